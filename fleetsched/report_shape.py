"""The shape of a ``fleetsched.run/2`` report: the fields that ``fleetsched report`` reads.

`check_shape(data)` raises `ReportSchemaError` naming the first field that is missing, of the
wrong type, not finite or out of range (a count or a duration below 0, a ratio outside 0..1), as
in ``tenants.0.sla: Field required``, a timeline whose ``t`` goes back in time, and a timeline
series that is not aligned with the timeline's ``t``. Fields nobody reads back (``sim``,
``wall_s``, ...) are not checked, and the report is used as read: these models only check it.
``docs/report-schema.md`` documents every field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ReportSchemaError
from .settings import first_error


#: Counts, and seconds, tokens or bytes: never below 0. Ratios (attainment, fragmentation): 0..1.
_Count = Annotated[int, Field(ge=0)]
_Amount = Annotated[float, Field(ge=0)]
_Ratio = Annotated[float, Field(ge=0, le=1)]


class _Shape(BaseModel):
    # strict: a "10" where a number belongs is an edit to point out, not to read as 10
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class _Percentiles(_Shape):
    p50: _Amount | None
    p99: _Amount | None


class _Objective(_Shape):
    # seconds, or tokens per second for min_tokens_per_s: never below 0
    target: _Amount
    value: _Amount | None
    attainment: _Ratio | None
    met: bool | None
    breaches: dict[str, _Count]


class _TenantSla(_Shape):
    refused: dict[str, _Count]
    objectives: dict[str, _Objective]


class _Tenant(_Shape):
    tenant: str
    tier: str
    weight: float
    sessions_done: _Count
    sessions_failed: _Count
    sessions_cancelled: _Count = 0  # the tenant table's "cancelled" column
    calls: _Count
    ttft_s: _Percentiles
    latency_s: _Percentiles
    prompt_tokens: _Count
    completion_tokens: _Count
    sla: _TenantSla


class _Breaches(_Shape):
    total: _Count
    by_reason: dict[str, _Count]


class _Unreachable(_Shape):
    tenant: str
    message: str


class _Feasibility(_Shape):
    method: str | None = None
    unloaded_ttft_s: dict[str, _Amount] | None = None
    unreachable: list[_Unreachable] | None = None
    note: str | None = None


class _Sla(_Shape):
    breaches: _Breaches
    feasibility: _Feasibility | None = None


_Quantiles = Annotated[list[_Amount], Field(min_length=101, max_length=101)]


class _Cdfs(_Shape):
    tenant: dict[str, _Quantiles | None]
    tier: dict[str, _Quantiles | None]


class _Distributions(_Shape):
    ttft_s: _Cdfs


class _Timeline(_Shape):
    window_s: Annotated[float, Field(gt=0)]  # the rolling SLA window: a window of 0 s holds nothing
    # Times from the run's start, counts and bytes: none below 0 (as every other figure).
    t: list[_Amount]
    completion_tokens: list[_Amount]
    queued_sessions: dict[str, list[_Amount]]
    queued_calls: dict[str, list[_Amount]]
    running_sessions: list[_Amount]
    in_flight: list[_Amount]
    window: list[_Amount]
    memory_allocated_bytes: dict[str, list[_Amount]]
    fragmentation: dict[str, list[_Ratio]]
    attainment: dict[str, list[_Ratio | None]]


class _Device(_Shape):
    name: str
    total_bytes: _Count


class _Memory(_Shape):
    devices: list[_Device] = []


class _Report(_Shape):
    backend: str
    duration_s: _Amount
    sessions: dict[str, _Count]
    calls: _Count
    refused_calls: _Count = 0
    completion_tokens: _Count
    throughput_tok_s: _Amount | None
    memory: _Memory
    tenants: list[_Tenant]
    sla: _Sla
    distributions: _Distributions
    timeline: _Timeline | None


def check_shape(data: dict[str, Any], source: str) -> None:
    """Raise `ReportSchemaError` (``"SOURCE: FIELD: what is wrong"``) unless `data` renders."""
    try:
        _Report.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field, message = first_error(exc)
        if error["type"] == "model_type":  # pydantic would name the model class
            message = "Input should be an object"
        got = "" if error["type"] == "missing" else f" (got {_short(error['input'])})"
        raise ReportSchemaError(f"{source}: {field or '(root)'}: {message}{got}") from None
    timeline = data["timeline"]
    if timeline is not None:
        times = timeline["t"]
        # The plots draw the series in this order and take rates between neighbours.
        back = next((i for i in range(1, len(times)) if times[i] < times[i - 1]), None)
        if back is not None:
            raise ReportSchemaError(f"{source}: timeline.t.{back}: {times[back]} comes after {times[back - 1]} (its times go forward)")
        n = len(times)
        for name in _Timeline.model_fields:
            value = timeline[name]
            for key, values in value.items() if isinstance(value, dict) else [(None, value)] if isinstance(value, list) else []:
                if len(values) != n:
                    where = f"timeline.{name}" if key is None else f"timeline.{name}.{key}"
                    raise ReportSchemaError(f"{source}: {where}: {len(values)} values for the {n} times of timeline.t (its series are aligned with t)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
