"""The vLLM server backend's parts that need no server: /metrics parsing, the circuit breaker, and
retry classification for failures a live vLLM cannot be made to produce on demand (5xx, 429),
served by a mock transport. Virtual time (trio MockClock, from conftest)."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from openai import AsyncOpenAI

from fleetsched.backends.base import AVOID_KEY, FALLBACK_KEY, REPLICA_KEY, collect_chat, collect_stream
from fleetsched.backends.metrics import merge_signals, parse_vllm_metrics
from fleetsched.backends.vllm_server import CircuitBreaker, VLLMServerBackend
from fleetsched.errors import BackendError, BackendUnavailable, ContextTooLong, InvalidRequest, Overloaded

from .helpers import virtual_loop

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 100.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 20.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 2.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7e+09
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 9.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="524288"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.125
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.025
"""


def test_parse_sums_label_sets_and_skips_created_samples():
    page = parse_vllm_metrics(PAGE)
    s = page.signals
    assert (s.running, s.waiting) == (5, 7)
    assert s.kv_cache_usage == 0.5  # the fullest engine, not a sum of fractions
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total, s.preemptions_total) == (120.0, 64.0, 2.0)
    assert page.finished == {"abort": 4.0, "length": 9.0}
    assert page.cache_config["kv_cache_size_tokens"] == "524288"
    assert page.scheduling_policy is None  # vLLM 0.32 does not export it
    assert page.model_names == {"tiny"}
    assert (page.ttft_sum_s, page.ttft_count) == (pytest.approx(0.15), 6.0)  # summed over engines, no buckets


def test_a_page_that_is_not_prometheus_text_is_refused():
    with pytest.raises(ValueError, match="not a Prometheus text page"):
        parse_vllm_metrics("<html><body>502 Bad Gateway</body></html>")


def test_policy_read_from_an_info_metric_when_exported():
    page = parse_vllm_metrics('# TYPE vllm:scheduler_config_info gauge\nvllm:scheduler_config_info{policy="fcfs"} 1.0\n')
    assert page.scheduling_policy == "fcfs"


def test_absent_series_stay_none_and_merge_sums_replicas():
    empty = parse_vllm_metrics("").signals
    assert empty.running is None and empty.kv_cache_usage is None
    merged = merge_signals([parse_vllm_metrics(PAGE).signals, empty, parse_vllm_metrics(PAGE).signals])
    assert merged.running == 10 and merged.waiting == 14 and merged.kv_cache_usage == 0.5


def test_breaker_opens_half_opens_and_closes():
    breaker = CircuitBreaker(failures=2, reset_s=10.0)
    assert breaker.acquire(0.0)
    breaker.record_failure(0.0)
    assert breaker.state(0.0) == "closed"
    breaker.record_failure(1.0)
    assert breaker.state(1.0) == "open" and not breaker.acquire(5.0)
    assert breaker.retry_in(5.0) == 6.0
    assert "next probe in 6.0 s" in breaker.refusal(5.0)
    assert breaker.acquire(11.0) == "probe"  # the one probe
    assert breaker.acquire(11.0) is None  # others wait for its verdict
    assert "a probe call is under way" in breaker.refusal(11.0)  # before: "next probe in 0.0 s"
    breaker.record_failure(11.5, "probe")  # a failed probe re-opens at once
    assert breaker.state(12.0) == "open"
    assert breaker.acquire(21.5) == "probe"
    breaker.release("probe")  # a cancelled probe frees the slot without a verdict
    assert breaker.acquire(21.5) == "probe"
    breaker.record_success()
    assert breaker.state(21.5) == "closed" and breaker.consecutive_failures == 0


@pytest.mark.parametrize("reset_s", [math.inf, math.nan, 0.0])
def test_a_breaker_that_would_never_probe_is_refused(reset_s):
    # An infinite reset_s was taken: after `failures` failures the breaker never half-opened,
    # and its replica was out for good ("next probe in inf s"); nan did the same.
    with pytest.raises(ValueError, match=f"reset_s must be a finite number of seconds > 0, got {reset_s}"):
        CircuitBreaker(failures=5, reset_s=reset_s)


def test_a_call_granted_before_the_probe_has_no_say_on_it():
    """A call granted while the breaker was closed, cancelled while a probe was under way, freed
    the probe's slot: a second probe passed beside it. Its failure re-opens the breaker (the
    replica still fails) but leaves the probe its slot."""
    breaker = CircuitBreaker(failures=1, reset_s=1.0)
    stale = breaker.acquire(0.0)
    assert stale == "call"
    breaker.record_failure(0.0)  # another call fails: open
    assert breaker.acquire(1.0) == "probe"
    breaker.release(stale)  # the stale call is cancelled
    assert breaker.acquire(1.0) is None  # still the one probe
    breaker.record_failure(1.5, stale)
    assert breaker.state(2.6) == "half-open" and breaker.acquire(2.6) is None  # the probe still holds its slot
    breaker.record_success()  # the probe's verdict
    assert breaker.state(2.6) == "closed"


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


OK_STREAM = _sse(
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
     "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
)  # fmt: skip


def _backend(responses: list[httpx2.Response], seen: list[dict], health: int = 404, **options) -> VLLMServerBackend:
    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(request.content))
        return responses.pop(0)

    def factory(base_url: str, api_key: str) -> AsyncOpenAI:
        client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=client)

    # /metrics and /server_info answer 404: the scheduling policy stays unknown; /health `health`.
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(health if request.url.path == "/health" else 404)))
    options = {"retry_attempts": 4, "retry_initial_s": 1.0, "retry_max_s": 8.0, **options}
    return VLLMServerBackend("http://vllm.invalid:8000", client_factory=factory, http_client=http, **options)


def _ok() -> httpx2.Response:
    return httpx2.Response(200, content=OK_STREAM, headers={"content-type": "text/event-stream"})


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "priority": -3}


@pytest.mark.anyio
async def test_5xx_is_retried_with_backoff_then_streams():
    seen: list[dict] = []
    backend = _backend([httpx2.Response(500, json={"error": "boom"}), httpx2.Response(502), _ok()], seen)
    began = anyio.current_time()
    chunks = [c async for c in backend.stream_chat(BODY)]
    waited = anyio.current_time() - began
    assert len(seen) == 3
    assert 1.0 + 2.0 <= waited <= (1.0 + 1.0) + (2.0 + 1.0)  # exponential, jitter up to `initial`
    assert seen[0]["priority"] == -3 and seen[0]["stream"] is True
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert chunks[-1]["usage"]["total_tokens"] == 6
    assert collect_chat(chunks)["choices"][0]["message"]["content"] == "hi"
    await backend.aclose()


def test_a_collected_answer_keeps_a_reasoning_model_s_thinking_and_stop_reason():
    """vLLM streams a reasoning model's thinking as ``reasoning`` deltas (``reasoning_content``
    in older servers) and its non-streamed answer has them joined, beside ``stop_reason``; the
    fold kept content and tool calls only, so ctx.chat and non-streamed SDK calls lost them."""

    def chunk(delta: dict, **choice) -> dict:
        return {"id": "c1", "model": "m", "created": 1, "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice}]}

    for key in ("reasoning", "reasoning_content"):
        chunks = [
            chunk({"role": "assistant", "content": ""}),
            chunk({key: "The user greets; "}),
            chunk({key: "answer politely."}),
            chunk({"content": "Hello!"}),
            chunk({}, finish_reason="stop", stop_reason=7),
        ]
        (choice,) = collect_chat(chunks)["choices"]
        assert choice["message"] == {"role": "assistant", "content": "Hello!", key: "The user greets; answer politely."}
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 7)
    plain = collect_chat([chunk({"content": "hi"}, finish_reason="stop", stop_reason=None)])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "hi"} and plain["stop_reason"] is None


def test_a_collected_answer_keeps_the_token_ids_and_fingerprint_vllm_streams():
    """With ``return_token_ids`` (and ``return_prompt_text``) vLLM streams the prompt's token IDs
    and text on the first chunk and each choice's on its chunks, and its fingerprint on the last;
    its non-streamed answer has them whole. The fold dropped them, so ctx.chat and non-streamed
    SDK calls through a vllm-server backend lost what a direct call returns."""

    def chunk(delta: dict, token_ids: list[int] | None = None, **top) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {"id": "c1", "model": "m", "created": 1, "choices": [choice], **top}

    chunks = [
        chunk({"role": "assistant", "content": ""}, prompt_token_ids=[0, 3, 306], prompt_text="<s>hi"),
        chunk({"content": "sw"}, [353]),
        chunk({"content": "or"}, [349, 350]),
        {"id": "c1", "model": "m", "created": 1, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}, "system_fingerprint": "vllm-0.32.0"},
    ]
    response = collect_chat(chunks)
    assert response["prompt_token_ids"] == [0, 3, 306] and response["prompt_text"] == "<s>hi"
    assert response["system_fingerprint"] == "vllm-0.32.0"
    assert response["choices"][0]["token_ids"] == [353, 349, 350]
    plain = collect_chat([chunk({"content": "hi"})])
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain


