"""What an async route (delivery: async) keeps and answers when it accepts a request:
the request as each attempt will send it (`stored_request`), its run id and status
token (`delivery_ids`), and the 202 that names its status URL (`accepted_reply`,
`status_url`; gateway/proxy/status.py answers that URL).
"""

from __future__ import annotations

import base64
import functools
import os
from json.encoder import encode_basestring_ascii as _json_text
from urllib.parse import quote

from gateway.config import Route
from gateway.engine.outbound import Origin
from gateway.engine.refusals import accepted_unconfirmed
from gateway.engine.settlement import Reply
from gateway.headers import forwarded_headers
from gateway.keying import RequestParts
from gateway.records import KeyRef, StoredRequest


def stored_request(route: Route, parts: RequestParts, origin: Origin) -> StoredRequest:
    """The request as the upstream will get it at each attempt, minus what is never
    stored: delivery.drop_headers and the key header (added again from the key)."""
    drop = never_stored(route.delivery.drop_headers, route.forward_key_header)
    headers = forwarded_headers(parts.headers, origin.client, origin.scheme, origin.proxies)
    # The names are lower-case already (RequestParts' and forwarded_headers' own lines).
    kept = tuple([(n, v) for n, v in headers if n not in drop])
    target = parts.path + ("?" + parts.query if parts.query else "")
    return StoredRequest(parts.method, target, kept, parts.body)


@functools.lru_cache(maxsize=256)
def never_stored(drop_headers: frozenset[str], key_header: str | None) -> frozenset[str]:
    """The lower-case names an async route never stores, built once per route setting
    (drop_headers are lower-case from the config; the key header may be any case)."""
    return (drop_headers | {key_header.lower()}) if key_header else drop_headers


def delivery_ids() -> tuple[str, str]:
    """An accept's run id (64 bits in hex, as `secrets.token_hex(8)` gives a sync run)
    and its status token (128 bits, spelled as `secrets.token_urlsafe(16)`), from one
    read of the system's CSPRNG instead of two."""
    drawn = os.urandom(24)
    return drawn[:8].hex(), base64.urlsafe_b64encode(drawn[8:]).rstrip(b"=").decode()


def accepted_reply(
    prefix: str, route: Route, ref: KeyRef, state: str, token: str, outcome: str
) -> Reply:
    """202 with the small body a client polls by: its status URL, also in Location.
    `outcome` as counted: "accepted", "replayed" (a repeat: Idempotent-Replayed), or
    "accepted_unconfirmed" (the store's replicas did not confirm it: the same 202 and
    URL, as problem+json that says so, AcceptedUnconfirmed)."""
    url = status_url(prefix, route.name, ref.digest, token)
    if outcome == "accepted_unconfirmed":
        _, raw, payload = accepted_unconfirmed(route, ref, url).render()
        fields = [(n.decode(), v.decode()) for n, v in raw if n != b"content-length"]
        return Reply(202, tuple(fields), payload)
    # json.dumps({"route": ..., "key": ..., "state": ..., "status_url": ...}), spelled
    # out: each value through json's own string encoder, without building a dict and
    # an encoder per 202 (test_status_url checks the two agree).
    body = (
        f'{{"route": {_json_text(route.name)}, "key": {_json_text(ref.key)}, '
        f'"state": {_json_text(state)}, "status_url": {_json_text(url)}}}'
    )
    headers = [
        ("content-type", "application/json"),
        ("location", url),
        ("cache-control", "no-store"),
    ]
    if outcome == "replayed":
        headers.append(("idempotent-replayed", "true"))
    return Reply(202, tuple(headers), body.encode())


def status_url(prefix: str, route: str, digest: str, token: str) -> str:
    """The path a 202 names in `Location`; the route is one percent-encoded segment."""
    return f"{prefix}/status/{quote(route, safe='')}/{digest}/{token}"
