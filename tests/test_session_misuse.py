"""Agents that misuse their session, and callers that give up on the scheduler: each gets a
clear error or a clean end, nothing stays held, and no other session is harmed.

Every test here failed before its fix (each was seen failing first)."""

from __future__ import annotations

import anyio
import openai
import pytest

from fleetsched import DeadlineExceeded, InvalidRequest, Scheduler, SessionCancelled, SessionEnded, SessionFailed
from fleetsched.backends.instant import InstantBackend
from fleetsched.scheduler.records import CANCELLED
from fleetsched.scheduler.session import SessionState

from .helpers import check_released, settings, virtual_loop

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Both event loops, on virtual time."""
    return virtual_loop(request.param)


GB = 10**9
MESSAGES = [{"role": "user", "content": "hello " * 20}]


def one_slot(**scheduler):
    return settings(scheduler={"max_sessions": 1, "drain_grace_s": 600, **scheduler})


async def hold(seconds: float):
    async def agent(ctx):
        await anyio.sleep(seconds)
        return "held"

    return agent


async def test_a_context_kept_after_its_session_ended_is_refused_and_holds_nothing():
    """A task that outlives its agent keeps `ctx`: its calls and tool marks raise `SessionEnded`
    (a tool mark re-admitted the ended session: a slot and memory held for good)."""
    kept = []

    async def leaky(ctx):
        kept.append(ctx)
        return "ok"

    async with Scheduler(one_slot(tool_policy="release")) as scheduler:
        assert await (await scheduler.submit(leaky, tenant="acme")) == "ok"
        ctx = kept[0]
        with pytest.raises(SessionEnded, match="session-.* has ended .done."):
            async with ctx.tool("search"):
                pass
        with pytest.raises(SessionEnded):
            await ctx.chat(MESSAGES, max_tokens=4)
        with pytest.raises(SessionEnded):
            async with ctx.stream(MESSAGES, max_tokens=4):
                pass
        check_released(scheduler)
        assert await (await scheduler.submit(await hold(1), tenant="acme")) == "held"
    check_released(scheduler)


@pytest.mark.parametrize("cleanup", ["tool", "chat"])
async def test_a_parked_session_s_shielded_cleanup_does_not_hang_the_exit(cleanup):
    """Parked in a tool at shutdown, a session cancelled by the exit marks a tool or makes a model
    call in a shielded scope. Nothing is re-admitted once the scheduler closes: it waited for
    ever, and the exit with it. Now the tool's end leaves it parked (the session ends cancelled)
    and the call raises `SchedulerClosed` (the session fails, naming it)."""
    from fleetsched import SchedulerClosed

    async def agent(ctx):
        try:
            async with ctx.tool("search"):
                await anyio.sleep(100)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):  # cleanup that must run
                if cleanup == "tool":
                    async with ctx.tool("flush-log"):
                        await anyio.sleep(1)
                else:
                    await ctx.chat(MESSAGES, max_tokens=4)
            raise

    with anyio.fail_after(3600):
        async with Scheduler(settings(scheduler={"tool_policy": "release", "drain_grace_s": 0})) as scheduler:
            handle = await scheduler.submit(agent, tenant="acme")
            await anyio.sleep(1)
            assert handle.parked
    if cleanup == "tool":
        assert handle.state is SessionState.CANCELLED
    else:
        assert handle.state is SessionState.FAILED and isinstance(handle.error, SchedulerClosed)
        assert "is parked in a tool and the scheduler is closing" in str(handle.error)
    check_released(scheduler)


async def test_a_quota_lowered_under_a_waiting_session_fails_that_session_alone():
    """`pool.set_quota` lowered a tenant's quota below a queued session's memory: the refusal
    escaped from `set_quota`, then from the next session's end inside the scheduler's task
    group (every session of every tenant cancelled). A parked session of that tenant returning
    from its tool would wait for ever. Now each fails alone with `QuotaExceeded`."""
    from fleetsched.errors import QuotaExceeded

    async def parks(ctx):
        async with ctx.tool("search"):
            await anyio.sleep(5)
        return "back"

    tenants = {"acme": {"memory_quota": "4GB"}, "other": {}}
    s = settings(tenants, scheduler={"tool_policy": "release"})
    async with Scheduler(s) as scheduler:
        other = await scheduler.submit(await hold(10), tenant="other")
        parked = await scheduler.submit(parks, tenant="acme", memory=3 * GB)
        first = await scheduler.submit(await hold(10), tenant="acme", memory=2 * GB)
        queued = await scheduler.submit(await hold(10), tenant="acme", memory=3 * GB)  # parked: 2 + 3 > 4
        await anyio.sleep(1)
        assert parked.parked and queued.state is SessionState.QUEUED
        scheduler.pool.set_quota("acme", 2 * GB)
        with pytest.raises(SessionFailed):
            await queued
        assert isinstance(queued.error, QuotaExceeded) and queued.state is SessionState.REJECTED
        with pytest.raises(SessionFailed) as info:
            await parked
        assert isinstance(info.value.__cause__, QuotaExceeded)
        assert await first == "held" and await other == "held"
    check_released(scheduler)


async def test_an_agent_s_sys_exit_leaves_the_scheduler_bare(anyio_backend_name):
    """It came out of the block in a BaseExceptionGroup: `except SystemExit` missed it, and the
    process exited with status 1 on trio (3 on asyncio)."""
    if anyio_backend_name == "asyncio":
        pytest.skip("asyncio raises a task's SystemExit out of its event loop itself, past every block")

    async def agent(ctx):
        await anyio.sleep(1)
        raise SystemExit(3)

    with pytest.raises(SystemExit) as info:
        async with Scheduler(settings()) as scheduler:
            await (await scheduler.submit(agent, tenant="acme"))
    assert info.value.code == 3
    check_released(scheduler)


async def test_reading_on_after_a_stream_read_was_cut_short_raises():
    """A timeout around one read of `ctx.stream` ends the call (the cancellation went through the
    stream's async generators, which end for good). Reading on ended the stream quietly: the
    agent got 16 of 1,200 characters, and the call was recorded without an error."""
    seen = []

    async def agent(ctx):
        async with ctx.stream(MESSAGES, max_tokens=300) as chunks:
            with anyio.move_on_after(0.01):  # a per-read timeout, say
                async for _ in chunks:
                    pass
            with pytest.raises(RuntimeError, match=r"a read of this stream was cut short \(\w+\): its call ended there"):
                await chunks.__anext__()
            seen.append("refused")
        return "ok"

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == "ok"
    assert seen == ["refused"]
    (call,) = scheduler.recorder.calls
    assert call.error in ("Cancelled", "CancelledError")  # not a whole answer
    check_released(scheduler)


async def test_an_agent_cannot_release_its_own_session_s_memory():
    """`ctx.reservation.release()` was accepted: the session ran on without its memory, and the
    pool admitted three 40 GB sessions on an 80 GB device."""

    async def gives_back(ctx):
        ctx.reservation.release()
        await anyio.sleep(5)

    async with Scheduler(settings(scheduler={"session_memory": "40GB"})) as scheduler:
        handle = await scheduler.submit(gives_back, tenant="acme")
        with pytest.raises(SessionFailed, match="is released by the scheduler, when its session ends or parks in a tool"):
            await handle
        assert await scheduler.run(await hold(1), tenant="acme") == "held"
    check_released(scheduler)


async def test_a_call_that_outlives_its_session_keeps_the_session_s_memory_until_it_ends():
    """An agent starts a call in a task outside its session and returns: the session ends, and
    its slot is free for the next, but its memory stays reserved while the call is at the engine
    (before, it was freed at once: admission counted memory that the engine still used)."""

    async def escaping(ctx, outside):
        async def call():
            await ctx.chat(MESSAGES, max_tokens=200)

        outside.start_soon(call)
        await anyio.sleep(0.001)  # the call has reached the engine
        return "ok"

    async with anyio.create_task_group() as outside:
        sim = settings(backend={"kind": "sim"}, scheduler={"max_sessions": 1, "session_memory": "30GB"})
        async with Scheduler(sim) as scheduler:
            handle = await scheduler.submit(lambda ctx: escaping(ctx, outside), tenant="acme")
            assert await handle == "ok"
            stats = scheduler.statistics()
            assert (stats.slots_in_use, stats.memory.allocated) == (0, 30 * GB)
            assert handle.calls_in_flight == 1
            with anyio.fail_after(600):
                while handle.calls_in_flight:
                    await anyio.sleep(0.01)
            assert scheduler.statistics().memory.allocated == 0
            assert handle.counters.calls == 1  # counted as its session's
            assert await scheduler.run(await hold(1), tenant="acme") == "held"
        check_released(scheduler)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize(("b_starts", "periods", "tool_s"), [(0.5, 1, 1.5), (2.0, 2, 2.0)])
async def test_tools_of_two_tasks_of_one_session_are_readmitted_once(slots, b_starts, periods, tool_s):
    """Two tasks of a session each in a tool, the session parked meanwhile. Overlapping blocks
    make one tool period; "b" opening while "a" waits to be re-admitted waits with it: the
    session is re-admitted once (before: the agent ran a second time with 2 slots, hung with 1)."""
    starts = []

    async def agent(ctx):
        starts.append(anyio.current_time())

        async def tool(name: str, after: float) -> None:
            await anyio.sleep(after)
            async with ctx.tool(name):
                await anyio.sleep(1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(tool, "a", 0)
            tg.start_soon(tool, "b", b_starts)
        return "ok"

    async with Scheduler(settings(scheduler={"max_sessions": slots, "tool_policy": "release"})) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await anyio.sleep(0.1)
        blockers = [await scheduler.submit(await hold(10), tenant="acme") for _ in range(slots)]
        with anyio.fail_after(60):
            assert await handle == "ok"
        for blocker in blockers:
            assert await blocker == "held"
    assert len(starts) == 1
    assert handle.parked_count == 1
    assert handle.counters.tool_calls == periods and handle.counters.tool_s == tool_s
    check_released(scheduler)


async def test_a_tool_begun_while_another_task_waits_to_be_readmitted_parks_once_it_is():
    """Task "fg" left its tool at 5 s and waited to be re-admitted behind a session holding the
    only slot until 10 s; task "bg" began a 60-s tool at 6 s, while the session was parked (its
    park came to nothing then). Re-admitted at 10 s, the session kept its slot through bg's whole
    tool (release policy), the session queued at 8 s waiting until 66 s, and its activity read
    "thinking"."""
    seen = []

    async def agent(ctx):
        async def background():
            await anyio.sleep(6)
            async with ctx.tool("bg"):
                await anyio.sleep(60)

        async with anyio.create_task_group() as tg:
            tg.start_soon(background)
            async with ctx.tool("fg"):  # parks at once
                await anyio.sleep(5)
            seen.append(("fg back", anyio.current_time(), ctx._handle.activity))

    async def other(ctx):
        seen.append(("other", anyio.current_time()))

    async with Scheduler(one_slot(tool_policy="release")) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await anyio.sleep(0.1)
        await scheduler.submit(await hold(10), tenant="acme")  # takes the slot the tool lends
        await anyio.sleep(8)
        await scheduler.submit(other, tenant="acme")
        await handle
    assert seen == [("fg back", 10.1, "tool"), ("other", 10.1)]
    assert handle.parked_count == 2
    check_released(scheduler)


async def test_a_model_call_inside_a_tool_waits_for_the_parked_session_to_be_readmitted():
    """A tool that is itself a model call (a sub-agent): the parked session is re-admitted first,
    so two sessions never have calls in flight on one slot."""
    answered = []

    async def sub_agent(ctx):
        async with ctx.tool("ask-llm"):  # the release policy parks it at once: `other` waits
            reply = await ctx.chat(MESSAGES, max_tokens=8)
            answered.append(anyio.current_time() - ctx._handle.timestamps[SessionState.QUEUED])
        return reply["usage"]["completion_tokens"]

    async def other(ctx):
        await anyio.sleep(5)
        return "other"

    s = settings(
        scheduler={"max_sessions": 1, "tool_policy": "release"},
        backend={"kind": "sim"},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "1GB"}]},
    )
    async with Scheduler(s) as scheduler:
        first = await scheduler.submit(sub_agent, tenant="acme", memory=GB)
        second = await scheduler.submit(other, tenant="acme", memory=GB)
        assert await first == 8 and await second == "other"
    # The call waited for `other` to end: answered after its re-admission at 5 s, not sent while parked.
    assert answered[0] > 5.0
    assert first.parked_count == 1
    check_released(scheduler)


async def test_cancel_right_after_submit_never_starts_the_agent():
    started = []

    async def agent(ctx):
        started.append(True)
        await ctx.chat(MESSAGES, max_tokens=4)
        return "ran"

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        assert handle.state is SessionState.ADMITTED
        handle.cancel()
        with pytest.raises(SessionCancelled):
            await handle
    assert started == [] and scheduler.dispatcher.statistics().calls_started == 0
    check_released(scheduler)


async def test_cancel_from_another_thread_is_refused_and_changes_nothing():
    """`handle.cancel()` from a worker thread (sync code beside the loop) took a queued session
    out of the queue, then failed to end it (no event loop in that thread): it stayed counted,
    and the scheduler's exit waited for it for ever. Now it raises at once, naming the way to
    call it, and changes nothing. On an ended session it does nothing, from anywhere (asyncio
    raised "no running event loop" there)."""

    async def forever(ctx):
        await anyio.sleep_forever()

    async with Scheduler(one_slot()) as scheduler:
        ended = await scheduler.submit(await hold(1), tenant="acme")
        assert await ended == "held"
        await anyio.to_thread.run_sync(ended.cancel)
        assert ended.state is SessionState.DONE
        running = await scheduler.submit(forever, tenant="acme")
        queued = await scheduler.submit(forever, tenant="acme")
        for handle in (queued, running):
            with pytest.raises(RuntimeError, match=r"cancel\(\) was called from a thread other than its event loop's.*from_thread"):
                await anyio.to_thread.run_sync(handle.cancel)
        assert queued.state is SessionState.QUEUED and scheduler.statistics().queued_total == 1
        assert running.state is SessionState.RUNNING
        queued.cancel()
        running.cancel()
        for handle in (queued, running):
            with pytest.raises(SessionCancelled):
                await handle
    check_released(scheduler)


async def test_submitting_from_another_threads_event_loop_is_refused_and_holds_nothing():
    """`asyncio.run(scheduler.submit(...))` in a worker thread counted the session and gave it a
    slot, then failed to start it in the scheduler's task group (on trio an AttributeError about
    a `RunContext`; on asyncio it ended cancelled, unsaid): the exit waited for it for ever."""
    import asyncio

    async def agent(ctx):
        return "ran"

    async with Scheduler(settings()) as scheduler:

        def submit_there(run: bool) -> object:
            return asyncio.run(scheduler.run(agent, tenant="acme") if run else scheduler.submit(agent, tenant="acme"))

        for run in (False, True):
            with pytest.raises(RuntimeError, match="submitted from a thread other than the scheduler's event loop's.*from_thread"):
                await anyio.to_thread.run_sync(submit_there, run)
        assert scheduler.statistics().running_total == 0
        assert await scheduler.run(agent, tenant="acme") == "ran"
        assert await anyio.to_thread.run_sync(lambda: anyio.from_thread.run(lambda: scheduler.run(agent, tenant="acme"))) == "ran"
    assert scheduler.statistics().finished == {"done": 2}
    check_released(scheduler)


async def test_one_scheduler_entered_by_two_tasks_at_once_refuses_the_second():
    """Two tasks entering one Scheduler while its entry awaits its backend (a vLLM server asked
    for its model) both passed the "entered only once" check: the second's task group replaced
    the first's, and leaving them crashed ("Attempted to exit a cancel scope that isn't the
    current tasks's current cancel scope"; on trio, an internal error of trio's)."""

    class AsksForItsModel(InstantBackend):
        async def served_model(self):
            await anyio.sleep(1)
            return None

    async def agent(ctx):
        return "ran"

    scheduler = Scheduler(settings(), backend=AsksForItsModel())
    outcomes: dict[int, str] = {}

    async def use(i: int) -> None:
        try:
            async with scheduler:
                outcomes[i] = await scheduler.run(agent, tenant="acme")
        except RuntimeError as exc:
            outcomes[i] = str(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(use, 1)
        tg.start_soon(use, 2)
    assert sorted(outcomes.values()) == ["a Scheduler can be entered only once", "ran"]
    check_released(scheduler)


async def test_a_queued_session_fails_at_its_deadline_and_leaves_the_queue():
    ran = []

    async def agent(ctx):
        ran.append(True)
        return "late"

    async with Scheduler(one_slot()) as scheduler:
        blocker = await scheduler.submit(await hold(100), tenant="acme")
        late = await scheduler.submit(agent, tenant="acme", deadline_s=5)
        with pytest.raises(SessionFailed) as info:
            await late
        assert anyio.current_time() - late.timestamps[SessionState.QUEUED] == 5.0
        assert isinstance(info.value.__cause__, DeadlineExceeded)
        assert "passed its deadline while queued" in str(info.value.__cause__)
        assert scheduler.statistics().queued_total == 0
        # Admitted in time, a session's deadline timer goes with its admission.
        prompt = await scheduler.submit(await hold(1), tenant="acme", deadline_s=200)
        assert await blocker == "held" and await prompt == "held"
    assert ran == []
    assert scheduler.statistics().finished == {"done": 2, "failed": 1}
    check_released(scheduler)


async def test_leaving_an_openai_stream_without_closing_it_frees_its_place_when_the_session_ends():
    """``break`` out of the SDK's stream, no ``close()``: the call held a place of the window for
    good (with a window of one, every later call waited forever)."""

    async def breaker(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=500, stream=True)
        async for _ in stream:
            break
        return "left"

    async def chatter(ctx):
        return (await ctx.chat(MESSAGES, max_tokens=5))["usage"]["completion_tokens"]

    s = settings(backend={"kind": "sim", "max_in_flight": 1}, dispatch={"adaptive_window": False})
    async with Scheduler(s) as scheduler:
        assert await (await scheduler.submit(breaker, tenant="acme")) == "left"
        assert scheduler.statistics().dispatcher.in_flight == 0
        with anyio.fail_after(60):
            assert await (await scheduler.submit(chatter, tenant="acme")) == 5
    check_released(scheduler)


async def test_stream_options_that_are_not_an_object_are_refused_before_taking_a_place():
    async def agent(ctx):
        async with ctx.stream(MESSAGES, max_tokens=4, stream_options="yes please"):
            pass

    s = settings(backend={"kind": "instant", "max_in_flight": 1}, dispatch={"adaptive_window": False})
    async with Scheduler(s) as scheduler:
        with pytest.raises(SessionFailed) as info:
            await (await scheduler.submit(agent, tenant="acme"))
        assert isinstance(info.value.__cause__, InvalidRequest)
        assert "stream_options: expected an object, got 'yes please'" in str(info.value.__cause__)
        assert scheduler.statistics().dispatcher.in_flight == 0
    check_released(scheduler)


class AgentsOwnBaseException(BaseException):
    pass


@pytest.mark.parametrize("error", [GeneratorExit, AgentsOwnBaseException])
async def test_a_base_exception_from_an_agent_fails_its_session_alone(error):
    async def bad(ctx):
        await anyio.sleep(1)
        raise error()

    async with Scheduler(settings()) as scheduler:
        good = await scheduler.submit(await hold(5), tenant="acme")
        with pytest.raises(SessionFailed) as info:
            await (await scheduler.submit(bad, tenant="acme"))
        assert isinstance(info.value.__cause__, error)
        assert await good == "held"
    assert scheduler.statistics().finished == {"failed": 1, "done": 1}
    check_released(scheduler)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("how", ["submit", "run"])
async def test_an_asyncio_cancelled_error_of_the_agents_own_fails_its_session_alone(anyio_backend_name, how, grouped):
    """A CancelledError raised while the session's task is not being cancelled (an awaited future
    that something else cancelled) is the agent's failure. It passed on as a cancellation: under
    `submit` it cancelled the scheduler's task group, the other tenant's session and the caller's
    task with it; under `run` the caller got a bare CancelledError. The same in a group (it
    passed on as a cancellation after the bare one was fixed)."""
    if anyio_backend_name != "asyncio":
        pytest.skip("trio's cancellation is its own exception class: an asyncio.CancelledError is an error there anyway")
    import asyncio

    async def bad(ctx):
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.5, future.cancel)
        try:
            await future
        except asyncio.CancelledError as exc:
            if grouped:
                raise BaseExceptionGroup("the agent's tasks", [exc]) from None
            raise

    async with Scheduler(settings(tenants={"a": {}, "b": {}})) as scheduler:
        good = await scheduler.submit(await hold(5), tenant="b")
        with pytest.raises(SessionFailed) as info:
            if how == "submit":
                await (await scheduler.submit(bad, tenant="a"))
            else:
                await scheduler.run(bad, tenant="a")
        cause = info.value.__cause__
        assert isinstance(cause.exceptions[0] if grouped else cause, asyncio.CancelledError)
        assert await good == "held"
    assert scheduler.statistics().finished == {"failed": 1, "done": 1}
    check_released(scheduler)


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_a_task_of_the_agent_failing_while_cancelled_fails_its_session_alone(how):
    """An agent's own task group, cancelled (its deadline, `cancel()`), with a task that raises
    as it is cancelled: on trio the group holds the task's error beside `Cancelled`, and it went
    on out of the session and brought the scheduler down (the good session was cancelled)."""

    async def messy(ctx):
        async def child():
            try:
                await anyio.sleep(100)
            except anyio.get_cancelled_exc_class():
                raise RuntimeError("cleanup failed") from None

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
            await anyio.sleep(100)

    async with Scheduler(settings()) as scheduler:
        good = await scheduler.submit(await hold(10), tenant="acme")
        bad = await scheduler.submit(messy, tenant="acme", deadline_s=2 if how == "deadline" else None)
        if how == "cancel":
            await anyio.sleep(2)
            bad.cancel()
        with pytest.raises(SessionFailed) as info:
            await bad
        assert await good == "held"
    failure = info.value.__cause__
    assert isinstance(failure, ExceptionGroup)
    assert [type(e) for e in failure.exceptions] == [RuntimeError]
    assert bad.timestamps[SessionState.FAILED] == 2.0
    check_released(scheduler)


async def test_cancelled_from_outside_during_its_drain_the_scheduler_still_ends_every_session():
    """The code around ``async with Scheduler`` gives up while it drains: sessions that `run`
    started and queued ones are cancelled, nothing stays held (before: a queued session was
    admitted after the exit, holding its slot and memory for good)."""

    async def long(ctx):
        for _ in range(100):
            await anyio.sleep(1)
            await ctx.chat(MESSAGES, max_tokens=2)
        return "done"

    outcomes: dict[str, str] = {}

    async def run_one(scheduler: Scheduler) -> None:
        try:
            await scheduler.run(long, tenant="acme")
        except SessionCancelled:
            outcomes["run"] = "cancelled"

    start = anyio.current_time()
    async with anyio.create_task_group() as outer:
        with anyio.move_on_after(5):
            async with Scheduler(settings(scheduler={"max_sessions": 1, "drain_grace_s": 30})) as scheduler:
                outer.start_soon(run_one, scheduler)
                await anyio.sleep(0.1)
                queued = await scheduler.submit(long, tenant="acme")
        assert anyio.current_time() - start == 5.0
        check_released(scheduler)
    assert outcomes == {"run": "cancelled"}
    assert queued.state is SessionState.CANCELLED
    assert scheduler.statistics().finished == {"cancelled": 2}


async def test_a_stream_read_after_its_block_raises_rather_than_ending_quietly():
    """Read after ``async with ctx.stream(...)`` ended, the stream gave no chunks and no error:
    an agent took the cut answer for a whole one."""

    async def agent(ctx):
        async with ctx.stream(MESSAGES, max_tokens=20) as chunks:
            first = await chunks.__anext__()
        rest = [chunk async for chunk in chunks]
        return first, rest

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        with pytest.raises(SessionFailed) as info:
            await (await scheduler.submit(agent, tenant="acme"))
    assert "read inside its `async with` block only" in str(info.value.__cause__)
    check_released(scheduler)


async def test_a_session_ending_while_a_task_waits_to_be_readmitted_releases_everything():
    """A task outliving the agent's scope waits in a model call for the parked session's
    re-admission when the session passes its deadline: the call raises `SessionEnded` (before:
    the ended session was re-admitted later and held its slot and memory for good)."""
    outcome = []
    s = settings(
        scheduler={"max_sessions": 1, "tool_policy": "release", "drain_grace_s": 0},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "1GB"}]},
    )
    async with anyio.create_task_group() as outer:
        async with Scheduler(s) as scheduler:

            async def late_call(ctx):
                await anyio.sleep(1)  # the session is parked in its tool by then
                try:
                    await ctx.chat(MESSAGES, max_tokens=2)
                except SessionEnded:
                    outcome.append("refused")

            async def agent(ctx):
                outer.start_soon(late_call, ctx)
                async with ctx.tool("search"):
                    await anyio.sleep(10)

            ended = await scheduler.submit(agent, tenant="acme", memory=GB, deadline_s=5)
            other = await scheduler.submit(await hold(20), tenant="acme", memory=GB)
            assert await other == "held"
            assert ended.state is SessionState.FAILED
            check_released(scheduler)
    assert outcome == ["refused"]


async def test_a_call_under_way_holds_off_parking_and_moving_until_it_ends():
    """A tool period begins in one task while another task's call is under way: the memory is
    not movable and the session not parked during the call, and it parks as soon as the call
    ends (before: movable during the call, and the refused park never came back)."""
    seen = []

    async def agent(ctx):
        async def call() -> None:
            await ctx.chat(MESSAGES, max_tokens=400)

        async def tool() -> None:
            await anyio.sleep(0.01)
            async with ctx.tool("search"):
                seen.append((ctx._handle.calls_in_flight, ctx.reservation.movable))
                await anyio.sleep(100)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(tool)

    async def other(ctx):
        return anyio.current_time()

    s = settings(
        scheduler={"max_sessions": 1, "tool_policy": "release"},
        backend={"kind": "sim"},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "1GB"}]},
    )
    async with Scheduler(s) as scheduler:
        start = anyio.current_time()
        session = await scheduler.submit(agent, tenant="acme", memory=GB)
        admitted_at = await (await scheduler.submit(other, tenant="acme", memory=GB))
        await session
    assert seen == [(1, False)]
    assert session.parked_count == 1
    assert admitted_at - start < 5  # the call's end, not the tool's (100 s)
    check_released(scheduler)


async def test_a_call_waiting_for_readmission_is_not_sent_by_a_park_in_the_same_instant():
    """Task b's call waits for the parked session's re-admission; task c's tool period began
    meanwhile, and its park timer fires as the session is resumed (adaptive policy): the call
    still goes out only with the slot and memory held (before: sent with neither)."""
    sent = []
    s = settings(
        scheduler={"max_sessions": 1, "tool_policy": "adaptive", "drain_grace_s": 60},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "1GB"}]},
    )
    async with Scheduler(s) as scheduler:
        dispatch = scheduler.dispatcher.chat

        async def observed(body, **route):  # records the session's holdings as each call is sent
            sent.append((session._holds_slot, session.reservation is not None))
            return await dispatch(body, **route)

        scheduler.dispatcher.chat = observed  # type: ignore[method-assign]

        async def agent(ctx):
            async def tool(name: str, after: float) -> None:
                await anyio.sleep(after)
                async with ctx.tool(name):
                    await anyio.sleep(3)

            async def call() -> None:
                await anyio.sleep(2)
                await ctx.chat(MESSAGES, max_tokens=2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(tool, "x", 0)
                tg.start_soon(call)
                tg.start_soon(tool, "y", 5)
            return "ok"

        session = await scheduler.submit(agent, tenant="acme", memory=GB)
        other = await scheduler.submit(await hold(5), tenant="acme", memory=GB)
        assert await session == "ok" and await other == "held"
    assert sent == [(True, True)]
    check_released(scheduler)


async def test_an_openai_stream_read_by_a_task_that_outlives_its_session_ends_with_it():
    """A task started outside the agent reads a ``ctx.openai`` stream when the agent returns: the
    session's end closed the stream under the reading task ("aclose(): asynchronous generator is
    already running"), which crashed the scheduler and every session in it. Now the reader's
    wait is cut and it gets `SessionEnded`."""
    outcome = []
    reading = anyio.Event()

    async def reader(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=2000, stream=True)
        try:
            async for _ in stream:
                reading.set()
        except SessionEnded:
            outcome.append("ended")

    async with anyio.create_task_group() as outer:
        async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:

            async def agent(ctx):
                outer.start_soon(reader, ctx)
                await reading.wait()
                return "left"

            assert await (await scheduler.submit(agent, tenant="acme")) == "left"
            chatter = await scheduler.submit(await hold(1), tenant="acme")
            assert await chatter == "held"
    assert outcome == ["ended"]
    check_released(scheduler)


async def test_a_stream_refused_or_failed_counts_no_call_as_a_chat_refused_counts_none():
    """A session's call count (its record's `calls`) is of calls made: ctx.chat counted only
    those that answered, while ctx.stream counted in its block's `finally` every attempt,
    refused ones (a context too long, a session that had ended) included."""
    too_long = {"role": "user", "content": "x" * 400_000}  # over the sim model's context

    async def agent(ctx):
        for call in (lambda: ctx.chat([too_long]), lambda: _read(ctx.stream([too_long]))):
            with pytest.raises(InvalidRequest):
                await call()
        await _read(ctx.stream(MESSAGES, max_tokens=3))
        await ctx.chat(MESSAGES, max_tokens=2)
        return ctx

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        ctx = await handle
        with pytest.raises(SessionEnded):  # after its end: refused, not counted
            await _read(ctx.stream(MESSAGES))
    assert handle.counters.calls == 2 and handle.counters.completion_tokens == 5
    assert scheduler.recorder.sessions[0].calls == 2
    check_released(scheduler)


async def _read(stream) -> None:
    async with stream as chunks:
        async for _ in chunks:
            pass


async def test_a_stream_left_while_a_task_reads_it_frees_its_place_and_says_why():
    """An agent leaves a ``ctx.stream()`` block while a task of its own reads the chunks: closing
    the stream under that read raised Python's "aclose(): asynchronous generator is already
    running", which skipped the call's end. Its place in the window stayed taken for good, and
    another tenant's call (a window of 1) waited out its deadline. Now the place comes back,
    and the error says what was done wrong."""

    async def reader(chunks):
        async for _ in chunks:
            pass

    async def agent(ctx):
        async with anyio.create_task_group() as tg:
            async with ctx.stream(MESSAGES, max_tokens=200) as chunks:
                tg.start_soon(reader, chunks)
                await anyio.sleep(0.001)  # the reader waits inside the stream now

    async def chat(ctx):
        return (await ctx.chat(MESSAGES, max_tokens=4))["usage"]["completion_tokens"]

    one_place = settings(
        tenants={"acme": {}, "other": {}}, backend={"kind": "sim", "max_in_flight": 1}, dispatch={"adaptive_window": False}
    )
    async with Scheduler(one_place) as scheduler:
        with pytest.raises(SessionFailed) as failed:
            await (await scheduler.submit(agent, tenant="acme"))
        assert "while another task was reading it" in repr(failed.value.__cause__)
        assert scheduler.dispatcher.statistics().in_flight == 0
        with anyio.fail_after(60):
            assert await (await scheduler.submit(chat, tenant="other", deadline_s=600)) == 4
    check_released(scheduler)


@pytest.mark.parametrize("when", ["at once", "queued"])
async def test_a_pool_failing_to_admit_a_session_fails_that_session_alone(when):
    """The pool's move callback fails while it compacts to admit a session. Admitted at once:
    `submit` raised, but the session stayed counted as live, and the scheduler's exit waited for
    it for good (shielded: no timeout could end it). Queued: the error left a release of another
    session's memory and cancelled every session. Now the session fails alone."""
    from fleetsched.resources import DeviceSpec, ExtentPool

    failing = False

    def move(reservation, new_offset):
        if failing:
            raise OSError("copy failed")

    pool = ExtentPool([DeviceSpec("gpu0", 10 * GB)], strategy="first-fit", page_size=GB, settle=False)
    pool.set_move_callback(move)

    async def in_tool(ctx):
        async with ctx.tool("search"):
            await anyio.sleep(20)
        return "tool"

    bystanders = []
    with anyio.fail_after(300):
        async with Scheduler(settings(scheduler={"tool_policy": "keep"}), pool=pool) as scheduler:
            for agent, size in ((await hold(20), 3), (in_tool, 2), (await hold(2), 2), (await hold(20), 1), (await hold(2), 2)):
                bystanders.append(await scheduler.submit(agent, tenant="acme", memory=size * GB))
            if when == "queued":  # no room yet: it queues, and is admitted when 4 GB come free in two holes
                failing = True
                late = await scheduler.submit(await hold(1), tenant="acme", memory=4 * GB)
                with pytest.raises(SessionFailed) as failed:
                    await late
                assert isinstance(failed.value.__cause__, OSError)
            else:
                await anyio.sleep(3)  # two holes of 2 GB: 4 GB free, in pieces
                failing = True
                with pytest.raises(SessionFailed) as failed:  # as the queued one's: a raw OSError was raised
                    await scheduler.submit(await hold(1), tenant="acme", memory=4 * GB)
                assert isinstance(failed.value.__cause__, OSError)
            failing = False
            assert [await handle for handle in bystanders] == ["held", "tool", "held", "held", "held"]
    check_released(scheduler)


