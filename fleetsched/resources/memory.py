"""Memory pools: the admission gate that says whether memory for a session exists.

`MemoryPool` holds the discipline every pool shares, after anyio's `CapacityLimiter`:

- ``reserve_nowait()`` places a reservation at once or raises `WouldBlock` (`QuotaWouldBlock`
  when only the tenant's own quota is full). It never barges past a waiter of the same or a
  better priority.
- ``acquire()`` / ``reserve()`` wait, FIFO within a priority (lower value first, like vLLM), and
  freed memory is handed straight to the waiters in that order. A cancelled waiter removes
  itself, and if it had already been handed a reservation it releases it to the next.
- A request no device could ever hold fails at once with `RequestTooLarge`; one larger than the
  tenant's whole quota with `QuotaExceeded`.
- ``Reservation.release()`` is idempotent.
- ``ends_at`` (reserve, acquire, reserve_nowait) is a hint: when the owner expects to release
  the reservation, on any clock the owner keeps to (the scheduler's is ``anyio.current_time()``).
  The default placement puts a hinted request beside reservations expected to end about when it
  does, so that their memory comes free together (see `FragAware`). Wrong hints cost
  fragmentation, never correctness.
- ``set_device_limit()`` lets a device's reservations hold less than its capacity (its memory
  shrank under the pool): what it holds past the limit stays, and it takes nothing more until
  releases bring it under.
- ``resize_nowait()`` grows or shrinks a reservation (in place when it can, else by moving it on
  its device); it does not queue behind waiters, since the session growing is already running.
- ``fragmentation_failures`` counts distinct requests refused while some device had enough free
  bytes in total, within its limit (one refused for a limit was refused for capacity): a request
  retried (a waiter on every release, or a ``reserve_nowait`` retried with the same `owner`)
  counts once until it is granted, or until its owner gives up (``forget``).

Subclasses decide placement only: `_place` finds room for a size on some device, `_unplace`
gives it back, `_resize` grows or shrinks in place or moves, `_device_statistics` reports per
device. `CountingPool` is the simple one (no
address space, no fragmentation); the fragmentation-aware allocators live beside it.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections import Counter, OrderedDict
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio

from ..errors import QuotaExceeded, QuotaWouldBlock, RequestTooLarge, WouldBlock

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device's memory for sessions: a GPU, or one vLLM replica's KV cache."""

    name: str
    capacity: int

    def __post_init__(self) -> None:
        capacity = _positive_bytes(self.capacity, f"device {self.name!r}: capacity")
        object.__setattr__(self, "capacity", capacity)  # numpy's integers as an int


class Reservation:
    """Memory held by one owner on one device. Release it once; further releases do nothing."""

    __slots__ = ("pool", "owner", "tenant", "nbytes", "size", "device", "offset", "priority", "ends_at", "released_by", "_movable", "_released")

    def __init__(
        self,
        pool: MemoryPool,
        owner: object,
        tenant: str | None,
        nbytes: int,
        size: int,
        device: str,
        offset: int,
        priority: int,
        ends_at: float | None = None,
    ) -> None:
        self.pool = pool
        self.owner = owner
        self.tenant = tenant
        self.nbytes = nbytes  #: bytes asked for
        self.size = size  #: bytes held (nbytes rounded up by the placement strategy)
        self.device = device
        self.offset = offset
        self.priority = priority
        self.ends_at = ends_at  #: when its owner expects to release it (a placement hint), or None
        #: Who releases it, when that is not whoever holds it (the scheduler, for a session's
        #: memory): `release()` then refuses, and that one calls ``pool.release(reservation)``.
        self.released_by: str | None = None
        self._movable = False
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def movable(self) -> bool:
        """True while the owner is idle (in a tool call, say), so a compaction may move it.

        The owner sets it; while it is True the pool may change `offset` (after calling its
        move callback, see `ExtentPool.set_move_callback`). Setting it back to False may move it
        one last time first; if the move callback raises then, the error propagates and the
        reservation is pinned all the same.
        """
        return self._movable

    @movable.setter
    def movable(self, value: bool) -> None:
        value = bool(value)
        if value == self._movable:
            return
        self.pool._check_not_moving("setting a reservation's movable flag")
        try:
            if not value and not self._released:
                self.pool._pinning(self)  # its last chance to move: it is still idle
        finally:  # pinned even if a move callback raised
            self._movable = value
            if not self._released:
                self.pool._movable_changed(self, value)

    def release(self) -> None:
        if self.released_by is not None:
            # An agent that gave its session's memory back ran on without it: the pool then
            # admitted sessions into memory the agent's model calls still used.
            raise RuntimeError(f"{self!r} is released by {self.released_by}")
        self.pool.release(self)

    def resize_nowait(self, nbytes: int) -> bool:
        """Grow or shrink to `nbytes`; see `MemoryPool.resize_nowait`. True if it moved."""
        return self.pool.resize_nowait(self, nbytes)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Reservation {self.size:,} B on {self.device}@{self.offset} for {self.owner!r} {state}>"


