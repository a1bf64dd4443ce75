"""Memory pools under misuse and odd timing: move callbacks that reach back into the pool,
quotas changed while requests wait, a shrink that frees quota only, listeners that fail.

Each test failed before its fix (found by a probe of the pools' API)."""

from __future__ import annotations

import anyio
import pytest

from fleetsched.errors import QuotaExceeded, RequestTooLarge
from fleetsched.resources import CountingPool, DeviceSpec, ExtentPool

MB = 1 << 20
pytestmark = pytest.mark.anyio


def holey_pool() -> tuple[ExtentPool, list]:
    """Eight 1-page reservations, holes at 1, 3 and 5, the one at 2 movable."""
    pool = ExtentPool([DeviceSpec("g0", 8 * MB)], page_size=MB, strategy="first-fit", settle=False)
    held = [pool.reserve_nowait(MB, owner=i) for i in range(8)]
    for i in (1, 3, 5):
        held[i].release()
    held[2].movable = True
    return pool, held


def accounts_agree(pool: ExtentPool) -> None:
    pool.check_invariants()
    assert pool.statistics().allocated == sum(r.size for r in pool.reservations())


@pytest.mark.parametrize("how", ["on-demand compaction", "a compaction plan"])
@pytest.mark.parametrize(
    "reentry", ["release the moved one", "release another", "pin the moved one", "reserve", "apply a plan"]
)
def test_a_move_callback_that_changes_the_pool_is_refused_and_the_move_undone(how, reentry):
    """Before: the pool was corrupted (two reservations on one page, bytes leaked, a waiter
    granted twice, a movable count of -1) or failed with a bare KeyError."""
    pool, held = holey_pool()

    def callback(reservation, move):
        if reentry == "release the moved one":
            reservation.release()
        elif reentry == "release another":
            held[0].release()
        elif reentry == "pin the moved one":
            reservation.movable = False
        elif reentry == "apply a plan":  # planned from the reservation's old offset: a bare KeyError
            pool.apply_plan(pool.plan_compaction(threshold=0.0))
        else:
            pool.reserve_nowait(MB, owner="inside")

    pool.set_move_callback(callback)
    with pytest.raises(RuntimeError, match="from inside a move callback: make the change after the callback returns"):
        if how == "on-demand compaction":
            pool.reserve_nowait(2 * MB, owner="new")  # needs the hole that moving 2 opens
        else:
            pool.apply_plan(pool.plan_compaction(threshold=0.0))
    accounts_agree(pool)
    assert len(pool.reservations()) == 5 and held[2].offset == 2 * MB and held[2].movable
    pool.set_move_callback(None)
    assert pool.reserve_nowait(2 * MB, owner="new").size == 2 * MB  # after the callback: it works
    accounts_agree(pool)


@pytest.mark.parametrize("kind", ["extent", "counting"])
async def test_a_quota_raised_lets_its_waiter_in_and_one_lowered_below_it_refuses_it(kind):
    """Before: set_quota woke nobody (the waiter, and everyone behind it, waited for good)."""
    devices = [DeviceSpec("g0", 64 * MB)]
    pool = ExtentPool(devices, page_size=MB, quotas={"t": 4 * MB}) if kind == "extent" else CountingPool(devices, quotas={"t": 4 * MB})
    pool.reserve_nowait(4 * MB, tenant="t")
    outcomes: list[object] = []

    async def wait_for(nbytes: int) -> None:
        try:
            outcomes.append(await pool.acquire(nbytes, tenant="t"))
        except QuotaExceeded as exc:
            outcomes.append(exc)

    with anyio.fail_after(60):  # the waiter refused returns at once
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for, 2 * MB)
            await anyio.sleep(1)
            pool.set_quota("t", 8 * MB)
            await anyio.sleep(1)
            assert pool.statistics().by_tenant == {"t": 6 * MB}
            tg.start_soon(wait_for, 7 * MB)  # within the quota of 8, over the room it leaves
            await anyio.sleep(1)
            pool.set_quota("t", 6 * MB)  # below the 7 asked: never grantable now
    assert outcomes[0].nbytes == 2 * MB  # type: ignore[union-attr]
    assert isinstance(outcomes[1], QuotaExceeded) and "quota is 6,291,456 bytes" in str(outcomes[1])
    assert pool.statistics().waiting == 0


async def test_a_quota_lowered_to_exactly_a_waiters_request_keeps_it_waiting():
    pool = ExtentPool([DeviceSpec("g0", 10 * MB)], page_size=MB, quotas={"t": 8 * MB})
    blocker = pool.reserve_nowait(10 * MB)
    granted = []

    async def waiter() -> None:
        granted.append(await pool.acquire(4 * MB, tenant="t"))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(1)
            pool.set_quota("t", 4 * MB)  # the 4 asked still fit: not refused
            blocker.release()
    assert [r.nbytes for r in granted] == [4 * MB]


