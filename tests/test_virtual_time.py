"""`fleetsched.virtual_time`: anyio code on a clock that jumps whenever every task waits."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
import sniffio

from fleetsched.virtual_time import run_virtual


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_sleeps_take_no_wall_time_and_keep_their_order(loop):
    async def main() -> tuple[float, list[str]]:
        start = anyio.current_time()
        order: list[str] = []

        async def sleeper(name: str, seconds: float) -> None:
            await anyio.sleep(seconds)
            order.append(f"{name}@{anyio.current_time() - start:g}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(sleeper, "slow", 3600)
            tg.start_soon(sleeper, "fast", 0.5)
            tg.start_soon(sleeper, "mid", 60)
        return anyio.current_time() - start, order

    began = time.perf_counter()
    elapsed, order = run_virtual(main, loop=loop)
    assert time.perf_counter() - began < 5
    assert elapsed == pytest.approx(3600)
    assert order == ["fast@0.5", "mid@60", "slow@3600"]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_timeouts_fire_at_their_virtual_deadline(loop):
    async def main() -> tuple[bool, float]:
        start = anyio.current_time()
        with anyio.move_on_after(90) as scope:
            await anyio.Event().wait()  # never set
        return scope.cancelled_caught, anyio.current_time() - start

    cancelled, elapsed = run_virtual(main, loop=loop)
    assert cancelled and elapsed == pytest.approx(90)


def test_a_worker_thread_still_wakes_the_loop():
    """With no timer left the loop blocks for real until the thread's result arrives."""

    async def main() -> str:
        return await anyio.to_thread.run_sync(lambda: time.sleep(0.05) or "done")

    assert run_virtual(main) == "done"


def test_the_loop_declares_itself_to_sniffio_while_it_runs_only():
    """`anyio.current_time()` finds the asyncio backend without sniffing for a task; a worker
    thread (sync code) and the code after the run see no async library."""

    def in_thread() -> str | None:
        return sniffio.thread_local.name

    async def main() -> tuple[str | None, str, str | None]:
        return sniffio.thread_local.name, sniffio.current_async_library(), await anyio.to_thread.run_sync(in_thread)

    assert run_virtual(main) == ("asyncio", "asyncio", None)
    assert sniffio.thread_local.name is None
    with pytest.raises(sniffio.AsyncLibraryNotFoundError):
        sniffio.current_async_library()


def test_the_clock_starts_at_zero_jumps_to_each_timer_and_never_goes_back():
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        await anyio.sleep(2.5)
        seen.append(loop.time())
        fired = anyio.Event()
        loop.call_at(1.0, fired.set)  # due in the past: runs at once, the clock stays
        await fired.wait()
        seen.append(loop.time())
        return seen

    assert run_virtual(main) == [0.0, 2.5, 2.5]


def test_an_unknown_loop_is_named():
    async def main() -> None: ...

    with pytest.raises(ValueError, match="curio"):
        run_virtual(main, loop="curio")  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_task_asleep_forever_is_no_timer_to_jump_to(loop):
    """`anyio.sleep_forever()` (a sleep of ``inf``) never wakes: while a thread works and that is
    the only timer, the loop waits for the thread instead of moving the clock to infinity."""

    async def main() -> tuple[float, bool]:
        woke = False

        async def sleeper() -> None:
            nonlocal woke
            await anyio.sleep_forever()
            woke = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(sleeper)
            await anyio.to_thread.run_sync(time.sleep, 0.02)
            now = anyio.current_time()
            tg.cancel_scope.cancel()
        return now, woke

    assert run_virtual(main, loop=loop) == (0.0, False)


def test_cancelled_timers_are_counted_out_when_they_come_due():
    """The loop looks for cancelled timers only while its count says some are in the heap: a
    cancelled timer that leaves the heap because it came due must leave the count too, or every
    later iteration searches a heap with none."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        timers = [loop.call_later(1, lambda: None) for _ in range(3)]
        timers[1].cancel()  # behind the first: due with it, not purged from the heap's head
        timers[2].cancel()
        await anyio.sleep(2)
        return len(loop._scheduled), loop._timer_cancelled_count  # type: ignore[attr-defined]

    assert run_virtual(main) == (0, 0)
