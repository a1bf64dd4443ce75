"""Agent code written for the openai SDK runs unchanged through ctx.openai."""

from __future__ import annotations

import re

import anyio
import openai
import pytest

from fleetsched import BackendUnavailable, ContextTooLong, Scheduler, SessionFailed
from fleetsched.backends.base import REQUEST_ID_KEY, make_chunk, usage_dict
from fleetsched.backends.instant import InstantBackend

from .helpers import check_released, settings

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_chat_completion_through_the_sdk(anyio_backend):
    async def agent(ctx):
        response = await ctx.openai.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return response.choices[0].message.content, response.usage.completion_tokens

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        assert await handle == ("ok", 4)
    assert handle.counters.calls == 1
    assert scheduler.recorder.calls[0].tenant == "acme"
    check_released(scheduler)


async def test_streaming_through_the_sdk():
    async def agent(ctx):
        stream = await ctx.openai.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async with Scheduler(settings()) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == "ok"
    (record,) = scheduler.recorder.calls
    assert record.completion_tokens == 3 and record.error is None
    check_released(scheduler)


async def test_rate_limit_reaches_the_sdk_as_429_with_retry_after():
    s = settings({"acme": {"requests_per_minute": 1}})

    async def agent(ctx):
        await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "a"}])
        try:
            await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "b"}])
        except openai.RateLimitError as exc:
            return exc.status_code, exc.response.headers["retry-after"]

    async with Scheduler(s) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == (429, "60")
    check_released(scheduler)



async def test_a_call_retried_after_its_retry_after_goes_through():
    # 11 requests a minute: the 12th may go 60/11 = 5.45 s later. Retry-After said 5 (rounded
    # down), and a client that waited that long was refused again.
    s = settings({"acme": {"requests_per_minute": 11}})

    async def agent(ctx):
        def call():
            return ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "a"}])

        for _ in range(11):
            await call()
        try:
            await call()
        except openai.RateLimitError as exc:
            wait = exc.response.headers["retry-after"]
        await anyio.sleep(int(wait))
        await call()
        return wait

    async with Scheduler(s) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == "6"
    check_released(scheduler)

async def test_malformed_request_is_a_400_not_a_crash():
    async def agent(ctx):
        try:
            await ctx.openai.chat.completions.create(model=ctx.model, messages="not a list")  # type: ignore[arg-type]
        except openai.BadRequestError as exc:
            return exc.status_code

    async with Scheduler(settings()) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == 400


async def test_a_call_over_the_context_is_openais_context_length_400():
    # Agent loops written for OpenAI catch this error to trim their history; it was a 500.
    async def agent(ctx):
        try:
            await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
        except openai.BadRequestError as exc:
            return exc.status_code, exc.code, exc.type

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        answer = await (await scheduler.submit(agent, tenant="acme"))
    assert answer == (400, "context_length_exceeded", "invalid_request_error")
    check_released(scheduler)


async def test_a_timeout_set_on_the_sdk_ends_the_call_and_frees_its_place():
    # The SDK's `timeout` (per call or `with_options`) was ignored: a call asked to give up after
    # 0.5 s ran to its end (4 s on the sim backend).
    async def agent(ctx):
        # A client's first call asks a worker thread for platform headers, and virtual time jumps
        # meanwhile: time a later call (`with_options` would make a new client).
        await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        start = anyio.current_time()
        try:
            await ctx.openai.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2000, timeout=0.5
            )
        except openai.APITimeoutError:
            timed_out = anyio.current_time() - start
        short = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, timeout=60)
        return timed_out, short.usage.completion_tokens

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == (pytest.approx(0.5), 4)
    check_released(scheduler)


async def test_a_timeout_set_on_the_sdk_bounds_each_streamed_chunk():
    async def agent(ctx):
        stream = await ctx.openai.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2000, stream=True, timeout=0.5
        )
        chunks = 0
        async for _ in stream:  # chunks come far more often than every 0.5 s: no timeout
            chunks += 1
        return chunks

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) > 100
    check_released(scheduler)


