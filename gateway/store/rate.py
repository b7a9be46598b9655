"""The rate limits a store keeps (`Store.take_token`): one bucket per name, shared by
every process on the store, as the generic cell rate algorithm (GCRA, the way the
`limits` library keeps its windows) in one atomic step.

A bucket holds one number, its theoretical arrival time (`tat`, in the store's
milliseconds): when the next token would be due if tokens were taken at exactly the
rate. A take at `now` is allowed while `max(tat, now) + interval - burst x interval`
is not after `now`, and moves `tat` on by one interval; a refused take changes
nothing and answers the wait until that moment. Over any span `t` at most
`rate x t + burst` takes succeed. The Redis store runs the same arithmetic in
lua/rate.lua, PostgreSQL in gateway_take_token (migration 009); the memory and
SQLite stores call `take` here.
"""

from __future__ import annotations


def interval_ms(per_second: float) -> float:
    """Milliseconds between two tokens at `per_second`."""
    return 1000.0 / per_second


def take(tat_ms: float, now_ms: float, per_second: float, burst: int) -> tuple[float, float]:
    """(the bucket's new `tat`, the wait in seconds): a wait of 0 took a token; any
    other leaves `tat` as it was."""
    step = interval_ms(per_second)
    start = max(tat_ms, now_ms)
    allowed_at = start + step - burst * step
    if allowed_at > now_ms:
        return tat_ms, (allowed_at - now_ms) / 1000.0
    return start + step, 0.0
