"""`ExtentPool`: a memory pool with a paged address space per device and a placement strategy.

Each device is an `AddressSpace` of fixed-size pages (``page_size`` bytes, 2 MiB by default); a
reservation holds one contiguous extent, its bytes rounded up to whole pages (and further by
strategies that round to classes). The rounding is reported as internal fragmentation.

Placement over several devices: a `device=` preference wins when the request fits there;
otherwise every device's strategy proposes an offset and the pool keeps the device whose
placement leaves the lowest fragmentation rate, then the least free memory (pack, so whole
devices stay free for large requests), then the device listed first. With ``spread``, the most
free memory instead: for devices that are engines of their own (vLLM replicas' KV caches, whose
sessions' calls go where their memory is), packed, one replica took every call while the others
stood idle.

Compaction, over reservations flagged `Reservation.movable` only, in four ways:

- settling (``settle``, on by default with ``compact``): whenever memory comes free away from the
  largest free run (a hole), or a reservation next to a hole becomes movable (its session went
  idle), the movable reservations between the hole and the largest free run slide across the
  hole, one extent at a time, until it joins that run (`settle.plan_slide`). Sessions alternate
  between model calls (pinned) and tool calls (movable), so holes stopped by a pinned session
  move on at its next tool call, and the device stays compact with no bulk compaction. A
  session about to be pinned slides past the hole beside it first, so as not to stop it. A hole
  that stays stopped is filled from the other side when it can be: a movable reservation at an
  edge of the largest free run moves into the best-fitting hole (`settle.plan_fill`).
- on demand (``compact=True``, the default): a request that fits nowhere contiguously although a
  device has enough free pages in total is not refused at once; `defrag.plan_hole` looks for the
  cheapest window to empty by moving movable reservations elsewhere (into free runs, or by
  sliding the reservations between two unmovable ones together), and the request is placed
  there. Only when no such window exists is it a fragmentation failure. The pages those moves
  leave outside the window are holes to settle, as are those any other move leaves.
- past a threshold (``compact_threshold``, whatever ``compact`` says): after memory comes free,
  every device whose fragmentation rate exceeds it is compacted with `defrag.plan_compaction`.
- by hand: `plan_compaction()` returns a plan, `apply_plan()` carries it out.

Every move calls the move callback (`set_move_callback`) before the reservation's offset changes,
so its owner can copy the data: those above, and a grow that must move (`resize_nowait`);
`statistics()` counts the compactions' and settling's moves and bytes moved.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .defrag import CompactionPlan, DeviceLayout, ExtentView, HolePlan, Move, plan_compaction, plan_hole
from .extents import AddressSpace
from .memory import DeviceSpec, DeviceStatistics, MemoryPool, Reservation, _check_reservation, _positive_bytes
from .settle import Neighbour, plan_fill, plan_slide
from .strategies import DEFAULT_STRATEGY, STRATEGIES, PlacementStrategy, make_strategy

DEFAULT_PAGE_SIZE = 2 << 20


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What `ExtentPool.apply_plan` did."""

    applied: int
    #: Moves left out because their reservation was released, became unmovable or was moved.
    skipped: int
    moved_bytes: int


