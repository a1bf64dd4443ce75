"""``fleetsched simulate CONFIG --duration 2h``: the real scheduler on the sim backend, in virtual time.

The same `Scheduler`, dispatcher and agents as ``fleetsched run``, on the `sim` backend in virtual
time (`fleetsched.virtual_time`): whenever every task waits, the clock jumps to the next deadline,
so hours of fleet traffic take seconds of wall time. ``--loop trio`` runs it under trio's
``MockClock(autojump_threshold=0)`` instead of the (faster) virtual-time asyncio loop; trio runs
the tasks ready at one instant in a random order, so two runs of one seed may differ a little
there (on the asyncio loop they give the same figures).

With ``--duration``, the workload is a fleet held for that long: each ``workload.agents`` entry keeps
``count`` sessions running at once (a session that ends is replaced by a new one of its kind, each
staggered over the first seconds); new sessions stop at the end and those running finish within
``scheduler.drain_grace_s``. Without it, the workload runs as ``fleetsched run`` runs it.

``--find-max-sessions`` answers "how many agents fit at these SLAs?": it scales the fleet (all
entries together, keeping the tier mix) and binary-searches the largest total that still meets
every tenant's SLA (`SlaSettings`: ttft_p99_s, latency_p95_s, deadline_s, min_tokens_per_s; and
no failed or refused calls), one virtual-time run per probe. Sessions that wait for admission count: their
wait is held to the tenant's TTFT and latency objectives (as the report holds it), so a fleet
larger than the scheduler's slots (or memory) admit does not fit. The search needs a tenant of
the workload with an objective.

Cost: one engine step per generated token wakes a stream only every ``stream_interval`` tokens;
simulate sets it to 8 (vLLM's own knob; the first token always comes at once) unless the config or
``--stream-interval`` says otherwise. A call that collects its whole answer (``ctx.chat``) is woken
only for its first token and at its end, whatever the interval.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import ValidationError

from ._args import applies_only, positive_int, writable_file
from .errors import ConfigError, FleetschedError
from .gc_tuning import SIMULATING, gc_thresholds
from .report import failed_sessions, nothing_done, print_or_drop, save_json, throughput_text
from .settings import AgentMix, Settings, SimSettings, first_error, load_settings
from .virtual_time import LOOPS, Loop, run_virtual

SIMULATE_STREAM_INTERVAL = 8
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


#: The longest `--duration` taken: a year of virtual time (the wall time grows with it).
MAX_DURATION_S = 365 * 86400.0


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1h30m"``; ValueError otherwise.

    Only a lone number goes without a unit: ``"1h30"`` (30 seconds? minutes?) is refused. Units
    go from the largest down, each once: ``"1m1m"`` and ``"30m1h"`` are refused too."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(min|[smhd]?)", text.strip().lower())
    unitless = len(parts) > 1 and any(not u for _, u in parts)
    scales = [_UNITS[u] for _, u in parts]
    descending = all(a > b for a, b in zip(scales, scales[1:]))
    if not parts or unitless or not descending or "".join(n + u for n, u in parts) != re.sub(r"\s+", "", text.strip().lower()):
        raise ValueError(f"--duration: not a duration: {text!r} (examples: 90s, 15m, 2h, 1h30m)")
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError(f"--duration must be more than 0 and at most 365 days of virtual time, got {text!r}")
    return seconds


def sim_settings(settings: Settings, profile: str | None = None, stream_interval: int | None = None) -> Settings:
    """`settings` with the sim backend, the profile and the stream interval of a simulation."""
    sim = settings.backend.sim.model_dump(exclude_unset=True)
    if profile is not None:
        # A profile replaces the section (fields in the config would not apply to it); its own
        # fields, a stream_interval among them, are set as if written in the section.
        sim = SimSettings(profile=profile).model_dump(exclude_unset=True)
    if stream_interval is not None:
        sim["stream_interval"] = stream_interval
    elif "stream_interval" not in sim:
        sim["stream_interval"] = SIMULATE_STREAM_INTERVAL
    backend = settings.backend.model_validate({**settings.backend.model_dump(exclude={"sim"}), "kind": "sim", "sim": sim})
    return settings.model_copy(update={"backend": backend})


def scale_fleet(agents: list[AgentMix], total: int) -> list[AgentMix]:
    """The agent mix with `total` sessions in all, in the same proportions (each kind at least 1)."""
    base = sum(m.count for m in agents)
    counts = [max(1, round(total * m.count / base)) for m in agents]
    return [m.model_copy(update={"count": c}) for m, c in zip(agents, counts)]


async def _fleet(scheduler: Any, agents: list[AgentMix], duration_s: float, seed: int) -> None:
    from .agents.workload import scripted_chat_agent

    rng = random.Random(seed)
    end = anyio.current_time() + duration_s
    ramp = min(30.0, duration_s / 10)

    async def member(index: int, mix: AgentMix, delay: float) -> None:
        kind = mix.kind or f"{mix.tenant}-{index}"
        memory = int(mix.session_memory) if mix.session_memory else None
        await anyio.sleep(delay)
        while anyio.current_time() < end:
            try:
                await scheduler.run(scripted_chat_agent(mix, rng), tenant=mix.tenant, memory=memory, kind=kind)
            except FleetschedError:
                await anyio.sleep(1.0)  # rejected or failed (recorded by the scheduler); do not spin

    # At the end, the sessions still running get `drain_grace_s` to finish; then they are
    # cancelled (as leaving the scheduler's block does), so a 600-s tool call cannot stretch the run.
    with anyio.move_on_after(duration_s + scheduler.settings.scheduler.drain_grace_s):
        async with anyio.create_task_group() as tg:
            for index, mix in enumerate(agents):
                for _ in range(mix.count):
                    tg.start_soon(member, index, mix, rng.uniform(0, ramp))


async def _simulate(settings: Settings, duration_s: float | None) -> tuple[dict[str, Any], Any]:
    from .agents.workload import run_workload
    from .observability.feasibility import check_feasibility
    from .observability.sla import SlaTracker
    from .observability.timeline import Timeline
    from .report import build_report
    from .scheduler import Scheduler

    async with Scheduler(settings) as scheduler:
        feasibility = await check_feasibility(settings, scheduler.backend, scheduler.model)
        start = anyio.current_time()
        timeline = Timeline(scheduler, SlaTracker(settings.tenants), interval_s=max(1.0, (duration_s or 0) / 500))
        async with anyio.create_task_group() as tg:
            tg.start_soon(timeline.run)
            if duration_s is None:
                await run_workload(scheduler, settings.workload)
            else:
                await _fleet(scheduler, settings.workload.agents, duration_s, settings.workload.seed)
            tg.cancel_scope.cancel()
        timeline.sample()
        elapsed = anyio.current_time() - start
    report = build_report(scheduler, duration_s=elapsed, backend="sim", start=start, timeline=timeline.as_dict(), feasibility=feasibility)
    stats = scheduler.backend.statistics()
    report["sim"] = {
        "profile": settings.backend.sim.profile,
        "stream_interval": settings.backend.sim.stream_interval,
        "engine_steps": stats.steps,
        "engine_busy_frac": round(stats.busy_fraction, 4),
        "preemptions": stats.preemptions,
        "enable_prefix_caching": settings.backend.sim.enable_prefix_caching,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "sessions_in_fleet": sum(m.count for m in settings.workload.agents),
    }
    return report, scheduler


def simulate(settings: Settings, duration_s: float | None = None, loop: Loop = "asyncio") -> tuple[dict[str, Any], Any]:
    """Run `settings` (already on the sim backend) in virtual time; (report, scheduler).

    `loop` is the event loop under the virtual clock (`run_virtual`): asyncio's is the faster.

    The report is `build_report`'s plus ``sim`` (engine figures) and ``wall_s``.
    """
    began = time.perf_counter()  # wall-clock ok
    with gc_thresholds(SIMULATING):
        result = run_virtual(_simulate, settings, duration_s, loop=loop)
    result[0]["wall_s"] = round(time.perf_counter() - began, 3)  # wall-clock ok
    return result


@dataclass(frozen=True, slots=True)
class SlaCheck:
    tenant: str
    metric: str
    target: float
    value: float

    @property
    def measured(self) -> str:
        """The value as shown: nan (no successful call, no session, no backlog) is "none measured"."""
        return "none measured" if math.isnan(self.value) else f"{self.value:.3g}"

    @property
    def ok(self) -> bool:
        return self.value <= self.target if self.metric != "min_tokens_per_s" else self.value >= self.target


def sla_checks(scheduler: Any, settings: Settings, duration_s: float) -> list[SlaCheck]:
    """Every tenant's SLA targets against what the run recorded (call errors and refused calls
    count against it).

    Sessions count as well as calls: a session's wait for admission (until it ended, for one
    never admitted) is held to the tenant's TTFT and latency objectives, since its first call
    can neither start nor end sooner; and every session that ended, whatever its end, to its
    deadline. Otherwise a fleet larger than the scheduler admits would meet every objective:
    its extra sessions only wait (a latency objective alone passed every size up to 65,536,
    with 984 of 1,024 sessions never admitted). `duration_s` (the run's length) is not used:
    min_tokens_per_s is over the backlogged time.
    """
    from .observability.sla import CANCELLED, admission_wait, busy_time
    # Nearest rank, not interpolation: a p99 at most the target exactly when 99 % of the values
    # are, as the report's verdict (an interpolated p99 passes with 98.7 % of 150 calls on time).
    from .scheduler.records import rank_percentile

    checks = []
    calls_by: dict[str, list[Any]] = {}
    for call in scheduler.recorder.calls:
        calls_by.setdefault(call.tenant, []).append(call)
    # Calls refused before the backend (shed, rate-limited) are kept apart from `calls`; each
    # fails its session and misses every call objective in the report, so a fleet with refused
    # calls does not fit (else a larger fleet, refused more, would look as good). Refused by
    # the tenant's own rate limits, counted apart (`RATE_LIMITED`): a busier engine slows its
    # calls under the limit, so these can stop as the fleet grows.
    refused: dict[tuple[str, str], int] = {}
    for call in scheduler.recorder.refusals:
        metric = RATE_LIMITED if call.error == "RateLimited" else "refused_calls"
        refused[call.tenant, metric] = refused.get((call.tenant, metric), 0) + 1
    sessions_by: dict[str, list[Any]] = {}
    rejected: dict[str, int] = {}
    for session in scheduler.recorder.sessions:
        if session.state == "rejected":  # refused at once (they could never run): no wait to count
            rejected[session.tenant] = rejected.get(session.tenant, 0) + 1
        else:
            sessions_by.setdefault(session.tenant, []).append(session)
    for name, tenant in settings.tenants.items():
        calls = calls_by.get(name, [])
        sessions = sessions_by.get(name, [])
        if name in rejected:  # a fleet whose sessions cannot run does not fit, whatever else it met
            checks.append(SlaCheck(name, "rejected_sessions", 0, rejected[name]))
        for metric in ("refused_calls", RATE_LIMITED):
            if (name, metric) in refused:
                checks.append(SlaCheck(name, metric, 0, refused[name, metric]))
        if not calls and not sessions:
            continue
        ok = [c for c in calls if c.error is None]
        # A call cancelled with its session (the run's end cuts the sessions still running) is no
        # event of the SLA, as in the report: not an error of the fleet.
        failed = sum(c.error is not None and c.error not in CANCELLED for c in calls)
        sla = tenant.sla
        checks.append(SlaCheck(name, "call_errors", 0, failed))
        waits = [admission_wait(s) for s in sessions]  # none rejected: each a float
        if sla.ttft_p99_s is not None:
            checks.append(SlaCheck(name, "ttft_p99_s", sla.ttft_p99_s, rank_percentile([c.ttft_s for c in ok], 99)))
            checks.append(SlaCheck(name, "admission_wait_p99_s", sla.ttft_p99_s, rank_percentile(waits, 99)))
        if sla.latency_p95_s is not None:
            checks.append(SlaCheck(name, "latency_p95_s", sla.latency_p95_s, rank_percentile([c.latency_s for c in ok], 95)))
            checks.append(SlaCheck(name, "admission_wait_p95_s", sla.latency_p95_s, rank_percentile(waits, 95)))
        if sla.deadline_s is not None:
            # A session ended at its deadline without finishing (DeadlineExceeded, queued or
            # running) spans the deadline exactly, which read as met: it missed it.
            spans = [
                s.finished - s.submitted if s.state == "done" or (s.finished - s.submitted < sla.deadline_s and not s.deadline_exceeded) else math.inf
                for s in sessions
            ]
            checks.append(SlaCheck(name, "deadline_s", sla.deadline_s, max(spans, default=math.nan)))
        if sla.min_tokens_per_s is not None:
            # Per second the tenant was backlogged (had a call outstanding), as `SlaSettings` and
            # the report define it: over the whole run, a tenant that thinks between calls would
            # miss it with few sessions and meet it with many. No backlog at all: nan, which fails.
            busy = busy_time((c.submitted, c.finished) for c in calls)
            # The tokens the report counts: a call cut with its session (the run's end cuts the
            # sessions still running) made its tokens in the time it adds to `busy`. Without
            # them the search read 821 tok/s for a fleet the report called met at 1,546.
            tokens = sum(c.completion_tokens for c in calls if c.error is None or c.error in CANCELLED)
            checks.append(SlaCheck(name, "min_tokens_per_s", sla.min_tokens_per_s, tokens / busy if busy > 0 else math.nan))
    # A NaN percentile (no successful call) fails its check: NaN <= target is False.
    return checks


#: The check of calls refused by their tenant's own rate limits (`sla_checks`).
RATE_LIMITED = "rate_limited_calls"


def find_max_sessions(
    settings: Settings, duration_s: float, echo: Any = print, limit: int = 1 << 16, loop: Loop = "asyncio", repeats: int = 1
) -> dict[str, Any]:
    """The largest fleet (total sessions, tier mix kept) whose run meets every tenant's SLA.

    Each fleet size is run `repeats` times, with the workload's seed and the next ones, and meets
    only if every run does: one run is one sample, and near the edge a size can pass or miss by
    chance (one seed answered 108 sessions where 95 to 104 missed in runs of a minute).

    The search grows the fleet, then bisects (to within 2 %) for the engine's edge, past which
    a fleet misses, taking a larger fleet to miss whatever a smaller one missed. A tenant's own
    rate limits break that: a busier engine slows its calls under them, so a fleet refused by
    them can be smaller than one that is not. So the edge is sought reading a fleet that missed
    nothing but those refusals as within it (taken for a miss, it answered 6 sessions where 48
    to 72 fit); the answer is the largest fleet within it that met every objective.

    The result: ``max_sessions`` (0: even the smallest fleet, one session of each kind, misses),
    ``bounded_by_limit``, ``probes`` ({sessions run: met}), ``agents`` (the fleet found),
    ``first_miss`` (sessions of the smallest fleet run past it that missed, None if none),
    ``rate_limited`` ({sessions run: what its tenants' rate limits refused} for fleets that
    missed nothing else), ``smallest_misses`` (what the smallest fleet missed, when it was run
    and missed), ``unreachable`` (the start-up check's messages: objectives an idle engine
    cannot meet), ``notes`` (its notes: an agent whose calls cannot fit, say) and ``repeats``.
    """
    agents = settings.workload.agents
    probes: dict[int, bool] = {}
    misses: dict[int, str] = {}  # by sessions run: what a fleet missed, its rate limits' refusals aside
    rate_limited: dict[int, str] = {}  # by sessions run: fleets that missed only those
    ran: dict[int, int] = {}  # the sessions run for each total tried
    unreachable: list[str] = []
    notes: list[str] = []

    def run(total: int) -> int:
        """Run the fleet of `total` (`repeats` seeds, up to the first that misses; each once:
        virtual time repeats it); the sessions it ran."""
        mix = scale_fleet(agents, total)
        ran[total] = sessions = sum(m.count for m in mix)  # each kind at least 1: may exceed `total`
        if sessions in probes:
            return sessions
        wall = 0.0
        for attempt in range(repeats):
            workload = settings.workload.model_copy(update={"agents": mix, "seed": settings.workload.seed + attempt})
            scaled = settings.model_copy(update={"workload": workload})
            report, scheduler = simulate(scaled, duration_s, loop)
            wall += report["wall_s"]
            if not probes and not attempt:
                unreachable.extend(u["message"] for u in report["sla"]["feasibility"]["unreachable"])
                if report["sla"]["feasibility"]["note"]:
                    notes.append(report["sla"]["feasibility"]["note"])
            failed = [c for c in sla_checks(scheduler, scaled, report["duration_s"]) if not c.ok]
            if failed:
                break
        probes[sessions] = not failed
        text = ", ".join(_miss_text(c) for c in failed)
        if repeats > 1 and failed:
            text += f" (seed {settings.workload.seed + attempt}, run {attempt + 1} of {repeats})"
        if failed and all(c.metric == RATE_LIMITED for c in failed):
            rate_limited[sessions] = text
            verdict = f"misses only its tenants' own rate limits: {text}"
        elif failed:
            misses[sessions] = text
            verdict = "misses " + text
        else:
            verdict = "meets every SLA" + (f" in {repeats} runs" if repeats > 1 else "")
        echo(f"  {sessions:6d} sessions: {throughput_text(report)}, {verdict} [{wall:.1f} s wall]")
        return sessions

    def meets(total: int) -> bool:
        return probes[run(total)]

    def fits(total: int) -> bool:
        """Within the engine's edge: missing nothing, or only its tenants' rate limits."""
        return run(total) not in misses

    def bisect(lo: int, hi: int, within: Callable[[int], bool]) -> int:
        while hi - lo > max(1, lo // 50):  # to within 2%
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if within(mid) else (lo, mid)
        return lo

    def result(found: int, bounded: bool) -> dict[str, Any]:
        size, smallest = _size(agents, found), _size(agents, 1)
        return {
            "max_sessions": size,
            "bounded_by_limit": bounded,
            "probes": probes,
            "agents": _mix(agents, found),
            "first_miss": min((n for n, ok in probes.items() if n > size and not ok), default=None),
            "rate_limited": rate_limited,
            "smallest_misses": (misses.get(smallest) or rate_limited.get(smallest)) if found == 0 else None,
            "unreachable": unreachable,
            "notes": notes,
            "repeats": repeats,
        }

    # From the config's fleet, but not past the limit: a config of millions would run them all
    # first. The engine's edge first: grown and bisected on `fits`.
    lo, hi = 0, min(max(1, sum(m.count for m in agents)), limit)
    bounded = False
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            bounded = True
            break
    edge = lo if bounded else bisect(lo, hi, fits)
    # Then the largest fleet within it that met every objective; below a fleet refused by its
    # rate limits, bisected again for it.
    found = max((total for total, sessions in ran.items() if total <= edge and probes[sessions]), default=0)
    limited = [total for total, sessions in ran.items() if found < total <= edge and sessions in rate_limited]
    if limited:
        found = bisect(found, min(limited), meets)
    return result(found, bounded=bounded and found == edge)


def _miss_text(check: SlaCheck) -> str:
    """What a fleet missed: the objective, measured against its target."""
    measured = "a session ended past it" if check.metric == "deadline_s" and check.value == math.inf else check.measured
    return f"{check.tenant}.{check.metric} ({measured} vs {check.target:.3g})"


def _note_rate_limits(settings: Settings, duration_s: float) -> None:
    """Say how much a probe hides of a rate limit: a bucket starts full, with a minute's worth,
    so a tenant going 18-26 % over its tokens_per_minute met it in 2-minute probes and missed it
    from the fifth minute on."""
    limited = sorted({m.tenant for m in settings.workload.agents if _has_rate_limit(settings, m.tenant)})
    if limited:
        minutes = duration_s / 60
        print(
            f"fleetsched simulate: note: {', '.join(limited)} set rate limits, whose buckets start with a minute's worth: "
            f"in a probe of {minutes:g} min, a tenant up to {100 / minutes:.0f} % over its limit is not refused",
            file=sys.stderr,
        )


def _has_rate_limit(settings: Settings, tenant: str) -> bool:
    limits = settings.tenants[tenant]
    return limits.tokens_per_minute is not None or limits.requests_per_minute is not None


#: The objectives a session's wait for admission counts against (`sla_checks`).
_TIME_OBJECTIVES = ("ttft_p99_s", "latency_p95_s", "deadline_s")


def _check_targets(settings: Settings, duration_s: float) -> None:
    """A capacity search needs an objective that a fleet too large misses: a time objective
    (ttft_p99_s, latency_p95_s, deadline_s), which its sessions' wait for admission counts
    against, no longer than a probe (nothing in a probe waits or lasts longer). Raise ConfigError
    when no tenant of the workload sets one: every fleet size would "meet" the objectives up to
    the search's limit (a min_tokens_per_s alone is met by the sessions a tenant runs, however
    many more wait; with only a 1,000 s latency_p95_s and 30 s probes, every size up to 65,536
    passed, with 984 of 1,024 sessions never admitted)."""
    tenants = sorted({m.tenant for m in settings.workload.agents})
    objectives = [
        (seconds, objective, name)
        for name in tenants
        if name in settings.tenants
        for objective in _TIME_OBJECTIVES
        if (seconds := getattr(settings.tenants[name].sla, objective)) is not None
    ]
    if not objectives:
        raise ConfigError(
            "tenants.<name>.sla",
            f"--find-max-sessions needs an objective that a fleet too large misses, and none of the workload's "
            f"tenants ({', '.join(tenants)}) sets one: give one an sla with ttft_p99_s, latency_p95_s or deadline_s "
            "(a min_tokens_per_s alone is met by the sessions a tenant runs, however many more wait)",
        )
    seconds, objective, name = min(objectives)
    if seconds > duration_s:
        raise ConfigError(
            "--duration",
            f"{duration_s:g} s is shorter than every objective a fleet too large would miss (the shortest: the "
            f"{objective} of tenant {name!r}, {seconds:g} s): a probe that short cannot see one missed; give "
            f"--duration {math.ceil(seconds)}s or more",
        )
    # The others a probe that short cannot see missed: the answer then rests on the shorter ones
    # alone (a 10 s probe answered 106 sessions, where 2-minute runs of 106 missed a 20 s wait).
    longer = [f"the {objective} of tenant {name!r} ({seconds:g} s)" for seconds, objective, name in sorted(objectives) if seconds > duration_s]
    if longer:
        print(
            f"fleetsched simulate: note: a probe of {duration_s:g} s cannot see {', '.join(longer)} missed: "
            f"give --duration {math.ceil(max(objectives)[0])}s or more to hold the fleet to {'them' if len(longer) > 1 else 'it'} too",
            file=sys.stderr,
        )


def _size(agents: list[AgentMix], total: int) -> int:
    """Sessions in the fleet `scale_fleet` makes of `total` (0 stays 0)."""
    return sum(_mix(agents, total).values())


def _mix(agents: list[AgentMix], total: int) -> dict[str, int]:
    """Sessions by kind in the fleet `scale_fleet` makes of `total` (entries of one kind added up)."""
    mix: dict[str, int] = {}
    for i, m in enumerate(scale_fleet(agents, total) if total else []):
        kind = m.kind or f"{m.tenant}-{i}"
        mix[kind] = mix.get(kind, 0) + m.count
    return mix


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched simulate", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="TOML settings file (tenants, workload; the backend becomes sim)")
    parser.add_argument("--duration", help="hold the fleet this long in virtual time (90s, 15m, 2h)")
    parser.add_argument("--profile", help="sim profile: a shipped name or a TOML file, in place of the config's [backend.sim] section (default: the config's)")
    parser.add_argument("--stream-interval", type=positive_int, help=f"tokens per streamed chunk (default {SIMULATE_STREAM_INTERVAL})")
    parser.add_argument("--find-max-sessions", action="store_true", help="search the largest fleet that meets every SLA")
    parser.add_argument(
        "--repeats", type=positive_int, help="with --find-max-sessions: runs of each size, one seed each, all to meet (default 1)"
    )
    parser.add_argument("--loop", choices=LOOPS, default="asyncio", help="event loop under the virtual clock (default asyncio)")
    parser.add_argument("--report", type=writable_file, metavar="FILE.json", help="write the report (or the search's result) as JSON")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    applies_only(parser, args, {"repeats": 1}, args.find_max_sessions, "with --find-max-sessions")
    try:
        duration = parse_duration(args.duration) if args.duration is not None else None
        settings = load_settings(args.config)
        if duration is None:  # the workload runs as `fleetsched run` runs it: check it as run does
            from .agents.workload import session_count

            if not session_count(settings.workload, settings):
                raise ConfigError("workload", "the config describes no sessions to run (agents or a trace)")
        elif not settings.workload.agents:
            raise ConfigError("workload.agents", "--duration holds a fleet of the config's agents, and it describes none")
        else:
            if settings.workload.trace:
                print("fleetsched simulate: note: workload.trace is replayed without --duration only; ignored", file=sys.stderr)
                # Ignored by the start-up check too: it noted the trace's sessions (every call of
                # theirs would fail, say), which the run never ran.
                settings = settings.model_copy(update={"workload": settings.workload.model_copy(update={"trace": None})})
            if settings.workload.arrival_rate:  # the fleet is held at its count from the start
                print(
                    "fleetsched simulate: note: workload.arrival_rate is used without --duration only; "
                    "--duration keeps each entry's count of sessions running from the start",
                    file=sys.stderr,
                )
        if args.profile is not None and settings.backend.sim.model_fields_set:
            # Said, not silent: a kv_cache_tokens in the config, say, does not apply to this run.
            print(
                "fleetsched simulate: note: --profile replaces the config's [backend.sim] section; "
                "its profile and fields are not used",
                file=sys.stderr,
            )
        try:
            settings = sim_settings(settings, args.profile, args.stream_interval)
        except ValidationError as exc:  # a bad --profile, or a field of [backend.sim]
            field, message = first_error(exc)
            if args.profile is not None:  # named by its file: "bogus" alone said not where it was
                field = f"--profile {args.profile}: {field.removeprefix('sim.') or 'sim'}"
                if message.startswith("sim profile "):  # a field of the file's own, which the message names
                    field, message = f"--profile {args.profile}", message.split(": ", 1)[1]
            raise ConfigError(field or "backend.sim", message) from None
        if args.find_max_sessions and duration is None:
            raise ConfigError("--duration", "--find-max-sessions needs --duration (each probe holds the fleet that long)")
        if args.find_max_sessions:
            _check_targets(settings, duration)
            _note_rate_limits(settings, duration)
    except (ConfigError, ValueError) as exc:
        print(f"fleetsched simulate: config error: {exc}", file=sys.stderr)
        return 2
    try:
        saved, nothing_worked = _simulate_and_print(settings, duration, args)
    except ConfigError as exc:  # found as the scheduler starts: a KV cache smaller than a session's budget
        print(f"fleetsched simulate: config error: {exc}", file=sys.stderr)
        return 2
    return 1 if nothing_worked or not saved else 0


def _save(text: str, args: argparse.Namespace) -> bool:
    """Write the JSON `text` to ``--report`` if asked; whether that went well. Before anything is
    printed: a reader of stdout that stops early (``| head``) cannot lose the file."""
    return not args.report or save_json(text + "\n", args.report, "fleetsched simulate")


def _simulate_and_print(settings: Settings, duration: float | None, args: argparse.Namespace) -> tuple[bool, bool]:
    """Run the simulation (or the capacity search) `args` ask for, save its ``--report``, print
    its tables (or its JSON), and return whether the report was saved (or none was asked for)
    and whether sessions failed with none done (a plain run's exit 1)."""
    if args.find_max_sessions:
        echo = (lambda _: None) if args.json else print_or_drop
        result = find_max_sessions(settings, duration, echo=echo, loop=args.loop, repeats=args.repeats)  # type: ignore[arg-type]
        for key in ("probes", "rate_limited"):
            result[key] = {str(k): v for k, v in sorted(result[key].items())}
        text = json.dumps(result, indent=2)
        saved = _save(text, args)
        for message in result["unreachable"]:
            print(f"fleetsched simulate: warning: {message}", file=sys.stderr)
        for note in result["notes"]:  # as a plain run prints it (why a tenant's calls all fail, say)
            print(f"fleetsched simulate: note: {note}", file=sys.stderr)
        if args.json:
            if saved:  # else `save_json` printed it
                print(text)
        elif result["max_sessions"] == 0:
            smallest = _size(settings.workload.agents, 1)
            kinds = " (one of each kind)" if len(settings.workload.agents) > 1 else ""
            print(f"no fleet meets every SLA: the smallest, {smallest} session{'s' if smallest > 1 else ''}{kinds}, misses {result['smallest_misses']}")
        elif result["bounded_by_limit"]:
            print(f"every fleet up to {result['max_sessions']} sessions meets every SLA (the search stops there) {result['agents']}")
        else:
            # The bisection stops within 2 %: the next fleet run says where the edge lies.
            miss = "" if result["first_miss"] is None else f"; the next fleet run, {result['first_miss']} sessions, misses"
            print(f"largest fleet meeting every SLA: {result['max_sessions']} sessions {result['agents']}{miss}")
            if args.repeats == 1:
                print(
                    "fleetsched simulate: note: each size ran once (one seed): near the edge a size can pass or miss by chance; "
                    "--repeats 3 runs each with three",
                    file=sys.stderr,
                )
        limited = {int(n): refused for n, refused in result["rate_limited"].items() if int(n) > result["max_sessions"]}
        if limited and not args.json:
            largest = max(limited)
            print(
                f"note: {largest} sessions fit the engine but miss their tenants' own rate limits ({limited[largest]}): "
                "a rate limit, not the engine, bounds the fleet there"
            )
    else:
        report, _ = simulate(settings, duration, args.loop)
        text = json.dumps(report, indent=2)
        saved = _save(text, args)
        # On stderr, with --json too (as the report's schema says, and as --find-max-sessions does).
        for flagged in report["sla"]["feasibility"]["unreachable"]:
            print(f"fleetsched simulate: warning: {flagged['message']}", file=sys.stderr)
        if report["sla"]["feasibility"]["note"]:  # as `run` prints it (an agent whose calls cannot fit, say)
            print(f"fleetsched simulate: note: {report['sla']['feasibility']['note']}", file=sys.stderr)
        if args.json:
            if saved:  # else `save_json` printed it (it came twice)
                print(text)
        else:
            from .report import sla_table, table_console, tenant_table

            console = table_console()
            console.print(tenant_table(report))
            console.print(sla_table(report))
            s = report["sim"]
            simulated = f"{report['duration_s']:.0f} s simulated"
            if duration is not None and report["duration_s"] > duration:  # sessions under way got drain_grace_s
                grace = settings.scheduler.drain_grace_s
                simulated += f" (the fleet for {duration:g} s, then up to {grace:g} s for the sessions under way to finish)"
            console.print(
                f"{simulated} in {report['wall_s']:.1f} s wall; {s['engine_steps']:,} engine steps, "
                f"busy {s['engine_busy_frac']:.0%}, {s['preemptions']:,} preemptions, stream_interval {s['stream_interval']}"
            )
        failed = failed_sessions(report)
        if failed:
            print(f"fleetsched simulate: {failed}", file=sys.stderr)
        return saved, nothing_done(report)
    return saved, False