async def test_no_timeout_unless_the_agent_sets_one():
    # The SDK's default of 600 s does not apply: a call may wait its turn longer in a simulated run.
    async def agent(ctx):
        await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        return ctx.openai.timeout

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) is None


@pytest.mark.parametrize("backend", ["sim", "instant"])
async def test_streamed_usage_comes_as_openai_sends_it(backend):
    # On the sim every chunk carried the usage so far (an agent adding up `chunk.usage` counted
    # 1+2+3+4+4 = 14 tokens for 4), and stream_options={"include_usage": True} brought no final
    # usage chunk with no choices, as OpenAI and vLLM send.
    async def agent(ctx):
        seen = {}
        for options in (None, {"include_usage": True}):
            extra = {"stream_options": options} if options else {}
            stream = await ctx.openai.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, **extra
            )
            seen[bool(options)] = [(len(chunk.choices), chunk.usage and chunk.usage.completion_tokens) async for chunk in stream]
        return seen

    async with Scheduler(settings(backend={"kind": backend})) as scheduler:
        seen = await (await scheduler.submit(agent, tenant="acme"))
    assert all(usage is None for _, usage in seen[False])
    *content, last = seen[True]
    assert all(usage is None and choices == 1 for choices, usage in content)
    assert last == (0, scheduler.recorder.calls[-1].completion_tokens)
    check_released(scheduler)


class VLLMShapedStream(InstantBackend):
    """Ends its stream as vLLM's server does: the finish reason with the last tokens, then the
    usage in a chunk whose choices are empty."""

    async def stream_chat(self, body):
        yield make_chunk("c", "m", 0, role="assistant", content="ok", finish_reason="stop")
        yield make_chunk("c", "m", 0, usage=usage_dict(3, 1))


async def test_a_backends_usage_chunk_is_no_chunk_without_choices_to_the_sdk():
    # On a backend that streams as vLLM (vllm-server, vllm-engine) the usage chunk, its usage
    # taken off, reached the agent as a chunk with no choices, asked for or not: an agent
    # reading chunk.choices[0] of every chunk (without include_usage, as OpenAI allows) failed.
    async def agent(ctx):
        seen = {}
        for options in (None, {"include_usage": True}):
            extra = {"stream_options": options} if options else {}
            stream = await ctx.openai.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": "hi"}], stream=True, **extra
            )
            seen[bool(options)] = [(len(chunk.choices), chunk.usage and chunk.usage.completion_tokens) async for chunk in stream]
        return seen

    async with Scheduler(settings(), backend=VLLMShapedStream()) as scheduler:
        seen = await (await scheduler.submit(agent, tenant="acme"))
    assert seen == {False: [(1, None)], True: [(1, None), (0, 1)]}
    check_released(scheduler)


class FailingStream(InstantBackend):
    """Fails a stream as a vLLM server's can: refused at its first read (`ContextTooLong`: the
    server's 400 comes with the response), or cut after its first chunk."""

    def __init__(self, after_first: bool) -> None:
        super().__init__()
        self.after_first = after_first

    async def stream_chat(self, body):
        if not self.after_first:
            raise ContextTooLong("this model's maximum context length is 8 tokens")
        yield make_chunk("c", "m", 0, role="assistant", content="par")
        raise BackendUnavailable("the server went away")


