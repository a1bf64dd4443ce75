"""The dispatcher: every model call of every session passes through here to the backend.

A call is first checked against its tenant's rate limits (`RateLimited`) and, for a sheddable
tier, against its tenant's TTFT objective: if the wait predicted from the queued work and the
recent service rate exceeds it, the call is refused with `Overloaded` and a retry-after rather
than left to miss its objective. Then it takes a place in the backend's in-flight window. While the window has room and no
call waits, it goes straight through (the fast path: no task switch, no allocation beyond the
call's record). Otherwise it waits in a `FairQueue` (tier bands, fair share between tenants by
virtual token counters, earliest deadline first within a tenant) and is handed a place when a
call ahead of it finishes. The order is decided here, before the engine, because the engine
itself never preempts a running request for a waiting high-priority one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import anyio
import anyio.lowlevel

from ..backends.base import (
    AVOID_KEY,
    FALLBACK_KEY,
    REPLICA_KEY,
    Backend,
    ChatBody,
    Chunk,
    Received,
    abort_stream,
    checked_stream_options,
    collect_stream,
    estimate_prompt_tokens,
    forced_call_content,
    output_so_far,
    requested_max_tokens,
)
from .._parking import Park, Unpark, parking_for_current_library
from ..errors import BackendUnavailable, DeadlineExceeded, InvalidRequest, Overloaded, RateLimited
from ..policies.fair_queue import Entry, FairQueue
from ..policies.tiers import Tier
from ..resources.ratelimit import TenantRateLimits
from .records import CallRecord, Recorder, percentile

#: `CallRecord.error` of a call the backend refused as invalid, and of one that failed before the
#: engine made anything of it: refused, or no server up or free to take it.
_INVALID = frozenset({"InvalidRequest", "ContextTooLong", "UnknownModel"})
_NOTHING_MADE = _INVALID | {"BackendUnavailable", "Overloaded", "RateLimited"}

#: VTC weights: a prompt token costs 1, a generated token 2.
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
#: The service rate (for predicted waits) is measured over periods at least this long.
RATE_PERIOD_S = 2.0
#: Engine-side TTFTs kept for `take_engine_ttft` at most (the most recent): with a fixed window
#: nothing takes them, and they would pile up one per call for as long as the process runs.
TTFT_SAMPLES = 4096
# The tiers the window compares calls' with, several times a call, as module globals: on Python
# 3.11 reading `Tier.CRITICAL` goes through the enum metaclass's `__getattr__` hook, about 900
# instructions, against some 100 for a global.
_CRITICAL, _STANDARD = Tier.CRITICAL, Tier.STANDARD


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    window: int
    in_flight: int
    queued: int
    queued_by_tier: Mapping[int, int]
    calls_started: int
    shed: int
    rate_limited: int
    service_rate: float | None
    """Recent rate at which queued work (prompt-token estimates) is served, per second, measured
    while calls queue (None until a backlog has lasted `RATE_PERIOD_S`)."""
    refused_by: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """Refused calls per (tenant, reason), reason "shed" or "rate-limited"."""


class _Waiter:
    """A call waiting for its place: parked (see `_parking`) until `_grant` hands it one."""

    __slots__ = ("waiter", "granted", "granted_at")

    def __init__(self) -> None:
        self.waiter: Any = None
        self.granted = False
        self.granted_at = math.nan  # the time `_grant` handed it its place


class Dispatcher:
    """Orders model calls into one backend through an in-flight window."""

    def __init__(
        self,
        backend: Backend,
        *,
        window: int,
        critical_reserve: int = 0,
        stream_interval: Mapping[int, int] | None = None,
        weights: Mapping[str, float] | None = None,
        aging_s: float | None = None,
        min_share: Mapping[int, float] | None = None,
        rate_limits: TenantRateLimits | None = None,
        shed_after_s: Mapping[str, float] | None = None,
        shed_tiers: frozenset[int] = frozenset({Tier.BATCH}),
        recorder: Recorder | None = None,
        stagger_starts: bool = False,
    ) -> None:
        """`shed_after_s` maps a tenant to the predicted wait past which its calls of a tier in
        `shed_tiers` are refused (its TTFT objective). `critical_reserve` places of the window are
        for critical-tier calls only. `stream_interval` maps a tier to the tokens per chunk its
        streamed calls ask vLLM for (its per-request ``stream_interval``: the first token at once,
        then every that many).

        `stagger_starts`: calls below the critical tier that take places together start one per
        turn of the event loop, so that the chunks of calls in flight (a critical call's first
        token among them) are read between their starts. Calls of equal length end in the same
        engine step and free their places at once; opening a request to a vLLM server costs this
        process 1-3 ms, and 28 of them in one turn held a critical call's first token back 40-80
        ms (measured in ``bench qos``). For backends whose requests cost this process real time;
        the sim's cost nothing in virtual time."""
        _check_count("in-flight window", window, 1)
        _check_count("critical reserve", critical_reserve, 0)
        self.backend = backend
        self.window = window
        self.critical_reserve = critical_reserve
        self._stream_interval = {tier: n for tier, n in (stream_interval or {}).items() if n > 1}
        self.recorder = recorder if recorder is not None else Recorder()
        self._queue = FairQueue(weights, aging_s=aging_s, min_share=min_share)
        self._limits = rate_limits
        self._shed_after_s = dict(shed_after_s or {})
        self._shed_tiers = shed_tiers
        self._in_flight = 0
        self._critical_in_flight = 0
        self._stagger = stagger_starts
        self._starting = 0  # calls with places waiting for their turn to start (`stagger_starts`)
        self._parking: tuple[Park, Unpark] | None = None  # taken on the first wait, in the event loop
        self._started = 0
        self._shed = 0
        self._rate_limited = 0
        self._refused_by: dict[tuple[str, str], int] = {}
        # Service rate, measured over periods of at least RATE_PERIOD_S.
        self._rate: float | None = None
        self._rate_since: float | None = None
        self._rate_served = 0.0
        self._engine_ttfts: list[float] = []
        self._call_made: anyio.Event | None = None  # set by the next call (`until_a_call`)
        #: Per tenant, a running mean of the share of `max_tokens` its calls used: a call is
        #: charged that share of its own `max_tokens` when it takes its place (VTC with length
        #: prediction).
        self._output_share: dict[str, float] = {}
        #: The same over every tenant's calls: the share a tenant none of whose calls has ended
        #: yet is charged.
        self._any_output_share: float | None = None
        #: Replica names of a multi-replica backend (calls may be routed to one by affinity).
        replicas = getattr(backend, "replicas", None)
        self.replicas = frozenset(replicas) if isinstance(replicas, (Mapping, frozenset, set)) else frozenset()

    # -- the call path ---------------------------------------------------------------------------

    async def chat(
        self,
        body: ChatBody,
        *,
        tenant: str,
        tier: int,
        session: int = 0,
        due: float = math.inf,
        due_in: float = math.inf,
        deadline: float = math.inf,
        replica: str | None = None,
        received: Received | None = None,
    ) -> dict[str, Any]:
        """Make one call and return the whole ``chat.completion`` response dict.

        The hot path of every non-streaming call: it does what `stream` does without the
        context manager and generator layers, and lets the backend collect the answer
        (`Backend.complete_chat`). `received`, where given, tells the caller what a call cut
        short had received, and whether it was sent at all (`Received`).
        """
        _check_call(body, tenant, tier, due, due_in, deadline)
        given_options = checked_stream_options(body)
        record, estimate = await self._begin(body, tenant, tier, session, due, due_in, deadline)
        # "stream": False: only the first token's time and the whole answer matter here. The
        # engine's count on every chunk, as for a stream: a call cut short is charged its output.
        request = {**body, "priority": tier, "stream": False, "stream_options": {**given_options, **_USAGE_ON_EVERY_CHUNK}}
        if received is None:
            received = Received()
        received.sent = True
        try:
            # Inside the try: a backend refuses a body (ContextTooLong) when the call is made,
            # and that call must still give its place in the window back.
            if self._routes_to(replica):
                response, first_token = await collect_stream(self._routed(request, replica), received)
            else:
                response, first_token = await self.backend.complete_chat(request, received)
            if first_token is not None:
                record.first_token = first_token
            usage = response.get("usage") or {}
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.completion_tokens = usage.get("completion_tokens", 0)
        except BaseException as exc:
            record.error = type(exc).__name__
            self._charge_received(record, received.output_tokens)  # what the engine made before the cut
            if received.prompt_tokens:  # the engine's counts, as a stream's chunks give them (`_note`)
                record.prompt_tokens, record.completion_tokens = received.prompt_tokens, received.output_tokens
            raise
        finally:
            self._end(record, estimate)
        return forced_call_content(response, body)

    @asynccontextmanager
    async def stream(
        self,
        body: ChatBody,
        *,
        tenant: str,
        tier: int,
        session: int = 0,
        due: float = math.inf,
        due_in: float = math.inf,
        deadline: float = math.inf,
        replica: str | None = None,
    ) -> AsyncIterator[AsyncIterator[Chunk]]:
        """``async with dispatcher.stream(body, ...) as chunks: async for chunk in chunks: ...``

        `due` orders calls within a tenant (earliest first); `due_in` gives it as seconds from the
        call's arrival (a TTFT objective: the earlier of the two counts), so that the caller need
        not read the clock for it; `deadline` is the session's: a call
        made after it raises `DeadlineExceeded` without reaching the backend. Leaving the block
        early aborts the call at the engine. `replica` (the session's placement) routes the call to
        that replica of a multi-replica backend while it is up, else to the least loaded one.
        """
        _check_call(body, tenant, tier, due, due_in, deadline)
        given_options = checked_stream_options(body)
        record, estimate = await self._begin(body, tenant, tier, session, due, due_in, deadline)
        request = {**body, "priority": tier}
        # Every chunk carries the engine's count of the tokens so far (vLLM's continuous usage
        # stats): the tenant is charged what its call received, however the engine split the
        # answer into chunks (the first token alone, then up to `stream_interval` a chunk, more
        # when the reader falls behind). Whatever the caller asked: what it gets of them is shaped
        # on the way out (`agents.transport.UsageShape`), and a caller that turned them off here
        # was charged nothing for a stream it left early.
        request["stream_options"] = {**given_options, **_USAGE_ON_EVERY_CHUNK}
        # Coarser streaming for lower tiers: fewer chunks for the engine's API server and for this
        # process to handle, so the calls that need every token at once get it sooner.
        tokens_per_chunk = self._stream_interval.get(tier, 1)
        if tokens_per_chunk > 1:
            request.setdefault("stream_interval", tokens_per_chunk)
        try:
            upstream = self._upstream(request, replica)
        except BaseException as exc:  # refused by the backend: the place goes back all the same
            record.error = type(exc).__name__
            self._end(record, estimate)
            raise

        answered = False  # the answer's end was read: its finish reason, or the stream's end

        async def observed() -> AsyncIterator[Chunk]:
            nonlocal answered
            while True:
                try:
                    chunk = await upstream.__anext__()
                except StopAsyncIteration:
                    answered = True
                    return
                except BaseException as exc:  # the call ends here: a reader that goes on past a cut
                    record.error = type(exc).__name__  # read (caught) leaves the block normally
                    raise
                _note(chunk, record)
                self._charge_received(record, output_so_far(chunk, record.streamed, tokens_per_chunk))
                choices = chunk.get("choices")
                if choices and choices[0].get("finish_reason"):
                    answered = True
                yield chunk

        try:
            yield observed()
        except BaseException:
            # A failed read named its failure (`observed`). An exception of the caller's own (an
            # agent's parse of the answer that raised in its block) is no failure of the call: one
            # that came after the answer's end left a call served whole, one before it cut the
            # call, as a `break` does. (Recorded as failed, the engine took the blame: a "failed"
            # breach of every call objective, where the same agent on ctx.openai met them.)
            if record.error is None:
                record.error = None if answered else anyio.get_cancelled_exc_class().__name__
            raise
        else:
            if not answered and record.error is None:
                # Left before the answer's end (a `break`): the engine aborts the call. Recorded
                # cut, as a call whose read was cut or that the OpenAI SDK closed is: its time is
                # its caller's choice, no event of the tenant's SLA (`sla.CANCELLED`).
                record.error = anyio.get_cancelled_exc_class().__name__
        finally:
            try:
                await abort_stream(upstream)
            finally:  # the call ends whatever the close raised: its place went missing for good
                self._end(record, estimate)

    def _upstream(self, request: dict[str, Any], replica: str | None) -> AsyncIterator[Chunk]:
        if self._routes_to(replica):
            return self._routed(request, replica)
        return self.backend.stream_chat(request)

    def _routes_to(self, replica: str | None) -> TypeGuard[str]:
        """Whether a call placed on `replica` goes there: a replica of this multi-replica backend."""
        return replica is not None and replica in self.replicas

    async def _routed(self, request: dict[str, Any], replica: str) -> AsyncIterator[Chunk]:
        """The call on its session's replica (affinity keeps its prefix cached there); if that
        replica is down before the first chunk, on the least loaded one instead: at once, not
        after the backend's retries (`FALLBACK_KEY`) while the replica's breaker is still closed."""
        upstream = self.backend.stream_chat({**request, REPLICA_KEY: replica, FALLBACK_KEY: True})
        try:
            try:
                first = await upstream.__anext__()
            except BackendUnavailable as exc:
                await upstream.aclose()  # type: ignore[attr-defined]
                # Not to `replica` again (its breaker may still be closed, and it ties on load).
                upstream = self.backend.stream_chat({**request, AVOID_KEY: replica})
                try:
                    first = await upstream.__anext__()
                except BackendUnavailable as again:
                    # Both failures: the fallback's alone named another replica than the
                    # session's, as if that one were the only replica down.
                    raise BackendUnavailable(f"{exc}; falling back to another replica: {again}") from again
            yield first
            async for chunk in upstream:
                yield chunk
        except StopAsyncIteration:
            return
        finally:
            await abort_stream(upstream)

    async def _begin(
        self, body: ChatBody, tenant: str, tier: int, session: int, due: float, due_in: float, deadline: float
    ) -> tuple[CallRecord, int]:
        if self._call_made is not None:
            self._call_made.set()
            self._call_made = None
        now = anyio.current_time()
        if due_in < math.inf:
            due = min(due, now + due_in)
        if now > deadline:
            # The session's own cancellation (its deadline's) goes first where it is due, not yet
            # delivered (the time passed in work no cancellation cuts): it fails the session with
            # `DeadlineExceeded`, where this refusal, a 408 to `ctx.openai`, failed it with the
            # SDK's `APIStatusError`. A shielded cleanup, or a task outside the session, gets it.
            await anyio.lowlevel.checkpoint()
            raise DeadlineExceeded(f"session {session} made a model call {now - deadline:.3f} s after its deadline")
        estimate = estimate_prompt_tokens(body)
        # Read before the shed: a call refused for its body is told so at once, not told to
        # retry after a wait (and counted as shed) as long as a backlog lasts.
        max_tokens = requested_max_tokens(body)
        if tier in self._shed_tiers and tenant in self._shed_after_s:
            wait = self.predicted_wait_s(tier)
            if wait > self._shed_after_s[tenant]:
                self._shed += 1
                self._refuse(tenant, tier, session, now, "shed", "Overloaded")
                raise Overloaded(
                    f"{Tier(tier)} call of tenant {tenant!r} shed: its predicted wait of {wait:.1f} s exceeds "
                    f"its TTFT objective of {self._shed_after_s[tenant]:.1f} s",
                    retry_after_s=wait,
                )
        tokens = estimate + max_tokens
        if self._limits is not None:
            wait = self._limits.try_take(tenant, tokens, now)
            if wait > 0:
                self._rate_limited += 1
                self._refuse(tenant, tier, session, now, "rate-limited", "RateLimited")
                short = self._limits.shortfall(tenant, tokens, now)
                raise RateLimited(f"tenant {tenant!r} is over its {short}", retry_after_s=wait)
        record = CallRecord(tenant, tier, session, now)
        record.max_tokens = max_tokens
        record.predicted_output = self._predict_output(tenant, record.max_tokens)
        cost = self._cost(estimate, record)
        try:
            started = await self._acquire(tenant, tier, cost, due, now)
            if self._stagger and tier > _CRITICAL:
                await self._wait_turn(tenant, tier, cost)
        except BaseException:  # cancelled before it reached the backend: it used none of the limits
            if self._limits is not None:
                self._limits.untake(tenant, tokens, anyio.current_time())
            raise
        record.started = started
        return record, estimate

    def _end(self, record: CallRecord, estimate: int) -> None:
        now = record.finished = anyio.current_time()
        record.backend_s = now - record.started
        if record.first_token == record.first_token:  # not nan
            ttfts = self._engine_ttfts
            ttfts.append(record.first_token - record.started)
            if len(ttfts) > TTFT_SAMPLES:  # nothing takes them (a fixed window): keep the recent half
                del ttfts[: len(ttfts) // 2]
        # The output the call used: the engine's count where a usage came, else what it streamed
        # (counted by chunks, an estimate at `stream_interval` a chunk: never over the usage's).
        counted = record.prompt_tokens or record.completion_tokens
        output = record.completion_tokens if counted else record.streamed
        # Failed with nothing made (refused by the engine, no server up or free): its prompt was
        # served to no one, and is taken back from the tenant's limits, counter and the rate.
        nothing_made = not counted and not output and record.error in _NOTHING_MADE
        if self._limits is not None:
            # Charged up front: the prompt's estimate and max_tokens. Output not received is not
            # charged, whether the call failed or not; a prompt the engine counted longer than
            # its estimate is (the estimate counts characters: a real tokenizer may count more).
            # A call that failed with nothing made (refused, a server down or overloaded) gets
            # its prompt back, as a refused gateway call does: one prompt over the context held
            # a tenant's tokens_per_minute 40,000 below empty, 240 s of refusals. Any other
            # (cut short, failed on the way) keeps it: the engine may have read it. One refused
            # as invalid gets its request back too: only a fixed call would use it.
            if counted:
                prompt = record.prompt_tokens
            elif nothing_made:
                prompt = 0
            else:
                prompt = estimate
            unused = estimate + record.max_tokens - prompt - output
            self._limits.refund(record.tenant, unused, now, request=record.error in _INVALID)
        # Measured in the units of the queue's costs, so queued cost over rate is a wait in seconds:
        # the prompt's estimate and the output the call made, which the queued calls' predicted
        # output stands for. Not its own predicted output: the first calls are predicted none (no
        # call has ended yet), and a rate measured in their costs read the next backlog, charged
        # its output, as 20 times longer than it was (batch calls shed, Retry-After 187 s).
        # A call that failed with nothing made served nothing: counted, one refused prompt of
        # 10,000 tokens read as that much work done, and the waits predicted from the rate shrank.
        self._measure_rate(now, 0.0 if nothing_made else estimate * INPUT_WEIGHT + output * OUTPUT_WEIGHT)
        # Correct what was charged (the prompt estimate, and the larger of the predicted output
        # and the output streamed) to what the call used: the usage's counts, or for a call cut
        # short, the output it received.
        charged_output = max(record.predicted_output, record.streamed)
        if counted:
            used = (record.prompt_tokens - estimate) * INPUT_WEIGHT + record.completion_tokens * OUTPUT_WEIGHT
            share = record.completion_tokens / max(1, record.max_tokens)
            self._output_share[record.tenant] = _running_mean(self._output_share.get(record.tenant), share)
            self._any_output_share = _running_mean(self._any_output_share, share)
        elif nothing_made:
            # Its prompt estimate too comes off the counter: left charged, one prompt over the
            # context (refused at once) put its tenant's next calls behind the other tenants'
            # for as long as serving 10,000 tokens of theirs took.
            used = -estimate * INPUT_WEIGHT
        else:
            used = output * OUTPUT_WEIGHT
        self._queue.charge(record.tenant, used - charged_output * OUTPUT_WEIGHT, record.tier)
        # The place goes back only now: the next pick must see this call's tenant charged in
        # full, or a tenant whose call just ended looks cheaper than it is and wins the place.
        self._release(record.tier, now)
        self.recorder.add_call(record)

    def _charge_received(self, record: CallRecord, received: int) -> None:
        """The call has received `received` output tokens so far. Output beyond the prediction
        is charged as it streams, not when the call ends: a tenant's counter then counts what
        its calls in flight received (`_end` corrects it to the usage)."""
        if received > record.streamed:
            before = max(record.predicted_output, record.streamed)
            record.streamed = received
            if received > before:
                self._queue.charge(record.tenant, (received - before) * OUTPUT_WEIGHT, record.tier)

    def _predict_output(self, tenant: str, max_tokens: int) -> int:
        """The output a call of `tenant` is charged up front: the share of `max_tokens` its
        recent calls used, times this call's `max_tokens`. Charging it when the call takes its
        place, not as its tokens arrive, counts the calls in flight in the tenant's counter; the
        next picks then balance the tenants' calls in flight, not only their finished ones. A
        share, not a mean length: a tenant whose answers run to their `max_tokens` is charged a
        long call's length, not its mean call's.

        Before any call of `tenant` has ended, the share every tenant's recent calls used (0
        before any call at all). Charged nothing then, a new tenant's calls would look cheaper
        than the others' until its first ended, and take more places than its share."""
        share = self._output_share.get(tenant, self._any_output_share)
        return 0 if share is None else min(max_tokens, round(share * max_tokens))

    @staticmethod
    def _cost(estimate: int, record: CallRecord) -> float:
        """A call's cost when it takes its place: its prompt estimate and predicted output."""
        return estimate * INPUT_WEIGHT + record.predicted_output * OUTPUT_WEIGHT

    def _refuse(self, tenant: str, tier: int, session: int, now: float, reason: str, error: str) -> None:
        """Count and record a refused call (off the hot path: only refusals come here)."""
        key = (tenant, reason)
        self._refused_by[key] = self._refused_by.get(key, 0) + 1
        self.recorder.add_refusal(CallRecord(tenant, tier, session, now, finished=now, error=error))

    # -- the window ------------------------------------------------------------------------------

    async def _acquire(self, tenant: str, tier: int, cost: float, due: float, now: float) -> float:
        """Take a place in the window; returns the time it was given (`now` when at once)."""
        if not self._queue and self._has_place(tier):
            self._take_place(tier)
            self._queue.serve_direct(tenant, tier, cost)
            return now
        if self._parking is None:
            self._parking = parking_for_current_library()
        waiter = _Waiter()
        entry = self._queue.push(Entry(tenant, tier, now, waiter, cost, due))
        if self._has_place(tier):
            # A place this call could take: a critical call passing lower-tier calls held back by
            # the reserve. Otherwise nothing changed for the calls queued (every release and resize
            # granted what it could), and there is nothing to grant.
            self._grant()
        try:
            if waiter.granted:
                # Granted at once (a critical call passing the calls the reserve holds back): on
                # its way without waiting for a turn of the loop, unless cancelled.
                await anyio.lowlevel.checkpoint_if_cancelled()
            else:
                await self._parking[0](waiter)
        except BaseException:
            if waiter.granted:
                self._give_back(tenant, tier, cost)
            else:
                self._queue.remove(entry)
            raise
        return waiter.granted_at

    async def _wait_turn(self, tenant: str, tier: int, cost: float) -> None:
        """Start one turn of the event loop after the call that took its place before this one
        (`stagger_starts`); a call cancelled meanwhile gives its place back.

        A call leaves the count one turn after its own turn, so calls that take places in the
        same turn see each other whatever order they run in."""
        turn = self._starting
        self._starting += 1
        try:
            for _ in range(turn + 1):
                await anyio.lowlevel.checkpoint()
        except BaseException:
            self._give_back(tenant, tier, cost)
            raise
        finally:
            self._starting -= 1

    def _give_back(self, tenant: str, tier: int, cost: float) -> None:
        """Give back the place of a call cancelled before it started (at its grant, or while it
        waited for its turn): it never reached the backend, so the `cost` charged when it took
        the place is taken off its tenant's counter and band again, and it is not a call started."""
        self._queue.charge(tenant, -cost, tier)
        self._started -= 1
        self._release(tier)

    def _release(self, tier: int, now: float | None = None) -> None:
        """Give a place back and hand it to the next waiting call in policy order (`now`: the
        time, if the caller has it)."""
        self._in_flight -= 1
        if tier <= _CRITICAL:
            self._critical_in_flight -= 1
        self._grant(now)

    def _has_place(self, tier: int) -> bool:
        """Whether a call of `tier` may take a place now.

        Lower tiers fill the window but its reserve; critical calls fill the whole window, and
        the reserve besides: when the window shrinks below the calls in flight, up to
        `critical_reserve` critical calls still go through at once."""
        if tier <= _CRITICAL:
            return self._in_flight < self.window or self._critical_in_flight < self.critical_reserve
        return self._in_flight < max(1, self.window - self.critical_reserve)

    def _take_place(self, tier: int) -> None:
        self._in_flight += 1
        self._started += 1
        if tier <= _CRITICAL:
            self._critical_in_flight += 1

    def _grant(self, now: float | None = None) -> None:
        if not self._queue:
            return
        if now is None:
            now = anyio.current_time()
        while self._queue:
            if self._has_place(_STANDARD):
                entry = self._queue.pick(now)
            elif self._has_place(_CRITICAL):  # only the reserve is left: critical calls alone
                entry = self._queue.pick(now, max_tier=_CRITICAL)
            else:
                break
            if entry is None:
                break
            self._take_place(entry.tier)
            entry.item.granted = True
            # Its call starts now: it reads the time from here (where the caller of `_release`
            # has it already) rather than reading the clock again when it resumes.
            entry.item.granted_at = now
            assert self._parking is not None  # set by the call that queued the entry
            self._parking[1](entry.item)

    def _measure_rate(self, now: float, served: float) -> None:
        """Count a call's service `served` as it ends, towards the rate at which the backend
        serves queued work: measured only while calls queue (the window full), in periods from
        a call's end to a later one's. Time with nothing queued is the demand's pace, not the
        backend's: counted, two calls an hour apart read as 0.13 a second, and the next burst was
        shed with a predicted wait of 2,044 s where it cleared in 0.16 s. A backlog that ends
        before a period is whole is not counted."""
        if not self._queue:
            self._rate_since, self._rate_served = None, 0.0
            return
        if self._rate_since is None:  # a period starts at this end; the call ran before it
            self._rate_since = now
            return
        self._rate_served += served
        elapsed = now - self._rate_since
        if elapsed >= RATE_PERIOD_S:
            rate = self._rate_served / elapsed
            self._rate = rate if self._rate is None else 0.5 * self._rate + 0.5 * rate
            self._rate_since, self._rate_served = now, 0.0

    def charge_external(self, tenant: str, cost: float) -> None:
        """Count service `tenant` received elsewhere (another gateway instance, say) in its
        fair-share counter, so that its share is fair across the whole deployment."""
        self._queue.charge(tenant, cost)

    def predicted_wait_s(self, tier: int | None = None) -> float:
        """Seconds a call arriving now would wait for a place: the queued work over the recent
        service rate (0 while the window has room or nothing has been measured yet). With its
        `tier`, the work served before it: its band's and those above, or less where its band
        has a minimum share (`FairQueue.cost_ahead`)."""
        if not self._queue or not self._rate:
            return 0.0
        ahead = self._queue.queued_cost if tier is None else self._queue.cost_ahead(tier)
        return ahead / self._rate

    def take_engine_ttft(self) -> float | None:
        """Median engine-side TTFT of the calls finished since the last take (for the window)."""
        if not self._engine_ttfts:
            return None
        median = percentile(self._engine_ttfts, 50)
        self._engine_ttfts.clear()
        return median

    def resize(self, window: int) -> None:
        """Change the in-flight window (the adaptive window policy calls this)."""
        _check_count("in-flight window", window, 1)
        self.window = window
        self._grant()

    async def until_a_call(self) -> None:
        """Return once a call is in flight or waiting for its place: at once if one is, else when
        the next one is made. The window's adjustments wait here while no call is made, so that
        a simulation's idle stretches (sparse arrivals, long tool calls) cost no wake-ups."""
        if self._in_flight or self._queue:
            return
        if self._call_made is None:
            self._call_made = anyio.Event()
        await self._call_made.wait()

    def statistics(self) -> DispatcherStatistics:
        by_tier: dict[int, int] = {}
        for (_, tier), n in self._queue.queued_by().items():
            by_tier[tier] = by_tier.get(tier, 0) + n
        return DispatcherStatistics(
            self.window,
            self._in_flight,
            len(self._queue),
            by_tier,
            self._started,
            self._shed,
            self._rate_limited,
            self._rate,
            dict(self._refused_by),
        )


_TIERS = frozenset(Tier)
#: The stream options every call is sent with: the engine's count of its tokens on every chunk.
_USAGE_ON_EVERY_CHUNK = {"continuous_usage_stats": True, "include_usage": True}
#: The types of a due or a due_in that the fast path of `_check_call` takes; others go the long way.
_TIMES = frozenset({float, int})


def _check_count(name: str, value: object, least: int) -> None:
    """A count of places must be an int: a NaN passed `value < least` and compared false with
    every count in flight (`_has_place`), and a fraction is no number of calls."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r:.40}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")


def _check_call(body: object, tenant: object, tier: object, due: object, due_in: object, deadline: object) -> None:
    """Refuse a call's bad arguments before it takes anything (rate limits, a place, a queue
    entry): a tier that is not one of `Tier`'s would be queued and compared with the others,
    and a NaN due breaks the earliest-deadline order (a NaN deadline never passed). A bool is
    none of them, though True equals 1 (the standard tier), and a Decimal is no time: it
    compares with floats but cannot be added to the clock's (`_begin`'s ``now + due_in``
    raised a bare TypeError). The common case costs the tests of the first `if`s."""
    try:
        if type(body) is dict and type(tenant) is str and tier in _TIERS and type(due) in _TIMES and type(due_in) in _TIMES:
            if type(tier) is not bool and due >= 0 and due_in >= 0 and type(deadline) in _TIMES and deadline >= 0:  # type: ignore[operator]
                return
    except TypeError:  # an unhashable tier: named below
        pass
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"body: expected an object (a dict), got {type(body).__name__}")
    if not isinstance(tenant, str):  # a list raised "unhashable type" from the rate limits
        raise TypeError(f"tenant: expected a tenant's name (a str), got {tenant!r:.40}")
    try:
        known = tier in _TIERS and not isinstance(tier, bool)
    except TypeError:
        known = False
    if not known:
        raise ValueError(f"tier: expected 0 (critical), 1 (standard) or 2 (batch), got {tier!r:.40}")
    if not (_is_number(due) and due >= 0):
        raise ValueError(f"due: expected a time on the clock (>= 0, or inf for none), got {due!r:.40}")
    if not (_is_number(due_in) and due_in >= 0):
        raise ValueError(f"due_in: expected seconds (>= 0, or inf for none), got {due_in!r:.40}")
    if not (_is_number(deadline) and deadline >= 0):  # "soon" raised a bare TypeError
        raise ValueError(f"deadline: expected a time on the clock (>= 0, or inf for none), got {deadline!r:.40}")


def _is_number(value: object) -> TypeGuard[float]:
    """A real number other than a bool (numpy's among them; a Decimal is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _running_mean(mean: float | None, value: float) -> float:
    """An output share's running mean after `value` (the recent calls weigh most)."""
    return value if mean is None else 0.8 * mean + 0.2 * value


def _note(chunk: Chunk, record: CallRecord) -> None:
    """Observe one chunk: the first token's time, and its usage (the counts so far, on every
    chunk of a stream that asked for continuous usage stats; the totals on the last)."""
    if record.first_token != record.first_token and chunk.get("choices"):  # still nan
        record.first_token = anyio.current_time()
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", 0)
        record.completion_tokens = usage.get("completion_tokens", 0)
