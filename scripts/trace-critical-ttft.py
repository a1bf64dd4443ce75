"""Where a critical call's first token waits under `fleetsched bench qos`'s fleetsched mode.

Starts a priority vLLM server as `bench qos` does, with a ``sitecustomize`` that times, inside
the engine-core process, when each critical call (vLLM priority 0) reached vLLM's scheduler, was
scheduled, and had its first token computed. Each critical call's client-side TTFT then splits
into: client -> engine (this process, HTTP, the API server's parsing and tokenising), engine wait
(for a slot in the running batch), the step, and engine -> client (the API server's streaming and
this process's reading). It also counts engine stalls: gaps over 10 ms between the scheduler's
steps. A diagnostic: it patches vLLM 0.32 internals (`vllm.v1.core.sched.scheduler.Scheduler`).

    .venv/bin/python scripts/trace-critical-ttft.py [bench qos options] [--repeats 2]

It takes `fleetsched bench qos`'s options and defaults (``--reserve``, ``--max-num-seqs``, ...);
it starts its own server and prints JSON lines (``--url`` and ``--json`` are not used).

Engine and client share one monotonic clock (the same machine), so the stamps compare directly.
Critical calls are matched to the engine's records in order of arrival.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import anyio

from fleetsched.bench import qos
from fleetsched.gc_tuning import SERVING, gc_thresholds
from fleetsched.policies.tiers import Tier
from fleetsched.scheduler import percentile
from fleetsched.testing.vllm_server import VLLMServer, off_cpus

# Runs in every process of the server; patches the scheduler where it is imported (engine core).
SITECUSTOMIZE = '''
import os, sys, threading, time

def _patch():
    while "vllm.v1.core.sched.scheduler" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)  # let the module finish importing
    Scheduler = sys.modules["vllm.v1.core.sched.scheduler"].Scheduler
    log = open(os.path.join(os.environ["TRACE_DIR"], f"engine-{os.getpid()}.txt"), "a", buffering=1)
    critical, pending, last = set(), set(), [0.0]
    add_request, schedule, update_from_output = Scheduler.add_request, Scheduler.schedule, Scheduler.update_from_output

    def traced_add_request(self, request):
        if request.priority == 0:
            critical.add(request.request_id)
            pending.add(request.request_id)
            log.write(f"add {time.monotonic():.6f} {request.request_id}\\n")
        return add_request(self, request)

    def traced_schedule(self, *args, **kwargs):
        now = time.monotonic()
        if last[0] and now - last[0] > 0.010:
            log.write(f"gap {last[0]:.6f} {now - last[0]:.6f}\\n")
        last[0] = now
        out = schedule(self, *args, **kwargs)
        for new in out.scheduled_new_reqs:
            if new.req_id in critical:
                log.write(f"sched {now:.6f} {new.req_id}\\n")
        return out

    def traced_update_from_output(self, scheduler_output, model_output):
        result = update_from_output(self, scheduler_output, model_output)
        now = time.monotonic()
        for request_id in [r for r in pending if r in scheduler_output.num_scheduled_tokens]:
            pending.discard(request_id)
            log.write(f"out {now:.6f} {request_id}\\n")
        return result

    Scheduler.add_request, Scheduler.schedule = traced_add_request, traced_schedule
    Scheduler.update_from_output = traced_update_from_output

if os.environ.get("TRACE_DIR"):
    threading.Thread(target=_patch, daemon=True).start()
'''

PARTS = ("ttft", "client_to_engine", "engine_wait", "step", "engine_to_client")


class TracedServer(VLLMServer):
    def __init__(self, trace_dir: Path, **options) -> None:
        super().__init__(**options)
        self.trace_dir = trace_dir

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "PYTHONPATH": str(self.trace_dir), "TRACE_DIR": str(self.trace_dir)}


def read_engine(trace_dir: Path) -> tuple[dict[str, dict[str, float]], list[tuple[float, float]]]:
    """Per critical request: its stamps by kind; and the engine's gaps between steps (start, length)."""
    stamps: dict[str, dict[str, float]] = {}
    gaps = []
    for path in trace_dir.glob("engine-*.txt"):
        for line in path.read_text().splitlines():
            kind, when, what = line.split()
            if kind == "gap":
                gaps.append((float(when), float(what)))
            else:
                stamps.setdefault(what, {})[kind] = float(when)
    return stamps, gaps


def split(records, stamps: dict[str, dict[str, float]], since: float) -> list[tuple[float, ...]]:
    """Each critical call made after `since`, matched to the next unmatched engine arrival."""
    arrivals = sorted((s["add"], rid) for rid, s in stamps.items() if "add" in s)
    taken, rows = set(), []
    for call in sorted((r for r in records if r.tier == Tier.CRITICAL and r.submitted >= since), key=lambda r: r.submitted):
        match = next((rid for when, rid in arrivals if when >= call.submitted and rid not in taken), None)
        if match is None:
            continue
        taken.add(match)
        s = stamps[match]
        if "sched" in s and "out" in s:
            rows.append((call.ttft_s, s["add"] - call.submitted, s["sched"] - s["add"], s["out"] - s["sched"], call.first_token - s["out"]))
    return rows


def main() -> None:
    parser = qos.build_parser(prog="trace-critical-ttft.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of the fleetsched mode on the one server")
    args = parser.parse_args()
    cpus = args.engine_cpus
    with tempfile.TemporaryDirectory() as tmp, gc_thresholds(SERVING), off_cpus(cpus if args.client_off_engine else frozenset()):
        trace_dir = Path(tmp)
        (trace_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        options = dict(max_num_seqs=args.max_num_seqs, engine_nice=args.engine_nice, engine_cpus=cpus)
        with TracedServer(trace_dir, scheduling_policy="priority", **options) as server:
            engine = anyio.run(qos.measure_engine, server.url, args.max_tokens, args.max_tokens_spread)
            rate = args.overload * engine["saturation_tok_s"] / args.max_tokens
            print(json.dumps({"args": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in vars(args).items()}, **engine}))
            for _ in range(args.repeats):
                for path in trace_dir.glob("engine-*.txt"):
                    path.write_text("")
                result, _, records = anyio.run(qos.run_fleetsched, server.url, rate, args)
                stamps, gaps = read_engine(trace_dir)
                start = min(r.submitted for r in records)
                rows = split(records, stamps, start + args.warmup)
                gaps = [length for when, length in gaps if when >= start]  # not the idle time before the load
                parts = {
                    name: {q: round(percentile([row[i] for row in rows], q) * 1e3, 1) for q in (50, 90, 99)}
                    for i, name in enumerate(PARTS)
                }
                print(json.dumps({
                    "critical_calls_matched": len(rows),
                    "throughput_tok_s": result["throughput_tok_s"],
                    "ms": parts,
                    "engine_gaps_over_10ms": len(gaps),
                    "longest_gap_ms": round(max(gaps, default=0.0) * 1e3, 1),
                }))


if __name__ == "__main__":
    main()