@pytest.mark.parametrize("fails", ["listener", "move callback"])
async def test_a_pool_callback_failing_after_a_release_harms_no_other_session(fails, caplog):
    """A release listener of the pool's owner, or its move callback settling another session's
    memory, raises once after a session's memory was released: the error left that session's
    cleanup and cancelled every session of the scheduler. Now it is logged, and the fleet runs
    on."""
    from fleetsched.resources import DeviceSpec, ExtentPool

    pool = ExtentPool([DeviceSpec("gpu0", 10 * GB)], strategy="first-fit", page_size=GB)
    failures = [OSError("copy failed")]

    def fail_once(*_):
        if failures:
            raise failures.pop()

    if fails == "listener":
        pool.add_release_listener(fail_once)
    else:
        pool.set_move_callback(fail_once)

    async def in_tool(ctx):  # movable, so the release before it settles it down
        async with ctx.tool("search"):
            await anyio.sleep(5)
        return "tool"

    async with Scheduler(settings(scheduler={"tool_policy": "keep"}), pool=pool) as scheduler:
        handles = [await scheduler.submit(agent, tenant="acme", memory=2 * GB) for agent in (await hold(1), in_tool, await hold(10))]
        assert [await handle for handle in handles] == ["held", "tool", "held"]
    assert not failures and "copy failed" in caplog.text
    check_released(scheduler)


