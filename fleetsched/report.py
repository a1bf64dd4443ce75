"""The run report: one JSON document per run, and the final per-tenant table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .scheduler import Scheduler, summarise

SCHEMA = "fleetsched.run/1"


def _num(value: float, digits: int = 4) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def build_report(scheduler: Scheduler, *, duration_s: float, backend: str) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (schema `SCHEMA`)."""
    settings = scheduler.settings
    stats = scheduler.statistics()
    tenants = []
    for row in summarise(scheduler.recorder, settings.tenants):
        tenant = settings.tenants[row.tenant]
        tenants.append(
            {
                "tenant": row.tenant,
                "tier": str(tenant.tier),
                "weight": tenant.weight,
                "sessions_done": row.sessions_done,
                "sessions_failed": row.sessions_failed,
                "sessions_cancelled": row.sessions_cancelled,
                "calls": row.calls,
                "call_errors": row.call_errors,
                "ttft_s": {"p50": _num(row.ttft_p50_s), "p99": _num(row.ttft_p99_s)},
                "latency_s": {"p50": _num(row.latency_p50_s), "p99": _num(row.latency_p99_s)},
                "queue_s": {"p50": _num(row.queue_p50_s)},
                "prompt_tokens": row.prompt_tokens,
                "completion_tokens": row.completion_tokens,
            }
        )
    completion = sum(t["completion_tokens"] for t in tenants)
    return {
        "schema": SCHEMA,
        "backend": backend,
        "duration_s": round(duration_s, 3),
        "sessions": dict(stats.finished),
        "calls": scheduler.recorder.call_count,
        "completion_tokens": completion,
        "throughput_tok_s": round(completion / duration_s, 1) if duration_s > 0 else None,
        "memory": {"total_bytes": stats.memory.total, "fragmentation_failures": stats.memory.fragmentation_failures},
        "tenants": tenants,
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def tenant_table(report: dict[str, Any]) -> Any:
    """A rich Table of the report's per-tenant rows."""
    from rich.table import Table

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:,.0f}"

    table = Table(title=f"fleetsched run: {report['duration_s']:.1f} s on {report['backend']}, {report['throughput_tok_s']} tok/s")
    for column in ("tenant", "tier", "done", "failed", "calls", "TTFT p50 ms", "TTFT p99 ms", "call p50 ms", "call p99 ms", "tokens in", "tokens out"):
        table.add_column(column, justify="left" if column in ("tenant", "tier") else "right")
    for t in report["tenants"]:
        table.add_row(
            t["tenant"],
            t["tier"],
            str(t["sessions_done"]),
            str(t["sessions_failed"]),
            str(t["calls"]),
            ms(t["ttft_s"]["p50"]),
            ms(t["ttft_s"]["p99"]),
            ms(t["latency_s"]["p50"]),
            ms(t["latency_s"]["p99"]),
            f"{t['prompt_tokens']:,}",
            f"{t['completion_tokens']:,}",
        )
    return table
