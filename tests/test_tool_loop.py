"""The tool-calling loop: scripted decisions, real model calls, and every malformed case."""

from __future__ import annotations

import datetime
import functools
import re
import threading
import time

import anyio
import pytest

from fleetsched import Scheduler, SessionFailed, SessionState
from fleetsched.agents.loop import Tool, run_tool_loop
from fleetsched.backends.instant import InstantBackend
from fleetsched.virtual_time import LOOPS, run_virtual

from .helpers import check_released, settings, virtual_loop

pytestmark = pytest.mark.anyio


async def add(a: float, b: float) -> str:
    return str(a + b)


async def search(query: str) -> dict:
    await anyio.sleep(2)
    return {"hits": [f"result for {query}"]}


async def explode() -> str:
    raise RuntimeError("disk full")


async def hang() -> str:
    await anyio.sleep(3600)
    return "never"


async def opaque() -> object:
    return object()


async def upstream() -> str:
    raise TimeoutError("the weather API did not answer")


async def unmeasured() -> dict:
    return {"temperature": float("nan")}


async def deep() -> list:
    nested: list = []
    for _ in range(3000):
        nested = [nested]
    return nested


TOOLS = [
    Tool("add", add, "add two numbers", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}),
    Tool("search", search, "search the web"),
    Tool("explode", explode),
    Tool("hang", hang, timeout_s=5),
    Tool("opaque", opaque),
    Tool("upstream", upstream),
    Tool("unmeasured", unmeasured),
    Tool("deep", deep),
]


async def run(script, **kw):
    results = {}

    async def agent(ctx):
        results["loop"] = await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, script=script, **kw)
        return results["loop"].answer

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await handle
    check_released(scheduler)
    return results["loop"], handle


async def test_concurrent_tools_then_an_answer():
    script = [[{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "search", "arguments": {"query": "q"}}]]
    loop, handle = await run(script)
    assert loop.stopped == "answer" and loop.answer == "ok" and loop.turns == 2
    tool_messages = [m["content"] for m in loop.messages if m["role"] == "tool"]
    assert tool_messages == ["5", '{"hits": ["result for q"]}']
    assert handle.counters.calls == 2 and handle.counters.tool_calls == 1
    assert handle.counters.tool_s == 2.0  # both tools ran at once: one tool period of 2 s


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"name": "nope"}, "error: unknown tool 'nope'; available tools: add, deep, explode, hang, opaque, search, unmeasured, upstream"),
        ({"name": "add", "arguments": "{not json"}, "error: the arguments for 'add' are not valid JSON"),
        ({"name": "add", "arguments": "[1, 2]"}, "error: the arguments for 'add' must be a JSON object"),
        ({"name": "add", "arguments": {"x": 1}}, "error: tool 'add' raised TypeError"),
        ({"name": "explode"}, "error: tool 'explode' raised RuntimeError: disk full"),
        ({"name": "hang"}, "error: tool 'hang' did not finish within 5 s"),
        ({"name": "opaque"}, "error: tool 'opaque' returned a object that is not JSON"),
        # NaN went to the model as {"temperature": NaN}, which is not JSON.
        ({"name": "unmeasured"}, "error: tool 'unmeasured' returned a dict that is not JSON (Out of range float values"),
        # Valid JSON nested deeper than the json module recurses: a RecursionError failed the session.
        ({"name": "add", "arguments": "[" * 3000 + "]" * 3000}, "error: the arguments for 'add' are nested too deeply"),
        ({"name": "deep"}, "error: tool 'deep' returned a list that is not JSON (maximum recursion depth"),
        # A tool's own TimeoutError read "did not finish within 30 s", at once.
        ({"name": "upstream"}, "error: tool 'upstream' raised TimeoutError: the weather API did not answer"),
    ],
)
async def test_malformed_calls_become_errors_in_the_conversation(call, message):
    loop, handle = await run([[call]])
    assert handle.state is SessionState.DONE and loop.stopped == "answer"
    (tool_message,) = [m for m in loop.messages if m["role"] == "tool"]
    assert tool_message["content"].startswith(message)
    assert loop.tool_errors == 1


async def test_turn_limit():
    script = [[{"name": "add", "arguments": {"a": 1, "b": 1}}]] * 5
    loop, _ = await run(script, max_turns=3)
    assert loop.stopped == "turn_limit" and loop.turns == 3 and loop.answer is None


