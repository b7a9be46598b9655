"""The `idempotency-gateway` command (also `python -m gateway`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

from gateway.admin import client as admin_client
from gateway.config import Config, StoreConfig, describe
from gateway.config.addresses import mask_url
from gateway.config.loading import load_config_warnings
from gateway.config.store import is_default_store
from gateway.config.summary import answer_rule, delivery_mode, retry_schedule
from gateway.digits import whole_number
from gateway.errors import ConfigError, ConfigIssue, ProblemError
from gateway.logs import setup_logging

log = logging.getLogger("gateway")


def _config_path(args: argparse.Namespace) -> str:
    path = args.config or os.environ.get("GATEWAY_CONFIG")
    if not path:
        raise SystemExit("error: give --config FILE or set GATEWAY_CONFIG")
    return str(path)


def _load(path: str) -> Config:
    return _load_warnings(path)[0]


def _load_warnings(path: str) -> tuple[Config, list[ConfigIssue]]:
    try:
        return load_config_warnings(path)
    except ConfigError as exc:
        print(f"{exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _run_loop(main: object) -> None:
    try:
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]


def cmd_run(args: argparse.Namespace) -> int:
    from gateway.serve import serve, supervise

    path = _config_path(args)
    config = _load(path)
    setup_logging(args.log_level, config.server.log_format, config.server.access_log)
    if config.store.kind == "postgres":
        refused = _postgres_refusal(config, path)
        if refused:
            print(f"error: {path}: {refused}", file=sys.stderr)
            return 1
    if config.store.kind == "sqlite":
        # Before any worker starts: the file is migrated once, and one the gateway
        # cannot use stops the start here with the fix.
        status, text = _sqlite_open(config)
        if status:
            print(f"error: {path}: {text}", file=sys.stderr)
            return 1
    if args.workers > 1:
        if config.store.kind == "memory":
            print(
                f"error: {path}: store.url is memory://, which lives inside one process; "
                f"{args.workers} workers would each have their own keys and run duplicates. "
                "Use a SQLite, Redis or PostgreSQL store, or --workers 1.",
                file=sys.stderr,
            )
            return 1
        return supervise(config, path, args.workers)
    _run_loop(serve(config, config_path=path))
    return 0


_NO_DRIVER = "a PostgreSQL store needs its driver: pip install 'idempotency-gateway[postgres]'"


def _postgres_refusal(config: Config, path: str) -> str:
    try:
        from gateway.store.postgres.schema import refusal
    except ImportError:
        return _NO_DRIVER
    return asyncio.run(refusal(config.store, path))


def _sqlite_open(config: Config) -> tuple[int, str]:
    """Open the SQLite store's file and apply its migrations: (0, what it did) or (1,
    why the file cannot be used, naming it and the fix)."""
    from gateway.store.sqlite.schema import SchemaError, open_file
    from gateway.store.sqlite.store import sqlite_path

    store = config.store
    file = sqlite_path(store.url)
    try:
        version = open_file(file, store.sqlite_synchronous, max(store.connect_timeout, 1.0))
    except SchemaError as exc:
        if is_default_store(store, config.source):
            return 1, (
                f"{exc}; it is the default store (no store.url): set store.url to a "
                "writable place, e.g. sqlite:///var/lib/idempotency-gateway/gateway.db"
            )
        return 1, str(exc)
    return 0, f"{file}: schema version {version}, up to date"


def cmd_store_migrate(args: argparse.Namespace) -> int:
    path = _config_path(args)
    config = _load(path)
    if config.store.kind == "sqlite":
        status, text = _sqlite_open(config)
        print(text if not status else f"error: {text}", file=sys.stderr if status else sys.stdout)
        return status
    if config.store.kind != "postgres":
        print(f"{path}: the store is {config.store.kind}, which has no schema; nothing to do")
        return 0
    try:
        from gateway.store.postgres.schema import migrate_store
    except ImportError:
        print(f"error: {_NO_DRIVER}", file=sys.stderr)
        return 1
    status, text = asyncio.run(migrate_store(config.store))
    print(text, file=sys.stderr if status else sys.stdout)
    return status


def _copy_side(url: str | None, config: Config | None, flag: str) -> StoreConfig:
    """The store one side of `store copy` names: its URL with the config's store
    settings (prefix, credentials, timeouts, TLS), or the config's store itself."""
    if url is None:
        if config is None:
            raise SystemExit(f"error: give {flag} URL, or --config FILE for that side")
        return config.store
    if config is None:
        return StoreConfig(url=url)
    # Only what the config wrote: a setting given at its default may be refused (an
    # empty sentinel block is an error), and the URL names the store instead.
    written = {
        f.name: getattr(config.store, f.name)
        for f in dataclasses.fields(config.store)
        if f.name not in _NOT_COPIED and getattr(config.store, f.name) != f.default
    }
    return StoreConfig(url=url, **written)


