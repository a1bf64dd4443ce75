"""`SessionContext`: what an agent sees of the scheduler.

An agent is an async callable taking one `SessionContext`. Through it the agent makes model
calls (routed through the dispatcher with the session's tenant, tier and deadline) and marks
its tool time, so the scheduler knows the session's pace.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from ..backends.base import Chunk, Received
from ..errors import InvalidRequest, SessionEnded
from ..scheduler.records import CANCELLED
from ..scheduler.session import MODEL_CALL, THINKING, TOOL

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from ..resources.memory import Reservation
    from ..scheduler.dispatcher import Dispatcher
    from ..scheduler.session import SessionHandle

logger = logging.getLogger(__name__)


def _idle(reservation: Reservation) -> None:
    """Mark `reservation` movable: its session is idle. The pool may serve its waiters and tell
    its owner's listeners then (the room a move would open), and a callback of theirs that
    raised failed this session, which had only gone into a tool: logged, as after a release."""
    try:
        reservation.movable = True
    except Exception:
        logger.exception("a callback of the memory pool failed as %r went idle", reservation)


class _Chunks:
    """The chunks of one `SessionContext.stream` call as its agent reads them: the last usage
    they carried is kept, and they are read inside the call's block only.

    A class, not an async generator: a read cut short (a timeout around one ``__anext__``)
    throws into a generator, which then ends for good, and the next read ended the stream
    quietly: the answer cut short, and nothing said so. Here it raises."""

    def __init__(self, chunks: AsyncIterator[Chunk]) -> None:
        self._chunks = chunks
        self.usage: dict[str, int] = {}
        self.block_open = True
        self._cut: str | None = None  # what cut a read short

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> Chunk:
        if self._cut is not None:
            raise RuntimeError(f"a read of this stream was cut short ({self._cut}): its call ended there, its answer incomplete")
        if not self.block_open:
            raise RuntimeError("a stream of ctx.stream() is read inside its `async with` block only")
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException as exc:
            self._cut = type(exc).__name__
            raise
        if chunk.get("usage"):
            self.usage.update(chunk["usage"])
        return chunk


class SessionContext:
    """The running session's view: identity, deadline, reservation, model calls, tool marks."""

    def __init__(
        self, handle: SessionHandle, dispatcher: Dispatcher, *, model: str, ttft_slo_s: float = math.inf, pace: Any = None
    ) -> None:
        """`pace` (the scheduler) is told when tools start and end, `tool_started(handle, name, now)`
        and ``await tool_finished(handle, name, seconds, readmit=..., complete=...)``, and asked before a model
        call ``await busy(handle)``: a session parked in a tool waits there to be re-admitted."""
        self._pace = pace
        self._handle = handle
        self._dispatcher = dispatcher
        self.model = model
        self._ttft_slo_s = ttft_slo_s
        self._openai: AsyncOpenAI | None = None
        #: `tool` blocks open, in every task of the session: the tool period lasts from the first
        #: one's start to the last one's end.
        self._tools_open = 0
        self._tool_idle = False  # the tool period has seen no model call of its own
        self._tool_name = ""
        self._tool_start = 0.0
        #: Streams of ``ctx.openai`` whose call is under way; closed when the session ends.
        self._open_streams: set[Any] = set()
        self._ending = False  # the session's end is closing its streams
        #: Set when the session ended under calls made from tasks outside it: called when the
        #: last of them ends (the scheduler gives the session's memory back then).
        self._after_calls: Callable[[], None] | None = None

    @property
    def session_id(self) -> int:
        return self._handle.id

    @property
    def tenant(self) -> str:
        return self._handle.tenant

    @property
    def tier(self) -> int:
        return self._handle.tier

    @property
    def deadline(self) -> float:
        """Absolute deadline on `anyio.current_time()`'s clock (inf: none)."""
        return self._handle.deadline

    @property
    def reservation(self) -> Reservation | None:
        return self._handle.reservation

    @property
    def openai(self) -> AsyncOpenAI:
        """A real ``openai.AsyncOpenAI`` client whose requests go through this session's dispatcher.

        Chat completions (streaming or not, with tools) work as against a server; the SDK's own
        retries are off, since fleetsched decides retries and order. No timeout unless the agent
        sets one (``timeout=`` on a call, or ``with_options``): the session's deadline bounds it.
        One the agent closed (``async with ctx.openai as client:``) is replaced by a new one.
        """
        if self._openai is None or self._openai.is_closed():
            import openai

            from .transport import SessionTransport

            self._openai = openai.AsyncOpenAI(
                base_url="http://fleetsched.invalid/v1",
                api_key="fleetsched-session",
                max_retries=0,
                timeout=None,  # not the SDK's 600 s: a call may wait its turn in a long simulated run
                http_client=httpx.AsyncClient(transport=SessionTransport(self)),
            )
        return self._openai

    def _body(self, messages: Sequence[Mapping[str, Any]] | None, body: Mapping[str, Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if body is None:
            out = {}
        elif type(body) is dict or isinstance(body, Mapping):  # dict() would take pairs, and fail on the rest unnamed
            out = dict(body)
        else:
            raise InvalidRequest(f"body: expected a chat-completions request (a dict), got {body!r:.80}")
        # A list, the usual, is spared the checks against the ABCs (about 3,000 instructions each).
        # list() would take a string or a mapping apart, and fail on a number without naming it.
        if type(messages) is not list and messages is not None:
            if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
                raise InvalidRequest(f"messages: expected a list of {{role, content}} objects, got {messages!r:.80}")
        if messages is not None:
            out["messages"] = list(messages)
        out.update(kwargs)
        out.setdefault("model", self.model)
        if "messages" not in out:  # an InvalidRequest (a ValueError), as for messages of the wrong form
            raise InvalidRequest("messages: a chat call needs a list of messages")
        return out

    async def chat(
        self, messages: Sequence[Mapping[str, Any]] | None = None, *, body: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """One chat completion (OpenAI request fields as keywords); returns the response dict."""
        request = self._body(messages, body, kwargs)
        handle = self._handle
        received = Received()
        handle.calls_in_flight += 1  # from here: the session is not parked under the call
        try:
            if self._tools_open or not handle._holds_slot:  # in a tool period, parked, or ended
                await self._busy()
            handle.activity = MODEL_CALL
            response = await self._dispatcher.chat(request, **self._route(), received=received)
        except BaseException as exc:
            # Cut short at the engine (cancelled, timed out): a call made, as its record has it,
            # with what the engine made for it (the record's counts, `Dispatcher.chat`). Left
            # out, a session's counts fell short of its calls' records by every call it cut.
            if received.sent and type(exc).__name__ in CANCELLED:
                counts = {"prompt_tokens": received.prompt_tokens, "completion_tokens": received.output_tokens}
                self._count(counts if received.prompt_tokens else {})  # the engine's, once it gave them
            raise
        finally:
            self._call_ended()
        self._count(response.get("usage") or {})
        return response

    @asynccontextmanager
    async def stream(
        self, messages: Sequence[Mapping[str, Any]] | None = None, *, body: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[AsyncIterator[Chunk]]:
        """``async with ctx.stream(messages) as chunks: async for chunk in chunks: ...``"""
        request = self._body(messages, body, kwargs)
        handle = self._handle
        counted: _Chunks | None = None
        handle.calls_in_flight += 1  # from here: the session is not parked under the call
        try:
            if self._tools_open or not handle._holds_slot:  # in a tool period, parked, or ended
                await self._busy()
            handle.activity = MODEL_CALL
            async with self._dispatcher.stream(request, **self._route()) as chunks:
                counted = _Chunks(chunks)
                yield counted
        except BaseException:
            # The block raised: the agent's own exception, or a read cut short (cancelled, timed
            # out), after the tokens it read. The call was made, as a `break` leaves one made, and
            # as its record has it. A read that failed is no call made (nor is a call refused).
            if counted is not None and (counted._cut is None or counted._cut in CANCELLED):
                self._count(counted.usage)
            raise
        finally:
            if counted is not None:
                counted.block_open = False
            self._call_ended()
        assert counted is not None
        self._count(counted.usage)  # a call made, as `chat` counts: not one refused or failed

    @asynccontextmanager
    async def tool(self, name: str) -> AsyncIterator[None]:
        """Mark the block as time spent in tool `name`.

        Meanwhile the session's memory may be moved by a compaction, or its slot and memory lent
        to waiting sessions (the scheduler's keep-or-release policy); leaving the block then
        waits until the session is re-admitted (not when the block raises: the exception goes on
        at once, and the session's next model call, if any, re-admits it). Blocks nested or open
        at once in several tasks of the session make one tool period, from the first's start to
        the last's end; a model call inside it ends the session's idleness (it is re-admitted
        first if it was parked).
        """
        if not isinstance(name, str):
            raise TypeError(f"tool name: expected a str, got {name!r:.80}")
        self._check_live()
        handle = self._handle
        self._tools_open += 1
        if self._tools_open == 1:  # the session's tool period begins
            now = anyio.current_time()
            self._tool_name, self._tool_start = name, now
            self._tool_idle = True
            handle.activity = TOOL
            if handle.reservation is not None and not handle.calls_in_flight:
                _idle(handle.reservation)  # a compaction may move its memory meanwhile
            if self._pace is not None:
                self._pace.tool_started(handle, name, now)
        try:
            yield
        except BaseException as exc:
            # Cancelled (its session, or a scope around the block): the tool was cut short, and
            # its time so far is no duration of the tool to learn.
            await self._tool_left(readmit=False, complete=not isinstance(exc, anyio.get_cancelled_exc_class()))
            raise
        await self._tool_left(readmit=True)

    async def _tool_left(self, readmit: bool, complete: bool = True) -> None:
        """A `tool` block was left; the last one ends the tool period: the memory is pinned
        again, and a parked session is re-admitted if `readmit`. The period's duration is
        learned only if `complete` (not cut short by a cancellation)."""
        handle = self._handle
        self._tools_open -= 1
        if self._tools_open == 0 and not handle.done:  # an ended session's record is written
            if handle.reservation is not None:
                handle.reservation.movable = False
            seconds = anyio.current_time() - self._tool_start
            handle.counters.tool_calls += 1
            handle.counters.tool_s += seconds
            if self._pace is not None:
                await self._pace.tool_finished(handle, self._tool_name, seconds, readmit=readmit, complete=complete)
            # Another task may have begun a tool period while this one waited to be re-admitted.
            handle.activity = TOOL if self._tools_open else THINKING

    def _check_live(self) -> None:
        handle = self._handle
        if handle.done or self._ending:
            raise SessionEnded(
                f"{handle.name} has ended ({handle.state if handle.done else 'ending'}): its context makes no more "
                "model calls and marks no tools (a task that outlived the agent kept it)"
            )

    async def _busy(self) -> None:
        """Before a model call: the session must be live, and hold its slot and memory (a model
        call inside a tool period ends the session's idleness)."""
        self._check_live()
        handle = self._handle
        if self._tools_open:
            self._tool_idle = False
            if handle.reservation is not None:
                handle.reservation.movable = False
        if self._pace is not None:
            await self._pace.busy(handle)
        self._check_live()  # it may have ended while it waited to be re-admitted

    def _call_ended(self) -> None:
        handle = self._handle
        handle.calls_in_flight -= 1
        if self._after_calls is not None:  # the session has ended: this call was made from outside it
            if not handle.calls_in_flight:
                after, self._after_calls = self._after_calls, None
                after()
            return
        if handle.done:  # a call refused after the end (`SessionEnded`) changes nothing
            return
        if not self._tools_open:  # the common case
            handle.activity = THINKING
            return
        handle.activity = TOOL
        if self._tool_idle and not handle.calls_in_flight:
            # The last call under way ended inside a tool period that began after it: idle now.
            if handle.reservation is not None:
                _idle(handle.reservation)
            if self._pace is not None:
                self._pace.call_ended(handle)

    async def _close(self) -> None:
        """The session ended: end the calls of ``ctx.openai`` streams still under way. Ending one
        waits for the task that reads it ahead (`_start_soon`), and a task still reading it may run
        meanwhile: the session counts as ended from here on, so that such a task gets `SessionEnded`."""
        self._ending = True
        while self._open_streams:
            await self._open_streams.pop().aclose()

    def _start_soon(self, func: Callable[[], Awaitable[None]], name: str) -> None:
        """Run `func` beside the session, in the scheduler's task group: a ``ctx.openai`` stream
        is read to its end there whether or not the agent reads on (it may be in a tool), so that
        its call ends when the engine's answer does. Such a task must not raise, and ends by the
        session's end (`_close`)."""
        task_group = getattr(self._pace, "_task_group", None)
        if task_group is None:
            raise RuntimeError("a streamed ctx.openai call needs the context of a session that a Scheduler runs")
        task_group.start_soon(func, name=name)

    def _route(self) -> dict[str, Any]:
        """The dispatcher's arguments for a call of this session: who, how urgent, where.

        `due_in` is how long after the call's arrival its first token is due under the tenant's
        TTFT objective (inf: none; the dispatcher adds the arrival time it reads);
        `replica` is the one the session's memory is placed on (affinity).
        """
        handle = self._handle
        reservation = handle.reservation
        return {
            "tenant": handle.tenant,
            "tier": handle.tier,
            "session": handle.id,
            "due_in": self._ttft_slo_s,
            "deadline": handle.deadline,
            "replica": reservation.device if reservation is not None else None,
        }

    def _count(self, usage: Mapping[str, int]) -> None:
        counters = self._handle.counters
        counters.calls += 1
        counters.prompt_tokens += usage.get("prompt_tokens", 0)
        counters.completion_tokens += usage.get("completion_tokens", 0)