async def test_a_session_woken_from_its_return_by_the_exit_ends_cancelled():
    """At the end of the drain, a session whose model call waits to be re-admitted after a tool
    is cancelled by the exit, as every other is. The exit woke the wait first, and the call
    raised `SchedulerClosed` before the cancellation came: the session was recorded FAILED."""

    async def agent(ctx):
        try:
            async with ctx.tool("search"):  # parks at once (release): the slot goes to the hog
                await anyio.sleep(0.05)
                raise ValueError("tool failed")
        except ValueError:
            pass
        await ctx.chat(MESSAGES, max_tokens=4)  # waits to be re-admitted, behind the hog

    async def hog(ctx):
        await anyio.sleep(100)

    async with Scheduler(one_slot(tool_policy="release", drain_grace_s=0.5)) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await anyio.sleep(0.01)
        await scheduler.submit(hog, tenant="acme")
        await anyio.sleep(0.2)
        assert scheduler.statistics().queued_total == 1  # the call waits to return
    assert handle.state is SessionState.CANCELLED and handle.error is None
    assert scheduler.statistics().finished == {"cancelled": 2}
    check_released(scheduler)


async def test_a_return_given_up_at_the_head_of_the_queue_lets_the_sessions_behind_it_in():
    """A parked session's call waits to be re-admitted at the head of the queue, its memory not
    free; the call gives up (a timeout around it). The session behind it, which fits, was held
    back until an unrelated release (here 10 s later)."""

    async def parks(ctx):
        try:
            async with ctx.tool("flaky"):
                await anyio.sleep(0.1)
                raise ValueError("tool failed")  # the session stays parked
        except ValueError:
            pass
        with anyio.move_on_after(0.5):
            await ctx.chat(MESSAGES, max_tokens=4)
        await anyio.sleep(10)

    async def long(ctx):
        await anyio.sleep(10)

    s = settings(
        scheduler={"max_sessions": 3, "tool_policy": "release"},
        resources={"strategy": "counting", "devices": [{"name": "gpu0", "memory": "8GB"}]},
    )
    async with Scheduler(s) as scheduler:
        await scheduler.submit(parks, tenant="acme", memory=6 * GB)
        await anyio.sleep(0.05)
        await scheduler.submit(long, tenant="acme", memory=4 * GB)
        await anyio.sleep(0.2)  # the parked session's call waits: 6 GB asked, 4 GB free
        small = await scheduler.submit(lambda ctx: anyio.sleep(0), tenant="acme", memory=1 * GB)
        await small.ended()
        assert small.waited_s() == pytest.approx(0.35)  # submitted at 0.25, in when the call gave up at 0.6
    check_released(scheduler)


