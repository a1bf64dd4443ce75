"""``fleetsched bench mixed-pace``: chatty agents, long-tool agents and batch summarisers together.

The same workload, concurrency and memory budget in two modes:

- ``baseline``: what the seeds do: a semaphore of N sessions and a fixed memory quota held for
  the whole session, tool time included (one tenant, so admission is FIFO; ``tool_policy =
  "keep"``).
- ``fleetsched``: tenants in tiers (chat critical, tool agents standard, batch batch) and the
  keep-or-release policy, which lends the slot and memory of a session in a long tool to waiting
  sessions.
- ``fleetsched-keep``: the tiers without keep-or-release, to show what each part contributes.

It runs on the sim backend in virtual time (`run_virtual`'s asyncio loop): `--hours` of traffic
take seconds, with the same figures for the same arguments. Sessions per hour measures a mode's
capacity only where sessions arrive faster than it serves them: still queued at the end. The
baseline is so at the defaults; the fleetsched mode, whose sessions in long tools hold neither a
slot nor memory, often is not: it served what arrived (``arrival_limited``, 0 queued at the
end), and the ratio of sessions per hour is then a lower bound that grows with
``--arrival-rate`` (1.28x at 1.5 a second to 9.13x at 12 in 0.1 h) rather than a measure of
capacity. Job times are those of the sessions done within the run: a queue that grows for the
whole run (the baseline's) gives a p95 that grows with ``--hours``.

``--backend vllm-server`` runs it on a real vLLM in real time instead (shorter: `--seconds` per
mode, tool times scaled by `--time-scale`), and reports the engine's prefix-cache hit rate per
mode from its ``/metrics`` counters.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio

from . import json_text
from .._args import applies_only, http_url, positive_float, positive_int
from ..agents.workload import run_workload
from ..scheduler import Scheduler, percentile
from ..settings import Settings
from ..virtual_time import run_virtual

KINDS = ("chatty", "long-tool", "summariser")


MODES = ("baseline", "fleetsched", "fleetsched-keep")

# Sessions a mode may be given (the defaults give 6,483): each is built into the settings up
# front, so a count far beyond what any run serves only exhausts memory.
MAX_SESSIONS = 1_000_000


def mixed_pace_settings(
    mode: str,
    *,
    sessions: int,
    arrival_rate: float,
    max_sessions: int,
    backend: dict[str, Any] | None = None,
    time_scale: float = 1.0,
    prompt_scale: float = 1.0,
) -> Settings:
    """The benchmark's workload: a third of each kind; one tenant per kind except in baseline."""
    per_kind = sessions // 3
    t = time_scale

    def p(tokens: int) -> int:
        return max(16, int(tokens * prompt_scale))

    tenant = {kind: ("fleet" if mode == "baseline" else name) for kind, name in
              (("chatty", "chat"), ("long-tool", "agents"), ("summariser", "batch"))}
    return Settings(
        backend=backend or {"kind": "sim", "max_in_flight": 128, "sim": {"stream_interval": 8}},
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
                {"tenant": tenant["chatty"], "kind": "chatty", "count": per_kind, "session_memory": "1GB", "turns": 6, "prompt_tokens": p(300),
                 "max_tokens": 48, "tool_s": 0.2 * t, "tool_s_max": 1.0 * t, "tool_dist": "uniform",
                 "tool_name": "calculator", "think_s": 0.5 * t},
                {"tenant": tenant["long-tool"], "kind": "long-tool", "count": per_kind, "session_memory": "2GB", "turns": 4, "prompt_tokens": p(1200),
                 "max_tokens": 96, "tool_s": 5 * t, "tool_s_max": 60 * t, "tool_dist": "uniform", "tool_name": "code-run"},
                {"tenant": tenant["summariser"], "kind": "summariser", "count": per_kind, "session_memory": "2GB", "turns": 1, "prompt_tokens": p(3000),
                 "max_tokens": 256},
            ],
        },
    )


