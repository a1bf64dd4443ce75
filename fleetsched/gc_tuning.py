"""Garbage-collector thresholds for processes that hold thousands of tasks at once.

Python collects cyclic garbage in three generations. At its defaults (700, 10, 10) a full pass,
which walks every live object, comes every 70,000 allocations or so once the heap has grown; a
fleetsched process under load holds thousands of queued calls (tasks, frames, bodies), and each
full pass then stops its event loop for 100-200 ms. Measured in ``fleetsched bench qos``'s
fleetsched mode (about 7,000 queued calls): 28 passes over 5 ms in 30 s, the longest 195 ms,
and a critical call's TTFT p99 of 0.65 s; with `SERVING` no pass over 28 ms.

`SERVING` keeps young passes short (every 2,000 allocations) and makes full passes rare (after
1,000 middle passes, each after 1,000 young ones: every 2 billion allocations). Cyclic garbage
that lives through a middle pass then waits for the next full pass; reference counting frees
everything else at once. `SIMULATING` makes young passes rarer still: a simulation is not
latency-bound, and at the default young threshold collection took 7-10 % of a 1,000-agent run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

Thresholds = tuple[int, int, int]

SERVING: Thresholds = (2_000, 1_000, 1_000)
SIMULATING: Thresholds = (100_000, 10, 10)


@contextmanager
def gc_thresholds(thresholds: Thresholds) -> Iterator[None]:
    """Collect with `thresholds` (`gc.set_threshold`) inside the block; the old ones after it."""
    old = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*old)