async def test_deadline_stops_the_loop_cleanly():
    async def agent(ctx):
        slow = [[{"name": "search", "arguments": {"query": "a"}}]] * 10
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, script=slow, max_turns=10)

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme", deadline_s=5)
        with pytest.raises(Exception):
            await handle
    # A deadline mid-tool cancels the session: failed with DeadlineExceeded, nothing leaked.
    assert handle.state is SessionState.FAILED and type(handle.error).__name__ == "DeadlineExceeded"
    check_released(scheduler)


async def test_invalid_turn_limit():
    async def agent(ctx):
        await run_tool_loop(ctx, [], TOOLS, max_turns=0)

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        with pytest.raises(Exception):
            await handle
    assert "max_turns must be >= 1" in str(handle.error)


async def test_empty_replies_are_answered_with_an_error_not_a_hang():
    from fleetsched.backends.instant import InstantBackend

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, max_turns=3)

    async with InstantBackend(text="") as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await (await scheduler.submit(agent, tenant="acme"))
    assert loop.stopped == "turn_limit" and loop.tool_errors == 3
    assert sum("your reply was empty" in (m["content"] or "") for m in loop.messages) == 3
    check_released(scheduler)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "5"])
def test_a_tool_timeout_must_be_positive(timeout_s):
    # Tool(timeout_s=0) was taken, and every call of the tool failed at once as "did not finish".
    with pytest.raises(ValueError, match="tool 'add': timeout_s must be > 0"):
        Tool("add", add, timeout_s=timeout_s)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        # Taken, then the loop's first model call failed with dict()'s own unnamed error.
        ({"parameters": "abc"}, ValueError, "tool 'add': parameters must be a JSON schema of an object"),
        ({"parameters": None}, ValueError, "tool 'add': parameters must be a JSON schema of an object"),
        # Served by the sim; OpenAI refuses a function whose arguments are not an object.
        ({"parameters": {"type": "string"}}, ValueError, "tool 'add': parameters must be a JSON schema of an object"),
        ({"description": 5}, TypeError, "tool 'add': description must be a str, got 5"),
    ],
)
def test_a_tool_with_a_schema_that_is_no_object_schema_is_refused(options, error, message):
    with pytest.raises(error, match=message):
        Tool("add", add, **options)


async def test_a_script_turn_without_a_tool_name_names_the_turn():
    """It failed the session with a bare KeyError('name')."""
    async def agent(ctx):
        await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, script=[[{"name": "add"}], [{"arguments": {}}]])

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        with pytest.raises(Exception) as failed:
            await handle
    check_released(scheduler)
    assert isinstance(failed.value.__cause__, ValueError)
    assert "script turn 1: a tool call needs a 'name'" in str(failed.value.__cause__)


def blocking_add(a: float, b: float) -> str:
    time.sleep(0.01)  # blocking work, as a `def` tool does (an HTTP client, a subprocess)
    return f"{a + b} in {'a worker thread' if threading.current_thread() is not threading.main_thread() else 'the loop'}"


class Deferred:
    """A callable object whose call returns an awaitable: awaited, as before."""

    def __call__(self, a: float, b: float):
        return add(a, b)


@pytest.mark.parametrize("anyio_backend", [virtual_loop("asyncio"), virtual_loop("trio")], ids=["asyncio", "trio"])
async def test_plain_functions_are_tools_too(anyio_backend):
    """A `def` tool was an error for the model on every call ("object str can't be used in
    'await' expression"); it now runs in a worker thread, so it does not stall other sessions."""
    tools = [
        Tool("add", blocking_add),
        Tool("upper", lambda word: word.upper()),
        Tool("add_later", lambda a, b: add(a, b)),  # a `def` returning an awaitable: awaited
        Tool("deferred", Deferred()),
    ]
    script = [[
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "upper", "arguments": {"word": "ok"}},
        {"name": "add_later", "arguments": {"a": 1, "b": 2}},
        {"name": "deferred", "arguments": {"a": 3, "b": 4}},
    ]]

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], tools, script=script)

    async with Scheduler(settings()) as scheduler:
        loop = await (await scheduler.submit(agent, tenant="acme"))
    check_released(scheduler)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"] == ["5 in a worker thread", "OK", "3", "7"]
    assert loop.tool_errors == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # a real clock: on a virtual one a thread's time does not count
