"""Keep or release a session's slot and memory during tool calls (policy, then scheduler)."""

from __future__ import annotations

import functools
import math

import anyio
import pytest

from fleetsched import Scheduler, SessionCancelled, SessionFailed, SessionState
from fleetsched.observability.metrics import SchedulerCollector
from fleetsched.observability.sla import SlaTracker
from fleetsched.policies.pace import KeepOrRelease, ToolStats

from .helpers import check_released, settings


def learned(tool: str, *durations: float) -> ToolStats:
    stats = ToolStats()
    for d in durations:
        stats.observe(tool, d)
    return stats


def test_policy_modes_and_pressure():
    stats = learned("search", 30, 30, 30)
    assert KeepOrRelease("keep").ttl_s("search", stats, waiting=5) == math.inf
    assert KeepOrRelease("release").ttl_s("search", stats, waiting=0) == 0
    adaptive = KeepOrRelease("adaptive", keep_s=2.0, unknown_ttl_s=1.0)
    assert adaptive.ttl_s("search", stats, waiting=0) == math.inf  # nobody waits: keep
    assert adaptive.ttl_s("search", stats, waiting=3) == 0  # long tool, others wait: release
    assert adaptive.ttl_s("calc", learned("calc", 0.1, 0.2, 0.1), waiting=3) == 2.0  # short: keep
    assert adaptive.ttl_s("new-tool", stats, waiting=3) == 1.0  # no history yet: keep a while


def test_tool_stats_are_pessimistic():
    stats = learned("t", 1, 3)
    assert stats.expected_s("t") is None  # too few samples
    stats.observe("t", 2)
    assert stats.expected_s("t") == pytest.approx(2 + 1)


def test_tool_stats_keep_a_bounded_number_of_tool_names():
    """A model that keeps inventing tool names (run_tool_loop times them under the model's
    names) grew the statistics by one entry a name for the whole run. The names seen longest
    ago are forgotten; one in use stays learned however many others come and go."""
    stats = learned("search", 1, 1, 1)
    for i in range(3 * 4096):
        stats.observe(f"invented-{i}", 0.01)
        if i % 100 == 0:
            stats.observe("search", 1)
    assert len(stats._tools) <= 4096, len(stats._tools)
    assert stats.expected_s("search") == pytest.approx(1) and stats.count("invented-0") == 0


def tool_agent(tool_s: float, log: list, label: str, *, fail: bool = False):
    async def agent(ctx):
        log.append((label, "start", anyio.current_time()))
        await ctx.chat([{"role": "user", "content": "plan"}], max_tokens=4)
        async with ctx.tool("long-tool"):
            await anyio.sleep(tool_s)
            if fail:
                raise RuntimeError("tool failed")
        await ctx.chat([{"role": "user", "content": "answer"}], max_tokens=4)
        log.append((label, "end", anyio.current_time()))

    return agent


def sleeper(seconds: float, log: list, label: str):
    async def agent(ctx):
        log.append((label, "start", anyio.current_time()))
        await anyio.sleep(seconds)
        log.append((label, "end", anyio.current_time()))

    return agent


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # Released after the unknown-tool TTL (1 s): B runs meanwhile; A resumes when its tool ends.
        ("adaptive", [("A", "start", 0.0), ("B", "start", 1.0), ("B", "end", 11.0), ("A", "end", 100.0)]),
        # The seeds' way: A holds its slot through the tool, B waits for all of it.
        ("keep", [("A", "start", 0.0), ("A", "end", 100.0), ("B", "start", 100.0), ("B", "end", 110.0)]),
    ],
)
async def test_a_long_tool_lends_its_slot(policy, expected):
    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": policy, "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        a = await scheduler.submit(tool_agent(100, log, "A"), tenant="acme")
        await anyio.sleep(0.5)
        await scheduler.submit(sleeper(10, log, "B"), tenant="acme")
        await anyio.sleep(5)
        stats = scheduler.statistics()
        assert stats.slots_in_use == 1
        assert stats.parked == (1 if policy == "adaptive" else 0)
    assert log == expected
    assert a.parked_count == (1 if policy == "adaptive" else 0)
    check_released(scheduler)


