"""Per-tenant rate limits: token buckets for requests per minute and tokens per minute."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


class TokenBucket:
    """`rate_per_s` tokens flow in up to `capacity`. Pure: callers pass the clock's `now`.

    A take larger than the capacity is allowed when the bucket is full (it goes negative), so an
    unusually large request is slowed, never refused for ever.
    """

    __slots__ = ("rate_per_s", "capacity", "tokens", "updated")

    def __init__(self, rate_per_s: float, capacity: float) -> None:
        if not rate_per_s > 0 or not capacity > 0:
            raise ValueError(f"a token bucket needs rate > 0 and capacity > 0, got {rate_per_s}, {capacity}")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.tokens = capacity
        self.updated: float | None = None

    def _refill(self, now: float) -> None:
        if self.updated is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` could be taken (0: now)."""
        self._refill(now)
        return _short_by(amount, self.tokens, self.capacity) / self.rate_per_s

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.tokens -= amount

    def level(self, now: float) -> Level:
        """The bucket as its client sees it at `now`."""
        self._refill(now)
        return Level(self.capacity, self.tokens, max(0.0, (self.capacity - self.tokens) / self.rate_per_s))

    def give_back(self, amount: float, now: float) -> None:
        """Add `amount` (negative: take it) as of `now`. Refilled to `now` first: a charge given
        at a call's end, on the level as of its start, was partly lost to the cap at the next
        refill (a bucket held 390 tokens where 200 were left)."""
        self._refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)


@dataclass(frozen=True, slots=True)
class Level:
    """A bucket as its client sees it (OpenAI's ``x-ratelimit-*`` headers): its size (a minute's
    worth), what is in it (below 0 after a take larger than it held), and the seconds until it
    is full again."""

    limit: float
    left: float
    reset_s: float


@dataclass(frozen=True, slots=True)
class Taken:
    """The answer to a take: `wait_s` 0 when it was taken, else the seconds until it would be;
    and the tenant's buckets after it (None: the tenant has no such limit)."""

    wait_s: float
    requests: Level | None = None
    tokens: Level | None = None


@dataclass(frozen=True, slots=True)
class RateLimit:
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None


class TenantRateLimits:
    """Requests-per-minute and tokens-per-minute buckets per tenant (burst: one minute's worth)."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        for tenant, limit in limits.items():
            if limit.requests_per_minute:
                self._requests[tenant] = TokenBucket(limit.requests_per_minute / 60, limit.requests_per_minute)
            if limit.tokens_per_minute:
                self._tokens[tenant] = TokenBucket(limit.tokens_per_minute / 60, limit.tokens_per_minute)

    def try_take(self, tenant: str, tokens: float, now: float) -> float:
        """Take one request and `tokens` tokens for `tenant`, or neither: returns 0 when taken,
        else the seconds to wait before both would be there."""
        requests = self._requests.get(tenant)
        token_bucket = self._tokens.get(tenant)
        wait = max(
            requests.wait_s(1, now) if requests else 0.0,
            token_bucket.wait_s(tokens, now) if token_bucket else 0.0,
        )
        if wait > 0:
            return wait
        if requests:
            requests.take(1, now)
        if token_bucket:
            token_bucket.take(tokens, now)
        return 0.0

    def levels(self, tenant: str, now: float) -> tuple[Level | None, Level | None]:
        """`tenant`'s requests and tokens buckets at `now` (None: no such limit)."""
        requests = self._requests.get(tenant)
        tokens = self._tokens.get(tenant)
        return (requests.level(now) if requests else None, tokens.level(now) if tokens else None)

    def shortfall(self, tenant: str, tokens: float, now: float) -> str:
        """Which of `tenant`'s limits keeps one request of `tokens` tokens from being taken now,
        in words for an error message ("" when none does)."""
        return shortfall_text(*self.levels(tenant, now), tokens)

    def untake(self, tenant: str, tokens: float, now: float) -> None:
        """Give back a whole `try_take`, request and tokens: the call never reached the backend."""
        self.refund(tenant, tokens, now, request=True)

    def refund(self, tenant: str, tokens: float, now: float, *, request: bool = False) -> None:
        """Give back tokens charged up front but not used (max_tokens not all generated), and
        with `request` the request too. A negative refund charges what a call used beyond its
        charge (a prompt longer than its estimate): the bucket may go below empty, and the
        tenant's next calls wait it out."""
        requests = self._requests.get(tenant) if request else None
        if requests is not None:
            requests.give_back(1, now)
        bucket = self._tokens.get(tenant)
        if bucket is not None and not math.isnan(tokens):
            bucket.give_back(tokens, now)


def shortfall_text(requests: Level | None, tokens_level: Level | None, tokens: float) -> str:
    """Which of these buckets (as `TenantRateLimits.levels` or a gateway's take reads them) keeps
    one request of `tokens` tokens out, in words for an error message ("" when none does)."""
    short = []
    if requests is not None and _short(requests, 1):
        short.append(f"requests_per_minute ({requests.limit:g})")
    if tokens_level is not None and _short(tokens_level, tokens):
        left = f", {max(0.0, tokens_level.left):.0f} are left" if tokens <= tokens_level.limit else ""
        short.append(tokens_asked(tokens_level.limit, tokens) + left)
    return " and its ".join(short)


def _short(level: Level, amount: float) -> bool:
    """Whether `amount` cannot be taken from `level` now, as `TokenBucket.wait_s` judges it."""
    return _short_by(amount, level.left, level.limit) > 0


def _short_by(amount: float, left: float, capacity: float) -> float:
    """What a bucket of `capacity` holding `left` lacks for a take of `amount` (0: nothing); a
    take needs at most a full bucket. Refilling over a wait computed from it comes up short by
    float rounding (up to about 1e-10 of the capacity with a clock at 1e8 s): a caller that
    waited it must not be refused again, so that little is not short."""
    short = min(amount, capacity) - left
    return 0.0 if short <= capacity * 1e-9 else short


def tokens_asked(per_minute: float, tokens: float) -> str:
    """A refusal's words for a tokens_per_minute limit and what the call asks of it."""
    text = f"tokens_per_minute ({per_minute:g}): this call asks {tokens:.0f} tokens (prompt plus max_tokens)"
    if tokens > per_minute:
        text += ", more than a minute's: it goes through when the bucket is full"
    return text
