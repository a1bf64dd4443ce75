"""Resources: memory pools (the admission gate), concurrency limits, KV sizing."""

from __future__ import annotations

from collections.abc import Mapping

from ..settings import ResourceSettings
from .memory import CountingPool, DeviceSpec, DeviceStatistics, MemoryPool, MemoryStatistics, Reservation

__all__ = [
    "CountingPool",
    "DeviceSpec",
    "DeviceStatistics",
    "MemoryPool",
    "MemoryStatistics",
    "Reservation",
    "create_pool",
]


def create_pool(settings: ResourceSettings, quotas: Mapping[str, int] | None = None) -> MemoryPool:
    """Build the memory pool that `settings.strategy` names, over `settings.devices`."""
    devices = [DeviceSpec(d.name, int(d.memory)) for d in settings.devices]
    if settings.strategy == "counting":
        return CountingPool(devices, quotas=quotas)
    raise ValueError(f"resources.strategy: unknown strategy {settings.strategy!r}; known: counting")
