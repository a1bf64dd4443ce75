"""Tenant state that gateway instances share: rate-limit buckets, fair-share counters, placement.

One small interface, `SharedState`, with two implementations: `MemoryState` (one instance alone;
the default) and `RedisState` (``gateway.redis_url`` set: several instances behind one load
balancer act as one gateway). `create_state` picks from the settings.

- Rate limits: a requests-per-minute and a tokens-per-minute token bucket per tenant, as in
  `fleetsched.resources.ratelimit`. In Redis both are taken or neither, in one Lua script on the
  Redis server's clock, so instances never race nor disagree about time.
- Fair-share counters: the service each tenant got (VTC cost: prompt 1, output 2). Each instance
  counts its own in its memory, as it serves, and writes its totals so far to fields of its own
  at each fair-share sync, off the calls' path; the peers' service is the sum of the other
  instances' fields, so that each instance's dispatcher counts what its peers served and never
  its own service twice.
- Session placement: which instance and replica serve a session, first writer wins, expiring
  after the session's idle time. A session that passed its deadline leaves a mark in its place
  instead, so that every instance refuses its id for an idle period.
"""

from __future__ import annotations

import json
import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import anyio

from ..errors import ConfigError, FleetschedError
from ..resources.ratelimit import Level, RateLimit, Taken, TenantRateLimits