@pytest.mark.anyio
async def test_returning_session_goes_before_newer_ones_of_its_tenant():
    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": "release", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        await scheduler.submit(tool_agent(5, log, "A"), tenant="acme")
        for label in ("B", "C"):
            await scheduler.submit(sleeper(10, log, label), tenant="acme")
    # A parks at t=0, B runs 0-10; A's tool ended at 5, so A goes before C.
    assert [entry for entry in log if entry[1] == "end"] == [("B", "end", 10.0), ("A", "end", 10.0), ("C", "end", 20.0)]
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_failing_tool_fails_its_session_and_leaks_nothing():
    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": "release"})
    async with Scheduler(s) as scheduler:
        bad = await scheduler.submit(tool_agent(3, log, "A", fail=True), tenant="acme")
        other = await scheduler.submit(sleeper(1, log, "B"), tenant="acme")
        with pytest.raises(SessionFailed):
            await bad
        await other
    check_released(scheduler)


@pytest.mark.anyio
async def test_cancel_while_parked_or_waiting_to_return():
    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": "release", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        parked = await scheduler.submit(tool_agent(50, log, "A"), tenant="acme")
        returning = await scheduler.submit(tool_agent(1, log, "R"), tenant="acme")
        blocker = await scheduler.submit(sleeper(100, log, "B"), tenant="acme")
        await anyio.sleep(10)  # A parked at 0, R parked at 0, B holds the slot; R waits to return
        stats = scheduler.statistics()
        assert (stats.parked, stats.queued_total) == (1, 1)  # A parked; R queued to return
        parked.cancel()
        returning.cancel()
        for handle in (parked, returning):
            with pytest.raises(SessionCancelled):
                await handle
        await blocker
    assert returning.state is SessionState.CANCELLED
    check_released(scheduler)


