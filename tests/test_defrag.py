"""The compaction planner (pure) and ExtentPool.apply_plan."""

import pytest

from fleetsched.resources import CompactionPlan, DeviceLayout, DeviceSpec, ExtentPool, ExtentView, Move, plan_compaction
from fleetsched.resources.extents import AddressSpace

PAGE = 1 << 20


def layout(*extents: tuple[str, int, int, bool], pages: int = 20) -> DeviceLayout:
    return DeviceLayout("gpu0", pages, tuple(ExtentView(k, o, n, m) for k, o, n, m in extents))


def replay(lay: DeviceLayout, plan) -> AddressSpace:
    """Apply the plan to a fresh address space, checking each destination is free when used."""
    space = AddressSpace(lay.pages)
    where = {}
    for e in lay.extents:
        space.allocate(e.offset, e.length)
        where[e.key] = e.offset
    for m in plan.moves:
        assert where[m.key] == m.src
        space.release(m.src)
        space.allocate(m.dst, m.length)  # raises if not free
        where[m.key] = m.dst
    space.check()
    return space


def test_slides_movable_extents_down():
    lay = layout(("a", 2, 3, True), ("b", 8, 2, True), ("c", 14, 1, True))
    plan = plan_compaction([lay], threshold=0.0)
    space = replay(lay, plan)
    assert space.largest_free == 14 and space.fragmentation == 0.0
    (gain,) = plan.gains
    assert gain.largest_free_before == 5 and gain.largest_free_after == 14
    assert gain.fragmentation_after == 0.0 < gain.fragmentation_before


def test_unmovable_extents_stay_and_holes_fill_from_above():
    lay = layout(("pin", 4, 2, False), ("a", 0, 1, True), ("x", 8, 3, True), ("y", 15, 3, True))
    plan = plan_compaction([lay], threshold=0.0)
    assert all(m.key != "pin" for m in plan.moves)
    space = replay(lay, plan)
    assert space.used_length(4) == 2  # the pinned one did not move
    assert space.largest_free > 5


def test_below_threshold_or_no_gain_plans_nothing():
    lay = layout(("a", 0, 5, True), ("b", 10, 5, True))
    assert not plan_compaction([lay], threshold=0.9)
    pinned = layout(("a", 2, 5, False), ("b", 10, 5, False))
    plan = plan_compaction([pinned], threshold=0.0)
    assert not plan and plan.gains[0].largest_free_after == plan.gains[0].largest_free_before


def test_at_the_threshold_or_with_no_gain_nothing_is_planned():
    lay = layout(("a", 2, 2, True), pages=10)  # free: 2 and 6 pages, fragmentation (8 - 6) / 8
    assert not plan_compaction([lay], threshold=0.25).gains  # at the threshold is not past it
    assert plan_compaction([lay], threshold=0.2).moved_pages == 2
    # sliding m down leaves the largest free run at 6 pages: a move for nothing
    level = layout(("m", 2, 1, True), ("u", 3, 1, False), pages=10)
    plan = plan_compaction([level], threshold=0.1)
    assert not plan.moves and plan.gains[0].moved_pages == 0


def test_budget_caps_moved_pages():
    lay = layout(("a", 2, 3, True), ("b", 8, 2, True), ("c", 14, 1, True))
    plan = plan_compaction([lay], threshold=0.0, max_moved_pages=3)
    assert plan.moved_pages <= 3
    replay(lay, plan)


def test_the_budget_caps_the_pages_moved_over_all_devices():
    lays = [
        DeviceLayout(name, 10, (ExtentView("u", 0, 1, False), ExtentView("m", 4, 2, True), ExtentView("v", 7, 1, False)))
        for name in ("gpu0", "gpu1")
    ]  # each device compacts by moving its 2 pages
    assert plan_compaction(lays, threshold=0.1, max_moved_pages=2).moved_pages == 2


def make_fragmented() -> tuple[ExtentPool, list]:
    # Settling off: it would close the holes as soon as the reservations become movable.
    pool = ExtentPool([DeviceSpec("gpu0", 20 * PAGE)], strategy="first-fit", page_size=PAGE, settle=False)
    held = [pool.reserve_nowait(2 * PAGE, owner=i) for i in range(10)]
    for r in held[::2]:
        r.release()
    for r in held[1::2]:
        r.movable = True
    return pool, held[1::2]


