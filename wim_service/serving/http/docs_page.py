"""`GET /docs`: Swagger UI over the app's OpenAPI schema, under a Content-Security-Policy.

Swagger UI's script and stylesheet come from a CDN (no installed package carries them). The
page's policy lets in exactly those two files and the page's own start-up script (by its
hash); its scripts may fetch from this origin only (the schema, and the calls "Try it out"
makes), load images from nowhere else, and the page may not be framed, post forms or change its
base URL. So a CDN that served something else could still not send what the page holds (an
API key typed into "Authorize") anywhere but this service. ReDoc (FastAPI's `/redoc`, more CDN
code: fonts, workers) is not served: one rendering of the schema is enough, and
`/openapi.json` serves it to any other viewer.
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"
# The page's one inline script (it starts Swagger UI); our own text, not a client's.
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _script_hash(script: str) -> str:
    digest = hashlib.sha256(script.encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def docs_page(openapi_url: str, title: str) -> HTMLResponse:
    """Swagger UI for the schema at `openapi_url`, with its Content-Security-Policy."""
    html = bytes(
        get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=SWAGGER_JS,
            swagger_css_url=SWAGGER_CSS,
            swagger_favicon_url="data:,",  # no third party's icon
        ).body
    ).decode()
    inline = " ".join(_script_hash(script) for script in _INLINE_SCRIPT.findall(html))
    policy = "; ".join(
        [
            "default-src 'none'",
            f"script-src {SWAGGER_JS} {inline}",
            # Swagger UI sets style attributes as it renders.
            f"style-src {SWAGGER_CSS} 'unsafe-inline'",
            "img-src 'self' data:",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    headers = {
        "Content-Security-Policy": policy,
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }
    return HTMLResponse(html, headers=headers)
