"""`check-config`'s summary of a loaded config: stable, and never shows secrets."""

from __future__ import annotations

from gateway.config.addresses import mask_url, reconcile_url_warning
from gateway.config.admin import AdminConfig
from gateway.config.keys import KeySource, KeySpec
from gateway.config.model import Config
from gateway.config.routes import Route
from gateway.config.store import MEMORY_KEEPS_NOTHING, StoreConfig, is_default_store
from gateway.config.text import show
from gateway.config.units import format_duration, format_rate, format_size, format_statuses
from gateway.encryption import key_id
from gateway.errors import ConfigIssue


def _store_where(store: StoreConfig) -> str:
    def nodes(items: tuple[tuple[str, int], ...]) -> str:
        return ", ".join(f"{host}:{port}" for host, port in items)

    if store.kind == "sentinel":
        return f"sentinel master {show(store.sentinel_master)} via {nodes(store.sentinel_nodes)}"
    if store.kind == "cluster":
        return f"cluster via {nodes(store.cluster_nodes)}"
    return mask_url(store.url)


def _describe_store(store: StoreConfig, source: str) -> str:
    if store.kind == "sqlite":
        # One file, one connection per process: no prefix, pool or network settings.
        default = " (the default: no store.url)" if is_default_store(store, source) else ""
        return (
            f"store: {show(store.url)}{default}; synchronous {store.sqlite_synchronous}; "
            f"busy timeout {format_duration(store.socket_timeout)}"
        )
    if store.kind == "memory":
        return f"store: memory://; {MEMORY_KEEPS_NOTHING}"
    return (
        f"store: {_store_where(store)}; prefix {show(store.prefix)}; socket timeout "
        f"{format_duration(store.socket_timeout)}; connect timeout "
        f"{format_duration(store.connect_timeout)}; {store.pool_size} connections"
        + ("; password set" if store.password else "")
        + (f"; TLS{' (no verify)' if not store.tls.verify else ''}" if store.tls else "")
    )


def store_at_start(config: Config) -> str:
    """The store as `run` names it at start: a SQLite store's file and whether it is the
    default, and that memory:// keeps nothing."""
    store = config.store
    if store.kind == "sqlite":
        default = " (the default: no store.url)" if is_default_store(store, config.source) else ""
        return f"sqlite at {store.url.removeprefix('sqlite://')}{default}"
    if store.kind == "memory":
        return f"memory ({MEMORY_KEEPS_NOTHING})"
    return store.kind


def describe(config: Config) -> str:
    """A stable, human-readable summary for `check-config`; never shows secrets."""
    server, admin, store = config.server, config.admin, config.store
    lines = [
        f"config: {config.source}",
        f"server: listen {server.listen}; shutdown grace {format_duration(server.shutdown_grace)}"
        f"; max header size {format_size(server.max_header_bytes)}",
        f"server limits: header timeout {format_duration(server.header_timeout)}; body timeout "
        f"{format_duration(server.body_timeout)}; write timeout "
        f"{format_duration(server.write_timeout)}; keep-alive {format_duration(server.keep_alive)}"
        f"; {server.max_connections} connections; upstream keep-alive "
        f"{format_duration(server.upstream_keep_alive)}; buffered responses up to "
        f"{format_size(server.max_buffered_responses)}; {server.max_deliveries} deliveries at once",
        "trusted proxies: "
        + (", ".join(str(n) for n in server.trusted_proxies) or "none (X-Forwarded-* replaced)"),
        f"admin: listen {admin.listen}; {_describe_access(admin)}",
        _describe_store(store, config.source),
        f"encryption: {_describe_encryption(store)}",
        f"routes: {len(config.routes)}",
    ]
    for route in config.routes:
        lines.append("")
        lines.extend(_describe_route(route))
    return "\n".join(lines) + "\n"


def config_warnings(config: Config) -> list[ConfigIssue]:
    """What `check-config` accepts but warns about (and `run` logs): settings that work
    and yet leave some requests unprotected, each with what to write instead."""
    found: list[ConfigIssue] = []
    for i, route in enumerate(config.routes):
        if route.reconcile is not None and route.on_unknown_outcome == "reconcile":
            warning = reconcile_url_warning(route.reconcile.url)
            if warning:
                found.append(ConfigIssue(f"routes[{i}].reconcile.url", warning))
    return found