def _streamed(*parts: bytes, then: BaseException | float | None = None) -> httpx2.Response:
    """An event stream of `parts`, then (`then`) an error raised, or a stall of that many seconds."""

    async def body():
        for part in parts:
            yield part
        if isinstance(then, BaseException):
            raise then
        if then is not None:
            await anyio.sleep(then)

    return httpx2.Response(200, content=body(), headers={"content-type": "text/event-stream"})


#: asyncio on virtual time, whose clock stands still while the SDK works in a worker thread (on
#: its first call): trio's plain MockClock jumps meanwhile, to the next deadline.
VIRTUAL_ASYNCIO = pytest.mark.parametrize("anyio_backend", [virtual_loop("asyncio")])


@pytest.mark.parametrize("then", [httpx2.ReadError("connection reset by peer"), 3600.0])
@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_an_answer_whole_at_its_done_is_not_failed_by_the_connection_after_it(then, anyio_backend):
    """The body is read to its end after [DONE] to keep the connection. A reset there failed the
    finished call with BackendUnavailable (the answer thrown away, the breaker counting it), and a
    stall held it for the read timeout, then failed it."""
    backend = _backend([_streamed(OK_STREAM, then=then)], [], read_timeout_s=60.0)
    began = anyio.current_time()
    response, _ = await collect_stream(backend.stream_chat(BODY))
    assert response["choices"][0]["message"]["content"] == "hi" and response["usage"]["total_tokens"] == 6
    assert anyio.current_time() - began <= 1.0 and backend.replicas["r0"].breaker.consecutive_failures == 0
    await backend.aclose()


@pytest.mark.parametrize("event", [b"not json", b"null", b"[]"])
@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_an_event_that_is_not_a_json_object_is_named(event, anyio_backend):
    # It said "Expecting value: line 1 column 1 (char 0)", or "'list' object has no attribute 'get'".
    backend = _backend([_streamed(b"data: " + event + b"\n\n")], [], retry_attempts=1)
    said = re.escape(f"sent an event that is not a JSON object: {event.decode()!r}")
    with pytest.raises(BackendError, match=rf"vLLM replica r0 \(.*\): {said}"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@pytest.mark.parametrize("choices", [b'"x"', b"[5]", b'{"index": 0}'])
@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_an_event_whose_choices_are_no_list_of_objects_is_named(choices, anyio_backend):
    # A collected answer (ctx.chat, the gateway's non-streamed call) failed with a bare
    # "AttributeError: 'str' object has no attribute 'get'", naming neither replica nor event.
    event = b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":' + choices + b"}"
    for before in (b"", ROLE_CHUNK):  # as the first chunk, and after it
        backend = _backend([_streamed(before, b"data: " + event + b"\n\n", b"data: [DONE]\n\n")], [], retry_attempts=1)
        with pytest.raises(BackendError, match=r"vLLM replica r0 \(.*\): sent an event whose choices are not a list of objects"):
            await collect_stream(backend.stream_chat(BODY))
        assert backend.replicas["r0"].in_flight == 0
        await backend.aclose()


@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_a_replica_that_sends_only_comments_fails_the_call_within_the_read_timeout(anyio_backend):
    """Comments (a proxy's keep-alives, in front of a hung server) kept every read within the
    read timeout: the call waited for ever, holding its place."""

    async def pings():
        while True:
            yield b": ping\n\n"
            await anyio.sleep(0.3)

    response = httpx2.Response(200, content=pings(), headers={"content-type": "text/event-stream"})
    backend = _backend([response], [], retry_attempts=1, read_timeout_s=1.0)
    with anyio.fail_after(10):
        with pytest.raises(BackendUnavailable, match=r"took the call, then sent nothing: no answer within the read timeout"):
            await collect_stream(backend.stream_chat(BODY))
    assert backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@pytest.mark.anyio
async def test_the_body_goes_out_as_given():
    """Messages, tools and vLLM's extras reach the server unchanged (the messages travel in
    `extra_body`, past the SDK's per-message transform), with streaming and usage switched on."""
    conversation = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": conversation, "tools": tools, "max_tokens": 4, "priority": 1, "stream_interval": 16}
    seen: list[dict] = []
    backend = _backend([_ok()], seen)
    _ = [c async for c in backend.stream_chat(body)]
    assert seen == [{**body, "stream": True, "stream_options": {"include_usage": True}}]
    assert body["messages"] is conversation  # the caller's body is left as it was
    await backend.aclose()


@pytest.mark.anyio
async def test_4xx_is_not_retried_and_does_not_trip_the_breaker():
    seen: list[dict] = []
    backend = _backend([httpx2.Response(400, json={"error": {"message": "max_tokens too large"}})], seen, breaker_failures=1)
    with pytest.raises(BackendError) as info:
        _ = [c async for c in backend.stream_chat(BODY)]
    assert type(info.value) is InvalidRequest and "400" in str(info.value)  # the body: not retryable
    assert len(seen) == 1
    assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
    await backend.aclose()


@pytest.mark.anyio
async def test_an_error_answer_without_a_message_field_says_what_its_body_said():
    """The SDK's message takes a JSON body's ``message`` alone: vLLM's own 401 for a wrong
    api_key (``{"error": "Unauthorized"}``), a proxy's 502 page or a plain-text 400 all read
    "Error code: N" and no more, the body that said why lost on the way to the session."""
    page = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1><hr>nginx/1.25</body></html>" + " " * 5000
    answers = [
        (httpx2.Response(401, json={"error": "Unauthorized"}), BackendError, "rejected the call (401): Error code: 401 - Unauthorized"),
        (httpx2.Response(502, text=page, headers={"content-type": "text/html"}), BackendUnavailable, "failed with 502: Error code: 502 - 502 Bad Gateway 502 Bad Gateway nginx/1.25"),
        (httpx2.Response(400, text="request header too large"), InvalidRequest, "rejected the call (400): Error code: 400 - request header too large"),
        (httpx2.Response(405, json={"detail": "Method Not Allowed"}), BackendError, 'rejected the call (405): Error code: 405 - {"detail": "Method Not Allowed"}'),
    ]
    for answer, kind, said in answers:
        backend = _backend([answer], [], retry_attempts=1)
        with pytest.raises(kind) as info:
            await collect_stream(backend.stream_chat(BODY))
        assert str(info.value) == f"vLLM replica r0 (http://vllm.invalid:8000) {said}"
        await backend.aclose()
    long = "x" * 1000  # an excerpt, not the whole body
    backend = _backend([httpx2.Response(400, text=long)], [], retry_attempts=1)
    with pytest.raises(InvalidRequest, match=r"Error code: 400 - x{200}\.\.\.$"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@pytest.mark.anyio
async def test_429_exhausts_attempts_into_overloaded_and_leaves_the_breaker_closed():
    """A replica that answers 429 (or 503) is up and busy: the caller gets `Overloaded` with the
    wait it asks, and the next call reaches it. It opened the breaker: the replica was locked out
    for the breaker's reset period, every call a `BackendUnavailable` with no wait to honour."""
    seen: list[dict] = []
    limited = [httpx2.Response(status, headers={"retry-after": "7"}, json={}) for status in (429, 429, 503, 503)]
    backend = _backend(limited, seen, retry_attempts=2, breaker_failures=1, breaker_reset_s=60.0)
    for sent in (2, 4):
        with pytest.raises(Overloaded) as info:
            _ = [c async for c in backend.stream_chat(BODY)]
        assert info.value.retry_after_s == 7.0 and len(seen) == sent
    assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
    await backend.aclose()


@pytest.mark.anyio
async def test_named_replica_and_least_loaded_fallback():
    backend = VLLMServerBackend({"a": "http://a.invalid:1", "b": "http://b.invalid:2/v1"})
    assert set(backend.replicas) == {"a", "b"} and backend.replicas["b"].url == "http://b.invalid:2"
    backend.replicas["a"].in_flight = 3
    assert backend.pick_replica().name == "b"
    assert backend.pick_replica("a").name == "a"
    backend.replicas["b"].breaker.record_failure(anyio.current_time())
    backend.replicas["b"].breaker.opened_at = anyio.current_time()
    assert backend.pick_replica().name == "a"  # b's breaker is open
    with pytest.raises(BackendError, match="unknown vLLM replica 'c'"):
        backend.pick_replica("c")
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_stream_options_that_are_no_object_are_refused(stream):
    """`stream_options` must be an object, streamed or collected whole (`chat` gave the dict
    merge's TypeError: "'str' object is not a mapping"); nothing is sent."""
    seen: list[dict] = []
    backend = _backend([], seen)
    with pytest.raises(InvalidRequest, match="stream_options: expected an object, got 'yes'"):
        _ = [c async for c in backend.stream_chat({**BODY, "stream_options": "yes", "stream": stream})]
    assert seen == [] and backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@pytest.mark.anyio
async def test_a_body_without_messages_is_an_invalid_request():
    """vLLM answers such a body 400 ('messages: Field required'); it was a `BackendError`, which
    the dispatcher and ctx.openai take for a failure of the backend (a 500), not of the body."""
    seen: list[dict] = []
    backend = _backend([], seen)
    body = {key: value for key, value in BODY.items() if key != "messages"}
    with pytest.raises(InvalidRequest, match="messages"):
        _ = [c async for c in backend.stream_chat(body)]
    assert seen == [] and backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"temperature": float("nan")}, "Out of range float values are not JSON compliant"),
        ({"metadata": {"due": datetime.date(2026, 1, 1)}}, "Object of type date is not JSON serializable"),
        # A tool's text with a lone surrogate (decoded with "surrogateescape", say).
        ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "ls: \udcff"}]}, "surrogates not allowed"),
    ],
)
async def test_a_body_that_cannot_be_sent_as_json_is_an_invalid_request(extra, said):
    """It was a `BackendError` naming the replica ("vLLM replica r0 (...): Object of type date is not
    JSON serializable"), a 500 to ctx.openai, where the sim refuses such a body as invalid."""
    seen: list[dict] = []
    backend = _backend([], seen, breaker_failures=1)
    with pytest.raises(InvalidRequest, match="the request cannot be sent as JSON") as info:
        _ = [c async for c in backend.stream_chat({**BODY, **extra})]
    assert said in str(info.value)
    assert seen == [] and backend.replicas["r0"].in_flight == 0
    assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
    await backend.aclose()