class StateUnavailable(FleetschedError):
    """The shared state (Redis) cannot be reached: the gateway answers 503, retry shortly."""

    @classmethod
    def from_error(cls, exc: Exception) -> StateUnavailable:
        """Say what went wrong with Redis, but not where it is (the message goes to tenants)."""
        import redis.exceptions as errors

        if isinstance(exc, (errors.TimeoutError, TimeoutError)):
            reason = "it did not answer in time"
        elif isinstance(exc, (errors.AuthenticationError, errors.AuthorizationError, errors.MaxClientsReachedError)):
            # Connected, and refused by Redis (no or a wrong password in gateway.redis_url, too
            # many clients): its own words, not "cannot connect", which sent the operator to
            # check the network while the password was wrong.
            reason = f"it refused the connection: {exc}"
        elif isinstance(exc, (errors.ConnectionError, OSError)):
            reason = "cannot connect to it"
        elif isinstance(exc, errors.ResponseError):
            reason = f"it refused the command: {exc}"
        else:
            reason = type(exc).__name__
        return cls(f"the gateway's shared state (Redis) is unavailable: {reason}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a session runs: the gateway instance that admitted it and the backend replica."""

    instance: str
    replica: str | None = None


class SharedState(ABC):
    """Per-tenant state, local or shared. All methods are cheap awaits on the request path."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        self.limits = dict(limits)

    @abstractmethod
    async def take(self, tenant: str, tokens: float) -> Taken:
        """Take one request and `tokens` tokens from `tenant`'s buckets, or neither.

        Its `wait_s` is 0 when taken, else the seconds until both would be there; with the
        buckets' levels after it."""

    @abstractmethod
    async def refund(self, tenant: str, tokens: float, *, request: bool = False) -> Taken | None:
        """Give back tokens charged up front but not used, and with `request` the request too
        (a call refused as invalid, which was served nothing). Returns the buckets after it (for
        a refusal's x-ratelimit-* headers), or None where nothing was given back."""

    @abstractmethod
    def count_usage(self, tenant: str, cost: float) -> None:
        """Count `cost` of service this instance gave `tenant` (fair-share counters), in its
        memory: the peers learn it at the next `peer_usage` (the fair-share sync's), which writes
        it. No wait on a call's path."""

    async def add_usage(self, tenant: str, cost: float) -> None:
        """`count_usage`, and write it for the peers at once."""
        self.count_usage(tenant, cost)

    @abstractmethod
    async def peer_usage(self) -> dict[str, float]:
        """Service given to each tenant so far by the other instances (with shared state, this
        instance's own service counted so far is written first, for them)."""

    @abstractmethod
    async def place(self, session: str, proposal: Placement, ttl_s: float) -> Placement | None:
        """The placement of `session`: the one already recorded, else `proposal` (recorded now).
        Either way its expiry is pushed to `ttl_s` from now. None while `session` is marked past
        its deadline (`mark_past_deadline`); asking does not extend the mark."""

    @abstractmethod
    async def mark_past_deadline(self, session: str, ttl_s: float) -> None:
        """`session` ended at its deadline: `place` refuses it for `ttl_s` (replaces its placement)."""

    @abstractmethod
    async def forget(self, session: str) -> None:
        """Drop the placement of `session`."""

    @property
    def shared(self) -> bool:
        """Whether other instances see this state."""
        return False

    async def unavailable(self) -> str | None:
        """Why the state cannot be reached now (for `/health`), or None: it can."""
        return None

    async def aclose(self) -> None:
        """Release connections. Idempotent."""


#: `MemoryState` sweeps its placements once it holds more than this many (or twice what it kept).
_SWEEP_AT_LEAST = 1024


class MemoryState(SharedState):
    """State of one gateway instance alone, in its memory."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        super().__init__(limits)
        self._buckets = TenantRateLimits(self.limits)
        #: Per session, its placement (None: marked past its deadline) and when it expires.
        self._placements: dict[str, tuple[Placement | None, float]] = {}
        #: The table's size past which a new session sweeps out the expired entries: twice what
        #: the last sweep kept (1,024 at least). A fixed 1,024 swept on every new session once
        #: that many were live, a scan of them all each: 8,000 sessions opened cost 4 s of the
        #: event loop, every other call waiting through it.
        self._sweep_above = _SWEEP_AT_LEAST

    async def take(self, tenant: str, tokens: float) -> Taken:
        if tenant not in self.limits:
            return Taken(0.0)
        now = anyio.current_time()
        wait = self._buckets.try_take(tenant, tokens, now)
        return Taken(wait, *self._buckets.levels(tenant, now))

    async def refund(self, tenant: str, tokens: float, *, request: bool = False) -> Taken | None:
        if tenant not in self.limits:
            return None
        now = anyio.current_time()
        self._buckets.refund(tenant, tokens, now, request=request)
        return Taken(0.0, *self._buckets.levels(tenant, now))

    def count_usage(self, tenant: str, cost: float) -> None:
        pass  # no peers to tell

    async def peer_usage(self) -> dict[str, float]:
        return {}

    async def place(self, session: str, proposal: Placement, ttl_s: float) -> Placement | None:
        now = anyio.current_time()
        found = self._placements.get(session)
        if found is not None and found[1] > now:
            if found[0] is None:  # past its deadline
                return None
            placement = found[0]
        else:
            placement = proposal
        self._placements[session] = (placement, now + ttl_s)
        if len(self._placements) > self._sweep_above and found is None:
            self._placements = {k: v for k, v in self._placements.items() if v[1] > now}
            self._sweep_above = max(_SWEEP_AT_LEAST, 2 * len(self._placements))
        return placement

    async def mark_past_deadline(self, session: str, ttl_s: float) -> None:
        self._placements[session] = (None, anyio.current_time() + ttl_s)

    async def forget(self, session: str) -> None:
        self._placements.pop(session, None)


# Both bucket scripts begin so: Redis's clock, a bucket's level (a bucket not stored is full, as
# a new in-memory one is), and `keep`, which keeps the hash until both buckets are full again (an
# hour at least): a bucket in debt (a take larger than it, a charge after the call) that expired
# sooner would come back full.
_BUCKETS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(value, at, rate, cap)
  if value == false or value == nil then return cap end
  -- never below the level stored: a clock behind the one that stored it (a failover, a step
  -- back) emptied the bucket
  return math.min(cap, tonumber(value) + math.max(0, now - tonumber(at)) * rate)
end
local function keep(r, rr, rc, k, tr, tc)
  local refill = 0
  if rr > 0 then refill = math.max(refill, (rc - r) / rr) end
  if tr > 0 then refill = math.max(refill, (tc - k) / tr) end
  redis.call('EXPIRE', KEYS[1], math.max(3600, math.ceil(refill) + 60))
end
"""

# KEYS[1]: the tenant's bucket hash. ARGV: requests rate/s, requests capacity, tokens rate/s,
# tokens capacity (rate 0: no such limit), tokens to take. Returns the wait in seconds and the
# two buckets' levels after the take (or the refusal), as a string "wait requests tokens" (Redis
# would truncate a Lua number to an integer). A take needs at most a full bucket, of requests
# as of tokens (a limit under one request a minute serves a call once its bucket is full).
_TAKE = _BUCKETS + """
local rr, rc, tr, tc, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local v = redis.call('HMGET', KEYS[1], 'r', 'rt', 'k', 'kt')
local wait, r, k = 0, 0, 0
if rr > 0 then
  r = level(v[1], v[2], rr, rc)
  local need = math.min(1, rc)
  if r < need then wait = math.max(wait, (need - r) / rr) end
end
if tr > 0 then
  k = level(v[3], v[4], tr, tc)
  local need = math.min(amount, tc)
  if k < need then wait = math.max(wait, (need - k) / tr) end
end
if wait > 0 then
  -- a bucket stored at a time ahead of this clock refills from now on: left as it was, it
  -- gained nothing until the clock caught up, refused all the while
  if rr > 0 and v[2] and tonumber(v[2]) > now then redis.call('HSET', KEYS[1], 'rt', tostring(now)) end
  if tr > 0 and v[4] and tonumber(v[4]) > now then redis.call('HSET', KEYS[1], 'kt', tostring(now)) end
  return tostring(wait) .. ' ' .. tostring(r) .. ' ' .. tostring(k)
end
if rr > 0 then
  r = r - 1
  redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', tostring(now))
end
if tr > 0 then
  k = k - amount
  redis.call('HSET', KEYS[1], 'k', tostring(k), 'kt', tostring(now))
end
keep(r, rr, rc, k, tr, tc)
return '0 ' .. tostring(r) .. ' ' .. tostring(k)
"""

# KEYS[1]: the tenant's bucket hash. ARGV: requests rate/s, requests capacity, requests to give
# back, tokens rate/s, tokens capacity, tokens to give back (negative: to take; a rate of 0: no
# such limit). Returns the two buckets' levels after it, as a string "requests tokens".
_REFUND = _BUCKETS + """
local rr, rc, rn, tr, tc, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local v = redis.call('HMGET', KEYS[1], 'r', 'rt', 'k', 'kt')
local r, k = level(v[1], v[2], rr, rc), level(v[3], v[4], tr, tc)
if rr > 0 and rn > 0 then
  r = math.min(rc, r + rn)
  redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', tostring(now))
end
if tr > 0 and amount ~= 0 then
  k = math.min(tc, k + amount)
  redis.call('HSET', KEYS[1], 'k', tostring(k), 'kt', tostring(now))
end
keep(r, rr, rc, k, tr, tc)
return tostring(r) .. ' ' .. tostring(k)
"""

# KEYS[1]: the session's key. ARGV: the proposed placement (JSON), its time to live in ms, the
# past-deadline mark.
# Returns the placement (the one recorded, else the proposal, now recorded; either way its
# expiry pushed back), or the past-deadline mark as it is (its expiry left alone).
_PLACE = """
local found = redis.call('GET', KEYS[1])
if found == ARGV[3] then return found end
if found then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return found
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""

# KEYS[1]: the usage hash. ARGV[1]: the writing process's incarnation; ARGV[2]: the seconds of
# silence after which an incarnation's fields are dropped; then pairs of a field (a tenant's name,
# NUL, the incarnation) and the service that process gave the tenant so far. A field is only ever
# raised: a write that lands late (its answer timed out, a newer one went first) or is sent again
# never lowers it nor adds twice, as an increment did. Each incarnation's last write is its field
# NUL + incarnation, on Redis's clock; the fields of one silent for ARGV[2] (a process gone) are
# dropped, else the hash grew by a field per tenant at every restart, read at every sync. Dropping
# loses nothing: the readers keep the highest they read, and a process that was only cut off
# writes its totals again. The hash itself expires after ARGV[2] without a write (every process
# gone, a deployment retired or given another prefix): it stayed for good. Its fields would all be
# dropped by then, so that loses nothing either. Returns the hash's fields and values, flat.
_SHARE_USAGE = """
local now = tonumber(redis.call('TIME')[1])
redis.call('HSET', KEYS[1], '\\0' .. ARGV[1], now)
redis.call('EXPIRE', KEYS[1], ARGV[2])
for i = 3, #ARGV, 2 do
  local stored = redis.call('HGET', KEYS[1], ARGV[i])
  if not stored or tonumber(stored) < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
local flat = redis.call('HGETALL', KEYS[1])
local silent = {}
for i = 1, #flat, 2 do
  if string.byte(flat[i], 1) == 0 and now - tonumber(flat[i + 1]) > tonumber(ARGV[2]) then
    silent[string.sub(flat[i], 2)] = true
  end
end
if next(silent) == nil then return flat end
local kept = {}
for i = 1, #flat, 2 do
  local incarnation = string.match(flat[i], '%z([^%z]*)$')
  if incarnation and silent[incarnation] then
    redis.call('HDEL', KEYS[1], flat[i])
  else
    kept[#kept + 1] = flat[i]
    kept[#kept + 1] = flat[i + 1]
  end
end
return kept
"""

#: Seconds after its last fair-share write that a process's fields in the usage hash are dropped
#: (`_SHARE_USAGE`): long enough that a process cut off from Redis for a while is not dropped (its
#: totals, written again, would read as new service to a peer started meanwhile: charged twice).
USAGE_SILENCE_S = 3600

#: What a session's key holds once it passed its deadline (never a placement's JSON).
_PAST_DEADLINE = "past-deadline"


#: Seconds a Redis command may take to connect or to answer: a Redis that stops answering (a
#: frozen host, a dropped network) held every call's end for redis-py's default (5 s from
#: redis-py 8, none before: the calls hung) where it now gets a 503 soon.
REDIS_TIMEOUT_S = 1.0


class RedisState(SharedState):
    """State shared by every gateway instance that names the same Redis (and `prefix`);
    `instance` names this one (its own service is counted apart)."""

    def __init__(self, limits: Mapping[str, RateLimit], url: str, *, instance: str, prefix: str = "fleetsched") -> None:
        import redis.asyncio as redis

        super().__init__(limits)
        try:
            # Timeouts the URL names win (``?socket_timeout=5``): redis-py reads them last.
            self._redis = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        except ValueError as exc:  # not a Redis URL: the operator's to fix, not a traceback
            raise ConfigError("gateway.redis_url", str(exc)) from exc
        split = urlsplit(url)
        database = split.path.strip("/")
        if split.scheme in ("redis", "rediss") and database and not database.isdigit():
            # redis-py reads a database that is no number as none: database 0, another's state
            raise ConfigError("gateway.redis_url", f"the database is a number (redis://host:port/0), got {database!r}")
        self._prefix = prefix
        self._usage = f"{prefix}:usage"
        # This process's own service per tenant since it started, written to `_usage` under
        # fields of its own (the tenant's name, NUL, `_incarnation`) at each `peer_usage`. It is
        # a total, not an increment, so that no call waits on Redis for it (a Redis that stopped
        # answering held every answer's end for REDIS_TIMEOUT_S), and a write that times out yet
        # lands later counts nothing twice. Per process, not per `instance` name: one restarted under the
        # same name counts from 0 again, which its old fields' totals would hide.
        self._own: dict[str, float] = {}
        self._incarnation = f"{instance.replace(chr(0), '')}:{secrets.token_hex(6)}".encode()  # no NUL
        # Per peer process (incarnation), the highest total read of each tenant's field: a field
        # that is gone (the hash lost with a Redis restarted without persistence, flushed or
        # evicted; its writer gone for good) still counts what it held, and one written again by
        # its writer, which counts on from its own memory, is counted from there on. The peers'
        # service never reads lower, so the fair-share sync never stops charging it until it
        # made up a loss.
        self._peers: dict[bytes, dict[str, float]] = {}
        # A peer process missing from the hash since when (this process's clock); once missing
        # for USAGE_SILENCE_S it is gone, and its totals move to `_gone`, per tenant: kept per
        # process, they grew by a field per tenant with every peer ever started, summed at
        # every sync, for as long as this process ran.
        self._missing_since: dict[bytes, float] = {}
        self._gone: dict[str, float] = {}
        self._take = self._redis.register_script(_TAKE)
        self._refund = self._redis.register_script(_REFUND)
        self._place = self._redis.register_script(_PLACE)
        self._share_usage = self._redis.register_script(_SHARE_USAGE)
        self._closed = False

    @property
    def shared(self) -> bool:
        return True

    async def unavailable(self) -> str | None:
        try:
            await self._redis.ping()
        except Exception as exc:
            return str(StateUnavailable.from_error(exc))
        return None

    def _bucket(self, tenant: str) -> str:
        return f"{self._prefix}:bucket:{tenant}"

    async def take(self, tenant: str, tokens: float) -> Taken:
        limit = self.limits.get(tenant)
        if limit is None:
            return Taken(0.0)
        rpm, tpm = limit.requests_per_minute or 0.0, limit.tokens_per_minute or 0.0
        answer = await self._take(keys=[self._bucket(tenant)], args=[rpm / 60, rpm, tpm / 60, tpm, float(tokens)])
        wait, requests, tokens_left = (float(x) for x in answer.split())
        return Taken(wait, _level(rpm, requests), _level(tpm, tokens_left))

    async def refund(self, tenant: str, tokens: float, *, request: bool = False) -> Taken | None:
        limit = self.limits.get(tenant)
        if limit is None:
            return None
        rpm, tpm = limit.requests_per_minute or 0.0, limit.tokens_per_minute or 0.0
        requests = 1.0 if request and rpm else 0.0
        # Negative too: a call that used more than its charge up front (a prompt longer than its
        # estimate) is charged the rest, as in memory; dropped here, a tenant got several times
        # its tokens per minute with such prompts.
        tokens = float(tokens) if tpm and not math.isnan(tokens) else 0.0
        if not (requests or tokens):
            return None
        answer = await self._refund(keys=[self._bucket(tenant)], args=[rpm / 60, rpm, requests, tpm / 60, tpm, tokens])
        requests_left, tokens_left = (float(x) for x in answer.split())
        return Taken(0.0, _level(rpm, requests_left), _level(tpm, tokens_left))

    def count_usage(self, tenant: str, cost: float) -> None:
        self._own[tenant] = self._own.get(tenant, 0.0) + cost

    async def add_usage(self, tenant: str, cost: float) -> None:
        self.count_usage(tenant, cost)
        await self._share()

    async def peer_usage(self) -> dict[str, float]:
        flat = await self._share()
        usage: dict[str, float] = {}
        present: set[bytes] = set()
        for field, value in zip(flat[::2], flat[1::2]):
            # The tenant's name runs up to the last NUL: an incarnation holds none.
            tenant, nul, incarnation = field.rpartition(b"\x00")
            if not nul:
                continue  # no field of this layout
            present.add(incarnation)
            if not tenant:
                continue  # an incarnation's last write
            name = tenant.decode()
            usage.setdefault(name, 0.0)  # a tenant only this instance served: 0
            if incarnation != self._incarnation:
                totals = self._peers.setdefault(incarnation, {})
                totals[name] = max(totals.get(name, 0.0), float(value))
        self._forget_peers_gone(present)
        for tenant, value in self._gone.items():
            usage[tenant] = usage.get(tenant, 0.0) + value
        for totals in self._peers.values():
            for tenant, value in totals.items():
                usage[tenant] = usage.get(tenant, 0.0) + value
        return usage

    def _forget_peers_gone(self, present: set[bytes]) -> None:
        """Move the totals of the peer processes missing from the hash for USAGE_SILENCE_S to
        `_gone` (their sum is unchanged): about twice that long after a process's last write
        (the hash drops one silent for USAGE_SILENCE_S), or that long after a Redis restarted
        without persistence lost the hash (a live peer writes its totals again within a sync
        period). One cut off from Redis that long and back is counted again, as a peer started
        meanwhile counts it."""
        now = anyio.current_time()
        for incarnation in self._peers.keys() - present:
            since = self._missing_since.setdefault(incarnation, now)
            if now - since >= USAGE_SILENCE_S:
                del self._missing_since[incarnation]
                for tenant, total in self._peers.pop(incarnation).items():
                    self._gone[tenant] = self._gone.get(tenant, 0.0) + total
        for incarnation in present & self._missing_since.keys():
            del self._missing_since[incarnation]

    async def _share(self) -> list[bytes]:
        """Write this process's service so far (each field only raised; all of it each time,
        so that a hash lost meanwhile has it back), and read the hash."""
        args: list[str | bytes] = [self._incarnation, str(USAGE_SILENCE_S)]
        for tenant, total in self._own.items():
            args += [tenant.encode() + b"\x00" + self._incarnation, repr(total)]
        flat: list[bytes] = await self._share_usage(keys=[self._usage], args=args)
        return flat

    def _session(self, session: str) -> str:
        return f"{self._prefix}:session:{session}"

    async def place(self, session: str, proposal: Placement, ttl_s: float) -> Placement | None:
        args = [json.dumps(asdict(proposal)), _milliseconds(ttl_s), _PAST_DEADLINE]
        raw = (await self._place(keys=[self._session(session)], args=args)).decode()
        return None if raw == _PAST_DEADLINE else Placement(**json.loads(raw))

    async def mark_past_deadline(self, session: str, ttl_s: float) -> None:
        await self._redis.set(self._session(session), _PAST_DEADLINE, px=_milliseconds(ttl_s))

    async def forget(self, session: str) -> None:
        await self._redis.delete(self._session(session))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._own:  # the service counted since the last fair-share sync, for the peers
                with anyio.move_on_after(2 * REDIS_TIMEOUT_S):
                    try:
                        await self._share()
                    except Exception:
                        pass  # Redis away: the peers miss at most a sync period of service
            await self._redis.aclose()


def _level(per_minute: float, left: float) -> Level | None:
    """A bucket's level as the take script read it (None: no such limit)."""
    if not per_minute:
        return None
    return Level(per_minute, left, max(0.0, (per_minute - left) * 60 / per_minute))


def _milliseconds(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def create_state(
    limits: Mapping[str, RateLimit], redis_url: str | None, *, instance: str, prefix: str = "fleetsched"
) -> SharedState:
    """`RedisState` when `redis_url` is set, else `MemoryState`."""
    if redis_url:
        return RedisState(limits, redis_url, instance=instance, prefix=prefix)
    return MemoryState(limits)
