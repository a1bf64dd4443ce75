"""``fleetsched bench allocator``: replay agent churn traces through every placement strategy.

Each trace is a stream of sessions (arrival time, KV bytes, lifetime) generated from a seed:

``chat``         short chats: 2k-16k tokens of context, short exponential lifetimes.
``tool-agents``  long-context tool agents: 16k-128k tokens, heavy-tailed (Pareto) lifetimes.
``batch``        batch jobs arriving in bursts: 32k-160k tokens, long uniform lifetimes.
``mixed``        70 % chat, 25 % tool agents, 5 % batch, heavy-tailed lifetimes.
``seeds-80g``    the seeds' example: an 80 GB GPU, sessions of 4-32 GB (20 and 25 GB most common).
``multi-gpu``    the mixed workload over 2 x 80 GB + 2 x 40 GB, a third asking for a device.

Sizes are Llama-3-8B KV bytes (128 KiB a token, `session_bytes`, 16-token blocks); the offered
load (arrival rate x mean bytes x mean lifetime) is the same fraction of capacity for every
strategy (``offered_load`` per trace measures it on the generated sessions: 0.69-0.73 for
``LOAD`` 0.7, the sampling noise of the arrival gaps). A session that does not fit waits in FIFO order and is retried on every release
(like the scheduler), so a request refused several times counts once. Each session cycles busy
(a model call: pinned) then idle (a tool call or the user's turn: movable), the idle share per
workload being an assumption (`CHAT_IDLE`, ...; ``--idle-scale`` scales them); the replay turns
each session movable and pinned again at the edges of its cycle, as the scheduler does around a
tool call.

Every strategy runs three ways: as shipped (``strategies``: settling, which slides movable
sessions across holes as memory comes free and as sessions go idle and fills the holes it cannot
slide out of with the sessions at the edges of the largest free run, and on-demand compaction
before a fragmentation refusal), on-demand compaction only (``on_demand_only``: the pool before
settling), placement only (``placement_only``: nothing moves); and the default strategy with
``compact_threshold`` (``default_threshold_X``). Figures:

``frag_mean`` / ``frag_p95``  the seeds' fragmentation rate, (free - largest free) / free, sampled
                              at every arrival (the mean over devices), as before settling;
``frag_pinned_floor``         the mean rate left at those moments if every movable session were
                              repacked (`_pinned_floor`): what no compaction could have removed,
                              caused by where the pinned sessions lie; ``frag_mean`` above it is
                              packing left undone;
``frag_failures``             requests refused while their device(s) had enough free bytes;
``failures_no_room``          of those, the ones no rearrangement of the sessions movable at that
                              moment could have avoided (`_room_by_moving`): caused by where the
                              pinned sessions lie, not by how the movable ones are packed;
``peak_util``                 the most bytes held at once, over capacity (rounding included);
``wait_mean``                 mean wait of a session for its memory, in units of trace time;
``op_us_p50`` / ``op_us_p99`` wall time of reserve/release calls that did not search for moves
                              (the settling a release sets off included);
``settle_op_us_*``            wall time of pin changes that settled something;
``compaction_op_us_*``        reserve/release calls that searched for moves (rare);
``moved_gb_per_gb_granted``   the price of moving: bytes copied per byte reserved.

Those are per trace (``traces``); the rows over all traces (``strategies``, ``on_demand_only``,
``placement_only``, ``default_threshold_X``, ``default_hinted``...) take the mean of ``frag_mean``,
``frag_pinned_floor`` and ``wait_mean`` (every trace has as many arrivals), the worst trace's
``frag_p95``, ``peak_util`` and ``*_op_us_p99``, the median trace's ``op_us_p50``, and the sums
of the counts.

``hinted`` replays each trace through the default strategy as shipped with end hints: every
session tells the pool when it expects to release (``ends_at``), its lifetime off by a factor of
e^N(0, ``--hint-noise``) (0.5: half the hints off by a factor of more than 1.4), as an owner
that knows its agents' turns and tool times roughly would (``submit(expected_s=...)``);
``kind_hinted`` with the mean lifetime of the session's kind instead (chat, tool agent, batch
job) over the trace, which the scheduler's running mean of its finished sessions approximates
(``learn_session_ends``, on by default).

``targets`` gives, per trace, the default's failures over first-fit's: like for like (both as
shipped, ``default_over_first_fit_shipped``; both with on-demand compaction only; both placement
only, ``default_placement_only_over_first_fit``) and against the classic first-fit allocator that
never moves anything (``default_shipped_over_first_fit``, the other ``_over_first_fit`` ratios'
denominator too; null where the first-fit in the denominator had no failures), and which strategy
wins. Settling and on-demand compaction are the pool's, so every strategy gets them: like for like
is the comparison of placements. ``no_fragmentation``
replays each trace through a pool that counts bytes only (no address space): its ``wait_mean``
is what queueing alone costs, so a trace where even it waits longer than a session lives is
overloaded whatever the placement (``batch``: its bursts of 8 jobs hold 100 GB on average).
Separately: op timing with 10,000 live reservations of 1-5 pages under churn (none movable, and
half movable: settling then runs), and the gain of a compaction plan on a fragmented snapshot
(half the sessions movable).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import json_text
from .._args import float_in, non_negative_float, positive_int, unit_float
from ..errors import WouldBlock
from ..resources import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    CountingPool,
    DeviceLayout,
    DeviceSpec,
    ExtentPool,
    ExtentView,
    MemoryPool,
    Reservation,
    session_bytes,
)

GB = 10**9
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16: 128 KiB
LOAD = 0.7
#: The end hints' spread: a session's lifetime as its owner expects it, off by e^N(0, HINT_NOISE).
HINT_NOISE = 0.5


@dataclass(frozen=True, slots=True)
class Session:
    arrival: float
    nbytes: int
    lifetime: float
    device: str | None = None
    #: Share of its life the session is idle (in a tool call, between turns): movable then.
    idle_share: float = 0.0
    #: Length of one busy-then-idle cycle (a model call and the tool call or user turn after it).
    cycle: float = 1.0
    #: Where in its first cycle the session starts, 0..1.
    phase: float = 0.0
    #: What kind of session (chat, tool, batch, seeds): what a scheduler learns run times by.
    kind: str = ""

    def movable_at(self, t: float) -> bool:
        """Idle at time `t`: each cycle is busy (generating) first, then idle for `idle_share`."""
        if self.idle_share <= 0.0:
            return False
        return ((t - self.arrival) / self.cycle + self.phase) % 1.0 >= 1.0 - self.idle_share

    def next_change(self, t: float) -> tuple[float, bool]:
        """The first edge of the cycle after `t`: (its time, idle from then on); never: inf."""
        if not 0.0 < self.idle_share < 1.0:
            return math.inf, False
        u = (t - self.arrival) / self.cycle + self.phase
        busy_end = math.floor(u) + 1.0 - self.idle_share
        if u < busy_end:
            return self.arrival + (busy_end - self.phase) * self.cycle, True
        return self.arrival + (math.floor(u) + 1.0 - self.phase) * self.cycle, False


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    devices: tuple[DeviceSpec, ...]
    sessions: tuple[Session, ...]
    seed: int = 0

    def hints(self, noise: float) -> list[float]:
        """Each session's lifetime as its owner expects it: off by a factor of e^N(0, `noise`)."""
        rng = random.Random(f"{self.seed}:{self.name}:hints")
        return [s.lifetime * rng.lognormvariate(0.0, noise) for s in self.sessions]

    def kind_means(self) -> list[float]:
        """Each session's lifetime as a scheduler learns it by default: its kind's mean (over the
        whole trace, which the scheduler's running mean of finished sessions approximates)."""
        by_kind: dict[str, list[float]] = {}
        for s in self.sessions:
            by_kind.setdefault(s.kind, []).append(s.lifetime)
        means = {kind: statistics.fmean(lives) for kind, lives in by_kind.items()}
        return [means[s.kind] for s in self.sessions]


