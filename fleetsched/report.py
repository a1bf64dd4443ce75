"""The run report: one JSON document per run (schema ``fleetsched.run/2``), and the final tables.

The schema is documented field by field in ``docs/report-schema.md``. `build_report` makes it
from a finished scheduler (``fleetsched run`` and ``fleetsched simulate`` both use it),
`load_report` reads one back and refuses any other schema version, or a report whose fields are
missing or of the wrong type, with `ReportSchemaError`.
`tenant_table` and `sla_table` are the tables printed at the end of a run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.cells import cell_len

from .errors import ReportSchemaError
from .observability.sla import OBJECTIVES, QUANTILE, REASON_TEXT, REASONS, ObjectiveResult, evaluate
from .policies.tiers import Tier
from .report_shape import check_shape
from .scheduler import Scheduler, summarise
from .scheduler.records import CallRecord, CallTimes, sorted_percentile

SCHEMA = "fleetsched.run/2"
#: Breach events kept in the report (the counts cover all of them).
MAX_BREACH_EVENTS = 500


def _num(value: float, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else round(value, digits)


def _floor(value: float | None, digits: int = 4) -> float | None:
    """`value` rounded down to `digits`: an attainment of 0.98997 against a required 0.99 read
    0.99, beside ``met: false``."""
    if value is None or math.isnan(value):
        return None
    scale = 10**digits
    return math.floor(round(value * scale, 6)) / scale


def share_text(value: float | None) -> str:
    """A share as the tables show an attainment: a percentage rounded down to a tenth, so that
    98.99 % of calls on time read 98.9 %, not 99.0 % beside MISSED; ``-`` for none."""
    floored = _floor(value, 3)
    return "-" if floored is None else f"{floored * 100:.1f}%"


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


def _past_target(o: ObjectiveResult) -> bool:
    """Whether `o`'s measured value is past its target (over it; under it for
    ``min_tokens_per_s``) where the report's rounding writes it equal to the target: the SLA
    table then reads "> 500 ms". An objective missed by refused or failed calls alone, its
    value within the target, read so too."""
    if _num(o.value) != o.target:
        return False
    return o.value < o.target if o.objective == "min_tokens_per_s" else o.value > o.target


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
                    **({"value_past_target": True} if _past_target(o) else {}),
                    "events": o.events,
                    "met_events": o.met_events,
                    "attainment": _floor(o.attainment),
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
                "session_errors": row.session_errors,
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
    # The duration as written, which the throughput is of: from the unrounded one, a run of 0.8 ms
    # read "duration_s": 0.001 beside 19,980.6 tok/s for its 16 tokens, and one under 0.5 ms
    # "duration_s": 0.0 beside a throughput (null for a run of no duration).
    duration_s = round(duration_s, 3)
    sla["feasibility"] = dict(feasibility) if feasibility is not None else None
    return {
        "schema": SCHEMA,
        "backend": backend,
        "duration_s": duration_s,
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


def failed_sessions(report: Mapping[str, Any]) -> str | None:
    """What a report's failed sessions failed with, for stderr: ``"5 of 5 sessions failed
    (ContextTooLong 5)"``; None when none failed. The tables give the counts per tenant but not
    why, and the report's ``session_errors`` are easily missed."""
    errors: Counter[str] = Counter()
    for tenant in report["tenants"]:
        errors.update(tenant.get("session_errors", {}))
    failed = sum(t["sessions_failed"] for t in report["tenants"])
    if not failed:
        return None
    ended = failed + sum(t["sessions_done"] + t["sessions_cancelled"] for t in report["tenants"])
    why = ", ".join(f"{name} {count}" for name, count in errors.most_common())
    return f"{failed} of {ended} sessions failed ({why})"


def nothing_done(report: Mapping[str, Any]) -> bool:
    """Whether sessions failed and none completed: the exit status of ``run`` and ``simulate``
    is then 1, as a script running a fleet expects of a run in which nothing worked."""
    tenants = report["tenants"]
    return sum(t["sessions_failed"] for t in tenants) > 0 and sum(t["sessions_done"] for t in tenants) == 0


