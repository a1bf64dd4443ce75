"""`fleetsched.virtual_time`: anyio code on a clock that jumps whenever every task waits."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
import threading
import time
import tomllib
from pathlib import Path

import anyio
import pytest
import sniffio

from fleetsched.errors import Deadlock
from fleetsched.virtual_time import VirtualTimeLoop, run_sync_in_thread, run_virtual


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


def test_trio_runs_on_virtual_time_with_an_anyio_that_drops_backend_options(monkeypatch):
    # anyio before 4.14 (pyproject.toml admits 4.5 on) ran trio without `backend_options`, the
    # virtual clock among them: the run slept on trio's real clock instead.
    import trio
    from anyio._backends._trio import TrioBackend

    def run_without_options(cls, func, args, kwargs, options):
        return trio.run(func, *args)

    monkeypatch.setattr(TrioBackend, "run", classmethod(run_without_options))

    async def main() -> float:
        start = anyio.current_time()
        await anyio.sleep(10)
        return anyio.current_time() - start

    began = time.perf_counter()
    assert run_virtual(main, loop="trio") == pytest.approx(10)
    assert time.perf_counter() - began < 5


def test_the_declared_anyio_brings_the_trio_its_trio_backend_needs():
    # anyio 4.12 on calls trio 0.32's API; "trio>=0.25" alone let an older trio stay beside a new
    # anyio, and `simulate --loop trio` ended in a TrioInternalError.
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert any(dep.replace(" ", "").startswith("anyio[trio]") for dep in pyproject["project"]["dependencies"])


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


#: Two ways to start a worker thread: fleetsched's own, and anyio's as other libraries call it
#: (before, only the first held the clock).
THREAD_STARTERS = pytest.mark.parametrize("in_thread", [run_sync_in_thread, anyio.to_thread.run_sync], ids=["ours", "anyio"])


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@THREAD_STARTERS
def test_the_clock_holds_still_while_a_worker_thread_works(loop, in_thread):
    """Before: 10 ms of work in a thread jumped the clock to the next timer (100 s on), and the
    30-s timeout around the thread fired."""

    async def main() -> tuple[bool, float, float]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep, 100)  # the next timer
            with anyio.move_on_after(30) as scope:
                await in_thread(time.sleep, 0.01, abandon_on_cancel=True)  # as a tool's
            after_thread = anyio.current_time()
        return scope.cancelled_caught, after_thread, anyio.current_time()

    assert run_virtual(main, loop=loop) == (False, 0.0, 100.0)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_threads_at_once_hold_the_clock_until_the_last_ends(loop):
    """The clock holds while any thread works; a sleep beside them takes its own time, no more."""

    async def main() -> list[tuple[str, float]]:
        seen: list[tuple[str, float]] = []

        async def work(name: str, seconds: float) -> None:
            await run_sync_in_thread(time.sleep, seconds)
            seen.append((name, anyio.current_time()))

        async def nap() -> None:
            await anyio.sleep(5)
            seen.append(("nap", anyio.current_time()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(work, "short", 0.01)
            tg.start_soon(work, "long", 0.05)
            tg.start_soon(nap)
        return seen

    seen = run_virtual(main, loop=loop)
    assert sorted(seen[:2]) == [("long", 0.0), ("short", 0.0)] and seen[2] == ("nap", 5.0)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@THREAD_STARTERS
def test_a_thread_left_behind_by_a_cancellation_lets_the_clock_go(loop, in_thread):
    """A thread abandoned on cancellation no longer holds the clock: the loop does not wait for it."""

    async def main() -> float:
        started, release = anyio.Event(), threading.Event()

        def work() -> None:
            anyio.from_thread.run_sync(started.set)
            release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(in_thread, work, abandon_on_cancel=True))
            await started.wait()
            tg.cancel_scope.cancel()
        await anyio.sleep(60)
        release.set()
        return anyio.current_time()

    assert run_virtual(main, loop=loop) == 60.0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_on_a_real_clock_a_thread_takes_its_real_time(backend):
    async def main() -> float:
        start = anyio.current_time()
        await run_sync_in_thread(time.sleep, 0.05)
        return anyio.current_time() - start

    assert anyio.run(main, backend=backend) >= 0.04


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


def test_a_thread_of_the_loops_executor_holds_the_clock():
    """Libraries start threads their own way: `asyncio.to_thread` runs on the loop's executor.
    Before: the clock jumped to the next timer while the thread worked (the 30-s timeout fired)."""

    async def main() -> tuple[bool, float, float]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep, 100)
            with anyio.move_on_after(30) as scope:
                await asyncio.to_thread(time.sleep, 0.01)
            after_thread = anyio.current_time()
        return scope.cancelled_caught, after_thread, anyio.current_time()

    assert run_virtual(main) == (False, 0.0, 100.0)


def test_an_agents_first_openai_sdk_call_takes_no_virtual_time_of_its_own():
    """The openai SDK reads the platform in a thread on a client's first call. Before, that thread
    let the clock jump from timer to timer: beside a 100-s sleeper, the first call through
    `ctx.openai` on the instant backend took 302.5 virtual seconds (the second none)."""
    from fleetsched import Scheduler
    from fleetsched.settings import Settings

    async def agent(ctx) -> list[float]:
        took = []
        for _ in range(2):
            start = anyio.current_time()
            await ctx.openai.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            took.append(anyio.current_time() - start)
        return took

    async def main() -> list[float]:
        async with Scheduler(Settings(backend={"kind": "instant"})) as scheduler, anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep, 100)
            handle = await scheduler.submit(agent, tenant="default")
            return await handle

    assert run_virtual(main) == [0.0, 0.0]


def test_a_timer_at_nan_is_refused_and_the_others_keep_their_order():
    """A nan in the timer heap compares with nothing: the heap's order broke (a 1-s timer fired
    before a 0.5-s one) and the loop waited on its selector for good, the whole run standing
    still. asyncio on Python 3.13 refuses it too (ValueError); anyio's and trio's sleeps do."""

    async def main() -> list[float]:
        fired: list[float] = []
        loop = asyncio.get_running_loop()
        for delay in (1.0, 3.0, 2.0, 0.5):
            loop.call_later(delay, lambda: fired.append(anyio.current_time()))
        with pytest.raises(ValueError, match="NaN"):
            await asyncio.sleep(float("nan"))
        await anyio.sleep(5)
        return fired

    assert run_virtual(main) == [0.5, 1.0, 2.0, 3.0]


def test_a_hold_released_twice_is_released_once():
    # Counted twice, the holds went below zero, which read as held: the clock stood still for good.
    async def main() -> float:
        loop = asyncio.get_running_loop()
        outer, inner = loop.hold_clock(), loop.hold_clock()  # type: ignore[attr-defined]
        inner()
        inner()
        outer()
        await anyio.sleep(1)
        return anyio.current_time()

    assert run_virtual(main) == 1.0


@pytest.mark.parametrize("debug", [False, True])
def test_callbacks_and_timers_behave_as_on_asyncios_own_loop(debug):
    """The loop makes its handles and runs their callbacks its own way outside debug mode (fewer
    Python calls a wake-up): what code sees of them is asyncio's. A failing callback reaches the
    exception handler with asyncio's message and the loop goes on; a timer cancelled in the heap
    is counted, one cancelled after it fired is not; each runs in its context."""
    from fleetsched.virtual_time import VirtualTimeLoop

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def fail() -> None:
        raise ValueError("boom")

    def run(loop: asyncio.AbstractEventLoop) -> tuple[list[tuple[str, str]], list[str], list[int]]:
        reported: list[tuple[str, str]] = []
        loop.set_exception_handler(lambda _, context: reported.append((context["message"].split(" at ")[0], repr(context["exception"]))))
        loop.set_debug(debug)
        seen: list[str] = []
        counts: list[int] = []

        async def main() -> None:
            loop.call_soon(fail)
            var.set("main's")
            loop.call_soon(lambda: seen.append(var.get()))
            other = contextvars.Context()
            loop.call_soon(lambda: seen.append(var.get()), context=other)
            fired = loop.call_later(0.01, lambda: seen.append("fired"))
            waiting = loop.call_later(10, lambda: seen.append("never"))
            await asyncio.sleep(0.05)
            fired.cancel()  # it has fired: out of the heap, not counted
            counts.append(loop._timer_cancelled_count)  # type: ignore[attr-defined]
            waiting.cancel()  # in the heap: counted
            counts.append(loop._timer_cancelled_count)  # type: ignore[attr-defined]

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
        return reported, seen, counts

    assert run(VirtualTimeLoop()) == run(asyncio.new_event_loop())
    reported, seen, counts = run(VirtualTimeLoop())
    assert reported == [("Exception in callback test_callbacks_and_timers_behave_as_on_asyncios_own_loop.<locals>.fail()", "ValueError('boom')")]
    assert seen == ["main's", "unset", "fired"] and counts == [0, 1]


def _run_with_deadlock_limit(fn, deadlock_s: float):
    loop_factory = functools.partial(VirtualTimeLoop, deadlock_s=deadlock_s)
    return anyio.run(fn, backend="asyncio", backend_options={"loop_factory": loop_factory})


def test_a_run_that_can_never_go_on_raises_deadlock_naming_where_its_tasks_wait():
    """Every task waiting on an event no one sets, with no timer and no thread: the loop blocked
    for good (a scheduler fault of this kind hung CI). It raises `Deadlock` after `deadlock_s`
    of real time, naming each waiting task and the line it waits at; the tasks are cancelled."""
    ended: list[str] = []

    async def waiter(event: anyio.Event) -> None:
        try:
            await event.wait()
        finally:
            ended.append("waiter")

    async def main() -> None:
        event = anyio.Event()
        await anyio.sleep(5)  # the message gives the time it stood still at
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, event, name="the-waiter")
            await anyio.sleep_forever()  # a timer at infinity never fires: no timer to jump to

    with pytest.raises(Deadlock) as raised:
        _run_with_deadlock_limit(main, deadlock_s=0.2)
    message = str(raised.value)
    assert message.startswith("virtual time stands still at 5 s: every task waits, no timer is set"), message
    assert "for 0.2 s of real time" in message
    assert "'the-waiter' at test_virtual_time.py:" in message and "(waiter)" in message, message
    assert "(main)" in message, message
    assert ended == ["waiter"]


def test_a_thread_of_its_own_that_wakes_the_loop_in_time_is_no_deadlock():
    """A thread started outside anyio (the clock does not wait for it) that reports back through
    ``call_soon_threadsafe`` before `deadlock_s` passes: the run goes on."""

    async def main() -> str:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        worker = threading.Thread(target=lambda: (time.sleep(0.3), loop.call_soon_threadsafe(future.set_result, "woken")))
        worker.start()
        try:
            return await future
        finally:
            worker.join()

    assert _run_with_deadlock_limit(main, deadlock_s=30) == "woken"


@pytest.mark.parametrize("deadlock_s", [0, -1.0, math.nan])
def test_a_deadlock_limit_that_is_no_positive_time_is_refused(deadlock_s):
    with pytest.raises(ValueError, match=r"^deadlock_s must be > 0"):
        VirtualTimeLoop(deadlock_s=deadlock_s)


def test_a_sleep_lasts_its_length_from_when_it_starts():
    """A sleep started at t=10 ends its length later, not at that length from the clock's zero."""

    async def main() -> float:
        await anyio.sleep(10)
        await anyio.sleep(5)
        return anyio.current_time()

    assert run_virtual(main) == 15.0