@pytest.mark.parametrize(
    ("after_first", "caught", "kind"),
    [(False, openai.BadRequestError, "invalid_request_error"), (True, openai.APIError, "backend_unavailable")],
)
async def test_a_streamed_call_that_fails_reaches_the_sdk_as_an_openai_error(after_first, caught, kind):
    # A failure at the stream's first read was the raw ContextTooLong, and one after a chunk the
    # raw BackendUnavailable: an agent catching openai's errors (to trim its history) missed both.
    async def agent(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass

    async with Scheduler(settings(), backend=FailingStream(after_first)) as scheduler:
        with pytest.raises(SessionFailed) as info:
            await (await scheduler.submit(agent, tenant="acme"))
    error = info.value.__cause__
    assert type(error) is caught and error.body["type"] == kind
    assert ("went away" if after_first else "maximum context length") in str(error)
    check_released(scheduler)


async def test_a_stream_that_fails_midway_is_recorded_as_failed():
    # Its call record said no error: reports, metrics and the SLA table counted the call as served.
    async def agent(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass

    async with Scheduler(settings(), backend=FailingStream(after_first=True)) as scheduler:
        await (await scheduler.submit(agent, tenant="acme"))
    assert [call.error for call in scheduler.recorder.calls] == ["BackendUnavailable"]
    check_released(scheduler)


async def test_a_stream_the_agent_gives_up_on_is_recorded_as_an_unstreamed_one_is():
    # Given up on midway (a cancel scope of the agent's), the unstreamed call's record said
    # CancelledError and the streamed one's no error: reports counted it as served.
    async def agent(ctx):
        await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)  # see above
        with anyio.move_on_after(0.5):
            await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2000)
        with anyio.move_on_after(0.5):
            stream = await ctx.openai.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2000, stream=True
            )
            async for _ in stream:
                pass

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        await (await scheduler.submit(agent, tenant="acme"))
    _, unstreamed, streamed = [call.error for call in scheduler.recorder.calls]
    assert unstreamed == streamed == anyio.get_cancelled_exc_class().__name__
    check_released(scheduler)


async def test_a_client_the_agent_closed_is_replaced_at_its_next_use():
    """An agent that closes ctx.openai (``async with ctx.openai as client:``) gets a working
    client from ctx.openai afterwards (before: the closed one, whose every call raised httpx's
    'Cannot send a request, as the client has been closed')."""

    async def agent(ctx):
        async with ctx.openai as client:
            first = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "a"}], max_tokens=2)
        second = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "b"}], max_tokens=2)
        return first.usage.completion_tokens, second.usage.completion_tokens

    async with Scheduler(settings()) as scheduler:
        assert await (await scheduler.submit(agent, tenant="acme")) == (2, 2)
    check_released(scheduler)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_sdk_lists_the_model_as_vllm_s_clients_begin(anyio_backend):
    """``client.models.list()`` (vLLM's client examples take the model's name from it) got a 404,
    failing the session; the legacy completions endpoint still does, naming what is served."""

    async def agent(ctx):
        models = await ctx.openai.models.list()
        model = models.data[0].id
        retrieved = await ctx.openai.models.retrieve(model)
        # It said "GET /v1/models/gpt-4o is not served to agents (chat completions and models are)".
        with pytest.raises(openai.NotFoundError, match=rf"The model `gpt-4o` does not exist: this session's model is `{model}`"):
            await ctx.openai.models.retrieve("gpt-4o")
        response = await ctx.openai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError, match=r"is not served to agents \(chat completions and models are\)"):
            await ctx.openai.completions.create(model=model, prompt="hi")
        return model, retrieved.id, response.choices[0].message.content

    async with Scheduler(settings()) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        model, retrieved, answer = await handle
    assert model == retrieved == scheduler.settings.backend.model and answer == "ok"
    check_released(scheduler)


async def test_stream_options_are_refused_where_vllm_refuses_them():
    """They were dropped unread: on a call not streamed, and when not an object (vLLM answers
    400: "Stream options can only be defined when `stream=True`")."""
    messages = [{"role": "user", "content": "hi"}]

    async def agent(ctx):
        for stream, options, said in ((False, {"include_usage": True}, "set only with stream=true"), (True, "yes", "an object")):
            with pytest.raises(openai.BadRequestError, match=f"stream_options: {said}") as info:
                await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, stream=stream, extra_body={"stream_options": options})
            assert info.value.body["param"] == "stream_options"
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, stream=True, stream_options={"include_usage": True})
        return [chunk.usage.completion_tokens async for chunk in stream if chunk.usage]

    async with Scheduler(settings()) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == [16]  # the instant backend's answer
    check_released(scheduler)


