"""The live dashboard of `fleetsched run`, rendered as a 120-column terminal shows it."""

from __future__ import annotations

from pathlib import Path

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
