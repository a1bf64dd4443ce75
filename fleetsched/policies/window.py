"""How many calls to keep at the engine: an AIMD controller driven by the engine's own signals.

Enough calls in flight keep the engine's batch full; too many and they wait in the engine's
queue, where our order no longer decides (the engine serves its waiting queue first come, first
served, or by a priority that never preempts running work). So the window grows by one while we
hold calls back and the engine has nothing waiting, and shrinks multiplicatively when the engine
queues, preempts, runs out of KV cache, or its time to first token climbs well above the
lowest seen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowSignals:
    """One observation, taken every adaptation interval."""

    window: int
    in_flight: int
    queued: int
    """Calls waiting in fleetsched's dispatcher."""
    engine_waiting: int | None = None
    kv_cache_usage: float | None = None
    preemptions: float = 0.0
    """Preemptions since the last observation."""
    ttft_s: float | None = None
    """Median engine-side time to first token of the calls finished since the last observation."""
    reserve: int = 0
    """Places of the window kept for critical calls (`dispatch.critical_reserve`): lower tiers
    fill the rest, so a window is full for them at ``window - reserve`` calls in flight."""


@dataclass(slots=True)
class AimdWindow:
    min_window: int = 4
    max_window: int = 512
    waiting_target: int = 2
    """Engine-side waiting calls tolerated before shrinking."""
    decrease: float = 0.8
    ttft_ratio: float = 4.0
    """Shrink when the engine's TTFT exceeds this multiple of the lowest TTFT seen."""
    ttft_floor_s: float | None = None

    def next_window(self, s: WindowSignals) -> int:
        """The window to use next, within [min_window, max_window] (a window outside them, as
        the starting one may be, is brought inside at once). Pure apart from remembering the
        lowest TTFT seen."""
        return max(self.min_window, min(self.max_window, self._next(s)))

    def _next(self, s: WindowSignals) -> int:
        if s.ttft_s is not None and s.ttft_s > 0:
            self.ttft_floor_s = s.ttft_s if self.ttft_floor_s is None else min(self.ttft_floor_s, s.ttft_s)
        if s.in_flight > s.window:
            # The last decrease has not taken effect: calls sent before it are still at the
            # engine (queued there, or holding its KV cache), and no new call goes until they
            # drain below the window. Shrinking again for the load they make would overshoot:
            # from 64, one window every interval, to 2 with 48 calls still in flight, where the
            # engine runs 8 (one decrease a round trip, as TCP's congestion window).
            return s.window
        shrink = int(s.window * self.decrease)
        if s.preemptions > 0 or (s.kv_cache_usage is not None and s.kv_cache_usage >= 0.98):
            return shrink
        if s.engine_waiting is not None and s.engine_waiting > self.waiting_target:
            return shrink
        slow = (
            s.ttft_s is not None
            and self.ttft_floor_s is not None
            and s.ttft_s > self.ttft_ratio * self.ttft_floor_s
            and s.engine_waiting  # only when the engine, not a long prefill, is the cause
        )
        if slow:
            return shrink
        if s.queued > 0 and s.in_flight >= max(1, s.window - s.reserve):
            return s.window + 1
        return s.window
