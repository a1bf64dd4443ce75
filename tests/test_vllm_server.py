"""The vLLM server backend against a real CPU vLLM server (the session's `vllm_server` fixture).

Real time on asyncio: these talk to another process. The session server runs the priority policy
with 4 sequences at once (see fleetsched.testing.fixtures). The restart test comes last: it stops
and starts the shared server (same port) while a call is being retried.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextlib import aclosing

import anyio
import httpx
import pytest
from openai import AsyncOpenAI

from fleetsched.backends.base import Received, collect_chat
from fleetsched.backends.metrics import VLLMMetrics, parse_vllm_metrics
from fleetsched.backends.vllm_server import VLLMServerBackend
from fleetsched.errors import BackendError, BackendUnavailable, ContextTooLong, InvalidRequest, UnknownModel
from fleetsched import Scheduler
from fleetsched.policies.tiers import Tier
from fleetsched.scheduler import Dispatcher
from fleetsched.testing.fixtures import SESSION_SERVER_OPTIONS, require_vllm_setup
from fleetsched.testing.vllm_server import VLLMServer, free_port

from .helpers import EngineLoad, settings, waiting_under_a_full_batch

pytestmark = pytest.mark.anyio

MODEL = "fleetsched-tiny"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def body(max_tokens: int, priority: int = 0, content: str = "Tell me about schedulers.", **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # the random model may sample EOS early; lengths must be what we ask
        "priority": priority,
        **extra,
    }


async def metrics(server: VLLMServer):
    async with httpx.AsyncClient() as client:
        return parse_vllm_metrics((await client.get(server.metrics_url)).text)


async def wait_for(predicate, server: VLLMServer, within_s: float):
    """Poll /metrics until `predicate(page)` holds; return the page (fail after `within_s`)."""
    seen: list[tuple[float, int | None, int | None]] = []
    began = time.perf_counter()
    with anyio.move_on_after(within_s):
        while True:
            page = await metrics(server)
            if predicate(page):
                return page
            seen.append((round(time.perf_counter() - began, 2), page.signals.running, page.signals.waiting))
            await anyio.sleep(0.05)
    pytest.fail(f"/metrics did not show the state within {within_s} s; (t, running, waiting): {seen[:8]} ... {seen[-3:]}")


@pytest.mark.vllm
async def test_metrics_and_policy_on_the_live_server(vllm_server):
    async with VLLMServerBackend(vllm_server.url) as backend:
        signals = await backend.signals()
        assert signals.running == 0 and signals.waiting == 0
        assert signals.kv_cache_usage is not None and 0.0 <= signals.kv_cache_usage <= 1.0
        assert signals.prefix_cache_queries_total is not None and signals.prefix_cache_hits_total is not None
        assert signals.preemptions_total is not None
        # /server_info (dev mode) shows the scheduler config; /metrics does not in vLLM 0.32.
        assert await backend.scheduling_policy() == "priority"
    page = await metrics(vllm_server)
    assert page.model_names == {MODEL}
    assert int(page.cache_config["kv_cache_size_tokens"]) > 0


@pytest.mark.vllm
async def test_streams_chunks_with_usage_last(vllm_server):
    arrivals: list[float] = []
    async with VLLMServerBackend(vllm_server.url) as backend:
        chunks = []
        async for chunk in backend.stream_chat(body(48)):
            arrivals.append(time.perf_counter())
            chunks.append(chunk)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 48
    assert chunks[-1]["usage"]["prompt_tokens"] > 0
    content_chunks = [c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) >= 24  # streamed token by token, not in one piece
    assert arrivals[-1] - arrivals[0] > 0  # the first chunk came before the last one
    folded = collect_chat(chunks)
    assert folded["choices"][0]["finish_reason"] == "length" and folded["usage"]["completion_tokens"] == 48


@pytest.mark.vllm
async def test_the_dispatcher_charges_what_the_engine_counts(vllm_server):
    """Through the dispatcher, with the batch tier streamed 8 tokens a chunk: every chunk carries
    the engine's count so far, and the tenant's counter follows it, ending at the call's usage.
    (vLLM sends the first token alone, unless its API server fell behind the engine and merged
    the first outputs: the first chunk of one CI run held 9 tokens, 1 + 8.)"""
    async with VLLMServerBackend(vllm_server.url) as backend:
        dispatcher = Dispatcher(backend, window=1, stream_interval={Tier.BATCH: 8})
        queue = dispatcher._queue
        counts, charged = [], []
        async with dispatcher.stream(body(40), tenant="a", tier=Tier.BATCH) as chunks:
            start = queue.counter("a")  # the prompt estimate: no prediction before a call ends
            async for chunk in chunks:
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    counts.append(chunk["usage"]["completion_tokens"])
                    charged.append(queue.counter("a") - start)
            usage = chunk["usage"]
    assert counts[0] % 8 == 1 and counts == sorted(counts) and counts[-1] == 40, counts
    assert len(counts) < 40  # several tokens a chunk
    assert charged == [2.0 * n for n in counts]
    assert queue.counter("a") == usage["prompt_tokens"] + 2.0 * 40


@pytest.mark.vllm
async def test_a_collected_call_counts_its_output_as_it_comes(vllm_server):
    """A call collected whole (the dispatcher's `chat`) asks for the engine's count on every
    chunk too, and `received` follows it as the chunks come: a call cut short is charged what
    it had received. (Cutting one short here is a race: on 2 shared cores the engine often
    finishes a call before its first chunk is read.)"""

    class Counted(Received):
        __slots__ = ("seen",)

        def __init__(self) -> None:
            self.seen: list[int] = []
            super().__init__()

        def __setattr__(self, name: str, value: object) -> None:
            if name == "output_tokens":
                self.seen.append(value)
            super().__setattr__(name, value)

    async with VLLMServerBackend(vllm_server.url) as backend:
        dispatcher = Dispatcher(backend, window=1)
        spied: list[Received] = []
        complete_chat = backend.complete_chat

        async def spy(request, received=None):
            spied.append(counted := Counted())
            return await complete_chat(request, counted)

        backend.complete_chat = spy
        response = await dispatcher.chat(body(40, stream_interval=8), tenant="a", tier=Tier.BATCH)
    assert response["usage"]["completion_tokens"] == 40
    # The first token alone, then up to 8 a chunk (more where the reader fell behind): the
    # engine's count after the second chunk is 9 or more, where a count of the chunks (no
    # usage on them) reads 2 (1, 2, ..., then the usage's 40 at the end).
    counts = sorted(set(spied[0].seen) - {0})
    assert counts[0] == 1 and counts[-1] == 40 and counts[1] > 2, counts


@pytest.mark.vllm
async def test_chat_template_renders_tools_and_tool_turns(vllm_server):
    tools = [{"type": "function", "function": {"name": "search", "description": "Search the web",
              "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]  # fmt: skip
    history = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    async with VLLMServerBackend(vllm_server.url) as backend:
        plain = [c async for c in backend.stream_chat(body(4, messages=history[:2]))]
        with_tools = [c async for c in backend.stream_chat(body(4, messages=history, tools=tools, tool_choice="none"))]
    assert with_tools[-1]["usage"]["prompt_tokens"] > plain[-1]["usage"]["prompt_tokens"] + 20


@pytest.mark.vllm
async def test_priority_reaches_the_engine(vllm_server):
    """With 20 long normal calls at the engine (4 running, the rest waiting), a short priority -10
    call sent through the backend jumps the queue: it takes the first free slot and finishes before
    the calls still waiting. Under fcfs it would start after all of them, and at most the 3
    others of the last wave could finish after it.
    """
    load = EngineLoad(vllm_server, calls=20)
    async with VLLMServerBackend(vllm_server.url) as backend:
        # Warm the client first: its first call imports and builds much of the SDK.
        _ = [c async for c in backend.stream_chat(body(1))]
        load.start()
        await anyio.to_thread.run_sync(load.wait_until, lambda page: load.admitted(page) and page.signals.waiting >= 4)
        chunks = [c async for c in backend.stream_chat(body(16, priority=-10))]
        finished_after_high = 20 - len(load.finished)
    await anyio.to_thread.run_sync(load.join)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert len(load.finished) == 20
    assert finished_after_high >= 4, f"only {finished_after_high} normal calls finished after the priority call"


@pytest.mark.vllm
async def test_the_policy_is_checked_on_a_fixed_window_too(vllm_server):
    """The policy was checked at the adaptive window's first poll only: on a fixed window no
    poll came, and a server not on the priority policy was never warned about."""
    fixed = settings(backend={"kind": "vllm-server", "urls": [vllm_server.url]}, dispatch={"adaptive_window": False})
    async with Scheduler(fixed) as scheduler:
        replica = scheduler.backend.replicas["r0"]
        with anyio.fail_after(30):
            while not replica.policy_checked:
                await anyio.sleep(0.05)
    assert replica.scheduling_policy == "priority"


@pytest.mark.vllm
async def test_an_agents_request_id_reaches_the_engine(vllm_server):
    """ctx.openai's X-Request-Id, or the ID it made itself, is the one vLLM gives the call: the
    answer's id is chatcmpl-<ID>, as through the gateway."""

    async def agent(ctx):
        chat = ctx.openai.chat.completions.with_raw_response
        answers = []
        for headers in ({"X-Request-Id": f"agent-trace-{time.time_ns()}"}, {}):
            raw = await chat.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers=headers)
            answers.append((headers.get("X-Request-Id"), raw.headers["x-request-id"], raw.parse().id))
        return answers

    async with Scheduler(settings(backend={"kind": "vllm-server", "urls": [vllm_server.url]})) as scheduler:
        (given, named, answer_id), (_, made, made_answer_id) = await (await scheduler.submit(agent, tenant="acme"))
    assert named == given and answer_id == f"chatcmpl-{given}"
    assert made.startswith("req_") and made_answer_id == f"chatcmpl-{made}"


