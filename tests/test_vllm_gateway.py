"""The gateway in front of the real CPU vLLM, with the real openai SDK as the client."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from fleetsched.gateway.server import serve_in_thread

from .helpers import EngineLoad
from .test_gateway import ACME, client, gateway_settings

pytestmark = [pytest.mark.vllm]
MSG = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def gateway_url(vllm_server):
    s = gateway_settings(
        backend={"kind": "vllm-server", "urls": [vllm_server.url], "model": "fleetsched-tiny"},
        gateway={"max_context_tokens": 2048},
    )
    with serve_in_thread(s) as (_, url):
        yield url


def engine_counts(vllm_server) -> tuple[float, float]:
    """(tokens generated, requests finished by length) so far, from the engine's /metrics."""
    generated = by_length = 0.0
    for line in httpx.get(vllm_server.metrics_url).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            generated += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_success_total") and 'finished_reason="length"' in line:
            by_length += float(line.rsplit(" ", 1)[1])
    return generated, by_length


def test_sync_chat_passes_the_engines_answer_through(gateway_url):
    reply = client(gateway_url).chat.completions.create(model="fleetsched-tiny", messages=MSG, max_tokens=6, extra_body={"ignore_eos": True})
    assert reply.id.startswith("chatcmpl-") and reply.model == "fleetsched-tiny"
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 5
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.anyio
async def test_async_streaming_chat_with_usage(gateway_url):
    async with openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=ACME, max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="fleetsched-tiny",
            messages=MSG,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 4
    assert chunks[-1].usage.completion_tokens == 8


def test_the_request_id_reaches_the_engine(gateway_url):
    """The client's X-Request-Id, or the gateway's own, is the ID the vLLM server gives the call
    (its logs, and the answer's id: chatcmpl-<ID>, cmpl-<ID>), streamed or not, chat or text."""
    c = client(gateway_url)
    for stream in (False, True):
        raw = c.chat.completions.with_raw_response.create(
            model="fleetsched-tiny", messages=MSG, max_tokens=2, stream=stream, extra_headers={"X-Request-Id": f"trace-{stream}"}
        )
        answer = raw.parse()
        ids = {chunk.id for chunk in answer} if stream else {answer.id}
        assert raw.headers["x-request-id"] == f"trace-{stream}" and ids == {f"chatcmpl-trace-{stream}"}, ids
    raw = c.completions.with_raw_response.create(model="fleetsched-tiny", prompt="Once upon a time", max_tokens=2)
    assert raw.headers["x-request-id"].startswith("req_") and raw.parse().id == "cmpl-" + raw.headers["x-request-id"]


def test_completions_streaming_and_not(gateway_url):
    c = client(gateway_url)
    reply = c.completions.create(model="fleetsched-tiny", prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 5 and reply.choices[0].text
    chunks = list(
        c.completions.create(
            model="fleetsched-tiny", prompt="Once upon a time", max_tokens=5, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)


def test_refusals_are_4xx_never_500(gateway_url):
    c = client(gateway_url)
    with pytest.raises(openai.BadRequestError, match="2048") as info:
        c.chat.completions.create(model="fleetsched-tiny", messages=MSG, max_tokens=4000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # the engine's own 400, passed through
        c.chat.completions.create(model="fleetsched-tiny", messages=MSG, max_tokens=4, extra_body={"stream_interval": 0})


def test_a_prompt_that_fits_is_not_refused_by_the_estimate(gateway_url):
    """The gateway estimates a prompt at 4 characters a token: 800 tokens of " continuously"
    (13 characters each, one token to the tiny model's tokenizer) read 2,604, over the 2,048 of
    gateway.max_context_tokens, and were refused though they fit. A vLLM backend's prompts are
    left to the engine, which counts them."""
    reply = client(gateway_url).completions.create(model="fleetsched-tiny", prompt=" continuously" * 800, max_tokens=2)
    assert reply.usage.prompt_tokens <= 1000 and reply.usage.completion_tokens == 2


def test_a_refusal_names_the_replica_not_its_address(gateway_url, vllm_server):
    """The engine refuses a call (a stream_interval of 0, which the gateway leaves to it): the
    400 a tenant's client gets names the replica (r0), as the chat path's and the completions
    path's do alike, but not its address: it told every tenant where the operator's servers are."""
    c = client(gateway_url)
    with pytest.raises(openai.BadRequestError) as completion:
        c.completions.create(model="fleetsched-tiny", prompt="Once upon a time", max_tokens=4, extra_body={"stream_interval": 0})
    with pytest.raises(openai.BadRequestError) as chat:
        c.chat.completions.create(model="fleetsched-tiny", messages=MSG, max_tokens=4, extra_body={"stream_interval": 0})
    for info in (completion, chat):
        assert "vLLM replica r0 rejected the call" in info.value.message and vllm_server.url not in info.value.message
        assert "://" not in info.value.message


def test_client_disconnect_aborts_at_the_engine(gateway_url, vllm_server):
    """A stream whose client leaves while its call waits at the engine (for one of its 4 slots,
    held by long calls, 12 more waiting) is aborted there: it never runs to its end, though the
    engine's slots free up for it later. (A stream dropped mid-generation takes the same path; on 2
    shared cores the engine often finishes a call before its first event is out, so that is not
    what this test waits for.)
    """
    headers = {"authorization": f"Bearer {ACME}"}
    body = {"model": "fleetsched-tiny", "messages": MSG, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    generated_before, length_before = engine_counts(vllm_server)
    load = EngineLoad(vllm_server, calls=16)
    load.start()
    load.wait_until(lambda page: load.admitted(page) and page.signals.waiting >= 4)
    left: list[Exception] = []

    def client_that_leaves() -> None:
        # No event can come while the call waits, so the read timeout is the client giving up.
        try:
            with httpx.stream("POST", gateway_url + "/v1/chat/completions", json=body, headers=headers,
                              timeout=httpx.Timeout(30, read=5)) as response:  # fmt: skip
                _ = [line for line in response.iter_lines()]
        except httpx.ReadTimeout as exc:
            left.append(exc)

    victim = threading.Thread(target=client_that_leaves)
    victim.start()
    # The engine holds one request more than the load: the victim, waiting.
    load.wait_until(lambda page: page.signals.running + page.signals.waiting == 16 - len(load.finished) + 1)
    victim.join(timeout=60)
    load.join()
    assert left, "the client was meant to give up while its call waited"
    assert len(load.finished) == 16
    generated, by_length = engine_counts(vllm_server)
    # The victim never ran to its end. A critical-tier call on a priority server, it takes the
    # first slot that frees up: on a fast day that came within the client's 5 s, while the API
    # server, on 2 shared cores, had sent it no event yet, and it had 1,367 of its 1,900 tokens
    # made when its abort came (CI of the twenty-ninth session).
    assert 16 * 4000 <= generated - generated_before < 16 * 4000 + body["max_tokens"]
    assert by_length - length_before == 16
