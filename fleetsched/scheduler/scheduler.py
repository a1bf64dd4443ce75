"""The `Scheduler`: admits agent sessions and runs them in its own task group.

A submitted session waits in the admission queue (ordered by `FairQueue`: tier bands with aging,
weighted fair share between tenants, FIFO within a tenant) until it holds both a session slot
(global and per tenant) and a memory reservation from the pool. Admission is one synchronous
step, `_admit_ready`, run whenever something changes (a submission, a release), so a slot and
its memory are granted together or not at all. When the head of the queue does not fit in
memory, admission waits for a release rather than letting smaller sessions pass it for ever.

While a session sits in a tool call, the `KeepOrRelease` policy may park it: its slot and memory
go back to the pool for waiting sessions, and when the tool returns the session is re-admitted
ahead of newer sessions of its tenant before it goes on.

Every session runs in its own cancel scope: an exception fails that session only, and every
exit path (done, failed, cancelled, deadline, scheduler shutdown) gives back its slot and its
reservation in `_finish`.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._cancellation import stray_cancelled_error
from .._parking import current_task
from ..agents import context  # the module: imported first, it is still being made here (it imports this one)
from ..backends import Backend, create_backend
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    FleetschedError,
    QuotaWouldBlock,
    SchedulerClosed,
    SessionFailed,
    SessionRejected,
    UnknownTenant,
    WouldBlock,
)
from ..policies.fair_queue import Entry, FairQueue
from ..policies.pace import KeepOrRelease, ToolStats
from ..policies.tiers import Tier
from ..policies.window import AimdWindow, WindowSignals
from ..resources import MemoryPool, MemoryStatistics, Reservation, create_pool, kv_pool
from ..resources.limiter import SessionSlots
from ..resources.ratelimit import RateLimit, TenantRateLimits
from ..settings import DeviceSettings, Settings
from .dispatcher import Dispatcher, DispatcherStatistics
from .records import AdmissionRecord, Recorder, SessionRecord
from .session import ADMITTED, DONE, QUEUED, RUNNING, THINKING, Agent, SessionHandle, SessionState, _described

if TYPE_CHECKING:
    from ..agents.context import SessionContext
    from ..resources.kv_sizing import KVCacheCapacity

T = TypeVar("T")  # what an agent returns

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A snapshot of the scheduler, taken by `Scheduler.statistics()`."""

    queued: Mapping[tuple[str, str], int]
    """Queued sessions per (tenant, tier)."""
    running: Mapping[tuple[str, str], int]
    """Admitted or running sessions per (tenant, tier), holding a slot."""
    parked: int
    """Sessions in a tool call whose slot and memory were released to others (one whose tool
    call is over and that waits to be re-admitted is in `queued`)."""
    finished: Mapping[str, int]
    """Finished sessions per final state."""
    slots_in_use: int
    slots_total: int
    memory: MemoryStatistics
    dispatcher: DispatcherStatistics

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())

    @property
    def running_total(self) -> int:
        return sum(self.running.values())


#: Who releases a session's memory (`Reservation.released_by`): not its agent.
RELEASED_BY = "the scheduler, when its session ends or parks in a tool"


def _seconds(name: str, value: float | None, *, finite: bool) -> float | None:
    """`value` (None, or seconds > 0) as a float; a `ValueError` naming `name` for anything else,
    an integer too large for a float among them (it failed later, in the scheduler's own task)."""
    if value is None:
        return None
    seconds = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's numbers too
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError(f"{name}: an integer of {value.bit_length()} bits, too large for a float of seconds") from None
    if not (seconds > 0 and (seconds < math.inf or not finite)):
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}number of seconds > 0, got {value!r:.80}")
    return seconds


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _bare_exit(group: BaseExceptionGroup) -> BaseException:
    """The KeyboardInterrupt or SystemExit of an agent that `group` holds beside cancellations
    alone, bare; else `group`. In a group, ``sys.exit(3)`` in an agent ended the process with
    status 1 on trio, and ``except SystemExit`` around the scheduler's block missed it."""
    exits, rest = group.split((KeyboardInterrupt, SystemExit))
    if exits is None or (rest is not None and rest.split(anyio.get_cancelled_exc_class())[1] is not None):
        return group
    return _first_leaf(exits)


def _failure_of(exc: BaseException) -> BaseException | None:
    """The session's failure in an exception out of its agent, or None where it only passes
    through: any exception but cancellation, KeyboardInterrupt and SystemExit (a GeneratorExit or
    a BaseException subclass of the agent's own fails its session alone, not the whole scheduler).

    A group with a KeyboardInterrupt or SystemExit passes; otherwise its part that is not
    cancellation is the failure (a task group of the agent's whose tasks raised as they were
    cancelled holds their errors beside `Cancelled`, on trio). On asyncio, a CancelledError
    while the task is not being cancelled is a failure too (`stray_cancelled_error`): passed on,
    it cancelled the scheduler's task group and every other session with it."""
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        if exc.subgroup((KeyboardInterrupt, SystemExit)) is not None:
            return None
        rest = exc.split(cancelled)[1]
        if rest is None and stray_cancelled_error(_first_leaf(exc)):
            return exc  # a group of CancelledErrors of the agent's own, as a bare one below
        return rest
    if isinstance(exc, cancelled):
        return exc if stray_cancelled_error(exc) else None
    return None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else exc


def _replica_devices(backend: Backend, devices: list[DeviceSettings]) -> bool:
    """Whether the pool's `devices` are replicas of `backend` (several, each an engine of its own,
    to which its sessions' calls go): the pool then spreads sessions over them rather than pack
    them onto one (it packed, and one replica took every call while the others stood idle)."""
    replicas = getattr(backend, "replicas", None)
    names = {device.name for device in devices}
    return isinstance(replicas, (Mapping, frozenset, set)) and len(names) > 1 and names <= set(replicas)


def _ended_by(error: BaseException) -> SessionState:
    """How a session that never ran ends on `error`: rejected (`SessionRejected`: it never can),
    failed, or cancelled (Ctrl-C, say: no failure of the session's)."""
    if isinstance(error, SessionRejected):
        return SessionState.REJECTED
    return SessionState.FAILED if isinstance(error, Exception) else SessionState.CANCELLED


