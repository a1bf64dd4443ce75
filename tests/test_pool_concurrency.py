"""The pools under concurrency and cancellation: waiters, grows that move, quotas, and the
scheduler's use of the pool, on virtual time (trio MockClock).

Each test failed before its fix (found by a probe of the pools under concurrency)."""

from __future__ import annotations

import contextlib

import anyio
import pytest

from fleetsched import Scheduler, SessionState
from fleetsched.resources import CountingPool, DeviceSpec, ExtentPool

from .helpers import check_released, settings
from .test_keep_or_release import sleeper

PAGE = 1 << 20
GB = 10**9
pytestmark = pytest.mark.anyio


async def until_granted(granted: list[float], within_s: float = 10) -> None:
    """Wait (virtual time) until `granted` holds a grant, or `within_s` passed."""
    with anyio.move_on_after(within_s):
        while not granted:
            await anyio.sleep(1)


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
        await until_granted(granted)
        tg.cancel_scope.cancel()
    assert granted == [1.0]
    assert pool.statistics().waiting == 0
    pool.check_invariants()


async def test_a_waiter_that_gives_up_lets_the_schedulers_queue_in():
    """A pool shared by the scheduler and a direct `acquire`: a waiter ahead holds back
    `reserve_nowait`, so admission waits for the pool's release listener. Before: a waiter that
    gave up (cancelled, timed out) served the waiters behind it but told no listener, and the
    scheduler's queue waited on until some later release."""
    log: list = []
    pool = CountingPool([DeviceSpec("gpu0", 80 * GB)])
    s = settings(scheduler={"max_sessions": 4, "drain_grace_s": 1000})
    async with Scheduler(s, pool=pool) as scheduler:
        await scheduler.submit(sleeper(100, log, "A"), tenant="acme", memory=50 * GB)
        async with anyio.create_task_group() as tg:

            async def impatient() -> None:
                with anyio.move_on_after(5):
                    await pool.acquire(40 * GB, owner="direct", priority=0)  # waits ahead of B

            tg.start_soon(impatient)
            await anyio.sleep(1)
            b = await scheduler.submit(sleeper(1, log, "B"), tenant="acme", memory=20 * GB)
            assert b.state is SessionState.QUEUED  # behind the waiter, though 30 GB are free
        await b
    assert ("B", "start", 5.0) in log
    check_released(scheduler)


@pytest.mark.parametrize("kind", ["extent", "counting"])
@pytest.mark.parametrize("how", ["grows", "reserves ahead of the line"])
async def test_a_head_waiter_pushed_over_its_quota_lets_the_line_move(kind, how):
    """A waiter its tenant's quota holds back does not hold the line (the pool serves those behind
    it). Before: when the tenant took more memory (a grow, or a reservation of a better
    priority) and so pushed its own waiter at the head over the quota, nobody served the line:
    a waiter behind that fits waited on until some later release."""
    devices = [DeviceSpec("g0", 16 * PAGE)]
    quotas = {"a": 10 * PAGE}
    pool = ExtentPool(devices, page_size=PAGE, quotas=quotas) if kind == "extent" else CountingPool(devices, quotas=quotas)
    pool.reserve_nowait(8 * PAGE, tenant="b")
    mine = pool.reserve_nowait(PAGE, tenant="a")  # 7 pages free
    granted: list[str] = []

    async def want(nbytes: int, tenant: str | None, name: str) -> None:
        await pool.acquire(nbytes, owner=name, tenant=tenant, priority=1)
        granted.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 8 * PAGE, "a", "head")  # within a's quota (1 + 8 <= 10), no room
        await anyio.sleep(1)
        tg.start_soon(want, 3 * PAGE, None, "behind")  # fits, but waits behind the head
        await anyio.sleep(1)
        assert pool.statistics().waiting == 2
        if how == "grows":
            mine.resize_nowait(3 * PAGE)  # a holds 3: its head waiter (8 more) is over the quota
        else:
            pool.reserve_nowait(2 * PAGE, tenant="a", priority=0)
        await anyio.sleep(1)
        tg.cancel_scope.cancel()
    assert granted == ["behind"]