@pytest.mark.anyio
async def test_a_stream_cut_mid_answer_says_so():
    """The server gone mid-answer (its process killed: the body ends before its last chunk):
    the error says the answer broke off and names the URL; it read 'cannot reach vLLM replica
    r0: peer closed connection ...' though the replica had answered."""

    class CutStream(httpx2.AsyncByteStream):
        async def __aiter__(self):
            yield OK_STREAM.split(b"\n\n")[0] + b"\n\n"
            raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")

    seen: list[dict] = []
    backend = _backend([httpx2.Response(200, stream=CutStream(), headers={"content-type": "text/event-stream"})], seen)
    with pytest.raises(BackendUnavailable) as info:
        _ = [c async for c in backend.stream_chat(BODY)]
    message = str(info.value)
    assert "vLLM replica r0 (http://vllm.invalid:8000) broke off the answer after 1 chunks" in message, message
    assert "peer closed connection" in message and len(seen) == 1  # not retried: it had streamed
    await backend.aclose()


def _scraped(pages: dict[str, str | int]) -> VLLMServerBackend:
    """A backend over replicas named by host (``http://a.invalid`` is replica "a"), whose
    ``/metrics`` answer `pages[host]` (a status code for a failed scrape); change `pages` between
    scrapes to change what they answer."""

    def handler(request: httpx.Request) -> httpx.Response:
        page = pages[request.url.host.removesuffix(".invalid")] if request.url.path == "/metrics" else 404
        return httpx.Response(page) if isinstance(page, int) else httpx.Response(200, text=page)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return VLLMServerBackend({name: f"http://{name}.invalid" for name in pages}, http_client=http)


def _gauges(waiting: str, kv: str = "0.5", preemptions: str = "0") -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {kv}\n'
        "# TYPE vllm:num_preemptions counter\n"
        f'vllm:num_preemptions_total{{engine="0",model_name="tiny"}} {preemptions}\n'
    )


@pytest.mark.anyio
async def test_non_finite_metric_values_are_left_out_and_never_escape_signals():
    """A page with +Inf or NaN samples (an exporter's division by zero, a proxy's page): those
    samples count as absent and the rest of the page still counts. `int(inf)` raised
    OverflowError, which `replica_signals` did not catch and the dispatcher's window loop (it
    catches fleetsched errors only) did not either: one odd page ended the scheduler."""
    backend = _scraped({"a": _gauges("+Inf"), "b": _gauges("NaN", kv="NaN", preemptions="3")})
    signals = await backend.signals()
    assert signals.waiting is None  # neither replica said a number
    assert signals.kv_cache_usage == 0.5  # a's; b's NaN is no reading
    assert signals.preemptions_total == 3.0  # b still answered: its NaN gauges did not drop it
    await backend.aclose()


@pytest.mark.anyio
async def test_counters_summed_over_replicas_only_rise():
    """The window loop takes the rise of ``preemptions_total`` between two scrapes as the
    preemptions since the last. Summed over the replicas that answered, it fell by a replica's
    whole count when that replica missed one scrape and rose by it again at the next: 100
    preemptions that never happened, and the window shrank. A replica's restart (its counter
    begins again at 0) hid the preemptions of the others. Each replica's counter now carries
    over its restarts, and a replica that misses a scrape counts with its last reading."""
    pages: dict[str, str | int] = {"a": _gauges("0", preemptions="100"), "b": _gauges("0", preemptions="5")}
    backend = _scraped(pages)
    assert (await backend.signals()).preemptions_total == 105
    pages["a"] = 503  # a misses a scrape
    assert (await backend.signals()).preemptions_total == 105
    pages["a"] = _gauges("0", preemptions="100")
    assert (await backend.signals()).preemptions_total == 105
    pages["a"], pages["b"] = _gauges("0", preemptions="2"), _gauges("0", preemptions="8")  # a restarted
    assert (await backend.signals()).preemptions_total == 110  # 2 on a since its restart, 3 more on b
    pages["a"] = _gauges("0", preemptions="4")
    assert (await backend.signals()).preemptions_total == 112
    await backend.aclose()


@pytest.mark.anyio
async def test_retry_after_is_honoured_up_to_the_longest_backoff():
    """A 429 or 503 that says when to come back (Retry-After, in seconds) is retried then, not
    after the exponential backoff alone (0.25 s, then 0.5 s: it came back 5 s early, and was
    refused again); a Retry-After longer than `retry_max_s` waits `retry_max_s`. Jittered
    either way, so that the calls refused together do not all return in the same instant."""
    seen: list[dict] = []
    answers = [
        httpx2.Response(429, headers={"retry-after": "5"}, json={}),
        httpx2.Response(503, headers={"retry-after": "600"}, json={}),
        httpx2.Response(503, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, json={}),  # no seconds: backoff
        _ok(),
    ]
    backend = _backend(answers, seen, retry_attempts=4, retry_initial_s=0.25, retry_max_s=8.0)
    began = anyio.current_time()
    _ = [c async for c in backend.stream_chat(BODY)]
    waited = anyio.current_time() - began
    assert len(seen) == 4
    assert 5.0 + 8.0 + 1.0 <= waited <= 5.0 + 8.0 + 1.0 + 3 * 0.25, waited
    await backend.aclose()


def _event_stream(*events: bytes) -> httpx2.Response:
    return httpx2.Response(200, content=b"".join(events) + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})


