"""The status URL of an accepted (202) request: `{prefix}/status/{route}/{digest}/{token}`.

Whoever holds a 202's `Location` may read that delivery's state from any replica; the
token, sealed in the record, is what makes the URL unguessable.
"""

from __future__ import annotations

from urllib.parse import quote


def status_url(prefix: str, route: str, digest: str, token: str) -> str:
    """The path a 202 names in `Location`; the route is one percent-encoded segment."""
    return f"{prefix}/status/{quote(route, safe='')}/{digest}/{token}"
