"""fleetsched: run fleets of tool-using LLM agents from many tenants on shared inference.

The public names live here; the code lives in the subpackages::

    async with fleetsched.Scheduler(fleetsched.load_settings("fleetsched.toml")) as scheduler:
        handle = await scheduler.submit(my_agent, tenant="acme")
        result = await handle
"""

from ._native import use_sources_if_stale

use_sources_if_stale()  # before anything imports a module that setup.py compiles

from .errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    ContextTooLong,
    DeadlineExceeded,
    Deadlock,
    FleetschedError,
    InvalidRequest,
    Overloaded,
    QuotaExceeded,
    QuotaWouldBlock,
    RateLimited,
    ReportSchemaError,
    RequestTooLarge,
    SchedulerClosed,
    SessionCancelled,
    SessionEnded,
    SessionFailed,
    SessionRejected,
    UnknownModel,
    UnknownTenant,
    WouldBlock,
)
from .policies.tiers import Tier
from .scheduler import Activity, Scheduler, SchedulerStatistics, SessionHandle, SessionState  # isort: skip
from .agents.context import SessionContext  # after .scheduler, which it imports
from .settings import Settings, load_settings

__version__ = "0.1.0"

__all__ = [
    "Activity",
    "BackendError",
    "BackendUnavailable",
    "ConfigError",
    "ContextTooLong",
    "DeadlineExceeded",
    "Deadlock",
    "FleetschedError",
    "InvalidRequest",
    "Overloaded",
    "QuotaExceeded",
    "QuotaWouldBlock",
    "RateLimited",
    "ReportSchemaError",
    "RequestTooLarge",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStatistics",
    "SessionCancelled",
    "SessionEnded",
    "SessionContext",
    "SessionFailed",
    "SessionHandle",
    "SessionRejected",
    "SessionState",
    "Settings",
    "Tier",
    "UnknownModel",
    "UnknownTenant",
    "WouldBlock",
    "__version__",
    "load_settings",
]
