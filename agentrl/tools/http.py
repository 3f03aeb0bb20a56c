"""The tool clients' check of a service URL, made when a client is configured."""

from __future__ import annotations

import httpx


def http_url(url: str, what: str) -> str:
    """`url` when a client can send to it (http or https, a host, a numeric port); otherwise a ValueError
    naming `what`, at configuration time rather than as an exception out of a later `call`."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"{what}: {url!r} is not a valid URL ({e}); expected e.g. http://127.0.0.1:8000") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{what}: {url!r} needs an http:// or https:// scheme and a host, e.g. http://127.0.0.1:8000")
    return url