@pytest.fixture(scope="module")
def tool_parsing_server():
    """A vLLM server that parses tool calls (hermes, as the tiny model's chat template writes
    them), which forced and "auto" tool calls need; the session's has no parser."""
    require_vllm_setup()
    with VLLMServer(max_model_len=4096, engine_nice=19, extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as server:
        yield server


@pytest.mark.vllm
async def test_a_forced_tool_call_collected_whole_has_the_content_vllm_gives_it(tool_parsing_server):
    """vLLM answers a call that forces a tool call with content "" beside its tool_calls, as the
    sim does; through ctx.chat and ctx.openai it was None (the stream folded, which for "auto" is
    right), so ``message.content.strip()`` passed on the sim and failed on vLLM."""
    server = tool_parsing_server
    parameters = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "ping", "parameters": parameters}}]
    choices = ["required", {"type": "function", "function": {"name": "ping"}}]
    # Room for the random model to end its call: cut short, vLLM reads no call, and answers its text.
    calls = [{"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": c, "max_tokens": 200, "seed": 1} for c in choices]
    async with httpx.AsyncClient(timeout=60) as client:
        direct = [(await client.post(f"{server.base_url}/chat/completions", json={"model": MODEL, **call})).json() for call in calls]

    async def agent(ctx):
        contents = []
        for call in calls:
            whole = await ctx.chat(**call)
            sdk = await ctx.openai.chat.completions.create(model=ctx.model, **call)
            contents += [whole["choices"][0]["message"]["content"], sdk.choices[0].message.content]
        return contents

    async with Scheduler(settings(backend={"kind": "vllm-server", "urls": [server.url]})) as scheduler:
        contents = await (await scheduler.submit(agent, tenant="acme"))
    assert [(answer["choices"][0]["message"]["content"], bool(answer["choices"][0]["message"]["tool_calls"])) for answer in direct] == [("", True)] * 2
    assert contents == ["", "", "", ""]


