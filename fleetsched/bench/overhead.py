"""``fleetsched bench overhead``: what fleetsched itself costs, against an instant backend.

Three phases, one process:

1. *memory*: N concurrent sessions (default 10,000) admitted and alive at once, each making a
   few calls with think time between; peak RSS of the process is reported.
2. *latency*: 1,000 concurrent sessions making calls back to back; per call, the time spent in
   fleetsched beyond the backend (the backend's own time is measured by a wrapper and
   subtracted). The same agents calling the backend directly give the baseline.
3. *throughput*: calls dispatched per second of wall time during phase 2.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from collections.abc import AsyncIterator

import anyio

from . import json_text
from .._args import positive_int
from ..backends.base import Backend, ChatBody, Chunk
from ..backends.instant import InstantBackend
from ..scheduler import Scheduler, percentile
from ..scheduler.records import Recorder
from ..settings import Settings

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class TimedBackend(Backend):
    """Wraps a backend and adds up the wall time spent inside it, per call."""

    name = "timed"

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.last_s = 0.0

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        spent = 0.0
        upstream = self.inner.stream_chat(body)
        while True:
            start = time.perf_counter()  # wall-clock ok
            try:
                chunk = await upstream.__anext__()
            except StopAsyncIteration:
                spent += time.perf_counter() - start  # wall-clock ok
                break
            spent += time.perf_counter() - start  # wall-clock ok
            self.last_s = spent
            yield chunk
        self.last_s = spent


def _settings(sessions: int) -> Settings:
    return Settings(
        backend={"kind": "instant", "max_in_flight": sessions},
        scheduler={"max_sessions": sessions, "session_memory": 1024},
        tenants={"t0": {"weight": 1}, "t1": {"weight": 2}, "t2": {"tier": "critical"}},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "1TB"}]},
    )


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _memory_phase(sessions: int, calls: int) -> dict[str, float]:
    alive = 0
    peak = 0

    async def agent(ctx) -> None:
        nonlocal alive, peak
        alive += 1
        peak = max(peak, alive)
        for _ in range(calls):
            await ctx.chat(MESSAGES, max_tokens=16)
            await anyio.sleep(0.5)
        alive -= 1

    start = time.perf_counter()  # wall-clock ok
    async with Scheduler(_settings(sessions), backend=InstantBackend(), recorder=Recorder(keep_calls=False)) as s:
        for i in range(sessions):
            await s.submit(agent, tenant=f"t{i % 3}")
    return {"sessions": peak, "rss_mb": _rss_mb(), "wall_s": time.perf_counter() - start}  # wall-clock ok


async def _latency_phase(sessions: int, calls: int) -> dict[str, float]:
    backend = TimedBackend(InstantBackend())
    added: list[float] = []

    async def agent(ctx) -> None:
        for _ in range(calls):
            start = time.perf_counter()  # wall-clock ok
            await ctx.chat(MESSAGES, max_tokens=16)
            added.append(time.perf_counter() - start - backend.last_s)  # wall-clock ok
            await anyio.lowlevel.checkpoint()

    start = time.perf_counter()  # wall-clock ok
    async with Scheduler(_settings(sessions), backend=backend, recorder=Recorder(keep_calls=False)) as s:
        for i in range(sessions):
            await s.submit(agent, tenant=f"t{i % 3}")
    wall = time.perf_counter() - start  # wall-clock ok
    return {"calls": len(added), "wall_s": wall, "p50_ms": percentile(added, 50) * 1e3, "p99_ms": percentile(added, 99) * 1e3}


async def _direct_phase(sessions: int, calls: int) -> dict[str, float]:
    """The baseline: the same agents calling the backend straight, no scheduler."""
    backend = TimedBackend(InstantBackend())
    spent: list[float] = []

    async def agent() -> None:
        for _ in range(calls):
            start = time.perf_counter()  # wall-clock ok
            chunks = [c async for c in backend.stream_chat({"messages": MESSAGES, "max_tokens": 16})]
            assert chunks
            spent.append(time.perf_counter() - start - backend.last_s)  # wall-clock ok
            await anyio.lowlevel.checkpoint()

    start = time.perf_counter()  # wall-clock ok
    async with anyio.create_task_group() as tg:
        for _ in range(sessions):
            tg.start_soon(agent)
    wall = time.perf_counter() - start  # wall-clock ok
    return {"calls": len(spent), "wall_s": wall, "p50_ms": percentile(spent, 50) * 1e3, "p99_ms": percentile(spent, 99) * 1e3}


#: Concurrent sessions a phase may hold (ten times the default), and calls the latency phase may make.
MAX_SESSIONS = 100_000
MAX_CALLS = 10_000_000


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=positive_int, default=10_000, help="concurrent sessions in the memory phase")
    parser.add_argument("--latency-sessions", type=positive_int, default=1_000, help="concurrent sessions in the latency phase")
    parser.add_argument("--calls", type=positive_int, default=50, help="calls per session in the latency phase")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    # Each session is held in memory at once (tens of KB each): beyond these the run exhausts the
    # machine's memory or runs for hours instead of measuring anything.
    if args.sessions > MAX_SESSIONS or args.latency_sessions > MAX_SESSIONS:
        parser.error(f"--sessions and --latency-sessions: at most {MAX_SESSIONS:,} concurrent sessions")
    if args.latency_sessions * args.calls > MAX_CALLS:
        parser.error(f"--latency-sessions x --calls makes {args.latency_sessions * args.calls:,} calls; at most {MAX_CALLS:,}")

    gc.collect()
    memory = anyio.run(_memory_phase, args.sessions, 3)
    latency = anyio.run(_latency_phase, args.latency_sessions, args.calls)
    direct = anyio.run(_direct_phase, args.latency_sessions, args.calls)
    result = {
        "sessions": int(memory["sessions"]),
        "peak_rss_mb": round(memory["rss_mb"], 1),
        "calls": int(latency["calls"]),
        "calls_per_s": round(latency["calls"] / latency["wall_s"]),
        "latency_sessions": args.latency_sessions,
        "added_latency_ms": {"p50": round(latency["p50_ms"], 4), "p99": round(latency["p99_ms"], 4)},
        "direct_baseline": {
            "calls_per_s": round(direct["calls"] / direct["wall_s"]),
            "overhead_ms": {"p50": round(direct["p50_ms"], 4), "p99": round(direct["p99_ms"], 4)},
        },
        "targets": {"peak_rss_mb": 300, "added_latency_ms": {"p50": 0.1, "p99": 1.0}, "calls_per_s": 20_000},
        "python": sys.version.split()[0],
    }
    if args.json:
        print(json_text(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fleetsched bench overhead (instant backend)")
    table.add_column("figure")
    table.add_column("measured", justify="right")
    table.add_column("target", justify="right")
    table.add_row("peak concurrent sessions", f"{result['sessions']:,}", f"{args.sessions:,}")
    table.add_row("peak RSS", f"{result['peak_rss_mb']} MB", "<= 300 MB")
    table.add_row(f"added latency p50 ({args.latency_sessions:,} sessions)", f"{latency['p50_ms']:.4f} ms", "<= 0.1 ms")
    table.add_row(f"added latency p99 ({args.latency_sessions:,} sessions)", f"{latency['p99_ms']:.4f} ms", "<= 1 ms")
    table.add_row("calls dispatched per second", f"{result['calls_per_s']:,}", ">= 20,000")
    table.add_row("direct (no fleetsched) calls per second", f"{result['direct_baseline']['calls_per_s']:,}", "baseline")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
