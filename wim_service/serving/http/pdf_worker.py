"""The PDF worker: reads one PDF from stdin and writes its text, or why not, to stdout as JSON.

Run by `serving/http/pdf.py` as
`python -m wim_service.serving.http.pdf_worker PAGES CHARS MEMORY CPU`, one process per upload,
so that the router can kill it. It imports only the standard library and pypdf: every worker
pays its own start-up.

It bounds itself before it reads a byte: address space (`MEMORY` bytes; pypdf's allocations
past it raise `MemoryError`), CPU seconds (`CPU`; a worker whose router died without killing
it stops there) and no core file (the CPU limit's signal would write one). Its answer is
`{"text", "pages"}`, or `{"refused": <Refusal>, "pages"}`; a worker that dies without one is
read as `unreadable` by the router.
"""

from __future__ import annotations

import io
import json
import resource
import sys
from enum import StrEnum
from typing import Any


class Refusal(StrEnum):
    UNREADABLE = "unreadable"  # pypdf failed: anything it raised
    PAGES = "pages"  # more pages than the cap
    CHARS = "chars"  # more text than the cap
    MEMORY = "memory"  # the address-space limit was reached


def _limit(kind: int, value: int) -> None:
    """Lower both the soft and the hard limit, so that nothing in this process raises it."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def extract(data: bytes, max_pages: int, max_chars: int) -> dict[str, Any]:
    from pypdf import PdfReader
    from pypdf.generic import DictionaryObject

    try:
        reader = PdfReader(io.BytesIO(data))
        # The page count the document declares costs nothing to read; a document that claims
        # too many is refused before its page tree is walked (seconds for 20,000 pages).
        tree = reader.root_object["/Pages"]
        declared = tree["/Count"] if isinstance(tree, DictionaryObject) and "/Count" in tree else 0
        if isinstance(declared, int) and declared > max_pages:
            return {"refused": Refusal.PAGES, "pages": declared}
        pages = len(reader.pages)  # the pages that are there, whatever /Count says
        if pages > max_pages:
            return {"refused": Refusal.PAGES, "pages": pages}
        texts: list[str] = []
        length = 0
        for page in reader.pages:
            texts.append((page.extract_text() or "").strip())
            # The joined text holds every page's text whole: past the cap already, stop.
            length += len(texts[-1])
            if length > max_chars:
                return {"refused": Refusal.CHARS, "pages": pages}
    except MemoryError:
        return {"refused": Refusal.MEMORY, "pages": 0}
    except Exception:  # whatever pypdf raises on a hostile file: the router says only "unreadable"
        return {"refused": Refusal.UNREADABLE, "pages": 0}
    text = "\n\n".join(texts).strip()
    if len(text) > max_chars:
        return {"refused": Refusal.CHARS, "pages": pages}
    return {"text": text, "pages": pages}


def main(argv: list[str]) -> None:
    max_pages, max_chars, memory_bytes, cpu_s = (int(arg) for arg in argv)
    _limit(resource.RLIMIT_AS, memory_bytes)
    _limit(resource.RLIMIT_CPU, cpu_s)
    _limit(resource.RLIMIT_CORE, 0)
    answer = extract(sys.stdin.buffer.read(), max_pages, max_chars)
    # A broken font map can give lone surrogates, which UTF-8 cannot carry: "?" stands in.
    sys.stdout.buffer.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "replace"))


if __name__ == "__main__":
    main(sys.argv[1:])