@pytest.mark.vllm
async def test_the_tool_loop_does_not_run_a_call_cut_at_max_tokens(tool_parsing_server):
    """The model's own calls, parsed by vLLM (its text forced by a regex: the model is random). A
    reply cut at max_tokens inside a call streams what the parser read of it: the loop took the
    half-written arguments for the model's ("" ran the tool with none)."""
    from fleetsched.agents.loop import Tool, run_tool_loop

    ran = []

    async def add(a=0, b=0):
        ran.append((a, b))
        return a + b

    # The first call is whole within max_tokens however the model spells it (a token a character
    # at most); the second is cut in its number's 200 digits (a token a digit at least).
    whole = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    cut = '<tool_call>{"name": "add", "arguments": {"a": ' + "7" * 200 + "}}</tool_call>"

    class Forced:
        """The session's context, each model call's text forced by the next of `texts`."""

        def __init__(self, ctx, texts):
            self.ctx, self.texts = ctx, list(texts)

        def __getattr__(self, name):
            return getattr(self.ctx, name)

        async def chat(self, messages, **options):
            options["structured_outputs"] = {"regex": re.escape(self.texts.pop(0))}
            options["seed"] = 0
            return await self.ctx.chat(messages, **options)

    async def agent(ctx):
        tools = [Tool("add", add, "add", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}})]
        return await run_tool_loop(Forced(ctx, [whole + cut, "done"]), [{"role": "user", "content": "go"}], tools, max_tokens=100)

    async with Scheduler(settings(backend={"kind": "vllm-server", "urls": [tool_parsing_server.url]})) as scheduler:
        loop = await (await scheduler.submit(agent, tenant="acme"))
    results = [m["content"] for m in loop.messages if m["role"] == "tool"]
    assert results == ["3", "error: your reply was cut at max_tokens (100) in this call, its arguments unfinished: it was not run"]
    assert ran == [(1, 2)] and loop.stopped == "answer"