def _error_event(code: int, message: str) -> bytes:
    """How vLLM reports a failure once its 200 and the stream have begun (create_streaming_error_response)."""
    error = {"message": message, "type": "InternalServerError" if code >= 500 else "BadRequestError", "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


ROLE_CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'


@pytest.mark.anyio
@pytest.mark.parametrize("in_stream", [False, True])
@pytest.mark.parametrize("health", [200, 503, 404])
async def test_a_5xx_counts_against_the_replica_only_where_its_health_is_not_200(health, in_stream):
    """vLLM 0.32 answers some bodies it cannot serve with a 500 while its engine is well (a
    ``structured_outputs`` of true): five such calls of one tenant opened the breaker, and every
    tenant's calls were refused for its reset period. A 5xx, before the answer or in its stream,
    counts against the replica only where its /health does not answer 200 just after."""
    failing = _event_stream(ROLE_CHUNK, _error_event(500, "Internal server error")) if in_stream else httpx2.Response(500, json={})
    backend = _backend([failing, _ok()], seen := [], health=health, retry_attempts=1, breaker_failures=1)
    with pytest.raises(BackendUnavailable, match="500"):
        _ = [c async for c in backend.stream_chat(BODY)]
    state = backend.replicas["r0"].breaker.state(anyio.current_time())
    assert state == ("closed" if health == 200 else "open")
    if health == 200:
        chunks = [c async for c in backend.stream_chat(BODY)]  # the next call is served
        assert chunks[-1]["usage"]["total_tokens"] == 6
    assert len(seen) == 1 + (health == 200)
    await backend.aclose()


@pytest.mark.anyio
async def test_an_error_event_is_translated_by_its_code_and_names_the_replica():
    """vLLM reports a failure after its 200 as an error event in the stream, with the HTTP code
    it would have answered. It was a bare BackendError ("vLLM failed the call mid-stream: ...")
    whatever the code, naming no replica; before the first chunk an engine failure (500) was
    neither retried nor counted by the breaker, though nothing had reached the caller."""
    seen: list[dict] = []
    backend = _backend([_event_stream(_error_event(500, "EngineCore died")), _ok()], seen, breaker_failures=1)
    chunks = [c async for c in backend.stream_chat(BODY)]  # retried: nothing had been delivered
    assert len(seen) == 2 and chunks[-1]["usage"]["total_tokens"] == 6

    backend = _backend([_event_stream(_error_event(400, "Invalid tool parser: 'nope'"))], seen := [])
    with pytest.raises(InvalidRequest, match=r"vLLM replica r0 \(http://vllm.invalid:8000\) .*Invalid tool parser"):
        _ = [c async for c in backend.stream_chat(BODY)]
    assert len(seen) == 1  # the body's fault: not retried

    backend = _backend([_event_stream(ROLE_CHUNK, _error_event(500, "Internal server error"))], seen := [], breaker_failures=1)
    with pytest.raises(BackendUnavailable, match=r"vLLM replica r0 \(http://vllm.invalid:8000\) .*Internal server error"):
        _ = [c async for c in backend.stream_chat(BODY)]
    assert len(seen) == 1  # a chunk had gone out: the failure is the caller's
    assert backend.replicas["r0"].breaker.state(anyio.current_time()) == "open"
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("info", ["null", "[]", '"up"', '{"vllm_config": {"scheduler_config": "SchedulerConfig(policy=fcfs)"}}'])
async def test_a_server_info_of_another_shape_leaves_the_policy_unknown(info):
    """`signals` reads a replica's scheduling policy from ``/server_info`` once; a 200 whose JSON
    is not vLLM's object (a proxy's answer, another server) raised AttributeError ('NoneType'
    object has no attribute 'get') out of `signals`, which the window loop does not catch."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_gauges("1"))
        return httpx.Response(200, text=info, headers={"content-type": "application/json"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    backend = VLLMServerBackend("http://vllm.invalid:8000", http_client=http)
    assert (await backend.signals()).waiting == 1
    assert await backend.scheduling_policy() is None
    await backend.aclose()


@contextlib.contextmanager
def _http_server(answer: bytes, posts: list[bytes] | None = None) -> Iterator[str]:
    """A real HTTP server in a thread that answers every POST with the raw bytes `answer` (status
    line, headers and body) and closes the connection: what a proxy in front of vLLM may send.
    The bodies it was sent go to `posts`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            sent = self.rfile.read(int(self.headers["Content-Length"]))
            if posts is not None:
                posts.append(sent)
            self.wfile.write(answer)
            self.close_connection = True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("keep_alive", [b"\n", b"event: ping\n\n", b"id: 7\n\n"])
@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_keep_alive_lines_of_every_kind_are_a_stall_past_the_read_timeout(keep_alive, anyio_backend):
    """Only comments started the silence clock: a blank line or an `event: ping` every 0.3 s
    held a stalled stream open for as long as they came."""

    async def pings():
        yield ROLE_CHUNK
        for _ in range(100):
            yield keep_alive
            await anyio.sleep(0.3)

    response = httpx2.Response(200, content=pings(), headers={"content-type": "text/event-stream"})
    backend = _backend([response], [], retry_attempts=1, read_timeout_s=1.0)
    began = anyio.current_time()
    with pytest.raises(BackendUnavailable):
        await collect_stream(backend.stream_chat(BODY))
    assert anyio.current_time() - began < 3.0 and backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_a_usage_with_null_counts_is_read_as_0_and_one_that_is_no_object_is_named(anyio_backend):
    """vLLM's schema lets a count be null: it went on into the records as None, failed the
    session's counters with a bare TypeError and the run's summary after it. A usage that is no
    object raised a bare AttributeError."""
    nulls = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":null}}\n\n'
    backend = _backend([_event_stream(ROLE_CHUNK, nulls)], [], retry_attempts=1)
    response, _ = await collect_stream(backend.stream_chat(BODY))
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    text = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":"x"}\n\n'
    backend = _backend([_event_stream(ROLE_CHUNK, text)], [], retry_attempts=1)
    with pytest.raises(BackendError, match="sent a usage that is not an object: 'x'"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_falling_back_from_the_only_replica_that_can_take_it_fails_at_once():
    """The dispatcher sends a session's call that its replica failed again, avoiding that
    replica; with no other to take it, it went back there and had its attempts twice (6 for
    retry_attempts 3), its breaker counting two failures."""
    seen: list[dict] = []
    backend = _backend([httpx2.Response(500, json={}) for _ in range(6)], seen, retry_attempts=3, retry_initial_s=0.0, retry_max_s=0.0)
    with pytest.raises(BackendUnavailable, match="failed with 500"):
        await collect_stream(backend.stream_chat({**BODY, REPLICA_KEY: "r0", FALLBACK_KEY: True}))
    with pytest.raises(BackendUnavailable, match="no vLLM replica but r0, which failed this call, can take it"):
        await collect_stream(backend.stream_chat({**BODY, AVOID_KEY: "r0"}))
    assert len(seen) == 3 and backend.replicas["r0"].breaker.consecutive_failures == 1
    await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_stream_that_ends_without_done_is_an_answer_broken_off(anyio_backend):
    """A body delimited by the connection's close (no length, not chunked: HTTP/1.0 style, as
    some proxies send it) ends cleanly wherever the connection drops. vLLM ends every stream
    with ``data: [DONE]``; a stream that ends without it was cut. It passed as a whole answer,
    "Hel" with a usage estimated for it, as if the model had stopped there."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    body = ROLE_CHUNK + b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    with _http_server(head + body) as url:
        async with VLLMServerBackend(url, retry_attempts=1) as backend:
            chunks = []
            with pytest.raises(BackendUnavailable, match=rf"vLLM replica r0 \({url}\) broke off the answer after 2 chunks"):
                async for chunk in backend.stream_chat(BODY):
                    chunks.append(chunk)
            assert len(chunks) == 2  # what came is delivered; no usage made up after it


#: A whole answer, "Hi", as vLLM streams it.
ANSWERED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    + ROLE_CHUNK
    + b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\n'
    + b"data: [DONE]\n\n"
)


@contextlib.contextmanager
def _silent_server(first: bytes = b"") -> Iterator[tuple[str, list[int]]]:
    """A server in a thread that takes each request, sends `first` (nothing by default) and then
    holds the connection without a word: a replica paused (SIGSTOP) or hung. Yields its URL and
    the count of calls (POSTs) it took; the backend's own reads (its policy check's) are not counted."""
    listener = socket.create_server(("127.0.0.1", 0))
    taken = [0]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            if connection.recv(65536).startswith(b"POST"):
                taken[0] += 1
            connection.sendall(first)
            held.append(connection)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", taken
    finally:
        listener.close()
        for connection in held:
            connection.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_replica_that_takes_the_call_and_then_says_nothing_fails_it_within_the_read_timeout(anyio_backend):
    """The SDK's default waits 600 s for each read, each attempt: a paused replica held a call
    for about 40 minutes, and one that a session was placed on was never failed over from."""
    with _silent_server() as (url, taken):
        async with VLLMServerBackend(url, retry_attempts=2, retry_initial_s=0.01, read_timeout_s=0.5) as backend:
            with anyio.fail_after(10):
                with pytest.raises(BackendUnavailable, match=r"vLLM replica r0 \(.*\) took the call, then sent nothing: no answer within the read timeout"):
                    await collect_stream(backend.stream_chat(BODY))
        assert taken[0] == 2  # retried, as an unreachable replica is
    stalled = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + ROLE_CHUNK  # then nothing
    with _silent_server(stalled) as (url, taken):
        async with VLLMServerBackend(url, retry_attempts=1, read_timeout_s=0.5) as backend:
            with anyio.fail_after(10):
                with pytest.raises(BackendUnavailable, match=r"broke off the answer after 1 chunks: no answer within the read timeout"):
                    await collect_stream(backend.stream_chat(BODY))
    # Before its first chunk, a silent replica is failed over from, as one that refuses is.
    with _silent_server() as (silent, _), _http_server(ANSWERED) as live:
        async with VLLMServerBackend({"r0": silent, "r1": live}, read_timeout_s=0.5) as backend:
            with anyio.fail_after(10):
                response, _ = await collect_stream(backend.stream_chat(BODY))
    assert response["choices"][0]["message"]["content"] == "Hi"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_call_falling_back_from_its_sessions_replica_does_not_go_back_to_it():
    """The fallback was routed by load, and the replica that had just failed (its breaker still
    closed, no call in flight) won the tie: it got the call's attempts twice over."""
    from fleetsched.scheduler import Dispatcher

    failing = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
    to_r0: list[bytes] = []
    with _http_server(failing, to_r0) as r0, _http_server(ANSWERED) as r1:
        async with VLLMServerBackend({"r0": r0, "r1": r1}, retry_attempts=3, retry_initial_s=0.01, retry_max_s=0.01) as backend:
            response = await Dispatcher(backend, window=4).chat(BODY, tenant="t", tier=1, replica="r0")
    assert response["choices"][0]["message"]["content"] == "Hi"
    assert len(to_r0) == 3  # its attempts once (6 before)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_replica_that_answers_with_a_page_is_no_vllm_server():
    """A proxy's or another service's page, answered 200, was retried as a stream cut short
    (every attempt) and counted against the replica's breaker."""
    page = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 18\r\nconnection: close\r\n\r\n<html>hello</html>"
    posts: list[bytes] = []
    with _http_server(page, posts) as url:
        async with VLLMServerBackend(url, retry_attempts=3, retry_initial_s=0.01, retry_max_s=0.01) as backend:
            with pytest.raises(BackendError, match=r"answered with 'text/html', not an event stream: the URL must be the root URL"):
                await collect_stream(backend.stream_chat(BODY))
            assert backend.replicas["r0"].breaker.consecutive_failures == 0
    assert len(posts) == 1  # not retried


def test_an_http_client_of_another_kind_is_refused_naming_it():
    """The readers of /metrics, the KV cache and the model list catch httpx's errors: an httpx2
    client (the SDK's own kind, an easy slip) let its raw errors out of every one of them."""
    with pytest.raises(TypeError, match=r"^http_client: expected an httpx.AsyncClient, got httpx2\."):
        VLLMServerBackend("http://vllm.invalid:8000", http_client=httpx2.AsyncClient())


@pytest.mark.anyio
async def test_the_field_vllm_names_in_its_400_reaches_the_client():
    """vLLM's 400 names the field apart from its message ("param"); the error kept the message
    only, and the gateway's and ctx.openai's answers had param null."""
    from fleetsched.agents.transport import response_for

    refusal = {"error": {"object": "error", "message": "top_k must be -1 or at least 1, got 0.", "type": "BadRequestError", "param": "top_k", "code": 400}}
    backend = _backend([httpx2.Response(400, json=refusal)], [])
    with pytest.raises(InvalidRequest) as refused:
        _ = [c async for c in backend.stream_chat({**BODY, "top_k": 0})]
    assert refused.value.param == "top_k"
    assert json.loads(response_for(refused.value).content)["error"]["param"] == "top_k"


@pytest.mark.anyio
async def test_a_400_that_names_max_model_len_is_context_too_long():
    """A vLLM 400 whose message speaks of its max_model_len is ContextTooLong, naming the field vLLM names."""
    said = "'max_tokens' is too large: 5000. This model's max_model_len is 4096 and you requested 5000 tokens."
    refusal = {"error": {"object": "error", "message": said, "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    backend = _backend([httpx2.Response(400, json=refusal)], [])
    with pytest.raises(ContextTooLong) as refused:
        _ = [c async for c in backend.stream_chat({**BODY, "max_tokens": 5000})]
    assert refused.value.param == "max_tokens"
    await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_an_answer_whose_bytes_do_not_decode_is_the_replica_s_failure_and_failed_over(anyio_backend):
    """A body that says it is gzip and is not (a proxy's fault, say) let httpx's DecodingError out
    raw: "vLLM replica r0: Error -3 while decompressing data", neither retried nor failed over."""
    garbled = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\nconnection: close\r\n\r\n" + b"no gzip at all"
    posts: list[bytes] = []
    with _http_server(garbled, posts) as url:
        async with VLLMServerBackend(url, retry_attempts=2, retry_initial_s=0.01, retry_max_s=0.01) as backend:
            with pytest.raises(BackendUnavailable, match=rf"^vLLM replica r0 \({url}\) sent an answer that cannot be decoded \(.*decompress"):
                await collect_stream(backend.stream_chat(BODY))
            assert backend.replicas["r0"].breaker.consecutive_failures == 1
        assert len(posts) == 2  # retried, as a connection reset is
        with _http_server(ANSWERED) as live:
            async with VLLMServerBackend({"r0": url, "r1": live}) as backend:
                response, _ = await collect_stream(backend.stream_chat(BODY, replica=None))
    assert response["choices"][0]["message"]["content"] == "Hi"


@contextlib.contextmanager
def _trickling_server(chunks: int, every_s: float) -> Iterator[str]:
    """A server in a thread that answers each request with a stream of `chunks` chunks, one
    every `every_s` seconds, then ``[DONE]``: a long answer. Other requests (the backend's
    policy check) are answered 404."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(connection: socket.socket) -> None:
        with connection:
            if not connection.recv(65536).startswith(b"POST"):
                connection.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + ROLE_CHUNK)
            for _ in range(chunks):
                time.sleep(every_s)
                connection.sendall(b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n')
            connection.sendall(b"data: [DONE]\n\n")
            connection.shutdown(socket.SHUT_WR)
            connection.settimeout(1.0)
            with contextlib.suppress(OSError):  # read the rest of the request: closed unread, it resets
                while connection.recv(65536):
                    pass

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_call_that_waits_for_a_connection_past_the_timeout_says_so(anyio_backend):
    """A call that found every connection of the client's pool busy for the whole timeout never
    left this process; it was worded as a replica that "took the call, then sent nothing"."""

    def one_connection(base_url: str, api_key: str) -> AsyncOpenAI:
        client = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=1))
        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=client)

    with _trickling_server(chunks=20, every_s=0.1) as url:
        async with VLLMServerBackend(url, retry_attempts=1, read_timeout_s=0.5, client_factory=one_connection) as backend:
            long_answer: list[Any] = []

            async def first() -> None:
                long_answer.append(await collect_stream(backend.stream_chat(BODY)))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await anyio.sleep(0.1)
                    with pytest.raises(BackendUnavailable, match=r"^cannot reach vLLM replica r0 \(.*\): no free connection to it within the timeout"):
                        await collect_stream(backend.stream_chat(BODY))
    assert long_answer[0][0]["choices"][0]["message"]["content"] == "a" * 20  # the call holding the connection is whole


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_replica_that_answers_then_ends_before_any_event_is_not_called_unreachable(anyio_backend):
    # It said "cannot reach vLLM replica r0": it was reached, and answered 200.
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    with _http_server(head) as url:
        async with VLLMServerBackend(url, retry_attempts=1) as backend:
            with pytest.raises(BackendUnavailable, match=rf"vLLM replica r0 \({url}\) answered the call, then broke off"):
                await collect_stream(backend.stream_chat(BODY))


@pytest.mark.anyio
async def test_no_replica_to_ask_for_its_model_is_not_told_to_set_the_model(caplog):
    """With no server listening, the first line said "no vLLM replica listed its model ...; set
    backend.model to the server's --served-model-name", a wrong fix, before the real error
    (cannot be reached): now it asks whether the server is up. A replica that answers something
    else than vLLM's list is still told to set the model."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = VLLMServerBackend(f"http://127.0.0.1:{port}", model=None)
    with caplog.at_level("WARNING"):
        assert await backend.served_model() == "fleetsched-tiny"
    await backend.aclose()
    assert "is the server up?" in caplog.text and "set backend.model" not in caplog.text
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, json={"not": "vllm"})))
    backend = VLLMServerBackend("http://vllm.invalid:8000", model=None, http_client=http)
    with caplog.at_level("WARNING"):
        await backend.served_model()
    await backend.aclose()
    await http.aclose()
    assert "no vLLM replica listed its model" in caplog.text