async def test_a_shrink_that_frees_quota_but_no_page_lets_the_tenants_waiter_in():
    pool = ExtentPool([DeviceSpec("g0", 64 * MB)], page_size=MB, quotas={"t": 4 * MB})
    whole = pool.reserve_nowait(4 * MB, tenant="t")
    granted = []

    async def waiter() -> None:
        granted.append(await pool.acquire(MB // 2, tenant="t"))

    with anyio.fail_after(60):  # the waiter is let in at once
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(1)
            whole.resize_nowait(4 * MB - MB // 2)  # still 4 pages held, half a page of quota free
    assert whole.size == 4 * MB and len(granted) == 1


def test_a_failing_release_listener_does_not_keep_the_others_from_hearing():
    pool = CountingPool([DeviceSpec("g0", 8 * MB)])
    heard: list[str] = []

    def broken() -> None:
        heard.append("broken")
        raise ValueError("listener bug")

    pool.add_release_listener(broken)
    pool.add_release_listener(lambda: heard.append("admission"))
    reservation = pool.reserve_nowait(MB)
    with pytest.raises(ValueError, match="listener bug"):
        reservation.release()
    assert heard == ["broken", "admission"] and pool.statistics().allocated == 0


def test_the_pools_figures_for_several_devices():
    """An empty pool of two devices read a fragmentation of 0.5 (free memory split between
    devices counted as fragmentation), and the counting pool said 0 reservations everywhere."""
    for pool in (
        CountingPool([DeviceSpec("a", 8 * MB), DeviceSpec("b", 8 * MB)]),
        ExtentPool([DeviceSpec("a", 8 * MB), DeviceSpec("b", 8 * MB)], page_size=MB),
    ):
        assert pool.statistics().fragmentation == 0.0
        pool.reserve_nowait(MB, device="a")
        assert [d.reservations for d in pool.statistics().devices] == [1, 0]
        assert pool.statistics().fragmentation == 0.0



async def test_listeners_hear_a_release_whose_waiter_s_compaction_failed():
    """Before: the move callback's error, raised while the release placed a waiter by moving a
    reservation, skipped the release listeners: admission never heard memory had come free."""
    pool = ExtentPool([DeviceSpec("g0", 10 * MB)], page_size=MB, strategy="first-fit", settle=False)
    held = [pool.reserve_nowait(2 * MB, owner=i) for i in range(5)]
    held[1].release()
    held[2].movable = True  # the 4 pages a waiter needs open only by moving it
    heard: list[str] = []
    pool.add_release_listener(lambda: heard.append("admission"))

    def copy_fails(reservation, move) -> None:
        raise OSError("copy failed")

    pool.set_move_callback(copy_fails)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.acquire, 4 * MB)
        await anyio.sleep(1)
        heard.clear()
        with pytest.raises(OSError, match="copy failed"):
            held[3].release()
        assert heard == ["admission"] and held[3].released
        assert pool.statistics().waiting == 1  # still first in line
        held[0].release()  # pages 0-3 free: the waiter is served
    accounts_agree(pool)
    assert pool.statistics().waiting == 0


@pytest.mark.parametrize("kind", ["counting", "extent"])
def test_what_is_not_a_reservation_or_a_listener_is_refused_naming_it(kind):
    """`release(None)` and `resize_nowait(None, n)` raised bare AttributeErrors; a listener that
    cannot be called was taken, and every later release failed on it; removing one never added
    said only "list.remove(x): x not in list"."""
    pool = CountingPool([DeviceSpec("g0", 8 * MB)]) if kind == "counting" else ExtentPool([DeviceSpec("g0", 8 * MB)], page_size=MB)
    held = pool.reserve_nowait(MB, owner="a")
    for call in (lambda: pool.release(None), lambda: pool.release("res-1"), lambda: pool.resize_nowait(None, MB)):
        with pytest.raises(TypeError, match="^reservation: expected a Reservation"):
            call()
    with pytest.raises(TypeError, match="^callback: "):
        pool.add_release_listener("not callable")
    with pytest.raises(ValueError, match="^callback: .* is not a release listener"):
        pool.remove_release_listener(print)
    held.release()  # nothing was taken by the refusals: releases go on as before
    assert pool.statistics().allocated == 0


class _Memory:
    """A device's bytes, which the move callback copies ``memmove``-style as an owner would."""

    def __init__(self, pages: int) -> None:
        self.bytes = bytearray(pages)

    def write(self, r, data: bytes) -> None:
        self.bytes[r.offset : r.offset + len(data)] = data

    def read(self, r, n: int) -> bytes:
        return bytes(self.bytes[r.offset : r.offset + n])

    def move(self, r, move) -> None:
        self.bytes[move.dst : move.dst + move.length] = self.bytes[move.src : move.src + move.length]


@pytest.mark.parametrize("settle", [True, False])
def test_a_grow_that_moves_copies_its_data_before_its_old_pages_are_reused(settle):
    """A grow that cannot grow in place moves through the move callback, as every move does,
    before the pages it leaves can go to anyone else. It freed them first, and the same call
    settled an idle neighbour into them: the caller, told to copy after the call, copied the
    neighbour's bytes. With the callback copying, its data now follows it."""
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy="first-fit", settle=settle)
    memory = _Memory(16)
    pool.set_move_callback(memory.move)
    r, m = pool.reserve_nowait(2, owner="R"), pool.reserve_nowait(2, owner="M")
    memory.write(r, b"RR")
    memory.write(m, b"MM")
    m.movable = True
    assert r.resize_nowait(6) is True
    assert (memory.read(r, 2), memory.read(m, 2)) == (b"RR", b"MM")
    accounts_agree(pool)


def test_a_grow_whose_move_callback_fails_stays_where_it_was():
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy="first-fit")
    r, _ = pool.reserve_nowait(2, owner="R"), pool.reserve_nowait(2, owner="M")

    def refuse(reservation, move):
        raise OSError("copy failed")

    pool.set_move_callback(refuse)
    with pytest.raises(OSError, match="copy failed"):
        r.resize_nowait(6)
    assert (r.offset, r.size, r.nbytes) == (0, 2, 2)
    assert pool.statistics().allocated == 4
    accounts_agree(pool)
    pool.set_move_callback(None)
    assert r.resize_nowait(6) is True and r.size == 6
    accounts_agree(pool)