async def test_a_slot_freed_under_calls_made_from_outside_goes_to_the_next_session():
    """A session ends while a call made through its context from a task outside it is at the
    engine: its slot is free at once (its memory when the call ends), and the next session,
    which needs only a slot, is admitted then, not when the call ends."""

    class Slow(InstantBackend):
        async def stream_chat(self, body):
            await anyio.sleep(5)
            async for chunk in super().stream_chat(body):
                yield chunk

    async with Scheduler(one_slot(), backend=Slow()) as scheduler:
        async with anyio.create_task_group() as outside:

            async def hands_on(ctx):
                outside.start_soon(lambda: ctx.chat(MESSAGES, max_tokens=4))
                await anyio.sleep(0.1)

            await scheduler.submit(hands_on, tenant="acme")
            nxt = await scheduler.submit(lambda ctx: anyio.sleep(0), tenant="acme")
            await nxt.ended()
            assert nxt.waited_s() == pytest.approx(0.1)
    check_released(scheduler)


@pytest.mark.parametrize("seconds", ["int64", "float32", "Fraction"])
async def test_seconds_of_any_real_number_type_are_taken(seconds):
    """`deadline_s` and `expected_s` of a numpy integer or float32 (or a Fraction) were refused
    with "must be a number of seconds", where `memory` took numpy's integers."""
    import fractions

    import numpy as np

    value = fractions.Fraction(30) if seconds == "Fraction" else getattr(np, seconds)(30)
    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(lambda ctx: anyio.sleep(0), tenant="acme", deadline_s=value, expected_s=value)
        await handle
    assert handle.state is SessionState.DONE