async def test_a_plain_function_past_its_limit_is_left_behind(anyio_backend):
    tools = [Tool("slow", lambda: time.sleep(0.5), timeout_s=0.05)]

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], tools, script=[[{"name": "slow"}]])

    async with Scheduler(settings()) as scheduler:
        loop = await (await scheduler.submit(agent, tenant="acme"))
    check_released(scheduler)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"] == ["error: tool 'slow' did not finish within 0.05 s"]


async def _plain_tool_beside_timers() -> tuple[list[str], float]:
    """A session whose tools work in threads (10 ms each, limits of 30 s and 10 ms) and in a 2-s
    sleep, while a timer waits an hour: its tool results and its virtual duration."""
    tools = [
        Tool("add", blocking_add),
        Tool("tight", lambda: time.sleep(0.01) or "done", timeout_s=0.01),  # real time: not counted
        Tool("search", search),
    ]
    script = [[{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "tight"}], [{"name": "search", "arguments": {"query": "q"}}]]

    async def agent(ctx):
        start = anyio.current_time()
        loop = await run_tool_loop(ctx, [{"role": "user", "content": "go"}], tools, script=script)
        return [m["content"] for m in loop.messages if m["role"] == "tool"], anyio.current_time() - start

    async with Scheduler(settings()) as scheduler, anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep, 3600)  # the next timer, for a clock that jumps
        outcome = await (await scheduler.submit(agent, tenant="acme"))
        tg.cancel_scope.cancel()
    return outcome


@pytest.mark.parametrize("loop", LOOPS)
def test_a_plain_function_tool_takes_no_virtual_time(loop):
    """Before: while the thread worked the clock jumped to the next timer, an hour on, so the
    tools' limits passed at once. Two runs: the same results at the same virtual times."""
    expected = (["5 in a worker thread", "done", '{"hits": ["result for q"]}'], 2.0)
    assert [run_virtual(_plain_tool_beside_timers, loop=loop) for _ in range(2)] == [expected, expected]


class ToolCallsBackend(InstantBackend):
    """Answers a session's first call with these `tool_calls` (as a model server might send
    them), and "ok" after."""

    def __init__(self, tool_calls: object, finish_reason: str = "tool_calls") -> None:
        super().__init__()
        self.tool_calls = tool_calls
        self.finish_reason = finish_reason
        self.answered = 0

    async def complete_chat(self, body, received=None):
        response, first_token_at = await super().complete_chat(body, received)
        if not self.answered:
            response["choices"][0]["message"].update(content=None, tool_calls=self.tool_calls)
            response["choices"][0]["finish_reason"] = self.finish_reason
        self.answered += 1
        return response, first_token_at


class RecordingBackend(InstantBackend):
    """Keeps the bodies of the calls it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []

    async def complete_chat(self, body, received=None):
        self.bodies.append(body)
        return await super().complete_chat(body, received)


@pytest.mark.parametrize("scripted", [True, False])
async def test_a_scripted_loop_asks_the_model_for_text_not_tool_calls(scripted):
    """With a script the calls are the script's, but no tool_choice was sent: "auto", which vLLM's
    server without a tool-call parser and the vllm-engine backend refuse."""
    script = [[{"name": "add", "arguments": {"a": 2, "b": 3}}]] if scripted else None

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS[:1], script=script)

    async with RecordingBackend() as backend, Scheduler(settings(), backend=backend) as scheduler:
        await (await scheduler.submit(agent, tenant="acme"))
    assert backend.bodies and all(len(body["tools"]) == 1 for body in backend.bodies)
    assert [body.get("tool_choice") for body in backend.bodies] == ["none" if scripted else None] * len(backend.bodies)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # Some servers send the arguments' object itself, not its JSON text: taken as they are.
        ({"id": "c1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}, "5"),
        ({"id": "c1", "function": {"name": "add", "arguments": 5}}, "error: the arguments for 'add' must be a JSON object, got int"),
        ("add", "error: a tool call must be an object with a `function` object (its name and arguments), got 'add'"),
        ({"id": "c1", "function": "add"}, "error: a tool call must be an object with a `function` object"),
    ],
)
async def test_tool_calls_of_unexpected_shapes_from_the_model_become_errors_or_run(call, message):
    """They failed the session (TypeError from json.loads, in an ExceptionGroup; AttributeError)."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS)

    async with ToolCallsBackend([call]) as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await (await scheduler.submit(agent, tenant="acme"))
    check_released(scheduler)
    assert loop.stopped == "answer" and loop.turns == 2
    (tool_message,) = [m for m in loop.messages if m["role"] == "tool"]
    assert tool_message["content"].startswith(message)


