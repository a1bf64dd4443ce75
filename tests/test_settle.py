"""Settling: holes slide towards the largest free run through movable reservations only, and
holes they cannot slide out of are filled from the edges of that run."""

import math

import anyio
import pytest

from fleetsched.resources import DeviceSpec, ExtentPool, Move
from fleetsched.resources.extents import AddressSpace
from fleetsched.resources.settle import Neighbour, plan_fill, plan_slide

PAGE = 1 << 20


def row(pages: int = 14, count: int = 5, **options) -> tuple[ExtentPool, list]:
    """`count` reservations of 2 pages from page 0 (first-fit), the rest of the device free."""
    options.setdefault("settle_moves", None)
    pool = ExtentPool([DeviceSpec("gpu0", pages * PAGE)], strategy="first-fit", page_size=PAGE, **options)
    held = [pool.reserve_nowait(2 * PAGE, owner=f"r{i}") for i in range(count)]
    return pool, held


def pages(*held) -> list[int]:
    return [r.offset // PAGE for r in held]


def free_runs(pool: ExtentPool) -> list[tuple[int, int]]:
    return list(pool.space("gpu0").free_extents())


# -- the planner (pure) ----------------------------------------------------------------------------


def layout_lookups(space: AddressSpace, extents: dict[int, tuple[str, int, bool]]) -> dict:
    """plan_slide's lookups over `space` and extents {offset: (key, length, movable)}."""
    by_start = {o: Neighbour(k, o, n, m) for o, (k, n, m) in extents.items()}
    by_end = {o + n: Neighbour(k, o, n, m) for o, (k, n, m) in extents.items()}
    return {
        "free_at": space.free_length_at,
        "free_ending_at": space.free_length_before,
        "starting_at": by_start.get,
        "ending_at": by_end.get,
    }


def test_plan_slide_moves_are_valid_in_order_and_join_the_gap():
    # [a 2][hole 2][b 3][c 1][hole 1][d 2][gap 9]: the hole rises past b, c (absorbing the 1-page
    # hole), then d; each move lands on free pages or its own.
    space = AddressSpace(20)
    extents = {0: ("a", 2, True), 4: ("b", 3, True), 7: ("c", 1, True), 9: ("d", 2, True)}
    for offset, (_, n, _) in extents.items():
        space.allocate(offset, n)
    moves = plan_slide("gpu0", (2, 2), (11, 9), **layout_lookups(space, extents))
    assert [(m.key, m.src, m.dst) for m in moves] == [("b", 4, 2), ("c", 7, 5), ("d", 9, 6)]
    for m in moves:
        space.move(m.src, m.dst)
    space.check()
    assert list(space.free_extents()) == [(8, 12)]


def test_plan_slide_stops_at_an_unmovable_extent_and_at_the_budget():
    space = AddressSpace(20)
    extents = {0: ("a", 2, True), 4: ("b", 3, True), 7: ("pin", 1, False), 9: ("d", 2, True)}
    for offset, (_, n, _) in extents.items():
        space.allocate(offset, n)
    lookups = layout_lookups(space, extents)
    assert [m.key for m in plan_slide("gpu0", (2, 2), (11, 9), **lookups)] == ["b"]
    assert plan_slide("gpu0", (2, 2), (11, 9), max_moves=0, **lookups) == []
    assert plan_slide("gpu0", (11, 9), (11, 9), **lookups) == []  # the gap itself: nothing to do


def test_plan_slide_downwards_above_the_gap():
    # [gap 8][a 2][hole 3][b 2][c 5]: above the gap, extents slide up and the hole sinks into it.
    space = AddressSpace(20)
    extents = {8: ("a", 2, True), 13: ("b", 2, True), 15: ("c", 5, True)}
    for offset, (_, n, _) in extents.items():
        space.allocate(offset, n)
    moves = plan_slide("gpu0", (10, 3), (0, 8), **layout_lookups(space, extents))
    assert [(m.key, m.src, m.dst) for m in moves] == [("a", 8, 11)]
    space.move(8, 11)
    assert list(space.free_extents()) == [(0, 11)]


def test_plan_slide_downwards_stops_once_the_hole_joins_the_gap():
    # [low 1][gap 5][m 2][hole 3]: one move of m joins the hole to the gap; low stays
    space = AddressSpace(11)
    extents = {0: ("low", 1, True), 6: ("m", 2, True)}
    for offset, (_, n, _) in extents.items():
        space.allocate(offset, n)
    assert [m.key for m in plan_slide("gpu0", (8, 3), (1, 5), **layout_lookups(space, extents))] == ["m"]


def test_plan_slide_downwards_carries_the_free_pages_it_passes_along():
    # [gap 4][a 2][free 1][b 2][hole 2]: the hole takes in the free page as it sinks past b
    space = AddressSpace(11)
    extents = {4: ("a", 2, True), 7: ("b", 2, True)}
    for offset, (_, n, _) in extents.items():
        space.allocate(offset, n)
    moves = plan_slide("gpu0", (9, 2), (0, 4), **layout_lookups(space, extents))
    assert [(m.key, m.src, m.dst) for m in moves] == [("b", 7, 9), ("a", 4, 7)]
    for m in moves:
        space.move(m.src, m.dst)
    assert list(space.free_extents()) == [(0, 7)]


def test_address_space_move_slides_and_falls_back():
    space = AddressSpace(12)
    space.allocate(0, 2)
    space.allocate(4, 3)
    space.move(4, 2)  # down across the free run below
    assert list(space.free_extents()) == [(5, 7)]
    space.move(2, 6)  # up across the free run above, overlapping its own pages
    assert list(space.free_extents()) == [(2, 4), (9, 3)]
    space.move(6, 9)
    space.move(9, 2)  # a jump: release and allocate
    assert list(space.free_extents()) == [(5, 7)]
    with pytest.raises(ValueError):
        space.move(2, 11)  # would run off the end
    assert space.used_length(2) == 3
    space.check()


def smallest_hole_but(space: AddressSpace, gap: tuple[int, int]):
    """plan_fill's lookup: the smallest free run of >= n pages other than `gap`."""

    def smallest_hole(n: int):
        return next(((o, length) for length, o in space.fits(n) if o != gap[0]), None)

    return smallest_hole


def test_plan_fill_takes_the_best_fit_and_leaves_the_rest_against_the_blocker():
    # [a 2][hole 3][pin 1][hole 2][pin 1][gap 7][d 2 movable][e 2]: d fits both holes below the
    # gap; the exact one wins.
    space = AddressSpace(20)
    for offset, n in ((0, 2), (5, 1), (8, 1), (16, 2), (18, 2)):
        space.allocate(offset, n)
    gap = (9, 7)
    d = Neighbour("d", 16, 2, True)
    edges = [Neighbour("pin", 8, 1, False), d]
    assert plan_fill("gpu0", gap, edges, smallest_hole=smallest_hole_but(space, gap)) == Move("d", "gpu0", 16, 6, 2)
    space.allocate(6, 2)  # that hole taken, d goes to the 3-page one, at its end away from the
    # gap: the page left stays against the pinned extent that stopped the hole's slide
    assert plan_fill("gpu0", gap, edges, smallest_hole=smallest_hole_but(space, gap)) == Move("d", "gpu0", 16, 2, 2)


def test_plan_fill_above_the_gap_goes_to_the_holes_top():
    # [b 3 movable][gap 5][pin 1][hole 4][pin 2][hole 3][c 2]
    space = AddressSpace(20)
    for offset, n in ((0, 3), (8, 1), (13, 2), (18, 2)):
        space.allocate(offset, n)
    gap = (3, 5)
    lookup = smallest_hole_but(space, gap)
    b = Neighbour("b", 0, 3, True)
    assert plan_fill("gpu0", gap, [b, None], smallest_hole=lookup) == Move("b", "gpu0", 0, 15, 3)
    two = Neighbour("two", 0, 2, True)  # a 2-page edge: the smallest hole that fits, at its top
    assert plan_fill("gpu0", gap, [two], smallest_hole=lookup) == Move("two", "gpu0", 0, 16, 2)


def test_plan_fill_prefers_the_longer_of_two_exact_fits():
    # [lo 3][gap 6][hi 2][pin 1][hole 2][pin 1][hole 3][pin 2]: both edges fit a hole exactly
    space = AddressSpace(20)
    for offset, n in ((0, 3), (9, 2), (11, 1), (14, 1), (18, 2)):
        space.allocate(offset, n)
    gap = (3, 6)
    edges = [Neighbour("lo", 0, 3, True), Neighbour("hi", 9, 2, True)]
    assert plan_fill("gpu0", gap, edges, smallest_hole=smallest_hole_but(space, gap)) == Move("lo", "gpu0", 0, 15, 3)


def test_plan_fill_needs_a_movable_edge_and_a_hole_it_fits():
    space = AddressSpace(12)
    for offset, n in ((0, 2), (3, 1), (10, 2)):
        space.allocate(offset, n)
    gap = (4, 6)  # the one other hole is 1 page
    lookup = smallest_hole_but(space, gap)
    assert plan_fill("gpu0", gap, [Neighbour("p", 3, 1, False), None], smallest_hole=lookup) is None
    assert plan_fill("gpu0", gap, [None, Neighbour("big", 10, 2, True)], smallest_hole=lookup) is None
    assert plan_fill("gpu0", gap, [Neighbour("one", 3, 1, True)], smallest_hole=lookup) == Move("one", "gpu0", 3, 2, 1)


def test_plan_fill_passes_over_an_edge_it_cannot_move_to_the_other_edge():
    space = AddressSpace(12)
    for offset, n in ((0, 1), (2, 2), (10, 1), (11, 1)):
        space.allocate(offset, n)
    gap = (4, 6)  # the one other hole is page 1
    lookup = smallest_hole_but(space, gap)
    one = Neighbour("one", 10, 1, True)
    for below in (Neighbour("pin", 2, 2, False), Neighbour("two", 2, 2, True)):  # pinned; fits no hole
        assert plan_fill("gpu0", gap, [below, one], smallest_hole=lookup) == Move("one", "gpu0", 10, 1, 1)


def test_smallest_fit_can_pass_over_one_extent():
    space = AddressSpace(20)
    for offset, n in ((2, 1), (6, 1), (11, 1)):
        space.allocate(offset, n)  # free: 0-1 (2), 3-5 (3), 7-10 (4), 12-19 (8)
    assert space.smallest_fit(3) == (3, 3)
    assert space.smallest_fit(3, skip=3) == (4, 7)
    assert space.smallest_fit(5, skip=12) is None  # only the skipped one is large enough
    assert space.smallest_fit(1, skip=12) == (2, 0)  # skip passes over that one extent only


# -- the pool --------------------------------------------------------------------------------------


def test_a_freed_hole_rises_to_the_gap_through_movable_reservations():
    pool, (r0, r1, r2, r3, r4) = row()
    seen = []
    pool.set_move_callback(lambda r, m: seen.append((r.owner, r.offset // PAGE, m.src, m.dst)))
    for r in (r2, r3, r4):
        r.movable = True
    assert not seen  # no hole yet
    r1.release()
    assert seen == [("r2", 4, 4, 2), ("r3", 6, 6, 4), ("r4", 8, 8, 6)]  # told before the offset changes
    assert pages(r0, r2, r3, r4) == [0, 2, 4, 6]
    assert free_runs(pool) == [(8, 6)] and pool.statistics().fragmentation == 0.0
    assert (pool.settles, pool.moves, pool.moved_bytes) == (1, 3, 6 * PAGE)
    pool.check_invariants()


def test_a_pinned_reservation_holds_the_hole_until_it_turns_movable():
    pool, (r0, r1, r2, r3, r4) = row()
    r2.movable = True
    r1.release()
    assert pages(r0, r2, r3, r4) == [0, 2, 6, 8]  # r2 slid; r3 is pinned, so the hole waits under it
    assert free_runs(pool) == [(4, 2), (10, 4)]  # (r4, at the gap's edge, is pinned too: no fill)
    r3.movable = True
    assert pages(r0, r2, r3, r4) == [0, 2, 4, 8]  # on to the next pinned one
    assert free_runs(pool) == [(6, 2), (10, 4)]
    r4.movable = True
    assert pages(r0, r2, r3, r4) == [0, 2, 4, 6]
    assert free_runs(pool) == [(8, 6)] and pool.fills == 0
    pool.check_invariants()


def test_a_reservation_about_to_be_pinned_slides_past_the_hole_beside_it_first():
    pool, (r0, r1, r2, r3, r4) = row(settle_moves=1)
    r1.movable = r2.movable = True
    r0.release()  # the one move slides r1 down; the hole, now under movable r2, waits
    assert pages(r1, r2) == [0, 4] and free_runs(pool) == [(2, 2), (10, 4)]
    r2.movable = False  # its tool call ends: one last slide before it is pinned
    assert pages(r1, r2) == [0, 2] and not r2.movable
    assert free_runs(pool) == [(4, 2), (10, 4)]  # the hole waits under pinned r3 now
    pool.check_invariants()


def test_a_reservation_is_pinned_even_when_its_last_move_fails():
    pool, (r0, r1, r2, r3, r4) = row(settle_moves=1)
    r1.movable = r2.movable = True
    r0.release()

    def copy(r, m):
        raise OSError("copy failed")

    pool.set_move_callback(copy)
    with pytest.raises(OSError):
        r2.movable = False
    assert not r2.movable and pages(r1, r2) == [0, 4]  # the move undone, the pin made
    pool.check_invariants()


def test_reservations_above_the_gap_slide_up():
    pool, (r0, r1, r2, r3, r4) = row(pages=10)
    r1.release()
    r2.release()  # the gap: pages 2-5
    r3.movable = True
    r4.release()  # a hole above the gap, under r3's top: r3 slides up into it
    assert pages(r0, r3) == [0, 8]
    assert free_runs(pool) == [(2, 6)]
    pool.check_invariants()


def test_the_move_budget_leaves_the_rest_for_the_next_call():
    pool, (r0, r1, r2, r3, r4) = row(settle_moves=1)
    for r in (r2, r3, r4):
        r.movable = True
    r1.release()
    assert pages(r2, r3, r4) == [2, 6, 8]
    r0.movable = True  # any later call resumes the queued hole, one move at a time
    assert pages(r2, r3, r4) == [2, 4, 8]
    r0.movable = False
    r0.movable = True
    assert pages(r2, r3, r4) == [2, 4, 6] and free_runs(pool) == [(8, 6)]
    pool.check_invariants()


@pytest.mark.parametrize("options", [{"settle": False}, {"compact": False}])
def test_no_settling_when_off(options):
    pool, (r0, r1, r2, r3, r4) = row(**options)
    for r in (r2, r3, r4):
        r.movable = True
    r1.release()
    assert pages(r2, r3, r4) == [4, 6, 8] and pool.moves == 0
    pool.check_invariants()


def test_compact_off_turns_settling_off_unless_asked():
    assert ExtentPool([DeviceSpec("g", 4 * PAGE)], page_size=PAGE, compact=False).settle is False
    assert ExtentPool([DeviceSpec("g", 4 * PAGE)], page_size=PAGE, compact=False, settle=True).settle is True
    # 1.5 was taken: a call made two moves, the budget went below 0 and never hit the 0 that
    # queues the rest of a hole for the next call; "2" failed inside a comparison.
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match=f"settle_moves must be an integer >= 1 or None, got {bad!r}"):
            ExtentPool([DeviceSpec("g", 4 * PAGE)], page_size=PAGE, settle_moves=bad)
    # "0.5" failed inside the comparison, with a TypeError that named no option.
    for bad in (-0.1, 1.5, "0.5", True, math.nan):
        with pytest.raises(ValueError, match=r"compact_threshold must be a number in \[0, 1\] or None, got"):
            ExtentPool([DeviceSpec("g", 4 * PAGE)], page_size=PAGE, compact_threshold=bad)


def test_a_failing_move_callback_stops_settling_and_propagates():
    pool, (r0, r1, r2, r3, r4) = row()
    for r in (r2, r3, r4):
        r.movable = True

    def copy(r, m):
        if r.owner == "r3":
            raise OSError("copy failed")

    pool.set_move_callback(copy)
    with pytest.raises(OSError):
        r1.release()
    assert r1.released and pages(r2, r3, r4) == [2, 6, 8]  # r2 moved, r3's move undone
    pool.check_invariants()
    assert pool.statistics().allocated == 8 * PAGE
    # The settling that moved r2 counts (it did not: 1 move, 0 settles).
    assert (pool.settles, pool.statistics().moves) == (1, 1)


def test_resize_keeps_the_index_and_a_shrink_settles():
    pool, (r0, r1, r2, r3, r4) = row()
    r2.movable = True
    r1.resize_nowait(PAGE)  # frees page 3: r2 slides down onto it
    assert pages(r1, r2) == [2, 3]
    r3.resize_nowait(4 * PAGE)  # grows by moving (r4 is in the way): to the gap
    pool.check_invariants()
    assert r3.size == 4 * PAGE



def test_a_movable_reservation_that_shrinks_slides_past_the_tail_it_freed():
    """Its freed tail, above the largest free run, slides down through it as a release's would;
    left out of the index meanwhile, it stopped that slide as if pinned, for good."""
    pool = ExtentPool([DeviceSpec("gpu0", 16 * PAGE)], strategy="first-fit", page_size=PAGE)
    pool.reserve_nowait(2 * PAGE)  # pages 0-1, pinned
    gone = pool.reserve_nowait(8 * PAGE)  # pages 2-9
    r = pool.reserve_nowait(6 * PAGE)  # pages 10-15
    gone.release()
    r.movable = True
    r.resize_nowait(2 * PAGE)  # frees pages 12-15: r slides up to them, one run of 12 below
    assert pages(r) == [14]
    assert free_runs(pool) == [(2, 12)]
    pool.check_invariants()

@pytest.mark.anyio
async def test_a_waiter_is_served_when_settling_opens_room():
    pool, (r0, r1, r2, r3) = row(count=4, settle=True, compact=False)
    r4 = pool.reserve_nowait(3 * PAGE, owner="r4")  # pages 8-10: too long to fill a 2-page hole
    r3.movable = r4.movable = True
    r1.release()  # hole at pages 2-3 under pinned r2; 5 pages free, 3 in one run
    got = []

    async def wait_for_five():
        got.append(await pool.acquire(5 * PAGE, owner="five"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_five)
        await anyio.sleep(1)
        assert not got
        r2.movable = True  # the session goes idle: r2, r3, r4 slide down, 5 pages in one run
        await anyio.sleep(1)
    assert got and got[0].offset == 9 * PAGE
    pool.check_invariants()


def test_a_hole_stuck_under_a_pinned_reservation_is_filled_from_the_gaps_edge():
    pool, (r0, r1, r2, r3, r4) = row()
    r4.movable = True  # at the gap's lower edge; nothing to fill yet
    assert pool.moves == 0
    r1.release()  # the hole at 2-3 cannot rise (r2 is pinned): r4 fills it, the gap grows to 6
    assert pages(r0, r2, r3, r4) == [0, 4, 6, 2]
    assert free_runs(pool) == [(8, 6)]
    assert (pool.fills, pool.settles, pool.moves) == (1, 1, 1)
    pool.check_invariants()


def test_a_gap_edge_turning_movable_fills_a_hole():
    pool, (r0, r1, r2, r3, r4) = row()
    r1.release()  # a hole at 2-3 under pinned r2; r4, at the gap's edge, is pinned too
    assert pool.moves == 0 and free_runs(pool) == [(2, 2), (10, 4)]
    r4.movable = True  # no hole beside r4 to slide across, but it fits the one at 2-3
    assert pages(r0, r2, r3, r4) == [0, 4, 6, 2] and free_runs(pool) == [(8, 6)]
    assert pool.fills == 1
    pool.check_invariants()


def test_a_slide_then_a_fill_in_one_call():
    pool, (r0, r1, r2, r3, r4) = row()
    r1.release()
    r3.release()  # holes at 2-3 and 6-7 under pinned r2 and r4; the gap is 10-13
    r4.movable = True  # r4 slides down across the hole under it, then, the gap's edge, fills 2-3
    assert pages(r0, r2, r4) == [0, 4, 2] and free_runs(pool) == [(6, 8)]
    assert (pool.settles, pool.fills, pool.moves) == (2, 1, 2)
    pool.check_invariants()


def test_fills_share_the_move_budget():
    pool, (r0, r1, r2, r3, r4) = row(settle_moves=1)
    r2.movable = r4.movable = True
    r1.release()  # the one move slides r2 down; the hole, now under pinned r3, waits for a fill
    assert pages(r2, r4) == [2, 8] and pool.fills == 0
    r0.movable = True  # the next call has a move to spend: r4 fills the hole at 4-5
    assert pages(r2, r4) == [2, 4] and pool.fills == 1
    assert free_runs(pool) == [(8, 6)]
    pool.check_invariants()


@pytest.mark.parametrize("options", [{"settle": False}, {"compact": False}])
def test_no_fill_without_settling(options):
    pool, (r0, r1, r2, r3, r4) = row(**options)
    r4.movable = True
    r1.release()
    assert pages(r4) == [8] and pool.moves == 0 and pool.fills == 0


def test_the_holes_a_compaction_plan_leaves_settle_as_a_releases_do():
    """A plan's moves leave holes as a release does; left out of the queue, nothing settled
    them: the plan moved g down into the hole at 1-4 and left e at the edge of the largest free
    run (10-17), 8 pages, where e fits the hole at 21-25 and the run grows to 10."""
    pool = ExtentPool([DeviceSpec("gpu0", 26 * PAGE)], strategy="first-fit", page_size=PAGE, settle_moves=None)
    sizes = {"a": 1, "x": 4, "c": 3, "e": 2, "g": 4, "y": 4, "h": 3, "z": 5}
    held = {name: pool.reserve_nowait(n * PAGE, owner=name) for name, n in sizes.items()}
    for name in "xyz":
        held[name].release()
    held["e"].movable = held["g"].movable = True  # nothing for settling to do yet
    assert pool.moves == 0 and free_runs(pool) == [(1, 4), (14, 4), (21, 5)]
    plan = pool.plan_compaction(threshold=0.0)
    assert [(m.key.owner, m.src, m.dst) for m in plan.moves] == [("g", 10, 1)]
    assert pool.apply_plan(plan).applied == 1
    assert pages(held["g"], held["e"]) == [1, 24]  # e filled the hole at 21-25 from the top
    assert free_runs(pool) == [(8, 10), (21, 3)]
    assert pool.statistics().largest_free == 10 * PAGE and pool.fills == 1
    pool.check_invariants()


def test_the_holes_room_for_a_request_leaves_settle_as_a_releases_do():
    """Before: the pages a move made to open room for a request left outside that room were
    never queued to settle. Here the room for 4 pages at 10-13 takes 13 from r (13-14), which
    moves down to 4; page 14 stayed a 1-page hole: the next settle (a release on gpu1) passed
    gpu0 over, so e, at the edge of the other 1-page run, never filled the hole at 6, and the
    largest free run stayed 1 page instead of 2."""
    devices = [DeviceSpec("gpu0", 16 * PAGE), DeviceSpec("gpu1", 4 * PAGE)]
    pool = ExtentPool(devices, strategy="first-fit", page_size=PAGE, settle_moves=None)
    other = pool.reserve_nowait(4 * PAGE, owner="other", device="gpu1")
    sizes = {"a": 4, "x": 3, "b": 3, "y": 3, "r": 2, "e": 1}
    held = {name: pool.reserve_nowait(n * PAGE, owner=name, device="gpu0") for name, n in sizes.items()}
    for name in "axy":
        held[name].release()
    held["r"].movable = held["e"].movable = True  # the largest free run, 0-6, has no movable edge
    held["a"] = pool.reserve_nowait(4 * PAGE, owner="a", device="gpu0")
    assert pool.moves == 0 and free_runs(pool) == [(4, 3), (10, 3)]
    big = pool.reserve_nowait(4 * PAGE, owner="big", device="gpu0")
    assert pool.statistics().compactions == 1 and pages(big, held["r"], held["e"]) == [10, 4, 15]
    assert free_runs(pool) == [(6, 1), (14, 1)]
    other.release()
    assert pages(held["e"]) == [6] and free_runs(pool) == [(14, 2)]
    assert pool.space("gpu0").largest_free == 2
    pool.check_invariants()


def test_a_grow_that_moves_over_its_own_pages_settles_the_pages_it_leaves():
    """Before: a grow by moving queued the first page of its old extent as the hole it left; when
    the new extent covers that page (it moved down into its own pages), the hole at the old
    extent's top was passed over. Here r (2-4) grows to 4 pages at 0-3 and leaves page 4; m
    slides down across it and the largest free run grows from 4 pages to 5."""
    pool = ExtentPool([DeviceSpec("gpu0", 12 * PAGE)], strategy="first-fit", page_size=PAGE, settle_moves=None)
    hole, r, m = (pool.reserve_nowait(n * PAGE, owner=name) for name, n in (("hole", 2), ("r", 3), ("m", 3)))
    hole.release()
    m.movable = True  # too long for the hole at 0-1: nothing to fill
    assert pool.moves == 0 and free_runs(pool) == [(0, 2), (8, 4)]
    assert r.resize_nowait(4 * PAGE)
    assert pages(r, m) == [0, 4] and free_runs(pool) == [(7, 5)]
    pool.check_invariants()


def test_the_holes_room_for_a_grow_leaves_settle_as_a_releases_do():
    """Before: growing by moving queued only the extent the reservation left, not the pages the
    moves that opened its room left. Here g (12-13) grows to 5 pages at 1-5, room made by moving
    m (3-6) to 15-18; the page m left at 6 stayed a hole, though n slides down across it into
    the run g left: the largest free run stayed 2 pages instead of 3."""
    pool = ExtentPool([DeviceSpec("gpu0", 19 * PAGE)], strategy="first-fit", page_size=PAGE, settle_moves=None)
    sizes = {"a": 1, "x": 2, "m": 4, "n": 5, "g": 2, "b": 1, "y": 4}
    held = {name: pool.reserve_nowait(n * PAGE, owner=name) for name, n in sizes.items()}
    held["m"].movable = held["n"].movable = True
    held["x"].release()  # the largest free run then: nothing slides
    held["y"].release()
    assert pool.moves == 0 and free_runs(pool) == [(1, 2), (15, 4)]
    assert held["g"].resize_nowait(5 * PAGE)
    assert pool.statistics().compactions == 1
    assert pages(held["g"], held["m"], held["n"]) == [1, 15, 6] and free_runs(pool) == [(11, 3)]
    pool.check_invariants()