@pytest.mark.anyio
async def test_a_replica_that_refuses_the_api_key_is_not_told_to_set_the_model(caplog):
    """vLLM's --api-key guards /v1/models too: with a wrong backend.api_key its 401 was said as
    "no vLLM replica listed its model (...HTTPStatusError: Client error '401 Unauthorized' ...
    For more information check: https://developer.mozilla.org/...): set backend.model to the
    server's --served-model-name", a wrong fix (every call is refused for the key all the same)."""
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(401, json={"error": "Unauthorized"})))
    backend = VLLMServerBackend("http://vllm.invalid:8000", model=None, api_key="wrong", http_client=http)
    with caplog.at_level("WARNING"):
        await backend.served_model()
    await backend.aclose()
    await http.aclose()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("a vLLM replica refused backend.api_key when asked for its model (r0 (http://vllm.invalid:8000): it answered 401 Unauthorized)")
    assert "set backend.api_key to the server's --api-key" in warning and "set backend.model" not in warning and "\n" not in warning


def test_a_breaker_closed_by_its_probe_lets_a_probe_through_at_the_next_outage():
    """A breaker that its probe closed lets a probe through when it opens again."""
    breaker = CircuitBreaker(failures=1, reset_s=1.0)
    breaker.record_failure(0.0)
    assert breaker.acquire(1.0) == "probe"
    breaker.record_success()
    breaker.record_failure(2.0)
    assert breaker.acquire(3.0) == "probe"


