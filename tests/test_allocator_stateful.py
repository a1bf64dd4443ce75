"""Random reserve / grow / shrink / release / pin / compact sequences, for every strategy.

After every step: no two live extents overlap, allocated + free == total, free neighbours are
coalesced, and every reported metric equals a brute-force recount from the live reservations.
Settling runs on its own (releases, reservations turning movable) and never shrinks a device's
largest free run; every move, settling's, on-demand compaction's or a plan's, must be of a
movable reservation (or of one growing where it cannot grow in place). Each page holds its
owner's tag, which the move callback copies as an owner copies its data: every reservation's
pages hold its own tag after every step (a move into pages whose data was not yet copied out
would overwrite it).
"""

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from fleetsched.errors import WouldBlock
from fleetsched.resources import STRATEGIES, DeviceSpec, ExtentPool

PAGE = 4096
DEVICES = (("a", 48), ("b", 31))  # pages; 31 is not a power of two


def recount(pool: ExtentPool) -> None:
    live = pool.reservations()
    for name, pages in DEVICES:
        mine = sorted((r.offset // PAGE, r.size // PAGE, r) for r in live if r.device == name)
        free_runs = []
        cursor = 0
        for start, length, r in mine:
            assert r.offset % PAGE == 0 and r.size % PAGE == 0 and r.size >= r.nbytes
            assert start >= cursor, f"{name}: extents overlap at page {start}"
            if start > cursor:
                free_runs.append(start - cursor)
            cursor = start + length
        assert cursor <= pages
        if cursor < pages:
            free_runs.append(pages - cursor)
        space = pool.space(name)
        space.check()  # its own indexes agree, and free extents never touch
        pool.check_invariants()
        assert sorted(n for _, n in space.free_extents()) == sorted(free_runs)
        (dev,) = [d for d in pool.statistics().devices if d.name == name]
        free = sum(free_runs) * PAGE
        largest = max(free_runs, default=0) * PAGE
        assert dev.total == pages * PAGE
        assert dev.allocated + dev.free == dev.total
        assert dev.free == free and dev.largest_free == largest
        assert dev.allocated == sum(length for _, length, _ in mine) * PAGE
        assert dev.reservations == len(mine)
        assert dev.internal_fragmentation == sum(r.size - r.nbytes for _, _, r in mine)
        assert dev.fragmentation == pytest.approx((free - largest) / free if free else 0.0)
        expected_ext = 1 - math.sqrt(sum(n * n for n in free_runs)) / sum(free_runs) if free_runs else 0.0
        assert dev.external_fragmentation == pytest.approx(expected_ext)


class AllocatorMachine(RuleBasedStateMachine):
    strategy = "frag-aware"
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.pool = ExtentPool([DeviceSpec(n, p * PAGE) for n, p in DEVICES], strategy=self.strategy, page_size=PAGE)
        self.pool.set_move_callback(self.moved)
        self.moves = 0
        self.growing = None  # the reservation being resized: it moves where it cannot grow in place
        self.memory = {name: [None] * pages for name, pages in DEVICES}  # each page's owner tag

    def write(self, r, start: int, end: int) -> None:
        """`r` writes its tag into its pages `start` to `end` (relative to its offset)."""
        pages, first = self.memory[r.device], r.offset // PAGE
        pages[first + start : first + end] = [r] * (end - start)

    def moved(self, r, move):
        assert (r.movable or r is self.growing) and not r.released, f"moved {r!r}, which may not move"
        pages = self.memory[move.device]
        pages[move.dst : move.dst + move.length] = pages[move.src : move.src + move.length]  # memmove
        assert r.offset == move.src * PAGE and r.size == move.length * PAGE
        self.moves += 1

    @rule(target=held, nbytes=st.integers(1, 20 * PAGE), device=st.sampled_from([None, "a", "b"]))
    def reserve(self, nbytes, device):
        stats = self.pool.statistics()
        try:
            r = self.pool.reserve_nowait(nbytes, owner=object(), device=device)
            self.write(r, 0, r.size // PAGE)
        except WouldBlock:
            fragmented = any(d.free >= nbytes for d in stats.devices)
            assert self.pool.statistics().fragmentation_failures == stats.fragmentation_failures + fragmented
            return None
        r.movable = nbytes % 2 == 0
        return r

    @rule(r=held, nbytes=st.integers(1, 24 * PAGE))
    def resize(self, r, nbytes):
        if r is None or r.released:
            return
        before = (r.offset, r.size, r.nbytes)
        self.growing = r
        try:
            self.pool.resize_nowait(r, nbytes)
        except WouldBlock:
            assert (r.offset, r.size, r.nbytes) == before
            return
        finally:
            self.growing = None
        assert r.nbytes == nbytes and r.size >= nbytes
        kept = min(before[1], r.size) // PAGE
        first = r.offset // PAGE
        assert self.memory[r.device][first : first + kept] == [r] * kept, "its data did not follow it"
        self.write(r, kept, r.size // PAGE)

    @rule(r=held, movable=st.booleans())
    def pin(self, r, movable):
        """The session goes idle (movable: settling may move it or its neighbours) or busy."""
        if r is None or r.released:
            return
        pinned = {x: x.offset for x in self.pool.reservations() if not x.movable and x is not r}
        largest = self.largest_free()
        r.movable = movable
        assert all(x.offset == offset for x, offset in pinned.items())
        # Settling (slides and fills) only ever grows a device's largest free run.
        assert all(after >= before for before, after in zip(largest, self.largest_free()))

    def largest_free(self) -> list[int]:
        return [d.largest_free for d in self.pool.statistics().devices]

    @rule(r=consumes(held))
    def release(self, r):
        if r is not None:
            largest = self.largest_free()
            r.release()
            r.release()
            assert all(after >= before for before, after in zip(largest, self.largest_free()))

    @rule(threshold=st.sampled_from([0.0, 0.3]), flip=st.booleans())
    def compact(self, threshold, flip):
        plan = self.pool.plan_compaction(threshold=threshold)
        for gain in plan.gains:
            assert gain.largest_free_after >= gain.largest_free_before
        moved = []
        if flip and plan.moves:  # a move made stale in between is skipped, not applied
            plan.moves[0].key.movable = False
        result = self.pool.apply_plan(plan, lambda r, m: moved.append((r, m)) or self.moved(r, m))
        assert result.applied == len(moved)
        assert all(r.movable and r.offset == m.dst * PAGE for r, m in moved if r.offset == m.dst * PAGE)

    @invariant()
    def consistent(self):
        recount(self.pool)
        for r in self.pool.reservations():
            first, n = r.offset // PAGE, r.size // PAGE
            assert self.memory[r.device][first : first + n] == [r] * n, f"{r!r} lost its data"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_allocator_state_machine(strategy):
    machine = type(f"Machine_{strategy}", (AllocatorMachine,), {"strategy": strategy})
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    runner().runTest()