async def test_a_task_that_outlives_its_session_leaves_its_record_alone():
    """A tool block left, or a model call refused, after the session ended changed the ended
    handle: its activity went back to "thinking", its tool counters grew after its record."""
    contexts = []
    async with Scheduler(settings()) as scheduler:
        async with anyio.create_task_group() as outside:

            async def agent(ctx):
                contexts.append(ctx)

                async def in_tool():
                    async with ctx.tool("background"):
                        await anyio.sleep(0.5)

                outside.start_soon(in_tool)
                await anyio.sleep(0.1)

            handle = await scheduler.submit(agent, tenant="acme")
            await handle
            counters = (handle.activity, handle.counters.tool_calls, handle.counters.tool_s)
            await anyio.sleep(1)  # the tool block is left
            with pytest.raises(SessionEnded):
                await contexts[0].chat(MESSAGES, max_tokens=2)
            assert (handle.activity, handle.counters.tool_calls, handle.counters.tool_s) == counters
    check_released(scheduler)


async def test_a_shielded_wait_to_return_from_a_tool_is_ended_by_the_exit():
    """A tool ends inside a shielded scope (cleanup that must run) while another session holds
    the only slot: the session waits there to be re-admitted when the drain runs out. Nothing is
    re-admitted once the scheduler closes, so the exit must wake that wait: left waiting, it held
    the exit until the agent's own timeout (here 600 s; without one, for ever)."""
    timed_out = []

    async def agent(ctx):
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(600) as guard:
                async with ctx.tool("flush-log"):  # parks at once (release): the hog takes the slot
                    await anyio.sleep(1)
            timed_out.append(guard.cancelled_caught)
        await anyio.sleep(1000)

    async with Scheduler(one_slot(tool_policy="release", drain_grace_s=5)) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await anyio.sleep(0.5)
        await scheduler.submit(await hold(1000), tenant="acme")
        await anyio.sleep(1)
        assert scheduler.statistics().queued_total == 1  # waits to return, behind the hog
    assert anyio.current_time() == 6.5  # the block left at 1.5 s, then the drain's 5 s
    assert timed_out == [False]
    assert handle.state is SessionState.CANCELLED
    check_released(scheduler)


