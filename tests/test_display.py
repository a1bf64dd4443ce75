"""The live dashboard of `fleetsched run`, rendered as 80- and 120-column terminals show it."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from rich.console import Console

from fleetsched import Scheduler
from fleetsched.display import _view
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
    assert len(rows) == 3, lines  # one line a tenant
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