#: Settings of the config's store that name a store; a URL given names another.
_NOT_COPIED = frozenset({"url", "sentinel_master", "sentinel_nodes", "cluster_nodes"})


def cmd_store_copy(args: argparse.Namespace) -> int:
    config = _load(args.config) if args.config else None
    if args.source is None and args.destination is None:
        raise SystemExit("error: give --from URL, --to URL, or one of them and --config FILE")
    source = _copy_side(args.source, config, "--from")
    destination = _copy_side(args.destination, config, "--to")
    names = (_store_name(source), _store_name(destination))
    if names[0] == names[1] and source.prefix == destination.prefix:
        print(f"error: --from and --to are the same store ({names[0]})", file=sys.stderr)
        return 1
    if "memory" in (source.kind, destination.kind):
        print("error: memory:// lives inside one process: there is nothing to copy from "
              "or to", file=sys.stderr)  # fmt: skip
        return 1
    if destination.kind == "postgres":
        try:
            from gateway.store.postgres.schema import migrate_store
        except ImportError:
            print(f"error: {_NO_DRIVER}", file=sys.stderr)
            return 1
        status, text = asyncio.run(migrate_store(destination))
        if status:
            print(text, file=sys.stderr)
            return status
    return int(asyncio.run(_copy(source, destination, names)))


def _store_name(config: StoreConfig) -> str:
    """A store as a message names it: its URL without a password."""
    if config.kind in ("sentinel", "cluster"):
        nodes = config.sentinel_nodes or config.cluster_nodes
        return f"{config.kind} " + ",".join(f"{host}:{port}" for host, port in nodes)
    return mask_url(config.url)


