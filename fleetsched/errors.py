"""The one error tree of fleetsched.

Every error the library raises on purpose derives from `FleetschedError`::

    FleetschedError
    ├── ConfigError(ValueError)            a setting is missing or out of range
    ├── ReportSchemaError(ValueError)      a run report of another schema version, or not a report
    ├── UnknownTenant(KeyError)            submit() named a tenant the config does not declare
    ├── SchedulerClosed(RuntimeError)      submit() after the scheduler stopped accepting work
    ├── Deadlock(RuntimeError)             a run on virtual time can never go on (every task waits, no timer)
    ├── WouldBlock                         a *_nowait() call could not proceed at once
    │   └── QuotaWouldBlock                ... because the tenant's memory quota is full
    ├── SessionRejected                    a session can never be admitted
    │   ├── RequestTooLarge(ValueError)    asks for more memory than any device holds
    │   └── QuotaExceeded(ValueError)      asks for more than the tenant's whole quota
    ├── SessionFailed                      awaiting a handle whose agent raised
    ├── SessionCancelled                   awaiting a handle that was cancelled
    ├── SessionEnded(RuntimeError)         a session's context used after the session ended
    └── BackendError                       a model call failed
        ├── InvalidRequest(ValueError)     the engine refuses the body as it stands (HTTP 400)
        │   ├── ContextTooLong             the prompt fills the model's context, or max_tokens alone exceeds it
        │   └── UnknownModel               the call names a model the engine does not serve (HTTP 404)
        ├── BackendUnavailable             connection refused, circuit open, server gone
        ├── Overloaded                     shed: its wait would exceed its SLA; carries retry_after_s
        │   └── RateLimited                the tenant's requests or tokens per minute are used up
        └── DeadlineExceeded(TimeoutError) a session past its deadline, queued or running

Foreign exceptions (httpx, openai, vllm) are translated where they cross into the library with
``raise OurError(...) from exc`` so that callers catch one tree.
"""

from __future__ import annotations

import math


class FleetschedError(Exception):
    """Root of every error fleetsched raises on purpose."""


class ConfigError(FleetschedError, ValueError):
    """A setting is missing, malformed or out of range. `key` names it (dotted path)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class ReportSchemaError(FleetschedError, ValueError):
    """A run report (JSON) is not of the schema this version reads; the message names both."""


class UnknownTenant(FleetschedError, KeyError):
    """`submit()` named a tenant that the settings do not declare."""

    def __init__(self, tenant: str, known: list[str]) -> None:
        super().__init__(tenant)
        self.tenant = tenant
        self.known = known

    def __str__(self) -> str:
        return f"unknown tenant {self.tenant!r}; declared tenants: {', '.join(self.known) or '(none)'}"


class SchedulerClosed(FleetschedError, RuntimeError):
    """The scheduler is not running (not entered yet, or shutting down)."""


class Deadlock(FleetschedError, RuntimeError):
    """A run on virtual time stands still for good: every task waits, no timer is set, no worker
    thread works, and nothing outside the loop woke it for a while (`fleetsched.virtual_time`).
    The message names the tasks that wait and where."""


class WouldBlock(FleetschedError):
    """A ``*_nowait()`` call could not proceed without waiting."""


class QuotaWouldBlock(WouldBlock):
    """The tenant's memory quota is in use by its other sessions; others may still proceed."""


class SessionRejected(FleetschedError):
    """A session that can never be admitted, rejected at once rather than left waiting."""


class RequestTooLarge(SessionRejected, ValueError):
    """A reservation larger than the largest device could ever hold."""

    def __init__(self, requested: int, largest: int, device: str | None = None) -> None:
        if device is None:
            held = f"the largest device holds {largest:,} bytes"
        else:  # a reservation growing: it stays on its device
            held = f"its device {device!r} holds {largest:,} bytes (a reservation grows on its own device)"
        super().__init__(f"asked for {requested:,} bytes but {held}; lower the session's memory (context budget) or add a larger device")
        self.requested = requested
        self.largest = largest


class QuotaExceeded(SessionRejected, ValueError):
    """A reservation larger than the tenant's whole memory quota."""

    def __init__(self, tenant: str, requested: int, quota: int) -> None:
        super().__init__(
            f"tenant {tenant!r} asked for {requested:,} bytes but its memory quota is {quota:,} bytes"
        )
        self.tenant = tenant
        self.requested = requested
        self.quota = quota


class SessionFailed(FleetschedError):
    """Raised when awaiting a handle whose agent raised; the agent's exception is the cause."""


class SessionCancelled(FleetschedError):
    """Raised when awaiting a handle whose session was cancelled."""


class SessionEnded(FleetschedError, RuntimeError):
    """A session's context was used after the session ended (by a task that outlived its agent)."""


class BackendError(FleetschedError):
    """A model call failed."""


class InvalidRequest(BackendError, ValueError):
    """The engine refuses this request as it stands (vLLM answers HTTP 400). Not retryable.
    `param`: the field the engine named as wrong, where it named one apart from its message."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """The call does not fit the model's context (``max_model_len``): its prompt fills it, or
    its ``max_tokens`` alone exceeds it (a ``max_tokens`` longer than the prompt leaves is cut,
    as vLLM's server does), or it needs more than the whole KV cache can hold. OpenAI clients
    see it as a 400 with code ``context_length_exceeded``."""


class UnknownModel(InvalidRequest):
    """The call names a model the engine does not serve (vLLM answers 404, param "model"). OpenAI
    clients see it as a 404 (``openai.NotFoundError``) with code ``model_not_found``."""


class BackendUnavailable(BackendError):
    """The backend cannot be reached (refused, reset, circuit open)."""


class Overloaded(BackendError):
    """The call was shed or rate-limited. Retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        # Rounded up to the tenth shown: a wait of 0.01 s read "retry after 0.0 s" (an infinite
        # wait, under a tokens_per_minute of 1e-300, stays inf).
        shown = math.ceil(retry_after_s * 10) / 10 if math.isfinite(retry_after_s) else retry_after_s
        super().__init__(f"{message} (retry after {shown:.1f} s)")
        self.retry_after_s = retry_after_s


class RateLimited(Overloaded):
    """The tenant's requests-per-minute or tokens-per-minute limit is used up for now."""


class DeadlineExceeded(BackendError, TimeoutError):
    """A session passed its deadline, queued or running (the cause of its `SessionFailed`, with
    or without a model call under way), or a model call was made after it had passed."""
