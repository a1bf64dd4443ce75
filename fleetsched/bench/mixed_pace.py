"""``fleetsched bench mixed-pace``: chatty agents, long-tool agents and batch summarisers together.

The same workload, concurrency and memory budget in two modes:

- ``baseline``: what the seeds do: a semaphore of N sessions and a fixed memory quota held for
  the whole session, tool time included (one tenant, so admission is FIFO; ``tool_policy =
  "keep"``).
- ``fleetsched``: tenants in tiers (chat critical, tool agents standard, batch batch) and the
  keep-or-release policy, which lends the slot and memory of a session in a long tool to waiting
  sessions.
- ``fleetsched-keep``: the tiers without keep-or-release, to show what each part contributes.

It runs on the sim backend in virtual time (trio's MockClock): `--hours` of traffic take seconds.
Sessions arrive faster than either mode can serve, so sessions per hour measures capacity.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio
import trio.testing

from ..agents.workload import run_workload
from ..scheduler import Scheduler, percentile
from ..settings import Settings

KINDS = ("chatty", "long-tool", "summariser")


MODES = ("baseline", "fleetsched", "fleetsched-keep")


def mixed_pace_settings(mode: str, *, sessions: int, arrival_rate: float, max_sessions: int) -> Settings:
    """The benchmark's workload: a third of each kind; one tenant per kind except in baseline."""
    per_kind = sessions // 3
    tenant = {kind: ("fleet" if mode == "baseline" else name) for kind, name in
              (("chatty", "chat"), ("long-tool", "agents"), ("summariser", "batch"))}
    return Settings(
        backend={"kind": "sim", "max_in_flight": 128, "sim": {"stream_interval": 8}},
        scheduler={
            "max_sessions": max_sessions,
            "tool_policy": "adaptive" if mode == "fleetsched" else "keep",
            "drain_grace_s": 0,
            "aging_s": 60,
        },
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "80GB"}]},
        tenants={"fleet": {}} if mode == "baseline" else {
            "chat": {"tier": "critical"},
            "agents": {"tier": "standard"},
            "batch": {"tier": "batch"},
        },
        workload={
            "arrival_rate": arrival_rate,
            "seed": 11,
            "agents": [
                {"tenant": tenant["chatty"], "kind": "chatty", "count": per_kind, "session_memory": "1GB", "turns": 6, "prompt_tokens": 300,
                 "max_tokens": 48, "tool_s": 0.2, "tool_s_max": 1.0, "tool_dist": "uniform", "tool_name": "calculator",
                 "think_s": 0.5},
                {"tenant": tenant["long-tool"], "kind": "long-tool", "count": per_kind, "session_memory": "2GB", "turns": 4, "prompt_tokens": 1200,
                 "max_tokens": 96, "tool_s": 5, "tool_s_max": 60, "tool_dist": "uniform", "tool_name": "code-run"},
                {"tenant": tenant["summariser"], "kind": "summariser", "count": per_kind, "session_memory": "2GB", "turns": 1, "prompt_tokens": 3000,
                 "max_tokens": 256},
            ],
        },
    )


async def run_mode(settings: Settings, hours: float) -> dict[str, Any]:
    duration = hours * 3600
    async with Scheduler(settings) as scheduler:
        with anyio.move_on_after(duration):
            await run_workload(scheduler, settings.workload)
        end = anyio.current_time()
        engine = scheduler.backend.statistics()  # type: ignore[attr-defined]
    done = [s for s in scheduler.recorder.sessions if s.state == "done" and s.finished <= end]
    jct: dict[str, dict[str, float | None]] = {}
    for kind in KINDS:
        times = [s.finished - s.submitted for s in done if s.kind == kind]
        jct[kind] = {
            "p50": round(percentile(times, 50), 2) if times else None,
            "p95": round(percentile(times, 95), 2) if times else None,
            "done": len(times),
        }
    return {
        "sessions_per_hour": round(len(done) / hours, 1),
        "jct_s": jct,
        "engine_busy_frac": round(engine.busy_fraction, 3),
        "generated_tokens": engine.generated_tokens,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench mixed-pace", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sim"], default="sim", help="sim (virtual time); a real vLLM run is not built yet")
    parser.add_argument("--hours", type=float, default=0.5, help="simulated hours per mode")
    parser.add_argument("--max-sessions", type=int, default=48, help="concurrent sessions (the same in both modes)")
    parser.add_argument("--arrival-rate", type=float, default=3.0, help="sessions submitted per second")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sessions = int(args.arrival_rate * args.hours * 3600 * 1.2) + 3
    result: dict[str, Any] = {"backend": args.backend, "hours": args.hours, "max_sessions": args.max_sessions, "modes": {}}
    for mode in MODES:
        settings = mixed_pace_settings(mode, sessions=sessions, arrival_rate=args.arrival_rate, max_sessions=args.max_sessions)
        start = time.perf_counter()  # wall-clock ok
        clock = trio.testing.MockClock(autojump_threshold=0)
        figures = anyio.run(run_mode, settings, args.hours, backend="trio", backend_options={"clock": clock})
        figures["wall_s"] = round(time.perf_counter() - start, 1)  # wall-clock ok
        result["modes"][mode] = figures
    base, ours = result["modes"]["baseline"], result["modes"]["fleetsched"]
    result["sessions_per_hour_ratio"] = round(ours["sessions_per_hour"] / base["sessions_per_hour"], 2) if base["sessions_per_hour"] else None
    result["chatty_p95_jct_ratio"] = (
        round(ours["jct_s"]["chatty"]["p95"] / base["jct_s"]["chatty"]["p95"], 2)
        if base["jct_s"]["chatty"]["p95"] and ours["jct_s"]["chatty"]["p95"]
        else None
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fleetsched bench mixed-pace: {args.hours} h simulated, {args.max_sessions} concurrent sessions")
    for column in ("mode", "sessions/h", "engine busy", *(f"{k} JCT p50/p95 s" for k in KINDS), "wall s"):
        table.add_column(column, justify="right")
    for mode, f in result["modes"].items():
        table.add_row(
            mode,
            f"{f['sessions_per_hour']:,}",
            f"{f['engine_busy_frac']:.0%}",
            *(f"{f['jct_s'][k]['p50']} / {f['jct_s'][k]['p95']}" for k in KINDS),
            str(f["wall_s"]),
        )
    Console().print(table)
    print(f"sessions per hour, fleetsched / baseline: {result['sessions_per_hour_ratio']}x; "
          f"chatty p95 JCT ratio: {result['chatty_p95_jct_ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
