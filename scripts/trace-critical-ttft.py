"""Where a critical call's first token waits under `fleetsched bench qos`'s fleetsched mode.

Starts a priority vLLM server as `bench qos` does, with a ``sitecustomize`` that times, inside
the engine-core process, when each critical call (vLLM priority 0) reached vLLM's scheduler, was
scheduled, and had its first token computed. Each critical call's client-side TTFT then splits
into: client -> engine (this process, HTTP, the API server's parsing and tokenising), engine wait
(for a slot in the running batch), the step, and engine -> client (the API server's streaming and
this process's reading). It also counts engine stalls: gaps over 10 ms between the scheduler's
steps. A diagnostic: it patches vLLM 0.32 internals (`vllm.v1.core.sched.scheduler.Scheduler`).

    .venv/bin/python scripts/trace-critical-ttft.py [--max-num-seqs 36] [--reserve in-batch] [--repeats 2]

Engine and client share one monotonic clock (the same machine), so the stamps compare directly.
Critical calls are matched to the engine's records in order of arrival.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import anyio

from fleetsched.bench import qos
from fleetsched.gc_tuning import SERVING, gc_thresholds
from fleetsched.policies.tiers import Tier
from fleetsched.scheduler import percentile
from fleetsched.testing.vllm_server import VLLMServer, default_engine_cpus, off_cpus

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=36)
    parser.add_argument("--reserve", choices=("in-batch", "beyond-batch"), default="in-batch")
    parser.add_argument("--critical-reserve", type=int, default=qos.CRITICAL_AGENTS)
    parser.add_argument("--batch-stream-interval", type=int, default=64)
    parser.add_argument("--overload", type=float, default=2.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--client-off-engine", action="store_true")
    parser.add_argument("--engine-nice", type=int, default=19)
    args = parser.parse_args()
    run_args = argparse.Namespace(duration=30.0, warmup=2.0, max_tokens=64, window=None, batch_min_share=0.05, **{
        k: getattr(args, k) for k in ("max_num_seqs", "reserve", "critical_reserve", "batch_stream_interval")})
    schedulers = []

    class Recorded(qos.Scheduler):  # keeps the scheduler, whose recorder has every call's times
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            schedulers.append(self)

    qos.Scheduler = Recorded
    cpus = default_engine_cpus()
    with tempfile.TemporaryDirectory() as tmp, gc_thresholds(SERVING), off_cpus(cpus if args.client_off_engine else frozenset()):
        trace_dir = Path(tmp)
        (trace_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        with TracedServer(trace_dir, scheduling_policy="priority", max_num_seqs=args.max_num_seqs, engine_nice=args.engine_nice, engine_cpus=cpus) as server:
            engine = anyio.run(qos.measure_engine, server.url, 64)
            rate = args.overload * engine["saturation_tok_s"] / 64
            print(json.dumps({"args": vars(args), **engine}))
            for _ in range(args.repeats):
                for path in trace_dir.glob("engine-*.txt"):
                    path.write_text("")
                result, _ = anyio.run(qos.run_fleetsched, server.url, rate, run_args)
                records = schedulers[-1].recorder.calls
                stamps, gaps = read_engine(trace_dir)
                start = min(r.submitted for r in records)
                rows = split(records, stamps, start + run_args.warmup)
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