async def test_a_model_call_made_past_the_sessions_deadline_is_refused():
    """Cleanup in a shielded scope after the session's deadline is past may not call the model:
    the call raises `DeadlineExceeded` before it reaches the engine (the engine spent tokens on a
    session already failed)."""
    refused = []

    async def agent(ctx):
        try:
            await anyio.sleep(100)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await anyio.sleep(1)  # cleanup that takes a moment, then a last word from the model
                try:
                    await ctx.chat(MESSAGES, max_tokens=4)
                except DeadlineExceeded as exc:
                    refused.append(str(exc))
            raise

    async with Scheduler(one_slot()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme", deadline_s=5)
        with pytest.raises(SessionFailed):
            await handle
    assert len(refused) == 1 and "after its deadline" in refused[0]
    assert isinstance(handle.error, DeadlineExceeded)
    assert not scheduler.recorder.calls
    check_released(scheduler)


async def test_memory_stays_pinned_until_the_last_call_under_way_in_a_tool_period_ends():
    """A tool period begins while two calls of the session are under way. The memory may be
    moved only once the session is idle: when the shorter call ended it was made movable
    already, under the longer call still at the engine."""
    seen = []

    async def agent(ctx):
        async def call(max_tokens: int) -> None:
            await ctx.chat(MESSAGES, max_tokens=max_tokens)
            seen.append((max_tokens, ctx._handle.calls_in_flight, ctx.reservation.movable))

        async def tool() -> None:
            await anyio.sleep(0.01)
            async with ctx.tool("search"):
                await anyio.sleep(100)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 40)
            tg.start_soon(call, 400)
            tg.start_soon(tool)

    s = settings(scheduler={"tool_policy": "keep"}, backend={"kind": "sim"})
    async with Scheduler(s) as scheduler:
        await (await scheduler.submit(agent, tenant="acme"))
    assert seen == [(40, 1, False), (400, 0, True)]
    check_released(scheduler)


