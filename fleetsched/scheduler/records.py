"""What happened: one record per model call and per finished session, and per-tenant summaries."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: A call's `error` when it was cut short by a cancellation (asyncio's and trio's): its time is
#: its caller's choice, no event of any SLA objective, and the engine may have read its prompt.
CANCELLED = frozenset({"Cancelled", "CancelledError"})


@dataclass(slots=True)
class CallRecord:
    """One model call. Times are on the scheduler's clock; nan where not reached."""

    tenant: str
    tier: int
    session: int
    submitted: float
    started: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    prompt_tokens: int = 0
    completion_tokens: int = 0
    backend_s: float = math.nan
    max_tokens: int = 0
    predicted_output: int = 0
    """Output tokens the dispatcher charged for this call when it took its place (a prediction)."""
    streamed: int = 0
    """Output tokens received so far, counted as chunks arrive (the engine's count where a chunk
    carries usage, else the tier's stream interval a chunk with content)."""
    error: str | None = None

    @property
    def queue_s(self) -> float:
        return self.started - self.submitted

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.submitted

    @property
    def latency_s(self) -> float:
        return self.finished - self.submitted


@dataclass(slots=True)
class SessionRecord:
    tenant: str
    tier: int
    kind: str
    state: str
    submitted: float
    admitted: float
    finished: float
    calls: int
    prompt_tokens: int
    completion_tokens: int
    #: Seconds spent in tools (``ctx.tool`` blocks), of the session's whole span.
    tool_s: float = 0.0
    #: The type name of the error a failed or rejected session ended with (None otherwise, or
    #: not recorded). ``DeadlineExceeded``: its deadline ended it, which its span alone cannot
    #: tell: on a float clock that span reads 1.9999999999999998 s as often as 2.0 s.
    error: str | None = None
    #: Seconds it waited to be re-admitted after tools that released its slot (its queueing
    #: after the first admission).
    readmit_wait_s: float = 0.0

    @property
    def deadline_exceeded(self) -> bool:
        """Whether the session's own deadline ended it (queued or running): it missed it."""
        return self.error == "DeadlineExceeded"


@dataclass(frozen=True, slots=True)
class AdmissionRecord:
    """A session's first admission (its wait is `admitted - submitted`), recorded when it
    happens: the live SLA view sees a long wait then, not when the session ends."""

    tenant: str
    tier: int
    submitted: float
    admitted: float


