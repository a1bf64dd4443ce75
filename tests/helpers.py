"""Small builders shared by tests."""

from __future__ import annotations

from typing import Any

from fleetsched.settings import Settings


def settings(tenants: dict[str, dict[str, Any]] | None = None, **sections: dict[str, Any]) -> Settings:
    """Settings for tests: the instant backend, one 80 GB device, and the given overrides."""
    sections.setdefault("backend", {"kind": "instant"})
    sections.setdefault("resources", {"strategy": "counting", "devices": [{"name": "gpu0", "memory": "80GB"}]})
    return Settings(tenants=tenants or {"acme": {}}, **sections)


def check_released(scheduler: Any) -> None:
    """The invariants after every session ended: no slot, no memory, nothing queued."""
    stats = scheduler.statistics()
    assert stats.slots_in_use == 0
    assert stats.memory.allocated == 0
    assert stats.queued_total == 0 and stats.running_total == 0
    assert not scheduler.pool.reservations()
    assert stats.dispatcher.in_flight == 0