@pytest.mark.anyio
async def test_an_agent_that_sleeps_without_ctx_tool_keeps_its_slot_until_its_deadline():
    """The scheduler cannot tell such a sleep from thinking: the session keeps its slot (it is
    never parked), and its deadline is what bounds it."""
    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": "adaptive", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        sleepy = await scheduler.submit(sleeper(100, log, "sleepy"), tenant="acme", deadline_s=10)
        await scheduler.submit(sleeper(1, log, "B"), tenant="acme")
        with pytest.raises(SessionFailed):
            await sleepy
    assert sleepy.parked_count == 0
    assert type(sleepy.error).__name__ == "DeadlineExceeded"
    assert ("B", "start", 10.0) in log
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_session_waiting_to_return_is_pressure_on_tools_kept_for_lack_of_it():
    """A's tool ends while B sits in a tool kept because nobody waited when it began: A waiting to
    return makes the policy decide again, and B parks (before: A waited for all of B's tool)."""
    log: list = []

    def in_tool(label: str, seconds: float):
        async def agent(ctx):
            async with ctx.tool(label):
                await anyio.sleep(seconds)
            log.append((label, "back", anyio.current_time()))

        return agent

    s = settings(scheduler={"max_sessions": 1, "tool_policy": "adaptive", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        a = await scheduler.submit(in_tool("A", 100), tenant="acme")
        await anyio.sleep(1)
        b = await scheduler.submit(in_tool("B", 200), tenant="acme")  # A parks for it; B's tool is kept
        await a
        await b
    assert log == [("A", "back", 100.0), ("B", "back", 201.0)]
    assert (a.parked_count, b.parked_count) == (1, 1)
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_tool_that_raises_while_parked_fails_its_session_at_once():
    """The tool raised at 3 s while its session was parked: leaving the block waited to be
    re-admitted first, behind a session holding the slot for 100 s, and the session's deadline
    (50 s) came meanwhile: it failed at 50 s with DeadlineExceeded, the tool's error lost."""

    async def failing(ctx):
        async with ctx.tool("search"):
            await anyio.sleep(3)
            raise RuntimeError("search failed")

    async def recovering(ctx):  # catches it and goes on: its next model call re-admits it
        try:
            async with ctx.tool("search"):
                await anyio.sleep(3)
                raise RuntimeError("search failed")
        except RuntimeError:
            pass
        await ctx.chat([{"role": "user", "content": "answer anyway"}], max_tokens=4)
        return anyio.current_time()

    log: list = []
    s = settings(scheduler={"max_sessions": 1, "tool_policy": "release", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        bad = await scheduler.submit(failing, tenant="acme", deadline_s=50)
        recovered = await scheduler.submit(recovering, tenant="acme")
        await scheduler.submit(sleeper(100, log, "B"), tenant="acme")  # both park at once for it
        with pytest.raises(SessionFailed) as info:
            await bad
        assert anyio.current_time() == 3.0
        assert isinstance(info.value.__cause__, RuntimeError)
        assert await recovered == 100.0
    assert recovered.parked_count == 1
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_session_waiting_to_return_counts_as_queued_not_parked():
    """A's tool ended at 5 s while B holds the only slot: A waits to be re-admitted, queued. It
    was counted parked too (in statistics() and the fleetsched_sessions gauge): 3 sessions of 2."""

    async def in_tool(ctx):
        async with ctx.tool("search"):
            await anyio.sleep(5)

    async def holding(ctx):
        await anyio.sleep(10)

    s = settings(scheduler={"max_sessions": 1, "tool_policy": "release"})
    async with Scheduler(s) as scheduler:
        a = await scheduler.submit(in_tool, tenant="acme")
        await anyio.sleep(1)
        b = await scheduler.submit(holding, tenant="acme")
        await anyio.sleep(1)
        stats = scheduler.statistics()
        assert (stats.queued_total, stats.running_total, stats.parked) == (0, 1, 1)  # A in its tool
        await anyio.sleep(5)
        stats = scheduler.statistics()
        assert (stats.queued_total, stats.running_total, stats.parked) == (1, 1, 0)  # A back from it
        collector = SchedulerCollector(scheduler, SlaTracker(s.tenants))
        sessions = next(f for f in collector.collect() if f.name == "fleetsched_sessions")
        assert {x.labels["state"]: x.value for x in sessions.samples} == {"queued": 1, "running": 1, "parked": 0}
        await a
        await b
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_tool_cut_short_by_its_sessions_cancellation_is_not_learned():
    """Three sessions were cancelled half a second into a 100-s tool: their 0.5 s were learned
    as the tool's duration, a short tool, so the next session in it kept its slot for keep_s
    (2 s) while B waited, where a tool with no history is released after unknown_ttl_s (1 s)."""
    log: list = []

    async def cut_short(ctx):
        async with ctx.tool("long-tool"):
            await anyio.sleep(100)

    s = settings(scheduler={"max_sessions": 1, "tool_policy": "adaptive", "drain_grace_s": 1000})
    async with Scheduler(s) as scheduler:
        for _ in range(3):
            handle = await scheduler.submit(cut_short, tenant="acme")
            await anyio.sleep(0.5)
            handle.cancel()
            with pytest.raises(SessionCancelled):
                await handle
        start = anyio.current_time()
        a = await scheduler.submit(tool_agent(100, log, "A"), tenant="acme")
        await anyio.sleep(0.5)
        await scheduler.submit(sleeper(10, log, "B"), tenant="acme")
        await a
    assert [(label, event, t - start) for label, event, t in log] == [
        ("A", "start", 0.0),
        ("B", "start", 1.0),
        ("B", "end", 11.0),
        ("A", "end", 100.0),
    ]
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_parked_session_comes_back_with_the_memory_it_had_grown_to():
    """It was re-admitted with its size at submission: grown to 16 MiB, parked in a long tool, it
    came back with 4 MiB, and the 12 MiB between were the pool's to give away."""
    page = 2 << 20
    s = settings(
        {"a": {"session_memory": 2 * page}},
        resources={"devices": [{"name": "g0", "memory": 40 * page}]},
        scheduler={"max_sessions": 4, "tool_policy": "release"},
    )

    async def agent(ctx):
        await ctx.chat([{"role": "user", "content": "x"}], max_tokens=4)
        ctx.reservation.resize_nowait(8 * page)  # its context grew
        async with ctx.tool("search"):
            await anyio.sleep(60)
        await ctx.chat([{"role": "user", "content": "y"}], max_tokens=4)
        return ctx.reservation.nbytes, ctx._handle.parked_count

    async with Scheduler(s) as scheduler:
        assert await scheduler.run(agent, tenant="a") == (8 * page, 1)
    check_released(scheduler)


@pytest.mark.anyio
async def test_adaptive_keeps_a_tool_s_slot_when_no_waiting_session_could_take_it():
    """The only session waiting belongs to a tenant at its max_sessions: a long tool's slot and
    memory were released for it all the same, and the slot stood idle while the session came
    back later. A session of a tenant under its limit, arriving during the tool, still has the
    tool's slot released to it."""
    s = settings(
        {"a": {}, "b": {"max_sessions": 1}, "c": {}},
        scheduler={"max_sessions": 2, "tool_policy": "adaptive"},
    )
    arrived = []

    async def holder(ctx):
        await anyio.sleep(100)

    async def tool_user(ctx, tenant_arriving=None):
        await ctx.chat([{"role": "user", "content": "x"}], max_tokens=4)
        async with ctx.tool("search"):
            if tenant_arriving is not None:
                arrived.append(await scheduler.submit(holder, tenant=tenant_arriving))
            await anyio.sleep(30)
        return ctx._handle.parked_count

    async with Scheduler(s) as scheduler:
        for _ in range(3):
            scheduler._tool_stats.observe("search", 30.0)  # a long tool, learned
        await scheduler.submit(holder, tenant="b")
        await scheduler.submit(holder, tenant="b")  # waits: b is at its limit of 1
        assert await scheduler.run(tool_user, tenant="a") == 0
        assert await scheduler.run(functools.partial(tool_user, tenant_arriving="c"), tenant="a") == 1
        assert arrived[0].timestamps[SessionState.RUNNING] < 100  # it took a's slot during the tool


@pytest.mark.anyio
async def test_a_tool_kept_for_lack_of_pressure_parks_for_its_own_tenant_s_next_session():
    """Tenant a at its limit of 1, its session kept in a long tool (nobody it could serve
    waited); then a's next session arrives while b's waits at b's limit: the tool's slot was
    not reconsidered (another tenant was already waiting) and a's session waited the whole
    60-s tool, the slot idle."""
    s = settings(
        {"a": {"max_sessions": 1}, "b": {"max_sessions": 1}},
        scheduler={"max_sessions": 10, "tool_policy": "adaptive"},
    )

    async def holder(ctx):
        await anyio.sleep(100)

    async def tool_user(ctx):
        await ctx.chat([{"role": "user", "content": "x"}], max_tokens=4)
        async with ctx.tool("code-run"):
            await anyio.sleep(60)
        return ctx._handle.parked_count

    async def quick(ctx):
        return anyio.current_time()

    async with Scheduler(s) as scheduler:
        for _ in range(3):
            scheduler._tool_stats.observe("code-run", 60.0)  # a long tool, learned
        await scheduler.submit(holder, tenant="b")
        await scheduler.submit(holder, tenant="b")  # waits: b is at its limit
        user = await scheduler.submit(tool_user, tenant="a")
        await anyio.sleep(1)
        assert not user.parked  # kept: nobody waiting could take its slot
        assert await scheduler.run(quick, tenant="a") == 1.0  # its tenant's session took the slot
        assert await user == 1
        for handle in scheduler.running_sessions():
            handle.cancel()


@pytest.mark.anyio
async def test_a_session_back_from_a_tool_ages_from_its_return_not_its_submission():
    """Aging promotes a lower band by the time its session waited: a batch session that came back
    from a tool after 215 s of life counted all of it, and went before critical sessions that
    had waited 16 s."""
    s = settings(
        {"crit": {"tier": "critical"}, "bat": {"tier": "batch"}},
        scheduler={"max_sessions": 1, "aging_s": 60, "tool_policy": "release"},
    )
    order = []

    async def batch(ctx):
        await anyio.sleep(200)
        async with ctx.tool("t"):  # parks: its slot goes to the critical sessions
            await anyio.sleep(10)
        order.append(("batch", anyio.current_time()))

    async def crit(ctx):
        order.append(("crit", anyio.current_time()))
        await anyio.sleep(5)

    async with Scheduler(s) as scheduler:
        handles = [await scheduler.submit(batch, tenant="bat")]
        await anyio.sleep(199)
        handles += [await scheduler.submit(crit, tenant="crit") for _ in range(4)]
        for handle in handles:
            await handle
    assert order == [("crit", 200.0), ("crit", 205.0), ("crit", 210.0), ("crit", 215.0), ("batch", 220.0)]


@pytest.mark.anyio
async def test_a_deadline_missed_waiting_to_come_back_from_a_tool_is_the_queue_s():
    """The session's one call took no time, its tool 2 s, then it waited 18 s to be re-admitted
    and ran out of its 20-s deadline: the breach said "engine-slow" (only the first admission's
    wait was counted as the queue's)."""
    from fleetsched.observability.sla import session_event

    s = settings({"a": {"sla": {"deadline_s": 20}}, "b": {}}, scheduler={"max_sessions": 1, "tool_policy": "release"})

    async def agent(ctx):
        await ctx.chat([{"role": "user", "content": "hi"}], max_tokens=4)
        async with ctx.tool("t"):
            await anyio.sleep(2)
        await ctx.chat([{"role": "user", "content": "hi"}], max_tokens=4)

    async def hog(ctx):
        await anyio.sleep(60)

    async with Scheduler(s) as scheduler:
        handle = await scheduler.submit(agent, tenant="a")
        await anyio.sleep(0.5)
        other = await scheduler.submit(hog, tenant="b")  # takes the slot the tool lends
        await handle.ended()
        other.cancel()
    (record,) = [r for r in scheduler.recorder.sessions if r.tenant == "a"]
    assert record.error == "DeadlineExceeded" and record.readmit_wait_s == pytest.approx(18.0)
    met, breach = session_event(record, {"deadline": 20})
    assert not met and breach.reason == "queued"


@pytest.mark.anyio
async def test_a_model_call_inside_a_tool_ends_its_idleness_until_the_tool_ends():
    """A session parks as its tool begins, then calls the model from inside it: it is re-admitted
    for the call and, no longer idle, keeps its slot and pinned memory until the tool ends. It
    was parked again as soon as the call ended, its memory movable, and came back a third time."""
    seen: list = []

    async def agent(ctx):
        async with ctx.tool("search"):  # parks at once (release)
            await anyio.sleep(5)
            await ctx.chat([{"role": "user", "content": "progress?"}], max_tokens=4)  # re-admitted first
            await anyio.sleep(5)
            seen.append((ctx._handle.parked, ctx.reservation is not None and not ctx.reservation.movable))
        return ctx._handle.parked_count

    s = settings(scheduler={"tool_policy": "release"})
    async with Scheduler(s) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == 1
    assert seen == [(False, True)]
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_session_back_from_a_tool_keeps_the_aging_of_its_tenant_s_waiting_sessions():
    """A batch session waited from 1 s behind critical ones, due in at 121 s (two aging periods).
    Another batch session came back from a tool at 100 s and went ahead of it, as a returning
    session does: the tenant's queue then aged from 100 s, and both waited until 220 s."""
    s = settings(
        {"crit": {"tier": "critical"}, "bat": {"tier": "batch"}},
        scheduler={"max_sessions": 1, "aging_s": 60, "tool_policy": "release"},
    )
    order = []

    async def returning(ctx):
        async with ctx.tool("t"):  # parks at once: the critical sessions take the slot
            await anyio.sleep(100)
        order.append(("returning", anyio.current_time()))

    async def waiting(ctx):
        order.append(("waiting", anyio.current_time()))

    async with Scheduler(s) as scheduler:
        back = await scheduler.submit(returning, tenant="bat")
        await anyio.sleep(0.5)
        crits = [await scheduler.submit(sleeper(10, [], "crit"), tenant="crit") for _ in range(30)]
        await anyio.sleep(0.5)
        new = await scheduler.submit(waiting, tenant="bat")
        await back
        await new
        for handle in crits:
            handle.cancel()
    assert order == [("returning", 130.5), ("waiting", 130.5)]
    assert back.counters.readmit_wait_s == pytest.approx(30.5)  # from its return, not the inherited wait
    check_released(scheduler)