@dataclass(slots=True)
class Recorder:
    """Collects records. Pass `keep_calls=False` to keep only counts (long simulations, a
    scheduler embedded in a service that runs for weeks): of calls, refused calls, sessions and
    admissions alike."""

    keep_calls: bool = True
    calls: list[CallRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    call_count: int = 0
    refusals: list[CallRecord] = field(default_factory=list)
    """Calls refused before a place in the window (shed, rate-limited): `error` names why,
    `started` is nan and `finished` the refusal's time. Kept apart from `calls`, and as they
    are: counted only, without `keep_calls` (a tenant hammering its limits grew a server's
    list for ever)."""
    refusal_count: int = 0
    admissions: list[AdmissionRecord] = field(default_factory=list)
    # Last, so that the fields before keep their places.
    session_count: int = 0
    admission_count: int = 0

    def add_call(self, record: CallRecord) -> None:
        self.call_count += 1
        if self.keep_calls:
            self.calls.append(record)

    def add_session(self, record: SessionRecord) -> None:
        # Counted only without `keep_calls`, as calls are: a scheduler that ran for weeks with
        # keep_calls=False still kept a record of every session and every admission it ever had.
        self.session_count += 1
        if self.keep_calls:
            self.sessions.append(record)

    def add_admission(self, record: AdmissionRecord) -> None:
        self.admission_count += 1
        if self.keep_calls:
            self.admissions.append(record)

    def add_refusal(self, record: CallRecord) -> None:
        self.refusal_count += 1
        if self.keep_calls:
            self.refusals.append(record)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    return sorted_percentile(sorted(v for v in values if not math.isnan(v)), q)


def sorted_percentile(data: Sequence[float], q: float) -> float:
    """`percentile` of values already sorted and free of nan: many quantiles of one sort."""
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def rank_percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: the smallest value with at least q % of the
    values at or below it; nan for no values. Unlike `percentile`'s interpolation, it is at most
    a target exactly when at least q % of the values are, the rule an SLA objective is met by
    (`fleetsched.observability.sla`)."""
    return sorted_rank_percentile(sorted(v for v in values if not math.isnan(v)), q)


def sorted_rank_percentile(data: Sequence[float], q: float) -> float:
    """`rank_percentile` of values already sorted and free of nan (`CallTimes`' lists)."""
    if not data:
        return math.nan
    rank = math.ceil(q * len(data) / 100 - 1e-9)  # 1-based; the epsilon absorbs float error
    return data[max(rank, 1) - 1]


@dataclass(frozen=True, slots=True)
class CallTimes:
    """The TTFTs and latencies of successful calls, sorted and free of nan: a report takes many
    percentiles of the same calls (`sorted_rank_percentile`, `sorted_percentile`), and sorts
    each list once."""

    ttft_s: list[float]
    latency_s: list[float]

    @classmethod
    def of(cls, ok: Sequence[CallRecord]) -> CallTimes:
        """The times of `ok`, successful calls."""
        return cls(
            sorted(v for c in ok if not math.isnan(v := c.ttft_s)),
            sorted(v for c in ok if not math.isnan(v := c.latency_s)),
        )

    @classmethod
    def merged(cls, parts: Sequence[CallTimes]) -> CallTimes:
        """The times of several groups of calls together (sorting sorted runs only merges them)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            sorted(itertools.chain.from_iterable(p.ttft_s for p in parts)),
            sorted(itertools.chain.from_iterable(p.latency_s for p in parts)),
        )


@dataclass(frozen=True, slots=True)
class TenantSummary:
    tenant: str
    sessions_done: int
    sessions_failed: int
    sessions_cancelled: int
    #: The failed and rejected sessions by the type name of their error ("unknown" where none
    #: was recorded).
    session_errors: dict[str, int]
    calls: int
    call_errors: int
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    queue_p50_s: float
    prompt_tokens: int
    completion_tokens: int


def summarise(recorder: Recorder, tenants: Iterable[str], times: Mapping[str, CallTimes] | None = None) -> list[TenantSummary]:
    """Per-tenant figures over everything recorded. `times`: each tenant's `CallTimes`, where
    the caller has them already (`build_report` shares them with the SLA and the distributions).

    Percentiles by nearest rank, as the SLA's measured figures: interpolated, the tenant table's
    TTFT p99 read 44 ms beside the SLA table's 61 ms for the same 49 calls."""
    rows = []
    calls_of: dict[str, list[CallRecord]] = {}
    for call in recorder.calls:
        calls_of.setdefault(call.tenant, []).append(call)
    sessions_of: dict[str, list[SessionRecord]] = {}
    for session in recorder.sessions:
        sessions_of.setdefault(session.tenant, []).append(session)
    for tenant in tenants:
        calls = calls_of.get(tenant, [])
        ok = [c for c in calls if c.error is None]
        sessions = sessions_of.get(tenant, [])
        tenant_times = (times or {}).get(tenant) or CallTimes.of(ok)
        failed = [s for s in sessions if s.state in ("failed", "rejected")]
        ttft, latency = tenant_times.ttft_s, tenant_times.latency_s
        rows.append(
            TenantSummary(
                tenant=tenant,
                sessions_done=sum(s.state == "done" for s in sessions),
                sessions_failed=len(failed),
                sessions_cancelled=sum(s.state == "cancelled" for s in sessions),
                session_errors=dict(Counter(s.error or "unknown" for s in failed).most_common()),
                calls=len(calls),
                call_errors=len(calls) - len(ok),
                ttft_p50_s=sorted_rank_percentile(ttft, 50),
                ttft_p99_s=sorted_rank_percentile(ttft, 99),
                latency_p50_s=sorted_rank_percentile(latency, 50),
                latency_p99_s=sorted_rank_percentile(latency, 99),
                queue_p50_s=rank_percentile([c.queue_s for c in ok], 50),
                prompt_tokens=sum(c.prompt_tokens for c in calls),
                completion_tokens=sum(c.completion_tokens for c in calls),
            )
        )
    return rows