@dataclass(frozen=True, slots=True)
class DeviceStatistics:
    """One device's memory. `total`, `free`, `largest_free` and the fragmentation figures are
    of the device as the pool was built (allocated + free == total), a limit or not; what a
    limit (`MemoryPool.set_device_limit`) lets reservations take of the free memory is `usable`:
    a request fits now only within both `largest_free` and `usable`."""

    name: str
    total: int
    allocated: int
    #: Bytes not reserved, those past a limit included.
    free: int
    largest_free: int
    #: The seeds' fragmentation rate, (free - largest free) / free; 0 when nothing is free.
    fragmentation: float
    #: 1 - sqrt(sum free_i^2) / sum free_i over all free extents; 0 for one extent.
    external_fragmentation: float
    #: Bytes held beyond what was asked, from rounding.
    internal_fragmentation: int
    reservations: int
    #: Free bytes its limit lets reservations take (whole pages, on a paged device): `free`
    #: without a limit, 0 while it holds as much as its limit or more.
    usable: int
    #: The bytes `MemoryPool.set_device_limit` lets it hold; None: no limit (all of `total`).
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryStatistics:
    total: int
    allocated: int
    free: int
    largest_free: int
    waiting: int
    #: Requests refused although some device had that much free in total (within its limit).
    fragmentation_failures: int
    devices: tuple[DeviceStatistics, ...]
    by_tenant: Mapping[str, int] = field(default_factory=dict)
    #: Compactions made by the pool itself (to place a request, or past its threshold).
    compactions: int = 0
    #: Reservations moved and bytes copied by those compactions.
    moves: int = 0
    moved_bytes: int = 0
    #: The devices' `DeviceStatistics.usable`: free bytes their limits let reservations take
    #: (`free` less what lies past a limit).
    usable: int = 0

    @property
    def fragmentation(self) -> float:
        """The seeds' rate over the pool: each device's free bytes outside its largest free
        extent, over all free bytes (free memory split between devices is not fragmentation:
        an empty pool of two devices reads 0)."""
        return sum(d.free - d.largest_free for d in self.devices) / self.free if self.free else 0.0


@dataclass(slots=True, eq=False)
class _Waiter:
    nbytes: int
    owner: object
    tenant: str | None
    priority: int
    seq: int
    device: str | None
    event: anyio.Event
    ends_at: float | None = None
    result: Reservation | None = None
    error: Exception | None = None  # refused while it waited (its quota lowered below it)


def _whole_bytes(nbytes: object, verb: str) -> int:
    """`nbytes` as an int (numpy's integers too); raises TypeError for a size that is not a whole
    number of bytes (a float would make the pool's counts floats) and ValueError for one <= 0."""
    try:
        whole = operator.index(nbytes)  # type: ignore[arg-type]
    except TypeError:
        whole = None
    if whole is None or isinstance(nbytes, bool):
        raise TypeError(f"a reservation must {verb} a whole number of bytes, got {nbytes!r}")
    if whole <= 0:
        raise ValueError(f"a reservation must {verb} > 0 bytes, got {whole}")
    return whole


def _positive_bytes(nbytes: object, what: str) -> int:
    """`nbytes` as an int, for a setting (a quota, a capacity, a page size): a whole number of
    bytes > 0, else ValueError naming `what` (nan would switch a quota off, a float page size
    make the pool's counts floats)."""
    try:
        return _whole_bytes(nbytes, "hold")
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a whole number of bytes > 0, got {nbytes!r}") from None


