"""On-demand compaction (`plan_hole`, `ExtentPool` placing by moving) and compaction past a threshold."""

import pytest

from fleetsched.errors import WouldBlock
from fleetsched.resources import DeviceLayout, DeviceSpec, ExtentPool, ExtentView, create_pool, plan_hole
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


def fragmented(**options) -> tuple[ExtentPool, list]:
    """A 10-page device: [r0 2][free 2][r2 2][free 2][r4 2] (r1, r3 released)."""
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
