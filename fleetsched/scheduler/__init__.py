"""The scheduler: session admission, lifecycle, and the model-call dispatcher."""

from .dispatcher import Dispatcher, DispatcherStatistics
from .records import CallRecord, Recorder, SessionRecord, TenantSummary, percentile, summarise
from .scheduler import Scheduler, SchedulerStatistics
from .session import Activity, Agent, SessionHandle, SessionState

__all__ = [
    "Activity",
    "Agent",
    "CallRecord",
    "Dispatcher",
    "DispatcherStatistics",
    "Recorder",
    "Scheduler",
    "SchedulerStatistics",
    "SessionHandle",
    "SessionRecord",
    "SessionState",
    "TenantSummary",
    "percentile",
    "summarise",
]
