"""Park a consumer task until the engine has tokens for it; the engine unparks it with no await.

This is the one hot wake-up path of the simulator (once per streamed chunk), so it uses the
cheapest wait of the running library: under trio the task parks itself (``wait_task_rescheduled``
/ ``reschedule``: no event object per token), under asyncio it awaits a bare future; elsewhere it
uses one `anyio.Event` per wait. The handle lives in ``request.waiter``; whoever
unparks clears it first, so a task is never rescheduled twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import sniffio

Park = Callable[[Any], Awaitable[None]]
Unpark = Callable[[Any], None]


async def park_event(request: Any) -> None:
    event = request.waiter = anyio.Event()
    try:
        await event.wait()
    finally:
        if request.waiter is event:
            request.waiter = None


def unpark_event(request: Any) -> None:
    event = request.waiter
    if event is not None:
        request.waiter = None
        event.set()


def parking_for_current_library() -> tuple[Park, Unpark]:
    """The (park, unpark) pair for the running async library."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return _asyncio_parking()
    if library != "trio":
        return park_event, unpark_event

    from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

    async def park(request: Any) -> None:
        request.waiter = current_task()

        def abort(_: object) -> Abort:
            request.waiter = None
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)

    def unpark(request: Any) -> None:
        task = request.waiter
        if task is not None:
            request.waiter = None
            reschedule(task)

    return park, unpark


def _asyncio_parking() -> tuple[Park, Unpark]:
    import asyncio

    async def park(request: Any) -> None:
        future = request.waiter = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            if request.waiter is future:
                request.waiter = None

    def unpark(request: Any) -> None:
        future = request.waiter
        if future is not None:
            request.waiter = None
            if not future.done():
                future.set_result(None)

    return park, unpark