async def run_mode(settings: Settings, hours: float) -> dict[str, Any]:
    duration = hours * 3600
    async with Scheduler(settings) as scheduler:
        start = anyio.current_time()
        with anyio.move_on_after(duration):
            await run_workload(scheduler, settings.workload)
        end = anyio.current_time()
        queued = sum(scheduler.statistics().queued.values())
        engine = scheduler.backend.statistics()  # type: ignore[attr-defined]
    return figures(scheduler, start, end, hours, engine.busy_fraction, queued) | {"generated_tokens": engine.generated_tokens}


async def run_mode_real(settings: Settings, seconds: float) -> dict[str, Any]:
    """One mode against a real vLLM: busy fraction sampled from its running count, and the
    prefix-cache hit rate from its counters over the mode's run."""
    async with Scheduler(settings) as scheduler:
        backend = scheduler.backend
        before = await backend.signals()
        busy = samples = 0

        async def sample() -> None:
            nonlocal busy, samples
            while True:
                await anyio.sleep(0.5)
                signals = await backend.signals()
                samples += 1
                busy += bool(signals.running)

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            with anyio.move_on_after(seconds):
                await run_workload(scheduler, settings.workload)
            tg.cancel_scope.cancel()
        end = anyio.current_time()
        queued = sum(scheduler.statistics().queued.values())
        after = await backend.signals()
    queries = (after.prefix_cache_queries_total or 0) - (before.prefix_cache_queries_total or 0)
    hits = (after.prefix_cache_hits_total or 0) - (before.prefix_cache_hits_total or 0)
    result = figures(scheduler, start, end, seconds / 3600, busy / samples if samples else 0.0, queued)
    result["prefix_cache_hit_rate"] = round(hits / queries, 3) if queries else None
    return result


