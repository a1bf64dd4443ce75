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
        names = ", ".join(t.name.lower() for t in cls)
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in cls._value2member_map_:
                raise ValueError(f"unknown tier {value!r}; expected one of {names} (or 0-{len(cls) - 1})")
            return cls(value)
        if not isinstance(value, str):
            raise ValueError(f"a tier is one of {names} (or its number), not a {type(value).__name__}")
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; expected one of {names}") from None

    def __str__(self) -> str:
        return self.name.lower()
