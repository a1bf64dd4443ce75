"""A session's handle: its lifecycle, timestamps and figures, awaitable for the agent's result."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from .._parking import current_task
from ..errors import SessionCancelled, SessionFailed
from ..policies.tiers import Tier

if TYPE_CHECKING:
    from ..agents.context import SessionContext
    from ..policies.fair_queue import Entry
    from ..resources.memory import Reservation

T = TypeVar("T")  # what an agent returns

#: An agent: an async callable taking its session's context. ``Agent[str]`` returns a str;
#: `Scheduler.submit` types its handle by it (``SessionHandle[str]``).
Agent = Callable[["SessionContext"], Awaitable[T]]


class SessionState(StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({SessionState.DONE, SessionState.FAILED, SessionState.CANCELLED, SessionState.REJECTED})


class Activity(StrEnum):
    """What a running session is doing right now."""

    THINKING = "thinking"
    MODEL_CALL = "model_call"
    TOOL = "tool"


# The members that every session or every model call sets, as module globals for those paths: on
# Python 3.11 reading `SessionState.DONE` goes through the enum metaclass's `__getattr__` hook,
# about 900 instructions, against some 100 for a global.
QUEUED, ADMITTED, RUNNING, DONE = SessionState.QUEUED, SessionState.ADMITTED, SessionState.RUNNING, SessionState.DONE
THINKING, MODEL_CALL, TOOL = Activity.THINKING, Activity.MODEL_CALL, Activity.TOOL


@dataclass(slots=True)
class SessionCounters:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0
    #: Seconds waited to be re-admitted after tools that released the session's slot.
    readmit_wait_s: float = 0.0


_ids = itertools.count(1)


class SessionHandle(Generic[T]):
    """One submitted session. ``await handle`` returns the agent's result (a `T`).

    Awaiting raises `SessionFailed` (the agent's exception as ``__cause__``) if the agent raised,
    `SessionCancelled` if it was cancelled. `cancel()` works in every state and is idempotent.
    """

    def __init__(
        self,
        agent: Agent[T],
        *,
        tenant: str,
        tier: Tier,
        memory: int,
        deadline: float,
        name: str | None = None,
        kind: str = "agent",
        expected_s: float | None = None,
    ) -> None:
        self.id = next(_ids)
        self.name = name or f"session-{self.id}"
        self.kind = kind
        self.agent = agent
        self.tenant = tenant
        self.tier = tier
        self.memory = memory
        #: Absolute deadline on the scheduler's clock (inf: none).
        self.deadline = deadline
        #: How long the session is expected to run once admitted (a placement hint), or None.
        self.expected_s = expected_s
        self.state = QUEUED
        self.activity: Activity | None = None
        self.timestamps: dict[SessionState, float] = {}
        self.counters = SessionCounters()
        self.reservation: Reservation | None = None
        #: The replica its memory was on when it parked in a tool, where it is re-admitted if its
        #: memory fits there (that replica's prefix cache holds its conversation); else None.
        self._replica: str | None = None
        self._memory_since = 0.0  # when it was given the memory it holds (admitted, re-admitted)
        self.result: T | None = None  # the agent's result, once it is DONE
        self.error: BaseException | None = None
        self._entry: Entry | None = None
        self._scope: anyio.CancelScope | None = None
        self._on_cancel_queued: Callable[[SessionHandle], None] | None = None
        self._cancel_requested = False
        self._holds_slot = False
        self._park_timer: anyio.CancelScope | None = None
        self._queue_timer: anyio.CancelScope | None = None  # fails it at its deadline while queued
        self._readmit: anyio.Event | None = None
        self._readmit_entry: Entry | None = None
        self._readmitting: anyio.Lock | None = None  # one re-admission at a time (made when needed)
        self._readmit_error: BaseException | None = None  # why it can never be re-admitted
        #: Model calls of the session under way (it is not parked meanwhile).
        self.calls_in_flight = 0
        #: Times its slot and memory were released during a tool call.
        self.parked_count = 0
        self._done = anyio.Event()
        #: The task that runs the agent, while it does (see `wait`).
        self._task: object | None = None
        #: The thread of the event loop that runs the session (see `cancel`).
        self._thread = threading.get_ident()

    # -- inspection ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.state.terminal

    @property
    def parked(self) -> bool:
        """Whether its slot and memory are lent to others while it is in a tool call. Once it
        waits to be re-admitted (its tool period over) it is queued instead, not parked."""
        return self.state is SessionState.RUNNING and not self._holds_slot and self._readmit is None

    def waited_s(self) -> float:
        """Seconds from submission to admission (so far, if still queued; nan for a session that
        ended without being admitted: cancelled, rejected or past its deadline in the queue)."""
        start = self.timestamps[SessionState.QUEUED]
        end = self.timestamps.get(SessionState.ADMITTED, anyio.current_time() if not self.done else math.nan)
        return end - start

    def duration_s(self) -> float:
        """Seconds from submission to the end (nan while unfinished)."""
        ends = [self.timestamps[s] for s in _TERMINAL if s in self.timestamps]
        return ends[0] - self.timestamps[SessionState.QUEUED] if ends else math.nan

    def __repr__(self) -> str:
        return f"<SessionHandle {self.name} tenant={self.tenant} tier={self.tier} {self.state}>"

    # -- control -----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Cancel the session: a queued one leaves the queue, a running one is cancelled."""
        if self.done:
            # Nothing to cancel. Its cancel scope, cancelled again, asked asyncio for the running
            # loop: after `anyio.run` returned, this raised "no running event loop".
            return
        if threading.get_ident() != self._thread:
            # From another thread a queued session left the queue, then failed to end (no event
            # loop there): it stayed counted, and the scheduler's exit waited for it for ever.
            raise RuntimeError(
                f"{self.name}: cancel() was called from a thread other than its event loop's; "
                "call it there: anyio.from_thread.run_sync(handle.cancel) from a worker thread, portal.call(handle.cancel) "
                "through a blocking portal"
            )
        self._cancel_requested = True
        if self.state is SessionState.QUEUED and self._on_cancel_queued is not None:
            self._on_cancel_queued(self)
        elif self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> T:
        self._refuse_own_task()
        await self._done.wait()
        if self.state is SessionState.DONE:
            return self.result  # type: ignore[return-value]  # T, which may be None itself
        if self.state is SessionState.CANCELLED:
            raise SessionCancelled(f"{self.name} was cancelled")
        raise SessionFailed(f"{self.name} {self.state}: {_described(self.error)}") from self.error

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()

    async def ended(self) -> None:
        """Wait until the session ends, whatever its outcome (nothing raised)."""
        self._refuse_own_task()
        await self._done.wait()

    def _refuse_own_task(self) -> None:
        if self._task is not None and self._task is current_task():
            # It would wait for itself: hung until its deadline, if it has one, for ever if not.
            raise RuntimeError(f"{self.name}: an agent cannot wait for its own session to end (it would wait for itself)")

    # -- used by the scheduler -------------------------------------------------------------------

    def _set_state(self, state: SessionState, now: float) -> None:
        self.state = state
        self.timestamps[state] = now
        if state.terminal:
            self.activity = None
            self._done.set()


def _described(error: BaseException | None) -> str:
    """`repr(error)`, or its type alone when its own `__repr__` fails: that failure replaced the
    `SessionFailed`, and the agent's error was lost to whoever awaited the handle."""
    try:
        return repr(error)
    except Exception as exc:
        return f"{type(error).__name__} (its repr raised {type(exc).__name__})"