@pytest.mark.vllm
async def test_a_collected_call_returns_the_token_ids_and_fingerprint_as_vllm_does(vllm_server):
    """A non-streamed call with ``return_token_ids`` through ctx.openai and ctx.chat has the
    prompt's and the answer's token IDs and the server's fingerprint, as the same call made to
    the server directly has them (the backend streams, and the fold dropped them)."""
    call = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, extra_body={"return_token_ids": True})
    async with AsyncOpenAI(base_url=vllm_server.base_url, api_key="EMPTY") as client:
        direct = await client.chat.completions.create(model=MODEL, **call)

    async def agent(ctx):
        sdk = await ctx.openai.chat.completions.create(model=ctx.model, **call)
        plain = await ctx.chat(call["messages"], max_tokens=3, temperature=0, return_token_ids=True)
        return sdk, plain

    async with Scheduler(settings(backend={"kind": "vllm-server", "urls": [vllm_server.url]})) as scheduler:
        sdk, plain = await (await scheduler.submit(agent, tenant="acme"))
    assert direct.prompt_token_ids and direct.choices[0].token_ids and direct.system_fingerprint
    for answer in (sdk.model_dump(), plain):
        assert answer["prompt_token_ids"] == direct.prompt_token_ids
        assert answer["choices"][0]["token_ids"] == direct.choices[0].token_ids
        assert answer["system_fingerprint"] == direct.system_fingerprint


@pytest.mark.vllm
async def test_cancellation_aborts_the_request_at_the_engine(vllm_server):
    """A call waiting at the engine is aborted there when its consumer is cancelled: it never
    generates a token, though the engine's slots free up for it later.

    It waits behind 16 long calls (4 waves of the engine's 4 slots), sent once they all reached
    the engine and at least a wave of them still waits. (Cancelling mid-stream takes
    the same path, closing the response; but on 2 shared cores the API server streams so late that
    the engine has often generated all of a call before its first chunk arrives, so a test of it
    would be luck.)
    """
    load = EngineLoad(vllm_server, calls=16)
    before = await metrics(vllm_server)
    async with VLLMServerBackend(vllm_server.url) as backend:
        _ = [c async for c in backend.stream_chat(body(1))]  # warm the client
        load.start()
        await anyio.to_thread.run_sync(load.wait_until, lambda page: load.admitted(page) and page.signals.waiting >= 4)

        def victim_waits(page: VLLMMetrics) -> bool:  # the engine holds one request more than the load
            return page.signals.running + page.signals.waiting == 16 - len(load.finished) + 1

        async with anyio.create_task_group() as tg:

            async def victim() -> None:
                async with aclosing(backend.stream_chat(body(4000))) as stream:
                    async for _ in stream:
                        pytest.fail("the call ran: it was meant to wait behind the load")

            tg.start_soon(victim)
            await anyio.to_thread.run_sync(load.wait_until, victim_waits)
            tg.cancel_scope.cancel()
        assert backend.replicas["r0"].in_flight == 0
    await anyio.to_thread.run_sync(load.join)
    after = await metrics(vllm_server)
    assert len(load.finished) == 16
    assert after.generation_tokens_total - before.generation_tokens_total == 16 * 4000 + 1  # the load and the warm-up
    assert after.finished.get("length", 0.0) - before.finished.get("length", 0.0) == 16 + 1