def test_a_probe_that_fails_after_another_call_closed_the_breaker_counts_as_one_failure():
    """A probe failing after another call's success closed the breaker counts as one failure, not a reopening."""
    breaker = CircuitBreaker(failures=2, reset_s=1.0)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    assert breaker.acquire(1.0) == "probe"
    breaker.record_success()  # a call granted before the breaker opened succeeds
    breaker.record_failure(1.5, "probe")
    assert breaker.state(1.5) == "closed"


@pytest.mark.anyio
async def test_a_call_the_replica_answers_resets_its_breaker_s_count():
    """A call that the replica streams, or refuses with a 400, resets its breaker's count of failures."""
    answers = [httpx2.Response(500, json={}), httpx2.Response(400, json={}), httpx2.Response(500, json={}), _ok(), httpx2.Response(500, json={})]
    backend = _backend(answers, seen := [], retry_attempts=1, breaker_failures=2)
    for _ in range(5):
        with contextlib.suppress(BackendUnavailable, InvalidRequest):
            await collect_stream(backend.stream_chat(BODY))
    assert len(seen) == 5 and backend.replicas["r0"].breaker.state(anyio.current_time()) == "closed"
    await backend.aclose()


@pytest.mark.anyio
async def test_a_probe_cancelled_before_its_first_chunk_frees_the_probe_s_slot():
    """A probe call cancelled before its first chunk lets the next call probe the replica."""
    backend = _backend([httpx2.Response(500, json={}), _streamed(then=3600.0), _ok()], seen := [], retry_attempts=1, breaker_failures=1, breaker_reset_s=1.0)
    with pytest.raises(BackendUnavailable):
        await collect_stream(backend.stream_chat(BODY))
    await anyio.sleep(1.0)
    with anyio.move_on_after(5.0):
        await collect_stream(backend.stream_chat(BODY))  # the probe, cancelled
    response, _ = await collect_stream(backend.stream_chat(BODY))
    assert response["choices"][0]["message"]["content"] == "hi" and len(seen) == 3
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_routed_by_load_with_every_breaker_open_is_refused():
    """A call routed by load when every replica's breaker is open is refused as a circuit open."""
    backend = _backend([httpx2.Response(500, json={})], seen := [], retry_attempts=1, breaker_failures=1)
    with pytest.raises(BackendUnavailable, match="failed with 500"):
        await collect_stream(backend.stream_chat(BODY))
    with pytest.raises(BackendUnavailable, match="circuit open"):
        await collect_stream(backend.stream_chat(BODY))
    assert len(seen) == 1
    await backend.aclose()


@pytest.mark.anyio
async def test_a_half_open_replica_takes_calls_routed_by_load():
    """A replica whose breaker is half-open takes a call routed by load (its probe) when it is the least loaded."""
    backend = VLLMServerBackend({"a": "http://a.invalid:1", "b": "http://b.invalid:2"}, breaker_failures=1, breaker_reset_s=1.0)
    backend.replicas["a"].in_flight = 1
    backend.replicas["b"].breaker.record_failure(anyio.current_time() - 2.0)
    assert backend.pick_replica().name == "b"
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("asked", "retry_after_s"), [(None, 1.0), ("-5", 0.0), ("inf", 1.0)])
async def test_a_429_asks_for_a_wait_that_is_a_finite_number_of_seconds_not_below_0(asked, retry_after_s):
    """A 429's `Overloaded` asks 1 s where Retry-After says no finite number, and never less than 0 s."""
    headers = {} if asked is None else {"retry-after": asked}
    backend = _backend([httpx2.Response(429, headers=headers, json={})], [], retry_attempts=1)
    with pytest.raises(Overloaded) as info:
        await collect_stream(backend.stream_chat(BODY))
    assert info.value.retry_after_s == retry_after_s
    await backend.aclose()


@pytest.mark.anyio
async def test_the_backoff_adds_up_to_the_initial_delay_of_jitter(monkeypatch):
    """Each backoff adds a random wait of up to `retry_initial_s` (here drawn at its top)."""
    import random

    monkeypatch.setattr(random, "random", lambda: 1.0)
    backend = _backend([httpx2.Response(500, json={}), _ok()], [], retry_attempts=2, retry_initial_s=1.0)
    began = anyio.current_time()
    await collect_stream(backend.stream_chat(BODY))
    assert anyio.current_time() - began == pytest.approx(2.0)
    await backend.aclose()


