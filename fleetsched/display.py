"""The live view of a run: a rich dashboard on a terminal, plain log lines otherwise."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from .observability.sla import SlaTracker
from .policies.tiers import Tier
from .report import count_text, share_text, tenant_cell
from .scheduler import Scheduler

GB = 10**9


def _standing(tracker: SlaTracker, tenant: str) -> str:
    """A tenant's SLA standing: the attainment of its objective nearest to missing, rounded
    down (99.6 % of a deadline's sessions read 100 %), and "missed" while one is."""
    standing = tracker.tenant_standing(tenant)
    if standing is None:
        return "-"
    value, met = standing
    return share_text(value) + ("" if met else " missed")


def _tenant_rows(scheduler: Scheduler, tracker: SlaTracker | None) -> list[list[str]]:
    stats = scheduler.statistics()
    done_by: dict[str, int] = {}
    failed_by: dict[str, int] = {}
    cancelled_by: dict[str, int] = {}
    for record in scheduler.recorder.sessions:
        # As the final tenant table counts them: cancelled sessions apart, not failed.
        bucket = done_by if record.state == "done" else cancelled_by if record.state == "cancelled" else failed_by
        bucket[record.tenant] = bucket.get(record.tenant, 0) + 1
    breaches: dict[str, int] = {}
    if tracker is not None:
        for (tenant, _, _), n in tracker.breaches.items():
            breaches[tenant] = breaches.get(tenant, 0) + n
    refused: dict[str, int] = {}
    for (tenant, _), n in stats.dispatcher.refused_by.items():
        refused[tenant] = refused.get(tenant, 0) + n
    rows = []
    for name, tenant in scheduler.settings.tenants.items():
        queued = sum(n for (t, _), n in stats.queued.items() if t == name)
        running = sum(n for (t, _), n in stats.running.items() if t == name)
        attained = _standing(tracker, name) if tracker is not None else "-"
        rows.append(
            [name, str(tenant.tier), count_text(queued), count_text(running), count_text(done_by.get(name, 0)),
             count_text(failed_by.get(name, 0)), count_text(cancelled_by.get(name, 0)), attained, count_text(breaches.get(name, 0)), count_text(refused.get(name, 0))]
        )
    return rows


#: Where the terminal is too narrow for the whole tenant table, it is shown as two: the
#: sessions, then the SLA and the calls refused (indices of the table's columns).
_PARTS = ((0, 1, 2, 3, 4, 5, 6), (0, 7, 8, 9))


class _TenantTable:
    """The dashboard's tenant table, whole where the terminal is wide enough, else in the two
    parts of `_PARTS`. Squeezed by rich into 80 columns, its headings and cells were cut to
    "tena…", "queu…", "crit…" and the names to "su…ot"."""

    def __init__(self, columns: list[str], rows: list[list[str]]) -> None:
        self.columns, self.rows = columns, rows

    def _table(self, indices: Sequence[int]) -> Table:
        table = Table(expand=False)
        for i in indices:
            table.add_column(self.columns[i], justify="left" if i < 2 else "right")
        names = [row[0] for row in self.rows]
        for row in self.rows:
            table.add_row(tenant_cell(row[0], names), *(row[i] for i in indices[1:]))  # one line, shortened as in the final tables
        return table

    def __rich_console__(self, console: Console, options: Any) -> Any:
        table = self._table(range(len(self.columns)))
        # Measured unbounded: rich's measure of a table is no wider than the terminal.
        if Measurement.get(console, options.update_width(10**6), table).maximum <= options.max_width:
            yield table
            return
        for part in _PARTS:
            yield self._table(part)


class _Fitted:
    """The dashboard as the live view draws it: cut with "..." to two lines less than the
    terminal's height, and followed by an empty line, where the cursor rests (the other line
    is the one rich moves down to as it stops). Taller, its last drawing (rich draws the whole
    of it as it stops) scrolled the terminal, and the lines scrolled off were left behind, a
    half dashboard above the final tables (the first 5 lines of 15 on a 10-line terminal).
    With the cursor at the end of its
    last line, the terminal's echo of Ctrl-C ("^C") began a new line where that line took the
    terminal's width (a table squeezed into 80 columns), and the view, erased one line short,
    left its progress bar above "fleetsched: interrupted"."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def __rich_console__(self, console: Console, options: Any) -> Any:
        lines = console.render_lines(self.view, options, pad=False)
        room = max(1, options.size.height - 2)
        if len(lines) > room:
            ellipsis = Text("...", overflow="crop", justify="center", end="", style="live.ellipsis")
            lines = [*lines[: room - 1], console.render_lines(ellipsis, options, pad=False)[0]]
        for line in lines:
            yield from line
            yield Segment.line()
        yield Segment("")  # the empty line: without it, rich leaves the cursor on the last line


def _view(scheduler: Scheduler, total: int, tracker: SlaTracker | None = None) -> Any:
    if tracker is not None:
        tracker.update(scheduler.recorder, anyio.current_time())
    stats = scheduler.statistics()
    finished = sum(stats.finished.values())
    window = f" ({tracker.window_s:g} s)" if tracker is not None else ""
    columns = ["tenant", "tier", "queued", "running", "done", "failed", "cancelled", f"SLA{window}", "breaches", "refused"]
    table = _TenantTable(columns, _tenant_rows(scheduler, tracker))
    d = stats.dispatcher
    queues = "   ".join(
        f"{t}: {sum(n for (_, tier), n in stats.queued.items() if tier == str(t)):,} sessions, {d.queued_by_tier.get(int(t), 0):,} calls"
        for t in Tier
    )
    # A device limited below its size (a replica restarted with a smaller KV cache) reads against
    # its limit: against its size, it showed room the pool would not grant.
    devices = "   ".join(
        f"{x.name} {x.allocated / GB:,.1f}/{x.total / GB:,.1f} GB"
        f"{'' if x.limit is None else f' (limited to {x.limit / GB:,.1f})'} frag {x.fragmentation:.0%}"
        for x in stats.memory.devices
    )
    summary = Text(
        f"sessions {finished:,}/{total:,}   slots {stats.slots_in_use:,}/{stats.slots_total:,}   "
        f"calls in flight {d.in_flight:,}/{d.window:,}, queued {d.queued:,}\n"
        f"queues  {queues}\nmemory  {devices}   fragmentation failures {stats.memory.fragmentation_failures:,}"
    )
    # In a grid row, the bar ends its line: alone, it ran into the summary's first line, which a
    # 120-column terminal then cut short.
    progress = Table.grid(padding=(0, 1))
    progress.add_row(ProgressBar(total=max(total, 1), completed=finished, width=60), f"{100 * finished / max(total, 1):.0f} % of sessions ended")
    return Group(progress, summary, table)


def _line(scheduler: Scheduler, total: int, tracker: SlaTracker | None) -> str:
    if tracker is not None:
        tracker.update(scheduler.recorder, anyio.current_time())
    stats = scheduler.statistics()
    finished = sum(stats.finished.values())
    pct = 100 * finished / total if total else math.nan
    frag = max((x.fragmentation for x in stats.memory.devices), default=0.0)
    attained = ""
    if tracker is not None:
        parts = [f"{name} {_standing(tracker, name)}" for name in scheduler.settings.tenants if tracker.goals.get(name)]
        attained = f" sla {', '.join(parts)}" if parts else ""
    return (
        f"[{pct:5.1f}%] finished {finished:,}/{total:,} queued {stats.queued_total:,} running {stats.running_total:,} "
        f"calls in flight {stats.dispatcher.in_flight:,}/{stats.dispatcher.window:,} queued {stats.dispatcher.queued:,} "
        f"memory {stats.memory.allocated / GB:,.1f}/{stats.memory.total / GB:,.1f} GB frag {frag:.0%}{attained}"
    )


async def live_view(
    scheduler: Scheduler, total: int, console: Console, *, tracker: SlaTracker | None = None, interval_s: float = 0.25
) -> None:
    """Show progress until cancelled: a live dashboard on a terminal, else (a dumb one too) a
    line every 2 s. On a dumb terminal (TERM=dumb: an editor's shell) rich's live view draws
    nothing, to not write the codes that move the cursor: the run showed no progress at all."""
    if console.is_terminal and not console.is_dumb_terminal:
        with Live(_Fitted(_view(scheduler, total, tracker)), console=console, refresh_per_second=8, transient=True) as live:
            while True:
                await anyio.sleep(interval_s)
                live.update(_Fitted(_view(scheduler, total, tracker)))
    while True:
        await anyio.sleep(2.0)
        console.print(_line(scheduler, total, tracker), highlight=False, markup=False)
