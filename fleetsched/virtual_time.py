"""Virtual time for simulations: the clock jumps to the next timer whenever every task waits.

`run_virtual(fn, *args)` runs ``fn`` under anyio on a virtual clock that starts at 0. Two event
loops give the same semantics (trio's ``MockClock(autojump_threshold=0)``):

- ``"asyncio"`` (the default): `VirtualTimeLoop`, an asyncio loop whose ``time()`` is virtual.
  When nothing is ready to run, the clock moves to the next timer instead of the loop blocking.
  A timer costs a heap entry and a future (a sleep: about 6 us on this project's machine).
- ``"trio"``: trio with ``MockClock(autojump_threshold=0)``. Every sleep is a cancel scope whose
  deadline expires by raising ``Cancelled`` (18-26 us). A simulated hour of a 1,000-agent fleet
  took 126.6 s of wall time here, against 94.0 s on the asyncio loop before it ran its own loop
  iteration (see `VirtualTimeLoop`).

Library code never sees the difference: it reads time with ``anyio.current_time()`` and waits with
``anyio.sleep()``. Worker threads hold the clock still while they work: their work takes no
virtual time, and no timer fires meanwhile (a thread that never returns, or waits on the loop's
timers, holds virtual time still for good). That holds on either loop for threads started through
`run_sync_in_thread` (on any trio ``MockClock``) or ``anyio.to_thread.run_sync`` under anyio's
default limiter (as libraries start them; on trio, every ``trio.to_thread.run_sync``), and on the
asyncio loop for those its executor runs (``asyncio.to_thread``, ``loop.run_in_executor``). A
thread that a cancellation left behind (``abandon_on_cancel``) holds nothing; one started any
other way (``threading.Thread``, anyio with a limiter of its own) lets the clock jump meanwhile.

A run in which every task waits with no timer set and no worker thread at work stands still for
good unless something outside the loop wakes it (a thread, a socket). The asyncio loop waits
`DEADLOCK_S` of real time for that, then raises `Deadlock` naming the tasks that wait and where
(a scheduler fault of this kind hung a test run until CI's limit). trio's ``MockClock`` spins in
that state instead, as trio does.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import math
import os
import threading
import time
import weakref
from asyncio import format_helpers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import sniffio

from .errors import Deadlock

T = TypeVar("T")

Loop = Literal["asyncio", "trio"]
LOOPS: tuple[Loop, ...] = ("asyncio", "trio")


#: Real seconds between looks at the worker threads that hold trio's virtual clock still.
_THREAD_POLL_S = 0.001
#: Rounds with callbacks ready in which the selector is not polled (see `VirtualTimeLoop._run_once`).
_POLL_EVERY = 64
#: Timers at least, and the cancelled share past which the timer heap is rebuilt (asyncio's values).
_MIN_TIMERS_TO_PURGE = 100
_PURGE_CANCELLED_FRACTION = 0.5
#: Real seconds a `VirtualTimeLoop` waits, every task waiting with no timer set and no worker
#: thread at work, for something outside it to wake it before it raises `Deadlock`.
DEADLOCK_S = 60.0
#: The waiting tasks a `Deadlock`'s message names at most.
_DEADLOCK_TASKS_NAMED = 8
#: Where the frames of the event loop's own libraries lie: a waiting task is named where it
#: waits in other code (an ``anyio.Event().wait()`` in the caller's code, not inside anyio).
_LIBRARY_DIRS = tuple(str(Path(m.__file__).parent) + os.sep for m in (asyncio, anyio))
#: Real seconds the executor's threads get to finish at shutdown (asyncio's join timeout).
EXECUTOR_JOIN_S = 300.0


class _Handle(asyncio.Handle):
    """asyncio's `Handle`, made without the debug-mode check of its ``__init__`` (a Python call
    made for every task woken). `VirtualTimeLoop` makes them outside debug mode only."""

    __slots__ = ()

    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop, context: Any) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _TimerHandle(asyncio.TimerHandle):
    """asyncio's `TimerHandle`, made and cancelled without the debug-mode checks: every
    ``asyncio.sleep`` makes one and cancels it when it ends, which took asyncio's six Python
    calls (outside debug mode only, as `_Handle`)."""

    __slots__ = ()

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop, context: Any) -> None:
        _Handle.__init__(self, callback, args, loop, context)  # type: ignore[arg-type]
        self._when = when
        self._scheduled = False

    def cancel(self) -> None:
        if not self._cancelled:
            if self._scheduled:  # what the loop's ``_timer_handle_cancelled`` counts
                self._loop._timer_cancelled_count += 1  # type: ignore[attr-defined]
            self._cancelled = True
            self._callback = None  # type: ignore[assignment]
            self._args = None  # type: ignore[assignment]


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on virtual time (``time()`` starts at 0 and moves only by jumps).

    It runs asyncio's loop iteration with two changes. When nothing is ready, the clock jumps to
    the next timer instead of the selector sleeping (the selector is still polled first, so a
    thread's wake-up stops the jump); while a worker thread works (anyio's default limiter has
    lent a token, or a hold is on: `hold_clock`), the selector sleeps for real instead, until a
    thread wakes the loop.
    And its timer heap holds ``(when, seq, handle)`` tuples, which the heap compares in C:
    asyncio's own heap compares `TimerHandle` objects through a Python ``__lt__``, about ten
    calls a timer with a thousand agents asleep.
    """

    def __init__(self, deadlock_s: float = DEADLOCK_S) -> None:
        """`deadlock_s`: the real seconds to wait, every task waiting with no timer set and no
        worker thread at work, before raising `Deadlock` (``math.inf``: wait for good)."""
        super().__init__()
        if not deadlock_s > 0:
            self.close()
            raise ValueError(f"deadlock_s must be > 0 (math.inf never raises), got {deadlock_s!r}")
        self.deadlock_s = deadlock_s
        self._virtual_now = 0.0
        self._timer_seq = itertools.count()
        self._polls_skipped = 0
        self._holds = 0
        self._thread_limiter: anyio.CapacityLimiter | None = None  # anyio's default, once read

    def _threads_work(self) -> bool:
        """Whether a call of ``anyio.to_thread.run_sync`` under anyio's default limiter is in a
        worker thread now (a call that a cancellation abandoned has given its token back)."""
        if self._thread_limiter is None:
            self._thread_limiter = anyio.to_thread.current_default_thread_limiter()  # one per loop
        return self._thread_limiter.borrowed_tokens > 0

    def time(self) -> float:
        return self._virtual_now

    def hold_clock(self) -> Callable[[], None]:
        """Keep the clock from jumping until the function returned is called. Holds nest; a
        release called again does nothing (counted twice, the clock stood still for good)."""
        self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._holds -= 1

        return release

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """asyncio's, with the clock held still until the thread's work is done (or the future
        cancelled): threads that other libraries start this way take no virtual time either (the
        openai SDK reads the platform in one, through `asyncio.to_thread`, on a client's first call)."""
        future = super().run_in_executor(executor, func, *args)
        release = self.hold_clock()
        future.add_done_callback(lambda _: release())
        return future

    async def shutdown_default_executor(self, *args: Any) -> None:
        """asyncio's, with the clock held still while the executor's threads are joined, for up
        to `EXECUTOR_JOIN_S` of real time: from Python 3.13 it waits for them under a timeout
        on the loop's clock (300 s), which the clock jumped to at once, warning that they did not
        finish. A thread stuck past that lets the clock go to the timeout, and asyncio warns."""
        release = self.hold_clock()
        stuck = threading.Timer(EXECUTOR_JOIN_S, self.call_soon_threadsafe, (release,))
        stuck.daemon = True
        stuck.start()
        try:
            await super().shutdown_default_executor(*args)
        finally:
            stuck.cancel()
            release()

    def run_forever(self) -> None:
        # Declare the loop to sniffio while it runs, as trio does: `anyio.current_time()` (read
        # millions of times a simulated hour) then finds its backend at once instead of sniffing
        # for the current asyncio task. Worker threads have their own thread-local: unaffected.
        previous, sniffio.thread_local.name = sniffio.thread_local.name, "asyncio"
        try:
            super().run_forever()
        finally:
            sniffio.thread_local.name = previous

    def call_soon(self, callback: Callable[..., object], *args: Any, context: Any = None) -> asyncio.Handle:
        # What asyncio's does outside debug mode, without its four extra Python calls (`_check_closed`,
        # `_call_soon`, and the handle's debug-mode check: `_Handle`): every future resolved and
        # every task woken comes here, several times a model call in a simulation. Debug mode
        # keeps asyncio's own, with its checks.
        if self._debug:  # type: ignore[attr-defined]
            return super().call_soon(callback, *args, context=context)
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any, context: Any = None) -> asyncio.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._virtual_now + delay, callback, *args, context=context)

    def call_at(self, when: float, callback: Callable[..., object], *args: Any, context: Any = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        if when != when:  # nan sorts with nothing: the heap's order broke, and the run stood still
            raise ValueError("when must not be NaN")
        self._check_closed()
        if self._debug:  # type: ignore[attr-defined]
            timer = asyncio.TimerHandle(when, callback, args, self, context)
        else:
            timer = _TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._scheduled, (when, next(self._timer_seq), timer))  # type: ignore[arg-type]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        """One iteration: poll (or jump the clock), move due timers to ready, run what is ready."""
        timers: list[tuple[float, int, asyncio.TimerHandle]] = self._scheduled  # type: ignore[assignment]
        if self._timer_cancelled_count:  # type: ignore[attr-defined]  # timers cancelled while in the heap
            self._purge_cancelled(timers)
        ready = self._ready  # type: ignore[attr-defined]
        if ready or self._stopping:  # type: ignore[attr-defined]
            # Callbacks are ready: run them without a system call. A thread's wake-up is seen at
            # the latest when the loop next goes idle, before the clock moves (or 64 rounds on).
            self._polls_skipped += 1
            if self._polls_skipped >= _POLL_EVERY:
                self._poll(0)
        elif self._holds or self._threads_work():
            # A worker thread works: time stands still until it reports, through
            # `call_soon_threadsafe`, which wakes the selector.
            self._poll(None)
        elif timers and timers[0][0] < math.inf:
            self._poll(0)
            if not ready:  # every task waits: time passes at once
                self._virtual_now = max(self._virtual_now, timers[0][0])
        else:
            # No timer, or only those at infinity (`anyio.sleep_forever()`), which never fire (a
            # real loop, and trio's autojump, do not reach them either): only another thread or
            # a socket can wake the loop. Jumping there would set the clock to inf for the rest
            # of the run.
            self._wait_for_outside()
        now = self._virtual_now
        while timers and timers[0][0] <= now:
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False  # type: ignore[attr-defined]
            if handle._cancelled:
                # Cancelled behind the head (so not purged): it leaves the heap here, and the count.
                self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
            else:
                ready.append(handle)
        # Run the callbacks ready now; those they schedule run next round (as asyncio does).
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            try:  # `handle._run()`, inline: a Python call fewer for every callback
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._callback_failed(handle, exc)

    def _callback_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """Report a callback's exception to the loop's exception handler, as asyncio's
        ``Handle._run`` does."""
        context: dict[str, Any] = {
            "message": f"Exception in callback {format_helpers._format_callback_source(handle._callback, handle._args)}",  # type: ignore[attr-defined]
            "exception": exc,
            "handle": handle,
        }
        if handle._source_traceback:  # type: ignore[attr-defined]
            context["source_traceback"] = handle._source_traceback  # type: ignore[attr-defined]
        self.call_exception_handler(context)

    def _wait_for_outside(self) -> None:
        """Wait for a thread or a socket to wake the loop, `deadlock_s` at most; raise `Deadlock` then."""
        events = self._selector.select(None if self.deadlock_s == math.inf else self.deadlock_s)  # type: ignore[attr-defined]
        if not events:
            raise Deadlock(_deadlock_message(self))
        self._polls_skipped = 0
        self._process_events(events)  # type: ignore[attr-defined]

    def _poll(self, timeout: float | None) -> None:
        self._polls_skipped = 0
        self._process_events(self._selector.select(timeout))  # type: ignore[attr-defined]

    def _purge_cancelled(self, timers: list[tuple[float, int, asyncio.TimerHandle]]) -> None:
        """Drop cancelled timers: all of them when they are most of the heap, else those at its head."""
        cancelled = self._timer_cancelled_count  # type: ignore[attr-defined]
        if len(timers) > _MIN_TIMERS_TO_PURGE and cancelled / len(timers) > _PURGE_CANCELLED_FRACTION:
            for _, _, handle in timers:
                if handle._cancelled:
                    handle._scheduled = False  # type: ignore[attr-defined]
            timers[:] = [t for t in timers if not t[2]._cancelled]
            heapq.heapify(timers)
            self._timer_cancelled_count = 0
            return
        while timers and timers[0][2]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]


