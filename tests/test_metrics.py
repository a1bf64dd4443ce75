"""Prometheus metrics scraped from a running ``fleetsched run --metrics-port`` (a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[backend]
kind = "sim"
max_in_flight = 4
[backend.sim]
max_num_seqs = 4
[scheduler]
max_sessions = 6
[resources]
devices = [{ name = "gpu0", memory = "40GB" }, { name = "gpu1", memory = "40GB" }]
[tenants.pager]
tier = "critical"
sla = { ttft_p99_s = 0.5, latency_p95_s = 2.0 }
[tenants.warehouse]
tier = "batch"
requests_per_minute = 6
sla = { ttft_p99_s = 5.0, min_tokens_per_s = 1 }
[[workload.agents]]
tenant = "pager"
count = 8
turns = 2
prompt_tokens = 64
max_tokens = 16
tool_s = 1.5
[[workload.agents]]
tenant = "warehouse"
count = 8
turns = 2
prompt_tokens = 64
max_tokens = 16
tool_s = 1.5
"""

EXPECTED = {
    # name (as the parser names the family): (type, label names)
    "fleetsched_queue_depth": ("gauge", {"queue", "tier"}),
    "fleetsched_sessions": ("gauge", {"tenant", "state"}),
    "fleetsched_sessions_finished": ("counter", {"tenant", "state"}),
    "fleetsched_calls_in_flight": ("gauge", {"backend"}),
    "fleetsched_in_flight_window": ("gauge", {"backend"}),
    "fleetsched_calls": ("counter", {"tenant", "tier", "outcome"}),
    "fleetsched_calls_refused": ("counter", {"tenant", "reason"}),
    "fleetsched_ttft_seconds": ("histogram", {"tenant", "tier"}),
    "fleetsched_call_latency_seconds": ("histogram", {"tenant", "tier"}),
    "fleetsched_prompt_tokens": ("counter", {"tenant"}),
    "fleetsched_completion_tokens": ("counter", {"tenant"}),
    "fleetsched_memory_total_bytes": ("gauge", {"device"}),
    "fleetsched_memory_allocated_bytes": ("gauge", {"device"}),
    "fleetsched_memory_largest_free_bytes": ("gauge", {"device"}),
    "fleetsched_memory_fragmentation_ratio": ("gauge", {"device"}),
    "fleetsched_memory_fragmentation_failures": ("counter", set()),
    "fleetsched_sla_target": ("gauge", {"tenant", "objective"}),
    "fleetsched_sla_attainment_ratio": ("gauge", {"tenant", "objective"}),
    "fleetsched_sla_breaches": ("counter", {"tenant", "objective", "reason"}),
}


def scrape(url: str) -> dict:
    text = httpx.get(url, timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_scraped_from_a_running_fleetsched_run(tmp_path):
    config = tmp_path / "metrics.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live", "--metrics-port", "0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 60  # wall-clock ok: a real subprocess
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "metrics on " in line:
                url = line.split("metrics on ", 1)[1].strip()
        assert url, "fleetsched run did not announce its metrics address"
        time.sleep(1.0)  # wall-clock ok: let the first turns finish (tools take 1.5 s)
        families = scrape(url)
        for name, (kind, labels) in EXPECTED.items():
            assert name in families, f"missing {name}"
            family = families[name]
            assert family.type == kind, (name, family.type)
            for sample in family.samples:
                assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
        # the raw text follows the conventions: counters end in _total, seconds and bytes in base units
        text = httpx.get(url, timeout=5).text
        assert "fleetsched_calls_total{" in text and "# TYPE fleetsched_sla_breaches_total counter" in text
        assert 'fleetsched_ttft_seconds_bucket{le="+Inf",tenant="pager",tier="critical"}' in text
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        assert values[("fleetsched_memory_total_bytes", (("device", "gpu1"),))] == pytest.approx(40e9, rel=1e-3)  # whole pages
        assert values[("fleetsched_sla_target", (("objective", "ttft_p99"), ("tenant", "pager")))] == 0.5
        assert values[("fleetsched_in_flight_window", (("backend", "sim"),))] >= 1
        assert sum(v for (n, _), v in values.items() if n == "fleetsched_calls_total") > 0
        assert httpx.get(url.replace("/metrics", "/nope"), timeout=5).status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_calls_cancelled_with_their_session_have_their_own_outcome():
    """A call cut by its session's cancellation (at the drain deadline, say) is no error: before,
    it counted as outcome="error", so an error-rate alert fired on a normal shutdown."""
    from fleetsched.observability.metrics import SchedulerCollector
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.scheduler import CallRecord, Scheduler
    from fleetsched.settings import Settings

    async def main() -> dict[str, float]:
        settings = Settings(backend={"kind": "instant"}, tenants={"t": {}})
        async with Scheduler(settings) as scheduler:
            for error in (None, "CancelledError", "Cancelled", "ContextTooLong"):
                scheduler.recorder.add_call(CallRecord("t", 1, 0, 0.0, error=error))
            collector = SchedulerCollector(scheduler, SlaTracker(settings.tenants))
            calls = next(f for f in collector.collect() if f.name == "fleetsched_calls")
            return {s.labels["outcome"]: s.value for s in calls.samples if s.name.endswith("_total")}

    assert anyio.run(main) == {"ok": 1, "cancelled": 2, "error": 1}
