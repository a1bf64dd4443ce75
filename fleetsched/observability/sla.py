"""SLA accounting: per-tenant attainment of `SlaSettings` objectives, and breaches with a reason.

Pure and synchronous: everything here reads `CallRecord` / `SessionRecord` values and takes the
time as an argument, so tests check it against hand-computed figures without an event loop.

Objectives and what counts (see `SlaSettings`):

- ``ttft_p99``: every call of the tenant is an event, met when it succeeded with a TTFT within
  the target. The objective is met when at least 99 % of events are.
- ``latency_p95``: the same with the whole call latency, 95 %.
- ``deadline``: every session that ended done or failed is an event, met when it ended done
  within the deadline (from submission). Met when every session is.
- ``min_tokens_per_s``: one event for the rate, generated tokens (of calls that succeeded or were
  cancelled) over the time the tenant had a call outstanding (it was backlogged), met when at
  least the target; and one missed event per refused or failed call: the tenant asked for
  service and got none (before, a tenant refused 228 of its 231 calls read met at 100 %, and one
  whose calls all failed at once, not measured). Met when every event is.

Refused calls are events that miss every call objective. Calls cancelled (their session ended
or was cancelled) are not call events: the session's deadline accounts for them.

A missed event is a `Breach` with a reason: ``shed`` or ``rate-limited`` (refused),
``failed`` (the call raised), ``queued`` (queued too long: the dispatcher queue time, started -
submitted, is at least half the value) or ``engine-slow`` (the rest). A session past its
deadline, or ended by it (``DeadlineExceeded``), is ``queued`` when its admission wait is at
least half its span, ``in-tools`` when its own tool calls are, else ``engine-slow``; one that
failed of something else within it is ``failed``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter

from ..scheduler.records import CANCELLED, CallRecord, CallTimes, Recorder, SessionRecord, rank_percentile
from ..settings import SlaSettings, TenantSettings

OBJECTIVES = ("ttft_p99", "admission_p99", "latency_p95", "admission_p95", "deadline", "min_tokens_per_s")
#: The share of events that must meet the target for the objective to be met.
QUANTILE = {"ttft_p99": 0.99, "admission_p99": 0.99, "latency_p95": 0.95, "admission_p95": 0.95, "deadline": 1.0, "min_tokens_per_s": 1.0}
#: The objectives of a session's wait for admission, each with the target of the call objective
#: named: a fleet larger than the scheduler admits met every call objective, its extra sessions
#: only waiting (the report said "0 breaches" where the warehouse's sessions waited 72.9 s at
#: p99 against its 20 s, and `simulate --find-max-sessions` called the fleet a miss).
ADMISSION = {"admission_p99": "ttft_p99", "admission_p95": "latency_p95"}
REASONS = ("queued", "engine-slow", "in-tools", "rate-limited", "shed", "failed")
REASON_TEXT = {
    "queued": "queued too long",
    "engine-slow": "engine slow",
    "in-tools": "in its tools",
    "rate-limited": "rate-limited",
    "shed": "shed",
    "failed": "call failed",
}
_REFUSED = {"Overloaded": "shed", "RateLimited": "rate-limited"}
_FINISHED = attrgetter("finished")
_FIRST = itemgetter(0)


def targets(sla: SlaSettings) -> dict[str, float]:
    """The objectives `sla` sets, by name (objectives left None are absent)."""
    values = {
        "ttft_p99": sla.ttft_p99_s,
        "admission_p99": sla.ttft_p99_s,
        "latency_p95": sla.latency_p95_s,
        "admission_p95": sla.latency_p95_s,
        "deadline": sla.deadline_s,
        "min_tokens_per_s": sla.min_tokens_per_s,
    }
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Breach:
    """One event that missed its objective."""

    at: float
    tenant: str
    tier: int
    objective: str
    value: float
    """What was measured (seconds; inf for a refused or failed call; tokens per second for
    ``min_tokens_per_s``, 0 for a refused or failed call)."""
    target: float
    reason: str


def _reason(wait_s: float, value_s: float) -> str:
    return "queued" if wait_s >= value_s / 2 else "engine-slow"


def call_events(call: CallRecord, goals: Mapping[str, float]) -> list[tuple[str, bool, Breach | None]]:
    """(objective, met, breach or None) for each call objective in `goals`; [] for a cancelled call.

    A refused or failed call is also a missed ``min_tokens_per_s`` event (a served call counts
    only in the rate, which `evaluate` and `SlaTracker` take over the backlogged time)."""
    if not goals or call.error in CANCELLED:
        return []
    events: list[tuple[str, bool, Breach | None]] = []
    rate = goals.get("min_tokens_per_s")
    if rate is not None and call.error is not None:
        reason = _REFUSED.get(call.error, "failed")
        events.append(("min_tokens_per_s", False, Breach(call.finished, call.tenant, call.tier, "min_tokens_per_s", 0.0, rate, reason)))
    for objective, value in (("ttft_p99", call.ttft_s), ("latency_p95", call.latency_s)):
        target = goals.get(objective)
        if target is None:
            continue
        if call.error is not None:
            reason = _REFUSED.get(call.error, "failed")
            events.append((objective, False, Breach(call.finished, call.tenant, call.tier, objective, math.inf, target, reason)))
        elif value <= target:
            events.append((objective, True, None))
        else:
            breach = Breach(call.finished, call.tenant, call.tier, objective, value, target, _reason(call.queue_s, value))
            events.append((objective, False, breach))
    return events


def admission_wait(session: SessionRecord) -> float | None:
    """How long `session` waited to be admitted (to its end, if it never was); None for one
    rejected at once (it could never run: no wait)."""
    if session.state == "rejected":
        return None
    return (session.finished if math.isnan(session.admitted) else session.admitted) - session.submitted


def admission_events(session: SessionRecord, goals: Mapping[str, float]) -> list[tuple[str, bool, Breach | None]]:
    """(objective, met, breach or None) for each admission objective in `goals` (`ADMISSION`),
    from the session's record, at its end (the whole run's `evaluate`)."""
    wait = admission_wait(session)
    if wait is None:
        return []
    at = session.finished if math.isnan(session.admitted) else session.admitted
    return _admission_events(session.tenant, session.tier, wait, at, goals)


def _admission_events(tenant: str, tier: int, wait: float, at: float, goals: Mapping[str, float]) -> list[tuple[str, bool, Breach | None]]:
    events: list[tuple[str, bool, Breach | None]] = []
    for objective in ADMISSION:
        target = goals.get(objective)
        if target is None:
            continue
        breach = None if wait <= target else Breach(at, tenant, tier, objective, wait, target, "queued")
        events.append((objective, breach is None, breach))
    return events


def session_event(session: SessionRecord, goals: Mapping[str, float]) -> tuple[bool, Breach | None] | None:
    """(met, breach or None) for the deadline objective; None when it does not apply."""
    target = goals.get("deadline")
    if target is None or session.state not in ("done", "failed"):
        return None
    span = session.finished - session.submitted
    if session.state == "done" and span <= target:
        return True, None
    # Failed before its deadline: its failure, not its wait or the engine, missed the objective.
    # One failed by the deadline itself ends at it (later on a real clock; on virtual time its
    # span reads 1.9999999999999998 as often as 2.0): its error says so, and the split below
    # tells why it ran out. A record without an error (hand-made) falls back on its span.
    if span < target and not session.deadline_exceeded:
        return False, Breach(session.finished, session.tenant, session.tier, "deadline", span, target, "failed")
    # Its waits in the queue: for admission, and to come back after tools that released its slot.
    wait = session.admitted - session.submitted + session.readmit_wait_s if session.admitted == session.admitted else span
    # Its own tools' time is neither the engine's nor the queue's (it was blamed on the engine).
    reason = "in-tools" if wait < span / 2 <= session.tool_s else _reason(wait, span)
    return False, Breach(session.finished, session.tenant, session.tier, "deadline", span, target, reason)


def _tokens_made(call: CallRecord) -> int:
    """The tokens `call` counts toward ``min_tokens_per_s``: a successful call's, and a call's cut
    with its session (a failed call's time counts, none of its tokens)."""
    return call.completion_tokens if call.error is None or call.error in CANCELLED else 0


def busy_time(intervals: Iterable[tuple[float, float]], lo: float = -math.inf, hi: float = math.inf) -> float:
    """Length of the union of [start, end] intervals, clipped to [lo, hi]."""
    total = 0.0
    end_so_far = -math.inf
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= start:
            continue
        if start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total


@dataclass(frozen=True, slots=True)
class ObjectiveResult:
    objective: str
    target: float
    value: float
    """The measured figure: TTFT p99 or latency p95 of successful calls, the longest session,
    or tokens per backlogged second (nan: nothing to measure)."""
    events: int
    met_events: int
    breaches: Mapping[str, int]
    """Missed events by reason."""
    at_least: bool = False
    """`value` is a lower bound: the longest session was ended by its deadline, unfinished."""

    @property
    def attainment(self) -> float:
        """Share of events that met the target (nan without events)."""
        return self.met_events / self.events if self.events else math.nan

    @property
    def met(self) -> bool | None:
        """Whether the objective was met; None when there was nothing to measure (no event: for
        ``min_tokens_per_s``, no backlog and no refused or failed call), neither met nor missed."""
        if not self.events:
            return None
        return self.met_events >= QUANTILE[self.objective] * self.events - 1e-9


@dataclass(frozen=True, slots=True)
class TenantSla:
    tenant: str
    tier: str
    weight: float
    objectives: tuple[ObjectiveResult, ...]
    refused: Mapping[str, int] = field(default_factory=dict)
    """Refused calls by reason (shed, rate-limited), whether or not an objective was set."""

    @property
    def met(self) -> bool | None:
        """False if an objective was missed, else True if one was met, else None (none measured)."""
        verdicts = [o.met for o in self.objectives]
        if False in verdicts:
            return False
        return True if True in verdicts else None


def evaluate(
    recorder: Recorder, tenants: Mapping[str, TenantSettings], times: Mapping[str, CallTimes] | None = None
) -> tuple[list[TenantSla], list[Breach]]:
    """Every tenant's objectives over the whole run; the breaches in time order. `times`: each
    tenant's `CallTimes`, where the caller has them already (as `summarise` takes them)."""
    calls: dict[str, list[CallRecord]] = {name: [] for name in tenants}
    for call in [*recorder.calls, *recorder.refusals]:
        calls.setdefault(call.tenant, []).append(call)
    sessions: dict[str, list[SessionRecord]] = {name: [] for name in tenants}
    for session in recorder.sessions:
        sessions.setdefault(session.tenant, []).append(session)
    rows, breaches = [], []
    for name, tenant in tenants.items():
        goals = targets(tenant.sla)
        counts = {o: [0, 0] for o in goals}  # events, met
        reasons: dict[str, dict[str, int]] = {o: {} for o in goals}

        def note(objective: str, met: bool, breach: Breach | None) -> None:
            counts[objective][0] += 1
            counts[objective][1] += met
            if breach is not None:
                reasons[objective][breach.reason] = reasons[objective].get(breach.reason, 0) + 1
                breaches.append(breach)

        refused: dict[str, int] = {}
        for call in calls[name]:
            if call.error in _REFUSED:
                refused[_REFUSED[call.error]] = refused.get(_REFUSED[call.error], 0) + 1
            for event in call_events(call, goals):
                note(*event)
        for session in sessions[name]:
            event = session_event(session, goals)
            if event is not None:
                note("deadline", *event)
            for event in admission_events(session, goals):
                note(*event)
        ok = [c for c in calls[name] if c.error is None]
        ok_times = (times or {}).get(name) or CallTimes.of(ok)
        results = []
        for objective, target in goals.items():
            at_least = False
            # Nearest rank, as the verdict counts: an interpolated p99 read 1,628 ms against a
            # target of 1,629 ms beside the verdict MISSED (98.7 % of the calls on time).
            if objective == "ttft_p99":
                value = rank_percentile(ok_times.ttft_s, 99)
            elif objective == "latency_p95":
                value = rank_percentile(ok_times.latency_s, 95)
            elif objective in ADMISSION:
                waits = [w for s in sessions[name] if (w := admission_wait(s)) is not None]
                value = rank_percentile(waits, 100 * QUANTILE[objective])
            elif objective == "deadline":
                spans = [(s.finished - s.submitted, s.deadline_exceeded) for s in sessions[name] if s.state in ("done", "failed")]
                value, at_least = max(spans, default=(math.nan, False))
            else:
                # The rate is one event beside the refused and failed calls' (`call_events`).
                # A call cut short with its session made tokens in the time it counts: its
                # time without them read 0.0 tok/s, "engine slow", for a tenant served 880.
                busy = busy_time((c.submitted, c.finished) for c in calls[name] if c.error not in _REFUSED)
                value = sum(map(_tokens_made, calls[name])) / busy if busy > 0 else math.nan
                if busy > 0:
                    counts[objective][0] += 1
                    counts[objective][1] += value >= target
                    if value < target:
                        reasons[objective]["engine-slow"] = reasons[objective].get("engine-slow", 0) + 1
            events, met = counts[objective]
            results.append(ObjectiveResult(objective, target, value, events, met, reasons[objective], at_least))
        rows.append(TenantSla(name, str(tenant.tier), tenant.weight, tuple(results), refused))
    breaches.sort(key=lambda b: b.at)
    return rows, breaches


def _share_in(start: float, end: float, lo: float) -> float:
    """The share of the interval [start, end] (which ends at or after `lo`) from `lo` on."""
    return 1.0 if start >= lo or end <= start else (end - lo) / (end - start)


class SlaTracker:
    """Live attainment per tenant and objective over a rolling window of `window_s` seconds.

    Call `update(recorder, now)` whenever a fresh figure is wanted (the live view and the
    metrics scrape do): it reads the records added since the last update, so the dispatcher's
    hot path pays nothing. `attainment(tenant, objective)` is then the share of the window's
    events that met the target (None without events in the window).
    """

    def __init__(self, tenants: Mapping[str, TenantSettings], *, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.goals = {name: targets(t.sla) for name, t in tenants.items()}
        self._events: dict[tuple[str, str], deque[tuple[float, bool]]] = {}
        self._met: dict[tuple[str, str], int] = {}  # met events in each deque: attainment in O(1)
        self._served: dict[str, deque[tuple[float, float, int]]] = {}  # submitted, finished, tokens (calls not refused)
        self.breaches: dict[tuple[str, str, str], int] = {}
        """Breaches so far per (tenant, objective, reason)."""
        self.recent: deque[Breach] = deque(maxlen=200)
        self._cursors = [0, 0, 0, 0]  # calls, refusals, sessions, admissions
        self._now = -math.inf

    def update(self, recorder: Recorder, now: float) -> list[Breach]:
        """Take in the records added since the last update; returns the new breaches."""
        self._now = now
        new: list[Breach] = []
        fresh: list[list] = []
        lists: Sequence[list] = (recorder.calls, recorder.refusals, recorder.sessions, recorder.admissions)
        for i, records in enumerate(lists):
            start, self._cursors[i] = self._cursors[i], len(records)
            fresh.append(records[start:])
        # Calls and refusals feed the same windows, which drop events from their oldest end:
        # take them in by time, or a refusal taken in after a later call outstays the window.
        calls = sorted([*fresh[0], *fresh[1]], key=_FINISHED)
        for i, records in enumerate((calls, fresh[2])):
            for record in records:
                goals = self.goals.get(record.tenant)
                if not goals:  # a tenant without objectives (often most calls): nothing to take in
                    continue
                if i == 0:
                    for objective, met, breach in call_events(record, goals):
                        self._note(record.tenant, objective, record.finished, met, breach, new)
                    # As in `evaluate`: every call not refused kept the tenant backlogged, and
                    # successful and cut calls' tokens count (a failed call's time, none of them).
                    if "min_tokens_per_s" in goals and record.error not in _REFUSED:
                        served = self._served.get(record.tenant)
                        if served is None:
                            served = self._served[record.tenant] = deque()
                        served.append((record.submitted, record.finished, _tokens_made(record)))
                else:
                    event = session_event(record, goals)
                    if event is not None:
                        self._note(record.tenant, "deadline", record.finished, *event, new)
        # A wait for admission counts when it ends: at the admission, or at the end of a session
        # never admitted. In time order, as the calls are.
        waits = [(a.admitted, a.tenant, a.tier, a.admitted - a.submitted) for a in fresh[3]]
        for s in fresh[2]:
            if math.isnan(s.admitted) and (wait := admission_wait(s)) is not None:
                waits.append((s.finished, s.tenant, s.tier, wait))
        for at, tenant, tier, wait in sorted(waits, key=_FIRST):
            goals = self.goals.get(tenant)
            if goals:
                for objective, met, breach in _admission_events(tenant, tier, wait, at, goals):
                    self._note(tenant, objective, at, met, breach, new)
        return new

    def _note(self, tenant: str, objective: str, at: float, met: bool, breach: Breach | None, new: list[Breach]) -> None:
        key = (tenant, objective)
        events = self._events.get(key)
        if events is None:
            events = self._events[key] = deque()
            self._met[key] = 0
        events.append((at, met))
        self._met[key] += met
        if breach is not None:
            key = (tenant, objective, breach.reason)
            self.breaches[key] = self.breaches.get(key, 0) + 1
            self.recent.append(breach)
            new.append(breach)

    def attainment(self, tenant: str, objective: str) -> float | None:
        """Share of events in the window that met the target; None without events.

        ``min_tokens_per_s``: the window's rate (one event, met or not) with the window's
        refused and failed calls (each a missed event), as `evaluate` counts the whole run."""
        lo = self._now - self.window_s
        key = (tenant, objective)
        events = self._events.get(key)
        while events and events[0][0] < lo:
            self._met[key] -= events.popleft()[1]
        count, met = (len(events), self._met[key]) if events else (0, 0)
        if objective == "min_tokens_per_s":
            rate = self._rate(tenant, lo)
            if rate is not None:
                count, met = count + 1, met + rate
        return met / count if count else None

    def _rate(self, tenant: str, lo: float) -> float | None:
        """1.0 or 0.0: whether the tenant's tokens per backlogged second since `lo` met its
        ``min_tokens_per_s``; None without a backlog in the window."""
        served = self._served.get(tenant)
        target = self.goals.get(tenant, {}).get("min_tokens_per_s")
        while served and served[0][1] < lo:
            served.popleft()
        if not served or target is None:
            return None
        busy = busy_time(((s, f) for s, f, _ in served), lo, self._now)
        # The backlog is clipped to the window, so the tokens must be too: a call that began
        # before the window counts the share of its tokens made inside it (taken as spread
        # evenly over the call), not all of them.
        tokens = sum(n * _share_in(s, f, lo) for s, f, n in served if f >= lo)
        return (1.0 if tokens / busy >= target else 0.0) if busy > 0 else None

    def tenant_standing(self, tenant: str) -> tuple[float, bool] | None:
        """The attainment of the tenant's objective nearest to missing in the window (the least
        above its required share, or the most below), and whether every objective meets its
        share; None: no events. The lowest attainment alone hid a missed p99 (98.6 %) behind a
        met p95 (96 %)."""
        nearest = None
        for objective in self.goals.get(tenant, {}):
            value = self.attainment(tenant, objective)
            if value is not None:
                margin = value - QUANTILE[objective]
                if nearest is None or margin < nearest[0]:
                    nearest = (margin, value)
        if nearest is None:
            return None
        return nearest[1], nearest[0] >= -1e-9

    def tenant_attainment(self, tenant: str) -> float | None:
        """The lowest attainment over the tenant's objectives in the window (None: no events)."""
        worst = None
        for objective in self.goals.get(tenant, {}):
            value = self.attainment(tenant, objective)
            if value is not None:
                worst = value if worst is None else min(worst, value)
        return worst