@pytest.mark.parametrize(
    ("name", "fn", "message"),
    [
        ("add", None, "tool 'add': fn must be a function, got None"),
        ("add", "add", "tool 'add': fn must be a function, got 'add'"),
        ("", add, "a tool's name must be a non-empty str, got ''"),
        (add, add, "a tool's name must be a non-empty str, got <function add"),
    ],
)
def test_a_tool_is_refused_when_it_is_built_wrong(name, fn, message):
    # Each was taken: every call of the tool was then an error the model saw ("'NoneType' object
    # is not callable"), or the model was offered a function named '' or '<function add ...>'.
    with pytest.raises(TypeError, match=re.escape(message)):
        Tool(name, fn)


async def multiply(a: float, b: float) -> str:
    return str(a * b)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        # The second 'add' was run for every call of 'add', without a word.
        ({"tools": [TOOLS[0], Tool("add", multiply)]}, ValueError, "tools: two tools are named 'add'"),
        ({"tools": [add]}, TypeError, "tools: expected a list of Tool, got <function add"),
        ({"tools": TOOLS[0]}, TypeError, "tools: expected a list of Tool, got Tool(name='add'"),
        ({"max_turns": "3"}, ValueError, "max_turns must be >= 1 (an integer), got '3'"),
        ({"max_turns": 2.5}, ValueError, "max_turns must be >= 1 (an integer), got 2.5"),
        ({"messages": "go"}, TypeError, "messages: expected a list of {role, content} objects, got 'go'"),
        # A turn given as one call, not a list of them: AttributeError ('str' object has no attribute 'get').
        ({"script": [{"name": "add"}]}, ValueError, "script turn 0: expected a list of tool calls, got {'name': 'add'}"),
        # Refused only when the loop reached that turn, its model calls made and paid for.
        ({"script": [[{"name": "add"}], [{"arguments": {}}]]}, ValueError, "script turn 1: a tool call needs a 'name'"),
        # The Tool given for its name: the sim took it into the conversation, a vLLM server's body
        # failed to encode ("Object of type Tool is not JSON serializable", blamed on the replica).
        ({"script": [[{"name": TOOLS[0]}]]}, ValueError, "script turn 0: a tool call's 'name' must be a tool's name (a str), got Tool(name='add'"),
        # A bare TypeError ("Object of type date is not JSON serializable") at that turn, mid-session.
        ({"script": [[{"name": "add"}], [{"name": "add", "arguments": {"a": datetime.date(2026, 1, 1)}}]]}, ValueError,
         "script turn 1: the arguments for 'add' are not JSON (Object of type date is not JSON serializable)"),
    ],
)
async def test_bad_arguments_to_the_loop_name_what_was_wrong(arguments, error, message):
    call = {"messages": [{"role": "user", "content": "go"}], "tools": TOOLS, **arguments}

    async def agent(ctx):
        await run_tool_loop(ctx, **call)

    async with Scheduler(settings()) as scheduler:
        with pytest.raises(SessionFailed) as failed:
            await (await scheduler.submit(agent, tenant="acme"))
    check_released(scheduler)
    assert isinstance(failed.value.__cause__, error) and message in str(failed.value.__cause__)
    assert scheduler.statistics().dispatcher.calls_started == 0  # refused before its first model call


async def test_tools_and_messages_given_as_generators_are_read_once():
    """The checks used them up: the loop then ran without them ("tools: expected at least one
    tool", or "messages: a chat request needs a non-empty list of messages")."""
    loop, _ = await run(
        [[{"name": "add", "arguments": {"a": 2, "b": 3}}]],
    )
    results = {}

    async def agent(ctx):
        messages = (m for m in [{"role": "user", "content": "go"}])
        results["loop"] = await run_tool_loop(ctx, messages, (t for t in TOOLS), script=[[{"name": "add", "arguments": {"a": 2, "b": 3}}]])

    async with Scheduler(settings()) as scheduler:
        await (await scheduler.submit(agent, tenant="acme"))
    check_released(scheduler)
    generated = results["loop"]
    assert generated.stopped == loop.stopped == "answer"
    assert [m["role"] for m in generated.messages] == [m["role"] for m in loop.messages]
    assert generated.messages[2]["content"] == "5"


