"""Prometheus metrics of a running scheduler, read at scrape time.

`SchedulerCollector` is a `prometheus_client` custom collector: a scrape reads
`Scheduler.statistics()` and the records added since the previous scrape (histograms and
counters are folded in then), so the dispatcher's hot path pays nothing for metrics.
`serve_metrics` answers ``GET /metrics`` on the event loop itself (no thread reads the
scheduler while the loop changes it). Names and labels:

==============================================  =======  ==================================
name                                            type     labels
==============================================  =======  ==================================
fleetsched_queue_depth                          gauge    queue (admission, dispatch), tier
fleetsched_sessions                             gauge    tenant, state (queued, running, parked)
fleetsched_sessions_finished_total              counter  tenant, state (done, failed, cancelled, rejected)
fleetsched_calls_in_flight                      gauge    backend
fleetsched_in_flight_window                     gauge    backend
fleetsched_calls_total                          counter  tenant, tier, outcome (ok, error, cancelled)
fleetsched_calls_refused_total                  counter  tenant, reason (shed, rate-limited)
fleetsched_ttft_seconds                         histo    tenant, tier
fleetsched_call_latency_seconds                 histo    tenant, tier
fleetsched_prompt_tokens_total                  counter  tenant
fleetsched_completion_tokens_total              counter  tenant
fleetsched_memory_total_bytes                   gauge    device
fleetsched_memory_allocated_bytes               gauge    device
fleetsched_memory_largest_free_bytes            gauge    device
fleetsched_memory_usable_bytes                  gauge    device
fleetsched_memory_fragmentation_ratio           gauge    device
fleetsched_memory_fragmentation_failures_total  counter  (none)
fleetsched_sla_target                           gauge    tenant, objective (seconds; tokens/s)
fleetsched_sla_attainment_ratio                 gauge    tenant, objective (rolling window)
fleetsched_sla_breaches_total                   counter  tenant, objective, reason
==============================================  =======  ==================================
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..policies.tiers import Tier
from ..scheduler import Scheduler
from .sla import CANCELLED, SlaTracker

#: Histogram upper bounds in seconds (TTFT and call latency alike).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


class SchedulerCollector(Collector):
    """Metrics of `scheduler` (and of `tracker`'s rolling SLA attainment) at each scrape."""

    def __init__(self, scheduler: Scheduler, tracker: SlaTracker) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self._cursors = [0, 0]  # calls, sessions
        self._ttft: dict[tuple[str, str], _Histogram] = {}
        self._latency: dict[tuple[str, str], _Histogram] = {}
        self._calls: dict[tuple[str, str, str], int] = {}
        self._tokens: dict[str, list[int]] = {}
        self._finished: dict[tuple[str, str], int] = {}

    def _fold(self) -> None:
        """Fold the records added since the last scrape into histograms and counters."""
        recorder = self.scheduler.recorder
        calls = recorder.calls
        for call in calls[self._cursors[0] :]:
            key = (call.tenant, str(Tier(call.tier)))
            # cancelled: cut with its session (at the drain deadline, say), not an error of the call
            outcome = "ok" if call.error is None else "cancelled" if call.error in CANCELLED else "error"
            self._calls[(*key, outcome)] = self._calls.get((*key, outcome), 0) + 1
            tokens = self._tokens.setdefault(call.tenant, [0, 0])
            tokens[0] += call.prompt_tokens
            tokens[1] += call.completion_tokens
            if call.error is None:
                if not math.isnan(call.first_token):
                    self._ttft.setdefault(key, _Histogram()).observe(call.ttft_s)
                self._latency.setdefault(key, _Histogram()).observe(call.latency_s)
        self._cursors[0] = len(calls)
        sessions = recorder.sessions
        for session in sessions[self._cursors[1] :]:
            key2 = (session.tenant, session.state)
            self._finished[key2] = self._finished.get(key2, 0) + 1
        self._cursors[1] = len(sessions)
        self.tracker.update(recorder, anyio.current_time())

    def collect(self) -> Iterator[Any]:
        self._fold()
        scheduler = self.scheduler
        stats = scheduler.statistics()
        tenants = list(scheduler.settings.tenants)
        backend = scheduler.backend.name

        depth = GaugeMetricFamily("fleetsched_queue_depth", "Sessions waiting for admission and calls waiting for the in-flight window, per tier.", labels=["queue", "tier"])
        admission = {str(t): 0 for t in Tier}
        for (_, tier), n in stats.queued.items():
            admission[tier] += n
        for tier in Tier:
            depth.add_metric(["admission", str(tier)], admission[str(tier)])
            depth.add_metric(["dispatch", str(tier)], stats.dispatcher.queued_by_tier.get(int(tier), 0))
        yield depth

        sessions = GaugeMetricFamily("fleetsched_sessions", "Live sessions per tenant and state.", labels=["tenant", "state"])
        counts = {(t, s): 0 for t in tenants for s in ("queued", "running", "parked")}
        for (tenant, _), n in stats.queued.items():
            counts[(tenant, "queued")] = counts.get((tenant, "queued"), 0) + n
        for (tenant, _), n in stats.running.items():
            counts[(tenant, "running")] = counts.get((tenant, "running"), 0) + n
        for handle in scheduler.running_sessions():
            if handle.parked:
                counts[(handle.tenant, "parked")] = counts.get((handle.tenant, "parked"), 0) + 1
        for (tenant, state), n in counts.items():
            sessions.add_metric([tenant, state], n)
        yield sessions

        finished = CounterMetricFamily("fleetsched_sessions_finished", "Sessions that ended, per tenant and final state.", labels=["tenant", "state"])
        for (tenant, state), n in sorted(self._finished.items()):
            finished.add_metric([tenant, state], n)
        yield finished

        d = stats.dispatcher
        yield _gauge("fleetsched_calls_in_flight", "Model calls at the backend now.", ["backend"], [([backend], d.in_flight)])
        yield _gauge("fleetsched_in_flight_window", "The dispatcher's in-flight window (calls at the backend at most).", ["backend"], [([backend], d.window)])

        calls = CounterMetricFamily("fleetsched_calls", "Model calls that went through to the backend, by outcome.", labels=["tenant", "tier", "outcome"])
        for key, n in sorted(self._calls.items()):
            calls.add_metric(list(key), n)
        yield calls
        refused = CounterMetricFamily("fleetsched_calls_refused", "Model calls refused before the backend: shed (Overloaded) or rate-limited.", labels=["tenant", "reason"])
        for tenant in tenants:
            for reason in ("shed", "rate-limited"):
                refused.add_metric([tenant, reason], d.refused_by.get((tenant, reason), 0))
        yield refused

        for name, text, hists in (
            ("fleetsched_ttft_seconds", "Time to first token of successful calls, from submission to the dispatcher.", self._ttft),
            ("fleetsched_call_latency_seconds", "Whole latency of successful calls, from submission to the dispatcher.", self._latency),
        ):
            family = HistogramMetricFamily(name, text, labels=["tenant", "tier"])
            for key, hist in sorted(hists.items()):
                family.add_metric(list(key), hist.buckets(), hist.sum)
            yield family

        prompt = CounterMetricFamily("fleetsched_prompt_tokens", "Prompt tokens of finished calls, per tenant.", labels=["tenant"])
        completion = CounterMetricFamily("fleetsched_completion_tokens", "Generated tokens of finished calls, per tenant.", labels=["tenant"])
        for tenant in tenants:
            p, c = self._tokens.get(tenant, (0, 0))
            prompt.add_metric([tenant], p)
            completion.add_metric([tenant], c)
        yield prompt
        yield completion

        devices = stats.memory.devices
        yield _gauge("fleetsched_memory_total_bytes", "Memory each device offers to sessions.", ["device"], [([x.name], x.total) for x in devices])
        yield _gauge("fleetsched_memory_allocated_bytes", "Memory reserved by sessions, per device.", ["device"], [([x.name], x.allocated) for x in devices])
        yield _gauge("fleetsched_memory_largest_free_bytes", "Largest contiguous free extent, per device.", ["device"], [([x.name], x.largest_free) for x in devices])
        yield _gauge(
            "fleetsched_memory_usable_bytes",
            "Free memory each device's limit lets sessions take (less than free on a replica restarted with a smaller KV cache).",
            ["device"],
            [([x.name], x.usable) for x in devices],
        )
        yield _gauge(
            "fleetsched_memory_fragmentation_ratio",
            "Fragmentation, (free - largest free) / free, per device.",
            ["device"],
            [([x.name], x.fragmentation) for x in devices],
        )
        yield CounterMetricFamily(
            "fleetsched_memory_fragmentation_failures",
            "Requests refused although some device had that much free in total.",
            value=stats.memory.fragmentation_failures,
        )

        tracker = self.tracker
        target = GaugeMetricFamily("fleetsched_sla_target", "Each tenant's SLA objectives (seconds; tokens per second for min_tokens_per_s).", labels=["tenant", "objective"])
        attainment = GaugeMetricFamily(
            "fleetsched_sla_attainment_ratio",
            f"Share of the last {tracker.window_s:g} s of events that met the tenant's objective (NaN: no events).",
            labels=["tenant", "objective"],
        )
        for tenant, goals in tracker.goals.items():
            for objective, value in goals.items():
                target.add_metric([tenant, objective], value)
                ratio = tracker.attainment(tenant, objective)
                attainment.add_metric([tenant, objective], math.nan if ratio is None else ratio)
        yield target
        yield attainment
        breaches = CounterMetricFamily("fleetsched_sla_breaches", "Events that missed their SLA objective, by reason.", labels=["tenant", "objective", "reason"])
        for key, n in sorted(tracker.breaches.items()):
            breaches.add_metric(list(key), n)
        yield breaches


def _gauge(name: str, text: str, labels: list[str], values: Sequence[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def registry_for(scheduler: Scheduler, tracker: SlaTracker) -> CollectorRegistry:
    """A fresh registry holding only the scheduler's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(scheduler, tracker))
    return registry


async def _handle(stream: SocketStream, registry: CollectorRegistry) -> None:
    async with stream:
        request = b""
        with anyio.move_on_after(5):
            while b"\r\n\r\n" not in request and len(request) < 16384:
                try:
                    request += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
        line = request.split(b"\r\n", 1)[0].split()
        path = line[1].split(b"?")[0] if len(line) > 1 else b""
        if path in (b"/metrics", b"/"):
            status, body, kind = b"200 OK", generate_latest(registry), b"text/plain; version=0.0.4; charset=utf-8"
        else:
            status, body, kind = b"404 Not Found", b"see /metrics\n", b"text/plain"
        head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (status, kind, len(body))
        try:
            await stream.send(head + body)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` from `registry` until cancelled. Start it with ``await tg.start(...)``:
    the started value is the port listened on (useful with `port` 0)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        bound = listener.extra(SocketAttribute.local_port)
        task_status.started(bound)
        await listener.serve(lambda stream: _handle(stream, registry))
