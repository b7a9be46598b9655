"""Background loops' one rule about cancellation, shared by every loop that calls a
store or an upstream (the sweep, the store watch, the roster)."""

from __future__ import annotations

import asyncio


def stop_if_cancelled() -> None:
    """Raise CancelledError if this task was told to stop. A client library that
    turns a cancellation mid-call into its own error (redis-py's pipeline can) would
    otherwise leave a background loop running, and `Gateway.close` waiting on it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
