"""Logs: JSON lines (or text on a terminal), and one access-log line per request.

The access line says what the gateway did: route, key (a hash of it where the route
says keys are sensitive), outcome, run id, upstream status, duration. Never bodies,
tokens, Authorization headers or store passwords: nothing here reads them, and a
status URL's token is cut from the path (`access_path`).

The engine fills the request's `Trace` through a context variable, so the forward
task (which copies the context) writes to the same trace as the request. Access lines
are buffered and written every 0.5 s (serve.py), when 512 are waiting, and at exit:
a crash loses at most the last half second of them, never a record in the store.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TextIO

from gateway.records import DIGEST


@dataclass(slots=True)
class Trace:
    method: str
    path: str
    route: str = ""
    key: str = ""
    sensitive: bool = False
    outcome: str = ""
    run_id: str = ""
    upstream_status: int | None = None
    started: float = field(default_factory=time.perf_counter)


current_trace: ContextVar[Trace | None] = ContextVar("current_trace", default=None)


def access_path(path: str, status_prefix: str) -> str:
    """`path` as the access log shows it. A status URL shows its route and digest, and
    `***` for its token; any other path holding `{prefix}/` is `***` past it, so a token
    sent in the wrong place, or behind dot-segments, is not logged either."""
    at = path.find(status_prefix + "/")
    if at < 0:
        return path
    head = path[: at + len(status_prefix) + 1]
    parts = path[len(head) :].split("/")
    if len(parts) >= 3 and parts[0] == "status" and DIGEST.fullmatch(parts[2]):
        return f"{head}status/{parts[1]}/{parts[2]}/***"
    return head + "***"


def shown_key(key: str, sensitive: bool) -> str:
    """A key as log lines show it: a hash of it on routes with sensitive_keys."""
    if key and sensitive:
        return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return key


class AccessWriter:
    """Formats access lines straight into a buffer. Going through `logging` (a
    LogRecord, handler locks, a formatter) cost about 30% of replay throughput,
    measured; the lines are the same as the JSON/text formatters would write."""

    def __init__(self, stream: TextIO, as_json: bool) -> None:
        self.stream = stream
        self.as_json = as_json
        self.lines: list[str] = []

    def write(self, trace: Trace, status: int) -> None:
        key = shown_key(trace.key, trace.sensitive)
        duration = round((time.perf_counter() - trace.started) * 1000, 2)
        if self.as_json:
            # The line json.dumps would write for this dict, without building the dict
            # or running the encoder's machinery: a tenth of the first request's Python
            # time went to it (py-spy). test_access_log_line_is_json_dumps checks they
            # stay equal.
            upstream = trace.upstream_status
            line = (
                f'{{"ts": {round(time.time(), 3)}, "level": "info", '
                f'"logger": "gateway.access", "method": {_quote(trace.method)}, '
                f'"path": {_quote(trace.path)}, "status": {status}, '
                f'"route": {_maybe(trace.route)}, "key": {_maybe(key)}, '
                f'"outcome": {_maybe(trace.outcome)}, "run_id": {_maybe(trace.run_id)}, '
                f'"upstream_status": {"null" if upstream is None else upstream}, '
                f'"duration_ms": {duration}}}'
            )
        else:
            details = " ".join(
                f"{name}={value}"
                for name, value in (
                    ("route", trace.route), ("key", key), ("outcome", trace.outcome),
                    ("run_id", trace.run_id), ("upstream_status", trace.upstream_status),
                    ("duration_ms", duration),
                )
                if value
            )  # fmt: skip
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            path = trace.path
            if not path.isprintable():
                # A decoded %0D%0A in the path must not start a forged log line.
                path = path.encode("unicode_escape").decode("ascii")
            line = f"{stamp} INFO gateway.access: {trace.method} {path} {status} {details}"
        self.lines.append(line)
        if len(self.lines) >= 512:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            self.stream.write("\n".join(self.lines) + "\n")
            self.stream.flush()
            self.lines.clear()


#: json.dumps's own string encoder (C) for ensure_ascii=False.
_quote: Callable[[str], str] = json.encoder.encode_basestring


def _maybe(value: str) -> str:
    return _quote(value) if value else "null"


#: None: no access log (also in tests that build gateways in-process).
_writer: AccessWriter | None = None


def log_access(trace: Trace, status: int) -> None:
    if _writer is not None:
        _writer.write(trace, status)


def flush_access_log() -> None:
    """Called every 0.5 s by serve(), at its end, and at exit."""
    if _writer is not None:
        _writer.flush()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # A line's own fields (an operator action's who, what, route, key, client),
        # given as `extra={"fields": {...}}`; they never replace the four above.
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update({k: v for k, v in fields.items() if k not in doc})
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def _text_formatter() -> logging.Formatter:
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def setup_logging(level: str = "INFO", fmt: str = "auto", access: bool = True) -> None:
    """One handler on stderr for everything the gateway logs."""
    global _writer
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else _text_formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _writer = AccessWriter(sys.stderr, use_json) if access else None
    # uvicorn's own error log is useful; its access log duplicates ours.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


atexit.register(flush_access_log)