class Scheduler:
    """Runs agent sessions under admission control. Use as ``async with Scheduler(...) as s:``.

    Leaving the block drains: submitted sessions get `scheduler.drain_grace_s` seconds to finish,
    then whatever remains is cancelled. If the block raises, everything is cancelled at once.
    `backend` and `pool` default to what `settings` describe; a backend passed in is the caller's
    to enter and close. `recorder` defaults to one that keeps a record of every call and session
    (for reports' exact percentiles); a scheduler meant to run for weeks passes
    ``Recorder(keep_calls=False)``, which keeps counts only.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        backend: Backend | None = None,
        pool: MemoryPool | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        if settings is not None and not isinstance(settings, Settings):
            # A path or a dict failed on its first use, "'str' object has no attribute 'tenants'",
            # and an empty dict ran on the defaults, unsaid.
            raise TypeError(
                f"settings: expected fleetsched.Settings (fleetsched.load_settings(path) reads a file), got {settings!r:.80}"
            )
        self.settings = settings if settings is not None else Settings()
        tenants = self.settings.tenants
        self._own_backend = backend is None
        self.backend = backend if backend is not None else create_backend(self.settings.backend)
        #: The model the agents' calls name: ``backend.model``, or where the settings name none,
        #: the one the backend serves (`Backend.served_model`, asked on entering).
        self.model = self.settings.backend.model
        quotas = {name: int(t.memory_quota) for name, t in tenants.items() if t.memory_quota is not None}
        #: `resources.kv_cache`: the pool is built over the backend's KV caches on entering.
        self._size_from_caches = pool is None and self.settings.resources.kv_cache is not None
        #: Sized from the caches: each replica's device in bytes, the bytes of a KV block, and
        #: the block size in tokens (`_follow_kv_caches`).
        self._kv_sized: tuple[dict[str, int], int, int] | None = None
        #: The replicas whose devices `_follow_kv_caches` closed to new sessions while they are down.
        self._replicas_down: frozenset[str] = frozenset()
        if pool is None:
            spread = _replica_devices(self.backend, self.settings.resources.devices)
            pool = create_pool(self.settings.resources, quotas, spread=spread)
        else:
            for name, quota in quotas.items():
                pool.set_quota(name, quota)
        self.pool = pool
        self._quotas = quotas
        self._session_memory = int(self.settings.scheduler.session_memory)
        self.recorder = recorder if recorder is not None else Recorder()
        self.slots = SessionSlots(self.settings.scheduler.max_sessions, {n: t.max_sessions for n, t in tenants.items()})
        weights = {name: t.weight for name, t in tenants.items()}
        self._queue = FairQueue(weights, aging_s=self.settings.scheduler.aging_s)
        dispatch = self.settings.dispatch
        limits = {
            name: RateLimit(t.requests_per_minute, t.tokens_per_minute)
            for name, t in tenants.items()
            if t.requests_per_minute or t.tokens_per_minute
        }
        window = self.settings.backend.max_in_flight
        if dispatch.adaptive_window:  # the controller keeps it within its bounds from the start
            window = max(dispatch.min_window, min(dispatch.max_window, window))
        self.dispatcher = Dispatcher(
            self.backend,
            window=window,
            critical_reserve=dispatch.critical_reserve,
            stream_interval={int(Tier.parse(tier)): n for tier, n in dispatch.stream_interval.items()},
            weights=weights,
            aging_s=self.settings.scheduler.aging_s,
            min_share={int(Tier.parse(tier)): share for tier, share in dispatch.min_share.items()},
            rate_limits=TenantRateLimits(limits) if limits else None,
            shed_after_s={n: t.sla.ttft_p99_s for n, t in tenants.items() if t.sla.ttft_p99_s} if dispatch.shed_batch else None,
            recorder=self.recorder,
            stagger_starts=self.settings.backend.kind in ("vllm-server", "vllm-engine"),
        )
        self._task_group: TaskGroup | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._entering = False
        self._accepting = False
        self._thread: int | None = None  # the thread of the event loop that entered it
        self._closing = False
        self._admitting = False
        self._running: dict[int, SessionHandle] = {}
        #: Mean time the sessions of each kind held their memory (from admission or re-admission
        #: to the end, or to parking in a tool): end hints.
        self._hold_s: dict[str, float] = {}
        # Kept as slots are taken and given (`_take_slot`, `_give_slot`), for `statistics`, which
        # would otherwise look at every running session at every sample: the running sessions
        # holding their slot per (tenant, tier), and those whose slot was released (parked in a
        # tool, or waiting to be re-admitted).
        self._holding: dict[tuple[str, int], int] = {}
        self._released: dict[SessionHandle, None] = {}
        self._live = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._finished: dict[str, int] = {}
        self._tool_stats = ToolStats()
        self._in_tool: dict[SessionHandle, tuple[str, float]] = {}  # tool name, start time
        #: The sessions of `_in_tool` that hold their slot: the only ones a change of pressure may
        #: park. Scanned instead of `_in_tool`, which holds the parked ones too: a gateway's idle
        #: sessions sit in a tool until they end, and each call that met admission pressure
        #: scanned all of them (2,000 open sessions, 1,300 handles a call).
        self._kept_in_tool: dict[SessionHandle, None] = {}
        self._tool_policy = KeepOrRelease(self.settings.scheduler.tool_policy, self.settings.scheduler.tool_keep_s)

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        if self._entering or self._exit_stack is not None:
            raise RuntimeError("a Scheduler can be entered only once")
        # Marked before the first await: two tasks entering it at once both passed the check, and
        # the second's task group replaced the first's ("Attempted to exit a cancel scope that
        # isn't the current tasks's current cancel scope"; on trio an internal error of trio's).
        self._entering = True
        try:
            async with AsyncExitStack() as stack:
                if self._own_backend:
                    await stack.enter_async_context(self.backend)
                if "model" not in self.settings.backend.model_fields_set:
                    self.model = await self.backend.served_model() or self.model
                if self._size_from_caches:
                    await self._use_kv_caches()
                self._task_group = await stack.enter_async_context(anyio.create_task_group())
                self.pool.add_release_listener(self._admit_ready)
                stack.callback(self.pool.remove_release_listener, self._admit_ready)
                if self.settings.dispatch.adaptive_window:
                    self._task_group.start_soon(self._adapt_window, name="fleetsched window")
                self._exit_stack = stack.pop_all()
        finally:
            self._entering = False
        self._thread = threading.get_ident()
        self._accepting = True
        return self

    async def _use_kv_caches(self) -> None:
        """Build the pool over the backend's KV caches, a device per replica, and size sessions
        from the model (`resources.kv_cache`)."""
        kv = self.settings.resources.kv_cache
        assert kv is not None
        capacities = await self.backend.kv_capacities()
        try:
            sized = kv_pool(capacities, kv.config, context_tokens=kv.context_tokens, dtype=kv.dtype, in_flight_tokens=kv.in_flight_tokens)
        except ValueError as exc:
            # Replicas that serve blocks of different sizes (one started with another
            # --block-size) ended `fleetsched run` in a traceback.
            raise ConfigError("resources.kv_cache", str(exc)) from None
        largest = max(sized.devices, key=sized.devices.__getitem__)
        cache = capacities[largest]
        if sized.session_bytes > sized.devices[largest]:
            # Every session would be rejected at submission, and a run would end "done" with
            # each of its sessions failed.
            raise ConfigError(
                "resources.kv_cache.context_tokens",
                f"a session's budget of {kv.context_tokens:,} tokens reserves {sized.session_bytes:,} bytes, more than "
                f"the largest KV cache holds (replica {largest!r}: {cache.usable_blocks * cache.block_size:,} tokens, "
                f"{sized.devices[largest]:,} bytes): no session could be admitted",
            )
        # A workload's sessions were left unchecked at load (the caches were not read yet): those
        # that set their own memory, and those of a tenant whose quota is smaller than the budget's
        # bytes. Every one of them was rejected at submission, and `run` exited 0.
        for i, mix in enumerate(self.settings.workload.agents):
            reason = self.settings.inadmissible(
                mix, f"workload.agents.{i}", cache=(largest, sized.devices[largest]), sized=sized.session_bytes
            )
            if reason is not None:
                raise ConfigError(f"workload.agents.{i}", reason)
        # So were a trace's lines, each checked at load against no cache: the run exited 0 with
        # the trace's other sessions done.
        if self.settings.workload.trace is not None:
            from ..agents.workload import read_trace  # it imports the scheduler

            read_trace(self.settings.workload.trace, self.settings, cache=(largest, sized.devices[largest]), sized=sized.session_bytes)
        devices = [DeviceSettings(name=name, memory=memory) for name, memory in sized.devices.items()]
        resources = self.settings.resources.model_copy(update={"devices": devices, "page_size": sized.page_size})
        self.pool = create_pool(resources, self._quotas, spread=_replica_devices(self.backend, devices))
        self._session_memory = sized.session_bytes
        self._kv_sized = (dict(sized.devices), sized.page_size, cache.block_size)

    def _follow_kv_caches(self) -> None:
        """Limit each replica's device to the KV cache the backend last saw it report, where that
        is smaller than the cache the pool was sized from (`MemoryPool.set_device_limit`): a
        replica restarted with a smaller cache was admitted to as before, and preempted (64
        blocks, then 20: 3 preemptions). Its sessions stay; it takes no new one until they hold
        no more than its cache. Back to its size or more, the limit goes: the pool's devices keep
        the size they were built with (the backend warns of a cache grown past it). A cache of
        another block size is left to the backend's warning: the pool's pages are the old blocks.

        A cache smaller than a session's budget is warned of, naming the replica and the sizes:
        it takes no session until it is restarted with a larger cache, and where no replica can
        take one, sessions wait for admission (they are not refused: the replica may come back)
        with nothing else to tell a user why. A budget is a tenant's: where some tenants' sessions
        still fit (their own, smaller ``session_memory``), the warning names those that do not.

        A replica that is down (`Backend.replicas_down`) takes no new session until it is up
        again: admitted to it, a session's calls all went to the replicas still up, past the
        caches their devices were sized to (two replicas of six sessions each, one down: the
        other served ten). Its sessions keep their memory there meanwhile."""
        if self._kv_sized is None:
            return
        devices, page, block_size = self._kv_sized
        down = self.backend.replicas_down() & devices.keys()
        for name in sorted(down - self._replicas_down):
            logger.warning("vLLM replica %s is down: no new session is admitted to it until it answers again", name)
            self.pool.set_device_limit(name, 0)
        for name in sorted(self._replicas_down - down):
            logger.info("vLLM replica %s is up again: sessions are admitted to it again", name)
            self.pool.set_device_limit(name, None)  # its cache's limit, where it has one, is set below
        self._replicas_down = down
        for name, cache in self.backend.kv_capacities_seen().items():
            if name not in devices or name in down or cache.block_size != block_size:
                continue
            memory = cache.usable_blocks * page
            limit = memory if memory < devices[name] else None
            if limit != self.pool.device_limit(name):
                self.pool.set_device_limit(name, limit)
                self._say_cache_limit(name, cache, memory, limit)

    def _say_cache_limit(self, name: str, cache: KVCacheCapacity, memory: int, limit: int | None) -> None:
        """Log the limit `_follow_kv_caches` set on replica `name`'s device: a warning where it
        is smaller than some tenant's session budget (their own ``session_memory``, else the
        budget of ``context_tokens``: a replica that still took a tenant's smaller sessions was
        said to take none), naming those tenants where others' sessions still fit."""
        assert self._kv_sized is not None
        devices = self._kv_sized[0]
        budgets = {  # what a session of each tenant reserves, and the key that sets it
            tenant: (int(own.session_memory), f"tenants.{tenant}.session_memory")
            if own.session_memory is not None
            else (self._session_memory, "resources.kv_cache.context_tokens")
            for tenant, own in self.settings.tenants.items()
        }
        unfit = {tenant: budget for tenant, (budget, _) in budgets.items() if limit is not None and budget > limit}
        if not unfit:
            logger.info(
                "vLLM replica %s reports %s usable KV blocks: its sessions may hold %s of the %s bytes its device was sized to",
                name, f"{cache.usable_blocks:,}", f"{min(memory, devices[name]):,}", f"{devices[name]:,}",
            )  # fmt: skip
            return
        smallest, source = min(budgets[tenant] for tenant in unfit)
        largest = max(unfit.values())
        others = []  # the replicas that still take every session this one cannot
        for other, size in devices.items():
            other_limit = self.pool.device_limit(other)
            if (size if other_limit is None else other_limit) >= largest:
                others.append(other)
        whose = ""
        if len(unfit) < len(budgets):  # some tenants' sessions fit: name those that do not
            whose = f" of tenant{'s' * (len(unfit) > 1)} {', '.join(map(repr, sorted(unfit)))}"
        logger.warning(
            "vLLM replica %s reports %s usable KV blocks (%s bytes), less than a session's budget of %s bytes "
            "(%s): it takes no session%s until it is restarted with a larger cache; %s",
            name, f"{cache.usable_blocks:,}", f"{memory:,}", f"{smallest:,}", source, whose,
            f"replicas {', '.join(others)} take them meanwhile" if others
            else "no replica can take one, and sessions wait for admission until then",
        )  # fmt: skip

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._accepting = False
        assert self._exit_stack is not None and self._task_group is not None
        try:
            if exc_type is None:
                with anyio.move_on_after(self.settings.scheduler.drain_grace_s):
                    await self._idle.wait()  # a cancellation from outside ends the drain too
        finally:
            self._closing = True  # nothing is admitted from here on
            try:
                for entry in list(self._queue):
                    self._cancel_queued(entry.item)
                # Sessions that `run` started live in their callers' tasks, outside the task
                # group: cancel them, and wait for them to give back what they hold before the
                # backend closes.
                for handle in list(self._running.values()):
                    self._drop_readmission(handle)  # a wait shielded from the cancellation ends too
                    handle.cancel()
                self._task_group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self._idle.wait()
            finally:
                # The block's own exception propagates as it is, not wrapped in the task group's.
                try:
                    await self._exit_stack.__aexit__(None, None, None)
                except BaseExceptionGroup as group:
                    raise _bare_exit(group) from None

    # -- submitting ------------------------------------------------------------------------------

    async def submit(
        self,
        agent: Agent[T],
        *,
        tenant: str,
        tier: Tier | str | None = None,
        memory: int | None = None,
        deadline_s: float | None = None,
        name: str | None = None,
        kind: str = "agent",
        expected_s: float | None = None,
    ) -> SessionHandle[T]:
        """Queue a session of `agent` for `tenant` and return its handle at once.

        `tier` defaults to the tenant's, `memory` (bytes to reserve) to the tenant's
        `session_memory` or the scheduler's. `deadline_s` counts from now; past it the session
        is cancelled and fails with `DeadlineExceeded`. `expected_s`, how long the session is
        expected to run once admitted, is a hint for placing its memory (the pool's
        ``ends_at``): sessions expected to end together are placed side by side.

        Raises `UnknownTenant`, `RequestTooLarge` or `QuotaExceeded` (the session could never
        run: rejected at once), `SchedulerClosed` outside the ``async with`` block,
        `SessionFailed` when the memory pool fails admitting it at once (a move callback's error).
        """
        handle, now = self._new_session(agent, tenant, tier, memory, deadline_s, name, kind, expected_s)
        if not self._start_at_once(handle, now):
            self._enqueue(handle, now)
        return handle

    async def run(
        self,
        agent: Agent[T],
        *,
        tenant: str,
        tier: Tier | str | None = None,
        memory: int | None = None,
        deadline_s: float | None = None,
        name: str | None = None,
        kind: str = "agent",
        expected_s: float | None = None,
    ) -> T:
        """Run a session of `agent` to its end and return its result: ``await submit(...)`` in
        one step, with the same arguments, admission and errors.

        A session admitted at once runs in the calling task, not in one of the scheduler's (a
        fleet of thousands of short sessions saves a task each); one that must wait is queued
        and awaited as `submit` would. Cancelling the caller cancels the session.
        """
        handle, now = self._new_session(agent, tenant, tier, memory, deadline_s, name, kind, expected_s)
        if self._start_at_once(handle, now, spawn=False):
            await self._run(handle, now)
            return await handle
        self._enqueue(handle, now)
        try:
            return await handle
        except anyio.get_cancelled_exc_class():
            handle.cancel()  # the caller gave up: so does its session, queued or running in its own task
            raise

    def _new_session(
        self,
        agent: Agent[T],
        tenant: str,
        tier: Tier | str | None,
        memory: int | None,
        deadline_s: float | None,
        name: str | None,
        kind: str,
        expected_s: float | None = None,
    ) -> tuple[SessionHandle[T], float]:
        """A checked, counted session in the QUEUED state, and the time of its submission."""
        if not self._accepting:
            if self._exit_stack is not None:  # entered: it is draining or has closed
                raise SchedulerClosed("the scheduler has closed: its `async with` block was left (a Scheduler runs once)")
            raise SchedulerClosed("the scheduler is not accepting sessions (enter it with `async with` first)")
        if threading.get_ident() != self._thread:
            # Awaited in another thread's event loop (`asyncio.run(scheduler.submit(...))` in a
            # worker thread), the session was counted and given a slot, then failed to start in
            # the scheduler's task group: on trio an AttributeError, and the exit hung for ever.
            raise RuntimeError(
                "a session was submitted from a thread other than the scheduler's event loop's; submit it there: "
                "anyio.from_thread.run(functools.partial(scheduler.submit, agent, tenant=...)) from a worker thread"
            )
        if not callable(agent):
            raise TypeError(f"agent: expected an async function taking the session's context, got {agent!r:.80}")
        if inspect.isasyncgenfunction(agent):  # its call returns no awaitable, though it is an `async def`
            name = getattr(agent, "__name__", agent)
            raise TypeError(f"agent: {name!r:.80} is an async generator (it yields): an agent returns its result")
        if not isinstance(tenant, str):  # a list was "unhashable type: 'list'"
            raise TypeError(f"tenant: expected a tenant's name (a str), got {tenant!r:.80}")
        # A list as kind failed in the scheduler's own task when its session ended (its mean run
        # time is kept by kind): other sessions cancelled, its memory kept, the exit hung.
        if not isinstance(kind, str):
            raise TypeError(f"kind: expected a kind of session (a str), got {kind!r:.80}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name: expected a str or None, got {name!r:.80}")
        tenant_settings = self.settings.tenants.get(tenant)
        if tenant_settings is None:
            raise UnknownTenant(tenant, list(self.settings.tenants))
        tier = Tier.parse(tier) if tier is not None else tenant_settings.tier
        if memory is None:
            memory = int(tenant_settings.session_memory or self._session_memory)
        elif isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or not memory > 0:
            # Named here: the pool's own refusal speaks of "a reservation", not of this argument.
            raise ValueError(f"memory: expected a whole number of bytes > 0, got {memory!r:.80}")
        deadline_s = _seconds("deadline_s", deadline_s, finite=False) or tenant_settings.sla.deadline_s
        expected_s = _seconds("expected_s", expected_s, finite=True)
        now = anyio.current_time()
        handle = SessionHandle(
            agent,
            tenant=tenant,
            tier=tier,
            memory=memory,
            deadline=now + deadline_s if deadline_s else math.inf,
            name=name,
            kind=kind,
            expected_s=expected_s,
        )
        handle._set_state(QUEUED, now)
        try:
            self.pool.check(memory, tenant)
        except SessionRejected as exc:
            handle.error = exc
            handle._set_state(SessionState.REJECTED, now)
            self._record(handle)
            raise
        handle._on_cancel_queued = self._cancel_queued
        self._live += 1
        if self._idle.is_set():
            self._idle = anyio.Event()
        return handle, now

    def _enqueue(self, handle: SessionHandle, now: float) -> None:
        # Set before the push, which may admit or fail it at once (`_start`, `_refuse_queued`).
        handle._entry = Entry(handle.tenant, int(handle.tier), now, handle)
        self._push(handle._entry)
        if handle.state is SessionState.QUEUED and handle.deadline < math.inf:
            assert self._task_group is not None
            handle._queue_timer = anyio.CancelScope()
            self._task_group.start_soon(self._expire_queued, handle, handle._queue_timer)

    def _push(self, entry: Entry) -> Entry:
        """Queue `entry` (a new session, or one returning from a tool) and admit whoever can run."""
        kept = bool(self._kept_in_tool)  # sessions kept in a tool: the only ones a change of pressure may park
        waiting_before = self._queue.queued_by() if kept and self._queue else {}
        pushed = self._queue.push(entry)
        self._admit_ready()
        # Sessions now wait (or, for the first time, one of a tenant under its limit: those at
        # theirs cannot take a slot another tenant frees; or the first of a tenant with a session
        # kept in a tool, whose slot it can take): tools kept for lack of pressure may park.
        slots = self.slots
        if kept and self._queue and (
            not waiting_before
            or (slots.under_cap(entry.tenant) and not any(slots.under_cap(tenant) for tenant, _ in waiting_before))
            or (
                not any(tenant == entry.tenant for tenant, _ in waiting_before)
                and any(h.tenant == entry.tenant and h._holds_slot and h._park_timer is None for h in self._kept_in_tool)
            )
        ):
            self._reconsider_tools(anyio.current_time())
        return pushed

    # -- admission -------------------------------------------------------------------------------

    def _admit_ready(self) -> None:
        """Admit queued sessions, in policy order, while a slot and memory are both free."""
        # Nothing queued is the common case (every release and session end calls this, the pool's
        # listener and `_finish` both): it costs no clock read.
        if not self._queue or self._admitting or self._task_group is None or self._closing:
            return
        self._admitting = True
        try:
            now = anyio.current_time()
            over_quota: set[str] = set()

            def eligible(tenant: str) -> bool:
                return tenant not in over_quota and self.slots.can_take(tenant)

            while self._queue and not self.slots.full():
                entry = self._queue.peek(now, eligible)
                if entry is None:
                    return
                handle: SessionHandle = entry.item
                try:
                    reservation = self.pool.reserve_nowait(
                        handle.memory,
                        owner=handle,
                        tenant=handle.tenant,
                        priority=int(handle.tier),
                        device=handle._replica if handle._readmit is not None else None,
                        ends_at=self._ends_at(handle, now),
                    )
                except QuotaWouldBlock:
                    over_quota.add(handle.tenant)
                    continue
                except WouldBlock:
                    return  # the head waits for memory; a release calls us again
                except SessionRejected as exc:  # it can never fit now: its tenant's quota was lowered under it
                    self._refuse_queued(entry, exc)
                    continue
                except Exception as exc:  # the pool's own failure (a move callback's, compacting for it)
                    self._refuse_queued(entry, exc)  # fails that session alone: it raised out of `submit`
                    continue
                picked = self._queue.pick(now, eligible)
                assert picked is entry
                if handle._readmit is not None:
                    self._resume(handle, reservation)
                else:
                    self._start(handle, reservation, now)
        finally:
            self._admitting = False

    def _start_at_once(self, handle: SessionHandle, now: float, spawn: bool = True) -> bool:
        """Start `handle` without queueing it when nobody waits and a slot and memory are free
        (the fast path: what `_admit_ready` would do for a queue of one). With `spawn` False the
        caller runs the session itself (`run`)."""
        if self._queue or self._admitting or self._task_group is None or self._closing or not self.slots.can_take(handle.tenant):
            return False
        try:
            reservation = self.pool.reserve_nowait(
                handle.memory, owner=handle, tenant=handle.tenant, priority=int(handle.tier), ends_at=self._ends_at(handle, now)
            )
        except WouldBlock:  # QuotaWouldBlock too: it queues, and `_admit_ready` takes it from there
            return False
        except BaseException as exc:  # the session ends here: it stayed counted, and the exit hung
            state = _ended_by(exc)
            handle.error = None if state is SessionState.CANCELLED else exc
            self._end_unrun(handle, state, now)
            if state is SessionState.FAILED:  # the pool's own failure, as a queued session's is given: not a raw OSError
                raise SessionFailed(f"{handle.name} failed: the memory pool could not admit it: {_described(exc)}") from exc
            raise
        self._queue.serve_direct(handle.tenant, int(handle.tier), 1.0)  # a session costs 1, as a queued one does
        self._start(handle, reservation, now, spawn)
        return True

    def _ends_at(self, handle: SessionHandle, now: float) -> float | None:
        """When `handle`, given memory at `now`, is expected to give it back: the pool's
        placement hint. None when that is not known.

        From its `expected_s`, counted from its first admission (a session re-admitted after a
        tool call has run part of it already), never before `now`. Else (with
        `learn_session_ends`) from how long its kind's sessions held their memory: to their
        end, or to parking in a tool (a session that parks gives its memory back then, not at
        its end; hinted its kind's whole run time, it was placed beside memory held far longer).
        """
        if handle.expected_s is not None:
            return max(now, handle.timestamps.get(ADMITTED, now) + handle.expected_s)
        if self.settings.scheduler.learn_session_ends and handle.kind in self._hold_s:
            return now + self._hold_s[handle.kind]
        return None

    def _learn_hold(self, handle: SessionHandle, now: float) -> None:
        """Fold how long `handle` held the memory it gives back now into its kind's mean
        (weight 1/5 for the newest)."""
        previous = self._hold_s.get(handle.kind)
        held = now - handle._memory_since
        self._hold_s[handle.kind] = held if previous is None else previous + 0.2 * (held - previous)

    def _start(self, handle: SessionHandle, reservation: Any, now: float, spawn: bool = True) -> None:
        self._take_slot(handle)
        reservation.released_by = RELEASED_BY
        handle.reservation = reservation
        handle._memory_since = now
        handle._entry = None
        if handle._queue_timer is not None:
            handle._queue_timer.cancel()
            handle._queue_timer = None
        handle._scope = anyio.CancelScope(deadline=handle.deadline)
        handle._set_state(ADMITTED, now)
        self.recorder.add_admission(AdmissionRecord(handle.tenant, int(handle.tier), handle.timestamps[QUEUED], now))
        self._running[handle.id] = handle
        if spawn:
            assert self._task_group is not None
            self._task_group.start_soon(self._run, handle, name=handle.name)

    async def _run(self, handle: SessionHandle, now: float | None = None) -> None:
        """Run the admitted session's agent and finish it. `now`: the time, when the caller
        admitted it in this very instant (`run`, with no await between) and has it already."""
        slo = self.settings.tenants[handle.tenant].sla.ttft_p99_s
        ctx = context.SessionContext(handle, self.dispatcher, model=self.model, ttft_slo_s=slo or math.inf, pace=self)
        scope = handle._scope
        assert scope is not None
        outcome: SessionState | None = None
        try:
            with scope:
                handle._set_state(RUNNING, anyio.current_time() if now is None else now)
                handle.activity = THINKING
                if scope.cancel_called:  # cancelled, or past its deadline, since its admission
                    await anyio.lowlevel.checkpoint()  # delivers it: the agent never starts
                try:
                    handle._task = current_task()
                    running = handle.agent(ctx)
                    if not inspect.isawaitable(running):
                        # An `async def __call__` that yields is one `submit` cannot tell: it was
                        # told to "define it with `async def`", which it is.
                        fix = "it yields: an agent returns its result" if inspect.isasyncgen(running) else "define it with `async def`"
                        raise TypeError(f"the agent returned {type(running).__name__}, not an awaitable: {fix}")
                    handle.result = await running
                    outcome = DONE
                except BaseException as exc:
                    failure = _failure_of(exc)
                    if failure is None:
                        raise  # cancellation, Ctrl-C, exit: not the session's own failure
                    handle.error = failure
                    outcome = SessionState.FAILED
            if outcome is None and scope.cancelled_caught and not handle._cancel_requested:
                handle.error = DeadlineExceeded(f"{handle.name} passed its deadline")
                outcome = SessionState.FAILED
        finally:
            try:
                if ctx._open_streams:
                    with anyio.CancelScope(shield=True):
                        await ctx._close()
            finally:
                self._finish(handle, outcome or SessionState.CANCELLED, ctx)

    def _finish(self, handle: SessionHandle, state: SessionState, ctx: SessionContext) -> None:
        """End the session and give back its slot and memory (its memory once the calls made from
        tasks outside it have ended)."""
        self._running.pop(handle.id, None)
        handle._task = None
        self._released.pop(handle, None)
        self._in_tool.pop(handle, None)
        self._kept_in_tool.pop(handle, None)
        if handle._park_timer is not None:
            handle._park_timer.cancel()
        self._drop_readmission(handle)
        if handle._holds_slot:
            self._give_slot(handle)
        now = anyio.current_time()
        handle._set_state(state, now)
        if state is DONE and handle.reservation is not None:  # a failure's time says little
            self._learn_hold(handle, now)
        self._record(handle)
        self._session_ended()
        self.pool.forget(handle)  # refused for fragmentation when re-admitted, the pool held on to it
        if handle.calls_in_flight:
            # Calls made through its context from tasks outside the session, which outlived the
            # agent, are still at the engine: they use its memory until the last one ends. (Its
            # slot is free: the session is over, and its context makes no new call.)
            ctx._after_calls = lambda: self._release_memory(handle)
            self._admit_ready()  # its slot may be all that a queued session waits for
        else:
            self._release_memory(handle)

    def _release_memory(self, handle: SessionHandle) -> None:
        """The ended session gives back its memory; then whoever can run now is admitted."""
        reservation, handle.reservation = handle.reservation, None
        if reservation is not None:
            self._give_back(reservation)  # the pool's release listener admits the next sessions
        self._admit_ready()

    def _give_back(self, reservation: Reservation) -> None:
        """Release `reservation`. The pool raises what its owner's callbacks raised (a move
        callback settling others' memory, a release listener) after the release is done: logged
        here, not raised, it no longer leaves the ended session's cleanup to cancel every
        session of the scheduler."""
        try:
            self.pool.release(reservation)
        except Exception:
            if not reservation.released:  # refused before releasing (during a move): not to be hidden
                raise
            logger.exception("a callback of the memory pool failed after %r was released", reservation)

    async def _expire_queued(self, handle: SessionHandle, timer: anyio.CancelScope) -> None:
        """Fail `handle` with `DeadlineExceeded` if it still waits in the queue at its deadline
        (admission cancels the timer)."""
        with timer:
            await anyio.sleep_until(handle.deadline)
            if handle.state is SessionState.QUEUED:
                handle.error = DeadlineExceeded(f"{handle.name} passed its deadline while queued")
                self._drop_queued(handle, SessionState.FAILED)

    def _cancel_queued(self, handle: SessionHandle) -> None:
        self._drop_queued(handle, SessionState.CANCELLED)

    def _refuse_queued(self, entry: Entry, error: Exception) -> None:
        """A queued session that cannot be given its memory (`error` says why) fails alone: a new
        one is rejected (`SessionRejected`: it never can) or fails; one waiting to be re-admitted
        gets `error` where it waits."""
        handle: SessionHandle = entry.item
        if handle._readmit is None:
            handle.error = error
            self._drop_queued(handle, _ended_by(error))
            return
        # Its entry: `_readmit_entry` is set only once the push that got here returns.
        handle._readmit_entry = entry
        handle._readmit_error = error
        self._drop_readmission(handle)

    def _drop_queued(self, handle: SessionHandle, state: SessionState) -> None:
        """Take a queued session out of the queue, ending it in `state`."""
        if handle.state is not SessionState.QUEUED or handle._entry is None:
            return
        self._queue.remove(handle._entry)
        handle._entry = None
        if handle._queue_timer is not None:
            handle._queue_timer.cancel()
            handle._queue_timer = None
        self._end_unrun(handle, state, anyio.current_time())
        self._admit_ready()  # the head may have been the one blocking

    def _end_unrun(self, handle: SessionHandle, state: SessionState, now: float) -> None:
        """End in `state` a counted session that never ran."""
        handle._set_state(state, now)
        self._record(handle)
        self._session_ended()
        self.pool.forget(handle)  # refused for fragmentation while queued, the pool held on to it

    def _session_ended(self) -> None:
        self._live -= 1
        if self._live == 0:
            self._idle.set()

    def _record(self, handle: SessionHandle) -> None:
        state = str(handle.state)
        self._finished[state] = self._finished.get(state, 0) + 1
        ts = handle.timestamps
        c = handle.counters
        self.recorder.add_session(
            SessionRecord(
                handle.tenant,
                int(handle.tier),
                handle.kind,
                state,
                ts[QUEUED],
                ts.get(ADMITTED, math.nan),
                ts[handle.state],
                c.calls,
                c.prompt_tokens,
                c.completion_tokens,
                c.tool_s,
                error=None if handle.error is None else type(handle.error).__name__,
                readmit_wait_s=c.readmit_wait_s,
            )
        )

    # -- tool calls: keep or release ---------------------------------------------------------------

    def tool_started(self, handle: SessionHandle, tool: str, now: float) -> None:
        """A session entered a tool at `now`: park it now, after a time to live, or never (the policy)."""
        self._in_tool[handle] = (tool, now)
        if handle._holds_slot:
            self._kept_in_tool[handle] = None
        self._plan_park(handle, tool, now, now)

    def _plan_park(self, handle: SessionHandle, tool: str, started: float, now: float) -> None:
        ttl = self._tool_policy.ttl_s(tool, self._tool_stats, waiting=self._waiting_for(handle))
        remaining = ttl - (now - started)
        if remaining <= 0:
            self._park(handle)
        elif remaining < math.inf:
            handle._park_timer = anyio.CancelScope()
            assert self._task_group is not None
            self._task_group.start_soon(self._park_after, handle, remaining, handle._park_timer)

    def _waiting_for(self, handle: SessionHandle) -> int:
        """The queued sessions that the slot of `handle` could serve if it freed it: of its own
        tenant, or of a tenant under its own limit. (Every queued session counted: a tool was
        released for one of a tenant at its `max_sessions`, which could not take the slot, and
        the slot stood idle.)"""
        if not self._queue:
            return 0
        slots = self.slots
        return sum(n for (tenant, _), n in self._queue.queued_by().items() if tenant == handle.tenant or slots.under_cap(tenant))

    def _reconsider_tools(self, now: float) -> None:
        """Admission pressure appeared: decide again for sessions kept in a tool without a timer."""
        for handle in list(self._kept_in_tool):
            if handle._holds_slot and handle._park_timer is None:
                tool, started = self._in_tool[handle]
                self._plan_park(handle, tool, started, now)

    async def tool_finished(
        self, handle: SessionHandle, tool: str, seconds: float, *, readmit: bool = True, complete: bool = True
    ) -> None:
        """A session left a tool: learn its duration if `complete` (a tool cut short by a
        cancellation ran for less than it would have: learned, it would look shorter than it
        is); if it was parked, wait to be re-admitted unless not `readmit` (the tool raised: a
        later model call of the session re-admits it)."""
        if complete:
            self._tool_stats.observe(tool, seconds)
        if readmit:
            await self.busy(handle, call=False)
        else:
            self._out_of_tool(handle)

    def _out_of_tool(self, handle: SessionHandle) -> None:
        """`handle` is no longer idle in a tool: no park is planned for it."""
        self._in_tool.pop(handle, None)
        self._kept_in_tool.pop(handle, None)
        if handle._park_timer is not None:
            handle._park_timer.cancel()
            handle._park_timer = None

    async def busy(self, handle: SessionHandle, *, call: bool = True) -> None:
        """`handle` is busy again (its tool period ended, or it makes a model call inside one): it
        is no longer parked in this period, and if it was parked, it waits to be re-admitted.

        Nothing is re-admitted once the scheduler closes (a cancelled session's shielded cleanup
        waited for ever, and the exit with it): a model `call` then raises `SchedulerClosed`; the
        end of a tool period leaves the session parked."""
        self._out_of_tool(handle)
        if handle._holds_slot or handle.done:
            return
        if handle._readmitting is None:
            handle._readmitting = anyio.Lock()
        async with handle._readmitting:  # tasks of one session waiting at once: one re-admission
            while not handle._holds_slot and not handle.done:
                if self._closing:
                    if not call:
                        return
                    # The exit woke this wait and cancelled the session in the same step: the
                    # cancellation ends the session (CANCELLED, as the exit ends every other),
                    # not this error (it failed the session). A shielded call gets the error.
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    raise SchedulerClosed(f"{handle.name} is parked in a tool and the scheduler is closing: it makes no more model calls")
                await self._readmit(handle)
            # Another task of the session began a tool period while this one waited: the session,
            # parked then, could not park for it, and kept its slot through the whole tool.
            tool = self._in_tool.get(handle)
            if tool is not None and handle._holds_slot and handle._park_timer is None:
                self._plan_park(handle, tool[0], tool[1], anyio.current_time())

    def call_ended(self, handle: SessionHandle) -> None:
        """The last model call under way of `handle` ended while one of its tasks is in a tool
        period that began meanwhile: the park the call held off is planned now."""
        tool = self._in_tool.get(handle)
        if tool is not None and handle._holds_slot:
            if handle._park_timer is not None:
                handle._park_timer.cancel()
                handle._park_timer = None
            self._plan_park(handle, tool[0], tool[1], anyio.current_time())

    async def _park_after(self, handle: SessionHandle, ttl: float, timer: anyio.CancelScope) -> None:
        with timer:
            await anyio.sleep(ttl)
            if handle._park_timer is timer and handle in self._in_tool:
                self._park(handle)

    def _park(self, handle: SessionHandle) -> None:
        """Give the slot and memory of a session in a tool to whoever waits (not while a model
        call of the session, from another of its tasks, is under way)."""
        if not handle._holds_slot or handle.done or handle.calls_in_flight:
            return
        self._give_slot(handle)
        self._released[handle] = None
        handle.parked_count += 1
        reservation, handle.reservation = handle.reservation, None
        if reservation is not None:
            self._learn_hold(handle, anyio.current_time())
            # Re-admitted with what it holds now: it came back with its size at submission, and
            # the bytes it had grown to (`ctx.reservation.resize_nowait`) went to others.
            handle.memory = reservation.nbytes
            # Its calls went to this replica (affinity): re-admitted elsewhere, a session lost its
            # conversation's prefix cache at every tool call it parked in.
            handle._replica = reservation.device if reservation.device in self.dispatcher.replicas else None
            self._give_back(reservation)  # admits the next sessions through the release listener
        self._admit_ready()

    async def _readmit(self, handle: SessionHandle) -> None:
        """Queue a returning session ahead of its tenant's new ones and wait for slot and memory."""
        handle._readmit = granted = anyio.Event()
        # deadline -1 sorts before new sessions (deadline 0) of the tenant. It arrives now: aging
        # counts the time it waits, not its life (a batch session back from a tool after 215 s
        # was promoted past critical sessions that had waited 16 s). But it goes ahead of the
        # sessions of its tenant already waiting, and a queue ages by its head: it keeps the
        # wait of the head it displaces (arriving now, it took away their aging, and a batch
        # session waiting since 1 s, due in at 121 s, waited until 220 s behind it).
        now = anyio.current_time()
        head = self._queue.head(handle.tenant, int(handle.tier))
        arrival = now if head is None else min(now, head.arrival)
        entry = Entry(handle.tenant, int(handle.tier), arrival, handle, deadline=-1.0)
        handle._readmit_entry = self._push(entry)
        try:
            await granted.wait()  # _resume may have set it already, during _push above
        except BaseException:
            self._queue.remove(entry)  # no-op if it was already granted (then _finish releases)
            handle._readmit = None
            self._admit_ready()  # it may have headed the queue, holding back sessions that fit
            raise
        finally:  # queued again: a deadline missed here is the queue's, not the engine's
            handle.counters.readmit_wait_s += anyio.current_time() - now
        error, handle._readmit_error = handle._readmit_error, None
        if error is not None:
            raise error

    def _drop_readmission(self, handle: SessionHandle) -> None:
        """If a task of `handle` waits to be re-admitted, wake it: it never will be (the session
        ended, or the scheduler closes)."""
        if handle._readmit is not None:
            self._queue.remove(handle._readmit_entry)
            handle._readmit.set()
            handle._readmit = None

    def _resume(self, handle: SessionHandle, reservation: Any) -> None:
        self._take_slot(handle)
        self._released.pop(handle, None)
        reservation.released_by = RELEASED_BY
        handle.reservation = reservation
        handle._memory_since = anyio.current_time()
        event, handle._readmit = handle._readmit, None
        assert event is not None
        event.set()

    def _take_slot(self, handle: SessionHandle) -> None:
        """`handle` (admitted, or re-admitted) takes a slot of its tenant."""
        self.slots.take(handle.tenant)
        handle._holds_slot = True
        if handle in self._in_tool:  # re-admitted while another of its tasks is in a tool
            self._kept_in_tool[handle] = None
        key = (handle.tenant, handle.tier)
        self._holding[key] = self._holding.get(key, 0) + 1

    def _give_slot(self, handle: SessionHandle) -> None:
        """`handle` (ended, or parked in a tool) gives its slot back."""
        self.slots.give(handle.tenant)
        handle._holds_slot = False
        self._kept_in_tool.pop(handle, None)
        key = (handle.tenant, handle.tier)
        self._holding[key] -= 1

    async def _adapt_window(self) -> None:
        """Resize the dispatcher's in-flight window from the engine's signals, periodically."""
        dispatch = self.settings.dispatch
        policy = AimdWindow(dispatch.min_window, dispatch.max_window, dispatch.waiting_target)
        last_preemptions: float | None = None
        while True:
            await anyio.sleep(dispatch.window_interval_s)
            # A replica limited below its size is read on, calls or none: with its sessions ended
            # and the rest waiting for its cache, no call was made, it was not read again, and
            # the sessions waited on after it was restarted back.
            following = self._kv_sized is not None and any(self.pool.device_limit(name) is not None for name in self._kv_sized[0])
            if not following:
                await self.dispatcher.until_a_call()  # nothing to pace meanwhile
            try:
                signals = await self.backend.signals()
            except FleetschedError:
                continue  # no signals this round; keep the window
            self._follow_kv_caches()
            if following:
                d = self.dispatcher.statistics()
                if not d.in_flight and not d.queued:
                    continue  # read for the caches alone: no call to pace
            preempted = 0.0
            total = signals.preemptions_total
            if total is not None:
                if last_preemptions is not None:
                    # A reading below the last is a counter begun again at 0 (the server restarted,
                    # where the backend does not carry its counters over): all of it is new.
                    preempted = total - last_preemptions if total >= last_preemptions else total
                last_preemptions = total
            d = self.dispatcher.statistics()
            window = policy.next_window(
                WindowSignals(
                    window=d.window,
                    in_flight=d.in_flight,
                    queued=d.queued,
                    engine_waiting=signals.waiting,
                    kv_cache_usage=signals.kv_cache_usage,
                    preemptions=preempted,
                    ttft_s=self.dispatcher.take_engine_ttft(),
                    reserve=self.dispatcher.critical_reserve,
                )
            )
            if window != d.window:
                self.dispatcher.resize(window)

    # -- inspection ------------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        queued = {(t, str(Tier(tier))): n for (t, tier), n in self._queue.queued_by().items()}
        # Released and waiting to be re-admitted is counted as queued, not parked.
        parked = sum(handle.parked for handle in self._released)
        return SchedulerStatistics(
            queued=queued,
            running={(tenant, str(Tier(tier))): n for (tenant, tier), n in self._holding.items() if n},
            parked=parked,
            finished=dict(self._finished),
            slots_in_use=self.slots.in_use,
            slots_total=self.slots.total,
            memory=self.pool.statistics(),
            dispatcher=self.dispatcher.statistics(),
        )

    def running_sessions(self) -> list[SessionHandle]:
        return list(self._running.values())
