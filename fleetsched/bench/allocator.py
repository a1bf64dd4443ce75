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
strategy. A session that does not fit waits in FIFO order and is retried on every release (like
the scheduler), so a request refused several times counts once. Figures per strategy:

``frag_mean`` / ``frag_p95``  the seeds' fragmentation rate, sampled at every arrival;
``frag_failures``             requests refused while their device(s) had enough free bytes;
``peak_util``                 the most bytes held at once, over capacity (rounding included);
``wait_mean``                 mean wait of a session for its memory, in units of trace time;
``op_us_p50`` / ``op_us_p99`` wall time of reserve/release calls, microseconds.

Separately: op timing with 10,000 live reservations of 1-5 pages under churn, and the gain of a
compaction plan on a fragmented snapshot (half the sessions movable).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import WouldBlock
from ..resources import DEFAULT_STRATEGY, STRATEGIES, DeviceSpec, ExtentPool, session_bytes

GB = 10**9
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16: 128 KiB
LOAD = 0.7
#: Share of sessions idle (in a tool call, between chat turns) at a compaction: movable.
MOVABLE = 0.5


@dataclass(frozen=True, slots=True)
class Session:
    arrival: float
    nbytes: int
    lifetime: float
    device: str | None = None
    movable: bool = False


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    devices: tuple[DeviceSpec, ...]
    sessions: tuple[Session, ...]


def _tokens_bytes(tokens: int) -> int:
    return session_bytes(tokens, bytes_per_token=BYTES_PER_TOKEN)


def _pareto(rng: random.Random, mean: float, alpha: float = 1.5, cap: float = 50.0) -> float:
    scale = mean * (alpha - 1) / alpha
    return min(scale * rng.paretovariate(alpha), cap * mean)


def _chat(rng: random.Random) -> tuple[int, float]:
    return _tokens_bytes(rng.randint(2_000, 16_000)), rng.expovariate(1.0)


def _tool(rng: random.Random) -> tuple[int, float]:
    return _tokens_bytes(int(math.exp(rng.uniform(math.log(16_000), math.log(128_000))))), _pareto(rng, 8.0)


def _batch(rng: random.Random) -> tuple[int, float]:
    return _tokens_bytes(rng.randint(32_000, 160_000)), rng.uniform(10.0, 30.0)


def _mixed(rng: random.Random) -> tuple[int, float]:
    u = rng.random()
    nbytes, _ = (_chat if u < 0.70 else _tool if u < 0.95 else _batch)(rng)
    return nbytes, _pareto(rng, 3.0 if u < 0.70 else 8.0)


def _seeds(rng: random.Random) -> tuple[int, float]:
    gb = rng.choices([4, 8, 12, 16, 20, 25, 32], weights=[2, 2, 2, 2, 4, 4, 1])[0]
    return gb * GB + rng.randint(0, 512) * 2**20, rng.expovariate(1 / 4.0)


def _generate(
    name: str, devices: tuple[DeviceSpec, ...], draw: Callable[[random.Random], tuple[int, float]], count: int, seed: int,
    *, bursty: bool = False, affinity: float = 0.0, load: float = LOAD,
) -> Trace:
    rng = random.Random(f"{seed}:{name}")
    capacity = sum(d.capacity for d in devices)
    drawn = [draw(rng) for _ in range(count)]
    mean_area = statistics.fmean(n * life for n, life in drawn)
    rate = load * capacity / mean_area  # Little's law: the offered load is LOAD of capacity
    clock = 0.0
    sessions = []
    for i, (nbytes, life) in enumerate(drawn):
        if bursty:
            if i % 8 == 0:
                clock += rng.expovariate(rate / 8)
        else:
            clock += rng.expovariate(rate)
        device = rng.choice(devices).name if rng.random() < affinity else None
        sessions.append(Session(clock, nbytes, life, device, rng.random() < MOVABLE))
    return Trace(name, devices, tuple(sessions))