@pytest.mark.vllm
async def test_client_errors_are_not_retried(vllm_server, caplog):
    caplog.set_level(logging.DEBUG, logger="fleetsched.backends.vllm_server")
    async with VLLMServerBackend(vllm_server.url, retry_attempts=5) as backend:
        with pytest.raises(ContextTooLong) as info:  # an InvalidRequest, as the sim raises it
            _ = [c async for c in backend.stream_chat(body(5000))]  # beyond --max-model-len (4096)
        with pytest.raises(InvalidRequest) as bad:
            _ = [c async for c in backend.stream_chat({**body(4), "top_k": "many"})]
    assert "400" in str(info.value) and not isinstance(bad.value, ContextTooLong)
    assert "retrying" not in caplog.text


@pytest.mark.vllm
async def test_a_model_the_server_does_not_serve_is_a_404_naming_the_model(vllm_server):
    """vLLM answers a model it does not serve with a 404 naming the field; it became a
    BackendError, which agents and gateway clients got as a 500 that the SDK retries."""
    from fleetsched.agents.transport import response_for

    async with VLLMServerBackend(vllm_server.url, retry_attempts=5) as backend:
        with pytest.raises(UnknownModel, match=r"does not serve the model the call names: .*The model `gpt-4o-mini` does not exist") as info:
            _ = [c async for c in backend.stream_chat({**body(4), "model": "gpt-4o-mini"})]
        assert backend.replicas["r0"].breaker.consecutive_failures == 0
    answer = response_for(info.value)
    assert answer.status_code == 404 and answer.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found"
    }


@pytest.mark.vllm
async def test_a_500_vllm_answers_for_a_body_does_not_open_the_breaker(vllm_server):
    """vLLM 0.32 answers a ``structured_outputs`` that is no object with a 500 ("'bool' object
    has no attribute 'get'") while its engine is well: calls like it, from one tenant, opened the
    replica's breaker (1 here, 5 by default), and every tenant's calls were refused for its reset
    period. Its /health answers 200 just after, so the 500 is the call's: the next call is served."""
    async with VLLMServerBackend(vllm_server.url, retry_attempts=1, breaker_failures=1) as backend:
        for _ in range(2):
            with pytest.raises(BackendError, match="500"):
                _ = [c async for c in backend.stream_chat({**body(4), "structured_outputs": True})]
        assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
        served = [c async for c in backend.stream_chat(body(4))]
    assert served[-1]["usage"]["completion_tokens"] == 4


async def test_circuit_breaker_opens_against_a_dead_port():
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMServerBackend(
        dead, retry_attempts=2, retry_initial_s=0.01, retry_max_s=0.02, breaker_failures=3, breaker_reset_s=0.5
    ) as backend:
        breaker = backend.replicas["r0"].breaker
        for _ in range(3):
            with pytest.raises(BackendUnavailable, match="cannot reach") as info:
                _ = [c async for c in backend.stream_chat(body(4))]
            assert info.value.__cause__ is not None
        assert breaker.state(anyio.current_time()) == "open"
        with pytest.raises(BackendUnavailable, match="circuit open"):
            _ = [c async for c in backend.stream_chat(body(4))]
        with pytest.raises(BackendUnavailable, match="no vLLM replica answered"):
            await backend.signals()
        await anyio.sleep(0.6)
        assert breaker.state(anyio.current_time()) == "half-open"
        with pytest.raises(BackendUnavailable, match="cannot reach"):  # the probe went through, and failed
            _ = [c async for c in backend.stream_chat(body(4))]
        assert breaker.state(anyio.current_time()) == "open"


async def test_a_caller_that_falls_back_itself_leaves_an_unreachable_replica_at_once(caplog):
    """A call named to a replica whose caller sends it elsewhere on failure (the dispatcher, for
    a session's affinity) is not retried when the replica cannot be reached; it was retried with
    backoff, so each call of a session on a dead replica waited out the retries before falling
    back, until the replica's breaker opened. The failure still counts against the breaker; a
    call named without the key is still retried."""
    caplog.set_level(logging.DEBUG, logger="fleetsched.backends.vllm_server")
    dead, other = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    async with VLLMServerBackend({"dead": dead, "other": other}, retry_attempts=3, retry_initial_s=0.01, retry_max_s=0.02) as backend:
        with pytest.raises(BackendUnavailable, match="cannot reach"):
            _ = [c async for c in backend.stream_chat(body(4, fleetsched_replica="dead", fleetsched_fallback=True))]
        assert "retrying" not in caplog.text
        assert backend.replicas["dead"].breaker.consecutive_failures == 1
        assert backend.replicas["dead"].in_flight == 0
        with pytest.raises(BackendUnavailable, match="cannot reach"):
            _ = [c async for c in backend.stream_chat(body(4, fleetsched_replica="dead"))]
        assert "retrying" in caplog.text


