"""The embedded ``sim`` backend: a model of vLLM v1's continuous-batching engine on anyio time.

- `_kv_cache`: the block pool with prefix caching (pure, synchronous).
- `_queues`: waiting-queue policies (fcfs, priority) and their preemption victim choice.
- `_engine`: the scheduler as a synchronous state machine (schedule a step, complete it).
- `_backend`: `SimBackend`, the async front: one engine-loop task, streaming, signals.
"""

from ._backend import ContextTooLong, InvalidRequest, SimBackend, SimStatistics
from ._engine import SimEngine, SimRequest
from ._kv_cache import BlockPool
from ._queues import FcfsQueue, PriorityQueue, RequestQueue, make_queue

__all__ = [
    "BlockPool",
    "ContextTooLong",
    "FcfsQueue",
    "InvalidRequest",
    "PriorityQueue",
    "RequestQueue",
    "SimBackend",
    "SimEngine",
    "SimRequest",
    "SimStatistics",
    "make_queue",
]