def traces(count: int, seed: int, load: float = LOAD) -> list[Trace]:
    gpu = (DeviceSpec("gpu0", 80 * GB),)
    mixed_gpus = (DeviceSpec("gpu0", 80 * GB), DeviceSpec("gpu1", 80 * GB), DeviceSpec("gpu2", 40 * GB), DeviceSpec("gpu3", 40 * GB))
    return [
        _generate("chat", (DeviceSpec("gpu0", 24 * GB),), _chat, count, seed, load=load),
        _generate("tool-agents", gpu, _tool, count, seed, load=load),
        _generate("batch", gpu, _batch, count, seed, bursty=True, load=load),
        _generate("mixed", gpu, _mixed, count, seed, load=load),
        _generate("seeds-80g", gpu, _seeds, count, seed, load=load),
        _generate("multi-gpu", mixed_gpus, _mixed, count, seed, affinity=1 / 3, load=load),
    ]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay(trace: Trace, strategy: str, *, compact: bool = False) -> dict[str, float]:
    """Run `trace` through an `ExtentPool` with `strategy`; return its figures.

    With `compact`, act as a scheduler that compacts: when the head of the queue is refused
    although enough bytes are free and a device's fragmentation rate exceeds 0.3 (the seeds'
    threshold), plan a compaction over the movable sessions, apply it, and retry once.
    """
    pool = ExtentPool(trace.devices, strategy=strategy)
    moved = compactions = 0
    capacity = sum(d.total for d in pool.statistics().devices)
    departures: list[tuple[float, int, object]] = []
    pending: deque[tuple[int, Session]] = deque()
    frag: list[float] = []
    ops: list[float] = []
    waits: list[float] = []
    peak = 0

    def admit(i: int, s: Session, now: float, retry: bool = True) -> bool:
        nonlocal peak, moved, compactions
        start = time.perf_counter()  # wall-clock ok
        try:
            r = pool.reserve_nowait(s.nbytes, owner=i, device=s.device)
        except WouldBlock:
            ops.append(time.perf_counter() - start)  # wall-clock ok
            if compact and retry and pool.statistics().free >= s.nbytes:
                plan = pool.plan_compaction(threshold=0.3)
                if plan:
                    result = pool.apply_plan(plan)
                    moved += result.moved_bytes
                    compactions += 1
                    return admit(i, s, now, retry=False)
            return False
        ops.append(time.perf_counter() - start)  # wall-clock ok
        r.movable = s.movable
        heapq.heappush(departures, (now + s.lifetime, i, r))
        waits.append(now - s.arrival)
        peak = max(peak, pool.statistics().allocated)
        return True

    def depart_until(limit: float) -> None:
        while departures and departures[0][0] <= limit:
            now, _, r = heapq.heappop(departures)
            start = time.perf_counter()  # wall-clock ok
            r.release()  # type: ignore[attr-defined]
            ops.append(time.perf_counter() - start)  # wall-clock ok
            while pending and admit(*pending[0], now):
                pending.popleft()

    for i, s in enumerate(trace.sessions):
        depart_until(s.arrival)
        devices = pool.statistics().devices
        frag.append(statistics.fmean(d.fragmentation for d in devices))
        if pending or not admit(i, s, s.arrival):
            pending.append((i, s))
    depart_until(math.inf)
    return {
        "frag_mean": statistics.fmean(frag),
        "frag_p95": _pct(frag, 0.95),
        "frag_failures": pool.fragmentation_failures,
        "peak_util": peak / capacity,
        "wait_mean": statistics.fmean(waits),
        "op_us_p50": _pct(ops, 0.50) * 1e6,
        "op_us_p99": _pct(ops, 0.99) * 1e6,
        "compactions": compactions,
        "moved_gb": moved / GB,
    }


def live_timing(strategy: str, live: int = 10_000, churn: int = 20_000, seed: int = 0) -> dict[str, float]:
    """Op wall time with `live` reservations of 1-5 pages held on one 80 GB device, under churn."""
    rng = random.Random(seed)
    pool = ExtentPool([DeviceSpec("gpu0", 80 * GB)], strategy=strategy)
    page = pool.page_size
    held = []
    try:  # size-class rounds a page up to 5 % of the device: it holds far fewer
        while len(held) < live:
            held.append(pool.reserve_nowait(rng.randint(1, 5) * page - rng.randint(0, page - 1)))
    except WouldBlock:
        pass
    ops: list[float] = []
    for _ in range(churn):
        victim = held.pop(rng.randrange(len(held)))
        start = time.perf_counter()  # wall-clock ok
        victim.release()
        ops.append(time.perf_counter() - start)  # wall-clock ok
        nbytes = rng.randint(1, 5) * page - rng.randint(0, page - 1)
        start = time.perf_counter()  # wall-clock ok
        try:
            held.append(pool.reserve_nowait(nbytes))
        except WouldBlock:
            pass
        ops.append(time.perf_counter() - start)  # wall-clock ok
    return {"live": len(held), "op_us_p50": _pct(ops, 0.5) * 1e6, "op_us_p99": _pct(ops, 0.99) * 1e6}


