"""The admin listener: health, readiness, metrics and the operator API's HTTP shapes.

Who may call the operator API is gateway/operators/identity.py's to say (named tokens, the
shared token, an identity header from a trusted proxy); what a call does is
gateway/operators/actions.py's, which the console calls too. A handler here reads the request
(path, query, a bounded JSON body), authenticates it, calls the action and answers
JSON. A key is addressed by route and key (URL-encoded); a scoped route's records
are addressed by their `digest` (from a listing) with `?digest=`.

Each handler is a module-level function of the request, reading the gateway from
`request.app.state.gateway`. A refusal is raised as an `OperatorRefusal`
(gateway.errors) and drawn by `ProblemError.render`, the proxy's renderer too. So is
everything else the listener answers outside the console: a path nothing serves
(404 `unknown-path`), a method the path does not take (405 `wrong-method`), an
exception no handler expected (500 `operator-call-failed`, the cause in the log),
and a request that is not HTTP (400 `not-http`, gateway/admin/listener.py): never
Starlette's or uvicorn's plain text.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

import yaml
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from gateway.console.site import create_console
from gateway.digits import whole_number
from gateway.errors import (
    BadFilter,
    BadOperatorRequest,
    NotJsonObject,
    OperatorBodyTooLarge,
    OperatorCallFailed,
    ProblemError,
    StoreError,
    StoreUnavailable,
    Unauthorized,
    UnknownPath,
    WrongMethod,
)
from gateway.operators import actions
from gateway.operators.identity import Operator, audit_sign_in
from gateway.records import KeyRef, Record, upstream_status
from gateway.store.pages import Match

if TYPE_CHECKING:
    from gateway.assembly import Gateway

log = logging.getLogger("gateway.admin")

#: The User-Agent the `keys` CLI sends (gateway/admin/client.py), so logs say "cli".
CLI_AGENT = "idempotency-gateway-cli"

#: What an operator call that the store failed under answers (why is in the log).
STORE_DOWN = (
    "The store did not answer, so nothing was read or changed. Retry shortly; the "
    "gateway's log says why."
)

#: A request body of the operator API, but resolve's: a name, a note, a flag.
_MAX_ADMIN_BODY = 64 * 1024


class AnyKey(Convertor[str]):
    """A key in a path: any text, line breaks too (Starlette's `path` stops at one, so
    a key with a newline would be a path nothing serves, not a key without a record)."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("key", AnyKey())


def create_admin_app(gateway: Gateway) -> Starlette:
    if not gateway.operators.enabled:
        log.warning(
            "neither admin.operators nor admin.token is set: the operator API is disabled "
            "(metrics and health stay on)"
        )
    app = Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/admin/openapi.json", openapi),
            Route("/admin/me", me),
            Route("/admin/overview", overview),
            Route("/admin/keys", list_keys),
            Route("/admin/bulk", bulk_count),
            Route("/admin/bulk", bulk_resolve, methods=["POST"]),
            Route("/admin/keys/{route}/{key:key}/claim", claim_key, methods=["POST"]),
            Route("/admin/keys/{route}/{key:key}/resolve", resolve_key, methods=["POST"]),
            Route("/admin/keys/{route}/{key:key}", show_key),
            # The same, the route and key in the query, where any key is one value
            # whatever it holds (`/`, `..`, `?`): a proxy in front that decodes and
            # resolves the path cannot turn it into another key's.
            Route("/admin/routes/{route}/pause", pause_route, methods=["POST"]),
            Route("/admin/routes/{route}/resume", resume_route, methods=["POST"]),
            Route("/admin/key", show_key),
            Route("/admin/key/claim", claim_key, methods=["POST"]),
            Route("/admin/key/resolve", resolve_key, methods=["POST"]),
            # The operator console (gateway/console/): HTML pages for people.
            Mount("/console", app=create_console(gateway)),
        ],
        exception_handlers={
            ProblemError: problem_response,
            StoreError: problem_response,
            HTTPException: unmatched,
            Exception: failed,
        },
    )
    app.state.gateway = gateway
    return app


async def problem_response(request: Request, exc: Exception) -> Response:
    """A refusal (or a store that failed under an operator call) as problem+json,
    drawn by the same ProblemError.render as the proxy's answers. A store's failure is
    said in the gateway's words: the driver's (addresses, errnos, the text it could
    not take) go to the log."""
    if isinstance(exc, StoreError):
        log.error("store failed under an operator call: %s", exc)
        exc = StoreUnavailable(STORE_DOWN)
    if not isinstance(exc, ProblemError):
        raise exc
    status, headers, payload = exc.render()
    return Response(
        payload,
        status_code=status,
        headers={name.decode("latin-1"): value.decode("latin-1") for name, value in headers},
    )


