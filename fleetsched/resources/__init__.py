"""Resources: memory pools (the admission gate), placement strategies, compaction, KV sizing."""

from __future__ import annotations

from collections.abc import Mapping

from ..settings import ResourceSettings
from .allocator import DEFAULT_PAGE_SIZE, ApplyResult, ExtentPool
from .defrag import CompactionPlan, DeviceGain, DeviceLayout, ExtentView, HolePlan, Move, plan_compaction, plan_hole
from .extents import AddressSpace
from .kv_sizing import (
    KVCacheCapacity,
    KVPool,
    kv_bytes_per_token,
    kv_device,
    kv_page_size,
    kv_pool,
    layer_windows,
    parse_vllm_cache_config,
    read_vllm_kv_capacity,
    session_bytes,
)
from .memory import CountingPool, DeviceSpec, DeviceStatistics, MemoryPool, MemoryStatistics, Reservation
from .strategies import DEFAULT_STRATEGY, STRATEGIES, PlacementStrategy, make_strategy

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "AddressSpace",
    "ApplyResult",
    "CompactionPlan",
    "CountingPool",
    "DeviceGain",
    "DeviceLayout",
    "DeviceSpec",
    "DeviceStatistics",
    "ExtentPool",
    "ExtentView",
    "HolePlan",
    "KVCacheCapacity",
    "KVPool",
    "MemoryPool",
    "MemoryStatistics",
    "Move",
    "PlacementStrategy",
    "Reservation",
    "create_pool",
    "kv_bytes_per_token",
    "kv_device",
    "kv_page_size",
    "kv_pool",
    "layer_windows",
    "make_strategy",
    "parse_vllm_cache_config",
    "plan_compaction",
    "plan_hole",
    "read_vllm_kv_capacity",
    "session_bytes",
]


def create_pool(settings: ResourceSettings, quotas: Mapping[str, int] | None = None, *, spread: bool = False) -> MemoryPool:
    """Build the memory pool that `settings.strategy` names, over `settings.devices`.

    "counting" gives a `CountingPool` (which places where the most is free); every name in
    `STRATEGIES` an `ExtentPool` with pages of `settings.page_size` that compacts as
    `settings.compact` and `settings.compact_threshold` say (give it a move callback with
    `ExtentPool.set_move_callback`), and that packs sessions onto the fullest device unless told to
    `spread` them (devices that are vLLM replicas). Raises ValueError for an unknown name.
    """
    devices = [DeviceSpec(d.name, int(d.memory)) for d in settings.devices]
    if settings.strategy == "counting":
        return CountingPool(devices, quotas=quotas)
    if settings.strategy in STRATEGIES:
        return ExtentPool(
            devices,
            strategy=settings.strategy,
            page_size=int(settings.page_size),
            quotas=quotas,
            compact=settings.compact,
            compact_threshold=settings.compact_threshold,
            spread=spread,
        )
    known = ", ".join(["counting", *STRATEGIES])
    raise ValueError(f"resources.strategy: unknown strategy {settings.strategy!r}; known: {known}")