def test_a_resize_says_it_moved_when_the_compaction_it_set_off_moved_it():
    """A shrink that frees memory may set off a compaction that moves the reservation itself:
    resize_nowait said False ("not moved") where its offset had changed."""
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy="first-fit", settle=False, compact_threshold=0.0)
    moves = []
    pool.set_move_callback(lambda r, move: moves.append((r.owner, move.src, move.dst)))
    x, r = pool.reserve_nowait(2, owner="X"), pool.reserve_nowait(4, owner="R")
    x.release()
    r.movable = True
    assert r.resize_nowait(3) is True
    assert moves == [("R", 2, 0)] and r.offset == 0


async def test_a_waiter_that_gives_up_gets_its_cancellation_when_a_move_fails_meanwhile(caplog):
    """A waiter that gives up has the pool serve the waiters behind it, which may settle idle
    reservations; a move callback failing there replaced the waiter's cancellation, escaped its
    cancel scope and failed the task group. The failure is logged instead."""
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy="first-fit", settle_moves=1)
    x = pool.reserve_nowait(2, owner="X")
    a, b = pool.reserve_nowait(2, owner="A"), pool.reserve_nowait(2, owner="B")
    a.movable = b.movable = True
    x.release()  # a hole at 0: one move made (A), the other hole queued

    def fail(reservation, move):
        raise OSError(f"copy of {reservation.owner} failed")

    pool.set_move_callback(fail)
    seen = []

    async def waiter():
        try:
            await pool.acquire(13, owner="W")
        except BaseException as exc:
            seen.append(exc)
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert len(seen) == 1 and isinstance(seen[0], anyio.get_cancelled_exc_class())
    assert "copy of B failed" in caplog.text
    assert pool.statistics().waiting == 0
    accounts_agree(pool)


def test_a_reservation_of_another_pool_or_a_tenant_that_is_no_name_is_refused():
    """Releasing another pool's reservation did nothing (the other pool kept the memory); a
    tenant that is no name was taken (5 keyed the statistics) or failed unnamed (a list)."""
    one, two = (ExtentPool([DeviceSpec("g", 8 * MB)], page_size=MB) for _ in range(2))
    r = one.reserve_nowait(MB)
    with pytest.raises(ValueError, match="another pool"):
        two.release(r)
    assert not r.released and one.statistics().allocated == MB
    for tenant in (5, ["x"], b"acme"):
        with pytest.raises(TypeError, match="tenant: expected a tenant's name"):
            one.reserve_nowait(MB, tenant=tenant)
        with pytest.raises(TypeError, match="tenant: expected a tenant's name"):
            anyio.run(lambda: one.acquire(MB, tenant=tenant))
    assert one.statistics().allocated == MB and not one.statistics().by_tenant


def test_a_grow_past_its_own_device_names_that_device():
    pool = ExtentPool([DeviceSpec("big", 80 * MB), DeviceSpec("small", 8 * MB)], page_size=MB)
    r = pool.reserve_nowait(4 * MB, device="small")
    with pytest.raises(RequestTooLarge, match="its device 'small' holds 8,388,608 bytes"):
        r.resize_nowait(16 * MB)


