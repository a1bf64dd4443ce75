"""The pools under concurrency and cancellation: waiters, grows that move, quotas, and the
scheduler's use of the pool, on virtual time (trio MockClock).

Each test failed before its fix (found by a probe of the pools under concurrency)."""

from __future__ import annotations

import anyio
import pytest

from fleetsched.resources import DeviceSpec, ExtentPool

PAGE = 1 << 20
pytestmark = pytest.mark.anyio


async def test_a_grow_that_moves_hands_the_extent_it_left_to_a_waiter():
    """Before: growing by moving freed the old extent without serving waiters, so a waiter that
    fits there now waited on until some later release."""
    pool = ExtentPool([DeviceSpec("g0", 13 * PAGE)], page_size=PAGE, strategy="best-fit")
    before = pool.reserve_nowait(3 * PAGE)  # [0, 3)
    grower = pool.reserve_nowait(2 * PAGE)  # [3, 5)
    after = pool.reserve_nowait(2 * PAGE)  # [5, 7)
    pool.reserve_nowait(PAGE)  # [7, 8): pinned, stops the grower growing in place
    before.release()
    after.release()  # free: [0, 3), [5, 7), [8, 13)
    granted: list[float] = []

    async def want() -> None:
        await pool.acquire(6 * PAGE, owner="w")  # 10 pages free, no 6 in a row: waits
        granted.append(anyio.current_time())

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(1)
        assert pool.statistics().waiting == 1
        assert grower.resize_nowait(5 * PAGE)  # moves to [8, 13); [0, 7) is free now
        assert grower.offset == 8 * PAGE
        with anyio.move_on_after(10):
            while not granted:
                await anyio.sleep(1)
        tg.cancel_scope.cancel()
    assert granted == [1.0]
    assert pool.statistics().waiting == 0
    pool.check_invariants()