@pytest.mark.vllm
async def test_named_replica_routing_with_a_dead_replica(vllm_server):
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMServerBackend({"live": vllm_server.url, "dead": dead}, retry_attempts=1, breaker_failures=1) as backend:
        with pytest.raises(BackendUnavailable):
            _ = [c async for c in backend.stream_chat(body(4, fleetsched_replica="dead"))]
        chunks = [c async for c in backend.stream_chat(body(4))]  # least loaded, breaker not open
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        signals = await backend.signals()  # the live replica alone answers
        assert signals.running == 0


@pytest.mark.vllm
async def test_a_chat_asking_for_two_choices_gets_both(vllm_server):
    """n=2 collected whole (`chat`): two choices, each its own answer; they were folded into one
    message, the two answers' tokens interleaved."""
    async with VLLMServerBackend(vllm_server.url) as backend:
        streamed = [c async for c in backend.stream_chat(body(6, n=2, seed=7))]
        response, _ = await backend.complete_chat({**body(6, n=2, seed=7), "stream": False})
    answers = ["".join(ch["delta"].get("content") or "" for c in streamed for ch in c["choices"] if ch["index"] == i) for i in (0, 1)]
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in response["choices"]] == answers
    assert [c["finish_reason"] for c in response["choices"]] == ["length", "length"]
    assert response["usage"]["completion_tokens"] == 12


@pytest.mark.vllm
async def test_a_call_fails_over_from_a_dead_replica_to_a_live_one(vllm_server):
    """A call routed by load (no replica named) to a replica that cannot be reached goes to
    another whose breaker is not open, at once; it failed (after its retries) until the dead
    replica's breaker opened. The failure still counts against the dead replica's breaker."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMServerBackend({"dead": dead, "live": vllm_server.url}, retry_initial_s=0.5) as backend:
        began = time.perf_counter()
        for _ in range(3):
            chunks = [c async for c in backend.stream_chat(body(4))]
            assert chunks[-1]["usage"]["completion_tokens"] == 4
        assert time.perf_counter() - began < 1.5  # no backoff on the dead replica
        assert backend.replicas["dead"].breaker.consecutive_failures == 3
        assert backend.replicas["dead"].in_flight == backend.replicas["live"].in_flight == 0
        with pytest.raises(BackendUnavailable):  # a named replica is the caller's choice: no failover
            _ = [c async for c in backend.stream_chat(body(4, fleetsched_replica="dead"))]


@pytest.mark.vllm
async def test_a_session_placed_on_a_dead_replica_runs_on_the_live_one(vllm_server, caplog):
    """Through the dispatcher, a call placed on a dead replica (affinity) falls over to the live
    one, without backing off on the dead one first; its fallback went to the least loaded
    replica, which was the dead one again."""
    caplog.set_level(logging.DEBUG, logger="fleetsched.backends.vllm_server")
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMServerBackend({"dead": dead, "live": vllm_server.url}, retry_attempts=3, retry_initial_s=0.05) as backend:
        dispatcher = Dispatcher(backend, window=4)
        for _ in range(2):
            response = await dispatcher.chat(body(4), tenant="a", tier=Tier.STANDARD, replica="dead")
            assert response["usage"]["completion_tokens"] == 4
    assert "retrying" not in caplog.text


@pytest.mark.vllm
async def test_errors_name_the_url_that_failed(vllm_server):
    """A URL that is not a vLLM server's root (404 for /v1/chat/completions) and one where
    nothing listens: the error names the URL and says what to check; they read 'rejected the
    call (404): Error code: 404' and 'cannot reach vLLM replica r0: Connection error.'."""
    wrong = f"{vllm_server.url}/api"
    async with VLLMServerBackend(wrong, retry_attempts=1) as backend:
        with pytest.raises(BackendError) as info:
            _ = [c async for c in backend.stream_chat(body(4))]
    assert f"{wrong}/v1/chat/completions" in str(info.value) and "404" in str(info.value), info.value
    assert "root URL of a vLLM server" in str(info.value)
    dead = f"http://127.0.0.1:{free_port()}"
    async with VLLMServerBackend(dead, retry_attempts=1) as backend:
        with pytest.raises(BackendUnavailable) as info:
            _ = [c async for c in backend.stream_chat(body(4))]
    assert dead in str(info.value) and "connection refused" in str(info.value).lower(), info.value
    async with VLLMServerBackend(vllm_server.url) as backend:  # a 404 of vLLM's own keeps its words
        with pytest.raises(BackendError, match="The model `nope` does not exist"):
            _ = [c async for c in backend.stream_chat(body(4, model="nope"))]