def _tokens_bytes(tokens: int) -> int:
    return session_bytes(tokens, bytes_per_token=BYTES_PER_TOKEN)


def _pareto(rng: random.Random, mean: float, alpha: float = 1.5, cap: float = 50.0) -> float:
    scale = mean * (alpha - 1) / alpha
    return min(scale * rng.paretovariate(alpha), cap * mean)


# Idle shares and cycles are assumptions, not measurements: a chat waits on its user about half
# the time; a tool agent spends most of its time in tools (6 of 10 parts); a batch job generates
# without pause. `--idle-scale` scales them to show how much the figures lean on them.
CHAT_IDLE, TOOL_IDLE, BATCH_IDLE, SEEDS_IDLE = 0.5, 0.6, 0.0, 0.5

Draw = tuple[int, float, float, float, str]  # bytes, lifetime, idle share, cycle, kind


def _chat(rng: random.Random) -> Draw:
    return _tokens_bytes(rng.randint(2_000, 16_000)), rng.expovariate(1.0), CHAT_IDLE, 0.25, "chat"


def _tool(rng: random.Random) -> Draw:
    tokens = int(math.exp(rng.uniform(math.log(16_000), math.log(128_000))))
    return _tokens_bytes(tokens), _pareto(rng, 8.0), TOOL_IDLE, 0.5, "tool"


def _batch(rng: random.Random) -> Draw:
    return _tokens_bytes(rng.randint(32_000, 160_000)), rng.uniform(10.0, 30.0), BATCH_IDLE, 1.0, "batch"


def _mixed(rng: random.Random) -> Draw:
    u = rng.random()
    nbytes, _, idle, cycle, kind = (_chat if u < 0.70 else _tool if u < 0.95 else _batch)(rng)
    return nbytes, _pareto(rng, 3.0 if u < 0.70 else 8.0), idle, cycle, kind


