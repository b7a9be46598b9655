"""How a parse's time grows with its input: by the ratio of two sizes, never by a
wall-clock threshold alone, so a loaded machine slows both sizes alike and the test
still tells linear from quadratic.

`assert_linear(run, make, small)` times `run(make(small))` and `run(make(small *
FACTOR))`, each the best of a few tries (the try least disturbed by other work), and
fails when the larger took more than SLACK times its share: a linear parse takes about
FACTOR times as long, a quadratic one FACTOR squared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: How much larger the second input is.
FACTOR = 8
#: The most the larger input may take, in multiples of FACTOR times the smaller's time:
#: 3 leaves room for noise and cache effects, and is well short of a quadratic's 8.
SLACK = 3
TRIES = 5


def best_of(run: Callable[[], object], tries: int = TRIES, give_up: float = float("inf")) -> float:
    """The shortest of `tries` timings of `run`; stops early once two took over
    `give_up` seconds (nothing shorter matters then). One such try alone is not
    enough: a process descheduled by the machine's other work takes that long once."""
    best = float("inf")
    over = 0
    for _ in range(tries):
        started = time.perf_counter()
        run()
        took = time.perf_counter() - started
        best = min(best, took)
        over += took > give_up
        if over == 2:
            break
    return best


def assert_linear(run: Callable[[T], object], make: Callable[[int], T], small: int) -> None:
    """`run` on inputs `make(small)` and `make(small * FACTOR)` grows linearly."""
    little, large = make(small), make(small * FACTOR)
    short = best_of(lambda: run(little))
    bound = short * FACTOR * SLACK
    # A try far past the bound ends the trying: a quadratic parse of the larger input
    # would otherwise be timed again and again.
    long = best_of(lambda: run(large), give_up=bound * 10)
    assert long <= bound, (
        f"{FACTOR}x the input took {long / short:.0f}x the time ({short * 1000:.2f} ms, then "
        f"{long * 1000:.2f} ms): more than linear"
    )
