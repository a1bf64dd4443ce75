"""Benchmarks: programs that print figures (and JSON with --json), run as ``fleetsched bench NAME``.

Each benchmark is a module here with ``main(argv) -> int``.
"""

from __future__ import annotations

import importlib
import json
import math
import sys

from ..errors import BackendUnavailable

BENCHMARKS = {
    "overhead": "what the scheduler itself costs per session and per call (instant backend)",
    "allocator": "placement strategies of the memory allocator on churn traces",
    "mixed-pace": "chatty, long-tool and batch agents: baseline (slots held through tools) vs keep-or-release",
    "qos": "tiers and fair share on a real vLLM overloaded 2-3x: direct-fcfs, direct-priority, fleetsched",
    "gateway": "the gateway's added latency and throughput under load from a second process",
    "sim-fidelity": "the sim backend against reference tables and a real CPU vLLM",
}


def json_text(result: object) -> str:
    """A benchmark's figures as JSON text, a figure that is not a finite number (the p99 of no
    calls) as null: ``json.dumps`` writes NaN, which is not JSON (a parser refuses it)."""

    def finite(value: object) -> object:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(item) for item in value]
        return value

    return json.dumps(finite(result), indent=2, allow_nan=False)


def run(name: str, argv: list[str]) -> int:
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        print(f"fleetsched bench: unknown benchmark {name!r}; known: {known}", file=sys.stderr)
        return 2  # a usage error, as argparse's
    module = importlib.import_module(f"fleetsched.bench.{name.replace('-', '_')}")
    try:
        return module.main(argv)
    except BackendUnavailable as exc:  # a --url or --backend that does not answer
        print(f"fleetsched bench {name}: {exc}", file=sys.stderr)
        return 1
