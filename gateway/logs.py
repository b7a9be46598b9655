"""Logs: JSON lines (or text on a terminal), and one access-log line per request.

The access line says what the gateway did: route, key (a hash of it where the route
says keys are sensitive), outcome, run id, upstream status, duration. Never bodies,
tokens, Authorization headers or store passwords: nothing here reads them.

The engine fills the request's `Trace` through a context variable, so the forward
task (which copies the context) writes to the same trace as the request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

access_log = logging.getLogger("gateway.access")


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


def log_access(trace: Trace, status: int) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    key = trace.key
    if key and trace.sensitive:
        key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    access_log.info(
        "%s %s %s",
        trace.method,
        trace.path,
        status,
        extra={
            "access": {
                "method": trace.method,
                "path": trace.path,
                "status": status,
                "route": trace.route or None,
                "key": key or None,
                "outcome": trace.outcome or None,
                "run_id": trace.run_id or None,
                "upstream_status": trace.upstream_status,
                "duration_ms": round((time.perf_counter() - trace.started) * 1000, 2),
            }
        },
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            doc.update(access)
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            details = " ".join(
                f"{k}={v}"
                for k, v in access.items()
                if v is not None and k not in ("method", "path", "status")
            )
            record.msg = f"{record.msg} {details}"
        return super().format(record)


#: Access lines are buffered: a write and flush per request cost about a quarter of
#: the replay throughput. `flush_access_log` runs every 0.5 s (see serve.py) and at exit.
_access_buffer: logging.handlers.MemoryHandler | None = None


def flush_access_log() -> None:
    if _access_buffer is not None:
        _access_buffer.flush()


def setup_logging(level: str = "INFO", fmt: str = "auto", access: bool = True) -> None:
    """One handler on stderr for everything the gateway logs."""
    global _access_buffer
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _access_buffer = logging.handlers.MemoryHandler(
        capacity=512, flushLevel=logging.WARNING, target=handler, flushOnClose=True
    )
    access_log.handlers[:] = [_access_buffer]
    access_log.propagate = False
    access_log.setLevel(logging.INFO if access else logging.WARNING)
    # uvicorn's own error log is useful; its access log duplicates ours.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
