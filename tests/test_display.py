"""The live dashboard of `fleetsched run`, rendered as 80- and 120-column terminals show it."""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path

import anyio
import pytest
from rich.console import Console

from fleetsched import Scheduler
from fleetsched.display import _view, live_view
from fleetsched.observability.sla import SlaTracker
from fleetsched.settings import load_settings

pytestmark = pytest.mark.anyio
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.toml"


async def test_the_dashboard_fits_120_columns_and_keeps_its_summary_whole():
    """The progress bar ended no line: the summary's first line ran on after it, and a
    120-column terminal cut it off before the count of calls queued."""
    async with Scheduler(load_settings(QUICKSTART)) as scheduler:
        console = Console(width=120, record=True, color_system=None, force_terminal=True)
        console.print(_view(scheduler, 210))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 120 for line in lines), lines
    assert "0 % of sessions ended" in lines[0]
    assert lines[1].startswith("sessions 0/210") and lines[1].rstrip().endswith("queued 0"), lines[:3]


async def test_the_dashboard_keeps_a_tenant_on_one_line_and_long_names_apart(tmp_path):
    """Squeezed into 80 columns, the names were cut at their ends: two tenants read
    'custom…' alike. They are cut as the final tables cut them, where they differ."""
    names = {"support-bot": "customer-support-bot-production-eu", "research": "customer-support-bot-production-us"}
    text = QUICKSTART.read_text()
    for old, new in names.items():
        text = text.replace(old, new)
    config = tmp_path / "long.toml"
    config.write_text(text)
    async with Scheduler(load_settings(config)) as scheduler:
        console = Console(width=80, record=True, color_system=None, force_terminal=True)
        console.print(_view(scheduler, 210))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    rows = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert len(rows) == 6, lines  # one line a tenant, in each of the table's two parts
    assert rows[0] != rows[1] and rows[0].endswith("eu") and rows[1].endswith("us"), rows


async def test_the_dashboard_counts_cancelled_sessions_apart_from_failed():
    """A cancelled session was counted in the dashboard's "failed" column, while the final
    tenant table and the report show it apart, under "cancelled"."""

    async def agent(ctx):
        await anyio.sleep_forever()

    async def failing(ctx):
        raise RuntimeError("boom")

    async with Scheduler(load_settings(QUICKSTART)) as scheduler:
        cancelled = await scheduler.submit(agent, tenant="research")
        failed = await scheduler.submit(failing, tenant="research")
        await anyio.sleep(0.1)
        cancelled.cancel()
        await cancelled.ended()
        await failed.ended()
        console = Console(width=120, record=True, color_system=None, force_terminal=True)
        console.print(_view(scheduler, 2))
    lines = console.export_text().splitlines()
    header = [cell.strip() for cell in next(line for line in lines if "tenant" in line).split("┃")[1:-1]]
    research = [cell.strip() for cell in next(line for line in lines if "research" in line).split("│")[1:-1]]
    row = dict(zip(header, research))
    assert row["failed"] == "1" and row["cancelled"] == "1", row


async def test_the_dashboard_shows_its_headings_tiers_and_names_whole_in_80_columns():
    """Squeezed into 80 columns, the table read "tena…", "queu…", "crit…" and "su…ot". Where it
    does not fit whole it is shown in two parts, as the final tenant table is."""
    settings = load_settings(QUICKSTART)
    async with Scheduler(settings) as scheduler:
        console = Console(width=80, record=True, color_system=None, force_terminal=True)
        console.print(_view(scheduler, 210, SlaTracker(settings.tenants, window_s=60)))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text, text
    for word in ("queued", "running", "cancelled", "SLA (60 s)", "breaches", "refused", "critical", "support-bot"):
        assert word in text, (word, text)


class _Terminal:
    """Just enough of a terminal to replay what the live view writes: text that wraps past the
    last column, carriage return, line feed (to the next line's start, as a tty's output
    processing makes it), cursor up (no higher than the screen's top) and
    erase line; the lines scrolled off the screen are kept, as a terminal keeps them."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.lines, self.row, self.col = [""], 0, 0

    def feed(self, data: str) -> None:
        for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", data):
            if token == "\r":
                self.col = 0
            elif token == "\n":
                self.col = 0
                self._down()
            elif token == "\x1b[1A":
                self.row = max(self.row - 1, len(self.lines) - self.height, 0)
            elif token == "\x1b[2K":
                self.lines[self.row] = ""
            elif not token.startswith("\x1b"):
                if self.col == self.width:  # the wrap a character past the last column makes
                    self.col = 0
                    self._down()
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[: self.col] + token + line[self.col + 1 :]
                self.col += 1

    def _down(self) -> None:
        self.row += 1
        if self.row == len(self.lines):
            self.lines.append("")


class _Writes(io.StringIO):
    """A terminal's stdout that keeps each write apart (rich writes a drawing in one)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)


async def _replayed(width: int, height: int, interrupt: bool) -> list[str]:
    """The lines a `width` x `height` terminal holds, scrolled off ones too, once the live view
    has drawn the quickstart's dashboard and stopped; with `interrupt`, the terminal echoed
    Ctrl-C ("^C") at its cursor just before the view stopped."""
    settings = load_settings(QUICKSTART)
    out = _Writes()
    console = Console(file=out, width=width, height=height, color_system=None, force_terminal=True)
    async with Scheduler(settings) as scheduler:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(live_view, scheduler, 210, console, tracker=SlaTracker(settings.tenants), interval_s=0.01))
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    terminal = _Terminal(width, height)
    for text in out.writes[:-1]:
        terminal.feed(text)
    if interrupt:
        terminal.feed("^C")
    terminal.feed(out.writes[-1])  # the last drawing and its erasure, as the view stops
    return terminal.lines


async def test_the_live_view_taller_than_the_terminal_leaves_nothing_behind():
    """As it stopped, rich drew the whole dashboard (15 lines) on a 10-line terminal and erased
    only what the screen held: its first 5 lines were left above the final tables."""
    lines = await _replayed(80, 10, interrupt=False)
    assert not "".join(lines).strip(), lines


async def test_the_live_view_stopped_by_ctrl_c_leaves_nothing_behind():
    """Where the dashboard's last line took the terminal's whole width (a table squeezed into it),
    the terminal's echo of Ctrl-C began a new line, and the view, erased one line short, left
    its progress bar above "fleetsched: interrupted"."""
    lines = await _replayed(40, 60, interrupt=True)
    assert not "".join(line.replace("^C", "") for line in lines).strip(), lines


async def test_a_dumb_terminal_gets_the_progress_lines():
    """On TERM=dumb the run showed no progress at all: rich's live view draws nothing there."""
    settings = load_settings(QUICKSTART)
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, _environ={"TERM": "dumb"})
    async with Scheduler(settings) as scheduler:
        with anyio.move_on_after(2.5):  # the first line comes after 2 s
            await live_view(scheduler, 210, console)
    assert "finished 0/210" in out.getvalue() and "\x1b" not in out.getvalue(), repr(out.getvalue())


async def test_the_dashboard_shows_a_device_s_limit():
    """A device limited to 30 GB of its 80 read "0.0/80.0 GB", room the pool would not grant."""
    async with Scheduler(load_settings(QUICKSTART)) as scheduler:
        name = scheduler.pool.devices[0].name
        scheduler.pool.set_device_limit(name, 30 * 10**9)
        console = Console(width=200, record=True, color_system=None, force_terminal=True)
        console.print(_view(scheduler, 2))
    assert re.search(rf"{name} 0\.0/\d+\.\d GB \(limited to 30\.0\) frag", console.export_text())