def _valid_ends_at(ends_at: object) -> float | None:
    """`ends_at` as a float, or None; raises TypeError / ValueError naming a hint that is not a
    finite number (NaN would compare false with every neighbour's and place at random)."""
    if ends_at is None:
        return None
    if isinstance(ends_at, bool) or not isinstance(ends_at, (int, float)):
        raise TypeError(f"ends_at: expected a number (when the owner expects to release), got {ends_at!r}")
    try:
        hint = float(ends_at)
    except OverflowError:  # an int beyond any float
        hint = math.inf
    if not math.isfinite(hint):
        raise ValueError(f"ends_at: expected a finite number, got {ends_at!r:.80}")
    return hint


def _valid_quota(tenant: str, nbytes: object) -> int:
    if not isinstance(tenant, str):  # a reservation's tenant None is no tenant: its quota would never hold
        raise TypeError(f"memory quota: expected a tenant's name, got {tenant!r:.80}")
    return _positive_bytes(nbytes, f"memory quota of tenant {tenant!r}")


class MemoryPool(ABC):
    """Base of every pool: quotas, waiters and accounting. Subclasses decide placement."""

    def __init__(self, devices: Sequence[DeviceSpec], *, quotas: Mapping[str, int] | None = None) -> None:
        if not devices:
            raise ValueError("a memory pool needs at least one device")
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        self.devices = tuple(devices)
        self._quotas: dict[str, int] = {tenant: _valid_quota(tenant, quota) for tenant, quota in (quotas or {}).items()}
        self._moving = False  # a move callback runs: the pool refuses changes meanwhile
        self._by_tenant: dict[str, int] = {}
        self._allocated: dict[str, int] = {d.name: 0 for d in devices}
        #: Devices that may hold less than their capacity (`set_device_limit`): bytes, by name.
        self._limits: dict[str, int] = {}
        self._live: set[Reservation] = set()
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._listeners: list[Callable[[], None]] = []
        self._movable_count: dict[str, int] = {d.name: 0 for d in devices}
        self.fragmentation_failures = 0
        self.compactions = self.moves = self.moved_bytes = 0
        # Requests refused for fragmentation and not granted since, so a retry counts once.
        self._refused: OrderedDict[object, None] = OrderedDict()

    # -- placement, for subclasses ------------------------------------------------------------

    @abstractmethod
    def _place(self, nbytes: int, device: str | None, ends_at: float | None = None) -> tuple[str, int, int] | None:
        """Find room for `nbytes`: return (device, offset, size held) or None if none fits now.

        `device` is a preferred device (affinity); a strategy may still place elsewhere.
        `ends_at` is the owner's hint of when it releases (see the module docstring).
        """

    @abstractmethod
    def _unplace(self, reservation: Reservation) -> None:
        """Give the reservation's extent back (coalescing is the subclass's business)."""

    def _resize(self, reservation: Reservation, nbytes: int) -> tuple[int, int] | None:
        """Make `reservation` hold room for `nbytes` on its device: (offset, size held) or None.

        Growing stays in place when the room after it is free, else moves; shrinking frees the
        tail. Called with the pool's counters still at the old size. The default suits pools
        without an address space.
        """
        if nbytes <= reservation.size:
            return reservation.offset, nbytes
        if self._free_bytes(reservation.device) < nbytes - reservation.size:
            return None
        return reservation.offset, nbytes

    def _free_bytes(self, device: str) -> int:
        """Bytes free on `device`, contiguous or not."""
        return self._device_capacity(device) - self._allocated[device]

    def _device_capacity(self, device: str) -> int:
        return next(d.capacity for d in self.devices if d.name == device)

    def _held(self, nbytes: int, device: str) -> int:
        """Bytes a reservation of `nbytes` holds on `device`, rounded as placement rounds it."""
        return nbytes

    def _within_limit(self, device: str, more: int) -> bool:
        """Whether `device` may hold `more` bytes than it does (`set_device_limit`)."""
        limit = self._limits.get(device)
        return limit is None or self._allocated[device] + more <= limit

    def _open_bytes(self, device: str) -> int:
        """Bytes free on `device` that its limit lets reservations take."""
        limit = self._limits.get(device)
        free = self._free_bytes(device)
        return free if limit is None else max(0, min(free, limit - self._allocated[device]))

    def _fits_unplaced(self, nbytes: int, device: str) -> bool:
        """Whether `device` has `nbytes` free in total and its limit lets it hold them as placed
        (rounded): a request refused there was refused for fragmentation, not for capacity."""
        return self._free_bytes(device) >= nbytes and self._within_limit(device, self._held(nbytes, device))

    def _device_statistics(self) -> tuple[DeviceStatistics, ...]:
        held = Counter(r.device for r in self._live)
        stats = []
        for d in self.devices:
            allocated = self._allocated[d.name]
            free = d.capacity - allocated
            stats.append(
                DeviceStatistics(
                    d.name, d.capacity, allocated, free, free, 0.0, 0.0, 0, held[d.name], self._open_bytes(d.name), self._limits.get(d.name)
                )
            )
        return tuple(stats)

    # -- public API ------------------------------------------------------------------------------

    @property
    def largest_device(self) -> int:
        return max(d.capacity for d in self.devices)

    def set_quota(self, tenant: str, nbytes: int | None) -> None:
        """Cap the bytes `tenant` may hold at once (None removes the cap).

        A quota counts the bytes its reservations asked for, not what placement rounds them up
        to (pages, a buddy block, a size class): the rounding depends on the device each lands
        on, and a tenant is not charged for the pool's choice of device."""
        self._check_not_moving("changing a quota")
        if nbytes is None:
            self._quotas.pop(tenant, None)
            self._released_memory()  # waiters the quota held back may fit now
            return
        whole = self._quotas[tenant] = _valid_quota(tenant, nbytes)
        for waiter in [w for w in self._waiters if w.tenant == tenant and w.nbytes > whole]:  # can never fit now
            self._waiters.remove(waiter)
            waiter.error = QuotaExceeded(tenant, waiter.nbytes, whole)
            waiter.event.set()
        self._released_memory()  # a raised quota may let waiters in

    def set_device_limit(self, device: str, nbytes: int | None) -> None:
        """Let the reservations on `device` hold at most `nbytes` of it (None: all of it).

        For a device whose memory changed under the pool (a vLLM replica restarted with a smaller
        KV cache). Reservations it holds past a lowered limit stay: it takes no new one, and
        grows none, until enough of them are released; requests go to other devices meanwhile.
        Devices keep the size the pool was built with: a limit at or above it is no limit. A
        request over every device's limit (not over every device's size, which `check` refuses at
        once) waits, as for memory held, until a limit is raised: the device may come back.
        Statistics count the memory past a limit as free, and apart as not `usable`
        (`DeviceStatistics`). Raises ValueError for an unknown device or a negative limit."""
        self._check_not_moving("limiting a device")
        if device not in self._allocated:
            raise ValueError(f"unknown device {device!r}; this pool's devices: {', '.join(self._allocated)}")
        if nbytes is not None:
            try:
                whole = operator.index(nbytes)
            except TypeError:
                whole = None
            if whole is None or isinstance(nbytes, bool):
                raise TypeError(f"device {device!r}: a limit must be a whole number of bytes or None, got {nbytes!r}")
            if whole < 0:
                raise ValueError(f"device {device!r}: a limit must be >= 0 bytes, got {whole}")
            nbytes = whole
        if nbytes is None or nbytes >= self._device_capacity(device):
            self._limits.pop(device, None)
        else:
            self._limits[device] = nbytes
        self._released_memory()  # a raised limit may let waiters in

    def device_limit(self, device: str) -> int | None:
        """The bytes `set_device_limit` lets `device` hold, or None where it has no limit."""
        return self._limits.get(device)

    def check(self, nbytes: int, tenant: str | None = None) -> int:
        """Raise at once if `nbytes` could never be granted: not a whole number of bytes, too
        large, or over the whole quota. Returns it as an int."""
        nbytes = _whole_bytes(nbytes, "ask for")
        if tenant is not None and not isinstance(tenant, str):  # it keys the quotas and statistics
            raise TypeError(f"tenant: expected a tenant's name, got {tenant!r:.80}")
        if nbytes > self.largest_device:
            raise RequestTooLarge(nbytes, self.largest_device)
        quota = self._quotas.get(tenant) if tenant is not None else None
        if quota is not None and nbytes > quota:
            raise QuotaExceeded(tenant or "", nbytes, quota)
        return nbytes

    def reserve_nowait(
        self,
        nbytes: int,
        *,
        owner: object = None,
        tenant: str | None = None,
        priority: int = 0,
        device: str | None = None,
        ends_at: float | None = None,
    ) -> Reservation:
        """Place a reservation now, or raise `WouldBlock` / `QuotaWouldBlock`.

        Retrying after a refusal with the same (hashable) `owner` counts one fragmentation failure.
        """
        priority = self._check_placement(priority, device)
        ends_at = _valid_ends_at(ends_at)
        return self._reserve_nowait(nbytes, owner, tenant, priority, device, key=owner, ends_at=ends_at)

    def _check_not_moving(self, change: str) -> None:
        """Refuse a change of the pool made from inside a move callback (its move is half made)."""
        if self._moving:
            raise RuntimeError(f"{change} from inside a move callback: make the change after the callback returns")

    def _check_placement(self, priority: int, device: str | None) -> int:
        """Refuse a reservation's device and priority if wrong; the priority as an int (numpy's
        integers are taken, as for sizes)."""
        self._check_not_moving("reserving")
        if device is not None:
            if not isinstance(device, str):
                raise TypeError(f"device: expected a device name, got {device!r:.80}")
            if device not in self._allocated:
                raise ValueError(f"unknown device {device!r}; this pool's devices: {', '.join(self._allocated)}")
        try:
            whole = operator.index(priority)
        except TypeError:
            whole = None
        if whole is None or isinstance(priority, bool):
            raise TypeError(f"priority: expected an integer (lower is sooner), got {priority!r}")
        return whole

    def _reserve_nowait(
        self,
        nbytes: int,
        owner: object,
        tenant: str | None,
        priority: int,
        device: str | None,
        *,
        key: object,
        ends_at: float | None = None,
    ) -> Reservation:
        nbytes = self.check(nbytes, tenant)
        if any(w.priority <= priority and not self._quota_blocks(w.tenant, w.nbytes) for w in self._waiters):
            raise WouldBlock(f"{len(self._waiters)} reservation(s) already waiting ahead")
        if self._quota_blocks(tenant, nbytes):
            raise QuotaWouldBlock(
                f"tenant {tenant!r} holds {self._by_tenant.get(tenant or '', 0):,} of its "
                f"{self._quotas[tenant or '']:,} byte quota; {nbytes:,} more do not fit"
            )
        held_before = self._by_tenant.get(tenant or "", 0)
        moves = self.moves
        try:
            reservation = self._try_place(nbytes, owner, tenant, priority, device, key=key, ends_at=ends_at)
        except BaseException:  # a move callback raised, compacting to make room for it
            self._serve_after_partial_moves(moves)
            raise
        if reservation is None:
            # Not "contiguous bytes free": a buddy or size-class pool may have them and still refuse
            # the request, rounded up to its block or class.
            raise WouldBlock(f"no device has room for {nbytes:,} bytes now")
        try:
            self._took_quota(tenant, held_before)
        except BaseException:  # a move callback or listener raised: the caller gets no reservation
            self.release(reservation)
            raise
        return reservation

    def resize_nowait(self, reservation: Reservation, nbytes: int) -> bool:
        """Make `reservation` hold `nbytes` on its device; return True if it moved (new offset).

        Grows in place when the memory after it is free, else moves it to a new extent on the
        same device. A move, as every move the pool makes, calls the move callback first
        (`ExtentPool.set_move_callback`), which copies the data ``memmove``-style (the new extent
        may overlap the old) before the pages left can go to anyone else; if it raises, the
        reservation stays as it was and the error propagates. Shrinking frees the tail and hands
        it to waiters; the memory that comes free may have the pool move idle reservations, this
        one among them (a move callback that raises then propagates out of the resize, which is
        made, as out of a release). Raises `WouldBlock` when the device has no room, `QuotaWouldBlock` when
        the tenant's quota is full, `RequestTooLarge` / `QuotaExceeded` when `nbytes` could never
        fit, ValueError for a released reservation or one of another pool.
        """
        _check_reservation(reservation)
        if reservation.pool is not self or reservation._released:
            raise ValueError(f"cannot resize {reservation!r}: not a live reservation of this pool")
        self._check_not_moving("resizing a reservation")
        nbytes = _whole_bytes(nbytes, "hold")
        capacity = self._device_capacity(reservation.device)
        if nbytes > capacity:
            raise RequestTooLarge(nbytes, capacity, reservation.device)
        tenant = reservation.tenant
        quota = self._quotas.get(tenant) if tenant is not None else None
        delta = nbytes - reservation.nbytes
        if quota is not None and nbytes > quota and delta > 0:  # a shrink only gives back
            raise QuotaExceeded(tenant or "", nbytes, quota)
        if delta > 0 and self._quota_blocks(tenant, delta):
            raise QuotaWouldBlock(
                f"tenant {tenant!r} holds {self._by_tenant.get(tenant or '', 0):,} of its "
                f"{quota or 0:,} byte quota; growing by {delta:,} does not fit"
            )
        old_size, old_offset = reservation.size, reservation.offset
        if not self._within_limit(reservation.device, self._held(nbytes, reservation.device) - old_size):
            raise WouldBlock(
                f"device {reservation.device} is limited to {self._limits[reservation.device]:,} bytes (it holds "
                f"{self._allocated[reservation.device]:,}): no room to grow {reservation!r} to {nbytes:,} bytes"
            )
        moves = self.moves
        try:
            placed = self._resize(reservation, nbytes)
        except BaseException:  # a move callback raised
            self._serve_after_partial_moves(moves)
            raise
        if placed is None:
            if self._free_bytes(reservation.device) + old_size >= nbytes:
                self._count_refusal(reservation)
            raise WouldBlock(f"device {reservation.device} has no room to grow {reservation!r} to {nbytes:,} bytes")
        self._refused.pop(reservation, None)
        offset, size = placed
        moved = offset != reservation.offset
        reservation.offset, reservation.size, reservation.nbytes = offset, size, nbytes
        self._resized(reservation)
        self._allocated[reservation.device] += size - old_size
        if tenant is not None:
            self._by_tenant[tenant] += delta
            if delta > 0:
                self._took_quota(tenant, self._by_tenant[tenant] - delta)
        # Memory, or only quota, came free; a grow that moved freed the extent it left, which
        # may join a free neighbour into a run a waiter fits in.
        if size < old_size or delta < 0 or moved:
            self._released_memory()
        return reservation.offset != old_offset  # settling may have moved it too

    async def acquire(
        self,
        nbytes: int,
        *,
        owner: object = None,
        tenant: str | None = None,
        priority: int = 0,
        device: str | None = None,
        ends_at: float | None = None,
    ) -> Reservation:
        """Wait for a reservation, FIFO within `priority`. Cancel-safe."""
        nbytes = self.check(nbytes, tenant)
        priority = self._check_placement(priority, device)
        ends_at = _valid_ends_at(ends_at)
        waiter = _Waiter(nbytes, owner, tenant, priority, next(self._seq), device, anyio.Event(), ends_at)
        try:
            return self._reserve_nowait(nbytes, owner, tenant, priority, device, key=waiter, ends_at=ends_at)
        except WouldBlock:
            pass
        self._waiters.append(waiter)
        self._waiters.sort(key=lambda w: (w.priority, w.seq))
        try:
            await waiter.event.wait()
        except BaseException:
            try:
                if waiter.result is not None:
                    waiter.result.release()
                elif waiter.error is None:  # still in the line (set_quota takes out those it refuses)
                    self._waiters.remove(waiter)
                    self._refused.pop(waiter, None)
                    # Serve the waiters behind it, and tell the listeners: a waiter ahead holds back
                    # `reserve_nowait` (a scheduler's admission), which may get in now.
                    self._released_memory()
            except Exception:  # a move callback or listener failed: not this waiter's to raise
                logger.exception("memory pool: serving the waiters after %r gave up failed", waiter.owner)
            raise
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    @asynccontextmanager
    async def reserve(
        self,
        nbytes: int,
        *,
        owner: object = None,
        tenant: str | None = None,
        priority: int = 0,
        device: str | None = None,
        ends_at: float | None = None,
    ) -> AsyncIterator[Reservation]:
        """``async with pool.reserve(n, owner=...) as r:`` holds `r` for the block."""
        reservation = await self.acquire(nbytes, owner=owner, tenant=tenant, priority=priority, device=device, ends_at=ends_at)
        try:
            yield reservation
        finally:
            reservation.release()

    def release(self, reservation: Reservation) -> None:
        """Give a reservation back and hand the memory to waiters. Idempotent. ValueError for a
        reservation of another pool (this one's memory is not its to give back)."""
        _check_reservation(reservation)
        if reservation.pool is not self:
            raise ValueError(f"cannot release {reservation!r}: a reservation of another pool")
        if reservation._released:
            return
        self._check_not_moving("releasing a reservation")
        reservation._released = True
        if reservation._movable:
            self._movable_count[reservation.device] -= 1
        self._live.discard(reservation)
        self._refused.pop(reservation, None)
        self._unplace(reservation)
        self._allocated[reservation.device] -= reservation.size
        if reservation.tenant is not None:
            self._by_tenant[reservation.tenant] -= reservation.nbytes
        self._released_memory()

    def forget(self, owner: object) -> None:
        """`owner` gave up its request without being granted: stop remembering its refusal.

        A request refused for fragmentation is remembered by its `owner` until it is granted, so
        that its retries count once in ``fragmentation_failures``. Without this call the owner
        of one given up (a session that ended in the queue) stays referenced until 65,536 later
        refusals push it out. A waiter of `acquire` that gives up needs no call."""
        try:
            self._refused.pop(owner, None)
        except TypeError:  # an unhashable owner is never remembered
            pass

    def _released_memory(self) -> None:
        """Memory came free (a release, a shrink, a compaction): serve waiters, tell listeners."""
        self._serve()

    def _serve_after_partial_moves(self, moves: int) -> None:
        """A move callback raised while the pool made room by moving reservations: the moves made
        before it stay made (`self.moves` was `moves`), and may have joined free runs that a
        waiter fits in. Serve the waiters and tell the listeners; the callback's error is the one
        that propagates, so a second failure is only logged."""
        if self.moves == moves:
            return
        try:
            self._released_memory()
        except Exception:
            logger.exception("memory pool: serving the waiters after a failed move failed")

    def _serve(self) -> None:
        """Serve the waiters and tell the listeners (the line may have moved)."""
        failed: BaseException | None = None
        moves = self.moves
        try:
            self._wake()
        except Exception as exc:  # a move callback failed placing a waiter: the listeners still hear
            failed = exc
            if self.moves != moves:  # the moves made before the failing one may let waiters in
                try:
                    self._wake()
                except Exception:
                    logger.exception("memory pool: serving the waiters after a failed move failed")
        for listener in list(self._listeners):
            try:
                listener()
            except Exception as exc:  # the others still hear of it; the first error propagates after
                failed = failed or exc
        if failed is not None:
            raise failed

    def add_release_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (synchronously) after every release, and after a waiter gives up,
        so admission can retry."""
        if not callable(callback):  # taken, it made every later release fail
            raise TypeError(f"callback: expected a function, got {callback!r:.80}")
        self._listeners.append(callback)

    def remove_release_listener(self, callback: Callable[[], None]) -> None:
        if callback not in self._listeners:
            raise ValueError(f"callback: {callback!r:.80} is not a release listener of this pool")
        self._listeners.remove(callback)

    def reservations(self) -> list[Reservation]:
        """Live reservations, in no particular order."""
        return list(self._live)

    def statistics(self) -> MemoryStatistics:
        devices = self._device_statistics()
        return MemoryStatistics(
            total=sum(d.total for d in devices),
            allocated=sum(d.allocated for d in devices),
            free=sum(d.free for d in devices),
            largest_free=max(d.largest_free for d in devices),
            waiting=len(self._waiters),
            fragmentation_failures=self.fragmentation_failures,
            devices=devices,
            by_tenant={t: n for t, n in self._by_tenant.items() if n},
            compactions=self.compactions,
            moves=self.moves,
            moved_bytes=self.moved_bytes,
            usable=sum(d.usable for d in devices),
        )

    # -- internals -------------------------------------------------------------------------------

    def _pinning(self, reservation: Reservation) -> None:
        """Called while `reservation` is still movable, just before its owner pins it."""

    def _resized(self, reservation: Reservation) -> None:
        """Called once a resize has given `reservation` its new offset and size, before the
        memory that came free is settled and handed to waiters."""

    def _movable_changed(self, reservation: Reservation, movable: bool) -> None:
        self._movable_count[reservation.device] += 1 if movable else -1

    def _place_by_moving(self, nbytes: int, device: str | None) -> tuple[str, int, int] | None:
        """Last resort before a fragmentation refusal: move movable reservations to make room.

        None by default (pools without an address space never fragment).
        """
        return None

    def _quota_blocks(self, tenant: str | None, nbytes: int) -> bool:
        quota = self._quotas.get(tenant) if tenant is not None else None
        return quota is not None and self._by_tenant.get(tenant or "", 0) + nbytes > quota

    def _took_quota(self, tenant: str | None, held_before: int) -> None:
        """`tenant` took more memory than the `held_before` bytes it held, outside `_wake`. A
        waiter of its own that this pushed over its quota no longer holds the line (`_wake` and
        `reserve_nowait` pass over such waiters), so those behind it may get in now."""
        quota = self._quotas.get(tenant) if tenant is not None else None
        if quota is None:
            return
        held = self._by_tenant.get(tenant or "", 0)
        if any(w.tenant == tenant and held_before + w.nbytes <= quota < held + w.nbytes for w in self._waiters):
            self._serve()

    #: Refused requests remembered at most, so owners that give up do not leak memory.
    _REFUSED_MEMORY = 65536

    def _count_refusal(self, key: object) -> None:
        """Count a fragmentation failure, once per distinct request (`key`; None: always)."""
        if key is None:
            self.fragmentation_failures += 1
            return
        try:
            if key in self._refused:
                return
            self._refused[key] = None
        except TypeError:  # an unhashable owner: cannot recognise its retries
            self.fragmentation_failures += 1
            return
        self.fragmentation_failures += 1
        if len(self._refused) > self._REFUSED_MEMORY:
            self._refused.popitem(last=False)

    def _try_place(
        self,
        nbytes: int,
        owner: object,
        tenant: str | None,
        priority: int,
        device: str | None,
        *,
        key: object = None,
        ends_at: float | None = None,
    ) -> Reservation | None:
        placed = self._place(nbytes, device, ends_at)
        if placed is None and any(self._fits_unplaced(nbytes, d.name) for d in self.devices):
            placed = self._place_by_moving(nbytes, device)
            if placed is None:
                self._count_refusal(key)
        if placed is None:
            return None
        if key is not None:
            try:
                self._refused.pop(key, None)
            except TypeError:
                pass
        name, offset, size = placed
        reservation = Reservation(self, owner, tenant, nbytes, size, name, offset, priority, ends_at)
        self._allocated[name] += size
        if tenant is not None:
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + nbytes
        self._live.add(reservation)
        return reservation

    def _wake(self) -> None:
        """Hand freed memory to waiters in order; stop at the first that does not fit."""
        for waiter in list(self._waiters):
            if waiter.event.is_set() or self._quota_blocks(waiter.tenant, waiter.nbytes):
                continue
            reservation = self._try_place(
                waiter.nbytes, waiter.owner, waiter.tenant, waiter.priority, waiter.device, key=waiter, ends_at=waiter.ends_at
            )
            if reservation is None:
                return
            self._waiters.remove(waiter)
            waiter.result = reservation
            waiter.event.set()


class CountingPool(MemoryPool):
    """The simple pool: per-device byte counters, no address space and so no fragmentation.

    Places on the preferred device when it fits, else on the device with the most free bytes.
    """

    def _place(self, nbytes: int, device: str | None, ends_at: float | None = None) -> tuple[str, int, int] | None:
        free = {d.name: self._open_bytes(d.name) for d in self.devices}
        if device is not None and free.get(device, 0) >= nbytes:
            return device, 0, nbytes
        name = max(free, key=free.__getitem__)
        return (name, 0, nbytes) if free[name] >= nbytes else None

    def _unplace(self, reservation: Reservation) -> None:
        pass


def _check_reservation(value: object) -> None:
    """Raise TypeError unless `value` is a `Reservation` (None raised a bare AttributeError)."""
    if not isinstance(value, Reservation):
        raise TypeError(f"reservation: expected a Reservation, got {value!r:.80}")
