"""Gateway sessions: calls that share an ``X-Session-ID`` run as one scheduler session.

The first call of a session submits a scheduler session for the key's tenant, so it waits for
admission (a session slot and a memory reservation) like an in-process agent. The session's
agent does not make the calls itself: it hands each arriving call a turn, waits until the call
is over, and then sits in a tool period (``ctx.tool("client")``) until the next call comes. The
time between two calls is the client's tool or think time, so the scheduler's keep-or-release
policy applies across HTTP calls: it may lend the session's slot and memory to waiting sessions,
and then the next call waits for re-admission. After `idle_s` without a call the session ends,
or at once when its client says it is over (`SessionTable.end`, after the calls already
waiting for it).

Calls of one session are served one at a time, in arrival order. The call itself runs in the
request's own task (so a client disconnect cancels it at once) with the session's identity,
tier and deadline. A session past its tenant's ``sla.deadline_s`` ends: its call under way gets a
408 (an error event if streamed), and its id is refused with a 408 for an idle period after, on
every instance (the shared state holds the mark).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from ..agents.context import SessionContext
from ..errors import DeadlineExceeded, SchedulerClosed
from ..scheduler import Scheduler
from ..scheduler.session import SessionHandle
from .state import Placement, SharedState, StateUnavailable

logger = logging.getLogger(__name__)


def session_key(tenant: str, session_id: str) -> str:
    """The key of a tenant's session, locally and in the shared state. The id comes first and
    '|' (never in an id) ends it, so that no two (tenant, id) pairs share a key: with
    ``tenant/id``, tenant 'a' id 'b/c' and tenant 'a/b' id 'c' were one session."""
    return f"{session_id}|{tenant}"


class _Turn:
    __slots__ = ("ready", "done", "abandoned", "granted", "last")

    def __init__(self, *, last: bool = False) -> None:
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.abandoned = False
        self.granted = False  # by the session (else the session ended first)
        #: No call: the session ends here, after the turns before it (`SessionTable.end`).
        self.last = last


@dataclass(eq=False)
class GatewaySession:
    key: str
    placement: Placement
    handle: SessionHandle | None = None
    closed: bool = False
    #: Ended by its client (`SessionTable.end`): its id may name a new session by now, so its
    #: deadline marks nothing.
    ended_by_client: bool = False
    #: Calls waiting for their turn, and turns handed out so far.
    waiting: int = 0
    served: int = 0
    #: A turn the session's agent took from its queue and has not granted yet: it waits for
    #: re-admission after a tool period in which the session's slot was lent. A session that
    #: ends then (its deadline, a shutdown) releases it too (`SessionTable._close`).
    held: _Turn | None = None

    def __post_init__(self) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[_Turn](math.inf)


class SessionTable:
    """The live gateway sessions of this instance, by tenant and session id."""

    def __init__(
        self, scheduler: Scheduler, state: SharedState, *, instance: str, idle_s: float, pick_replica: object = None
    ) -> None:
        self._scheduler = scheduler
        self._state = state
        self._instance = instance
        self._idle_s = idle_s
        self._pick_replica = pick_replica
        self._sessions: dict[str, GatewaySession] = {}
        #: Sessions their clients ended (`end`) that still serve the calls waiting for them.
        self._ending: set[GatewaySession] = set()
        self._closing = False
        #: Whether the shared state (Redis) failed its last use by the gateway's fair-share sync:
        #: a session this instance runs then skips the placement lookup, which would only time
        #: out (REDIS_TIMEOUT_S, a second each call) and go on with the placement it has.
        self.state_away = False

    def __len__(self) -> int:
        return len(self._sessions) + len(self._ending)

    @asynccontextmanager
    async def call(self, tenant: str, session_id: str) -> AsyncIterator[GatewaySession]:
        """Hold the session's turn for one call: waits for (re-)admission, released on exit.

        Raises what `Scheduler.submit` raises for a session that can never run, and
        `SchedulerClosed` once the gateway shuts down (to a call still waiting for its turn)."""
        if self._closing:
            raise SchedulerClosed("the gateway is shutting down")
        key = session_key(tenant, session_id)
        proposal = Placement(self._instance, self._pick_replica() if callable(self._pick_replica) else None)
        running = self._sessions.get(key)
        ours = running is not None and not running.closed
        try:
            if self.state_away and ours:
                raise StateUnavailable("the shared state failed the last fair-share sync")
            placement = await self._state.place(key, proposal, self._idle_s)
        except Exception as exc:  # Redis away: a 503 to retry, not our 500
            running = self._sessions.get(key)
            if running is None or running.closed:
                raise StateUnavailable.from_error(exc) from exc
            # A session this instance runs goes on (its deadline is kept here too): only a new
            # one needs the shared placement. Its calls were refused with the rest.
            logger.warning("session %r goes on without the shared state: %s: %s", key, type(exc).__name__, exc)
            placement = running.placement
        if placement is None:
            raise DeadlineExceeded(
                f"session {session_id!r} passed its deadline (sla.deadline_s); a new session needs a new X-Session-ID"
            )
        if self._closing:  # began to shut down meanwhile
            raise SchedulerClosed("the gateway is shutting down")
        # Looked up after that await, and a new session entered at once: calls of a new session
        # that arrive together make one session, not one each.
        session = self._sessions.get(key)
        if session is None or session.closed:
            session = self._sessions[key] = GatewaySession(key, placement)
            turn = _Turn()
            session.send.send_nowait(turn)
            try:
                session.handle = await self._scheduler.submit(
                    self._agent(session), tenant=tenant, name=f"gateway:{tenant}/{session_id}", kind="gateway"
                )
            except BaseException:  # rejected: never runnable
                self._close(session)
                raise
        else:
            session.placement = placement
            turn = _Turn()
            session.send.send_nowait(turn)
        session.waiting += 1
        try:
            try:
                if session.served:
                    await turn.ready.wait()
                else:
                    await self._first_turn(session, turn)
            finally:
                session.waiting -= 1
            if not turn.granted:
                await self._refuse_ungranted(session, session_id)
            yield session
        finally:
            turn.abandoned = True
            turn.done.set()
            if not turn.ready.is_set() and session.served == 0 and session.waiting == 0 and not session.closed:
                # The only call of a session not yet served left before its turn (its client gave
                # up waiting for admission): no session is left behind to hold a slot until idle.
                self._close(session)
                assert session.handle is not None
                session.handle.cancel()

    async def _first_turn(self, session: GatewaySession, turn: _Turn) -> None:
        """Wait for a turn of a session that has served none yet: it may end before its agent
        starts (past its deadline in the queue, or cancelled), which closes it and ends the wait."""
        handle = session.handle
        assert handle is not None
        async with anyio.create_task_group() as tg:

            async def close_when_ended() -> None:
                await handle.ended()
                self._close(session)  # releases every turn still waiting

            tg.start_soon(close_when_ended)
            await turn.ready.wait()
            tg.cancel_scope.cancel()

    async def _refuse_ungranted(self, session: GatewaySession, session_id: str) -> None:
        """A turn released by the session's end rather than granted by it: refused during a
        shutdown, and when the session ended before serving any call (else, an expiry racing
        with the call, it goes ahead without the session)."""
        if self._closing:
            raise SchedulerClosed("the gateway is shutting down; this session's call was still waiting for its turn")
        handle = session.handle
        if session.served == 0 and handle is not None and handle.done:
            if isinstance(handle.error, DeadlineExceeded):
                if not session.ended_by_client:
                    await self._mark_past_deadline(session.key)
                raise DeadlineExceeded(f"session {session_id!r} passed its deadline before its first call was served")
            raise SchedulerClosed(f"session {session_id!r} ended ({handle.state}) before serving this call")

    def _agent(self, session: GatewaySession):  # noqa: ANN202 - an Agent
        async def serve(ctx: SessionContext) -> None:
            turn = None
            try:
                turn = session.receive.receive_nowait()
                while True:
                    if not turn.abandoned:
                        session.served += 1
                        turn.granted = True
                        turn.ready.set()
                        await turn.done.wait()
                    next_turn = None
                    async with ctx.tool("client"):
                        with anyio.move_on_after(self._idle_s):
                            try:
                                next_turn = await session.receive.receive()
                            except (anyio.EndOfStream, anyio.ClosedResourceError):
                                pass  # closed (`_close`: a shutdown): ends as an idle session does
                        if next_turn is None:
                            try:
                                next_turn = session.receive.receive_nowait()
                            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                                pass
                        session.held = next_turn  # out of the queue: released by `_close` if the session ends first
                        if next_turn is None or next_turn.last:  # idle for idle_s, or ended by its client
                            self._close(session)
                            assert session.handle is not None
                            session.handle.cancel()  # leaves the tool without waiting for re-admission
                            await anyio.sleep_forever()
                    turn = next_turn
                    session.held = None
            finally:
                # Ended by its deadline: its id stays refused a while (not once its client ended it).
                if anyio.current_time() >= ctx.deadline and not session.ended_by_client:
                    # Marked before the session closes: a call that comes meanwhile joins the
                    # session and gets its 408 from the deadline, rather than a new session.
                    await self._mark_past_deadline(session.key)
                if turn is not None and turn.granted and not turn.done.is_set():
                    # Its call under way, cut by the same deadline (or left to finish by a
                    # shutdown), is counted in the session's counters when it ends: the session
                    # ends after it, so that its record counts it too (it missed the call cut at
                    # the deadline, which the counters and the call's record had).
                    with anyio.CancelScope(shield=True):
                        await turn.done.wait()
                self._close(session)

        return serve

    async def _mark_past_deadline(self, key: str) -> None:
        """Have every instance refuse the session's id for an idle period (shielded: the session
        ends by cancellation; bounded: the shared state may hang)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self._state.mark_past_deadline(key, self._idle_s)
            except Exception as exc:  # Redis away: its next call gets the 503, or a new session
                logger.warning("could not mark session %r past its deadline: %s: %s", key, type(exc).__name__, exc)

    def _close(self, session: GatewaySession) -> None:
        if session.closed:
            return
        session.closed = True
        self._ending.discard(session)
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
        if session.held is not None:  # its agent took it, then waited for re-admission
            session.held.ready.set()
        while True:  # a call that raced with the expiry goes ahead without the session
            try:
                session.receive.receive_nowait().ready.set()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        # Nothing is sent to a closed session, nor taken from its queue: left open, anyio warned
        # of both ends (ResourceWarning "Unclosed <MemoryObject...Stream>") once collected.
        session.send.close()
        session.receive.close()

    def end(self, tenant: str, session_id: str) -> bool:
        """End a session at its client's word (``DELETE /v1/sessions/{id}``) rather than after
        `idle_s`: its slot and memory come free once the calls already waiting for it are served,
        and a later call with its id starts a new session (placed where the ended one was: the
        placement is left to expire, a hint for the replica whose cache holds the conversation).
        False when this instance serves no such session."""
        key = session_key(tenant, session_id)
        session = self._sessions.get(key)
        if session is None or session.closed:
            return False
        del self._sessions[key]  # later calls of the id make a new session
        session.ended_by_client = True
        self._ending.add(session)
        session.send.send_nowait(_Turn(last=True))
        return True

    def close_all(self) -> None:
        """End every session (the gateway is shutting down): calls under way finish, calls
        waiting for their turn get `SchedulerClosed`, and so do new ones."""
        self._closing = True
        for session in [*self._sessions.values(), *self._ending]:
            self._close(session)
            if session.handle is not None:
                session.handle.cancel()
