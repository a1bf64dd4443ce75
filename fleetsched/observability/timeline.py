"""The run over time: a sampler task that records queue depths, throughput, memory and SLA attainment.

``async with anyio.create_task_group() as tg: tg.start_soon(sampler.run)`` samples every
`interval_s` on the scheduler's clock until cancelled; `Timeline.as_dict()` is the report's
``timeline`` section. Each sample reads `Scheduler.statistics()` and the records added since the
previous one, nothing on the call path.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import anyio

from ..policies.tiers import Tier
from ..scheduler import Scheduler
from .sla import SlaTracker

TIERS = [str(t) for t in Tier]
_COMPLETION_TOKENS = attrgetter("completion_tokens")


class Timeline:
    """Samples of one run; `sample()` takes one, `run()` takes one every `interval_s`."""

    def __init__(self, scheduler: Scheduler, tracker: SlaTracker, *, interval_s: float = 1.0, max_samples: int = 2000) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.start = anyio.current_time()
        self._tokens = 0
        self._cursor = 0
        devices = [d.name for d in scheduler.pool.devices]
        tenants = list(scheduler.settings.tenants)
        self.series: dict[str, Any] = {
            "t": [],
            "completion_tokens": [],
            "queued_sessions": {t: [] for t in TIERS},
            "queued_calls": {t: [] for t in TIERS},
            "running_sessions": [],
            "in_flight": [],
            "window": [],
            "memory_allocated_bytes": {d: [] for d in devices},
            "fragmentation": {d: [] for d in devices},
            "attainment": {t: [] for t in tenants},
        }

    def sample(self) -> None:
        now = anyio.current_time()
        recorder = self.scheduler.recorder
        calls = recorder.calls
        self._tokens += sum(map(_COMPLETION_TOKENS, calls[self._cursor :]))  # a C loop: every call passes here
        self._cursor = len(calls)
        self.tracker.update(recorder, now)
        stats = self.scheduler.statistics()
        s = self.series
        at = round(now - self.start, 4)
        if s["t"] and s["t"][-1] == at:  # the last sample, taken on a tick at the run's end: this one replaces it
            _drop_last(s)
        s["t"].append(at)
        s["completion_tokens"].append(self._tokens)
        queued = {t: 0 for t in TIERS}
        for (_, tier), n in stats.queued.items():
            queued[tier] += n
        for tier in TIERS:
            s["queued_sessions"][tier].append(queued[tier])
        by_tier = stats.dispatcher.queued_by_tier
        for tier in Tier:
            s["queued_calls"][str(tier)].append(by_tier.get(int(tier), 0))
        s["running_sessions"].append(stats.running_total)
        s["in_flight"].append(stats.dispatcher.in_flight)
        s["window"].append(stats.dispatcher.window)
        for d in stats.memory.devices:
            s["memory_allocated_bytes"][d.name].append(d.allocated)
            s["fragmentation"][d.name].append(round(d.fragmentation, 4))
        for tenant in s["attainment"]:
            value = self.tracker.tenant_attainment(tenant)
            s["attainment"][tenant].append(None if value is None else round(value, 4))
        if len(s["t"]) >= self.max_samples and len(s["t"]) % 2:
            self._halve()

    def _halve(self) -> None:
        """Keep every other sample and sample half as often: long runs stay a bounded size
        (`max_samples` + 1 at most). Halved at an odd count, the first and the last sample stay,
        so the next comes on the same grid: halved at an even one, the sample just taken went,
        and the next came an interval and a half after the last kept."""

        def thin(value: Any) -> Any:
            return {k: thin(v) for k, v in value.items()} if isinstance(value, dict) else value[::2]

        self.series = thin(self.series)
        self.interval_s *= 2

    async def run(self) -> None:
        """Sample every `interval_s` until cancelled (take a last `sample()` after cancelling)."""
        while True:
            self.sample()
            await anyio.sleep(self.interval_s)

    def as_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "window_s": self.tracker.window_s, **self.series}


def _drop_last(series: dict[str, Any]) -> None:
    for value in series.values():
        if isinstance(value, dict):
            _drop_last(value)
        else:
            value.pop()