def _describe_access(admin: AdminConfig) -> str:
    """Who may use the operator API: names, roles and where each token is read from,
    never a token."""
    if not admin.token and not admin.operators:
        return "operator API disabled (no token, no operators)"
    parts = ["shared token set" if admin.token else "no shared token"]
    for op in admin.operators:
        source = f"${op.token_env}" if op.token_env else show(op.token_file)
        parts.append(f"{op.name} ({op.role}, token from {source})")
    if admin.identity_header:
        proxies = ", ".join(str(n) for n in admin.trusted_proxies)
        parts.append(f"identity header {admin.identity_header} believed from {proxies}")
    if admin.session_secret_env:
        parts.append(f"console sessions signed with ${admin.session_secret_env}")
    if admin.show_headers:
        parts.append("stored headers also show " + ", ".join(sorted(admin.show_headers)))
    if admin.show_query:
        parts.append("stored queries also show " + ", ".join(sorted(admin.show_query)))
    return "operator API: " + "; ".join(parts)


def _describe_encryption(store: StoreConfig) -> str:
    """Key ids only: they name a key without revealing it."""
    old = ", ".join(key_id(k).hex() for k in store.previous_encryption_keys)
    reads = f"; also reads key id(s) {old}" if old else ""
    if store.encryption_key:
        return (
            f"AES-256-GCM, new responses sealed with key id {key_id(store.encryption_key).hex()}"
            + reads
        )
    if old:
        return f"off for new responses{reads}"
    return "off (responses stored unencrypted)"


def _describe_route(route: Route) -> list[str]:
    methods = ", ".join(sorted(route.methods)) if route.methods is not None else "any method"
    fmt = format_duration
    rows: list[tuple[str, str]] = [
        ("match", f"{methods} {route.path}"),
        ("upstream", mask_url(route.upstream)),
        ("key", _describe_key(route.key)),
    ]
    if route.key is not None:
        spec = route.key
        details = [f"on missing key: {spec.on_missing}", f"max length {spec.max_length}"]
        if spec.period is not None:
            details.append(
                f"period {spec.period.text or spec.period.count} in {spec.period.timezone}"
            )
        if spec.scope:
            details.append("scoped by " + ", ".join(spec.scope))
        rows.append(("key options", "; ".join(details)))
        rows.append(("fingerprint", ", ".join(route.fingerprint) or "none"))
    concurrent: str = route.concurrent
    if route.concurrent == "wait":
        concurrent += f" (up to {fmt(route.wait_timeout)})"
    rows += [
        ("concurrent", concurrent),
        (
            "timeouts",
            f"upstream {fmt(route.upstream_timeout)}; keep responses {fmt(route.response_ttl)}",
        ),
        ("cache statuses", answer_rule(route)),
        (
            "body limits",
            f"request {format_size(route.max_request_body)}; "
            f"stored {format_size(route.max_stored_body)}; "
            f"read {format_size(route.max_response_body)}",
        ),
        ("unknown outcome", route.on_unknown_outcome),
    ]
    if route.reconcile is not None:
        rec = route.reconcile
        rows.append(
            (
                "reconcile",
                f"{rec.method} {mask_url(rec.url)}; done {format_statuses(rec.done)}; not done "
                f"{format_statuses(rec.not_done)}; timeout {fmt(rec.timeout)}; every "
                f"{fmt(rec.every)}; park after {fmt(rec.park_after)}; {rec.concurrency} "
                "at once per process",
            )
        )
    if route.delivery.mode == "async":
        dl, retry = route.delivery, route.retry
        rows.append(
            (
                "delivery",
                f"async: 202 at once; {dl.concurrency} at a time per process; up to "
                f"{dl.max_queued} queued; never stored: "
                + (", ".join(sorted(dl.drop_headers)) or "none"),
            )
        )
        asked = " or ".join(h for h in (dl.delay_header, dl.not_before_header) if h)
        rows.append(
            (
                "first attempt",
                ("at once" if not dl.delay else f"{fmt(dl.delay)} after acceptance")
                + (f", or as {asked} asks" if asked else "")
                + f"; at most {fmt(dl.max_delay)} later",
            )
        )
        if dl.pause_after:
            rows.append(
                (
                    "pause",
                    f"after {dl.pause_after} refused attempts in a row; then one probe every "
                    f"{fmt(dl.probe_every)} until one is answered",
                )
            )
        if dl.rate is not None:
            shared = f", shared by rate_group {dl.rate_group}" if dl.rate_group else ""
            rows.append(
                (
                    "rate",
                    f"at most {format_rate(dl.rate)} over every replica, burst {dl.burst}"
                    f"{shared}; reconcile checks count too",
                )
            )
        rows.append(
            (
                "retry",
                f"{retry.attempts} attempts; backoff {fmt(retry.backoff)} doubling, full "
                f"jitter, at most {fmt(retry.max_backoff)} (Retry-After wins); then parked",
            )
        )
    rows += [
        ("store errors", route.on_store_error),
        ("forward key as", route.forward_key_header or "(not forwarded)"),
        ("strip headers", ", ".join(sorted(route.strip_headers)) or "none"),
        ("sensitive keys", "yes (logs show a hash)" if route.sensitive_keys else "no"),
    ]
    width = max(len(label) for label, _ in rows) + 1
    return [f"route {route.name}", *(f"  {label + ':':<{width}} {text}" for label, text in rows)]


