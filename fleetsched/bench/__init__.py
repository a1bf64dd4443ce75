"""Benchmarks: programs that print figures (and JSON with --json), run as ``fleetsched bench NAME``.

Each benchmark is a module here with ``main(argv) -> int``.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "overhead": "what the scheduler itself costs per session and per call (instant backend)",
    "allocator": "placement strategies of the memory allocator on churn traces",
}


def run(name: str, argv: list[str]) -> int:
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        raise SystemExit(f"fleetsched bench: unknown benchmark {name!r}; known: {known}")
    module = importlib.import_module(f"fleetsched.bench.{name.replace('-', '_')}")
    return module.main(argv)
