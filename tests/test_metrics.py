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
    "fleetsched_memory_usable_bytes": ("gauge", {"device"}),
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


def collected(records, tenants=None) -> dict:
    """The collector's families after `records` (CallRecords) were recorded: {name: {labels: value}}."""
    from fleetsched.observability.metrics import SchedulerCollector
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.scheduler import Scheduler
    from fleetsched.settings import Settings

    async def main() -> dict:
        settings = Settings(backend={"kind": "instant"}, tenants=tenants or {"t": {}})
        async with Scheduler(settings) as scheduler:
            for record in records:
                scheduler.recorder.add_call(record)
            collector = SchedulerCollector(scheduler, SlaTracker(settings.tenants))
            return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples} for f in collector.collect()}

    return anyio.run(main)


def test_a_time_exactly_on_a_bucket_bound_counts_in_that_bucket():
    """Histogram buckets are "less than or equal": a TTFT of exactly 0.5 s is in le="0.5"."""
    from fleetsched.scheduler import CallRecord

    ttft = collected([CallRecord("t", 1, 0, 0.0, 0.0, 0.5, 1.0)])["fleetsched_ttft_seconds"]
    labels = (("le", "0.5"), ("tenant", "t"), ("tier", "standard"))
    assert ttft[("fleetsched_ttft_seconds_bucket", labels)] == 1


def test_histograms_hold_successful_calls_and_ttft_only_calls_with_a_first_token():
    """A failed call is in no histogram; a call without a first token only in the latency one."""
    import math

    from fleetsched.scheduler import CallRecord

    families = collected(
        [CallRecord("t", 1, 0, 0.0, 0.0, math.nan, 2.0), CallRecord("t", 1, 0, 0.0, 0.0, 0.5, 3.0, error="BackendUnavailable")]
    )
    key = (("tenant", "t"), ("tier", "standard"))
    assert families["fleetsched_ttft_seconds"] == {}
    assert families["fleetsched_call_latency_seconds"][("fleetsched_call_latency_seconds_count", key)] == 1
    assert families["fleetsched_call_latency_seconds"][("fleetsched_call_latency_seconds_sum", key)] == 2.0


def test_token_counters_count_prompt_and_completion_tokens_apart():
    """fleetsched_prompt_tokens_total and fleetsched_completion_tokens_total each count their own tokens."""
    from fleetsched.scheduler import CallRecord

    families = collected([CallRecord("t", 1, 0, 0.0, 0.0, 0.5, 1.0, prompt_tokens=7, completion_tokens=3)])
    assert families["fleetsched_prompt_tokens"][("fleetsched_prompt_tokens_total", (("tenant", "t"),))] == 7
    assert families["fleetsched_completion_tokens"][("fleetsched_completion_tokens_total", (("tenant", "t"),))] == 3


def test_the_admission_queue_depth_sums_the_tenants_of_a_tier():
    """Two tenants' sessions queued in one tier read a depth of 2 for that tier."""
    from fleetsched.observability.metrics import SchedulerCollector
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.scheduler import Scheduler
    from fleetsched.settings import Settings
    from fleetsched.virtual_time import run_virtual

    async def agent(ctx) -> None:
        await anyio.sleep(10)

    async def main() -> float:
        settings = Settings(backend={"kind": "instant"}, scheduler={"max_sessions": 1}, tenants={"a": {}, "b": {}, "c": {}})
        async with Scheduler(settings) as scheduler:
            for tenant in ("a", "b", "c"):
                await scheduler.submit(agent, tenant=tenant)
            await anyio.sleep(1)
            collector = SchedulerCollector(scheduler, SlaTracker(settings.tenants))
            depth = next(f for f in collector.collect() if f.name == "fleetsched_queue_depth")
            return next(s.value for s in depth.samples if s.labels == {"queue": "admission", "tier": "standard"})

    assert run_virtual(main) == 2


def test_a_limited_device_s_usable_memory_is_its_own_gauge():
    """A device limited to 30 GB of its 80 (a replica restarted with a smaller KV cache) read 80
    GB free, all of it "largest free", which the pool would not grant: its usable memory is now
    a gauge of its own, beside free memory as the device has it."""
    from fleetsched.observability.metrics import SchedulerCollector
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.scheduler import Scheduler
    from fleetsched.settings import Settings

    async def main() -> dict:
        settings = Settings(backend={"kind": "instant"}, tenants={"t": {}})
        async with Scheduler(settings) as scheduler:
            scheduler.pool.set_device_limit("gpu0", 30 * 10**9)
            collector = SchedulerCollector(scheduler, SlaTracker(settings.tenants))
            return {s.name: s.value for f in collector.collect() if f.name.startswith("fleetsched_memory") for s in f.samples}

    values = anyio.run(main)
    assert values["fleetsched_memory_usable_bytes"] == pytest.approx(30e9, rel=1e-3)  # whole pages
    assert values["fleetsched_memory_largest_free_bytes"] == pytest.approx(80e9, rel=1e-3)