async def unmatched(request: Request, exc: Exception) -> Response:
    """What Starlette raises itself, as a problem: no route for the path (404), a
    method the route does not take (405, with Allow)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        refusal: ProblemError = WrongMethod(
            f"{request.method} is not one of the methods this path takes: {allow}.",
            headers={"Allow": allow},
        )
    elif exc.status_code == 404:
        refusal = UnknownPath(
            "The admin listener serves /healthz, /readyz, /metrics, the operator API under "
            "/admin/ (its document: /admin/openapi.json) and the console under /console/."
        )
    else:  # nothing else is raised on these routes; said as a refusal all the same
        refusal = BadOperatorRequest(str(exc.detail))
    return await problem_response(request, refusal)


async def failed(request: Request, exc: Exception) -> Response:
    """An exception no handler expected: a 500 in the gateway's words. The exception,
    with its traceback, is logged by the server it is raised on to (uvicorn)."""
    return await problem_response(
        request,
        OperatorCallFailed(
            "An unexpected error stopped this request; the gateway's log says which. It may "
            "have changed the key before it failed: read the key before repeating an action."
        ),
    )


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def authenticate(request: Request) -> tuple[Gateway, Operator]:
    """The gateway and the operator a request comes from; otherwise a refusal. The
    operators are the current config's: a reload that removes one refuses them."""
    gateway = gateway_of(request)
    client = request.client.host if request.client is not None else None
    try:
        return gateway, gateway.operators.authenticate(request.headers, client)
    except Unauthorized as exc:
        # A wrong or missing token is logged: the only trace of someone guessing.
        audit_sign_in(client_of(request), client, None, exc.slug, exc.detail or exc.title)
        raise


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
            log.warning("readiness: the store did not answer: %s", exc)
            checks["store"] = "unreachable: the gateway's log says why"
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
        gateway.metrics.set_store_info(await gateway.store_info.get())
    except StoreError:
        pass  # store_up says so
    registry = gateway.metrics.registry
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        # Workers of one gateway: add up every worker's samples.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# -- the operator API: who first, then the body, then the action ----------------------


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The operator API's OpenAPI 3.1 document: gateway/openapi.yaml, the one place
    it is written (package data)."""
    text = resources.files("gateway").joinpath("openapi.yaml").read_text(encoding="utf-8")
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


async def openapi(request: Request) -> Response:
    """The document, without a token: it says what the API does, not what it holds."""
    return JSONResponse(openapi_document())


async def me(request: Request) -> Response:
    """Who the credentials sent are: name, role, and how they were told."""
    _, operator = authenticate(request)
    return JSONResponse({"name": operator.name, "role": str(operator.role), "via": operator.via})


async def overview(request: Request) -> Response:
    gateway, _ = authenticate(request)
    return JSONResponse(await actions.overview(gateway))


async def list_keys(request: Request) -> Response:
    """One page (`limit`, 100 by default), the longest waiting first; `next_cursor`
    and `prev_cursor` walk on (null where the listing ends). `since`, `until`, `status`
    and `key_prefix` narrow it (the run log: a route's deliveries, completed ones
    included with state=completed)."""
    gateway, _ = authenticate(request)
    query = request.query_params
    states = actions.parse_states(query.get("state", "unresolved,parked,claimed"))
    older_than = actions.parse_age(query.get("older_than"))
    limit = actions.parse_limit(query.get("limit"))
    match = actions.parse_match(
        query.get("since"), query.get("until"), query.get("status"), query.get("key_prefix")
    )
    page = await actions.list_keys(
        gateway, states, query.get("route"), older_than, query.get("cursor", ""), limit, match
    )
    rows = [summary(r) for r in page.records]
    return JSONResponse(
        {
            "keys": rows,
            "count": len(rows),
            "next_cursor": page.next or None,
            "prev_cursor": page.prev or None,
        }
    )


async def show_key(request: Request) -> Response:
    gateway, _ = authenticate(request)
    record = await actions.show(gateway, _ref(gateway, request))
    doc = record.to_json()
    stored = await actions.stored_request(gateway, record)
    if stored is not None:
        doc["request"] = stored.to_json()
    return JSONResponse(doc)


async def claim_key(request: Request) -> Response:
    gateway, operator = authenticate(request)
    ref, client = _ref(gateway, request), client_of(request)
    actions.may(gateway, operator, "claim", ref, client)  # a viewer's: 403, whatever the body
    body = await _json_body(request, _MAX_ADMIN_BODY)
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise BadOperatorRequest("force is true or false.", field="force")
    named = body.get("operator")
    record = await actions.claim(gateway, operator, ref, force, client, given=named)
    return JSONResponse(record.to_json())


async def resolve_key(request: Request) -> Response:
    gateway, operator = authenticate(request)
    ref, client = _ref(gateway, request), client_of(request)
    actions.may(gateway, operator, "resolve", ref, client)
    _, max_body = actions.route_limits(gateway, ref.route)
    # Room for the response body written as JSON text at its most escaped (\u0000).
    body = await _json_body(request, 6 * max_body + _MAX_ADMIN_BODY)
    note, outcome = body.get("note"), body.get("outcome")
    record = await actions.resolve(
        gateway,
        operator,
        ref,
        outcome if isinstance(outcome, str) else "",  # anything else: BadOutcome
        "" if note is None else note,
        body.get("response"),
        client,
        given=body.get("operator"),
    )
    return JSONResponse(record.to_json())


def _bulk_filters(fields: Mapping[str, Any]) -> tuple[float, Match]:
    """A bulk action's filters (`older_than`, `status`, `reason`), as text; BadFilter
    for any that is not."""
    for name in ("older_than", "status", "reason", "route"):
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise BadFilter(f"{name} is text.", field=name)
    age = actions.parse_age(fields.get("older_than"))
    return age, actions.parse_match(None, None, fields.get("status"), None, fields.get("reason"))


async def bulk_count(request: Request) -> Response:
    """How many parked deliveries of `route` a bulk action with these filters takes now."""
    gateway, _ = authenticate(request)
    query = request.query_params
    age, match = _bulk_filters(query)
    count = await actions.bulk_count(gateway, query.get("route"), age, match)
    return JSONResponse({"route": query.get("route"), "count": count})


async def bulk_resolve(request: Request) -> Response:
    """Retry, or resolve done with a note, every parked delivery of a route matching the
    filters: how many were resolved, and how many changed meanwhile and were skipped."""
    gateway, operator = authenticate(request)
    body = await _json_body(request, _MAX_ADMIN_BODY)
    age, match = _bulk_filters(body)
    outcome, note = body.get("outcome"), body.get("note")
    done = await actions.bulk_resolve(
        gateway,
        operator,
        body.get("route"),
        outcome if isinstance(outcome, str) else "",
        "" if note is None else note,
        client_of(request),
        older_than=age,
        match=match,
        given=body.get("operator"),
    )
    return JSONResponse(done.to_json())


async def pause_route(request: Request) -> Response:
    """Pause an async route by hand: `{"why": "...", "operator": ...}`."""
    return await _pause(request, "pause")


async def resume_route(request: Request) -> Response:
    """Resume an async route, however it was paused: `{"why": "...", "operator": ...}`."""
    return await _pause(request, "resume")


async def _pause(request: Request, move: Literal["pause", "resume"]) -> Response:
    gateway, operator = authenticate(request)
    route, client = request.path_params["route"], client_of(request)
    actions.may(gateway, operator, f"{move}_route", KeyRef("", route, ""), client)
    body = await _json_body(request, _MAX_ADMIN_BODY)
    done = await actions.pause_route(
        gateway, operator, route, move, body.get("why"), client, given=body.get("operator")
    )
    return JSONResponse(done)


def _ref(gateway: Gateway, request: Request) -> KeyRef:
    """The key the path names, or (under /admin/key) the query's `route` and `key`."""
    params, query = request.path_params, request.query_params
    if "key" in params:
        return actions.locate(gateway, params["route"], params["key"], query.get("digest"))
    named = []
    for field in ("route", "key"):
        values = query.getlist(field)
        if len(values) != 1 or not values[0]:
            raise BadOperatorRequest(
                f"Give the {field} once, as ?{field}= in the query.", field=field
            )
        named.append(values[0])
    return actions.locate(gateway, named[0], named[1], query.get("digest"))


