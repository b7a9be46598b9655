"""The admin listener: health, readiness, metrics and the operator API.

The operator API needs `Authorization: Bearer <admin.token>` (compared in constant
time); with no token configured it is off and says so. A key is addressed by route
and key (URL-encoded); a scoped route's records are addressed by their `digest`
(from a listing) with `?digest=`.

Each handler is a module-level function of the request, reading the gateway from
`request.app.state.gateway`. A refusal is raised as an `OperatorRefusal`
(gateway.errors) and drawn by `ProblemError.render`, the proxy's renderer too.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from gateway.admin_responses import check_response, operator_response
from gateway.config import Route as RouteConfig
from gateway.config import parse_duration
from gateway.console.site import create_console
from gateway.errors import (
    BadFilter,
    BadOutcome,
    DigestRequired,
    HeldByAnother,
    InvalidTransition,
    NotJsonObject,
    NotTheHolder,
    OperatorApiDisabled,
    OperatorBodyTooLarge,
    OperatorRefusal,
    OperatorRequired,
    ProblemError,
    StoreError,
    StoreUnavailable,
    Unauthorized,
    UnknownKey,
)
from gateway.keys import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store.base import OperatorResult

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.admin")

LISTABLE = {
    "in_flight": State.IN_FLIGHT,
    "unresolved": State.UNRESOLVED,
    "parked": State.PARKED,
    "claimed": State.CLAIMED,
    "queued": State.QUEUED,  # deliveries of async routes, from the due indexes
    "retrying": State.RETRYING,
}

#: A request body of the operator API, but resolve's: a name, a note, a flag.
_MAX_ADMIN_BODY = 64 * 1024


def _route_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(RouteConfig) if f.name == name)


#: For a record whose route a reload removed: a route's declared defaults (read from
#: the model, not a made-up route that has to validate).
_DEFAULT_MAX_STORED_BODY = int(_route_default("max_stored_body"))
_DEFAULT_RESPONSE_TTL = float(_route_default("response_ttl"))


def create_admin_app(gateway: Gateway) -> Starlette:
    if not gateway.config.admin.token:
        log.warning(
            "admin.token is not set: the operator API is disabled (metrics and health stay on)"
        )
    app = Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/admin/keys", list_keys),
            Route("/admin/keys/{route}/{key:path}/claim", claim_key, methods=["POST"]),
            Route("/admin/keys/{route}/{key:path}/resolve", resolve_key, methods=["POST"]),
            Route("/admin/keys/{route}/{key:path}", show_key),
            # The operator console (gateway/console/): HTML pages for people.
            Mount("/console", app=create_console(gateway)),
        ],
        exception_handlers={ProblemError: problem_response, StoreError: problem_response},
    )
    app.state.gateway = gateway
    return app


async def problem_response(request: Request, exc: Exception) -> Response:
    """A refusal (or a store that failed under an operator call) as problem+json,
    drawn by the same ProblemError.render as the proxy's answers."""
    if isinstance(exc, StoreError):
        exc = StoreUnavailable(str(exc))
    if not isinstance(exc, ProblemError):
        raise exc
    status, headers, payload = exc.render()
    return Response(
        payload,
        status_code=status,
        headers={name.decode("latin-1"): value.decode("latin-1") for name, value in headers},
    )


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def authorize(request: Request) -> Gateway:
    """The gateway, for a request that carries the admin token; otherwise a refusal."""
    gateway = gateway_of(request)
    token = gateway.config.admin.token  # read each time: a reload may change it
    if not token:
        raise OperatorApiDisabled("Set admin.token in the config to enable it.")
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    # A token in the query string is never accepted: it would end up in logs.
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.encode(), token.encode()):
        raise Unauthorized("Send Authorization: Bearer <admin.token>.")
    return gateway


# -- health, readiness, metrics: no token -----------------------------------------------


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gateway = gateway_of(request)
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
    gateway = gateway_of(request)
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


# -- the operator API: the token first, then the body, then the record ------------------


async def list_keys(request: Request) -> Response:
    gateway = authorize(request)
    wanted = request.query_params.get("state", "unresolved,parked,claimed")
    states: set[State] = set()
    for name in wanted.split(","):
        if name not in LISTABLE:
            raise BadFilter(
                f"Unknown state {name!r}: state is one or more of {', '.join(LISTABLE)}.",
                field="state",
            )
        states.add(LISTABLE[name])
    older_than = 0.0
    if "older_than" in request.query_params:
        try:
            older_than = parse_duration(request.query_params["older_than"])
        except ValueError as exc:
            raise BadFilter(f"older_than is not a duration: {exc}", field="older_than") from None
    route = request.query_params.get("route")
    records = await gateway.store.open_records(frozenset(states))
    rows = [
        summary(r)
        for r in sorted(records, key=lambda r: r.since_ms or r.created_ms)
        if (route is None or r.route == route) and r.state_age >= older_than
    ]
    return JSONResponse({"keys": rows, "count": len(rows)})


async def show_key(request: Request) -> Response:
    gateway = authorize(request)
    _, record = await record_for(gateway, request)
    return JSONResponse(record.to_json())


