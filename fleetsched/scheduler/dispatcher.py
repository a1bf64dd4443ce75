"""The dispatcher: every model call of every session passes through here to the backend.

A call first takes a place in the backend's in-flight window. While the window has room and no
call waits, it goes straight through (the fast path: no task switch, no allocation beyond the
call's record). Otherwise it waits in a `FairQueue` (tier bands, fair share between tenants by
virtual token counters, earliest deadline first within a tenant) and is handed a place when a
call ahead of it finishes. The order is decided here, before the engine, because the engine
itself never preempts a running request for a waiting high-priority one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from ..backends.base import Backend, ChatBody, Chunk, collect_chat, estimate_prompt_tokens
from ..errors import DeadlineExceeded
from ..policies.fair_queue import Entry, FairQueue
from .records import CallRecord, Recorder

#: VTC weights: a prompt token costs 1, a generated token 2.
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    window: int
    in_flight: int
    queued: int
    queued_by_tier: Mapping[int, int]
    calls_started: int


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


class Dispatcher:
    """Orders model calls into one backend through an in-flight window."""

    def __init__(
        self,
        backend: Backend,
        *,
        window: int,
        weights: Mapping[str, float] | None = None,
        aging_s: float | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"in-flight window must be >= 1, got {window}")
        self.backend = backend
        self.window = window
        self.recorder = recorder if recorder is not None else Recorder()
        self._queue = FairQueue(weights, aging_s=aging_s)
        self._in_flight = 0
        self._started = 0

    # -- the call path ---------------------------------------------------------------------------

    async def chat(
        self, body: ChatBody, *, tenant: str, tier: int, session: int = 0, due: float = math.inf, deadline: float = math.inf
    ) -> dict[str, Any]:
        """Make one call and return the whole ``chat.completion`` response dict."""
        async with self.stream(body, tenant=tenant, tier=tier, session=session, due=due, deadline=deadline) as chunks:
            return collect_chat([chunk async for chunk in chunks])

    @asynccontextmanager
    async def stream(
        self, body: ChatBody, *, tenant: str, tier: int, session: int = 0, due: float = math.inf, deadline: float = math.inf
    ) -> AsyncIterator[AsyncIterator[Chunk]]:
        """``async with dispatcher.stream(body, ...) as chunks: async for chunk in chunks: ...``

        `due` orders calls within a tenant (earliest first); `deadline` is the session's: a call
        made after it raises `DeadlineExceeded` without reaching the backend. Leaving the block
        early aborts the call at the engine.
        """
        now = anyio.current_time()
        if now > deadline:
            raise DeadlineExceeded(f"session {session} made a model call {now - deadline:.3f} s after its deadline")
        estimate = estimate_prompt_tokens(body)
        record = CallRecord(tenant, tier, session, now)
        await self._acquire(tenant, tier, estimate * INPUT_WEIGHT, due, now)
        try:
            record.started = anyio.current_time()
            upstream = self.backend.stream_chat({**body, "priority": tier})
            try:
                yield self._observe(upstream, record)
            finally:
                with anyio.move_on_after(5, shield=True):
                    await upstream.aclose()
        except BaseException as exc:
            record.error = type(exc).__name__
            raise
        finally:
            end = anyio.current_time()
            record.finished = end
            record.backend_s = end - record.started
            self._release()
            # Correct the prompt estimate and charge the output, now that both are known.
            if record.prompt_tokens or record.completion_tokens:
                self._queue.charge(
                    tenant, (record.prompt_tokens - estimate) * INPUT_WEIGHT + record.completion_tokens * OUTPUT_WEIGHT
                )
            self.recorder.add_call(record)

    async def _observe(self, upstream: AsyncIterator[Chunk], record: CallRecord) -> AsyncIterator[Chunk]:
        async for chunk in upstream:
            if math.isnan(record.first_token) and chunk.get("choices"):
                record.first_token = anyio.current_time()
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens", 0)
                record.completion_tokens = usage.get("completion_tokens", 0)
            yield chunk

    # -- the window ------------------------------------------------------------------------------

    async def _acquire(self, tenant: str, tier: int, cost: float, due: float, now: float) -> None:
        if self._in_flight < self.window and not self._queue:
            self._in_flight += 1
            self._started += 1
            self._queue.serve_direct(tenant, tier, cost)
            return
        waiter = _Waiter()
        entry = self._queue.push(Entry(tenant, tier, now, waiter, cost, due))
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self._release()
            else:
                self._queue.remove(entry)
            raise

    def _release(self) -> None:
        self._in_flight -= 1
        self._grant()

    def _grant(self) -> None:
        now = anyio.current_time() if self._queue else 0.0
        while self._in_flight < self.window and self._queue:
            entry = self._queue.pick(now)
            assert entry is not None
            self._in_flight += 1
            self._started += 1
            entry.item.granted = True
            entry.item.event.set()

    def resize(self, window: int) -> None:
        """Change the in-flight window (the adaptive window policy calls this)."""
        if window < 1:
            raise ValueError(f"in-flight window must be >= 1, got {window}")
        self.window = window
        self._grant()

    def statistics(self) -> DispatcherStatistics:
        by_tier: dict[int, int] = {}
        for (_, tier), n in self._queue.queued_by().items():
            by_tier[tier] = by_tier.get(tier, 0) + n
        return DispatcherStatistics(self.window, self._in_flight, len(self._queue), by_tier, self._started)
