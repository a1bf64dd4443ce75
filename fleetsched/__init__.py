"""fleetsched: run fleets of tool-using LLM agents from many tenants on shared inference.

The public names live here; the code lives in the subpackages::

    async with fleetsched.Scheduler(fleetsched.load_settings("fleetsched.toml")) as scheduler:
        handle = await scheduler.submit(my_agent, tenant="acme")
        result = await handle
"""

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .agents.context import SessionContext
    from .scheduler import Activity, Scheduler, SchedulerStatistics, SessionHandle, SessionState
    from .settings import Settings, load_settings

#: The public names imported on their first use, and their modules: most of the library, which
#: takes a second and more to import. The ``fleetsched`` command imports this package before
#: its Ctrl-C handling can be in place (`__main__`); imported here, the Ctrl-C of a user who
#: changed their mind at once ended in the import's traceback.
_LAZY = {
    "Activity": ".scheduler",
    "Scheduler": ".scheduler",
    "SchedulerStatistics": ".scheduler",
    "SessionHandle": ".scheduler",
    "SessionState": ".scheduler",
    "SessionContext": ".agents.context",
    "Settings": ".settings",
    "load_settings": ".settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleetsched' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module, __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

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