def _seeds(rng: random.Random) -> Draw:
    gb = rng.choices([4, 8, 12, 16, 20, 25, 32], weights=[2, 2, 2, 2, 4, 4, 1])[0]
    return gb * GB + rng.randint(0, 512) * 2**20, rng.expovariate(1 / 4.0), SEEDS_IDLE, 0.5, "seeds"


def _generate(
    name: str, devices: tuple[DeviceSpec, ...], draw: Callable[[random.Random], Draw], count: int, seed: int,
    *, bursty: bool = False, affinity: float = 0.0, load: float = LOAD, idle_scale: float = 1.0,
) -> Trace:
    rng = random.Random(f"{seed}:{name}")
    capacity = sum(d.capacity for d in devices)
    drawn = [draw(rng) for _ in range(count)]
    mean_area = statistics.fmean(d[0] * d[1] for d in drawn)
    rate = load * capacity / mean_area  # Little's law: the offered load is LOAD of capacity
    clock = 0.0
    sessions = []
    for i, (nbytes, life, idle, cycle, kind) in enumerate(drawn):
        if bursty:
            if i % 8 == 0:
                clock += rng.expovariate(rate / 8)
        else:
            clock += rng.expovariate(rate)
        device = rng.choice(devices).name if rng.random() < affinity else None
        sessions.append(Session(clock, nbytes, life, device, min(1.0, idle * idle_scale), cycle, rng.random(), kind))
    return Trace(name, devices, tuple(sessions), seed)


def traces(count: int, seed: int, load: float = LOAD, idle_scale: float = 1.0) -> list[Trace]:
    gpu = (DeviceSpec("gpu0", 80 * GB),)
    mixed_gpus = (DeviceSpec("gpu0", 80 * GB), DeviceSpec("gpu1", 80 * GB), DeviceSpec("gpu2", 40 * GB), DeviceSpec("gpu3", 40 * GB))
    return [
        _generate("chat", (DeviceSpec("gpu0", 24 * GB),), _chat, count, seed, load=load, idle_scale=idle_scale),
        _generate("tool-agents", gpu, _tool, count, seed, load=load, idle_scale=idle_scale),
        _generate("batch", gpu, _batch, count, seed, bursty=True, load=load, idle_scale=idle_scale),
        _generate("mixed", gpu, _mixed, count, seed, load=load, idle_scale=idle_scale),
        _generate("seeds-80g", gpu, _seeds, count, seed, load=load, idle_scale=idle_scale),
        _generate("multi-gpu", mixed_gpus, _mixed, count, seed, affinity=1 / 3, load=load, idle_scale=idle_scale),
    ]


def offered_load(trace: Trace) -> float | None:
    """Bytes x lifetime offered per unit of time, over capacity: what `LOAD` asks for.

    None when the arrivals span no time (one session): there is no rate to measure, and
    infinity would be written to the JSON as ``Infinity``, which is not JSON."""
    span = trace.sessions[-1].arrival - trace.sessions[0].arrival
    capacity = sum(d.capacity for d in trace.devices)
    return sum(s.nbytes * s.lifetime for s in trace.sessions) / (capacity * span) if span > 0 else None


def _pct(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (rank ceil(q n): p99 of 100 values is the 99th); 0.0 of none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)]  # round: 0.07 * 100 is 7.000000000000001