async def test_a_session_past_its_deadline_fails_with_deadline_exceeded_through_the_sdk_too():
    """Work that no cancellation cuts (blocking code, a shielded scope, a thread) ran past the
    session's deadline, and the agent's next call was through ``ctx.openai``: the call was refused
    as past the deadline, a 408 to the SDK, and the session failed with the SDK's
    `APIStatusError`, not `DeadlineExceeded`, as ``ctx.chat`` fails it. The refusal now lets the
    session's own cancellation in first."""

    async def agent(ctx):
        await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=4)
        with anyio.CancelScope(shield=True):
            await anyio.sleep(10)  # past the deadline, uncut
        return await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=4)

    async with Scheduler(one_slot()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme", deadline_s=5)
        with pytest.raises(SessionFailed) as info:
            await handle
    assert isinstance(handle.error, DeadlineExceeded) and isinstance(info.value.__cause__, DeadlineExceeded)
    assert len(scheduler.recorder.calls) == 1
    check_released(scheduler)


async def test_a_call_cut_short_counts_in_its_session_as_in_its_record():
    """Calls cut short at the engine (a timeout around the call, around the block of its stream,
    or around the reads of one of ctx.openai; the SDK's timeout) count in their session, with the tokens they had received, as
    their records count them (cut, not failed). Before, of the cut calls only the one whose
    block went on after its cut read was counted: the session counted 2 calls, 68 prompt and 27
    output tokens, where its records counted 6 calls, 204 and 120."""

    async def agent(ctx):
        async with ctx.stream(MESSAGES, max_tokens=500) as chunks:
            await anext(chunks)
            with anyio.move_on_after(0.05):
                async for _ in chunks:
                    pass
        with anyio.move_on_after(0.05):
            async with ctx.stream(MESSAGES, max_tokens=500) as chunks:
                async for _ in chunks:
                    pass
        with anyio.move_on_after(0.05):
            await ctx.chat(MESSAGES, max_tokens=500)
        create = ctx.openai.chat.completions.create
        with pytest.raises(openai.APITimeoutError):
            await create(model=ctx.model, messages=MESSAGES, max_tokens=500, timeout=0.05)
        stream = await create(model=ctx.model, messages=MESSAGES, max_tokens=500, stream=True)
        with anyio.move_on_after(0.05):
            async for _ in stream:
                pass
        await ctx.chat(MESSAGES, max_tokens=3)
        return "ok"

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        assert await handle == "ok"
    records = scheduler.recorder.calls
    assert [r.error in CANCELLED for r in records] == [True] * 5 + [False]
    assert records[-1].error is None and all(r.completion_tokens > 0 for r in records)
    c, (session,) = handle.counters, scheduler.recorder.sessions
    counted = (len(records), sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records))
    assert (c.calls, c.prompt_tokens, c.completion_tokens) == counted
    assert (session.calls, session.prompt_tokens, session.completion_tokens) == counted
    check_released(scheduler)