class ExtentPool(MemoryPool):
    """A pool whose devices are paged address spaces; see the module docstring."""

    def __init__(
        self,
        devices: Sequence[DeviceSpec],
        *,
        strategy: str | PlacementStrategy = DEFAULT_STRATEGY,
        page_size: int = DEFAULT_PAGE_SIZE,
        quotas: Mapping[str, int] | None = None,
        compact: bool = True,
        compact_threshold: float | None = None,
        settle: bool | None = None,
        settle_moves: int | None = 2,
        move_callback: Callable[[Reservation, Move], None] | None = None,
        spread: bool = False,
    ) -> None:
        super().__init__(devices, quotas=quotas)
        #: Place on the device with the most free memory (see the module docstring), not the least.
        self.spread = spread
        if compact_threshold is not None and (
            isinstance(compact_threshold, bool)
            or not isinstance(compact_threshold, (int, float))
            or not 0.0 <= compact_threshold <= 1.0
        ):
            raise ValueError(f"compact_threshold must be a number in [0, 1] or None, got {compact_threshold!r}")
        self.compact = compact
        self.compact_threshold = compact_threshold
        #: Settle holes as they appear (see the module docstring); None: as `compact`.
        self.settle = compact if settle is None else settle
        #: Times settling moved something (its moves count in `moves` and `moved_bytes` too).
        self.settles = 0
        #: Of those, fills: a reservation at an edge of the largest free run moved into a hole.
        self.fills = 0
        if settle_moves is not None and (
            isinstance(settle_moves, bool) or not isinstance(settle_moves, int) or settle_moves < 1
        ):
            raise ValueError(f"settle_moves must be an integer >= 1 or None, got {settle_moves!r}")
        #: Moves one call (a release, a reservation turning movable) makes at most to settle;
        #: a hole left halfway waits for the next call. None: no limit.
        self.settle_moves = settle_moves
        self._holes: deque[tuple[str, int]] = deque()  # (device, a page of the hole) to settle
        self._move_callback = _check_move_callback(move_callback)
        self._compacting = False
        #: Times the pool looked for moves (to place a request, or past its threshold), moving or not.
        self.compaction_searches = 0
        self.page_size = page_size = _positive_bytes(page_size, "page size")
        if isinstance(strategy, str):
            strategy = make_strategy(strategy)
        elif not isinstance(strategy, PlacementStrategy):
            known = ", ".join(STRATEGIES)
            raise TypeError(f"strategy: expected a name ({known}) or a PlacementStrategy, got {strategy!r}")
        self.strategy = strategy
        self._spaces: dict[str, AddressSpace] = {}
        for d in self.devices:
            pages = d.capacity // page_size
            if pages == 0:
                raise ValueError(f"device {d.name!r} ({d.capacity:,} B) is smaller than one page ({page_size:,} B)")
            self._spaces[d.name] = AddressSpace(pages, address_index=self.strategy.address_index, capacity_pages=d.capacity / page_size)
        # Devices never change after this: the largest is read on every reservation (`check`).
        self._largest_device = max(s.pages for s in self._spaces.values()) * page_size
        self._internal: dict[str, int] = {d.name: 0 for d in self.devices}
        self._count: dict[str, int] = {d.name: 0 for d in self.devices}
        # Live reservations by their first page and by the page after their last, per device.
        self._starting: dict[str, dict[int, Reservation]] = {d.name: {} for d in self.devices}
        self._ending: dict[str, dict[int, Reservation]] = {d.name: {} for d in self.devices}

    def space(self, device: str) -> AddressSpace:
        """The address space of `device` (read it; change it only through the pool)."""
        return self._spaces[device]

    @property
    def largest_device(self) -> int:
        return self._largest_device

    def set_move_callback(self, callback: Callable[[Reservation, Move], None] | None) -> None:
        """Call ``callback(reservation, move)`` before the pool moves a reservation: a movable
        one (settling, compaction), or one growing where it cannot grow in place (`resize_nowait`).

        `move` gives pages (multiply by `page_size`); the reservation still has its old `offset`
        during the call and the new one after. If the callback raises, that move is undone and the
        exception propagates out of the call that moved it (a reserve, a release or a resize).
        TypeError for what is not a plain function (an ``async def`` one would never run: the
        pool moves in its synchronous calls).
        """
        self._move_callback = _check_move_callback(callback)

    # -- placement -------------------------------------------------------------------------------

    def _pages(self, nbytes: int, space: AddressSpace) -> int:
        return self.strategy.round(-(-nbytes // self.page_size), space)

    def _place(self, nbytes: int, device: str | None, ends_at: float | None = None) -> tuple[str, int, int] | None:
        if device is not None and device in self._spaces:
            placed = self._place_on(device, nbytes, ends_at)
            if placed is not None:
                return placed
        best: tuple[tuple[float, int, int], str, int, int] | None = None
        for index, (name, space) in enumerate(self._spaces.items()):
            n = self._pages(nbytes, space)
            if n > space.largest_free or not self._within_limit(name, n * self.page_size):
                continue
            offset = self._choose(name, space, n, ends_at)
            if offset is None:
                continue
            if len(self._spaces) == 1:  # nothing to compare it with
                return self._commit(name, offset, n, nbytes)
            left = space.free_pages - n
            key = (self._fragmentation_after(space, offset, n), -left if self.spread else left, index)
            if best is None or key < best[0]:
                best = (key, name, offset, n)
        if best is None:
            return None
        _, name, offset, n = best
        return self._commit(name, offset, n, nbytes)

    def _place_on(self, name: str, nbytes: int, ends_at: float | None = None) -> tuple[str, int, int] | None:
        space = self._spaces[name]
        n = self._pages(nbytes, space)
        fits = n <= space.largest_free and self._within_limit(name, n * self.page_size)
        offset = self._choose(name, space, n, ends_at) if fits else None
        return None if offset is None else self._commit(name, offset, n, nbytes)

    def _choose(self, name: str, space: AddressSpace, n: int, ends_at: float | None) -> int | None:
        if ends_at is None:
            return self.strategy.choose(space, n)
        starting, ending = self._starting[name], self._ending[name]

        def apart(offset: int) -> float:
            """How far apart in time `n` pages at `offset` and the extents beside them end: the
            sum of the differences of their hints; free pages or the device's edge beside it
            count nothing, a reservation without a hint makes it inf (unknown)."""
            total = 0.0
            below, above = ending.get(offset), starting.get(offset + n)  # (called ~16 times a placement)
            if below is not None:
                if below.ends_at is None:
                    return math.inf
                total = abs(below.ends_at - ends_at)
            if above is not None:
                if above.ends_at is None:
                    return math.inf
                total += abs(above.ends_at - ends_at)
            return total

        return self.strategy.choose_near(space, n, apart)

    def _commit(self, name: str, offset: int, n: int, nbytes: int) -> tuple[str, int, int]:
        self._spaces[name].allocate(offset, n)
        size = n * self.page_size
        self._internal[name] += size - nbytes
        self._count[name] += 1
        return name, offset * self.page_size, size

    @staticmethod
    def _fragmentation_after(space: AddressSpace, offset: int, n: int) -> float:
        """The device's fragmentation rate if `n` pages at `offset` were taken."""
        hole = space.free_extent_containing(offset)
        assert hole is not None
        start, length = hole
        free = space.free_pages - n
        if free == 0:
            return 0.0
        largest = max(space.largest_other_than(start, length), offset - start, start + length - offset - n)
        return (free - largest) / free

    def _place_by_moving(self, nbytes: int, device: str | None) -> tuple[str, int, int] | None:
        if not self.compact:
            return None
        best: tuple[tuple[int, int, int], HolePlan] | None = None
        for index, (name, space) in enumerate(self._spaces.items()):
            n = self._pages(nbytes, space)
            if not self._movable_count[name] or space.free_pages < n or not self._within_limit(name, n * self.page_size):
                continue
            self.compaction_searches += 1
            plan = plan_hole(self._layout(name), list(space.free_extents()), n)
            if plan is not None:
                key = (plan.moved_pages, name != device, index)
                if best is None or key < best[0]:
                    best = (key, plan)
        if best is None:
            return None
        plan = best[1]
        self._open_hole(plan)
        return self._commit(plan.device, plan.offset, plan.length, nbytes)

    def _open_hole(self, plan: HolePlan) -> None:
        """Make `plan`'s moves: one compaction, counted as made also when a later move's callback
        raises. The pages the moves leave outside the room are holes, queued to settle as a
        release's are (a grow's settle at once; a new request's with the next release, or the
        next reservation turning idle)."""
        made = self.moves
        try:
            self._carry_out(plan.moves)
        finally:
            if self.moves > made:
                self.compactions += 1
            for move in plan.moves[: self.moves - made]:
                self._queue_left(move)

    def _queue_left(self, move: Move) -> None:
        """Queue the pages `move` left to settle, as a release's are: by both ends, since the room
        a move opens may then be taken over one end (what lies beyond it is the hole), and a
        later move may land on one end."""
        first, last = _first_page_left(move), _last_page_left(move)
        self._holes.append((move.device, first))
        if last != first:
            self._holes.append((move.device, last))

    def _carry_out(self, moves: tuple[Move, ...]) -> None:
        """Make `moves` (none overlapping another's destination); undo the failing one and raise."""
        for move in moves:
            r = move.key
            assert isinstance(r, Reservation)
            space = self._spaces[move.device]
            space.move(move.src, move.dst)
            self._notify_move(r, move, space)
            self._set_offset(r, move.dst)
            self.moves += 1
            self.moved_bytes += move.length * self.page_size

    def _notify_move(self, r: Reservation, move: Move, space: AddressSpace) -> None:
        if self._move_callback is None:
            return
        try:
            self._call_back(self._move_callback, r, move)
        except BaseException:
            space.move(move.dst, move.src)
            raise

    def _call_back(self, callback: Callable[[Reservation, Move], None], r: Reservation, move: Move) -> None:
        """Call a move callback; meanwhile the pool refuses changes (the move is half made)."""
        self._moving = True
        try:
            copied = callback(r, move)
            if inspect.isawaitable(copied):  # an async callback's copy would run after the pages are reused, if ever
                if inspect.iscoroutine(copied):
                    copied.close()  # not awaited, on purpose: no "never awaited" warning
                raise TypeError(f"move callback {callback!r:.80} returned an awaitable: it must copy the data before it returns")
        finally:
            self._moving = False

    # -- the index of live extents and settling ------------------------------------------------

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
        reservation = super()._try_place(nbytes, owner, tenant, priority, device, key=key, ends_at=ends_at)
        if reservation is not None:
            self._index(reservation)
        return reservation

    def resize_nowait(self, reservation: Reservation, nbytes: int) -> bool:
        _check_reservation(reservation)
        live = reservation.pool is self and not reservation.released
        if live:
            self._unindex(reservation)
        try:
            return super().resize_nowait(reservation, nbytes)
        finally:
            if live and not reservation.released:
                self._index(reservation)

    def _resized(self, reservation: Reservation) -> None:
        # Indexed again before settling runs: left out of the index, it stopped the slide of the
        # hole its own shrink (or its move) left beside it, as if it were pinned, and that hole
        # left the queue for good (it is movable already: nothing would bring it back).
        self._index(reservation)

    def _index(self, r: Reservation) -> None:
        start = r.offset // self.page_size
        self._starting[r.device][start] = r
        self._ending[r.device][start + r.size // self.page_size] = r

    def _unindex(self, r: Reservation) -> None:
        start = r.offset // self.page_size
        end = start + r.size // self.page_size
        if self._starting[r.device].get(start) is r:
            del self._starting[r.device][start]
        if self._ending[r.device].get(end) is r:
            del self._ending[r.device][end]

    def _set_offset(self, r: Reservation, page: int) -> None:
        self._unindex(r)
        r.offset = page * self.page_size
        self._index(r)

    def _neighbour(self, r: Reservation | None) -> Neighbour | None:
        if r is None:
            return None
        return Neighbour(r, r.offset // self.page_size, r.size // self.page_size, r.movable)

    def _movable_changed(self, reservation: Reservation, movable: bool) -> None:
        super()._movable_changed(reservation, movable)
        if not movable or self._compacting:
            return
        # A request refused for fragmentation (a waiter, or the scheduler's queue, which retries
        # on the release listeners) may fit now by moving this reservation (`_place_by_moving`):
        # serve them as after a release, not only when settling moved something.
        if self.settle:
            self._settle_from(reservation.device, self._hole_beside(reservation), serve=self.compact)
        elif self.compact:
            super()._released_memory()

    def _pinning(self, reservation: Reservation) -> None:
        """A session about to be pinned (its tool call over, its model call next) moves one last
        time: the hole on its far side from the largest free run slides past it, so that it is
        not pinned where it would stop that hole (`fleetsched bench allocator`: mean fragmentation
        rate 4-25 % lower on the traces with idle sessions, at 1-7 % more bytes moved)."""
        if self.settle and not self._compacting:
            page = self._hole_beside(reservation)
            if page is not None:
                self._settle_from(reservation.device, page)

    def _settle_from(self, device: str, page: int | None, *, serve: bool = False) -> None:
        """Settle the hole at `page` (if any) first, then the holes queued; serve waiters if
        anything moved (or `serve`)."""
        if page is not None:
            self._holes.appendleft((device, page))
        try:
            moved = self._settle_holes(device)
        except BaseException:  # a move callback raised: the moves before it still count
            super()._released_memory()
            raise
        if moved or serve:
            super()._released_memory()  # larger free runs: serve waiters, tell listeners

    def _hole_beside(self, r: Reservation) -> int | None:
        """A page of the free run on the far side of `r` from its device's largest free run."""
        space = self._spaces[r.device]
        gap = space.largest_free_extent()
        start = r.offset // self.page_size
        if gap is None:
            return None
        if start < gap[0]:  # below the gap: the hole under r rises past it
            return start - 1 if space.free_length_before(start) else None
        end = start + r.size // self.page_size  # above it: the hole over r sinks past it
        return end if space.free_length_at(end) else None

    def _settle_holes(self, device: str | None = None) -> bool:
        """Slide movable extents across the queued holes, then fill, `settle_moves` moves in all.

        A hole whose slide stops at an unmovable extent leaves the queue (that extent turning
        movable brings it back); one stopped by the budget goes back to the front. Then, on
        `device` and on every device a queued hole was on, movable extents at the edges of the
        largest free run fill holes while the budget lasts. True if anything moved.
        """
        budget = self.settle_moves
        touched = [] if device is None else [device]
        moved = False
        while self._holes and (budget is None or budget > 0):
            name, page = self._holes.popleft()
            if name not in touched:
                touched.append(name)
            space = self._spaces[name]
            hole = space.free_extent_containing(page)
            gap = space.largest_free_extent()
            if hole is None or gap is None or hole[0] == gap[0]:
                continue
            starting, ending = self._starting[name], self._ending[name]
            moves = plan_slide(
                name,
                hole,
                gap,
                free_at=space.free_length_at,
                free_ending_at=space.free_length_before,
                starting_at=lambda page: self._neighbour(starting.get(page)),
                ending_at=lambda page: self._neighbour(ending.get(page)),
                max_moves=budget,
            )
            if not moves:
                continue
            self._settle_moves(moves)
            moved = True
            if budget is not None:
                budget -= len(moves)
                if budget == 0:  # perhaps stopped halfway: resume there next time
                    last = moves[-1]
                    self._holes.appendleft((name, last.dst + last.length if last.dst < last.src else last.src))
        for name in touched:
            while budget is None or budget > 0:
                move = self._plan_fill(name)
                if move is None:
                    break
                self._settle_moves([move])
                self.fills += 1
                moved = True
                if budget is not None:
                    budget -= 1
        return moved

    def _plan_fill(self, name: str) -> Move | None:
        space = self._spaces[name]
        if space.free_extent_count < 2:
            return None
        gap = space.largest_free_extent()
        assert gap is not None
        start, length = gap
        room = space.largest_other_than(start, length) * self.page_size
        # Checked here, as it is on almost every call (a release, a session going idle), so
        # that the common case, no movable edge that fits a hole, costs a few lookups.
        edges = [
            r
            for r in (self._ending[name].get(start), self._starting[name].get(start + length))
            if r is not None and r.movable and r.size <= room
        ]
        if not edges:
            return None

        def smallest_hole(n: int) -> tuple[int, int] | None:
            fit = space.smallest_fit(n, skip=start)
            return None if fit is None else (fit[1], fit[0])

        return plan_fill(name, gap, map(self._neighbour, edges), smallest_hole=smallest_hole)

    def _settle_moves(self, moves: list[Move]) -> None:
        self._compacting = True
        made = self.moves
        try:
            self._carry_out(tuple(moves))
        finally:
            self._compacting = False
            if self.moves > made:  # also when a later move's callback raised
                self.settles += 1

    def _released_memory(self) -> None:
        try:
            if not self._compacting:
                if self.settle:
                    self._settle_holes()
                else:
                    self._holes.clear()
                if self.compact_threshold is not None:
                    self._compact_over_threshold()
        finally:  # a move callback that raised stops the moves, not the waiters
            super()._released_memory()

    def _compact_over_threshold(self) -> None:
        threshold = self.compact_threshold
        assert threshold is not None
        over = [
            self._layout(name)
            for name, space in self._spaces.items()
            if self._movable_count[name] and space.fragmentation > threshold
        ]
        if not over:
            return
        self.compaction_searches += 1
        plan = plan_compaction(over, threshold=threshold)
        if not plan:
            return
        made: list[Move] = []  # counted as made, also when a later move's callback raises

        def counted(r: Reservation, move: Move) -> None:
            if self._move_callback is not None:
                self._move_callback(r, move)
            made.append(move)

        self._compacting = True
        try:
            self.apply_plan(plan, counted, _wake=False)
        finally:
            self._compacting = False
            if made:
                self.compactions += 1
                self.moves += len(made)
                self.moved_bytes += sum(m.length for m in made) * self.page_size

    def _layout(self, name: str) -> DeviceLayout:
        page = self.page_size
        views = tuple(ExtentView(r, r.offset // page, r.size // page, r.movable) for r in self._live if r.device == name)
        return DeviceLayout(name, self._spaces[name].pages, views)

    def _unplace(self, reservation: Reservation) -> None:
        self._unindex(reservation)
        self._spaces[reservation.device].release(reservation.offset // self.page_size)
        self._holes.append((reservation.device, reservation.offset // self.page_size))
        self._internal[reservation.device] -= reservation.size - reservation.nbytes
        self._count[reservation.device] -= 1

    def _resize(self, reservation: Reservation, nbytes: int) -> tuple[int, int] | None:
        space = self._spaces[reservation.device]
        old = reservation.size // self.page_size
        start = reservation.offset // self.page_size
        n = self._pages(nbytes, space)
        offset = start
        if n < old:
            space.truncate(start, n)
            self._holes.append((reservation.device, start + n))
        elif n > old and not space.try_extend(start, n):
            # Move: free the old extent first so the new one may reuse (overlap) it.
            space.release(start)
            found = self.strategy.choose(space, n) if n <= space.largest_free else None
            if found is None:
                try:
                    found = self._room_by_moving(reservation, start, old, n)
                except BaseException:  # a move's callback raised: the moves before it stay made
                    space.allocate(start, old)
                    raise
            if found is None:
                space.allocate(start, old)  # the freed run is still free: restore exactly
                return None
            space.allocate(found, n)
            if self._move_callback is not None and found != start:  # the data moves before the pages left can be reused
                try:
                    self._call_back(self._move_callback, reservation, Move(reservation, reservation.device, start, found, old))
                except BaseException:
                    space.release(found)
                    space.allocate(start, old)
                    raise
            offset = found
            left = max(start, found + n) if found < start else start  # what the new extent leaves of the old
            if left < start + old:
                self._holes.append((reservation.device, left))  # a hole to settle
        size = n * self.page_size
        self._internal[reservation.device] += (size - nbytes) - (reservation.size - reservation.nbytes)
        return offset * self.page_size, size

    def _room_by_moving(self, reservation: Reservation, start: int, old: int, n: int) -> int | None:
        """Open `n` free pages for `reservation`, which is growing and has freed its `old` pages at
        `start` (still holding its data), by moving idle reservations, as a new request gets room
        (`_place_by_moving`); the page the room starts at, or None. The room may take in its old
        pages, which nothing else moves into before its data is copied out."""
        device = reservation.device
        space = self._spaces[device]
        if not self.compact or not self._movable_count[device] or space.free_pages < n:
            return None
        self.compaction_searches += 1
        others = tuple(view for view in self._layout(device).extents if view.key is not reservation)
        plan = plan_hole(DeviceLayout(device, space.pages, others), list(space.free_extents()), n, keep_clear=(start, old))
        if plan is None:
            return None
        self._open_hole(plan)
        return plan.offset

    def _free_bytes(self, device: str) -> int:
        return self._spaces[device].free_pages * self.page_size

    def _held(self, nbytes: int, device: str) -> int:
        return self._pages(nbytes, self._spaces[device]) * self.page_size

    def _open_bytes(self, device: str) -> int:
        # Whole pages: a limit between two pages lets no reservation hold the part page.
        open_bytes = super()._open_bytes(device)
        return open_bytes - open_bytes % self.page_size

    def _device_capacity(self, device: str) -> int:
        return self._spaces[device].pages * self.page_size

    # -- statistics ------------------------------------------------------------------------------

    def _device_statistics(self) -> tuple[DeviceStatistics, ...]:
        page = self.page_size
        stats = []
        for name, space in self._spaces.items():
            stats.append(
                DeviceStatistics(
                    name=name,
                    total=space.pages * page,
                    allocated=space.used_pages * page,
                    free=space.free_pages * page,
                    largest_free=space.largest_free * page,
                    fragmentation=space.fragmentation,
                    external_fragmentation=space.external_fragmentation,
                    internal_fragmentation=self._internal[name],
                    reservations=self._count[name],
                    usable=self._open_bytes(name),
                    limit=self._limits.get(name),
                )
            )
        return tuple(stats)

    # -- compaction ------------------------------------------------------------------------------

    def layouts(self) -> list[DeviceLayout]:
        """Immutable views of every device's live extents, in pages, for the planner."""
        by_device: dict[str, list[ExtentView]] = {name: [] for name in self._spaces}
        for r in self._live:
            by_device[r.device].append(ExtentView(r, r.offset // self.page_size, r.size // self.page_size, r.movable))
        return [DeviceLayout(name, self._spaces[name].pages, tuple(views)) for name, views in by_device.items()]

    def plan_compaction(self, threshold: float = 0.3, *, max_moved_pages: int | None = None) -> CompactionPlan:
        """A compaction plan for every device whose fragmentation rate exceeds `threshold`."""
        return plan_compaction(self.layouts(), threshold=threshold, max_moved_pages=max_moved_pages)

    def apply_plan(
        self, plan: CompactionPlan, move_callback: Callable[[Reservation, Move], None] | None = None, *, _wake: bool = True
    ) -> ApplyResult:
        """Carry out `plan`'s moves in order; call ``move_callback(reservation, move)`` before each.

        Without `move_callback`, the pool's own (`set_move_callback`) is called.

        The callback moves the data (offsets in `move` are pages; multiply by `page_size`). A
        move is skipped when its reservation was released, is no longer movable, is no longer
        where the plan found it, or its destination is no longer free. If the callback raises,
        that move is not made and the exception propagates; earlier moves stay made. The pages
        the moves leave are holes that settling closes as it does a release's. Waiters are
        served and release listeners called afterwards, since larger holes may now exist. Raises
        RuntimeError when called from inside a move callback (that move is half made), TypeError
        for a `move_callback` that is not a plain function (see `set_move_callback`).
        """
        self._check_not_moving("applying a compaction plan")
        applied = skipped = moved = 0
        move_callback = _check_move_callback(move_callback) or self._move_callback
        try:
            for move in plan.moves:
                r = move.key
                if not isinstance(r, Reservation) or r.pool is not self or not self._movable_as_planned(r, move):
                    skipped += 1
                    continue
                space = self._spaces[move.device]
                space.release(move.src)
                hole = space.free_extent_containing(move.dst)
                if hole is None or move.dst + move.length > hole[0] + hole[1]:
                    space.allocate(move.src, move.length)
                    skipped += 1
                    continue
                space.allocate(move.dst, move.length)
                try:
                    if move_callback is not None:
                        self._call_back(move_callback, r, move)
                except BaseException:
                    space.move(move.dst, move.src)
                    raise
                self._set_offset(r, move.dst)
                self._queue_left(move)
                applied += 1
                moved += move.length * self.page_size
        finally:
            if applied and _wake:
                self._released_memory()
        return ApplyResult(applied, skipped, moved)

    def check_invariants(self) -> None:
        """Recount every device and raise AssertionError on a broken invariant.

        Each address space checks itself; its used extents must be exactly the live
        reservations', and the index of extents by first and last page must agree with them.
        """
        page = self.page_size
        for name, space in self._spaces.items():
            space.check()
            live = [r for r in self._live if r.device == name]
            assert sorted(space.used_extents()) == sorted((r.offset // page, r.size // page) for r in live)
            assert self._starting[name] == {r.offset // page: r for r in live}, f"{name}: index by first page"
            assert self._ending[name] == {(r.offset + r.size) // page: r for r in live}, f"{name}: index by end"
            assert self._movable_count[name] == sum(r.movable for r in live)

    def _movable_as_planned(self, r: Reservation, move: Move) -> bool:
        return (
            not r.released
            and r.movable
            and r.device == move.device
            and r.offset == move.src * self.page_size
            and r.size == move.length * self.page_size
        )


def _first_page_left(move: Move) -> int:
    """The first page `move` leaves free (its source less any overlap with its destination)."""
    return max(move.src, move.dst + move.length) if move.dst < move.src else move.src


def _last_page_left(move: Move) -> int:
    """The last page `move` leaves free."""
    return move.src + move.length - 1 if move.dst < move.src else min(move.src + move.length, move.dst) - 1


def _check_move_callback(callback: Callable[[Reservation, Move], None] | None) -> Callable[[Reservation, Move], None] | None:
    """`callback` if it is None or a plain function; TypeError otherwise. An ``async def`` one was
    taken and called without being awaited: the pool moved reservations whose data nobody copied."""
    if callback is not None and (not callable(callback) or inspect.iscoroutinefunction(callback)):
        raise TypeError(
            f"move callback: expected a function that copies the data before it returns, got {callback!r:.80}"
            + (" (an async function: the pool moves inside its synchronous calls)" if callable(callback) else "")
        )
    return callback
