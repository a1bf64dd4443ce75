"""The live view of a run: a rich dashboard on a terminal, plain log lines otherwise."""

from __future__ import annotations

import math
from typing import Any

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .scheduler import Scheduler

GB = 10**9


def _view(scheduler: Scheduler, total: int) -> Any:
    stats = scheduler.statistics()
    finished = sum(stats.finished.values())
    table = Table(expand=False)
    for column in ("tenant", "tier", "queued", "running", "done", "failed"):
        table.add_column(column, justify="left" if column in ("tenant", "tier") else "right")
    done_by: dict[str, int] = {}
    failed_by: dict[str, int] = {}
    for record in scheduler.recorder.sessions:
        bucket = done_by if record.state == "done" else failed_by
        bucket[record.tenant] = bucket.get(record.tenant, 0) + 1
    for name, tenant in scheduler.settings.tenants.items():
        queued = sum(n for (t, _), n in stats.queued.items() if t == name)
        running = sum(n for (t, _), n in stats.running.items() if t == name)
        table.add_row(name, str(tenant.tier), str(queued), str(running), str(done_by.get(name, 0)), str(failed_by.get(name, 0)))
    memory = stats.memory
    d = stats.dispatcher
    summary = Text(
        f"sessions {finished}/{total}   slots {stats.slots_in_use}/{stats.slots_total}   "
        f"memory {memory.allocated / GB:,.1f}/{memory.total / GB:,.1f} GB (frag {memory.fragmentation:.0%})   "
        f"calls in flight {d.in_flight}/{d.window}, queued {d.queued}"
    )
    return Group(ProgressBar(total=max(total, 1), completed=finished, width=60), summary, table)


async def live_view(scheduler: Scheduler, total: int, console: Console, *, interval_s: float = 0.25) -> None:
    """Show progress until cancelled: a live dashboard on a terminal, else a line every 2 s."""
    if console.is_terminal:
        with Live(_view(scheduler, total), console=console, refresh_per_second=8, transient=True) as live:
            while True:
                await anyio.sleep(interval_s)
                live.update(_view(scheduler, total))
    while True:
        await anyio.sleep(2.0)
        stats = scheduler.statistics()
        finished = sum(stats.finished.values())
        pct = 100 * finished / total if total else math.nan
        console.print(
            f"[{pct:5.1f}%] finished {finished}/{total} queued {stats.queued_total} running {stats.running_total} "
            f"calls in flight {stats.dispatcher.in_flight}",
            highlight=False,
        )