async def test_a_loop_without_tools_is_served_by_the_sim():
    """Before: the loop sent ``tools: []``, which vLLM (and the sim, like it) refuses."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], [], max_tokens=4)

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        result = await (await scheduler.submit(agent, tenant="acme"))
    assert result.stopped == "answer" and result.turns == 1
    check_released(scheduler)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio's cancellation is its own exception class
async def test_a_tool_raising_a_cancelled_error_of_its_own_is_a_tool_error(anyio_backend):
    # Its task ended as if cancelled: the model got an empty result, counted as no error.
    import asyncio

    async def flaky() -> str:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        return await future

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], [Tool("flaky", flaky)], script=[[{"name": "flaky"}]])

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    assert loop.tool_errors == 1
    assert [m["content"] for m in loop.messages if m["role"] == "tool"] == ["error: tool 'flaky' raised CancelledError: "]
    check_released(scheduler)


async def test_a_refused_model_call_is_made_again_after_the_wait_it_names():
    """Under 3 requests a minute the loop's fourth model call is refused for 20 s: it failed
    the session, three turns of tool work lost. It waits the 20 s and goes on; a refusal past
    `max_refusals`, or whose wait passes the deadline, is raised."""
    calc = [{"name": "add", "arguments": {"a": 6, "b": 7}}]

    async def agent(ctx, **kw):
        began = anyio.current_time()
        result = await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, script=[calc] * 3, **kw)
        return result.stopped, result.turns, anyio.current_time() - began

    async with Scheduler(settings({"acme": {"requests_per_minute": 3}, "tight": {"requests_per_minute": 3, "sla": {"deadline_s": 10}}})) as scheduler:
        stopped, turns, took = await scheduler.run(agent, tenant="acme")
        assert (stopped, turns) == ("answer", 4) and 20 <= took < 21
        await anyio.sleep(60)  # the bucket full again
        with pytest.raises(SessionFailed) as refused:
            await scheduler.run(functools.partial(agent, max_refusals=0), tenant="acme")
        with pytest.raises(SessionFailed) as past_deadline:
            await scheduler.run(agent, tenant="tight")
    assert "requests_per_minute (3)" in str(refused.value.__cause__)
    assert "requests_per_minute (3)" in str(past_deadline.value.__cause__)
    check_released(scheduler)


async def test_max_refusals_must_be_a_count():
    async def agent(ctx):
        await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, max_refusals=-1)

    async with Scheduler(settings()) as scheduler:
        with pytest.raises(SessionFailed) as info:
            await scheduler.run(agent, tenant="acme")
    assert str(info.value.__cause__) == "max_refusals must be >= 0 (an integer), got -1"


async def test_a_reply_of_whitespace_alone_is_answered_as_an_empty_one():
    """A reply of whitespace alone is no answer: the model is told its reply was empty, counted as an error."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, max_turns=2)

    async with InstantBackend(text=" \n ") as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    assert (loop.stopped, loop.answer, loop.tool_errors) == ("turn_limit", None, 2)
    check_released(scheduler)


async def test_a_model_call_with_null_arguments_runs_the_tool_with_none():
    """A tool call from the model whose arguments are null runs the tool without arguments."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS)

    call = {"id": "c1", "function": {"name": "explode", "arguments": None}}
    async with ToolCallsBackend([call]) as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    check_released(scheduler)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"] == ["error: tool 'explode' raised RuntimeError: disk full"]


async def test_a_refusal_whose_wait_ends_at_the_deadline_is_raised_at_once():
    """A refused model call whose wait would end exactly at the session's deadline is raised at once, not waited out."""
    calc = [{"name": "add", "arguments": {"a": 6, "b": 7}}]

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, script=[calc] * 3)

    async with Scheduler(settings({"edge": {"requests_per_minute": 3, "sla": {"deadline_s": 20}}})) as scheduler:
        with pytest.raises(SessionFailed) as refused:
            await scheduler.run(agent, tenant="edge")
    assert "requests_per_minute (3)" in str(refused.value.__cause__) and "retry after 20.0 s" in str(refused.value.__cause__)
    check_released(scheduler)