@pytest.mark.parametrize("strategy", ["first-fit", "frag-aware"])
def test_a_grow_gets_room_by_moving_idle_reservations_as_a_new_request_does(strategy):
    """A grow with no run to grow into was refused (and counted a fragmentation failure) where
    moving an idle neighbour made room, which the pool does for a new request of that size.
    Nothing moves into the pages it leaves before its data is copied out of them."""
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy=strategy)
    memory = _Memory(16)
    pool.set_move_callback(memory.move)
    r = pool.reserve_nowait(4, owner="R", device="g")
    m = pool.reserve_nowait(2, owner="M")
    filler = pool.reserve_nowait(6, owner="filler")
    pool.reserve_nowait(4, owner="X")  # busy: it stays
    filler.release()
    m.movable = True
    memory.write(r, b"RRRR")
    memory.write(m, b"MM")
    r.resize_nowait(8)
    assert r.size == 8 and pool.statistics().fragmentation_failures == 0
    assert (memory.read(r, 4), memory.read(m, 2)) == (b"RRRR", b"MM")
    accounts_agree(pool)


def test_a_grow_whose_room_by_moving_fails_keeps_its_pages():
    """A move callback that raises while idle reservations move to make a grow room: the grow
    had freed its pages and left them free, and the next request was placed over it."""
    pool = ExtentPool([DeviceSpec("g", 16)], page_size=1, strategy="first-fit")
    r = pool.reserve_nowait(4, owner="R", device="g")
    m = pool.reserve_nowait(2, owner="M")
    filler = pool.reserve_nowait(6, owner="filler")
    pool.reserve_nowait(4, owner="X")
    filler.release()
    m.movable = True

    def refuse(reservation, move):
        raise OSError(f"copy of {reservation.owner} failed")

    pool.set_move_callback(refuse)
    with pytest.raises(OSError, match="copy of M failed"):
        r.resize_nowait(8)
    assert (r.offset, r.size) == (0, 4)
    accounts_agree(pool)
    pool.set_move_callback(None)
    other = pool.reserve_nowait(4, owner="other")
    assert other.offset >= r.offset + r.size or other.offset + other.size <= r.offset
    accounts_agree(pool)


@pytest.mark.parametrize("kind", ["extent", "counting"])
def test_a_shrink_is_allowed_while_a_lowered_quota_is_still_below_what_is_held(kind):
    """Before: a tenant holding more than its lowered quota could not shrink part of the way
    (QuotaExceeded, "could never fit"), although a shrink only gives memory back."""
    devices = [DeviceSpec("g0", 16 * MB)]
    pool = ExtentPool(devices, page_size=MB, quotas={"t": 8 * MB}) if kind == "extent" else CountingPool(devices, quotas={"t": 8 * MB})
    r = pool.reserve_nowait(6 * MB, tenant="t")
    pool.set_quota("t", 3 * MB)
    assert r.resize_nowait(4 * MB) is False  # still over the quota, but less so
    assert r.nbytes == 4 * MB and pool.statistics().by_tenant == {"t": 4 * MB}
    with pytest.raises(QuotaExceeded):
        r.resize_nowait(5 * MB)  # growing past the quota is still refused
    assert r.nbytes == 4 * MB and pool.statistics().allocated == 4 * MB


def test_an_async_move_callback_is_refused_instead_of_moving_data_nobody_copies():
    """Before: an ``async def`` move callback (natural in an AnyIO program) was taken and called
    without being awaited: the pool moved reservations whose data nobody copied, with at most a
    "never awaited" warning. It is refused where it is given, and one that returns an awaitable
    all the same (a lambda around the async function) has its move undone."""

    async def copy(r, move) -> None:
        raise AssertionError("never runs")

    for give in (
        lambda: ExtentPool([DeviceSpec("g", 8 * MB)], page_size=MB, move_callback=copy),
        lambda: ExtentPool([DeviceSpec("g", 8 * MB)], page_size=MB).set_move_callback(copy),
        lambda: ExtentPool([DeviceSpec("g", 8 * MB)], page_size=MB).set_move_callback("copy"),
        lambda: ExtentPool([DeviceSpec("g", 8 * MB)], page_size=MB).apply_plan(holey_pool()[0].plan_compaction(), copy),
    ):
        with pytest.raises(TypeError, match="^move callback: expected a function that copies"):
            give()
    pool, held = holey_pool()
    pool.set_move_callback(lambda r, move: copy(r, move))
    plan = pool.plan_compaction(threshold=0.0)
    assert plan.moves
    with pytest.raises(TypeError, match="returned an awaitable"):
        pool.apply_plan(plan)
    assert held[2].offset == 2 * MB  # not moved: its data is where it was
    accounts_agree(pool)
