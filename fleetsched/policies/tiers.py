"""QoS tiers: strict bands, the lower the value the sooner served (as vLLM's `priority`)."""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    CRITICAL = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: str | int | Tier) -> Tier:
        """Accept a Tier, its value, or its name in any case ("critical", "Batch")."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(t.name.lower() for t in cls)
            raise ValueError(f"unknown tier {value!r}; expected one of {names}") from None

    def __str__(self) -> str:
        return self.name.lower()