async def test_a_replica_s_retry_after_of_a_day_is_raised_not_slept_through():
    """A vLLM replica (or a proxy before it) that refused a call with Retry-After: 86400 held a
    session without a deadline asleep for a day before the loop called again. A wait longer
    than the loop's `MAX_REFUSAL_WAIT_S` is raised at once, naming it; a short one is still
    waited out."""
    import httpx2

    from fleetsched.errors import Overloaded

    from .test_vllm_backend_offline import _backend, _ok

    async def agent(ctx):
        began = anyio.current_time()
        result = await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS)
        return result.stopped, anyio.current_time() - began

    for asked, outcome in [(30, "answer"), (86400, "raised")]:
        refused = httpx2.Response(429, headers={"retry-after": str(asked)}, json={})
        backend = _backend([refused, _ok()], [], retry_attempts=1)
        async with backend, Scheduler(settings(), backend=backend) as scheduler:
            if outcome == "answer":
                stopped, took = await scheduler.run(agent, tenant="acme")
                assert stopped == "answer" and took >= asked, took
            else:
                began = anyio.current_time()
                with pytest.raises(SessionFailed) as failed:
                    await scheduler.run(agent, tenant="acme")
                assert anyio.current_time() - began < 3600  # not slept through
                assert isinstance(failed.value.__cause__, Overloaded) and "retry after 86400.0 s" in str(failed.value.__cause__)
            check_released(scheduler)


async def test_a_tool_error_whose_message_cannot_be_read_is_still_a_tool_error():
    """A tool raised an exception whose own ``__str__`` raises: that escaped the loop, and the
    session failed with it (in a task group's ExceptionGroup), the tool's error and the turns
    done lost. The model is told, as of any tool's failure."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    async def broken() -> str:
        raise Unprintable()

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], [Tool("broken", broken)], script=[[{"name": "broken"}]])

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    assert loop.stopped == "answer" and loop.tool_errors == 1
    (said,) = [m["content"] for m in loop.messages if m["role"] == "tool"]
    assert said.startswith("error: tool 'broken' raised Unprintable: (its message could not be read")
    check_released(scheduler)


async def test_a_tool_s_text_with_a_lone_surrogate_goes_to_the_model_escaped():
    """Python decodes a file name or a command's output that is not UTF-8 with "surrogateescape":
    such a result (or a tool's error naming it) went into the conversation as it was, which has no
    UTF-8, and a vLLM server's request could not be sent: the session failed at its next call."""

    async def listing() -> str:
        return "report.txt\ncaf\udce9.txt"

    async def missing() -> str:
        raise RuntimeError("cannot open caf\udce9.txt")

    tools = [Tool("listing", listing), Tool("missing", missing)]

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], tools, script=[[{"name": "listing"}, {"name": "missing"}]])

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    check_released(scheduler)
    results = [m["content"] for m in loop.messages if m["role"] == "tool"]
    assert results == ["report.txt\ncaf\\udce9.txt", "error: tool 'missing' raised RuntimeError: cannot open caf\\udce9.txt"]
    assert all(result.encode("utf-8") for result in results)  # sendable
    assert loop.tool_errors == 1


async def test_a_reply_cut_at_max_tokens_inside_a_tool_call_does_not_run_that_call():
    """A vLLM server streams a call as its parser reads it: a reply cut at max_tokens ended with a
    call whose arguments were "" (or half their JSON), as the real server sends it. The "" ran the
    tool with no arguments at all, arguments the model never wrote; the calls before it are whole."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, max_tokens=40)

    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        {"id": "c2", "type": "function", "function": {"name": "explode", "arguments": ""}},
    ]
    async with ToolCallsBackend(calls, finish_reason="length") as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    check_released(scheduler)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"] == [
        "5",
        "error: your reply was cut at max_tokens (40) in this call, its arguments unfinished: it was not run",
    ]
    assert (loop.stopped, loop.tool_errors) == ("answer", 1)


async def test_a_reply_cut_at_max_tokens_before_anything_usable_says_so_not_that_it_was_empty():
    """vLLM's tool-call parser holds back a call it has not read whole: a reply cut inside one
    came with no content and no calls, which the model was told was empty."""

    async def agent(ctx):
        return await run_tool_loop(ctx, [{"role": "user", "content": "go"}], TOOLS, max_tokens=16)

    async with ToolCallsBackend([], finish_reason="length") as backend, Scheduler(settings(), backend=backend) as scheduler:
        loop = await scheduler.run(agent, tenant="acme")
    check_released(scheduler)
    said = [m["content"] for m in loop.messages if m["role"] == "user"][1:]
    assert said == ["error: your reply was cut at max_tokens (16) before any of it could be used; answer, or call one of the tools"]
    assert (loop.stopped, loop.tool_errors) == ("answer", 1)