async def test_stream_is_read_as_vllm_reads_it():
    """``"stream": "false"`` (a body built from text, sent with ``extra_body``) was read by
    truthiness: the call was streamed, and the SDK, which asked for one answer, returned the
    events' raw text. A word for false is false, as vLLM's server and the gateway read it, and one
    that is no flag a 400 naming the field."""
    messages = [{"role": "user", "content": "hi"}]

    async def agent(ctx):
        answers = []
        for flag in ("false", "no", 0):
            response = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, extra_body={"stream": flag})
            answers.append(response.choices[0].message.content)
        with pytest.raises(openai.BadRequestError, match="stream: must be true or false") as info:
            await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, extra_body={"stream": "maybe"})
        assert info.value.body["param"] == "stream"
        return answers

    async with Scheduler(settings()) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == ["ok", "ok", "ok"]
    check_released(scheduler)


async def test_the_sdks_parse_and_stream_helpers_get_a_whole_answer_on_the_sim():
    # The sim ended every answer with finish_reason "length", also where the call named no
    # max_tokens: the SDK's `.parse()` and `.stream(...).get_final_completion()` raised
    # LengthFinishReasonError ("the length limit was reached") on every call.
    async def agent(ctx):
        parsed = await ctx.openai.chat.completions.parse(model=ctx.model, messages=[{"role": "user", "content": "hi"}])
        async with ctx.openai.chat.completions.stream(model=ctx.model, messages=[{"role": "user", "content": "hi"}]) as stream:
            final = await stream.get_final_completion()
        limited = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        return parsed.choices[0].finish_reason, final.choices[0].finish_reason, limited.choices[0].finish_reason

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == ("stop", "stop", "length")
    check_released(scheduler)


