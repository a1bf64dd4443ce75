"""Park a task until another unparks it with no await: the cheapest wait of the running library.

Two hot wake-ups use it: the simulator's consumer waiting for tokens (once per streamed chunk)
and the dispatcher's call waiting for its place in the window. Under trio the task parks itself
(``wait_task_rescheduled`` / ``reschedule``: no event object per wait), under asyncio it awaits a
bare future; elsewhere it uses one `anyio.Event` per wait. The handle lives in ``holder.waiter``;
whoever unparks clears it first, so a task is never rescheduled twice. A parked task can be
cancelled like any waiting task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import sniffio

Park = Callable[[Any], Awaitable[None]]
Unpark = Callable[[Any], None]


async def park_event(holder: Any) -> None:
    event = holder.waiter = anyio.Event()
    try:
        await event.wait()
    finally:
        if holder.waiter is event:
            holder.waiter = None


def unpark_event(holder: Any) -> None:
    event = holder.waiter
    if event is not None:
        holder.waiter = None
        event.set()


def parking_for_current_library() -> tuple[Park, Unpark]:
    """The (park, unpark) pair for the running async library."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return _asyncio_parking()
    if library != "trio":
        return park_event, unpark_event

    from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

    async def park(holder: Any) -> None:
        holder.waiter = current_task()

        def abort(_: object) -> Abort:
            holder.waiter = None
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)

    def unpark(holder: Any) -> None:
        task = holder.waiter
        if task is not None:
            holder.waiter = None
            reschedule(task)

    return park, unpark


def _asyncio_parking() -> tuple[Park, Unpark]:
    import asyncio

    async def park(holder: Any) -> None:
        future = holder.waiter = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            if holder.waiter is future:
                holder.waiter = None

    def unpark(holder: Any) -> None:
        future = holder.waiter
        if future is not None:
            holder.waiter = None
            if not future.done():
                future.set_result(None)

    return park, unpark


def current_task() -> object:
    """The running task, as its library knows it (cheaper than `anyio.get_current_task`, which
    makes a `TaskInfo` each time): only to compare with another task, by identity."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        import asyncio

        return asyncio.current_task()
    if library == "trio":
        import trio

        return trio.lowlevel.current_task()
    return anyio.get_current_task().id