@pytest.mark.vllm
async def test_call_is_retried_across_a_server_restart(vllm_server, caplog):
    caplog.set_level(logging.DEBUG, logger="fleetsched.backends.vllm_server")
    outcome: dict[str, object] = {}
    async with VLLMServerBackend(
        vllm_server.url, retry_attempts=60, retry_initial_s=0.5, retry_max_s=3.0, breaker_failures=1
    ) as backend:
        await anyio.to_thread.run_sync(vllm_server.stop)

        async def call() -> None:
            outcome["chunks"] = [c async for c in backend.stream_chat(body(8))]

        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.sleep(1.5)
                assert "retrying" in caplog.text  # it is failing and backing off now
                await anyio.to_thread.run_sync(vllm_server.start)
        assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
    assert outcome["chunks"][-1]["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert caplog.text.count("retrying") >= 2


@pytest.mark.vllm
async def test_the_next_turn_hits_the_blocks_of_the_answer_on_vllm_and_the_sim(vllm_server):
    """vLLM caches every full block, generated tokens included, so a conversation's next turn
    hits the prompt's and the answer's full blocks: (prompt + answer - 1) // block size of them.
    The sim answers the same conversation by the same rule (counting tokens its own way)."""
    from fleetsched.backends.sim import SimBackend
    from fleetsched.settings import SimSettings

    turn1 = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "Plan the week's jobs. " * 40}]
    answer_tokens = 128

    async def hits_of_next_turn(chat, hits_total) -> tuple[int, int]:
        first = await chat({"model": MODEL, "messages": turn1, "max_tokens": answer_tokens, "temperature": 0.0, "ignore_eos": True})
        assert first["usage"]["completion_tokens"] == answer_tokens
        turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "tool result: 3 jobs moved"}]  # fmt: skip
        before = await hits_total()
        await chat({"model": MODEL, "messages": turn2, "max_tokens": 1})
        return first["usage"]["prompt_tokens"], int(await hits_total() - before)

    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:

        async def real_chat(body: dict) -> dict:
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        async def real_hits() -> float:
            return (await metrics(vllm_server)).signals.prefix_cache_hits_total

        block = int((await metrics(vllm_server)).cache_config["block_size"])
        prompt, hits = await hits_of_next_turn(real_chat, real_hits)
    assert hits == (prompt + answer_tokens - 1) // block * block > prompt // block * block

    settings = SimSettings(profile="tiny-cpu-vllm")
    async with SimBackend(settings, model=MODEL) as sim:

        async def sim_hits() -> float:
            return (await sim.signals()).prefix_cache_hits_total

        async def sim_chat(body: dict) -> dict:
            return (await sim.complete_chat(body))[0]

        prompt, hits = await hits_of_next_turn(sim_chat, sim_hits)
    block = settings.block_size
    assert hits == (prompt + answer_tokens - 1) // block * block > prompt // block * block


@pytest.mark.vllm
async def test_logprobs_have_the_same_shape_on_vllm_and_the_sim(vllm_server):
    """The sim's log probabilities are made up, but laid out as vLLM's: per token, its text,
    logprob, bytes and ``top_logprobs`` (the token first); both refuse more than 20 alternatives."""
    from fleetsched.backends.sim import SimBackend

    asked = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True,
             "logprobs": True, "top_logprobs": 3}  # fmt: skip

    def shape(choice: dict) -> list[tuple]:
        entries = choice["logprobs"]["content"]
        for entry in entries:
            assert entry["bytes"] == list(entry["token"].encode()) or not entry["token"]  # a partial character
            assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
        return [(sorted(e), len(e["top_logprobs"]), sorted(e["top_logprobs"][0])) for e in entries]

    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        real = (await client.post("/v1/chat/completions", json=asked)).json()["choices"][0]
        refused = await client.post("/v1/chat/completions", json=asked | {"top_logprobs": 21})
    assert refused.status_code == 400 and "21" in refused.text
    async with SimBackend(model=MODEL) as sim:
        simulated = (await sim.complete_chat(asked))[0]["choices"][0]
        with pytest.raises(InvalidRequest, match="top_logprobs: at most 20"):
            sim.stream_chat(asked | {"top_logprobs": 21})
    assert shape(simulated) == shape(real)