@pytest.mark.parametrize("kind", ["extent", "counting"])
async def test_a_waiter_its_quota_holds_back_does_not_hold_back_reserve_nowait(kind):
    """A waiter ahead holds back `reserve_nowait` (a scheduler's admission), but not one that
    only its tenant's quota keeps waiting: that one would hold back every tenant's admission."""
    devices = [DeviceSpec("g0", 10 * PAGE)]
    quotas = {"t": 3 * PAGE}
    pool = ExtentPool(devices, page_size=PAGE, quotas=quotas) if kind == "extent" else CountingPool(devices, quotas=quotas)
    pool.reserve_nowait(3 * PAGE, tenant="t")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: pool.acquire(PAGE, tenant="t"))  # over t's quota: waits
        await anyio.sleep(1)
        assert pool.statistics().waiting == 1
        pool.reserve_nowait(2 * PAGE, tenant="u")  # 7 pages free: no WouldBlock
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["extent", "counting"])
async def test_a_waiter_cancelled_as_its_quota_refuses_it_is_just_cancelled(kind):
    """The waiter's cancellation is delivered (its task rescheduled) and, before it runs, a lowered
    quota refuses it: set_quota takes it out of the line. Before: the waiter then tried to take
    itself out again and failed with ValueError (list.remove) instead of being cancelled."""
    devices = [DeviceSpec("g0", 16 * PAGE)]
    pool = ExtentPool(devices, page_size=PAGE, quotas={"t": 8 * PAGE}) if kind == "extent" else CountingPool(devices, quotas={"t": 8 * PAGE})
    pool.reserve_nowait(12 * PAGE, tenant="other")
    outcome: list[str] = []

    async def want() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await pool.acquire(6 * PAGE, tenant="t")
        outcome.append("cancelled" if scope.cancelled_caught else "granted")

    scopes: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(1)
        scopes[0].cancel()  # delivered at once: the waiter is rescheduled with the cancellation ...
        pool.set_quota("t", 4 * PAGE)  # ... and refused before it runs
    assert outcome == ["cancelled"]
    assert pool.statistics().waiting == 0


@pytest.mark.parametrize("settle", [True, False])
async def test_a_reservation_turning_movable_lets_a_fragmented_waiter_in(settle):
    """Before: a waiter refused for fragmentation waited on when a reservation beside its hole
    turned movable (on-demand compaction could now make room) unless settling happened to move
    something, and the release listeners (the scheduler's admission) were not told either: the
    pool stood still until some later release."""
    pool = ExtentPool([DeviceSpec("g0", 10 * PAGE)], page_size=PAGE, strategy="first-fit", settle=settle)
    pool.reserve_nowait(PAGE)  # [0, 1): pinned
    idle = pool.reserve_nowait(PAGE)  # [1, 2): turns movable below
    gap_a = pool.reserve_nowait(2 * PAGE)  # [2, 4)
    pool.reserve_nowait(2 * PAGE)  # [4, 6): pinned
    gap_b = pool.reserve_nowait(2 * PAGE)  # [6, 8)
    pool.reserve_nowait(2 * PAGE)  # [8, 10): pinned
    gap_a.release()
    gap_b.release()  # free: [2, 4), [6, 8); no 3 pages in a row, and nothing movable
    heard: list[float] = []
    pool.add_release_listener(lambda: heard.append(anyio.current_time()))
    granted: list[float] = []

    async def want() -> None:
        await pool.acquire(3 * PAGE, owner="w")
        granted.append(anyio.current_time())

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(1)
        assert pool.statistics().waiting == 1
        idle.movable = True  # moving it to [6, 7) opens [1, 4)
        await until_granted(granted)
        tg.cancel_scope.cancel()
    assert granted == [1.0]
    assert heard and heard[0] == 1.0
    assert pool.statistics().waiting == 0
    pool.check_invariants()


async def test_a_move_callback_failing_halfway_through_compaction_still_serves_the_waiters():
    """On-demand compaction for a `reserve_nowait` whose move callback raises on the second move:
    the first move stays made, and here it joins the free pages into a run a waiter fits in.
    Before: nothing served the waiters then, and the waiter waited on until some later release."""
    pool = ExtentPool([DeviceSpec("g0", 6 * PAGE)], page_size=PAGE, strategy="first-fit", settle=False)
    before = pool.reserve_nowait(2 * PAGE)  # [0, 2)
    idle = [pool.reserve_nowait(PAGE), pool.reserve_nowait(PAGE)]  # [2, 3), [3, 4)
    after = pool.reserve_nowait(2 * PAGE)  # [4, 6)
    before.release()
    after.release()  # free: [0, 2), [4, 6)
    calls: list = []

    def copy(r, move) -> None:
        calls.append(move)
        if len(calls) == 2:
            raise OSError("copy failed")

    granted: list[float] = []

    async def want() -> None:
        await pool.acquire(3 * PAGE, owner="w", priority=1)
        granted.append(anyio.current_time())

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)  # 4 pages free, no 3 in a row, nothing movable: waits
        await anyio.sleep(1)
        def refuse(r, move) -> None:
            raise OSError("not yet")

        pool.set_move_callback(refuse)  # (were turning movable to serve the waiter, it fails at once)
        for r in idle:
            with contextlib.suppress(OSError):
                r.movable = True
        assert pool.statistics().waiting == 1
        pool.set_move_callback(copy)
        with pytest.raises(OSError, match="copy failed"):
            pool.reserve_nowait(4 * PAGE, owner="big")  # moves [2, 3) to [4, 5), then fails
        assert len(calls) == 2 and idle[0].offset == 4 * PAGE  # [0, 3) is free now
        await until_granted(granted)
        tg.cancel_scope.cancel()
    assert granted == [1.0]
    assert pool.statistics().waiting == 0
    pool.check_invariants()
