"""Compaction planning: a pure function from extent layouts to a list of moves and their gain.

`plan_compaction(layouts, threshold)` looks at every device whose fragmentation rate,
(free - largest free) / free, exceeds `threshold` and plans, over the movable extents only:

1. a slide: movable extents, in address order, move down to the end of the extent before them,
   so each run between unmovable extents packs at its low end;
2. a fill: from the top down, a movable extent jumps into the best-fitting hole below it (the
   holes a slide leaves in front of unmovable extents);
3. a second slide, to close what the fill opened; the fill and this slide are dropped when
   they leave a smaller largest free extent than the first slide did.

Every move's destination is free when the move runs, given the moves before it, except that it
may overlap the extent's own source (copy ``memmove``-style, as a compacting collector does). A
device's moves are kept only if they enlarge its largest free extent. Nothing here touches a pool:
`ExtentPool.apply_plan` carries a plan out.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from .extents import AddressSpace


@dataclass(frozen=True, slots=True)
class ExtentView:
    """One live extent, in pages. `key` is opaque to the planner (the pool puts the reservation)."""

    key: object
    offset: int
    length: int
    movable: bool


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    name: str
    pages: int
    extents: tuple[ExtentView, ...]


@dataclass(frozen=True, slots=True)
class Move:
    """Move the extent of `key` on `device` from page `src` to page `dst` (`length` pages)."""

    key: object
    device: str
    src: int
    dst: int
    length: int


@dataclass(frozen=True, slots=True)
class DeviceGain:
    device: str
    largest_free_before: int
    largest_free_after: int
    fragmentation_before: float
    fragmentation_after: float
    moved_pages: int


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    moves: tuple[Move, ...]
    #: One entry per device that was over the threshold (with or without moves).
    gains: tuple[DeviceGain, ...]

    @property
    def moved_pages(self) -> int:
        return sum(m.length for m in self.moves)

    def __bool__(self) -> bool:
        return bool(self.moves)


#: Holes tried per extent in the fill step (best fit among the smallest that fit below it).
_FILL_CANDIDATES = 32


def plan_compaction(
    layouts: list[DeviceLayout] | tuple[DeviceLayout, ...], *, threshold: float = 0.3, max_moved_pages: int | None = None
) -> CompactionPlan:
    """Plan moves for the devices fragmented beyond `threshold`; see the module docstring.

    `max_moved_pages` caps the pages moved over all devices (None: no cap). Raises ValueError
    for a `threshold` outside [0, 1] (at 1 nothing is planned: the rate stays below 1) or a
    negative cap.
    """
    if not 0.0 <= threshold <= 1.0:  # nan too: it would pass every device
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    if max_moved_pages is not None and max_moved_pages < 0:
        raise ValueError(f"max_moved_pages must be >= 0 or None, got {max_moved_pages}")
    moves: list[Move] = []
    gains: list[DeviceGain] = []
    budget = max_moved_pages
    for layout in layouts:
        space = _build(layout)
        before_largest, before_frag = space.largest_free, space.fragmentation
        if before_frag <= threshold:
            continue
        device_moves = _plan_device(layout, space, budget)
        if space.largest_free <= before_largest:
            gains.append(DeviceGain(layout.name, before_largest, before_largest, before_frag, before_frag, 0))
            continue
        moved = sum(m.length for m in device_moves)
        if budget is not None:
            budget -= moved
        moves.extend(device_moves)
        gains.append(DeviceGain(layout.name, before_largest, space.largest_free, before_frag, space.fragmentation, moved))
    return CompactionPlan(tuple(moves), tuple(gains))


def _build(layout: DeviceLayout) -> AddressSpace:
    space = AddressSpace(layout.pages)
    for e in layout.extents:
        space.allocate(e.offset, e.length)
    return space


def _plan_device(layout: DeviceLayout, space: AddressSpace, budget: int | None) -> list[Move]:
    """Simulate slide, fill, slide on `space` (changed in place); return the moves."""
    where = {id(e): e.offset for e in layout.extents}
    movable = [e for e in layout.extents if e.movable]
    moves: list[Move] = []

    def move(e: ExtentView, dst: int) -> bool:
        nonlocal budget
        if budget is not None:
            if budget < e.length:
                return False
            budget -= e.length
        src = where[id(e)]
        space.release(src)
        space.allocate(dst, e.length)
        where[id(e)] = dst
        moves.append(Move(e.key, layout.name, src, dst, e.length))
        return True

    def slide() -> None:
        cursor = 0
        for e in sorted(layout.extents, key=lambda e: where[id(e)]):
            offset = where[id(e)]
            if e.movable and offset > cursor and move(e, cursor):
                offset = cursor
            cursor = offset + e.length

    slide()
    slid, slid_largest = len(moves), space.largest_free
    for e in sorted(movable, key=lambda e: where[id(e)], reverse=True):
        offset = where[id(e)]
        holes = [(length, start) for length, start in islice(space.fits(e.length), _FILL_CANDIDATES) if start < offset]
        if holes:
            length, start = min(holes)
            if start + length <= offset:  # a hole that touches the extent is the slide's business
                move(e, start)
    slide()
    if space.largest_free < slid_largest:  # the fill scattered into the run the slide gathered
        for m in reversed(moves[slid:]):
            space.release(m.dst)
            space.allocate(m.src, m.length)
        del moves[slid:]
    return moves


@dataclass(frozen=True, slots=True)
class HolePlan:
    """Moves that open a free run of `length` pages at page `offset` of `device`."""

    device: str
    offset: int
    length: int
    moves: tuple[Move, ...]

    @property
    def moved_pages(self) -> int:
        return sum(m.length for m in self.moves)


#: Cheapest windows whose evictions are tried before giving up (each try is O(holes)).
_HOLE_TRIES = 16
#: Holes looked at per evicted extent (smallest first).
_HOLE_SCAN = 64


def plan_hole(
    layout: DeviceLayout, free: Sequence[tuple[int, int]], n: int, keep_clear: tuple[int, int] | None = None
) -> HolePlan | None:
    """The cheapest way found to open `n` contiguous free pages by moving movable extents only.

    `free` is the device's free extents, (offset, length) in address order. A candidate is a
    window of `n` pages (starting at a hole, ending at a hole's end, or starting at a movable
    extent) that no unmovable extent overlaps; its price is the pages of the extents it overlaps.
    Windows are tried cheapest first: each overlapped extent, largest first, goes to the
    smallest free run outside the window that holds it. When no window can be emptied that way
    (the free runs outside are too small for what the window holds, which is the common case
    once memory is tight), a stretch between unmovable extents is slid together instead, so
    its free pages gather at one end: see `_gather`. That moves more pages, so it comes second.
    Moves are valid in the order given (a move's destination is free once the moves before it
    are made, save for its own source). Returns None when neither way finds room, or when `n`
    pages already lie free in one run.

    `keep_clear`, (offset, length): free pages that the window may take in but no move may land
    in (a growing reservation's old extent: its data is there until it is copied out).
    """
    if any(length >= n for _, length in free) or sum(length for _, length in free) < n or n > layout.pages:
        return None
    extents = sorted(layout.extents, key=lambda e: e.offset)
    starts = [e.offset for e in extents]
    starts_set: set[int] = set()
    for offset, length in free:
        starts_set.add(offset)
        starts_set.add(offset + length - n)
    starts_set.update(e.offset for e in extents if e.movable)
    priced: list[tuple[int, int, list[ExtentView]]] = []
    for a in starts_set:
        if a < 0 or a + n > layout.pages:
            continue
        i = bisect_right(starts, a) - 1
        if i < 0 or extents[i].offset + extents[i].length <= a:
            i += 1
        over: list[ExtentView] = []
        while i < len(extents) and extents[i].offset < a + n:
            if not extents[i].movable:
                break
            over.append(extents[i])
            i += 1
        else:
            priced.append((sum(e.length for e in over), a, over))
    priced.sort(key=lambda p: (p[0], p[1]))
    by_size = sorted((length, offset) for offset, length in _outside(free, keep_clear))
    for _, a, over in priced[:_HOLE_TRIES]:
        moves = _evict(layout.name, by_size, a, a + n, over)
        if moves is not None:
            return HolePlan(layout.name, a, n, tuple(moves))
    top = _gather(layout, extents, n)
    mirrored = _mirror(layout)
    bottom = _gather(mirrored, list(mirrored.extents), n)
    plans = []
    if top is not None:
        plans.append((top[0], HolePlan(layout.name, top[1], n, tuple(top[2]))))
    if bottom is not None:
        moves = tuple(_unmirror(layout.pages, m) for m in bottom[2])
        plans.append((bottom[0], HolePlan(layout.name, layout.pages - bottom[1] - n, n, moves)))
    if keep_clear is not None:
        lo, hi = keep_clear[0], keep_clear[0] + keep_clear[1]
        plans = [(cost, plan) for cost, plan in plans if not any(m.dst < hi and lo < m.dst + m.length for m in plan.moves)]
    return min(plans, key=lambda p: p[0])[1] if plans else None


def _outside(free: Sequence[tuple[int, int]], keep_clear: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The free runs, (offset, length), less the pages of `keep_clear`."""
    if keep_clear is None:
        return list(free)
    lo, hi = keep_clear[0], keep_clear[0] + keep_clear[1]
    runs = []
    for offset, length in free:
        for start, end in ((offset, min(offset + length, lo)), (max(offset, hi), offset + length)):
            if end > start:
                runs.append((start, end - start))
    return runs


def _evict(device: str, by_size: list[tuple[int, int]], lo: int, hi: int, over: list[ExtentView]) -> list[Move] | None:
    """Place every extent of `over` in free pages outside ``[lo, hi)``; None if one does not fit."""
    used: dict[int, int] = {}  # free run start -> pages already given out from its low end
    moves = []
    for e in sorted(over, key=lambda e: -e.length):
        first = bisect_left(by_size, (e.length, -1))
        for length, offset in islice(by_size, first, first + _HOLE_SCAN):
            pieces = [(offset, min(offset + length, lo)), (max(offset, hi), offset + length)]
            for start, end in pieces:
                begin = start + used.get(start, 0)
                if end - begin >= e.length:
                    used[start] = begin + e.length - start
                    moves.append(Move(e.key, device, e.offset, begin, e.length))
                    break
            else:
                continue
            break
        else:
            return None
    return moves


@dataclass(slots=True)
class _Stretch:
    """Pages between two unmovable extents (or a device end): movable extents and free runs."""

    start: int
    end: int
    held: list[ExtentView]  #: the movable extents in it, in address order
    runs: list[list[int]]  #: its free runs, [offset, length], shrinking from the low end as used
    #: Once repacked (its extents slid down to `start`): the first free page, the rest being free.
    packed: int | None = None
    #: Whether an extent was sent into one of its free runs (then it cannot be repacked: the
    #: plan's slides would have to move that extent too).
    filled: bool = False

    @property
    def free(self) -> int:
        return self.end - self.packed if self.packed is not None else sum(length for _, length in self.runs)


def _stretches(pages: int, extents: list[ExtentView]) -> list[_Stretch]:
    """Split a device (extents in address order) at its unmovable extents."""
    out: list[_Stretch] = []
    start, held = 0, []
    for e in [*extents, ExtentView(None, pages, 0, False)]:
        if e.movable:
            held.append(e)
            continue
        runs, cursor = [], start
        for h in held:
            if h.offset > cursor:
                runs.append([cursor, h.offset - cursor])
            cursor = h.offset + h.length
        if e.offset > cursor:
            runs.append([cursor, e.offset - cursor])
        if e.offset > start:
            out.append(_Stretch(start, e.offset, held, runs))
        start, held = e.offset + e.length, []
    return out


def _gather(layout: DeviceLayout, extents: list[ExtentView], n: int) -> tuple[int, int, list[Move]] | None:
    """Open `n` pages at the top of one stretch by sliding its extents down: (cost, offset, moves).

    Extents of the stretch that no longer fit below the window move to other stretches: into a
    free run that holds them, else to the top of another stretch, itself slid down first. Only
    the `_HOLE_TRIES` stretches with the most free pages are tried; the cheapest plan (pages
    moved) wins. Moves are valid in the order given: the other stretches' slides, then the
    extents leaving, then this stretch's slide.
    """
    stretches = _stretches(layout.pages, extents)
    tall = [s for s in stretches if s.end - s.start >= n]
    best: tuple[int, int, list[Move]] | None = None
    for target in sorted(tall, key=lambda s: -s.free)[:_HOLE_TRIES]:
        window = target.end - n
        # Keep the largest extents that fit below the window: the small ones find room elsewhere.
        room, staying = window - target.start, set()
        for e in sorted(target.held, key=lambda e: -e.length):
            if e.length <= room:
                staying.add(id(e))
                room -= e.length
        slides, leaving, cursor = [], [], target.start
        for e in target.held:
            if id(e) in staying:
                if e.offset != cursor:
                    slides.append(Move(e.key, layout.name, e.offset, cursor, e.length))
                cursor += e.length
            else:
                leaving.append(e)
        others = [_Stretch(s.start, s.end, s.held, [list(r) for r in s.runs]) for s in stretches if s is not target]
        moves = _send_away(layout.name, others, leaving)
        if moves is None:
            continue
        moves += slides
        cost = sum(m.length for m in moves)
        if best is None or cost < best[0]:
            best = (cost, window, moves)
    return best


def _send_away(device: str, stretches: list[_Stretch], leaving: list[ExtentView]) -> list[Move] | None:
    """Place `leaving` (largest first) in `stretches`; return the moves, or None if one has no room.

    Each goes to the smallest free run that holds it; failing that, to the stretch with enough
    free pages that is cheapest to repack (one already repacked costs nothing more).
    """
    slides: list[Move] = []
    arrivals: list[Move] = []
    for e in sorted(leaving, key=lambda e: -e.length):
        runs = [(r[1], k, r) for k, s in enumerate(stretches) if s.packed is None for r in s.runs if r[1] >= e.length]
        if runs:
            _, k, run = min(runs, key=lambda x: (x[0], x[1]))
            arrivals.append(Move(e.key, device, e.offset, run[0], e.length))
            run[0] += e.length
            run[1] -= e.length
            stretches[k].filled = True
            continue
        roomy = [s for s in stretches if s.free >= e.length and not s.filled]
        if not roomy:
            return None
        s = min(roomy, key=lambda s: (0 if s.packed is not None else _slide_cost(s.start, s.held), s.free))
        if s.packed is None:
            cursor = s.start
            for h in s.held:
                if h.offset != cursor:
                    slides.append(Move(h.key, device, h.offset, cursor, h.length))
                cursor += h.length
            s.packed = cursor
        arrivals.append(Move(e.key, device, e.offset, s.packed, e.length))
        s.packed += e.length
    return slides + arrivals


def _mirror(layout: DeviceLayout) -> DeviceLayout:
    """The device seen upside down: an extent at `offset` lies at ``pages - offset - length``."""
    flipped = (ExtentView(e.key, layout.pages - e.offset - e.length, e.length, e.movable) for e in layout.extents)
    return DeviceLayout(layout.name, layout.pages, tuple(sorted(flipped, key=lambda e: e.offset)))


def _unmirror(pages: int, move: Move) -> Move:
    return Move(move.key, move.device, pages - move.src - move.length, pages - move.dst - move.length, move.length)


def _slide_cost(start: int, held: list[ExtentView]) -> int:
    """Pages moved by sliding `held` (address order) down to `start`."""
    moved, cursor = 0, start
    for e in held:
        if e.offset != cursor:
            moved += e.length
        cursor += e.length
    return moved
