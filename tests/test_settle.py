"""Settling: holes slide towards the largest free run through movable reservations only."""

import anyio
import pytest

from fleetsched.resources import DeviceSpec, ExtentPool, Move
from fleetsched.resources.extents import AddressSpace
from fleetsched.resources.settle import Neighbour, plan_slide

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
    r2.movable = r4.movable = True
    r1.release()
    assert pages(r0, r2, r3, r4) == [0, 2, 6, 8]  # r2 slid; r3 is pinned, so the hole waits under it
    assert free_runs(pool) == [(4, 2), (10, 4)]
    r3.movable = True
    assert pages(r0, r2, r3, r4) == [0, 2, 4, 6]
    assert free_runs(pool) == [(8, 6)]
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
    with pytest.raises(ValueError):
        ExtentPool([DeviceSpec("g", 4 * PAGE)], page_size=PAGE, settle_moves=0)


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


def test_resize_keeps_the_index_and_a_shrink_settles():
    pool, (r0, r1, r2, r3, r4) = row()
    r2.movable = True
    r1.resize_nowait(PAGE)  # frees page 3: r2 slides down onto it
    assert pages(r1, r2) == [2, 3]
    r3.resize_nowait(4 * PAGE)  # grows by moving (r4 is in the way): to the gap
    pool.check_invariants()
    assert r3.size == 4 * PAGE


@pytest.mark.anyio
async def test_a_waiter_is_served_when_settling_opens_room():
    pool, (r0, r1, r2, r3, r4) = row(settle=True, compact=False)
    r3.movable = r4.movable = True
    r1.release()  # hole at pages 2-3 under pinned r2; 6 pages free, 4 in one run
    got = []

    async def wait_for_six():
        got.append(await pool.acquire(6 * PAGE, owner="six"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_six)
        await anyio.sleep(1)
        assert not got
        r2.movable = True  # the session goes idle: r2, r3, r4 slide down, 6 pages in one run
        await anyio.sleep(1)
    assert got and got[0].offset == 8 * PAGE
    pool.check_invariants()