@pytest.mark.vllm
async def test_a_truncated_prompt_counts_the_same_on_vllm_and_the_sim(vllm_server):
    """``truncate_prompt_tokens`` cuts a prompt longer than the context to what vLLM keeps, on
    the sim as on the server: N tokens, or the context less one (-1, with a length asked), the
    answer's length cut to the room left; a size over the context is refused by both."""
    from fleetsched.backends.sim import SimBackend
    from fleetsched.settings import SimSettings

    context = SESSION_SERVER_OPTIONS["max_model_len"]
    long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (2 * context)}], "ignore_eos": True}
    cases = [{"truncate_prompt_tokens": 100, "max_tokens": 4}, {"truncate_prompt_tokens": -1, "max_tokens": 4}]
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        real = [(await client.post("/v1/chat/completions", json=long | case)).json()["usage"] for case in cases]
        refused = await client.post("/v1/chat/completions", json=long | {"truncate_prompt_tokens": context + 1, "max_tokens": 4})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.text
    async with SimBackend(SimSettings(max_model_len=context), model=MODEL) as sim:
        simulated = [(await sim.complete_chat(long | case))[0]["usage"] for case in cases]
        with pytest.raises(InvalidRequest, match="^truncate_prompt_tokens: expected at most"):
            sim.stream_chat(long | {"truncate_prompt_tokens": context + 1})
    counts = [(u["prompt_tokens"], u["completion_tokens"]) for u in real]
    assert counts == [(100, 4), (context - 1, 1)]
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in simulated] == counts


@pytest.mark.vllm
async def test_engine_waiting_counts_only_what_a_step_left_waiting(vllm_server):
    """vLLM's num_requests_waiting is what its scheduler left waiting at its last step. A call that
    arrives while a step runs waits in the engine core's input queue and is not counted, so with
    no more calls in flight than the batch holds it stays 0 (the sim's test of the same name)."""
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:

        async def chat(request: dict) -> None:
            response = await client.post("/v1/chat/completions", json=request)
            assert response.status_code == 200, response.text

        async def signals():
            return parse_vllm_metrics((await client.get("/metrics")).text).signals

        seen = await waiting_under_a_full_batch(chat, signals, clients=SESSION_SERVER_OPTIONS["max_num_seqs"], seconds=4, model=MODEL)
    assert sum(running == SESSION_SERVER_OPTIONS["max_num_seqs"] for running, _ in seen) > len(seen) / 4  # the batch was full
    assert {waiting for _, waiting in seen} == {0}


@pytest.mark.vllm
async def test_the_bodies_the_sim_refuses_are_those_vllm_refuses(vllm_server):
    """The sim's checks (`fleetsched.backends.sampling` and `chat_options`) against the server
    they copy: each body of the sim tests' refused lists is refused by vLLM (a 400, or an error
    event with code 400 before any token: SamplingParams and the grammar engine refuse in the
    stream), and each of the taken lists is served. A vLLM upgrade that changes what it refuses
    fails here."""
    from .test_sim import BAD_CHAT_OPTIONS, BAD_CONSTRAINTS, BAD_SAMPLING, GOOD_CHAT_OPTIONS, GOOD_CONSTRAINTS

    base = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}

    async def refused(client: httpx.AsyncClient, extra: dict) -> bool:
        async with client.stream("POST", "/v1/chat/completions", json={**base, **extra}) as response:
            if response.status_code != 200:
                # vLLM 0.32 answers a structured_outputs that is no object with a 500 (its bug).
                assert response.status_code == 400 or "structured_outputs" in extra, (extra, response.status_code, await response.aread())
                return True
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    return event.get("error", {}).get("code") == 400
        return False

    bad = [{field: value} for field, value in BAD_SAMPLING]  # min_tokens 10: over the max_tokens of 4
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        bad += [extra for extra, _ in BAD_CONSTRAINTS + BAD_CHAT_OPTIONS]
        served = [extra for extra in bad if not await refused(client, extra)]
        refused_good = [extra for extra in GOOD_CONSTRAINTS + GOOD_CHAT_OPTIONS if await refused(client, extra)]
    assert served == [] and refused_good == []