def defrag_gain(seed: int = 0) -> dict[str, float]:
    """Fragment an 80 GB device with mixed sessions (half movable), then plan and apply a compaction."""
    rng = random.Random(f"{seed}:defrag")
    pool = ExtentPool([DeviceSpec("gpu0", 80 * GB)], strategy=DEFAULT_STRATEGY)
    held = []
    while True:  # fill, then free a random 40 %
        nbytes, _ = _mixed(rng)
        try:
            held.append(pool.reserve_nowait(nbytes))
        except WouldBlock:
            break
    rng.shuffle(held)
    for r in held[: len(held) * 2 // 5]:
        r.release()
    for r in held[len(held) * 2 // 5 :]:
        r.movable = rng.random() < 0.5
    before = pool.statistics()
    start = time.perf_counter()  # wall-clock ok
    plan = pool.plan_compaction(threshold=0.0)
    plan_ms = (time.perf_counter() - start) * 1e3  # wall-clock ok
    result = pool.apply_plan(plan)
    after = pool.statistics()
    return {
        "largest_free_gb_before": before.largest_free / GB,
        "largest_free_gb_after": after.largest_free / GB,
        "frag_before": before.fragmentation,
        "frag_after": after.fragmentation,
        "moves": result.applied,
        "moved_gb": result.moved_bytes / GB,
        "plan_ms": plan_ms,
    }


def _aggregate(per_trace: dict[str, dict[str, dict[str, float]]], strategy: str) -> dict[str, float]:
    rows = [per_trace[t][strategy] for t in per_trace]
    return {
        "frag_mean": statistics.fmean(r["frag_mean"] for r in rows),
        "frag_p95": max(r["frag_p95"] for r in rows),
        "frag_failures": sum(int(r["frag_failures"]) for r in rows),
        "peak_util": statistics.fmean(r["peak_util"] for r in rows),
        "wait_mean": statistics.fmean(r["wait_mean"] for r in rows),
        "op_us_p50": statistics.median(r["op_us_p50"] for r in rows),
        "op_us_p99": max(r["op_us_p99"] for r in rows),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench allocator", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--sessions", type=int, default=4000, help="sessions per trace (default 4000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=LOAD, help=f"offered load, fraction of capacity (default {LOAD})")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated names")
    args = parser.parse_args(argv)
    names = [n for n in args.strategies.split(",") if n]
    generated = traces(args.sessions, args.seed, args.load)
    per_trace = {t.name: {n: replay(t, n) for n in names} for t in generated}
    compacting = {t.name: replay(t, DEFAULT_STRATEGY, compact=True) for t in generated}
    result = {
        "default": DEFAULT_STRATEGY,
        "load": args.load,
        "sessions_per_trace": args.sessions,
        "seed": args.seed,
        "strategies": {n: _aggregate(per_trace, n) for n in names},
        "traces": per_trace,
        "live_10k": {n: live_timing(n, seed=args.seed) for n in names},
        "defrag": {
            "snapshot": defrag_gain(args.seed),
            "replay": {
                "strategy": DEFAULT_STRATEGY,
                "frag_failures": sum(int(r["frag_failures"]) for r in compacting.values()),
                "frag_failures_without": sum(int(per_trace[t].get(DEFAULT_STRATEGY, r)["frag_failures"]) for t, r in compacting.items()),
                "frag_mean": statistics.fmean(r["frag_mean"] for r in compacting.values()),
                "wait_mean": statistics.fmean(r["wait_mean"] for r in compacting.values()),
                "compactions": sum(int(r["compactions"]) for r in compacting.values()),
                "moved_gb": sum(r["moved_gb"] for r in compacting.values()),
            },
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    columns = ["frag_mean", "frag_p95", "frag_failures", "peak_util", "wait_mean", "op_us_p50", "op_us_p99"]
    for title, table in [("all traces", result["strategies"])] + [(t, per_trace[t]) for t in per_trace]:
        print(f"\n== {title} ==")
        print(f"{'strategy':<12}" + "".join(f"{c:>15}" for c in columns))
        for n, row in table.items():
            print(f"{n:<12}" + "".join(f"{row[c]:>15.3f}" if isinstance(row[c], float) else f"{row[c]:>15}" for c in columns))
    print("\n== 10,000 live reservations, churn ==")
    for n, row in result["live_10k"].items():
        print(f"{n:<12} live={row['live']:>6}  op p50={row['op_us_p50']:.1f} us  p99={row['op_us_p99']:.1f} us")
    d = result["defrag"]["snapshot"]
    print(
        f"\n== compaction on a fragmented 80 GB device ==\nlargest free {d['largest_free_gb_before']:.1f} -> "
        f"{d['largest_free_gb_after']:.1f} GB, fragmentation {d['frag_before']:.2f} -> {d['frag_after']:.2f}, "
        f"{d['moves']} moves ({d['moved_gb']:.1f} GB), planned in {d['plan_ms']:.1f} ms"
    )
    c = result["defrag"]["replay"]
    print(
        f"{c['strategy']} compacting on fragmentation refusals (half the sessions movable): frag failures "
        f"{c['frag_failures_without']} -> {c['frag_failures']}, frag mean {c['frag_mean']:.3f}, wait mean "
        f"{c['wait_mean']:.2f}, {c['compactions']} compactions moving {c['moved_gb']:.0f} GB"
    )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
