"""The run report: one JSON document per run (schema ``fleetsched.run/2``), and the final tables.

The schema is documented field by field in ``docs/report-schema.md``. `build_report` makes it
from a finished scheduler (``fleetsched run`` and ``fleetsched simulate`` both use it),
`load_report` reads one back and refuses any other schema version, or a report whose fields are
missing or of the wrong type, with `ReportSchemaError`.
`tenant_table` and `sla_table` are the tables printed at the end of a run.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ReportSchemaError
from .observability.sla import OBJECTIVES, QUANTILE, REASON_TEXT, REASONS, evaluate
from .policies.tiers import Tier
from .report_shape import check_shape
from .scheduler import Scheduler, summarise
from .scheduler.records import CallRecord, CallTimes, sorted_percentile

SCHEMA = "fleetsched.run/2"
#: Breach events kept in the report (the counts cover all of them).
MAX_BREACH_EVENTS = 500


def _num(value: float, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else round(value, digits)


def _quantiles(data: list[float]) -> list[float] | None:
    """The 0th..100th percentiles (101 values) of `data` (sorted, no nan): a CDF that stays small."""
    if not data:
        return None
    return [round(sorted_percentile(data, q), 6) for q in range(101)]


def _call_times(calls: list[CallRecord]) -> tuple[dict[str, CallTimes], dict[int, CallTimes]]:
    """The successful calls' `CallTimes` per tenant and per tier, each call's times sorted once
    (with a long run's hundreds of thousands of calls, sorts are much of the report's cost)."""
    groups: dict[tuple[str, int], list[CallRecord]] = {}
    for c in calls:
        if c.error is None:
            groups.setdefault((c.tenant, c.tier), []).append(c)
    times = {key: CallTimes.of(ok) for key, ok in groups.items()}
    of_tenant: dict[str, list[CallTimes]] = {}
    of_tier: dict[int, list[CallTimes]] = {}
    for (tenant, tier), group_times in times.items():
        of_tenant.setdefault(tenant, []).append(group_times)
        of_tier.setdefault(tier, []).append(group_times)
    return (
        {tenant: CallTimes.merged(parts) for tenant, parts in of_tenant.items()},
        {tier: CallTimes.merged(parts) for tier, parts in of_tier.items()},
    )


def _sla_section(
    scheduler: Scheduler, start: float, times: Mapping[str, CallTimes]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    rows, breaches = evaluate(scheduler.recorder, scheduler.settings.tenants, times)
    by_reason = {r: 0 for r in REASONS}
    for b in breaches:
        by_reason[b.reason] += 1
    per_tenant = {}
    for row in rows:
        per_tenant[row.tenant] = {
            "met": row.met,
            "refused": {"shed": row.refused.get("shed", 0), "rate_limited": row.refused.get("rate-limited", 0)},
            "objectives": {
                o.objective: {
                    "target": o.target,
                    "value": _num(o.value),
                    **({"value_at_least": True} if o.at_least else {}),
                    "events": o.events,
                    "met_events": o.met_events,
                    "attainment": _num(o.attainment),
                    "required": QUANTILE[o.objective],
                    "met": o.met,
                    "breaches": dict(o.breaches),
                }
                for o in row.objectives
            },
        }
    section = {
        "breaches": {"total": len(breaches), "by_reason": by_reason},
        "events": [
            {
                "t": round(b.at - start, 4),
                "tenant": b.tenant,
                "tier": str(Tier(b.tier)),
                "objective": b.objective,
                "value": _num(b.value),
                "target": b.target,
                "reason": b.reason,
            }
            for b in breaches[:MAX_BREACH_EVENTS]
        ],
    }
    return section, per_tenant


def build_report(
    scheduler: Scheduler,
    *,
    duration_s: float,
    backend: str,
    start: float | None = None,
    timeline: Mapping[str, Any] | None = None,
    feasibility: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (schema `SCHEMA`).

    `start` is the run's start on the scheduler's clock (breach times are relative to it);
    `timeline` is `Timeline.as_dict()`, `feasibility` `check_feasibility()`'s result.
    """
    settings = scheduler.settings
    stats = scheduler.statistics()
    recorder = scheduler.recorder
    if start is None:
        start = min((s.submitted for s in recorder.sessions), default=0.0)
    by_tenant, by_tier = _call_times(recorder.calls)
    sla, sla_by_tenant = _sla_section(scheduler, start, by_tenant)
    tenants = []
    for row in summarise(recorder, settings.tenants, by_tenant):
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
                "sla": sla_by_tenant[row.tenant],
            }
        )
    distributions = {
        metric: {
            "tenant": {k: _quantiles(getattr(v, metric)) for k, v in by_tenant.items()},
            "tier": {str(Tier(k)): _quantiles(getattr(v, metric)) for k, v in by_tier.items()},
        }
        for metric in ("ttft_s", "latency_s")
    }
    completion = sum(t["completion_tokens"] for t in tenants)
    sla["feasibility"] = dict(feasibility) if feasibility is not None else None
    return {
        "schema": SCHEMA,
        "backend": backend,
        "duration_s": round(duration_s, 3),
        "sessions": dict(stats.finished),
        "calls": recorder.call_count,
        "refused_calls": recorder.refusal_count,
        "completion_tokens": completion,
        "throughput_tok_s": round(completion / duration_s, 1) if duration_s > 0 else None,
        "memory": {
            "total_bytes": stats.memory.total,
            "fragmentation_failures": stats.memory.fragmentation_failures,
            "devices": [{"name": d.name, "total_bytes": d.total} for d in stats.memory.devices],
        },
        "tenants": tenants,
        "sla": sla,
        "distributions": distributions,
        "timeline": dict(timeline) if timeline is not None else None,
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def save_json(text: str, path: str | Path, command: str) -> bool:
    """Write a run's JSON `text` to `path` (``--report``); whether it was written. A write that
    fails (the path was checked before the run, yet a disk fills or a directory goes) prints
    the JSON on stdout and says so on stderr: the run's figures are not lost with a traceback."""
    try:
        Path(path).write_text(text)
    except OSError as exc:
        print(text)
        print(f"{command}: cannot write {path} ({exc.strerror or exc}); the report is printed above", file=sys.stderr)
        return False
    return True


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a run report; raises `ReportSchemaError` unless it is a ``fleetsched.run/2`` document.

    The message names the first field missing or of the wrong type (a report edited by hand).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ReportSchemaError(f"{path}: no such file") from None
    except OSError as exc:  # a directory, no permission
        raise ReportSchemaError(f"{path}: cannot read it ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ReportSchemaError(f"{path}: not a JSON run report ({exc})") from None
    except RecursionError:  # arrays or objects nested deeper than the parser's stack: no report is
        raise ReportSchemaError(f"{path}: not a JSON run report (nested too deeply)") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA:
        found = f"schema {schema!r}" if schema else "no 'schema' field"
        raise ReportSchemaError(f"{path}: {found}, but this fleetsched reads only {SCHEMA!r}{_version_hint(schema)}")
    missing = [name for name in _SECTIONS if name not in data]
    if missing:
        raise ReportSchemaError(f"{path}: a {SCHEMA} report without {', '.join(missing)} (cut short, or edited?)")
    check_shape(data, str(path))
    return data


#: What `fleetsched report` reads of a report (a report always has them, some null).
_SECTIONS = ("duration_s", "backend", "throughput_tok_s", "tenants", "sla", "distributions", "timeline")


def _version_hint(schema: Any) -> str:
    """What to do with a report of another ``fleetsched.run/N`` version: an older fleetsched
    wrote it (run again), or a newer one (render it with that one); nothing for other schemas."""
    prefix, _, version = str(schema).rpartition("/")
    if prefix != SCHEMA.rpartition("/")[0] or not version.isdecimal():
        return ""
    ours = int(SCHEMA.rpartition("/")[2])
    if int(version) < ours:
        return " (written by an older fleetsched: run it again to get a new report)"
    if int(version) > ours:
        return " (written by a newer fleetsched: render it with that version, or upgrade this one)"
    return ""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a report holds (it writes null for what it did not measure)")


def throughput_text(report: dict[str, Any]) -> str:
    """The run's throughput as shown: ``"1234.5 tok/s"``, or ``"- tok/s"`` when not measured."""
    value = report.get("throughput_tok_s")
    return "- tok/s" if value is None else f"{value} tok/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f}"


def _fold(column: str) -> dict[str, str]:
    """The tenant column's cells wrap onto more lines rather than end in an ellipsis: two long
    names that differ at their ends were cut to the same text, and the rows (one met, one
    MISSED) could not be told apart."""
    return {"overflow": "fold"} if column == "tenant" else {}


def tenant_table(report: dict[str, Any]) -> Any:
    """A rich Table of the report's per-tenant rows (a tenant's name as plain text, not markup:
    ``team[/]`` failed the run's end with a MarkupError, before its report was written)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"fleetsched: {report['duration_s']:.1f} s on {report['backend']}, {throughput_text(report)}")
    columns = ("tenant", "tier", "done", "failed", "cancelled", "calls", "TTFT p50 ms", "TTFT p99 ms", "call p50 ms", "call p99 ms", "tokens in", "tokens out")
    for column in columns:
        table.add_column(column, justify="left" if column in ("tenant", "tier") else "right", **_fold(column))
    for t in report["tenants"]:
        table.add_row(
            Text(t["tenant"]),
            t["tier"],
            str(t["sessions_done"]),
            str(t["sessions_failed"]),
            # Sessions still under way when a run ends (its drain grace over) are cancelled:
            # without the column they were in no table. Absent from older reports.
            str(t.get("sessions_cancelled", "-")),
            str(t["calls"]),
            _ms(t["ttft_s"]["p50"]),
            _ms(t["ttft_s"]["p99"]),
            _ms(t["latency_s"]["p50"]),
            _ms(t["latency_s"]["p99"]),
            f"{t['prompt_tokens']:,}",
            f"{t['completion_tokens']:,}",
        )
    return table


_OBJECTIVE_TEXT = {
    "ttft_p99": "TTFT p99",
    "admission_p99": "admission p99",
    "latency_p95": "call p95",
    "admission_p95": "admission p95",
    "deadline": "deadline",
    "min_tokens_per_s": "tok/s",
}


def objective_text(objective: str) -> str:
    """An SLA objective as the tables and plots name it ("ttft_p99": "TTFT p99")."""
    return _OBJECTIVE_TEXT.get(objective, objective)


def sla_rows(report: dict[str, Any]) -> list[list[str]]:
    """The SLA table as text cells: per tenant and objective, target, measured, attainment, verdict, breaches."""
    rows = []
    unreachable = {u["tenant"] for u in ((report["sla"].get("feasibility") or {}).get("unreachable") or [])}
    for t in report["tenants"]:
        sla = t["sla"]
        refused = sla["refused"]
        refused_text = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in refused.items() if n)
        if not sla["objectives"]:
            rows.append([t["tenant"], t["tier"], f"{t['weight']:g}", "-", "-", "-", "-", "no SLA", refused_text])
            continue
        for objective in OBJECTIVES:
            o = sla["objectives"].get(objective)
            if o is None:
                continue
            if objective == "min_tokens_per_s":
                target, value = f"{o['target']:g}", "-" if o["value"] is None else f"{o['value']:,.1f}"
            else:
                target, value = f"{o['target'] * 1e3:,.0f} ms", "-" if o["value"] is None else f"{o['value'] * 1e3:,.0f} ms"
                if o.get("value_at_least"):  # the longest session was cut at its deadline, unfinished
                    value = ">= " + value
            attainment = "-" if o["attainment"] is None else f"{o['attainment']:.1%}"
            verdict = "not measured" if o["met"] is None else "met" if o["met"] else "MISSED"
            if t["tenant"] in unreachable and objective == "ttft_p99":
                verdict += " (unreachable)"
            breaches = ", ".join(f"{n} {REASON_TEXT.get(r, r)}" for r, n in sorted(o["breaches"].items(), key=lambda kv: -kv[1]))
            rows.append([t["tenant"], t["tier"], f"{t['weight']:g}", objective_text(objective), target, value, attainment, verdict, breaches or refused_text])
    return rows


SLA_COLUMNS = ("tenant", "tier", "weight", "objective", "target", "measured", "attained", "verdict", "breaches (reason)")


def sla_table(report: dict[str, Any]) -> Any:
    """A rich Table of every tenant's SLA objectives: target, measured, attainment, breaches by reason."""
    from rich.table import Table
    from rich.text import Text

    rows = sla_rows(report)
    title = f"SLA: {report['sla']['breaches']['total']} breaches"
    # The breaches are events (calls, refused calls, sessions); a missed min_tokens_per_s rate
    # is none, and the title read "0 breaches" above a MISSED row.
    missed = sum(row[7].startswith("MISSED") for row in rows)
    if missed:
        title += f", {missed} objective{'s' if missed > 1 else ''} missed"
    table = Table(title=title)
    for column in SLA_COLUMNS:
        table.add_column(column, justify="right" if column in ("weight", "target", "measured", "attained") else "left", **_fold(column))
    for row in rows:
        style = "red" if row[7].startswith("MISSED") else None
        table.add_row(Text(row[0]), *row[1:], style=style)  # the tenant's name as plain text, as in tenant_table
    return table