def test_apply_plan_moves_through_the_callback_and_wakes_waiters():
    pool, live = make_fragmented()
    assert pool.statistics().largest_free == 2 * PAGE
    calls = []
    pool.add_release_listener(lambda: calls.append("listener"))
    plan = pool.plan_compaction(threshold=0.3)
    result = pool.apply_plan(plan, lambda r, m: calls.append((r.owner, m.src, m.dst)))
    assert result.applied == len(plan.moves) == 5 and result.skipped == 0
    assert result.moved_bytes == 10 * PAGE
    assert sorted(r.offset for r in live) == [0, 2 * PAGE, 4 * PAGE, 6 * PAGE, 8 * PAGE]
    assert pool.statistics().largest_free == 10 * PAGE and pool.statistics().fragmentation == 0
    assert calls[-1] == "listener"
    pool.space("gpu0").check()


def test_apply_plan_skips_released_and_unmovable():
    pool, live = make_fragmented()
    plan = pool.plan_compaction(threshold=0.3)
    live[0].release()
    live[1].movable = False
    result = pool.apply_plan(plan)
    assert result.skipped >= 2
    assert result.applied + result.skipped == len(plan.moves)
    pool.space("gpu0").check()
    stats = pool.statistics()
    assert stats.allocated == sum(r.size for r in live if not r.released)


def test_apply_plan_skips_a_move_naming_another_device():
    pool = ExtentPool([DeviceSpec(f"gpu{i}", 6 * PAGE) for i in range(2)], strategy="first-fit", page_size=PAGE, settle=False)
    first, second = ([pool.reserve_nowait(2 * PAGE, device=d) for _ in range(3)] for d in ("gpu0", "gpu1"))
    first[0].release()
    second[0].release()
    first[1].movable = True  # at page 2 of gpu0; gpu1 holds page 2 too
    result = pool.apply_plan(CompactionPlan((Move(first[1], "gpu1", 2, 0, 2),), ()))
    assert (result.applied, result.skipped) == (0, 1)
    assert (first[1].device, first[1].offset) == ("gpu0", 2 * PAGE)
    pool.check_invariants()


def test_failing_callback_leaves_that_move_undone():
    pool, live = make_fragmented()
    plan = pool.plan_compaction(threshold=0.3)
    before = {r: r.offset for r in live}

    def boom(r, m):
        raise OSError("copy failed")

    with pytest.raises(OSError):
        pool.apply_plan(plan, boom)
    assert {r: r.offset for r in live} == before
    pool.space("gpu0").check()


def test_a_fill_that_scatters_what_the_slide_gathered_is_dropped_not_the_slide():
    """The slide opens 4 pages ([4, 8)); the fill then moved the top extents into that run,
    leaving 2-page holes, and the device's moves were all dropped as no gain: an empty plan for
    a device at 0.5 that one slide compacts."""
    lay = layout(("a", 2, 2, True), ("b", 6, 2, True), ("p", 8, 2, False), ("c", 10, 2, True),
                 ("q", 12, 2, False), ("d", 14, 2, True), ("r", 16, 2, False), ("e", 18, 2, True))  # fmt: skip
    plan = plan_compaction([lay], threshold=0.1)
    space = replay(lay, plan)
    (gain,) = plan.gains
    assert gain.largest_free_before == 2 and gain.largest_free_after == space.largest_free == 4
    assert gain.moved_pages == plan.moved_pages == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [  # before: nan compacted every device (no comparison holds), 2 and -1 were taken silently
        ({"threshold": float("nan")}, r"threshold must lie in \[0, 1\], got nan"),
        ({"threshold": 2}, r"threshold must lie in \[0, 1\], got 2"),
        ({"threshold": -1}, r"threshold must lie in \[0, 1\], got -1"),
        ({"max_moved_pages": -1}, r"max_moved_pages must be >= 0 or None, got -1"),
    ],
)
def test_plan_compaction_refuses_a_threshold_or_budget_out_of_range(options, message):
    pool, _ = make_fragmented()
    with pytest.raises(ValueError, match=message):
        pool.plan_compaction(**options)
    with pytest.raises(ValueError, match=message):
        plan_compaction(pool.layouts(), **options)
