"""A `RequestParts` for key and fingerprint tests, with defaults for what a test leaves out."""

from __future__ import annotations

from gateway.keying import RequestParts


def req(
    *,
    method: str = "POST",
    path: str = "/jobs/run",
    query: str = "",
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    params: dict[str, str] | None = None,
) -> RequestParts:
    return RequestParts(method, path, query, headers or [], body, params or {})