def _describe_key(spec: KeySpec | None) -> str:
    if spec is None:
        return "none (pass-through)"
    texts = [_describe_source(source) for source in spec.sources]
    return texts[0] if len(texts) == 1 else "first present of: " + "; ".join(texts)


def _describe_source(source: KeySource) -> str:
    if source.kind == "header":
        return f"header {source.name}"
    if source.kind == "query":
        return f"query parameter {source.name}"
    if source.kind == "body":
        return f"body {source.name} (JMESPath)"
    if source.kind == "template":
        return f"template {show(source.name)}"
    if source.kind == "hash":
        return "hash of " + ", ".join(source.parts)
    return "the period window alone"


def answer_rule(route: Route) -> str:
    """What the upstream's answer does to a key of `route` (the engine's `_conclude`):
    a status in cache_statuses completes it; any other, like a request never sent,
    lets the work run again."""
    cached = format_statuses(route.cache_statuses)
    if route.key is None:
        return f"{cached} (no key: every request passes through)"
    if route.delivery.mode == "async":
        return (
            f"{cached} complete the delivery; any other status, and a request never sent, "
            "are attempted again"
        )
    return (
        f"{cached} complete the key (replayed); any other status, and a request never "
        "sent, release it"
    )


def retry_schedule(route: Route, shown: int = 5) -> str:
    """The retry rule as the delays it allows: before attempt n, full jitter draws from
    0 to min(max_backoff, backoff x 2^(n-2)) (delivery.next_delay), Retry-After aside."""
    retry, fmt = route.retry, format_duration
    if retry.attempts == 1:
        return "1 attempt, no retry; then parked"
    bounds = []
    for n in range(2, min(retry.attempts, shown + 1) + 1):
        ceiling = min(retry.max_backoff, retry.backoff * 2.0 ** (n - 2))
        bounds.append(f"{n}: 0-{fmt(ceiling)}")
    more = ", ..." if retry.attempts > shown + 1 else ";"
    return (
        f"{retry.attempts} attempts; before attempt {', '.join(bounds)}{more} at most "
        f"{fmt(retry.max_backoff)} (full jitter; Retry-After wins); then parked"
    )


def delivery_mode(route: Route, max_deliveries: int) -> str:
    dl = route.delivery
    if dl.mode == "sync":
        return "sync: the caller waits for the upstream's answer"
    if max_deliveries == 0:
        return (
            f"async: 202 at once; up to {dl.max_queued} queued; this process never "
            "delivers (server.max_deliveries: 0): another replica must"
        )
    return (
        f"async: 202 at once, delivered by every process ({dl.concurrency} at a time each, "
        f"{max_deliveries} in all); up to {dl.max_queued} queued"
    )