def replay(
    trace: Trace,
    strategy: str,
    *,
    compact: bool = True,
    settle: bool | None = None,
    threshold: float | None = None,
    expected: Sequence[float] | None = None,
) -> dict[str, float]:
    """Run `trace` through an `ExtentPool` with `strategy`; return its figures.

    `compact`, `settle` and `threshold` are the pool's on-demand compaction, settling (None: as
    `compact`) and `compact_threshold`. Events run in time order: departures, then pin changes,
    then arrivals at one instant. A pin change is a session turning idle (movable, as the
    scheduler marks a session in a tool call) or busy again, at the edges of its cycle
    (`Session.movable_at`); when settling moved something then, waiting sessions are retried, as
    after a release. Reserve and release calls that searched for moves are timed
    apart (``compaction_op_us_*``) from the rest (``op_us_*``, settling set off by a release
    included); pin changes that settled something are timed as ``settle_op_us_*``. Strategy
    "counting" replays through a `CountingPool`: the same queue without fragmentation. With
    `expected` (a lifetime per session: `Trace.hints`, `Trace.kind_means`), each session
    reserves with ``ends_at``, its admission time plus its expected lifetime.
    """
    pool: MemoryPool
    if strategy == "counting":
        pool = CountingPool(trace.devices)
    else:
        pool = ExtentPool(trace.devices, strategy=strategy, compact=compact, settle=settle, compact_threshold=threshold)
    # Only moves read the pins, and `failures_no_room`: a counting pool needs none.
    moving = isinstance(pool, ExtentPool)
    capacity = sum(d.total for d in pool.statistics().devices)
    depart, pin, arrive = 0, 1, 2  # the order of events at one instant
    # (time, kind, session, idle from then on: pin changes only)
    events = [(s.arrival, arrive, i, False) for i, s in enumerate(trace.sessions)]
    heapq.heapify(events)
    pending: deque[int] = deque()
    live: dict[int, tuple[Reservation, float]] = {}  # session -> (reservation, departure time)
    frag: list[float] = []
    floor: list[float] = []
    ops: list[float] = []
    compaction_ops: list[float] = []
    settle_ops: list[float] = []
    waits: list[float] = []
    peak = granted = no_room = 0

    def settles() -> int:
        return getattr(pool, "settles", 0)

    def timed(op: Callable[[], object], *, pin_change: bool = False) -> object:
        searches, settled = getattr(pool, "compaction_searches", 0), settles()
        start = time.perf_counter()  # wall-clock ok
        try:
            return op()
        finally:
            elapsed = time.perf_counter() - start  # wall-clock ok
            if getattr(pool, "compaction_searches", 0) != searches:
                compaction_ops.append(elapsed)
            elif pin_change:
                if settles() != settled:
                    settle_ops.append(elapsed)
            else:
                ops.append(elapsed)

    def next_pin(i: int, at: float, idle: bool) -> None:
        if at < live[i][1]:
            heapq.heappush(events, (at, pin, i, idle))

    def admit(i: int, now: float) -> bool:
        nonlocal peak, granted, no_room
        s = trace.sessions[i]
        failures = pool.fragmentation_failures
        try:
            ends_at = None if expected is None else now + expected[i]
            r = timed(lambda: pool.reserve_nowait(s.nbytes, owner=i, device=s.device, ends_at=ends_at))
        except WouldBlock:
            if pool.fragmentation_failures != failures and isinstance(pool, ExtentPool):
                no_room += not _room_by_moving(pool, s.nbytes)
            return False
        assert isinstance(r, Reservation)
        live[i] = (r, now + s.lifetime)
        heapq.heappush(events, (now + s.lifetime, depart, i, False))
        if moving:
            r.movable = s.movable_at(now)
            next_pin(i, *s.next_change(now))
        waits.append(now - s.arrival)
        granted += s.nbytes
        peak = max(peak, pool.statistics().allocated)
        return True

    def drain(now: float) -> None:
        while pending and admit(pending[0], now):
            pending.popleft()

    while events:
        now, kind, i, idle = heapq.heappop(events)
        if kind == arrive:
            frag.append(statistics.fmean(d.fragmentation for d in pool.statistics().devices))
            if moving:
                floor.append(_pinned_floor(pool))  # type: ignore[arg-type]
            if pending or not admit(i, now):
                pending.append(i)
        elif kind == depart:
            timed(live.pop(i)[0].release)
            drain(now)
        elif i in live:
            r, s, settled = live[i][0], trace.sessions[i], settles()
            timed(lambda: setattr(r, "movable", idle), pin_change=True)
            next_pin(i, now + s.cycle * (s.idle_share if idle else 1.0 - s.idle_share), not idle)
            if settles() != settled:
                drain(now)
    stats = pool.statistics()
    return {
        "frag_mean": statistics.fmean(frag),
        "frag_p95": _pct(frag, 0.95),
        "frag_pinned_floor": statistics.fmean(floor) if floor else 0.0,
        "frag_failures": pool.fragmentation_failures,
        "failures_no_room": no_room,
        "peak_util": peak / capacity,
        "wait_mean": statistics.fmean(waits),
        "op_us_p50": _pct(ops, 0.50) * 1e6,
        "op_us_p99": _pct(ops, 0.99) * 1e6,
        "compactions": stats.compactions,
        "compaction_ops": len(compaction_ops),
        "compaction_op_us_p50": _pct(compaction_ops, 0.50) * 1e6,
        "compaction_op_us_p99": _pct(compaction_ops, 0.99) * 1e6,
        "settles": settles(),
        "settle_op_us_p50": _pct(settle_ops, 0.50) * 1e6,
        "settle_op_us_p99": _pct(settle_ops, 0.99) * 1e6,
        "moves": stats.moves,
        "moved_gb": stats.moved_bytes / GB,
        "moved_bytes_per_op": stats.moved_bytes / max(1, len(ops) + len(compaction_ops)),
        "moved_gb_per_gb_granted": stats.moved_bytes / max(1, granted),
        "granted_gb": granted / GB,
    }