def test_timers_due_at_the_same_time_fire_in_the_order_they_were_set():
    """Timers of one time fire first in, first out: a simulation replays in the same order."""

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        for i in range(20):
            loop.call_at(1.0, fired.append, i)
        await anyio.sleep(2)
        return fired

    assert run_virtual(main) == list(range(20))


def test_a_socket_ready_when_every_task_waits_is_read_before_the_clock_jumps():
    """Data already on a socket wakes its reader at the current time, before the next timer."""
    import socket

    async def main() -> float:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        read_at: list[float] = []

        async def reader() -> None:
            await loop.sock_recv(a, 1)
            read_at.append(loop.time())

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.sleep(0)  # the reader waits on the socket
                b.send(b"x")
                await anyio.sleep(100)
        finally:
            a.close()
            b.close()
        return read_at[0]

    assert run_virtual(main) == 0.0


def test_callbacks_a_callback_schedules_run_in_the_next_round_after_the_timers_then_due():
    """As on asyncio's own loop: a chain of call_soon callbacks lets a timer due meanwhile in."""

    def run(loop: asyncio.AbstractEventLoop) -> list[object]:
        seen: list[object] = []

        def step(n: int) -> None:
            seen.append(n)
            if n == 0:
                loop.call_later(0, seen.append, "timer")
            if n < 3:
                loop.call_soon(step, n + 1)

        async def main() -> None:
            loop.call_soon(step, 0)
            await asyncio.sleep(0.01)

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
        return seen

    assert run(VirtualTimeLoop()) == run(asyncio.new_event_loop()) == [0, 1, "timer", 2, 3]


def test_a_callback_cancelled_before_it_runs_never_runs():
    """A cancelled call_soon callback is skipped without a word to the exception handler."""

    async def main() -> tuple[list[int], list[dict]]:
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        seen: list[int] = []
        loop.call_soon(seen.append, 1).cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return seen, reported

    assert run_virtual(main) == ([], [])


def test_a_cancelled_timer_purged_from_the_heap_s_head_leaves_the_count():
    """The cancelled count falls to 0 once a cancelled timer at the heap's head is dropped."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        loop.call_later(1, lambda: None).cancel()
        loop.call_later(2, lambda: None)
        await anyio.sleep(0.5)
        return len(loop._scheduled), loop._timer_cancelled_count  # type: ignore[attr-defined]

    assert run_virtual(main) == (1, 0)