async def _copy(
    source_config: StoreConfig, destination_config: StoreConfig, names: tuple[str, str]
) -> int:
    from gateway.errors import CopyRefused, StoreError
    from gateway.store import open_store
    from gateway.store.copy import copy_records

    print(f"copying every record from {names[0]} to {names[1]}")
    opened = []
    try:
        source, destination = open_store(source_config), open_store(destination_config)
        for store, name in zip((source, destination), names, strict=True):
            await store.start()
            opened.append(store)
            try:
                await store.ping()
            except StoreError as exc:
                raise StoreError(f"cannot reach {name}: {exc}") from exc
        report = await copy_records(source, destination, destination_name=names[1])
    except (CopyRefused, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for store in opened:
            await store.close()
    print(f"copied {report.written} records")
    print(f"  {'route':24} {'state':12} {'source':>8} {'copied':>8}")
    for route, state in sorted(report.read.keys() | report.found.keys()):
        read, found = report.read[(route, state)], report.found[(route, state)]
        print(f"  {route:24} {state:12} {read:>8} {found:>8}")
    for route, (queued, retrying, queued_now, retrying_now) in sorted(report.queues.items()):
        print(
            f"  deliveries of {route}: {queued} queued and {retrying} retrying in the source, "
            f"{queued_now} and {retrying_now} in the destination"
        )
    if report.repeated:
        print(f"  {report.repeated} records read twice by the walk were written once")
    if report.mismatches:
        for line in report.mismatches:
            print(f"error: {line}", file=sys.stderr)
        print(
            f"error: the copy in {names[1]} does not match {names[0]}; keep the gateway on "
            "the source, empty the destination and copy again",
            file=sys.stderr,
        )
        return 1
    print(f"the counts match: point store.url at {names[1]} and start the gateway")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from gateway.serve import serve, worker_sockets

    config = _load(args.config)
    setup_logging(args.log_level, config.server.log_format, config.server.access_log)
    sockets, supervisor_fd = worker_sockets(args.fds)
    _run_loop(serve(config, config_path=args.config, sockets=sockets, supervisor_fd=supervisor_fd))
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    config, warnings = _load_warnings(args.file)
    print(describe(config))
    for issue in warnings:
        place = f"{args.file}:{issue.line}:{issue.column}" if issue.line else args.file
        print(f"{place}: warning: {issue}", file=sys.stderr)
    noted = f", {len(warnings)} warning(s)" if warnings else ""
    print(f"\n{args.file}: OK, {len(config.routes)} route(s){noted}")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from gateway.config.schema import schema_text

    sys.stdout.write(schema_text())
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from gateway.config.reference import reference_text

    sys.stdout.write(reference_text())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from gateway.keying import RequestParts, extract_key, fingerprint, record_digest, scope_value
    from gateway.routes import Router

    config = _load(_config_path(args))
    url = urlsplit(args.url)
    path = url.path or "/"
    method = args.method.upper()
    match = Router(config.routes).match(method, path)
    if match is None:
        print(f"no route matches {method} {path}: the gateway answers 404")
        return 1
    route = match.route
    print(f"route:       {route.name} (upstream {route.upstream})")
    print(f"delivery:    {delivery_mode(route, config.server.max_deliveries)}")
    if route.delivery.mode == "async":
        print(f"retry:       {retry_schedule(route)}")
    if route.key is not None:
        print(f"answers:     {answer_rule(route)}")
    if match.params:
        print(f"params:      {match.params}")
    headers: list[tuple[str, str]] = []
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            raise SystemExit(f"error: -H {item!r}: write 'Name: value'")
        headers.append((name.strip().lower(), value.strip()))
    body = (args.data or "").encode()
    parts = RequestParts(method, path, url.query, headers, body, match.params)
    if route.key is None:
        print("key:         none: the route has no key, requests pass through")
        return 0
    try:
        key = extract_key(route.key, parts, datetime.now(UTC))
    except ProblemError as exc:
        print(f"key:         none: {exc.status} {exc.title}: {exc.detail}")
        return 1
    if key is None:
        sources = ", ".join(f"{s.kind} {s.name}".strip() for s in route.key.sources)
        action = (
            "the gateway answers 400 (on_missing: reject)"
            if route.key.on_missing == "reject"
            else "forwarded without dedupe (on_missing: forward)"
        )
        print(f"key:         none found in: {sources}; {action}")
        return 1
    scope = scope_value(route.key, parts)
    print(f"key:         {key}")
    if scope:
        print(f"scope:       {scope[:16]}... (hash of {', '.join(route.key.scope)})")
    fp = fingerprint(route.fingerprint, parts)
    print(f"fingerprint: {fp or 'none'}" + (f" (of {', '.join(route.fingerprint)})" if fp else ""))
    digest = record_digest(route.name, scope, key)
    print(f"record:      {digest}")
    if route.delivery.mode == "async":
        status = f"{config.server.status_prefix}/status/{quote(route.name, safe='')}/{digest}"
        print(f"status url:  {status}/<token> (the token is in the 202's Location)")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from gateway.encryption import key_id, new_key, parse_key

    key = new_key()
    print(key)
    # The key alone on stdout, for `export KEY=$(... keygen)`; the rest on stderr.
    print(
        f"key id {key_id(parse_key(key)).hex()}. Keep the key in your secret store and pass "
        'it through the environment: store.encryption_key: "${GATEWAY_ENCRYPTION_KEY}". '
        "When rotating, move the old key to store.previous_encryption_keys.",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    setup_logging("INFO", "text")
    _run_loop(run_demo(args.port, args.admin_port, args.job_port))
    return 0


def _counted(low: int, high: int) -> Callable[[str], int]:
    """An argument that is a whole number from `low` to `high`, in ASCII digits."""

    def read(text: str) -> int:
        number = whole_number(text)
        if number is None or not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to {high}")
        return number

    return read


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idempotency-gateway",
        description="A reverse proxy that makes scheduled and retried HTTP jobs safe to run twice.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve the proxy and admin listeners")
    run.add_argument("--config", help="config file (default: $GATEWAY_CONFIG)")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument(
        "--workers",
        type=_counted(1, 1024),
        default=1,
        help="worker processes sharing the listeners (SQLite, Redis and PostgreSQL stores)",
    )
    run.set_defaults(func=cmd_run)

    worker = sub.add_parser("worker", help="(internal) one worker of `run --workers N`")
    worker.add_argument("--config", required=True)
    worker.add_argument("--fds", required=True)
    worker.add_argument("--log-level", default="INFO")
    worker.set_defaults(func=cmd_worker)

    check = sub.add_parser("check-config", help="validate a config and print its routes")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)

    schema = sub.add_parser(
        "config-schema",
        help="print the JSON Schema of the config file (for editors; docs/config.schema.json)",
    )
    schema.set_defaults(func=cmd_config_schema)

    reference = sub.add_parser(
        "config-reference",
        help="print the configuration reference in Markdown (docs/configuration.md)",
    )
    reference.set_defaults(func=cmd_config_reference)

    explain = sub.add_parser("explain", help="dry run: which route, key and fingerprint")
    explain.add_argument("--config", help="config file (default: $GATEWAY_CONFIG)")
    explain.add_argument("method")
    explain.add_argument("url", help="a URL or a path, e.g. /jobs/send-reminder?run=1")
    explain.add_argument("-H", "--header", action="append", default=[], help="'Name: value'")
    explain.add_argument("-d", "--data", help="the request body")
    explain.set_defaults(func=cmd_explain)

    keygen = sub.add_parser("keygen", help="print a new store.encryption_key")
    keygen.set_defaults(func=cmd_keygen)

    store = sub.add_parser("store", help="the store's schema (PostgreSQL), copying a store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    migrate = store_sub.add_parser(
        "migrate",
        help="create or upgrade the PostgreSQL store's schema (versioned; safe to repeat, "
        "and to run from two replicas at once)",
    )
    migrate.add_argument("--config", help="config file (default: $GATEWAY_CONFIG)")
    migrate.set_defaults(func=cmd_store_migrate)
    copy = store_sub.add_parser(
        "copy",
        help="copy every record from one store to an empty one, with the gateway stopped "
        "(SQLite, Redis, PostgreSQL, either way); checks the counts after",
    )
    copy.add_argument("--from", dest="source", metavar="URL", help="the store to copy")
    copy.add_argument("--to", dest="destination", metavar="URL", help="an empty store")
    copy.add_argument(
        "--config",
        help="config file: its store is the side --from or --to leaves out, and its store "
        "settings (prefix, credentials, TLS) apply to a URL given",
    )
    copy.set_defaults(func=cmd_store_copy)

    demo = sub.add_parser("demo", help="an example job endpoint behind the gateway, no Redis")
    port = _counted(1, 65535)
    demo.add_argument("--port", type=port, default=8080)
    demo.add_argument("--admin-port", type=port, default=9090)
    demo.add_argument("--job-port", type=port, default=5000)
    demo.set_defaults(func=cmd_demo)

    admin_client.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