def client_of(request: Request) -> actions.Client:
    """Which client called: the `keys` CLI says so in its User-Agent; anything else is
    the API. (Said by the caller, so it is for the log, never for a decision.)"""
    agent = request.headers.get("user-agent", "")
    return "cli" if agent.startswith(CLI_AGENT) else "api"


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
        "upstream_status": upstream_status(record),
        # null on a key of a sync route
        "attempts": doc["delivery"]["attempts"] if "delivery" in doc else None,
        "next_attempt_ms": doc["delivery"]["next_attempt_ms"] if "delivery" in doc else None,
    }


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    # A body must say it is JSON. Behind a single-sign-on proxy the identity header is
    # added to whatever the signed-in browser sends, so another site's page could post
    # a form (text/plain, whose body can be JSON) or a no-cors fetch and act as the
    # operator; neither can send application/json without the server agreeing first.
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise NotJsonObject(
            f"Send the body as Content-Type: application/json (given: {media_type or 'none'})."
        )
    too_large = OperatorBodyTooLarge(f"This call takes a body of at most {limit} bytes.")
    declared = whole_number(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
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
    except RecursionError:
        raise NotJsonObject("The body nests deeper than the gateway reads JSON.") from None
    if not isinstance(body, dict):
        raise NotJsonObject("The body is valid JSON, but not an object.")
    return body