def write_report(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def save_json(text: str, path: str | Path, command: str) -> bool:
    """Write a run's JSON `text` to `path` (``--report``); whether it was written. A write that
    fails (the path was checked before the run, yet a disk fills or a directory goes) prints
    the JSON on stdout and says so on stderr: the run's figures are not lost with a traceback."""
    target = Path(path)
    emptied = False
    try:
        with target.open("w") as file:
            emptied = True
            file.write(text)
    except BaseException as exc:
        # Emptied, then cut short (a full disk, a file size limit, Ctrl-C): what was written is no
        # report, and was left at `path` for `fleetsched report` to refuse ("not a JSON run report").
        if emptied and target.is_file():  # not /dev/full or a pipe
            target.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
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
        if isinstance(data, dict) and schema is None and {"max_sessions", "probes"} <= data.keys():
            # What `simulate --find-max-sessions --report` writes: "no 'schema' field" read as a
            # report cut short or edited, where it is another document altogether.
            raise ReportSchemaError(
                f"{path}: a capacity search's result (simulate --find-max-sessions), not a run report: it has no plots; "
                "for a run report of the fleet it found, run `fleetsched simulate CONFIG --report RUN.json` without --find-max-sessions"
            )
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


def drop_stdout() -> None:
    """Stdout's reader has gone (``... | head``): point stdout at nothing, so that what is
    printed next, and Python's flush at exit, goes nowhere instead of failing."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def print_or_drop(text: str) -> None:
    """print(text); once stdout's reader has gone, nothing (the run goes on, its report saved)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        drop_stdout()


def table_console() -> Any:
    """The console `run` and `simulate` print their tables (and `run` its progress) on: a
    terminal's width, else 160 columns (logs and CI: the tables are not squeezed to 80). Once
    stdout's reader has gone, it prints nothing: rich's own console exits (SystemExit 1), which
    stopped a run part-way, with a traceback, where its progress lines went to ``| head``. Once
    stdout cannot be written (its `write_error` says why), it prints nothing either."""
    from rich.console import Console

    class _Console(Console):
        #: Why stdout could not be written, once it could not; None while it can.
        write_error: str | None = None

        def on_broken_pipe(self) -> None:
            self.quiet = True
            drop_stdout()

        def _write_buffer(self) -> None:
            try:
                super()._write_buffer()
            except BrokenPipeError:
                raise  # the reader has gone: `on_broken_pipe`
            except OSError as exc:
                # A full disk under `run > run.log`, an I/O error: raised from a progress line,
                # it ended the run with a traceback, and its report was not written. Said once;
                # the run goes on without stdout.
                self.write_error = exc.strerror or str(exc)
                self.quiet = True
                drop_stdout()
                print(f"fleetsched: cannot write to stdout ({self.write_error}); its output is dropped", file=sys.stderr)

    console = _Console()
    return console if console.is_terminal else _Console(width=160)


def table_borders(columns: int) -> int:
    """The characters a rich Table's box takes in a row beside its cells: each column's
    padding (2) and border, and the last border."""
    return 3 * columns + 1


def is_simulated(report: dict[str, Any]) -> bool:
    """Whether `report` comes from ``fleetsched simulate`` (virtual time, the sim engine's
    figures, not measured): only it writes the ``sim`` section."""
    return isinstance(report.get("sim"), dict)


def throughput_text(report: dict[str, Any]) -> str:
    """The run's throughput as shown: ``"1,234.5 tok/s"``, or ``"- tok/s"`` when not measured."""
    value = report.get("throughput_tok_s")
    return "- tok/s" if value is None else f"{value:,.1f} tok/s"


def count_text(value: int | None) -> str:
    """A count as tables and pages show it, with thousands separators (``12,345``); ``-`` for none."""
    return "-" if value is None else f"{value:,}"


def _ms(value: float | None) -> str:
    """Seconds in milliseconds: whole ones, with a decimal below 10 ms (the instant backend's
    TTFTs all read 0)."""
    if value is None:
        return "-"
    return f"{value * 1e3:,.1f}" if value < 0.01 else f"{value * 1e3:,.0f}"


def _beside(value: float | None, target: float, digits: int) -> str:
    """A measured `value` shown beside its `target`: with `digits` decimals, or up to 6 where
    fewer would show a value that differs from its target as equal to it (500.3 ms read "500
    ms" beside a target of 500 ms and the verdict MISSED)."""
    if value is None:
        return "-"
    while digits < 6 and value != target and round(value, digits) == round(target, digits):
        digits += 1
    return f"{value:,.{digits}f}"


def _cut(name: str, head: int, width: int) -> str:
    """`name` whole if it fits in `width` cells, else its start in `head` cells, "…" and its end
    in the rest. Cells, not characters: a wide (CJK) character takes two."""
    if cell_len(name) <= width:
        return name
    start = _fitting(name, head)
    end = _fitting(name[::-1], width - 1 - cell_len(start))[::-1]
    return start + "…" + end


def _fitting(text: str, cells: int) -> str:
    """The longest start of `text` that fits in `cells` cells."""
    used = 0
    for i, char in enumerate(text):
        used += cell_len(char)
        if used > cells:
            return text[:i]
    return text


@functools.lru_cache(maxsize=256)
def short_names(names: tuple[str, ...], width: int) -> dict[str, str]:
    """Each of `names` in at most `width` cells: whole, or a start and an end around an
    ellipsis (``customer…duction``), cut at one place for all, the nearest the middle where no
    two read the same (``...-eu`` and ``...-us`` keep their ends, ``eu-...-prod`` and
    ``us-...-prod`` their starts); whole, to be folded, where no place tells them apart."""
    for head in sorted(range(1, width - 1), key=lambda head: abs(head - width // 2)):
        short = {name: _cut(name, head, width) for name in names}
        if len(set(short.values())) == len(short):
            return short
    return {name: name for name in names}


class _TenantName:
    """A tenant's name in a table cell, on one line: `short_names` at the column's width as
    rendered, as plain text (as markup, ``team[/]`` failed the run's end with a MarkupError).
    Folded, a long name broke its row over several lines (the table of an 80-120 column
    terminal); cut at its end, names that differ there read the same."""

    def __init__(self, name: str, names: tuple[str, ...]) -> None:
        self.name, self.names = name, names

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        return Measurement(1, cell_len(self.name))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield Text(short_names(self.names, options.max_width)[self.name], overflow="fold")


def tenant_cell(name: str, names: list[str]) -> Any:
    """A tenant's name as the terminal tables show it (the final tables and the live dashboard):
    one line, shortened in its middle where the column is narrow; `names` are the table's."""
    return _TenantName(name, tuple(names))


#: The fewest characters of a tenant's name the tenant table keeps where the terminal is narrow.
NAME_MIN = 12

#: The per-tenant table's columns, in the terminal and on the HTML page.
TENANT_COLUMNS = ("tenant", "tier", "done", "failed", "cancelled", "calls", "TTFT p50 ms", "TTFT p99 ms", "call p50 ms", "call p99 ms", "tokens in", "tokens out")


def tenant_rows(report: dict[str, Any]) -> list[list[str]]:
    """The per-tenant table as text cells, in `TENANT_COLUMNS` order."""
    return [
        [
            t["tenant"],
            t["tier"],
            count_text(t["sessions_done"]),
            count_text(t["sessions_failed"]),
            # Sessions still under way when a run ends (its drain grace over) are cancelled:
            # without the column they were in no table. Absent from older reports.
            count_text(t.get("sessions_cancelled")),
            count_text(t["calls"]),
            _ms(t["ttft_s"]["p50"]),
            _ms(t["ttft_s"]["p99"]),
            _ms(t["latency_s"]["p50"]),
            _ms(t["latency_s"]["p99"]),
            count_text(t["prompt_tokens"]),
            count_text(t["completion_tokens"]),
        ]
        for t in report["tenants"]
    ]


def run_title(report: dict[str, Any]) -> str:
    """The run in a few words: ``fleetsched: 18.8 s on sim``, or for a simulation
    ``fleetsched simulated run: 314.0 s of virtual time on sim``."""
    if is_simulated(report):
        return f"fleetsched simulated run: {report['duration_s']:,.1f} s of virtual time on {report['backend']}"
    return f"fleetsched: {report['duration_s']:,.1f} s on {report['backend']}"


#: Where the terminal is too narrow for the whole tenant table, it is printed as two: the
#: sessions and calls, then the times and tokens (indices of `TENANT_COLUMNS`).
_TENANT_PARTS = ((0, 1, 2, 3, 4, 5), (0, 6, 7, 8, 9, 10, 11))


def _tenant_grid(title: str | None, rows: list[list[str]], indices: Any, width: int) -> tuple[Any, bool]:
    """A rich Table of `rows`' cells at `indices` (of `TENANT_COLUMNS`), and whether it fits in
    `width`. Each column is as wide as its heading, or where the names would not fit whole, as
    its figures (the heading wraps over more lines); the names (the first column) take the room
    left, from `NAME_MIN` characters to the longest."""
    from rich.table import Table

    for heading in (lambda text: [text], str.split):
        widths = [max(cell_len(text) for text in [*heading(TENANT_COLUMNS[i]), *(row[i] for row in rows)]) for i in indices]
        room = width - sum(widths[1:]) - table_borders(len(widths))
        if room >= widths[0]:
            break
    longest, widths[0] = widths[0], min(widths[0], max(room, NAME_MIN))
    table = Table(title=title)
    for i, column_width in zip(indices, widths):
        table.add_column(TENANT_COLUMNS[i], justify="left" if i < 2 else "right", width=column_width)
    names = [row[0] for row in rows]
    for row in rows:
        table.add_row(tenant_cell(row[0], names), *(row[i] for i in indices[1:]))
    return table, room >= min(longest, NAME_MIN)


class _TenantTable:
    """The tenant table, laid out as the terminal it is printed on allows: whole, or in the two
    parts of `_TENANT_PARTS` where it would not fit with names of `NAME_MIN` characters. Squeezed
    by rich, its figures were cut (``5,254,6…``) and its names folded over several lines."""

    def __init__(self, title: str, rows: list[list[str]]) -> None:
        self.title, self.rows = title, rows

    def __rich_console__(self, console: Any, options: Any) -> Any:
        table, fits = _tenant_grid(self.title, self.rows, range(len(TENANT_COLUMNS)), options.max_width)
        if fits:
            yield table
            return
        for n, part in enumerate(_TENANT_PARTS):
            yield _tenant_grid(None if n else self.title, self.rows, part, options.max_width)[0]


def tenant_table(report: dict[str, Any]) -> Any:
    """A rich renderable of the report's per-tenant rows (`_TenantTable`): one line a tenant,
    its name shortened in the middle where the terminal is narrow (`tenant_cell`), and its
    figures whole and aligned."""
    return _TenantTable(f"{run_title(report)}, {throughput_text(report)}", tenant_rows(report))


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
        refused_text = ", ".join(f"{n:,} {k.replace('_', '-')}" for k, n in refused.items() if n)
        if not sla["objectives"]:
            rows.append([t["tenant"], t["tier"], f"{t['weight']:g}", "-", "-", "-", "-", "no SLA", refused_text])
            continue
        for objective in OBJECTIVES:
            o = sla["objectives"].get(objective)
            if o is None:
                continue
            if objective == "min_tokens_per_s":
                target, value = f"{o['target']:,.10g}", _beside(o["value"], o["target"], 1)
            else:
                target, value = f"{o['target'] * 1e3:,.10g} ms", "-"
                if o["value"] is not None:
                    ms = o["value"] * 1e3
                    value = _beside(ms, o["target"] * 1e3, 1 if ms < 10 else 0) + " ms"
                if o.get("value_at_least"):  # the longest session was cut at its deadline, unfinished
                    value = ">= " + value
            if o.get("value_past_target") and not o.get("value_at_least"):
                # Missed by less than the report's rounding (0.1 ms): it read "500 ms" beside a
                # target of "500 ms" and MISSED. Not where the value itself was within the
                # target (refused or failed calls missed the objective).
                value = ("< " if objective == "min_tokens_per_s" else "> ") + value
            attainment = share_text(o["attainment"])
            verdict = "not measured" if o["met"] is None else "met" if o["met"] else "MISSED"
            if t["tenant"] in unreachable and objective == "ttft_p99":
                verdict += " (unreachable)"
            breaches = ", ".join(f"{n:,} {REASON_TEXT.get(r, r)}" for r, n in sorted(o["breaches"].items(), key=lambda kv: -kv[1]))
            # An objective's own breaches only: the tenant's refusals were shown on every row
            # without any, as breaches of objectives met.
            rows.append([t["tenant"], t["tier"], f"{t['weight']:g}", objective_text(objective), target, value, attainment, verdict, breaches])
    return rows


SLA_COLUMNS = ("tenant", "tier", "weight", "objective", "target", "measured", "attained", "verdict", "breaches (reason)")


#: The SLA table's columns left out where the terminal is too narrow for every column with no
#: word cut (the tenant table shows the tier).
_SLA_SPARED = ("tier", "weight")

#: The SLA table's columns that fold inside their words where nothing else makes it fit.
_SLA_FOLDED = ("verdict", "breaches (reason)")

#: Where even folded the SLA table is too wide (a terminal under about 80 columns), it is
#: printed as two, each row named by its tenant and objective: the figures, then the verdicts.
_SLA_PARTS = (("tenant", "objective", "target", "measured", "attained"), ("tenant", "objective", "verdict", "breaches (reason)"))


class _SlaTable:
    """The SLA table, laid out as the terminal it is printed on allows: every column, or without
    `_SLA_SPARED`, so that no word or figure is cut (squeezed by rich into 80 columns, they
    read "criti…" and "100.…"); cells wrap between words. Where even that is too wide, the
    verdicts and breaches fold inside their words rather than run past the right edge, where a
    terminal cut them ("rate-limit" for "rate-limited" at 80 columns)."""

    def __init__(self, title: str, rows: list[list[str]], names: list[str]) -> None:
        self.title, self.rows, self.names = title, rows, names

    def _narrowest(self, column: str) -> int:
        """The narrowest `column` can be with no word of its heading and cells cut; a name is cut
        in its middle (`tenant_cell`) to `NAME_MIN` cells."""
        i = SLA_COLUMNS.index(column)
        longest = max(cell_len(word) for text in [column, *(row[i] for row in self.rows)] for word in text.split())
        return min(longest, NAME_MIN) if column == "tenant" else longest

    def _table(self, columns: tuple[str, ...], fold: bool, titled: bool = True) -> Any:
        from rich.table import Table

        table = Table(title=self.title if titled else None)
        for column in columns:
            justify = "right" if column in ("weight", "target", "measured", "attained") else "left"
            if fold and column in _SLA_FOLDED:
                table.add_column(column, justify=justify, overflow="fold")
            else:
                table.add_column(column, justify=justify, min_width=self._narrowest(column))
        indices = [SLA_COLUMNS.index(column) for column in columns[1:]]
        for row in self.rows:
            style = "red" if row[7].startswith("MISSED") else None
            table.add_row(tenant_cell(row[0], self.names), *(row[i] for i in indices), style=style)
        return table

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.segment import Segment

        fewer = tuple(c for c in SLA_COLUMNS if c not in _SLA_SPARED)
        for columns, fold in ((SLA_COLUMNS, False), (fewer, False), (fewer, True)):
            table = self._table(columns, fold)
            # As drawn: a sum of the columns' narrowest widths said 9 columns fit in 101-105
            # where rich drew them 104-106 wide.
            lines = Segment.split_lines(console.render(table, options))
            if max((Segment.get_line_length(line) for line in lines), default=0) <= options.max_width:
                yield table
                return
        # Drawn whole, the last table ran past the right edge, where the terminal cut off the
        # breaches and then the verdicts (under 73 columns, no MISSED was to be seen).
        for n, part in enumerate(_SLA_PARTS):
            yield self._table(part, fold=True, titled=not n)


def sla_table(report: dict[str, Any]) -> Any:
    """A rich renderable of every tenant's SLA objectives (`_SlaTable`): target, measured,
    attainment, breaches by reason."""
    rows = sla_rows(report)
    title = f"SLA: {report['sla']['breaches']['total']:,} breaches"
    # The breaches are events (calls, refused calls, sessions); a missed min_tokens_per_s rate
    # is none, and the title read "0 breaches" above a MISSED row.
    missed = sum(row[7].startswith("MISSED") for row in rows)
    if missed:
        title += f", {missed} objective{'s' if missed > 1 else ''} missed"
    return _SlaTable(title, rows, [t["tenant"] for t in report["tenants"]])
