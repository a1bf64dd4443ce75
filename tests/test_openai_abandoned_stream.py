"""A ``ctx.openai`` stream the agent leaves unread and unclosed (``break`` out of ``async for``, a
common SDK pattern) gives its place in the dispatcher's window back once the engine has sent the
whole answer, as against a server, where the rest of the answer waits in the connection.

Before, the place stayed taken until the session ended: with a window of one, the session's
next call waited for ever; with a window of four, four sessions that each left a stream and went
into a long tool blocked every other tenant (an 8-token call waited 599 s, the engine idle)."""

from __future__ import annotations

import gc
import warnings

import anyio
import pytest

from fleetsched import Scheduler
from fleetsched.virtual_time import LOOPS, run_virtual

from .helpers import check_released, settings

MESSAGES = [{"role": "user", "content": "x " * 200}]


def _fixed_window(size: int) -> dict:
    return {"backend": {"kind": "sim", "max_in_flight": size}, "dispatch": {"adaptive_window": False}}


async def _leave_a_stream(ctx, max_tokens: int = 64):
    """Read the first chunk of a streamed answer, then leave the stream as it is."""
    stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=max_tokens, stream=True)
    async for _ in stream:
        break
    return stream


@pytest.mark.parametrize("loop", LOOPS)
def test_a_session_makes_its_next_call_after_leaving_a_stream_with_a_window_of_one(loop):
    async def agent(ctx):
        stream = await _leave_a_stream(ctx)
        await anyio.sleep(5)  # the engine has long finished that answer
        in_flight = scheduler.statistics().dispatcher.in_flight
        answer = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=8)
        del stream
        return in_flight, answer.usage.completion_tokens

    async def main():
        nonlocal scheduler
        async with Scheduler(settings(**_fixed_window(1))) as scheduler:
            with anyio.fail_after(60):  # before: waited for ever on the window's one place
                assert await (await scheduler.submit(agent, tenant="acme")) == (0, 8)
        first, second = scheduler.recorder.calls
        assert first.error is None and first.completion_tokens == 64  # the whole answer, served
        check_released(scheduler)

    scheduler = None
    run_virtual(main, loop=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_sessions_that_left_streams_and_sit_in_tools_do_not_block_another_tenant(loop):
    async def sloppy(ctx):
        stream = await _leave_a_stream(ctx)
        async with ctx.tool("long-job"):
            await anyio.sleep(600)
        del stream

    async def other(ctx):
        start = anyio.current_time()
        await ctx.chat(MESSAGES, max_tokens=8)
        return anyio.current_time() - start

    async def main():
        s = settings({"sloppy": {}, "other": {}}, **_fixed_window(4))
        async with Scheduler(s) as scheduler:
            sloppies = [await scheduler.submit(sloppy, tenant="sloppy") for _ in range(4)]
            await anyio.sleep(10)  # their answers are long done; they sit in their tools
            with anyio.fail_after(60):  # before: 590 s, until the first tool ended
                latency = await (await scheduler.submit(other, tenant="other"))
            assert latency < 5
            assert scheduler.statistics().dispatcher.in_flight == 0
            for handle in sloppies:
                await handle
        check_released(scheduler)

    run_virtual(main, loop=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_left_unread_keeps_the_rest_of_its_answer_for_the_agent(loop):
    async def agent(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=16, stream=True)
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                break
        await anyio.sleep(30)  # the call has ended meanwhile; its chunks wait unread
        in_flight = scheduler.statistics().dispatcher.in_flight
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return in_flight, "".join(parts).split()

    async def main():
        nonlocal scheduler
        async with Scheduler(settings(**_fixed_window(1))) as scheduler:
            in_flight, words = await (await scheduler.submit(agent, tenant="acme"))
        assert in_flight == 0 and len(words) == 16
        check_released(scheduler)

    scheduler = None
    run_virtual(main, loop=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_closed_early_is_still_aborted_at_the_engine_at_once(loop):
    async def agent(ctx):
        stream = await _leave_a_stream(ctx, max_tokens=4000)
        await anyio.sleep(0.5)
        running = len(scheduler.backend.engine.running)
        await stream.close()
        return running, len(scheduler.backend.engine.running), scheduler.statistics().dispatcher.in_flight

    async def main():
        nonlocal scheduler
        async with Scheduler(settings(**_fixed_window(1))) as scheduler:
            assert await (await scheduler.submit(agent, tenant="acme")) == (1, 0, 0)
        (record,) = scheduler.recorder.calls
        assert 0 < record.completion_tokens < 4000
        check_released(scheduler)

    scheduler = None
    run_virtual(main, loop=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_backend_stream_that_fails_as_it_is_closed_fails_no_other_session(loop):
    """The call of a ctx.openai stream ends in a task beside the session (the scheduler's): an
    error from closing the backend's stream (a mock: no engine fails so on demand) must reach
    at most that session, never the scheduler's task group, whose other sessions it would cancel."""
    from fleetsched.backends.base import Backend, make_chunk

    class FailsOnClose(Backend):
        async def stream_chat(self, body):
            try:
                for _ in range(1000):
                    await anyio.sleep(0.01)
                    yield make_chunk("c", "m", 0, role="assistant", content="x")
            finally:
                raise RuntimeError("the connection broke as it was closed")

    async def closes_early(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=1000, stream=True)
        async for _ in stream:
            break
        await stream.close()

    async def bystander(ctx):
        async with ctx.tool("wait"):
            await anyio.sleep(5)
        return "done"

    async def main():
        async with Scheduler(settings({"a": {}, "b": {}}, **_fixed_window(4)), backend=FailsOnClose()) as scheduler:
            other = await scheduler.submit(bystander, tenant="b")
            first = await scheduler.submit(closes_early, tenant="a")
            with anyio.fail_after(60):
                assert await other == "done"
                try:
                    await first
                except Exception:
                    pass  # its own session may fail with it: that is all
        assert scheduler.statistics().dispatcher.in_flight == 0

    run_virtual(main, loop=loop)


def test_streams_read_to_their_end_or_left_open_leave_no_unclosed_buffer():
    """Each ``ctx.openai`` stream's buffer is closed, read to its end or left open by its agent
    (closed by the session's end then). Before, every one was collected unclosed: anyio's
    ResourceWarning "Unclosed <MemoryObjectReceiveStream>", a stream at a time, under
    ``python -X dev`` or ``-W error``."""

    async def reads_to_the_end(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=MESSAGES, max_tokens=8, stream=True)
        return len([chunk async for chunk in stream])

    async def leaves_a_stream(ctx):
        stream = await _leave_a_stream(ctx, max_tokens=8)
        await anyio.sleep(5)  # its answer has ended meanwhile, unread
        del stream

    async def main():
        async with Scheduler(settings()) as scheduler:
            assert await scheduler.run(reads_to_the_end, tenant="acme") > 0
            await scheduler.run(leaves_a_stream, tenant="acme")

    gc.collect()  # what earlier tests left (their sockets, say) is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        run_virtual(main)  # asyncio: trio's own async-generator hooks warn of the SDK's generators
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and "MemoryObject" in str(w.message)] == []