def figures(scheduler: Scheduler, start: float, end: float, hours: float, busy_fraction: float, queued: int) -> dict[str, Any]:
    """A mode's figures; `queued`: the sessions waiting for admission (or to come back from a
    tool) at the end, one reading. None: the mode served what arrived by then, and its sessions
    per hour is the arrivals', not its capacity."""
    done = [s for s in scheduler.recorder.sessions if s.state == "done" and start <= s.finished <= end]
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
        "queued_at_end": queued,
        "arrival_limited": queued == 0,
        "jct_s": jct,
        "engine_busy_frac": round(busy_fraction, 3),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench mixed-pace", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sim", "vllm-server"], default="sim", help="sim (virtual time) or a real vLLM")
    parser.add_argument("--url", type=http_url, help="vllm-server: a running server (default: start one)")
    parser.add_argument("--seconds", type=positive_float, help="vllm-server: real seconds per mode (90)")
    parser.add_argument("--time-scale", type=positive_float, help="vllm-server: tool and think times scaled by this (0.1)")
    parser.add_argument("--hours", type=positive_float, help="sim: simulated hours per mode (0.5)")
    parser.add_argument("--max-sessions", type=positive_int, default=48, help="concurrent sessions (the same in both modes)")
    parser.add_argument("--arrival-rate", type=positive_float, default=3.0, help="sessions submitted per second")
    parser.add_argument("--engine-nice", type=int,
                        help="vllm-server: niceness of the engine processes of the server it starts (19; see VLLMServer.engine_nice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.url and args.backend != "vllm-server":
        parser.error("--url needs --backend vllm-server (the sim backend runs on virtual time, with no server)")
    real = args.backend == "vllm-server"
    applies_only(parser, args, {"seconds": 90.0, "time_scale": 0.1}, real, "with --backend vllm-server")
    applies_only(parser, args, {"engine_nice": 19}, real and args.url is None, "with --backend vllm-server, to the server it starts (not with --url)")
    applies_only(parser, args, {"hours": 0.5}, not real, "with --backend sim (a real vLLM runs for --seconds)")
    # Sessions submitted per mode: more than the modes can serve in the time (see the docstring).
    span_s, span_flag = (args.seconds, "--seconds") if args.backend == "vllm-server" else (args.hours * 3600, "--hours")
    wanted = args.arrival_rate * span_s * 1.2  # inf for huge values: int() of it would raise OverflowError
    if wanted > MAX_SESSIONS:
        parser.error(f"--arrival-rate x {span_flag} asks for {wanted:.3g} sessions per mode; at most {MAX_SESSIONS:,}")
    args.sessions = int(wanted) + 3
    result: dict[str, Any] = {"backend": args.backend, "max_sessions": args.max_sessions, "modes": {}}
    if args.backend == "vllm-server":
        real_modes(args, result)
    else:
        result["hours"] = args.hours
        for mode in MODES:
            settings = mixed_pace_settings(mode, sessions=args.sessions, arrival_rate=args.arrival_rate, max_sessions=args.max_sessions)
            start = time.perf_counter()  # wall-clock ok
            # The asyncio loop of `run_virtual` runs the tasks ready at one instant in the order
            # they became ready; trio's runs them in a random order, and the scripted agents draw
            # their tool times from one seeded RNG in the order they run: on trio's MockClock the
            # same seed gave other figures from one run to the next (3,550 or 3,600 sessions/h).
            measured = run_virtual(run_mode, settings, args.hours)
            measured["wall_s"] = round(time.perf_counter() - start, 1)  # wall-clock ok
            result["modes"][mode] = measured
    base, ours = result["modes"]["baseline"], result["modes"]["fleetsched"]
    result["sessions_per_hour_ratio"] = round(ours["sessions_per_hour"] / base["sessions_per_hour"], 2) if base["sessions_per_hour"] else None
    # Served all that arrived while the baseline queued: more capacity than measured.
    result["ratio_is_lower_bound"] = ours["arrival_limited"] and not base["arrival_limited"]
    result["chatty_p95_jct_ratio"] = (
        round(ours["jct_s"]["chatty"]["p95"] / base["jct_s"]["chatty"]["p95"], 2)
        if base["jct_s"]["chatty"]["p95"] and ours["jct_s"]["chatty"]["p95"]
        else None
    )
    if args.json:
        print(json_text(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    span = f"{args.hours} h simulated" if args.backend == "sim" else f"{args.seconds:g} s on a real vLLM"
    table = Table(title=f"fleetsched bench mixed-pace: {span}, {args.max_sessions} concurrent sessions")
    for column in ("mode", "sessions/h", "queued at end", "engine busy", *(f"{k} JCT p50/p95 s" for k in KINDS), "prefix hits", "wall s"):
        table.add_column(column, justify="right")
    for mode, f in result["modes"].items():
        table.add_row(
            mode,
            f"{f['sessions_per_hour']:,}",
            f"{f['queued_at_end']:,}",
            f"{f['engine_busy_frac']:.0%}",
            *(f"{f['jct_s'][k]['p50']} / {f['jct_s'][k]['p95']}" for k in KINDS),
            str(f.get("prefix_cache_hit_rate", "-")),
            str(f.get("wall_s", "-")),
        )
    Console().print(table)
    bound = " (at least: fleetsched served every session that arrived, none queued at the end)" if result["ratio_is_lower_bound"] else ""
    print(f"sessions per hour, fleetsched / baseline: {result['sessions_per_hour_ratio']}x{bound}; "
          f"chatty p95 JCT ratio: {result['chatty_p95_jct_ratio']}")
    return 0


def real_modes(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Each mode for `args.seconds` against one real vLLM server (started here unless --url)."""
    import contextlib

    from ..testing.vllm_server import VLLMServer

    result.update(seconds=args.seconds, time_scale=args.time_scale, prompt_scale=0.25, engine_nice=args.engine_nice)
    sessions = args.sessions
    with contextlib.ExitStack() as stack:
        server = VLLMServer(scheduling_policy="priority", max_num_seqs=32, max_model_len=4096, engine_nice=args.engine_nice)
        url = args.url or stack.enter_context(server).url
        backend = {"kind": "vllm-server", "urls": [url], "max_in_flight": 32}
        for mode in ("baseline", "fleetsched"):
            settings = mixed_pace_settings(
                mode, sessions=sessions, arrival_rate=args.arrival_rate, max_sessions=args.max_sessions,
                backend=backend, time_scale=args.time_scale, prompt_scale=0.25,  # the tiny model's context
            )
            result["modes"][mode] = anyio.run(run_mode_real, settings, args.seconds)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
