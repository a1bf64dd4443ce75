"""End hints (`ends_at`): a hinted request goes beside the extents expected to end when it does."""

import math

import anyio
import pytest

from fleetsched.errors import WouldBlock
from fleetsched.resources import DeviceSpec, ExtentPool

PAGE = 1 << 20


def make(pages: int = 40, strategy: str = "frag-aware") -> ExtentPool:
    return ExtentPool([DeviceSpec("gpu0", pages * PAGE)], strategy=strategy, page_size=PAGE, compact=False)


def two_holes(pool: ExtentPool, *, soon: float | None, late: float | None):
    """[a:2][hole 3][b:2][hole 3][c:2][rest: 28, no hint], `a` ending at `soon`, `b` at 50, `c`
    at `late` (small requests fill the device from the bottom)."""
    a, gap1, b, gap2, c, rest = (pool.reserve_nowait(n * PAGE) for n in (2, 3, 2, 3, 2, 28))
    # Set after placing (an owner may revise its hint): hinted, they would be placed by them.
    a.ends_at, b.ends_at, c.ends_at = soon, None if soon is None else 50.0, late
    gap1.release()
    gap2.release()
    assert [(r.offset // PAGE, r.size // PAGE) for r in (a, b, c, rest)] == [(0, 2), (5, 2), (10, 2), (12, 28)]
    return a, b, c


def test_a_hinted_request_lands_beside_the_neighbour_ending_closest():
    pool = make()
    two_holes(pool, soon=10.0, late=100.0)
    # Without hints both would take the low end of their tightest hole: pages 2, then 7.
    middle = pool.reserve_nowait(2 * PAGE, ends_at=48.0)
    assert middle.offset // PAGE == 3  # right before `b` (ends at 50), not after `a` (10)
    late = pool.reserve_nowait(2 * PAGE, ends_at=95.0)
    assert late.offset // PAGE == 8  # right before `c` (ends at 100), not after `b`
    assert (middle.ends_at, late.ends_at) == (48.0, 95.0)
    pool.space("gpu0").check()


def test_without_hinted_neighbours_placement_is_as_without_a_hint():
    hinted, plain = make(), make()
    two_holes(hinted, soon=None, late=None)
    two_holes(plain, soon=None, late=None)
    assert hinted.reserve_nowait(2 * PAGE, ends_at=12.0).offset == plain.reserve_nowait(2 * PAGE).offset


def test_a_hinted_request_between_neighbours_without_hints_is_placed_as_without_one():
    pool = make()
    held = [pool.reserve_nowait(4 * PAGE) for _ in range(10)]  # small: from the bottom, no hints
    held[1].release()
    held[2].release()  # one hole, [4, 12), between two reservations without hints
    assert pool.reserve_nowait(6 * PAGE, ends_at=12.0).offset == 6 * PAGE  # large: at the hole's top


@pytest.mark.parametrize("strategy", ["first-fit", "best-fit", "buddy", "size-class"])
def test_other_strategies_take_the_hint_and_place_as_they_always_do(strategy):
    hinted, plain = make(20, strategy=strategy), make(20, strategy=strategy)
    for pool in (hinted, plain):
        for _ in range(3):
            pool.reserve_nowait(2 * PAGE, ends_at=5.0 if pool is hinted else None)
    assert hinted.reserve_nowait(3 * PAGE, ends_at=99.0).offset == plain.reserve_nowait(3 * PAGE).offset


@pytest.mark.parametrize(
    ("ends_at", "error", "message"),
    [
        ("soon", TypeError, "ends_at: expected a number (when the owner expects to release), got 'soon'"),
        (True, TypeError, "ends_at: expected a number (when the owner expects to release), got True"),
        (math.nan, ValueError, "ends_at: expected a finite number, got nan"),
        (math.inf, ValueError, "ends_at: expected a finite number, got inf"),
    ],
)
@pytest.mark.anyio
async def test_a_bad_hint_is_refused_naming_it_and_holds_nothing(ends_at, error, message):
    pool = make()
    with pytest.raises(error) as info:
        pool.reserve_nowait(PAGE, ends_at=ends_at)
    assert str(info.value) == message
    with pytest.raises(error):
        await pool.acquire(PAGE, ends_at=ends_at)
    stats = pool.statistics()
    assert stats.allocated == 0 and stats.waiting == 0
    assert pool.reserve_nowait(40 * PAGE).size == 40 * PAGE  # the whole device is still free


@pytest.mark.anyio
async def test_a_waiter_keeps_its_hint_until_it_is_placed():
    pool = make(10)
    blocker = pool.reserve_nowait(10 * PAGE)
    got = []

    async def want() -> None:
        async with pool.reserve(4 * PAGE, owner="w", ends_at=42.0) as r:
            got.append(r.ends_at)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(1)
        with pytest.raises(WouldBlock):
            pool.reserve_nowait(PAGE, priority=1)  # the waiter holds the line
        blocker.release()
    assert got == [42.0]
    assert pool.statistics().allocated == 0
