"""Telling a cancellation from a ``CancelledError`` that code raised on its own (asyncio)."""

from __future__ import annotations

import asyncio


def stray_cancelled_error(exc: BaseException) -> bool:
    """Whether `exc` is an asyncio ``CancelledError`` raised while the current task is not being
    cancelled (``Task.cancelling()`` is 0): code awaited a future that something else cancelled,
    say. That is the code's own failure; passed on as a cancellation, it would cancel the task
    group around it and everything in it. False outside an asyncio task (trio has its own
    cancellation class)."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop running
        return False
    return task is not None and task.cancelling() == 0