def _deadlock_message(loop: VirtualTimeLoop) -> str:
    waiting = [task for task in asyncio.all_tasks(loop) if not task.done()]
    named = ", ".join(f"{task.get_name()!r} at {_waits_at(task)}" for task in waiting[:_DEADLOCK_TASKS_NAMED])
    more = f", and {len(waiting) - _DEADLOCK_TASKS_NAMED} more" if len(waiting) > _DEADLOCK_TASKS_NAMED else ""
    return (
        f"virtual time stands still at {loop.time():g} s: every task waits, no timer is set, no worker thread "
        f"works, and nothing woke the loop for {loop.deadlock_s:g} s of real time (a deadlock). "
        f"{len(waiting)} task{'s wait' if len(waiting) != 1 else ' waits'}: {named}{more}"
    )


def _waits_at(task: asyncio.Task[Any]) -> str:
    """Where `task` waits: the innermost frame of its chain of awaits outside asyncio and anyio
    (inside them where it has none: a task that runs ``anyio.Event().wait`` itself)."""
    inner = outer = None
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is not None:
            inner = frame
            if not frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
                outer = frame
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None) or getattr(awaited, "ag_await", None)
    frame = outer or inner
    return "?" if frame is None else f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


async def run_sync_in_thread(fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, with a virtual clock held still while it runs.

    On a virtual clock (`VirtualTimeLoop`, or trio's ``MockClock``) the clock does not jump while
    the thread works: its work takes no virtual time, and no timer fires meanwhile, so a timeout
    around it cannot cut it off. The hold ends with the call, also when a cancellation leaves the
    thread behind (``abandon_on_cancel``). A thread that never returns, or that waits on the
    loop's timers (``anyio.from_thread.run(anyio.sleep, ...)``), therefore holds virtual time
    still for good. On a real clock this is ``anyio.to_thread.run_sync``, nothing more.
    """
    release = _hold_virtual_clock()
    try:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)
    finally:
        if release is not None:
            release()


@dataclass(slots=True)
class _AutojumpHold:
    threshold: float  # the clock's own, put back when the last hold is released
    count: int = 0


#: The holds on each trio MockClock (a clock is not ours to add attributes to).
_autojump_holds: weakref.WeakKeyDictionary[Any, _AutojumpHold] = weakref.WeakKeyDictionary()


def _hold_virtual_clock() -> Callable[[], None] | None:
    """Keep the running loop's virtual clock from jumping until the function returned is called;
    None on a real clock."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        loop = asyncio.get_running_loop()
        return loop.hold_clock() if isinstance(loop, VirtualTimeLoop) else None
    if library != "trio":
        return None
    import trio.testing

    clock = trio.lowlevel.current_clock()
    if not isinstance(clock, trio.testing.MockClock):
        return None
    # An infinite threshold turns autojump off (trio's default); the IO wait then sleeps for real
    # until the thread reports back, and `jump()` still works.
    hold = _autojump_holds.get(clock)
    if hold is None:
        hold = _autojump_holds[clock] = _AutojumpHold(clock.autojump_threshold)
        clock.autojump_threshold = math.inf
    hold.count += 1

    def release() -> None:
        hold.count -= 1
        if not hold.count:
            del _autojump_holds[clock]
            clock.autojump_threshold = hold.threshold

    return release


def run_virtual(fn: Callable[..., Awaitable[T]], *args: Any, loop: Loop = "asyncio") -> T:
    """``anyio.run(fn, *args)`` on virtual time, on the asyncio or the trio event loop."""
    if loop == "asyncio":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"loop_factory": VirtualTimeLoop})
    if loop == "trio":
        clock = _thread_aware_mock_clock()
        # Ctrl-C at the main task's next checkpoint, not wherever the signal lands: raised inside
        # a session's task or in `start_soon`, it left a coroutine never awaited, or the
        # simulation running on.
        # trio.run itself, not anyio.run(backend="trio"): anyio before 4.14 dropped its
        # `backend_options`, and the run went on trio's real clock, an hour in an hour.
        import trio

        return trio.run(fn, *args, clock=clock, restrict_keyboard_interrupt_to_checkpoints=True)
    raise ValueError(f"loop: expected one of {', '.join(LOOPS)}, got {loop!r}")


def _thread_aware_mock_clock() -> Any:
    """trio's ``MockClock(autojump_threshold=0)``, which does not jump while a call of
    ``trio.to_thread.run_sync`` (anyio's, on trio) is in a worker thread."""
    import trio.testing

    clock = trio.testing.MockClock(autojump_threshold=0)
    jump = clock._autojump  # trio calls it when every task has been idle for the threshold

    def jump_unless_a_thread_works() -> None:
        # The class is final, so this clock's own method is replaced. While a thread works, wait
        # for it for real, a millisecond at a time (not a busy loop), instead of jumping.
        if trio.testing.active_thread_count():
            time.sleep(_THREAD_POLL_S)  # wall-clock ok: the virtual clock waits for a real thread
        else:
            jump()

    clock._autojump = jump_unless_a_thread_works  # type: ignore[method-assign]
    return clock
