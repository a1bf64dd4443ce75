"""On-demand compaction (`plan_hole`, `ExtentPool` placing by moving) and compaction past a threshold."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetsched.errors import WouldBlock
from fleetsched.resources import AddressSpace, DeviceLayout, DeviceSpec, ExtentPool, ExtentView, create_pool, plan_hole
from fleetsched.settings import ResourceSettings

PAGE = 1 << 20


def layout(*extents: tuple[str, int, int, bool], pages: int = 20) -> DeviceLayout:
    return DeviceLayout("gpu0", pages, tuple(ExtentView(k, o, n, m) for k, o, n, m in extents))


def free_of(lay: DeviceLayout) -> list[tuple[int, int]]:
    used = sorted((e.offset, e.length) for e in lay.extents)
    holes, cursor = [], 0
    for offset, length in used:
        if offset > cursor:
            holes.append((cursor, offset - cursor))
        cursor = offset + length
    if cursor < lay.pages:
        holes.append((cursor, lay.pages - cursor))
    return holes


def test_plan_hole_moves_the_cheapest_movable_extent_out_of_the_window():
    # [a:0-4 pinned][free 4-8][b:8-9 movable][free 9-12][c:12-18 movable][free 18-20]
    lay = layout(("a", 0, 4, False), ("b", 8, 1, True), ("c", 12, 6, True))
    plan = plan_hole(lay, free_of(lay), 8)
    assert plan is not None
    assert [(m.key, m.src) for m in plan.moves] == [("b", 8)]
    assert plan.moved_pages == 1
    dst = plan.moves[0].dst
    assert not plan.offset <= dst < plan.offset + 8  # moved outside the window it opens
    assert 4 <= plan.offset and plan.offset + 8 <= 12


def test_plan_hole_never_moves_unmovable_extents():
    lay = layout(("a", 0, 4, True), ("b", 8, 1, False), ("c", 12, 6, False))
    assert plan_hole(lay, free_of(lay), 8) is None


def test_plan_hole_is_none_when_a_hole_already_fits_or_too_little_is_free():
    lay = layout(("a", 0, 4, True))
    assert plan_hole(lay, free_of(lay), 8) is None  # 16 contiguous free already
    lay = layout(("a", 0, 10, True), ("b", 12, 7, True))
    assert plan_hole(lay, free_of(lay), 4) is None  # 3 pages free in all


def test_plan_hole_slides_a_stretch_together_when_no_free_run_takes_the_window_s_extents():
    # [a:0-1 pinned][free 1-3][b:3-6 movable][free 6-8][c:8-11 movable][free 11-13][d:13-20 pinned]
    # 6 pages are free but in runs of 2: no window of 5 can be emptied into a free run, yet
    # sliding b and c down to page 1 gathers the six free pages at 7-13.
    lay = layout(("a", 0, 1, False), ("b", 3, 3, True), ("c", 8, 3, True), ("d", 13, 7, False))
    plan = plan_hole(lay, free_of(lay), 5)
    assert plan is not None and plan.length == 5
    apply_moves(lay, plan)
    assert sorted(m.key for m in plan.moves) == ["b", "c"]


def test_plan_hole_sends_what_does_not_fit_below_the_window_to_another_stretch():
    # [free 0-2][b 2-3][free 3-4] p:4-5 [free 5-6][c 6-9][free 9-10][d 10-11][free 11-13]
    # 7 pages free, none in a run of 3. Opening 6 at the top of the right stretch keeps d
    # (slid down) and sends c left, into the room that sliding b down makes there.
    lay = layout(("b", 2, 1, True), ("p", 4, 1, False), ("c", 6, 3, True), ("d", 10, 1, True), pages=13)
    plan = plan_hole(lay, free_of(lay), 6)
    assert plan is not None and plan.offset == 7
    apply_moves(lay, plan)
    assert [(m.key, m.dst) for m in plan.moves] == [("b", 0), ("c", 1), ("d", 5)]


def test_plan_hole_opens_the_window_that_moves_the_fewest_pages():
    # [u0][free 2][b][free][u1][c 2][free][u2][free 2][u3 8]: 3 pages open by moving b (1 page) or c (2)
    lay = layout(("u0", 0, 1, False), ("b", 3, 1, True), ("u1", 5, 1, False), ("c", 6, 2, True),
                 ("u2", 9, 1, False), ("u3", 12, 8, False))  # fmt: skip
    plan = plan_hole(lay, free_of(lay), 3)
    assert plan is not None and plan.moved_pages == 1
    apply_moves(lay, plan)


def test_plan_hole_packs_what_it_evicts_side_by_side_into_one_free_run():
    # [u0][x][free][y][free][z][free][u1 3][free 4][u2 6]: opening [1, 7) sends x, y, z to 10, 11, 12
    lay = layout(("u0", 0, 1, False), ("x", 1, 1, True), ("y", 3, 1, True), ("z", 5, 1, True),
                 ("u1", 7, 3, False), ("u2", 14, 6, False))  # fmt: skip
    plan = plan_hole(lay, free_of(lay), 6)
    assert plan is not None
    apply_moves(lay, plan)  # they overlapped: all three went to page 10


def apply_moves(lay: DeviceLayout, plan) -> AddressSpace:
    """Carry out `plan` in order on a fresh address space; each destination must be free then."""
    space = AddressSpace(lay.pages)
    where = {}
    movable = {e.key: e.movable for e in lay.extents}
    for e in lay.extents:
        space.allocate(e.offset, e.length)
        where[e.key] = e.offset
    for m in plan.moves:
        assert movable[m.key], f"moved the unmovable {m.key!r}"
        assert where[m.key] == m.src
        space.release(m.src)
        space.allocate(m.dst, m.length)  # raises if not free
        where[m.key] = m.dst
        assert not (plan.offset < m.dst + m.length and m.dst < plan.offset + plan.length), "moved into the window"
    space.check()
    hole = space.free_extent_containing(plan.offset)
    assert hole is not None and plan.offset + plan.length <= hole[0] + hole[1], "the window is not free"
    return space


@st.composite
def layouts(draw) -> DeviceLayout:
    """A random device of up to 40 pages, tiled by extents (movable or not) and holes."""
    pages = draw(st.integers(4, 40))
    extents, cursor, k = [], 0, 0
    while cursor < pages:
        length = draw(st.integers(1, min(8, pages - cursor)))
        kind = draw(st.sampled_from(["free", "movable", "pinned"]))
        if kind != "free":
            extents.append(ExtentView(f"e{k}", cursor, length, kind == "movable"))
            k += 1
        cursor += length
    return DeviceLayout("gpu0", pages, tuple(extents))


@given(lay=layouts(), n=st.integers(1, 40))
@settings(max_examples=400, deadline=None)
def test_plan_hole_moves_only_movable_extents_out_of_a_window_it_then_leaves_free(lay, n):
    free = free_of(lay)
    plan = plan_hole(lay, free, n)
    if plan is None:
        return
    assert max((length for _, length in free), default=0) < n <= sum(length for _, length in free)
    assert 0 <= plan.offset and plan.offset + n <= lay.pages and plan.length == n
    apply_moves(lay, plan)


@given(lay=layouts())
@settings(max_examples=300, deadline=None)
def test_plan_hole_finds_a_plan_whenever_one_stretch_alone_can_be_slid_open(lay):
    # Between two unmovable extents, if the free pages add up to n, sliding that stretch's
    # extents down opens n pages with no help from elsewhere: the planner must not miss it.
    free = free_of(lay)
    pinned = sorted((e.offset, e.offset + e.length) for e in lay.extents if not e.movable)
    stretches = zip([0] + [end for _, end in pinned], [start for start, _ in pinned] + [lay.pages])
    roomiest = max(
        hi - lo - sum(e.length for e in lay.extents if e.movable and lo <= e.offset < hi) for lo, hi in stretches
    )
    for n in range(max((length for _, length in free), default=0) + 1, roomiest + 1):
        assert plan_hole(lay, free, n) is not None, n


def fragmented(**options) -> tuple[ExtentPool, list]:
    """A 10-page device: [r0 2][free 2][r2 2][free 2][r4 2] (r1, r3 released); settling off."""
    options.setdefault("settle", False)
    pool = ExtentPool([DeviceSpec("gpu0", 10 * PAGE)], strategy="first-fit", page_size=PAGE, **options)
    held = [pool.reserve_nowait(2 * PAGE, owner=f"r{i}") for i in range(5)]
    held[1].release()
    held[3].release()
    return pool, held


def test_pool_moves_a_movable_reservation_instead_of_refusing():
    pool, held = fragmented()
    held[2].movable = True
    calls = []
    pool.set_move_callback(lambda r, m: calls.append((r.owner, r.offset, m.src * PAGE, m.dst * PAGE)))
    r = pool.reserve_nowait(4 * PAGE, owner="big")
    assert pool.fragmentation_failures == 0
    assert calls and calls[0][0] == "r2" and calls[0][1] == calls[0][2]  # told before the offset changes
    assert held[2].offset == calls[0][3]
    assert r.size == 4 * PAGE
    stats = pool.statistics()
    assert (stats.compactions, stats.moves, stats.moved_bytes) == (1, 1, 2 * PAGE)
    for d in pool.devices:
        pool.space(d.name).check()
    spans = sorted((x.offset, x.offset + x.size) for x in pool.reservations())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_moving_to_make_room_prefers_the_device_asked_for():
    pool = ExtentPool([DeviceSpec(d, 10 * PAGE) for d in ("a", "b")], strategy="first-fit", page_size=PAGE, settle=False)
    for d in ("a", "b"):
        held = [pool.reserve_nowait(n * PAGE, device=d) for n in (3, 1, 3, 3)]
        held[0].release()
        held[2].release()
        held[1].movable = True  # holes of 3 on either side of a movable page: one move opens 6
    assert pool.reserve_nowait(6 * PAGE, device="b").device == "b"


def test_pool_refuses_when_nothing_is_movable_or_compaction_is_off():
    pool, held = fragmented()
    with pytest.raises(WouldBlock):
        pool.reserve_nowait(4 * PAGE, owner="big")
    assert pool.fragmentation_failures == 1
    pool, held = fragmented(compact=False)
    held[2].movable = True
    with pytest.raises(WouldBlock):
        pool.reserve_nowait(4 * PAGE, owner="big")
    assert pool.fragmentation_failures == 1 and pool.statistics().moves == 0


def test_a_failing_move_callback_undoes_its_move_and_propagates():
    pool, held = fragmented()
    held[2].movable = True
    offset = held[2].offset

    def boom(r, m):
        raise RuntimeError("copy failed")

    pool.set_move_callback(boom)
    with pytest.raises(RuntimeError):
        pool.reserve_nowait(4 * PAGE, owner="big")
    assert held[2].offset == offset
    pool.space("gpu0").check()
    assert pool.statistics().allocated == 6 * PAGE


def test_movable_counts_follow_release():
    pool, held = fragmented()
    held[0].movable = True
    held[0].release()
    held[0].movable = False  # after release: no effect on the counts
    assert pool._movable_count["gpu0"] == 0


def test_threshold_compaction_after_a_release():
    pool, held = fragmented(compact_threshold=0.3)
    moves = []
    pool.set_move_callback(lambda r, m: moves.append(r.owner))
    held[2].movable = True
    held[4].movable = True
    held[0].release()  # frees memory: fragmentation (8 free, largest 4... ) passes 0.3
    stats = pool.statistics()
    assert moves and stats.compactions >= 1
    assert stats.largest_free == stats.free  # one hole left
    pool.space("gpu0").check()


def test_settings_carry_compaction_to_the_pool():
    pool = create_pool(ResourceSettings(compact=False, compact_threshold=0.25))
    assert isinstance(pool, ExtentPool)
    assert (pool.compact, pool.compact_threshold) == (False, 0.25)
    with pytest.raises(ValueError):
        ResourceSettings(compact_threshold=1.5)


def test_with_compact_off_a_threshold_is_the_only_compaction():
    """As `ResourceSettings.compact_threshold` says: compact = false leaves the threshold on, and
    turns settling and opening room for a request off."""
    settings = ResourceSettings(compact=False, compact_threshold=0.5, devices=[{"name": "gpu0", "memory": 20 * PAGE}], page_size=PAGE)
    pool = create_pool(settings)
    held = [pool.reserve_nowait(2 * PAGE, owner=i) for i in range(10)]
    for r in held:
        r.movable = True
    held[0].release()
    held[9].release()  # two runs of 2, a rate of 0.5: not past the threshold
    assert pool.statistics().moves == 0  # settling would have slid the run at 0-1 up to the other
    with pytest.raises(WouldBlock):  # nor is room opened for 4 pages
        pool.reserve_nowait(4 * PAGE, owner="big")
    held[2].release()  # three runs of 2, a rate of 0.67: compacted into one run
    stats = pool.statistics()
    assert stats.compactions == 1 and stats.moves > 0 and stats.largest_free == stats.free == 6 * PAGE


def test_threshold_compaction_stopped_by_its_callback_counts_the_moves_it_made():
    """Before: a callback that raised on a later move left the earlier moves made but uncounted
    (compactions, moves and moved_bytes all 0)."""
    pool = ExtentPool([DeviceSpec("gpu0", 20 * PAGE)], strategy="first-fit", page_size=PAGE, settle=False, compact_threshold=0.1)
    held = [pool.reserve_nowait(2 * PAGE, owner=i) for i in range(10)]
    for r in held:
        r.movable = True
    calls = []

    def fails_third(r, m):
        calls.append(m)
        if len(calls) == 3:
            raise OSError("copy failed")

    pool.set_move_callback(fails_third)
    held[0].release()  # one hole: not fragmented
    with pytest.raises(OSError, match="copy failed"):
        held[2].release()  # two holes: past 0.1, compacted until the third move
    moved = [r for r in held if not r.released and r.offset != r.owner * 2 * PAGE]
    assert len(moved) == 2
    stats = pool.statistics()
    assert (stats.compactions, stats.moves, stats.moved_bytes) == (1, 2, sum(r.size for r in moved))
    pool.space("gpu0").check()


def test_on_demand_compaction_stopped_by_its_callback_counts_the_moves_it_made():
    """Before: a callback that raised on the second move of a plan left the first move made and
    counted in moves, but no compaction counted (1 move in 0 compactions)."""
    pool = ExtentPool([DeviceSpec("gpu0", 8 * PAGE)], strategy="first-fit", page_size=PAGE, settle=False)
    held = [pool.reserve_nowait(PAGE, owner=i) for i in range(8)]
    for i in (1, 4, 7):
        held[i].release()
    held[2].movable = held[3].movable = True  # 3 free pages, none together: two moves open [1, 4)
    calls = []

    def fails_second(r, m):
        calls.append(m)
        if len(calls) == 2:
            raise OSError("copy failed")

    pool.set_move_callback(fails_second)
    with pytest.raises(OSError, match="copy failed"):
        pool.reserve_nowait(3 * PAGE, owner="big")
    stats = pool.statistics()
    assert (stats.compactions, stats.moves, stats.moved_bytes) == (1, 1, PAGE)
    pool.check_invariants()
