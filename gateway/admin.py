"""The admin listener: health, readiness, metrics and the operator API.

The operator API needs `Authorization: Bearer <admin.token>` (compared in constant
time); with no token configured it is off and says so. A key is addressed by route
and key (URL-encoded); a scoped route's records are addressed by their `digest`
(from a listing) with `?digest=`.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.config import Route as RouteConfig
from gateway.config import parse_duration
from gateway.engine import NEVER_STORED, REPLAY_HEADERS
from gateway.errors import PROBLEM_BASE, StoreError
from gateway.keys import record_digest
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.upstream import HOP_BY_HOP

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.admin")

LISTABLE = {
    "in_flight": State.IN_FLIGHT,
    "unresolved": State.UNRESOLVED,
    "parked": State.PARKED,
    "claimed": State.CLAIMED,
}


#: RFC 9110 5.6.2: a header name is a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A header value an operator may give: visible ASCII, space and tab. RFC 9110 5.5
#: also allows obs-text (bytes 0x80-0xFF), but clients disagree on what it means.
_VALUE = re.compile(r"[\t\x20-\x7e]*")
_RESPONSE_FIELDS = ("status", "headers", "body")
_MAX_HEADERS = 100
#: A request body of the operator API, but resolve's: a name, a note, a flag.
_MAX_ADMIN_BODY = 64 * 1024
#: For a record whose route a reload removed: the declared default of a route's
#: max_stored_body (read from the model, not a made-up route that has to validate).
_DEFAULT_MAX_STORED_BODY = int(
    next(f.default for f in dataclasses.fields(RouteConfig) if f.name == "max_stored_body")  # type: ignore[arg-type]
)


def problem(status: int, slug: str, title: str, detail: str = "", **extra: Any) -> Response:
    doc = {"type": PROBLEM_BASE + slug, "title": title, "status": status, **extra}
    if detail:
        doc["detail"] = detail
    return Response(json.dumps(doc), status_code=status, media_type="application/problem+json")


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def create_admin_app(gateway: Gateway) -> Starlette:
    if not gateway.config.admin.token:
        log.warning(
            "admin.token is not set: the operator API is disabled (metrics and health stay on)"
        )

    def authorize(request: Request) -> None:
        token = gateway.config.admin.token  # read each time: a reload may change it
        if not token:
            raise _Refused(
                problem(
                    404,
                    "operator-api-disabled",
                    "The operator API is disabled",
                    "Set admin.token in the config to enable it.",
                )
            )
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        # A token in the query string is never accepted: it would end up in logs.
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.encode(), token.encode()):
            raise _Refused(
                problem(
                    401,
                    "unauthorized",
                    "A valid admin token is required",
                    "Send Authorization: Bearer <admin.token>.",
                )
            )

    async def record_for(request: Request) -> tuple[KeyRef, Record]:
        route_name = request.path_params["route"]
        key = request.path_params["key"]
        route = next((r for r in gateway.config.routes if r.name == route_name), None)
        digest = request.query_params.get("digest")
        if digest is None:
            if route is not None and route.key is not None and route.key.scope:
                raise _Refused(
                    problem(
                        400,
                        "digest-required",
                        "This route's keys are scoped per client",
                        "Address the record with ?digest=<digest> from the listing.",
                        route=route_name,
                        key=key,
                    )
                )
            digest = record_digest(route_name, "", key)
        record = await gateway.store.get(KeyRef(digest, route_name, key))
        if record is None or record.route != route_name or record.key != key:
            raise _Refused(
                problem(
                    404,
                    "unknown-key",
                    "No record for this route and key",
                    route=route_name,
                    key=key,
                )
            )
        return KeyRef(digest, route_name, key), record

    def handler(fn: Any) -> Any:
        async def wrapped(request: Request) -> Response:
            try:
                authorize(request)
                return await fn(request)  # type: ignore[no-any-return]
            except _Refused as refused:
                return refused.response
            except StoreError as exc:
                return problem(
                    503, "store-unavailable", "The idempotency store is unavailable", str(exc)
                )

        return wrapped

    async def list_keys(request: Request) -> Response:
        wanted = request.query_params.get("state", "unresolved,parked,claimed")
        states: set[State] = set()
        for name in wanted.split(","):
            if name not in LISTABLE:
                return problem(
                    400,
                    "bad-request",
                    "Unknown state",
                    f"state is one or more of {', '.join(LISTABLE)}",
                )
            states.add(LISTABLE[name])
        older_than = 0.0
        if "older_than" in request.query_params:
            try:
                older_than = parse_duration(request.query_params["older_than"])
            except ValueError as exc:
                return problem(400, "bad-request", "older_than is not a duration", str(exc))
        route = request.query_params.get("route")
        records = await gateway.store.open_records(frozenset(states))
        rows = [
            _summary(r)
            for r in sorted(records, key=lambda r: r.since_ms or r.created_ms)
            if (route is None or r.route == route) and r.state_age >= older_than
        ]
        return JSONResponse({"keys": rows, "count": len(rows)})

    async def show_key(request: Request) -> Response:
        _, record = await record_for(request)
        return JSONResponse(record.to_json())

    async def claim_key(request: Request) -> Response:
        body = await _json_body(request, _MAX_ADMIN_BODY)
        operator = _operator(body)
        ref, _ = await record_for(request)
        result = await gateway.store.operator_claim(ref, operator, bool(body.get("force", False)))
        if not result.ok:
            return _refusal(result, ref)
        gateway.metrics.operator_actions.labels("claim").inc()
        log.info("operator %s claimed %s key %r", operator, ref.route, ref.key)
        record = await gateway.store.get(ref)
        return JSONResponse(record.to_json() if record else {"state": result.state})

    async def resolve_key(request: Request) -> Response:
        name = request.path_params["route"]
        route = next((r for r in gateway.config.routes if r.name == name), None)
        ttl = route.response_ttl if route is not None else 86400.0
        max_body = route.max_stored_body if route is not None else _DEFAULT_MAX_STORED_BODY
        # Room for the response body written as JSON text at its most escaped (\u0000).
        body = await _json_body(request, 6 * max_body + _MAX_ADMIN_BODY)
        operator = _operator(body)
        outcome = body.get("outcome")
        if outcome not in ("done", "retry"):
            raise _Refused(problem(400, "bad-request", 'outcome must be "done" or "retry"'))
        given = body.get("response") if outcome == "done" else None
        if given is not None:
            _check_response(given, max_body, name)
        ref, record = await record_for(request)
        response = _operator_response(given, record, operator) if outcome == "done" else None
        result = await gateway.store.operator_resolve(
            ref, operator, outcome, str(body.get("note", "")), response, ttl
        )
        if not result.ok:
            return _refusal(result, ref)
        gateway.metrics.operator_actions.labels(f"resolve_{outcome}").inc()
        log.info("operator %s resolved %s key %r: %s", operator, ref.route, ref.key, outcome)
        after = await gateway.store.get(ref)
        return JSONResponse(after.to_json() if after else {"state": result.state})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        checks = {"config": "loaded", "store": "ok"}
        doc: dict[str, Any] = {"checks": checks}
        status = 200
        if not gateway.started:
            checks["store"] = "not started"
            status = 503
        else:
            try:
                await gateway.store.ping()
                info = await gateway.store.info()
            except StoreError as exc:
                checks["store"] = str(exc)
                status = 503
            else:
                gateway.metrics.set_store_info(info)
                doc["store"] = {"maxmemory_policy": info.maxmemory_policy, "aof": info.aof}
                refusal = info.refusal(gateway.config.store.allow_eviction)
                allowed = "allowed by store.allow_eviction" if info.evicts else "ok"
                checks["store_eviction"] = refusal or allowed
                if refusal:
                    status = 503
        return JSONResponse({"ready": status == 200, **doc}, status_code=status)

    async def metrics(request: Request) -> Response:
        await gateway.refresh_key_metrics()
        try:
            gateway.metrics.set_store_info(await gateway.store.info())
        except StoreError:
            pass  # store_up says so
        registry = gateway.metrics.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # Workers of one gateway: add up every worker's samples.
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/admin/keys", handler(list_keys)),
            Route("/admin/keys/{route}/{key:path}/claim", handler(claim_key), methods=["POST"]),
            Route("/admin/keys/{route}/{key:path}/resolve", handler(resolve_key), methods=["POST"]),
            Route("/admin/keys/{route}/{key:path}", handler(show_key)),
        ]
    )


def _summary(record: Record) -> dict[str, Any]:
    return {
        "route": record.route,
        "key": record.key,
        "digest": record.digest,
        "state": str(record.state),
        "age_seconds": round(record.age, 3),
        "state_age_seconds": round(record.state_age, 3),
        "run_id": record.run_id,
        "reason": record.reason,
        "last_reconcile": record.reconcile or None,
        "holder": record.holder or None,
        "holder_since_ms": record.holder_since_ms or None,
    }


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    too_large = _Refused(
        problem(413, "request-too-large", f"The request body is over {limit} bytes")
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError:
        raise _Refused(problem(400, "bad-request", "The body must be a JSON object")) from None
    if not isinstance(body, dict):
        raise _Refused(problem(400, "bad-request", "The body must be a JSON object"))
    return body


def _operator(body: dict[str, Any]) -> str:
    operator = body.get("operator")
    if not isinstance(operator, str) or not operator.strip():
        raise _Refused(problem(400, "bad-request", 'Say who you are: {"operator": "name"}'))
    return operator.strip()


def _bad_response(title: str, field: str, detail: str = "", **extra: Any) -> _Refused:
    return _Refused(problem(400, "bad-response", title, detail, field=field, **extra))


def _check_response(given: Any, max_body: int, route: str) -> None:
    """Refuse an operator's response that the gateway could not replay as given:
    repeats of the key get exactly it, for as long as the record lives."""
    shape = 'Give {"status": 200, "headers": {"Name": "value"}, "body": ...}.'
    if not isinstance(given, dict):
        raise _bad_response("response must be a JSON object", "response", shape)
    unknown = sorted(set(given) - set(_RESPONSE_FIELDS))
    if unknown:
        raise _bad_response(f"response has an unknown field: {unknown[0]}", "response", shape)
    status = given.get("status", 200)
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise _bad_response(
            "response.status must be a whole number from 200 to 599",
            "response.status",
            "A replay is a final response: 1xx ones are interim and never end an exchange.",
        )
    headers = given.get("headers", {})
    if headers is None:
        headers = {}
    if not isinstance(headers, dict):
        raise _bad_response(
            "response.headers must be a JSON object of names and values", "response.headers"
        )
    if len(headers) > _MAX_HEADERS:
        raise _bad_response(f"response.headers has over {_MAX_HEADERS} headers", "response.headers")
    for name, value in headers.items():
        _check_header(name, value)
    body = given.get("body", "")
    raw = _body_bytes(body)
    if len(raw) > max_body:
        raise _bad_response(
            f"response.body is over {max_body} bytes",
            "response.body",
            f"Route {route} stores and replays bodies up to {max_body} bytes "
            "(its max_stored_body).",
        )
    if raw and status in (204, 304):
        raise _bad_response(f"response.body must be empty for status {status}", "response.body")


def _check_header(name: str, value: Any) -> None:
    field = f"response.headers.{name}"
    if not _TOKEN.fullmatch(name):
        raise _bad_response(
            f"response.headers: {name!r} is not a header name",
            field,
            "A header name is letters, digits and !#$%&'*+-.^_`|~ (an RFC 9110 token).",
        )
    lowered = name.lower()
    refusal = ""
    if lowered == "content-length":
        refusal = "the gateway sets Content-Length itself"
    elif lowered == "transfer-encoding":
        refusal = "the gateway frames the replay itself: no Transfer-Encoding"
    elif lowered in HOP_BY_HOP:
        refusal = f"{name} is a hop-by-hop header, not part of a stored response"
    elif lowered in NEVER_STORED:
        refusal = f"a stored response never carries {name}: every repeat would get it"
    elif lowered in REPLAY_HEADERS:
        refusal = f"the gateway sets {name} itself on replays"
    if refusal:
        raise _bad_response(f"response.headers: {refusal}", field)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad_response(f"response.headers: the value of {name} must be text", field)
    if not _VALUE.fullmatch(str(value)):
        raise _bad_response(
            f"response.headers: the value of {name} has a character a header cannot carry",
            field,
            "Header values are printable ASCII, spaces and tabs: no CR, LF, NUL or other "
            "control characters.",
        )


def _body_bytes(body: Any) -> bytes:
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()


def _operator_response(given: Any, record: Record, operator: str) -> StoredResponse:
    """What repeats of the key get once an operator said it is done: the response
    they gave (checked by _check_response), or a 2xx that says an operator resolved it."""
    if isinstance(given, dict):
        body = given.get("body", "")
        headers = tuple(
            (name.lower(), str(value).strip(" \t"))
            for name, value in (given.get("headers") or {}).items()
        )
        if not any(name == "content-type" for name, _ in headers) and not isinstance(body, str):
            headers = (*headers, ("content-type", "application/json"))
        status = given.get("status", 200)
        return StoredResponse(status, headers, _body_bytes(body), origin="operator")
    doc = {
        "status": "completed",
        "resolved_by": operator,
        "key": record.key,
        "detail": "The first request's outcome was unknown; an operator checked and marked "
        "it done. It was not run again.",
    }
    return StoredResponse(
        200, (("content-type", "application/json"),), json.dumps(doc).encode(), origin="operator"
    )


def _refusal(result: Any, ref: KeyRef) -> Response:
    if result.refused == "missing":
        return problem(
            404, "unknown-key", "No record for this route and key", route=ref.route, key=ref.key
        )
    if result.refused == "held":
        return problem(
            409,
            "held-by-another-operator",
            "Another operator holds this key",
            f"{result.holder} holds it since {result.holder_since_ms} (ms since epoch). "
            'Send "force": true to take it over; the takeover is recorded.',
            holder=result.holder,
            holder_since_ms=result.holder_since_ms,
            route=ref.route,
            key=ref.key,
        )
    if result.refused == "holder":
        return problem(
            409,
            "not-the-holder",
            "Only the operator holding this key may resolve it",
            f"{result.holder} holds it; claim it first.",
            holder=result.holder,
            route=ref.route,
            key=ref.key,
        )
    return problem(
        409,
        "invalid-transition",
        "That is not a legal move for this key now",
        f"The key is {result.state}.",
        state=result.state,
        route=ref.route,
        key=ref.key,
    )
