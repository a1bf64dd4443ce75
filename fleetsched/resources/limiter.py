"""Session slots: how many sessions may run at once, in all and per tenant.

Synchronous on purpose: the scheduler's admission step asks `can_take` for every candidate and
takes a slot only together with a memory reservation, so both are granted or neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    total: int
    in_use: int
    by_tenant: Mapping[str, int]


class SessionSlots:
    """A global limit and optional per-tenant limits on concurrently running sessions."""

    def __init__(self, total: int, per_tenant: Mapping[str, int | None] | None = None) -> None:
        if total < 1:
            raise ValueError(f"total session slots must be >= 1, got {total}")
        self.total = total
        self._limits: dict[str, int] = {}
        for tenant, limit in (per_tenant or {}).items():
            if limit is None:
                continue
            if limit < 1:
                raise ValueError(f"session slots of tenant {tenant!r} must be >= 1, got {limit}")
            self._limits[tenant] = limit
        self._in_use = 0
        self._by_tenant: dict[str, int] = {}

    @property
    def in_use(self) -> int:
        return self._in_use

    def full(self) -> bool:
        return self._in_use >= self.total

    def can_take(self, tenant: str) -> bool:
        limit = self._limits.get(tenant)
        return self._in_use < self.total and (limit is None or self._by_tenant.get(tenant, 0) < limit)

    def under_cap(self, tenant: str) -> bool:
        """Whether `tenant` runs fewer sessions than its own limit (the global one aside)."""
        limit = self._limits.get(tenant)
        return limit is None or self._by_tenant.get(tenant, 0) < limit

    def take(self, tenant: str) -> None:
        if not self.can_take(tenant):
            raise RuntimeError(f"no session slot free for tenant {tenant!r}")
        self._in_use += 1
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1

    def give(self, tenant: str) -> None:
        if self._by_tenant.get(tenant, 0) <= 0:
            raise RuntimeError(f"tenant {tenant!r} holds no session slot to give back")
        self._in_use -= 1
        self._by_tenant[tenant] -= 1

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(self.total, self._in_use, {t: n for t, n in self._by_tenant.items() if n})
