"""Keep or release a session's memory and slot while it sits in a tool call.

A session in a tool holds a slot and a memory reservation it is not using. Keeping them is cheap
when the tool is short: the session resumes at once and its prefix is still cached at the
engine, so the next turn's prefill is cheap. Releasing them pays when the tool is long and
others wait: the freed slot serves a waiting session meanwhile, and the returning session is
re-admitted ahead of newer ones of its tenant.

The decision is taken when the tool starts, from the tool's durations learned online and the
current admission pressure, as a time to live in the manner of Continuum (Li et al., 2025): keep
for `ttl_s` (inf: for the whole tool), then release if the tool is still running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(slots=True)
class _Running:
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0


#: The tool names whose durations `ToolStats` keeps: the least recently observed are forgotten
#: past it. Names come from agents (``ctx.tool(name)``; run_tool_loop passes the model's, which
#: may invent one a call): unbounded, they grew the statistics for the whole run.
MAX_TOOLS = 4096


@dataclass(slots=True)
class ToolStats:
    """Durations per tool name, learned online (count, mean, standard deviation), for the
    `MAX_TOOLS` names observed most recently."""

    min_samples: int = 3
    _tools: dict[str, _Running] = field(default_factory=dict)

    def observe(self, tool: str, seconds: float) -> None:
        stats = self._tools.pop(tool, None)  # re-inserted: the dict's order is the recency
        if stats is None:
            stats = _Running()
            if len(self._tools) >= MAX_TOOLS:
                del self._tools[next(iter(self._tools))]
        self._tools[tool] = stats
        stats.add(seconds)

    def expected_s(self, tool: str) -> float | None:
        """A pessimistic expectation (mean plus one standard deviation); None until learned."""
        stats = self._tools.get(tool)
        if stats is None or stats.count < self.min_samples:
            return None
        return stats.mean + stats.std

    def count(self, tool: str) -> int:
        stats = self._tools.get(tool)
        return stats.count if stats else 0


Mode = Literal["keep", "release", "adaptive"]


@dataclass(frozen=True, slots=True)
class KeepOrRelease:
    """The policy. `mode` "keep" never releases (the seeds' fixed quota held all session long);
    "release" always releases at once; "adaptive" decides per tool call."""

    mode: Mode = "adaptive"
    keep_s: float = 2.0
    """Under pressure, tools expected to last at most this long keep their slot and memory."""
    unknown_ttl_s: float = 1.0
    """Under pressure, a tool with no history yet is kept this long, then released."""

    def ttl_s(self, tool: str, stats: ToolStats, *, waiting: int) -> float:
        """How long to keep the session's slot and memory once `tool` starts (0: release now)."""
        if self.mode == "keep":
            return math.inf
        if self.mode == "release":
            return 0.0
        if waiting == 0:
            return math.inf  # nobody would use what we free
        expected = stats.expected_s(tool)
        if expected is None:
            return self.unknown_ttl_s
        if expected <= self.keep_s:
            return max(self.keep_s, 2 * expected)  # a short tool: keep, unless it overruns badly
        return 0.0