class RequestIds(InstantBackend):
    """Keeps the request ID each call reached the backend with (vllm-server sends it to vLLM)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str | None] = []

    def stream_chat(self, body):
        self.seen.append(body.get(REQUEST_ID_KEY))
        return super().stream_chat(body)


async def test_every_answer_names_its_request_and_the_backend_gets_the_id():
    """As the gateway's: the agent's X-Request-Id, else a new req_ ID, on the answer (streamed or
    not, refused or not) and on the call to the backend; a malformed one is a 400 naming it."""

    async def agent(ctx):
        chat = ctx.openai.chat.completions.with_raw_response
        msg = [{"role": "user", "content": "hi"}]
        given = await chat.create(model=ctx.model, messages=msg, extra_headers={"X-Request-Id": "trace-1"})
        streamed = await chat.create(model=ctx.model, messages=msg, stream=True)
        async for _ in streamed.parse():
            pass
        try:
            await chat.create(model=ctx.model, messages=msg, extra_headers={"X-Request-Id": "has space"})
        except openai.BadRequestError as exc:
            refused = exc
        try:
            await chat.create(model=ctx.model, messages=msg, max_tokens=-1)
        except openai.BadRequestError as exc:
            invalid = exc
        return given.headers["x-request-id"], streamed.headers["x-request-id"], refused, invalid

    backend = RequestIds()
    async with Scheduler(settings(), backend=backend) as scheduler:
        given, streamed, refused, invalid = await (await scheduler.submit(agent, tenant="acme"))
    assert given == "trace-1" and re.fullmatch(r"req_[0-9a-f]{32}", streamed)
    assert backend.seen == ["trace-1", streamed]
    assert refused.status_code == 400 and refused.param == "X-Request-Id" and "X-Request-Id: 1 to 128 characters" in refused.message
    assert re.fullmatch(r"req_[0-9a-f]{32}", refused.response.headers["x-request-id"])
    assert invalid.status_code == 400 and invalid.response.headers["x-request-id"].startswith("req_")
    check_released(scheduler)


async def test_a_stream_left_early_is_recorded_alike_through_ctx_stream_and_the_sdk():
    """The agent leaves a stream after its first token. Through the SDK (closed, or left by its
    ``async with``) the call was recorded cut (CancelledError: no SLA event); through
    `ctx.stream` (a ``break``), as a call that ended, its cut latency a met latency objective.
    Now alike: cut, counted in the session's counters with the tokens it got; a stream left
    after its finish reason ended."""
    messages = [{"role": "user", "content": "hello " * 20}]

    async def via_ctx_stream(ctx):
        async with ctx.stream(messages, max_tokens=500) as chunks:
            async for chunk in chunks:
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):  # past the role's chunk
                    break

    async def via_sdk_close(ctx):
        stream = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, max_tokens=500, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()

    async def read_to_the_end(ctx):
        async with ctx.stream(messages, max_tokens=3) as chunks:
            async for chunk in chunks:
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    break  # the answer is whole: its usage chunk is left unread

    cut = anyio.get_cancelled_exc_class().__name__
    for agent, error in ((via_ctx_stream, cut), (via_sdk_close, cut), (read_to_the_end, None)):
        handle, record, latency = await _one_session_with_a_latency_objective(agent)
        assert record.error == error, agent.__name__
        assert handle.counters.calls == 1 and handle.counters.completion_tokens == record.completion_tokens > 0
        assert latency["events"] == (0 if error else 1), agent.__name__


async def _one_session_with_a_latency_objective(agent):
    """Run `agent` as acme's one session on the sim, under a latency objective: its handle, its
    one call's record, and the report's figures for the objective."""
    from fleetsched.report import build_report

    sla = {"acme": {"sla": {"latency_p95_s": 100.0}}}
    async with Scheduler(settings(sla, backend={"kind": "sim"})) as scheduler:
        handle = await scheduler.submit(agent, tenant="acme")
        await handle
        report = build_report(scheduler, duration_s=1.0, backend="sim")
    check_released(scheduler)
    (record,) = scheduler.recorder.calls
    return handle, record, report["tenants"][0]["sla"]["objectives"]["latency_p95"]


@pytest.mark.parametrize("raised", ["after the answer's end", "midway"])
async def test_an_agent_raising_in_its_stream_block_is_recorded_alike_through_ctx_stream_and_the_sdk(raised):
    """The agent's own code raises inside a stream's block (its parse of the answer failed),
    after the whole answer or midway. Through the SDK the call was served (or cut); through
    `ctx.stream` it was recorded failed with the agent's ValueError, a "failed" breach of the
    tenant's latency objective blamed on the engine, and the session's counters left it out.
    Now alike: served whole after the answer's end, cut before it, and counted either way."""
    messages = [{"role": "user", "content": "hello " * 20}]

    def done(finish_reason):
        return finish_reason if raised == "after the answer's end" else True

    async def via_ctx_stream(ctx):
        with pytest.raises(ValueError):
            async with ctx.stream(messages, max_tokens=50) as chunks:
                async for chunk in chunks:
                    if chunk["choices"] and done(chunk["choices"][0]["finish_reason"]):
                        raise ValueError("the agent could not parse the answer")

    async def via_sdk(ctx):
        with pytest.raises(ValueError):
            async with await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, max_tokens=50, stream=True) as stream:
                async for chunk in stream:
                    if chunk.choices and done(chunk.choices[0].finish_reason):
                        raise ValueError("the agent could not parse the answer")

    whole = raised == "after the answer's end"
    for agent in (via_ctx_stream, via_sdk):
        handle, record, latency = await _one_session_with_a_latency_objective(agent)
        assert record.error == (None if whole else anyio.get_cancelled_exc_class().__name__), agent.__name__
        assert (record.completion_tokens == 50) == whole, agent.__name__
        assert handle.counters.calls == 1 and handle.counters.completion_tokens == record.completion_tokens, agent.__name__
        assert latency["breaches"] == {} and latency["events"] == (1 if whole else 0), agent.__name__


async def test_a_call_naming_a_model_not_served_is_a_404_naming_the_model_field():
    """A call naming a model the backend does not serve is a 404 whose param is model, as vLLM answers it."""

    async def agent(ctx):
        with pytest.raises(openai.NotFoundError) as refused:
            await ctx.openai.chat.completions.create(model="other-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        return refused.value.body["param"], refused.value.code

    async with Scheduler(settings(backend={"kind": "sim"})) as scheduler:
        assert await scheduler.run(agent, tenant="acme") == ("model", "model_not_found")
    check_released(scheduler)


def test_a_retry_after_is_at_least_1_s():
    """An error answer's Retry-After is at least 1 second, also for a wait of 0."""
    from fleetsched.agents.transport import response_for
    from fleetsched.errors import Overloaded

    assert response_for(Overloaded("shed", retry_after_s=0)).headers["retry-after"] == "1"