@pytest.mark.anyio
async def test_a_422_answer_or_event_is_an_invalid_request():
    """A 422, answered or reported in the stream, is an `InvalidRequest` and is not retried."""
    for answer in (httpx2.Response(422, json={"message": "bad field"}), _event_stream(_error_event(422, "bad field"))):
        backend = _backend([answer], seen := [])
        with pytest.raises(InvalidRequest, match="422"):
            await collect_stream(backend.stream_chat(BODY))
        assert len(seen) == 1
        await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("error", "said"),
    [
        (httpx2.ConnectTimeout("timed out"), r"no connection within the connect timeout \(5 s\)"),
        (httpx2.WriteTimeout("timed out"), r"the call could not be sent within the timeout .*: the server does not read"),
    ],
)
async def test_a_timeout_before_the_call_went_out_says_which(error, said):
    """A connect or write timeout is named as such, not as a replica that took the call and went silent."""

    def failing(base_url: str, api_key: str) -> AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            raise error

        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    backend = VLLMServerBackend("http://vllm.invalid:8000", retry_attempts=1, client_factory=failing)
    with pytest.raises(BackendUnavailable, match=rf"^cannot reach vLLM replica r0 \(http://vllm.invalid:8000\): {said}"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: real time
@pytest.mark.anyio
async def test_a_port_nothing_listens_on_is_named_a_refused_connection(anyio_backend):
    """A replica whose port nothing listens on is named as a refused connection, with its URL."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    backend = VLLMServerBackend(url, retry_attempts=1)
    with pytest.raises(BackendUnavailable, match=rf"^cannot reach vLLM replica r0 \({url}\): connection refused \(no server listens there\)"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_the_body_is_read_to_its_end_after_done(anyio_backend):
    """The body is read to its end after [DONE], so that the connection is kept for the next call."""
    read_to_end: list[bool] = []

    async def body():
        yield OK_STREAM
        read_to_end.append(True)

    backend = _backend([httpx2.Response(200, content=body(), headers={"content-type": "text/event-stream"})], [])
    await collect_stream(backend.stream_chat(BODY))
    assert read_to_end == [True]
    await backend.aclose()


@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_leaving_a_stream_early_closes_the_response(anyio_backend):
    """Leaving the iteration after a chunk closes the HTTP response (vLLM aborts the request on disconnect)."""
    closed: list[bool] = []

    class Held(httpx2.AsyncByteStream):
        async def __aiter__(self):
            yield ROLE_CHUNK
            await anyio.sleep(3600)

        async def aclose(self) -> None:
            closed.append(True)

    backend = _backend([httpx2.Response(200, stream=Held(), headers={"content-type": "text/event-stream"})], [])
    async with contextlib.aclosing(backend.stream_chat(BODY)) as chunks:
        async for _ in chunks:
            break
    assert closed and backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@pytest.mark.anyio
async def test_a_503_event_mid_stream_leaves_the_breaker_closed():
    """A 503 reported in the stream after its first chunk (the replica is busy) does not count against the breaker."""
    backend = _backend([_event_stream(ROLE_CHUNK, _error_event(503, "overloaded"))], [], breaker_failures=1)
    with pytest.raises(BackendUnavailable, match="overloaded"):
        await collect_stream(backend.stream_chat(BODY))
    assert backend.replicas["r0"].breaker.consecutive_failures == 0
    await backend.aclose()


@pytest.mark.anyio
async def test_a_stream_without_usage_ends_with_an_estimated_one():
    """A stream that sends no usage ends with a usage chunk estimated from the body and the chunks with choices."""
    from fleetsched.backends.base import estimate_prompt_tokens

    no_usage = httpx2.Response(200, content=OK_STREAM.replace(OK_STREAM.split(b"\n\n")[2] + b"\n\n", b""), headers={"content-type": "text/event-stream"})
    backend = _backend([no_usage], [])
    chunks = [c async for c in backend.stream_chat(BODY)]
    assert chunks[-1]["usage"] == {"prompt_tokens": estimate_prompt_tokens(BODY), "completion_tokens": 1, "total_tokens": estimate_prompt_tokens(BODY) + 1}
    await backend.aclose()


@pytest.mark.anyio
async def test_the_caller_s_stream_options_go_out_with_usage_switched_on():
    """The caller's `stream_options` are sent, with `include_usage` on even where the caller turned it off."""
    backend = _backend([_ok()], seen := [])
    await collect_stream(backend.stream_chat({**BODY, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}))
    assert seen[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    await backend.aclose()


def _fleet(answers: dict[str, list[httpx2.Response | Exception]], **options) -> tuple[VLLMServerBackend, dict[str, int]]:
    """A backend over mock replicas named as `answers`, each answering its calls in turn (an
    exception is raised, as a transport's); with the count of calls each was sent."""
    sent = dict.fromkeys(answers, 0)

    def factory(base_url: str, api_key: str) -> AsyncOpenAI:
        name = base_url.split("//")[1].split(".")[0]

        def handler(request: httpx2.Request) -> httpx2.Response:
            sent[name] += 1
            answer = answers[name].pop(0) if len(answers[name]) > 1 else answers[name][0]
            if isinstance(answer, Exception):
                raise answer
            return answer

        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    options = {"retry_attempts": 3, "retry_initial_s": 1.0, **options}
    return VLLMServerBackend({name: f"http://{name}.invalid:8000" for name in answers}, client_factory=factory, http_client=http, **options), sent


@pytest.mark.anyio
async def test_a_call_routed_by_load_leaves_an_unreachable_replica_at_once():
    """A call routed by load goes from a replica it cannot reach to another at once, without retrying it."""
    backend, sent = _fleet({"a": [httpx2.ConnectError("connection refused")], "b": [_ok()]})
    response, _ = await collect_stream(backend.stream_chat(BODY))
    assert response["choices"][0]["message"]["content"] == "hi" and sent == {"a": 1, "b": 1}
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_that_every_replica_fails_names_each_of_them():
    """With every replica down, a call routed by load (`fleetsched run`'s probe call, say) said
    "cannot reach vLLM replica b" alone, as if a were up; and a session's call, falling back from
    its replica a, named b alone too. Now each failure is named, in the order they came."""
    from fleetsched.scheduler import Dispatcher

    backend, sent = _fleet({name: [httpx2.ConnectError("connection refused") for _ in range(6)] for name in "ab"})
    every = r"cannot reach vLLM replica a \(http://a.invalid:8000\): connection refused.*; cannot reach vLLM replica b \(.*\): connection refused"
    with pytest.raises(BackendUnavailable, match=rf"^no vLLM replica could take the call: {every}"):
        await collect_stream(backend.stream_chat(BODY))
    with pytest.raises(BackendUnavailable, match=r"^cannot reach vLLM replica a .*; falling back to another replica: cannot reach vLLM replica b"):
        await Dispatcher(backend, window=4).chat(BODY, tenant="t", tier=1, replica="a")
    assert sent == {"a": 2, "b": 6}  # a left at once each time, b (the last) given its 3 attempts
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_named_to_a_replica_does_not_fail_over():
    """A call named to a replica that fails it is failed, not sent to another replica."""
    backend, sent = _fleet({"a": [httpx2.Response(500, json={})], "b": [_ok()]}, retry_attempts=1)
    with pytest.raises(BackendUnavailable, match="replica a .*failed with 500"):
        await collect_stream(backend.stream_chat({**BODY, REPLICA_KEY: "a"}))
    assert sent == {"a": 1, "b": 0}
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_refused_for_its_body_does_not_fail_over():
    """A call that its replica refuses with a 400 is not sent to another replica."""
    backend, sent = _fleet({"a": [httpx2.Response(400, json={})], "b": [_ok()]})
    with pytest.raises(InvalidRequest):
        await collect_stream(backend.stream_chat(BODY))
    assert sent == {"a": 1, "b": 0}
    await backend.aclose()


@pytest.mark.anyio
async def test_a_call_falling_back_from_a_replica_never_fails_over_to_it():
    """A call that avoids a replica (falling back from it) and fails on another is not sent to the avoided one."""
    backend, sent = _fleet({"a": [_ok()], "b": [httpx2.Response(500, json={})]}, retry_attempts=1)
    with pytest.raises(BackendUnavailable, match="replica b .*failed with 500"):
        await collect_stream(backend.stream_chat({**BODY, AVOID_KEY: "a"}))
    assert sent == {"a": 0, "b": 1}
    await backend.aclose()


@pytest.mark.anyio
async def test_signals_warn_once_about_a_replica_not_on_the_priority_policy(caplog):
    """`signals` reads each replica's policy from /server_info once and warns about one that is not priority."""
    policies = {"a": "FCFS", "b": "priority"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_gauges("1"))
        return httpx.Response(200, json={"vllm_config": {"scheduler_config": {"policy": policies[request.url.host.split(".")[0]]}}})

    backend = VLLMServerBackend({name: f"http://{name}.invalid" for name in policies}, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with caplog.at_level("WARNING", logger="fleetsched.backends.vllm_server"):
        await backend.signals()
        await backend.signals()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["vLLM replica a"]
    assert "runs the 'fcfs' scheduling policy" in caplog.text
    assert await backend.scheduling_policy("b") == "priority"
    await backend.aclose()


@pytest.mark.anyio
async def test_an_entered_backend_checks_the_policy_in_its_own_task(caplog):
    """vLLM makes its first /server_info answer for seconds (it gathers the host's environment:
    8 s on the CPU server). Checked at the first `signals` poll, the poll waited for it, holding
    the adaptive window still, and a run on a fixed window (no poll at all) was never warned.
    Entered, the backend checks at once, in a task of its own."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            await anyio.sleep(8.0)
            return httpx.Response(200, json={"vllm_config": {"scheduler_config": {"policy": "fcfs"}}})
        return httpx.Response(200, text=_gauges("3"))

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    with caplog.at_level("WARNING", logger="fleetsched.backends.vllm_server"):
        async with VLLMServerBackend("http://a.invalid", http_client=http) as backend:
            began = anyio.current_time()
            assert (await backend.signals()).waiting == 3
            assert anyio.current_time() == began  # the poll did not wait for the check
            await anyio.sleep(10.0)  # no poll meanwhile
            assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["vLLM replica r0"]
            assert "runs the 'fcfs' scheduling policy" in caplog.text
            await backend.signals()
    assert len(caplog.records) == 1


@pytest.mark.anyio
async def test_signals_fail_when_no_replica_answers_its_metrics():
    """`signals` raises `BackendUnavailable` when every replica answers /metrics with an error status."""
    backend = _scraped({"a": 503, "b": 500})
    with pytest.raises(BackendUnavailable, match="no vLLM replica answered /metrics"):
        await backend.signals()
    await backend.aclose()


@pytest.mark.anyio
async def test_a_replica_whose_metrics_cannot_be_read_is_warned_about_once(caplog):
    """A /metrics that never answers (a proxy in front of vLLM that does not pass it on) leaves the
    adaptive window without the replica's signals: that was said at debug level only, at every
    poll, and the window held where it was with no word. Now a warning, once per replica."""
    pages: dict[str, str | int] = {"a": 404, "b": "<html>sign in</html>"}
    backend = _scraped(pages)
    with caplog.at_level("DEBUG", logger="fleetsched.backends.vllm_server"):
        for _ in range(3):
            with pytest.raises(BackendUnavailable):
                await backend.signals()
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("vLLM replica a (http://a.invalid): cannot read its /metrics (it answered 404 Not Found)")
    assert "vLLM replica b (http://b.invalid): cannot read its /metrics (not a Prometheus text page" in warnings[1]
    assert all("\n" not in w and "adaptive window" in w for w in warnings)
    await backend.aclose()


@pytest.mark.anyio
async def test_a_metrics_page_that_trickles_in_is_given_up_within_the_timeout(caplog):
    """The client's timeout bounds each read, not the page: a /metrics that came a byte at a
    time (a choked proxy) held the poll of every replica's signals, and the adaptive window with
    it, for as long as it trickled (hours, for a page of vLLM's size)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow.invalid":
            await anyio.sleep(3600)  # each byte within the read timeout, the page never whole
        return httpx.Response(200, text=_gauges("4"))

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    backend = VLLMServerBackend({"slow": "http://slow.invalid", "b": "http://b.invalid"}, http_client=http)
    began = anyio.current_time()
    with caplog.at_level("WARNING", logger="fleetsched.backends.vllm_server"):
        signals = await backend.signals()
    assert signals.waiting == 4 and anyio.current_time() - began <= 5.0
    assert "vLLM replica slow (http://slow.invalid): cannot read its /metrics (no answer within the timeout)" in caplog.text
    await backend.aclose()


@pytest.mark.anyio
async def test_a_replica_restarted_with_another_kv_cache_is_warned_about(caplog):
    """The memory pool of `[resources.kv_cache]` is sized from the caches read at the start. A
    server restarted with a smaller cache (another VLLM_CPU_KVCACHE_SPACE, --num-gpu-blocks-override
    96 then 32 on the CPU build) went on being admitted to as before, without a word, and
    preempted. (Served by a mock: a real server's restart takes minutes here.)"""

    def page(blocks: int) -> str:
        info = f'vllm:cache_config_info{{block_size="64",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
        return _gauges("0") + "# TYPE vllm:cache_config_info gauge\n" + info

    pages: dict[str, str | int] = {"a": page(96)}
    backend = _scraped(pages)
    assert (await backend.kv_capacities())["a"].tokens == 6144
    with caplog.at_level("WARNING", logger="fleetsched.backends.vllm_server"):
        await backend.signals()
        assert not caplog.records  # the same cache
        pages["a"] = page(32)
        for _ in range(3):
            await backend.signals()
    assert len(caplog.records) == 1, caplog.text
    message = caplog.records[0].getMessage()
    assert message.startswith("vLLM replica a (http://a.invalid) now reports a KV cache of 2,048 tokens (32 blocks of 64)")
    assert "not the 6,144 tokens (96 blocks of 64) the memory pool was sized from" in message
    assert message.endswith("a scheduler sized from the caches (resources.kv_cache) admits to it as to the smaller cache")
    assert backend.kv_capacities_seen()["a"].num_gpu_blocks == 32  # what the scheduler limits its device to
    await backend.aclose()


@pytest.mark.anyio
async def test_a_counter_missing_from_a_page_keeps_its_last_reading():
    """A counter absent from a replica's page counts with the replica's last reading of it."""
    pages: dict[str, str | int] = {"a": _gauges("0", preemptions="7")}
    backend = _scraped(pages)
    assert (await backend.signals()).preemptions_total == 7
    pages["a"] = _gauges("2").split("# TYPE vllm:num_preemptions")[0]
    signals = await backend.signals()
    assert signals.waiting == 2 and signals.preemptions_total == 7
    await backend.aclose()


def test_token_and_finished_counts_are_summed_over_engines():
    """Prompt, generation and finished counts are summed over a page's engines."""
    page = parse_vllm_metrics(
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 10.0\n'
        'vllm:prompt_tokens_total{engine="1",model_name="tiny"} 5.0\n'
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 7.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="tiny"} 1.0\n'
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0\n'
        'vllm:request_success_total{engine="1",finished_reason="stop",model_name="tiny"} 3.0\n'
    )
    assert (page.prompt_tokens_total, page.generation_tokens_total, page.finished) == (15.0, 8.0, {"stop": 5.0})


def test_merged_kv_cache_usage_is_the_mean_over_replicas():
    """The KV cache usage merged over replicas is the mean of theirs."""
    low, high = (parse_vllm_metrics(f'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{engine="0"}} {v}\n').signals for v in (0.25, 0.75))
    assert merge_signals([low, high]).kv_cache_usage == 0.5


@pytest.mark.parametrize("count", ["true", "-1", "1.5"])
@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_a_usage_count_that_is_no_count_of_tokens_is_named(count, anyio_backend):
    """A usage count that is a boolean, negative or fractional fails the call, naming it."""
    usage = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":%s}}\n\n' % count.encode()
    backend = _backend([_event_stream(ROLE_CHUNK, usage)], [], retry_attempts=1)
    with pytest.raises(BackendError, match=f"sent a usage whose completion_tokens is not a count: {count.title() if count == 'true' else count}"):
        await collect_stream(backend.stream_chat(BODY))
    await backend.aclose()


@pytest.mark.anyio
async def test_a_consumer_cancelled_at_a_chunk_gets_no_further_chunk():
    """A consumer cancelled while handling a chunk gets no further chunk, even from an answer already buffered."""
    backend = _backend([_ok()], [])
    got = []
    with anyio.CancelScope() as scope:
        async for chunk in backend.stream_chat(BODY):
            got.append(chunk)
            scope.cancel()
    assert len(got) == 1 and backend.replicas["r0"].in_flight == 0
    await backend.aclose()


@VIRTUAL_ASYNCIO
@pytest.mark.anyio
async def test_a_call_that_fails_before_its_first_chunk_closes_its_response(anyio_backend):
    """A call failed by an error event before its first chunk closes the HTTP response at once."""
    closed: list[bool] = []

    class Held(httpx2.AsyncByteStream):
        async def __aiter__(self):
            yield _error_event(400, "bad tool parser")
            await anyio.sleep(3600)

        async def aclose(self) -> None:
            closed.append(True)

    backend = _backend([httpx2.Response(200, stream=Held(), headers={"content-type": "text/event-stream"})], [])
    with pytest.raises(InvalidRequest):
        await collect_stream(backend.stream_chat(BODY))
    assert closed
    await backend.aclose()


def test_a_policy_label_is_read_in_lower_case():
    """A policy label on an ``*_info`` series is reported in lower case."""
    page = parse_vllm_metrics('# TYPE vllm:scheduler_config_info gauge\nvllm:scheduler_config_info{scheduling_policy="PRIORITY"} 1.0\n')
    assert page.scheduling_policy == "priority"


def test_a_finished_count_without_its_reason_is_left_out():
    """A ``request_success`` sample without a ``finished_reason`` label is left out of the finished counts."""
    page = parse_vllm_metrics('# TYPE vllm:request_success counter\nvllm:request_success_total{model_name="tiny"} 3.0\n')
    assert page.finished == {}


@pytest.mark.anyio
async def test_start_up_reads_that_trickle_in_are_given_up_within_their_timeouts(caplog):
    """The client's timeout bounds each read, not the answer: a server (or a proxy in front of
    it) that sent its answers a byte at a time held `fleetsched run`'s start, waiting for the
    model's name (/v1/models) or the KV caches (/metrics), for as long as they trickled, with
    nothing on the screen; so did the policy check and a 5xx's /health."""

    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(3600)  # each byte within the read timeout, the answer never whole
        return httpx.Response(200, text="")

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    backend = VLLMServerBackend("http://slow.invalid:8000", model=None, http_client=http)
    began = anyio.current_time()
    with caplog.at_level("WARNING", logger="fleetsched.backends.vllm_server"):
        async with backend:
            assert backend.model == "fleetsched-tiny" and anyio.current_time() - began <= 5.0
            began = anyio.current_time()
            with pytest.raises(BackendUnavailable, match=r"^vLLM replica r0 \(http://slow.invalid:8000\): cannot read its KV cache: /metrics did not answer whole within 5 s$"):
                await backend.kv_capacities()
            assert anyio.current_time() - began <= 5.0
            began = anyio.current_time()
            assert not await backend._healthy(backend.pick_replica("r0"))
            assert anyio.current_time() - began <= 2.0
            began = anyio.current_time()
            backend.pick_replica("r0").policy_checked = False
            assert await backend.scheduling_policy("r0") is None
            assert anyio.current_time() - began <= 5.0 + 30.0
    assert "no vLLM replica listed its model (r0 (http://slow.invalid:8000): /v1/models did not answer whole within 5 s)" in caplog.text
    await http.aclose()


@pytest.mark.anyio
async def test_the_model_s_context_is_the_smallest_its_replicas_list():
    """`max_model_len`: a session's calls may go to any replica, so the context every call fits
    is the smallest listed for the model; a replica that does not answer, or lists another
    model, says nothing. (Two servers of different contexts, served by a mock.)"""

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host.removesuffix(".invalid")
        if host == "down":
            raise httpx.ConnectError("connection refused")
        listed = {"wide": [("tiny", 4096)], "narrow": [("other", 512), ("tiny", 2048)]}[host]
        return httpx.Response(200, json={"object": "list", "data": [{"id": i, "max_model_len": n} for i, n in listed]})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    urls = {name: f"http://{name}.invalid" for name in ("wide", "narrow", "down")}
    backend, alone = (VLLMServerBackend(u, model="tiny", http_client=http) for u in (urls, {"down": urls["down"]}))
    assert await backend.max_model_len() == 2048
    assert await alone.max_model_len() is None
    await backend.aclose()
    await alone.aclose()


def test_a_transport_error_whose_causes_lead_back_to_it_is_still_reported():
    """An exception chain may lead back into itself (an exception raised ``from`` one that was
    raised while handling it); the reason of such a transport error was sought down the chain
    forever, and the call hung in its error report, holding the event loop."""
    refused = httpx2.ConnectError("connection refused")
    try:
        raise OSError("the socket closed") from None  # Python sets its context: nothing
    except OSError as socket_error:
        socket_error.__context__ = refused
        refused.__cause__ = socket_error
    backend, _ = _fleet({"a": [refused]}, retry_attempts=1)
    failures: list[BaseException] = []

    def call() -> None:
        async def main() -> None:
            with pytest.raises(BackendUnavailable) as failure:
                await collect_stream(backend.stream_chat(BODY))
            failures.append(failure.value)
            await backend.aclose()

        anyio.run(main)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the failed call's error report never ended"
    assert re.search(r"cannot reach vLLM replica a \(http://a.invalid:8000\): the socket closed$", str(failures[0]))