async def claim_key(request: Request) -> Response:
    gateway = authorize(request)
    body = await _json_body(request, _MAX_ADMIN_BODY)
    operator = _operator(body)
    ref, _ = await record_for(gateway, request)
    claimed = await gateway.store.operator_claim(ref, operator, bool(body.get("force", False)))
    if not claimed.ok:
        raise refusal(claimed, ref)
    gateway.metrics.operator_actions.labels("claim").inc()
    log.info("operator %s claimed %s key %r", operator, ref.route, ref.key)
    record = await gateway.store.get(ref)
    return JSONResponse(record.to_json() if record else {"state": claimed.state})


async def resolve_key(request: Request) -> Response:
    gateway = authorize(request)
    name = request.path_params["route"]
    route = next((r for r in gateway.config.routes if r.name == name), None)
    ttl = route.response_ttl if route is not None else _DEFAULT_RESPONSE_TTL
    max_body = route.max_stored_body if route is not None else _DEFAULT_MAX_STORED_BODY
    # Room for the response body written as JSON text at its most escaped (\u0000).
    body = await _json_body(request, 6 * max_body + _MAX_ADMIN_BODY)
    operator = _operator(body)
    outcome = body.get("outcome")
    if outcome not in ("done", "retry"):
        raise BadOutcome(
            "done: it ran, and repeats get the response given (or a 2xx saying so); "
            "retry: it did not run, and the next request runs it."
        )
    given = body.get("response") if outcome == "done" else None
    if given is not None:
        check_response(given, max_body, name)
    ref, record = await record_for(gateway, request)
    response = operator_response(given, record, operator) if outcome == "done" else None
    resolved = await gateway.store.operator_resolve(
        ref, operator, outcome, str(body.get("note", "")), response, ttl
    )
    if not resolved.ok:
        raise refusal(resolved, ref)
    gateway.metrics.operator_actions.labels(f"resolve_{outcome}").inc()
    log.info("operator %s resolved %s key %r: %s", operator, ref.route, ref.key, outcome)
    after = await gateway.store.get(ref)
    return JSONResponse(after.to_json() if after else {"state": resolved.state})


async def record_for(gateway: Gateway, request: Request) -> tuple[KeyRef, Record]:
    """The record the path (and `?digest=`) names, or UnknownKey."""
    route_name = request.path_params["route"]
    key = request.path_params["key"]
    route = next((r for r in gateway.config.routes if r.name == route_name), None)
    digest = request.query_params.get("digest")
    if digest is None:
        if route is not None and route.key is not None and route.key.scope:
            raise DigestRequired(
                "Address the record with ?digest=<digest> from the listing.",
                route=route_name,
                key=key,
            )
        digest = record_digest(route_name, "", key)
    record = await gateway.store.get(KeyRef(digest, route_name, key))
    # A digest is the caller's to give: it must be this route's and this key's record.
    if record is None or record.route != route_name or record.key != key:
        raise UnknownKey(route=route_name, key=key)
    return KeyRef(digest, route_name, key), record


def refusal(result: OperatorResult, ref: KeyRef) -> OperatorRefusal:
    """What the store's refusal of a claim or resolve means to the operator."""
    if result.refused == "missing":
        return UnknownKey(route=ref.route, key=ref.key)
    if result.refused == "held":
        return HeldByAnother(
            f"{result.holder} holds it since {result.holder_since_ms} (ms since epoch). "
            'Send "force": true to take it over; the takeover is recorded.',
            holder=result.holder,
            holder_since_ms=result.holder_since_ms,
            route=ref.route,
            key=ref.key,
        )
    if result.refused == "holder":
        return NotTheHolder(
            f"{result.holder} holds it; claim it first.",
            holder=result.holder,
            route=ref.route,
            key=ref.key,
        )
    return InvalidTransition(
        f"The key is {result.state}.", state=result.state, route=ref.route, key=ref.key
    )


def summary(record: Record) -> dict[str, Any]:
    """A listing's row: the fields of Record.to_json that fit on a line, every one
    present (null when unset), and its last check as `last_reconcile`."""
    doc = record.to_json()
    return {
        "route": doc["route"],
        "key": doc["key"],
        "digest": doc["digest"],
        "state": doc["state"],
        "age_seconds": doc["age_seconds"],
        "state_age_seconds": doc["state_age_seconds"],
        "run_id": doc["run_id"],
        "reason": doc.get("reason", ""),
        "last_reconcile": doc.get("reconcile"),
        "holder": doc.get("holder"),
        "holder_since_ms": doc.get("holder_since_ms") or None,
        # null on a key of a sync route
        "attempts": doc["delivery"]["attempts"] if "delivery" in doc else None,
        "next_attempt_ms": doc["delivery"]["next_attempt_ms"] if "delivery" in doc else None,
    }


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    too_large = OperatorBodyTooLarge(f"This call takes a body of at most {limit} bytes.")
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
        raise NotJsonObject("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise NotJsonObject("The body is valid JSON, but not an object.")
    return body


def _operator(body: dict[str, Any]) -> str:
    operator = body.get("operator")
    if not isinstance(operator, str) or not operator.strip():
        raise OperatorRequired(
            'Send {"operator": "your name"}: the record keeps who claimed and resolved it.'
        )
    return operator.strip()
