"""Waiting-queue policies of the simulated scheduler (vLLM v1's ``request_queue.py``).

One small interface, one class per policy, one factory. Each policy owns three decisions: the
order in which waiting requests are admitted, where a preempted request goes back, and which
running request is preempted when the KV cache runs out. Aborted requests are removed lazily:
they stay in the container and are skipped when they reach the head.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ._engine import SimRequest


class RequestQueue(ABC):
    """Waiting requests in admission order, plus the victim choice for preemption."""

    def __init__(self) -> None:
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @abstractmethod
    def add(self, request: SimRequest) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def add_preempted(self, request: SimRequest) -> None:
        """Queue a request that was just preempted (it goes ahead of newer arrivals)."""

    @abstractmethod
    def peek(self) -> SimRequest | None:
        """The request to admit next, or None."""

    @abstractmethod
    def _pop_head(self) -> None: ...

    def pop(self) -> SimRequest:
        """Remove and return the request `peek` names."""
        request = self.peek()
        assert request is not None
        self._pop_head()
        self._live -= 1
        return request

    def discard(self, request: SimRequest) -> None:
        """Forget an aborted request (its status is no longer WAITING; removal is lazy)."""
        self._live -= 1

    @staticmethod
    @abstractmethod
    def victim(running: Sequence[SimRequest]) -> SimRequest:
        """The running request to preempt when blocks run out."""


class FcfsQueue(RequestQueue):
    """First come, first served; `priority` is ignored; the latest running request is the victim."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[SimRequest] = deque()

    def add(self, request: SimRequest) -> None:
        self._queue.append(request)
        self._live += 1

    def add_preempted(self, request: SimRequest) -> None:
        self._queue.appendleft(request)
        self._live += 1

    def peek(self) -> SimRequest | None:
        queue = self._queue
        while queue and not queue[0].waiting:
            queue.popleft()
        return queue[0] if queue else None

    def _pop_head(self) -> None:
        self._queue.popleft()

    @staticmethod
    def victim(running: Sequence[SimRequest]) -> SimRequest:
        return running[-1]


class PriorityQueue(RequestQueue):
    """Lowest `priority` value first, then arrival; the victim is the lowest-priority, latest one.

    A waiting request never preempts a running one: admission only fills free slots.
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, int, SimRequest]] = []

    def add(self, request: SimRequest) -> None:
        heapq.heappush(self._heap, (request.priority, request.seq, request))
        self._live += 1

    add_preempted = add  # it keeps its arrival order, so it goes ahead of later arrivals

    def peek(self) -> SimRequest | None:
        heap = self._heap
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _pop_head(self) -> None:
        heapq.heappop(self._heap)

    @staticmethod
    def victim(running: Sequence[SimRequest]) -> SimRequest:
        return max(running, key=lambda r: (r.priority, r.seq))


def make_queue(policy: Literal["fcfs", "priority"]) -> RequestQueue:
    """The queue for a scheduling policy name (as vLLM's ``--scheduling-policy``)."""
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"policy: expected 'fcfs' or 'priority', got {policy!r}")