def _room_by_moving(pool: ExtentPool, nbytes: int) -> bool:
    """Whether any rearrangement of the movable reservations would open room for `nbytes`.

    The unmovable reservations cut each device into stretches. A window in a stretch at least
    the request's size can be opened when the stretch's movable reservations fit in what the
    window leaves of it and in the free pages of the other stretches (each repacked as needed),
    packed first-fit decreasing. A diagnostic: it says which failures no compaction of movable
    sessions could have avoided at that moment (first-fit decreasing may miss a rare packing).
    """
    for layout in pool.layouts():
        n = pool.strategy.round(-(-nbytes // pool.page_size), pool.space(layout.name))
        stretches = _stretches(layout)
        free = [pages - sum(held) for pages, held in stretches]
        for k, (pages, held) in enumerate(stretches):
            if pages >= n and not _unpacked(held, [pages - n, *free[:k], *free[k + 1 :]]):
                return True
    return False


def _pinned_floor(pool: ExtentPool) -> float:
    """The fragmentation rate (mean over devices) left if every movable reservation were repacked now.

    The largest free run a repacking can open lies in one stretch between unmovable
    reservations: the stretch less those of its movable reservations that fit in no other
    stretch's free pages (first-fit decreasing). What settling leaves above this is packing;
    the rest is where the pinned sessions lie.
    """
    rates = []
    for layout in pool.layouts():
        free_pages = pool.space(layout.name).free_pages
        if not free_pages:
            rates.append(0.0)
            continue
        stretches = _stretches(layout)
        free = [pages - sum(held) for pages, held in stretches]
        largest = max(pages - _unpacked(held, free[:k] + free[k + 1 :]) for k, (pages, held) in enumerate(stretches))
        rates.append((free_pages - largest) / free_pages)
    return statistics.fmean(rates)


def _stretches(layout: DeviceLayout) -> list[tuple[int, list[int]]]:
    """The runs between unmovable extents: (pages, lengths of the movable extents in it)."""
    stretches: list[tuple[int, list[int]]] = []
    cursor, held = 0, []
    for e in [*sorted(layout.extents, key=lambda e: e.offset), ExtentView(None, layout.pages, 0, False)]:
        if e.movable:
            held.append(e.length)
            continue
        stretches.append((e.offset - cursor, held))
        cursor, held = e.offset + e.length, []
    return stretches


def _unpacked(items: list[int], bins: list[int]) -> int:
    """First-fit decreasing of `items` into `bins`: the total length of the items left out."""
    bins = sorted(bins)
    left = 0
    for item in sorted(items, reverse=True):
        for k, room in enumerate(bins):
            if room >= item:
                bins[k] -= item
                break
        else:
            left += item
    return left


def live_timing(strategy: str, live: int = 10_000, churn: int = 20_000, seed: int = 0, movable: float = 0.0) -> dict[str, float]:
    """Op wall time with `live` reservations of 1-5 pages held on one 80 GB device, under churn.

    A share `movable` of the reservations is marked movable when placed: settling may then run
    on that mark (timed as a settle op) and on releases, and on-demand compaction when a request
    finds no hole; reserve/release calls that searched for moves are timed apart.
    """
    rng = random.Random(seed)
    pool = ExtentPool([DeviceSpec("gpu0", 80 * GB)], strategy=strategy)
    page = pool.page_size
    held = []
    try:  # size-class rounds a page up to 5 % of the device: it holds far fewer
        while len(held) < live:
            held.append(pool.reserve_nowait(rng.randint(1, 5) * page - rng.randint(0, page - 1)))
            held[-1].movable = rng.random() < movable
    except WouldBlock:
        pass
    ops: list[float] = []
    compaction_ops: list[float] = []
    settle_ops: list[float] = []

    def timed(op: Callable[[], object], *, pin_change: bool = False) -> object:
        searches, settles = pool.compaction_searches, pool.settles
        start = time.perf_counter()  # wall-clock ok
        try:
            return op()
        finally:
            elapsed = time.perf_counter() - start  # wall-clock ok
            if pool.compaction_searches != searches:
                compaction_ops.append(elapsed)
            elif pin_change:
                if pool.settles != settles:
                    settle_ops.append(elapsed)
            else:
                ops.append(elapsed)

    for _ in range(churn):
        victim = held.pop(rng.randrange(len(held)))
        timed(victim.release)
        nbytes = rng.randint(1, 5) * page - rng.randint(0, page - 1)
        try:
            r = timed(lambda: pool.reserve_nowait(nbytes))
        except WouldBlock:
            continue
        assert isinstance(r, Reservation)
        held.append(r)
        if rng.random() < movable:
            timed(lambda: setattr(r, "movable", True), pin_change=True)
    return {
        "live": len(held),
        "op_us_p50": _pct(ops, 0.5) * 1e6,
        "op_us_p99": _pct(ops, 0.99) * 1e6,
        "compaction_ops": len(compaction_ops),
        "compaction_op_us_p50": _pct(compaction_ops, 0.5) * 1e6,
        "compaction_op_us_p99": _pct(compaction_ops, 0.99) * 1e6,
        "settle_ops": len(settle_ops),
        "settle_op_us_p99": _pct(settle_ops, 0.99) * 1e6,
        "all_op_us_p99": _pct(ops + compaction_ops + settle_ops, 0.99) * 1e6,
        "moved_bytes_per_op": pool.moved_bytes / max(1, len(ops) + len(compaction_ops)),
    }


def defrag_gain(seed: int = 0) -> dict[str, float]:
    """Fragment an 80 GB device with mixed sessions (half movable), then plan and apply a compaction.

    The snapshot is built with settling off, so that the plan has the fragmentation to remove;
    ``settled_*`` is what settling alone makes of the same snapshot as its sessions turn movable.
    """
    pool = _fragmented(seed, settle=False)
    before = pool.statistics()
    start = time.perf_counter()  # wall-clock ok
    plan = pool.plan_compaction(threshold=0.0)
    plan_ms = (time.perf_counter() - start) * 1e3  # wall-clock ok
    result = pool.apply_plan(plan)
    after = pool.statistics()
    settled = _fragmented(seed, settle=True).statistics()
    return {
        "largest_free_gb_before": before.largest_free / GB,
        "largest_free_gb_after": after.largest_free / GB,
        "frag_before": before.fragmentation,
        "frag_after": after.fragmentation,
        "moves": result.applied,
        "moved_gb": result.moved_bytes / GB,
        "plan_ms": plan_ms,
        "settled_largest_free_gb": settled.largest_free / GB,
        "settled_frag": settled.fragmentation,
        "settled_moved_gb": settled.moved_bytes / GB,
    }


def _fragmented(seed: int, *, settle: bool) -> ExtentPool:
    rng = random.Random(f"{seed}:defrag")
    pool = ExtentPool([DeviceSpec("gpu0", 80 * GB)], strategy=DEFAULT_STRATEGY, settle=settle, settle_moves=None)
    held = []
    while True:  # fill, then free a random 40 %
        nbytes = _mixed(rng)[0]
        try:
            held.append(pool.reserve_nowait(nbytes))
        except WouldBlock:
            break
    rng.shuffle(held)
    for r in held[: len(held) * 2 // 5]:
        r.release()
    for r in held[len(held) * 2 // 5 :]:
        r.movable = rng.random() < 0.5
    return pool


def _aggregate(rows: list[dict[str, float]]) -> dict[str, float]:
    # Every trace's bytes granted count, those of traces that moved nothing too (read back from
    # the ratio, they were left out, and the ratio over the traces came out too high).
    granted = sum(r["granted_gb"] for r in rows)
    return {
        "frag_mean": statistics.fmean(r["frag_mean"] for r in rows),
        "frag_p95": max(r["frag_p95"] for r in rows),
        "frag_pinned_floor": statistics.fmean(r["frag_pinned_floor"] for r in rows),
        "frag_failures": sum(int(r["frag_failures"]) for r in rows),
        "failures_no_room": sum(int(r["failures_no_room"]) for r in rows),
        "peak_util": max(r["peak_util"] for r in rows),  # the most held at once, as per trace (not a mean of peaks)
        "wait_mean": statistics.fmean(r["wait_mean"] for r in rows),
        "op_us_p50": statistics.median(r["op_us_p50"] for r in rows),
        "op_us_p99": max(r["op_us_p99"] for r in rows),
        "compaction_ops": sum(int(r["compaction_ops"]) for r in rows),
        "compaction_op_us_p99": max(r["compaction_op_us_p99"] for r in rows),
        "settles": sum(int(r["settles"]) for r in rows),
        "settle_op_us_p99": max(r["settle_op_us_p99"] for r in rows),
        "moves": sum(int(r["moves"]) for r in rows),
        "moved_gb": sum(r["moved_gb"] for r in rows),
        "moved_gb_per_gb_granted": sum(r["moved_gb"] for r in rows) / granted if granted else 0.0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench allocator", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--sessions", type=positive_int, default=4000, help="sessions per trace (default 4000)")
    parser.add_argument("--seed", type=int, default=0)
    # Outside these the replay breaks: at a load of 1e-15 the arrival clock reaches 1e15 s, where a
    # step of a session's cycle rounds back to the same instant and the replay loops for ever;
    # a hint noise over ~190 overflows its lognormal draw.
    parser.add_argument("--load", type=float_in(0.01, 10.0), default=LOAD, help=f"offered load, fraction of capacity, 0.01-10 (default {LOAD})")
    parser.add_argument("--idle-scale", type=non_negative_float, default=1.0, help="scale the sessions' idle (movable) shares")
    parser.add_argument("--threshold", type=unit_float, default=0.3, help="compact_threshold for the threshold row (default 0.3)")
    parser.add_argument("--strategies", type=_strategy_names, default=list(STRATEGIES), help="comma-separated names")
    parser.add_argument(
        "--hint-noise", type=float_in(0.0, 5.0), default=HINT_NOISE,
        help=f"spread of the end hints of the hinted row: lifetimes off by e^N(0, X) (default {HINT_NOISE})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = args.strategies
    generated = traces(args.sessions, args.seed, args.load, args.idle_scale)
    shipped = {t.name: {n: replay(t, n) for n in names} for t in generated}
    on_demand = {t.name: {n: replay(t, n, settle=False) for n in names} for t in generated}
    placement = {t.name: {n: replay(t, n, compact=False) for n in names} for t in generated}
    threshold = {t.name: replay(t, DEFAULT_STRATEGY, threshold=args.threshold) for t in generated}
    reference = {t.name: replay(t, "counting") for t in generated}
    hinted = {t.name: replay(t, DEFAULT_STRATEGY, expected=t.hints(args.hint_noise)) for t in generated}
    kind_hinted = {t.name: replay(t, DEFAULT_STRATEGY, expected=t.kind_means()) for t in generated}
    result: dict[str, object] = {
        "default": DEFAULT_STRATEGY,
        "load": args.load,
        "sessions_per_trace": args.sessions,
        "seed": args.seed,
        "idle_scale": args.idle_scale,
        "hint_noise": args.hint_noise,
        # Every strategy in the pool as shipped: settling and on-demand compaction.
        "strategies": {n: _aggregate([shipped[t][n] for t in shipped]) for n in names},
        # On-demand compaction alone (no settling): the pool as it was before settling.
        "on_demand_only": {n: _aggregate([on_demand[t][n] for t in on_demand]) for n in names},
        # The same without any compaction: placement alone.
        "placement_only": {n: _aggregate([placement[t][n] for t in placement]) for n in names},
        f"default_threshold_{args.threshold}": _aggregate(list(threshold.values())),
        # The default as shipped, every session reserving with an end hint (`ends_at`): its own
        # lifetime, off by e^N(0, hint_noise); its kind's mean lifetime (what the scheduler learns).
        "default_hinted": _aggregate(list(hinted.values())),
        "default_kind_hinted": _aggregate(list(kind_hinted.values())),
        "traces": {
            t: {"shipped": shipped[t], "on_demand_only": on_demand[t], "placement_only": placement[t],
                "threshold": threshold[t], "hinted": hinted[t], "kind_hinted": kind_hinted[t],
                "no_fragmentation": {k: reference[t][k] for k in ("wait_mean", "peak_util")},
                "lifetime_mean": statistics.fmean(s.lifetime for s in trace.sessions),
                "offered_load": offered_load(trace)}  # fmt: skip
            for t, trace in zip(shipped, generated)
        },
        "live_10k": {n: live_timing(n, seed=args.seed) for n in names},
        "live_10k_half_movable": live_timing(DEFAULT_STRATEGY, seed=args.seed, movable=0.5),
        "defrag": {"snapshot": defrag_gain(args.seed)},
    }
    if "first-fit" in names and DEFAULT_STRATEGY in names:
        result["targets"] = _targets(shipped, on_demand, placement, threshold, hinted, kind_hinted)
    if args.json:
        print(json_text(result))
        return 0
    columns = ["frag_mean", "frag_p95", "frag_pinned_floor", "frag_failures", "failures_no_room", "wait_mean",
               "op_us_p99", "settle_op_us_p99", "compaction_op_us_p99", "moved_gb_per_gb_granted"]  # fmt: skip
    tables = [("all traces, as shipped (settling, on-demand compaction)", result["strategies"]),
              ("all traces, on-demand compaction only", result["on_demand_only"]),
              ("all traces, placement only", result["placement_only"])]  # fmt: skip
    for title, rows in (("as shipped", shipped), ("on-demand compaction only", on_demand), ("placement only", placement)):
        tables += [(f"{t}, {title}", rows[t]) for t in rows]
    for title, table in tables:
        print(f"\n== {title} ==")
        print(f"{'strategy':<12}" + "".join(f"{c[:14]:>15}" for c in columns))
        for n, row in table.items():  # type: ignore[attr-defined]
            print(f"{n:<12}" + "".join(f"{row[c]:>15.3f}" if isinstance(row[c], float) else f"{row[c]:>15}" for c in columns))
    row = result[f"default_threshold_{args.threshold}"]
    print(f"\n{DEFAULT_STRATEGY} with compact_threshold {args.threshold}: " + ", ".join(f"{c} {row[c]:.3f}" for c in columns))  # type: ignore[index]
    print(f"\n== {DEFAULT_STRATEGY} as shipped, with end hints: none / own lifetime (noise {args.hint_noise}) / kind's mean ==")
    for t, row in hinted.items():
        rows = (shipped[t][DEFAULT_STRATEGY], row, kind_hinted[t])
        print(f"{t:<12} frag_failures " + " / ".join(f"{r['frag_failures']:>5}" for r in rows)
              + "   frag_mean " + " / ".join(f"{r['frag_mean']:.3f}" for r in rows))  # fmt: skip
    print("\n== 10,000 live reservations, churn ==")
    for n, row in {**result["live_10k"], f"{DEFAULT_STRATEGY} (half movable)": result["live_10k_half_movable"]}.items():  # type: ignore[dict-item]
        print(f"{n:<28} live={row['live']:>6}  op p50={row['op_us_p50']:.1f} us  p99={row['op_us_p99']:.1f} us  "
              f"compaction ops {row['compaction_ops']} p99={row['compaction_op_us_p99']:.0f} us  "
              f"settle ops {row['settle_ops']} p99={row['settle_op_us_p99']:.0f} us  "
              f"all ops p99={row['all_op_us_p99']:.1f} us")  # fmt: skip
    d = result["defrag"]["snapshot"]  # type: ignore[index]
    print(
        f"\n== compaction on a fragmented 80 GB device ==\nlargest free {d['largest_free_gb_before']:.1f} -> "
        f"{d['largest_free_gb_after']:.1f} GB, fragmentation {d['frag_before']:.2f} -> {d['frag_after']:.2f}, "
        f"{d['moves']} moves ({d['moved_gb']:.1f} GB), planned in {d['plan_ms']:.1f} ms; settling the same "
        f"snapshot: largest free {d['settled_largest_free_gb']:.1f} GB, fragmentation {d['settled_frag']:.2f}, "
        f"{d['settled_moved_gb']:.1f} GB moved"
    )
    if "targets" in result:
        print("\n== targets ==")
        print(json_text(result["targets"]))
    return 0


def _strategy_names(text: str) -> list[str]:
    """``--strategies``: placement strategies by name, comma-separated, each once."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        what = f"unknown strategy {unknown[0]!r}" if unknown else "no strategy named"
        raise argparse.ArgumentTypeError(f"{what}; known: {', '.join(STRATEGIES)}")
    return names


def _targets(
    shipped: dict, on_demand: dict, placement: dict, threshold: dict, hinted: dict, kind_hinted: dict
) -> dict[str, object]:
    """Default vs first-fit failures per trace, like for like and against first-fit that never moves."""
    out: dict[str, object] = {}
    for t in shipped:
        ff = placement[t]["first-fit"]["frag_failures"]
        default, first_fit = shipped[t][DEFAULT_STRATEGY], shipped[t]["first-fit"]
        out[t] = {
            "first_fit_placement_only": placement[t]["first-fit"]["frag_failures"],
            "default_shipped": default["frag_failures"],
            "first_fit_shipped": first_fit["frag_failures"],
            "default_over_first_fit_shipped": _ratio(default["frag_failures"], first_fit["frag_failures"]),
            "default_over_first_fit_on_demand_only": _ratio(
                on_demand[t][DEFAULT_STRATEGY]["frag_failures"], on_demand[t]["first-fit"]["frag_failures"]
            ),
            "default_shipped_over_first_fit": _ratio(shipped[t][DEFAULT_STRATEGY]["frag_failures"], ff),
            "default_placement_only_over_first_fit": _ratio(placement[t][DEFAULT_STRATEGY]["frag_failures"], ff),
            "first_fit_with_compaction_over_first_fit": _ratio(shipped[t]["first-fit"]["frag_failures"], ff),
            "default_threshold_over_first_fit": _ratio(threshold[t]["frag_failures"], ff),
            "default_on_demand_only_over_first_fit": _ratio(on_demand[t][DEFAULT_STRATEGY]["frag_failures"], ff),
            "default_hinted": hinted[t]["frag_failures"],
            "default_hinted_over_first_fit": _ratio(hinted[t]["frag_failures"], ff),
            "default_kind_hinted": kind_hinted[t]["frag_failures"],
            "default_kind_hinted_over_first_fit": _ratio(kind_hinted[t]["frag_failures"], ff),
            "default_frag_mean_shipped": round(default["frag_mean"], 3),
            "default_frag_mean_hinted": round(hinted[t]["frag_mean"], 3),
            "default_frag_mean_kind_hinted": round(kind_hinted[t]["frag_mean"], 3),
            "default_frag_pinned_floor_shipped": round(default["frag_pinned_floor"], 3),
            "best_shipped": min(shipped[t], key=lambda n: shipped[t][n]["frag_failures"]),
            "best_frag_mean_shipped": min(shipped[t], key=lambda n: shipped[t][n]["frag_mean"]),
            "best_placement_only": min(placement[t], key=lambda n: placement[t][n]["frag_failures"]),
        }
    return out


def _ratio(failures: int, first_fit: int) -> float | None:
    """`failures` over first-fit's, to 3 places; None when first-fit had none: the ratio is
    undefined then (it read as `failures` itself, and 0 of 0 as 0.0, a target met)."""
    return round(failures / first_fit, 3) if first_fit else None


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
