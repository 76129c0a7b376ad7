"""The load test's address guard: traffic goes to this machine's loopback only.

Kept apart from the locustfile so that it can be imported without Locust (which patches the
standard library with gevent on import).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class NotLoopbackError(ValueError):
    """The target host is not a loopback address."""


def require_loopback(host: str | None) -> str:
    """Return `host` (a base URL) if it names a loopback address, else raise NotLoopbackError.

    Accepted: `localhost` and IP literals in 127.0.0.0/8 or ::1. Other names are refused
    without being resolved.
    """
    if not host:
        raise NotLoopbackError("no target host: pass --host http://127.0.0.1:8000")
    hostname = urlsplit(host).hostname if "//" in host else None
    if hostname is None:
        raise NotLoopbackError(f"{host!r} is not a base URL like http://127.0.0.1:8000")
    if hostname == "localhost":
        return host
    try:
        address = ipaddress.ip_address(hostname)
    except ValueError:
        raise NotLoopbackError(
            f"{hostname!r} is not loopback; names other than localhost are refused"
        ) from None
    if not address.is_loopback:
        raise NotLoopbackError(f"{hostname} is not a loopback address (127.0.0.0/8 or ::1)")
    return host
