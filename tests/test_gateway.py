"""The gateway over a real socket (uvicorn in a thread), the real openai SDK as the client."""

from __future__ import annotations

import gc
import json
import math
import re
import threading
import time
import warnings
from collections.abc import AsyncIterator
from unittest.mock import ANY

import anyio
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from prometheus_client.parser import text_string_to_metric_families
from trio.testing import MockClock

from fleetsched.backends.base import Backend, ChatBody, Chunk, make_chunk, usage_dict
from fleetsched.backends.instant import InstantBackend
from fleetsched.errors import BackendError, Overloaded, RateLimited
from fleetsched.gateway.app import Gateway, _answer_for, duration_text
from fleetsched.gateway.auth import KeyRing, hash_key
from fleetsched.gateway.server import serve_in_thread
from fleetsched.scheduler.records import CANCELLED
from fleetsched.settings import Settings
from fleetsched.virtual_time import VirtualTimeLoop

ACME, GLOBEX, ADMIN = "fs-acme-key", "fs-globex-key", "fs-admin-key"
MSG = [{"role": "user", "content": "hi"}]


def gateway_settings(tenants: dict | None = None, **sections) -> Settings:
    tenants = tenants or {
        "acme": {"api_keys": [hash_key(ACME)], "tier": "critical"},
        "globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 3},
    }
    sections.setdefault("backend", {"kind": "instant"})
    if sections["backend"].get("kind") == "sim":  # it serves the model the tests' calls name, as vLLM serves one
        sections["backend"] = {"model": "m", **sections["backend"]}
    sections.setdefault("resources", {"strategy": "counting", "devices": [{"name": "gpu0", "memory": "80GB"}]})
    gateway = {"admin_api_keys": [hash_key(ADMIN)], "max_context_tokens": 1000, **sections.pop("gateway", {})}
    return Settings(tenants=tenants, gateway=gateway, **sections)


@pytest.fixture(scope="module")
def gateway():
    with serve_in_thread(gateway_settings()) as (gw, url):
        yield gw, url


@pytest.fixture
def url(gateway):
    return gateway[1]


def client(url: str, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_sync_sdk_chat_and_streaming(url):
    c = client(url)
    reply = c.chat.completions.create(model="m", messages=MSG, max_tokens=4)
    assert reply.choices[0].message.content == "ok" and reply.usage.completion_tokens == 4
    # Streamed as OpenAI streams: no usage unless asked for (the usual `chunk.choices[0]` loop
    # broke on a last chunk of usage alone, sent to every client), then a last chunk with it.
    chunks = list(c.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "ok"
    assert all(ch.usage is None for ch in chunks)
    options = {"include_usage": True}
    chunks = list(c.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True, stream_options=options))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(ch.usage is None for ch in chunks[:-1])


def test_continuous_usage_reaches_a_client_that_asks_for_it(url):
    # vLLM's continuous_usage_stats: the count on every chunk. On the instant backend the client
    # that asked got it on the last chunk alone (the backend sent none on the answer's chunk).
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client(url).chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True, stream_options=options))
    assert chunks[0].choices[0].delta.content == "ok" and chunks[0].usage.completion_tokens == 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_sync_sdk_completions(url):
    c = client(url)
    reply = c.completions.create(model="m", prompt="Once upon", max_tokens=2)
    assert reply.object == "text_completion" and reply.choices[0].text == "ok" and reply.usage.completion_tokens == 2
    chunks = list(c.completions.create(model="m", prompt="Once upon", max_tokens=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "ok" and all(ch.usage is None for ch in chunks)
    chunks = list(c.completions.create(model="m", prompt="Once upon", max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.total_tokens > 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_async_sdk_streaming(url, anyio_backend):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=ACME, max_retries=0) as c:
        stream = await c.chat.completions.create(model="m", messages=MSG, max_tokens=5, stream=True, stream_options={"include_usage": True})
        parts = [ch async for ch in stream]
        reply = await c.completions.create(model="m", prompt="x", max_tokens=1)
    assert parts[0].choices[0].delta.content == "ok" and parts[-1].usage.completion_tokens == 5
    assert reply.usage.completion_tokens == 1


def test_models_and_health(url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client(url).models.list()] == ["fleetsched-tiny"]
    # The SDK's models.retrieve got "no such endpoint: /v1/models/fleetsched-tiny", a 404.
    assert client(url).models.retrieve("fleetsched-tiny").id == "fleetsched-tiny"
    # With the model's context, as vLLM lists it (gateway.max_context_tokens here).
    listed = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {ACME}"}).json()["data"][0]
    assert listed["max_model_len"] == 1000 and client(url).models.retrieve("fleetsched-tiny").max_model_len == 1000
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist: this gateway serves `fleetsched-tiny`"):
        client(url).models.retrieve("gpt-4o")
    head = httpx.head(url + "/health")
    assert head.status_code == 200 and head.content == b""


def test_a_method_not_allowed_says_which_are(url):
    """RFC 9110: a 405 names the methods allowed (it had no Allow header)."""
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/models", "GET, HEAD")):
        response = httpx.request(method, url + path)
        assert response.status_code == 405 and response.headers["allow"] == allowed
        assert response.json()["error"]["type"] == "method_not_allowed"


def test_missing_and_wrong_key_get_401_openai_style(url):
    response = httpx.post(url + "/v1/chat/completions", json={"messages": MSG})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(url, "fs-wrong").chat.completions.create(model="m", messages=MSG)
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": "Basic " + ACME}).status_code == 401


def test_key_decides_tenant_and_metrics_show_only_own(url):
    client(url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=1)
    client(url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
    mine = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ACME}"}).text
    assert 'tenant="acme"' in mine and "globex" not in mine and 'tenant=""' not in mine
    theirs = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {GLOBEX}"}).text
    assert 'tenant="globex"' in theirs and "acme" not in theirs
    everything = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert 'tenant="acme"' in everything and 'tenant="globex"' in everything
    assert "fleetsched_dispatcher_in_flight" in everything and "fleetsched_dispatcher" not in mine
    # Every family of the admin's page typed: the scheduler's were bare lines, "unknown" to Prometheus.
    types = {f.name: f.type for f in text_string_to_metric_families(everything)}
    assert "unknown" not in types.values(), types
    assert types["fleetsched_dispatcher_shed"] == "counter" and types["fleetsched_gateway_sessions"] == "gauge"
    # The admin key names no tenant: it makes no model calls.
    assert httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 403


def test_a_key_is_found_without_a_pass_over_every_stored_key():
    """A request's key is looked up by its digest: compared with every stored hash, each request
    cost time in the number of keys (0.6 ms a request with 2,000 tenants, on the event loop)."""
    tenants = {f"t{i}": {"api_keys": [hash_key(f"fs-key-{i}")]} for i in range(500)}
    ring = KeyRing(gateway_settings(tenants).tenants)
    read = []

    class Counted(tuple):
        def __iter__(self):
            for entry in tuple.__iter__(self):
                read.append(entry)
                yield entry

    ring._entries = Counted(ring._entries)
    assert ring.identify("fs-key-250").tenant == "t250" and ring.identify("fs-key-x") is None
    assert len(ring) == 500
    assert read == []  # no stored key was read one by one


def test_keys_are_compared_hashed():
    ring = KeyRing(gateway_settings().tenants)
    assert ring.identify(ACME).tenant == "acme" and ring.identify(GLOBEX).tenant == "globex"
    assert ring.identify(ACME + "x") is None and ring.identify("") is None
    with pytest.raises(ValueError, match="hashed"):
        gateway_settings({"a": {"api_keys": [ACME]}})


def test_rate_limited_429_with_retry_after():
    # A tokens_per_minute beside it, never short: the 429 named both limits, joined by "or".
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2, "tokens_per_minute": 100_000}})
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        for _ in range(2):
            c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as caught:
            c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
    assert caught.value.status_code == 429 and int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.body["message"] == "tenant 'globex' is over its requests_per_minute (2)"
    assert caught.value.code == "rate_limit_exceeded"  # OpenAI's code for it (it was the status, 429)


def test_answers_carry_openais_rate_limit_headers():
    """Every answer after the tenant's limits are taken carries OpenAI's x-ratelimit-* headers
    (LiteLLM-style proxies pass them on; clients pace themselves by them): 200s, streams and
    429s alike. A tenant without limits gets none."""
    s = gateway_settings(
        {
            "globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2, "tokens_per_minute": 1000},
            "acme": {"api_keys": [hash_key(ACME)]},
        }
    )
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        first = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=100)
        h = first.headers
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "1")
        assert h["x-ratelimit-reset-requests"] in ("30s", "29.999s")  # one request at 2 a minute
        tokens_left = int(h["x-ratelimit-remaining-tokens"])  # 1,000 less the prompt and max_tokens
        assert h["x-ratelimit-limit-tokens"] == "1000" and 880 <= tokens_left <= 900
        assert h["x-ratelimit-reset-tokens"].endswith("s") and 6 <= float(h["x-ratelimit-reset-tokens"][:-1]) <= 7.3
        with c.chat.completions.with_streaming_response.create(model="m", messages=MSG, max_tokens=1, stream=True) as streamed:
            assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as caught:
            c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        refused = caught.value.response.headers
        assert refused["x-ratelimit-remaining-requests"] == "0" and "retry-after" in refused
        plain = client(url, ACME).chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=1)
        assert not [name for name in plain.headers if name.startswith("x-ratelimit")]


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_refusal_s_rate_limit_headers_count_what_it_gave_back(anyio_backend):
    """A call refused as invalid after its limits were taken gets its request and tokens back,
    and its x-ratelimit-* headers say so: a 404 for an unknown model read remaining-requests 0
    (the level before its refund) while the next call was served, so a client pacing itself by
    the headers waited for nothing. A 200's headers still show its charge up front."""
    tenants = {"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2, "tokens_per_minute": 1000}}
    gateway = Gateway(gateway_settings(tenants, backend={"kind": "sim"}))
    headers = {"authorization": f"Bearer {GLOBEX}"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        served = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10})
        assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "1"
        tokens_left = int(served.headers["x-ratelimit-remaining-tokens"])
        refused = await c.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MSG, "max_tokens": 10})
        assert refused.status_code == 404, refused.text
        assert refused.headers["x-ratelimit-remaining-requests"] == "1"
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) >= tokens_left
        again = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10})
        assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "0"


def test_reset_times_are_written_as_openai_writes_them():
    cases = {0: "0s", -1: "0s", 0.25: "250ms", 0.0004: "1ms", 6: "6s", 1.5: "1.5s", 90.5: "1m30.5s", 60: "1m0s", 3600: "1h0m0s"}
    assert {s: duration_text(s) for s in cases} == cases


def test_a_429_says_when_one_call_asks_more_than_a_minutes_tokens():
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 100}})
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        c.chat.completions.create(model="m", messages=MSG, max_tokens=150)  # a full bucket lets it through
        with pytest.raises(openai.RateLimitError) as caught:
            c.chat.completions.create(model="m", messages=MSG, max_tokens=150)
    assert "tokens_per_minute (100)" in caught.value.message and "more than a minute's" in caught.value.message


def test_a_429_names_the_limit_that_keeps_the_call_out():
    """A tenant with both limits, short of tokens: the 429 named both, joined by "or" (and, short
    of requests, `test_rate_limited_429_with_retry_after`)."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 100, "tokens_per_minute": 100}})
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        c.chat.completions.create(model="m", messages=MSG, max_tokens=90)  # uses 20 of the 94 it was charged
        with pytest.raises(openai.RateLimitError) as caught:
            c.chat.completions.create(model="m", messages=MSG, max_tokens=90)  # 94 asked, about 80 left
    message = caught.value.body["message"]
    assert message.startswith("tenant 'globex' is over its tokens_per_minute (100): this call asks")
    assert "requests_per_minute" not in message and "are left" in message


def test_shed_is_503_with_retry_after():
    answer = _answer_for(Overloaded("batch call shed", retry_after_s=7.2))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "8"  # rounded up: not before the wait


def test_a_wait_without_end_says_retry_after_a_day():
    # A tokens_per_minute of 1e-300 made the wait infinite: a 500 (OverflowError in ceil).
    for wait in (float("inf"), float("nan"), 1e300):
        answer = _answer_for(RateLimited("over its tokens_per_minute", retry_after_s=wait))
        assert answer.status_code == 429 and answer.headers["retry-after"] == "86400"


def test_a_stray_prompt_beside_the_messages_does_not_make_a_chat_call_cheap():
    # A chat body is counted by its messages: with "prompt": "x" beside 900 tokens of them, it
    # was counted 1 token, and a tenant passed its tokens_per_minute eight times over.
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 1000}})
    long = [{"role": "user", "content": "x" * 3600}]
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        c.chat.completions.create(model="m", messages=long, max_tokens=1, extra_body={"prompt": "x"})
        with pytest.raises(openai.RateLimitError) as caught:
            c.chat.completions.create(model="m", messages=long, max_tokens=1, extra_body={"prompt": "x"})
    assert "this call asks 905 tokens" in caught.value.message




def test_a_stray_messages_field_does_not_make_a_text_completion_cheap():
    # A completions body with "messages" beside its prompt was counted by the messages: a
    # 2,500-token prompt with a one-word message passed the context check (1,000 tokens here)
    # and was charged 4 tokens against the tenant's tokens per minute. The field is dropped, as
    # vLLM's completions endpoint ignores it.
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 1000}})
    stray = [{"role": "user", "content": "hi"}]
    with serve_in_thread(s) as (_, url):
        c = client(url, GLOBEX)
        with pytest.raises(openai.BadRequestError) as too_long:
            c.completions.create(model="m", prompt="word " * 2000, max_tokens=4, extra_body={"messages": stray})
        c.completions.create(model="m", prompt="x" * 3600, max_tokens=1, extra_body={"messages": stray})
        with pytest.raises(openai.RateLimitError) as caught:
            c.completions.create(model="m", prompt="x" * 3600, max_tokens=1, extra_body={"messages": stray})
    assert too_long.value.body["code"] == "context_length_exceeded" and too_long.value.body["param"] == "prompt"
    assert "this call asks 901 tokens" in caught.value.message


def test_a_call_refused_as_invalid_does_not_use_up_a_request_per_minute():
    """A 400 after the limits were taken (a session that can never run; a field only the engine
    checks) used up one of the tenant's requests per minute: two of them locked a tenant of 2 a
    minute out for up to a minute, though the gateway gave back their tokens."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "requests_per_minute": 2, "session_memory": "100GB"}}
    headers = {"authorization": f"Bearer {ACME}"}
    with serve_in_thread(gateway_settings(tenants, backend={"kind": "sim"})) as (_, url):
        for i in range(2):
            never = httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers={**headers, "x-session-id": f"s{i}"})
            assert never.status_code == 400 and "largest device holds" in never.text
            refused = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "stream_interval": 0}, headers=headers)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_interval"
        for status in (200, 200, 429):  # and the limit still holds
            assert httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=headers).status_code == status

@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_sampling_parameter_vllm_refuses_is_a_400_before_the_rate_limits(anyio_backend):
    """A top_k, min_p or repetition_penalty vLLM refuses was left to the engine, after the rate
    limits were taken: a tenant at its limit got 429 for it, waited out its Retry-After, and only
    then learnt of the field. A top_k of 0 (none) is vLLM's default: taken."""
    tenants = {"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 1, "tokens_per_minute": 1000}}
    gateway = Gateway(gateway_settings(tenants, backend={"kind": "sim"}))
    headers = {"authorization": f"Bearer {GLOBEX}"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        served = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10})
        assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "0"
        bad = [("top_k", -5), ("top_k", 1.5), ("top_k", "x"), ("min_p", 2), ("repetition_penalty", 0), ("min_tokens", 11)]
        for endpoint, body in [("chat/completions", {"messages": MSG}), ("completions", {"prompt": "hi"})]:
            for field, value in bad:
                refused = await c.post(f"/v1/{endpoint}", json={"model": "m", **body, "max_tokens": 10, field: value})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (endpoint, field, refused.text)
        limited = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10, "top_k": 0})
        assert limited.status_code == 429, limited.text


def test_a_refusal_gives_its_request_back_before_its_answer_reaches_the_client():
    """The request a refused call gave back was returned after its answer had gone out: a
    client that made its next call at once was refused with 429 for it, now and then (2 and 3
    in 40 with an unknown model and a field the engine refuses, 1 a minute). With the shared
    state taking 0.3 s to answer (a far Redis), every next call was refused."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 1}}, backend={"kind": "sim"})
    headers = {"authorization": f"Bearer {GLOBEX}"}
    with serve_in_thread(s) as (gw, url):
        refund = gw.state.refund

        async def slow_refund(*args, **kwargs):
            await anyio.sleep(0.3)
            await refund(*args, **kwargs)

        gw.state.refund = slow_refund
        with httpx.Client(base_url=url, headers=headers) as c:
            for bad in ({"model": "nope"}, {"top_k": "x"}, {"model": "nope", "stream": True}):
                refused = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, **bad})
                assert refused.status_code in (400, 404), refused.text
            assert c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}).status_code == 200


class CharTokenizer(InstantBackend):
    """Counts a prompt a token a character, as a real tokenizer counts Chinese text: four times
    what the gateway's estimate (four characters a token) says before the call."""

    name = "char-tokenizer"

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        async for chunk in super().stream_chat(body):
            if chunk.get("usage"):
                characters = sum(len(m["content"]) for m in body["messages"])
                chunk = {**chunk, "usage": usage_dict(characters, chunk["usage"]["completion_tokens"])}
            yield chunk


def test_a_prompt_longer_than_its_estimate_is_charged_in_full():
    """1,200 characters of Chinese, estimated 304 tokens, counted 1,200 by the engine: the
    tenant's 1,000 tokens a minute are spent (before: charged 305, three such calls a minute
    went through)."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 1000}})
    chinese = [{"role": "user", "content": "你好" * 600}]
    with serve_in_thread(s, backend=CharTokenizer(completion_tokens=1)) as (_, url):
        c = client(url, GLOBEX)
        reply = c.chat.completions.create(model="m", messages=chinese, max_tokens=1)
        assert reply.usage.prompt_tokens == 1200
        with pytest.raises(openai.RateLimitError, match="this call asks 305 tokens"):
            c.chat.completions.create(model="m", messages=chinese, max_tokens=1)

def test_too_large_400_names_the_limit(url):
    """Refused as vLLM 0.32 refuses: a prompt that fills the context, or a max_tokens over it;
    a max_tokens the prompt leaves no room for is the engine's to cut (it was refused here)."""
    cases = [("x" * 4000, "max_tokens", 10, "messages"), ("x" * 40, "max_tokens", 1001, "max_tokens")]
    cases += [("x" * 40, "max_completion_tokens", 1001, "max_completion_tokens")]  # named as sent (it read max_tokens)
    for content, field, max_tokens, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": content}], **{field: max_tokens})
        error = caught.value.body
        assert error["code"] == "context_length_exceeded" and "1000" in error["message"] and error["param"] == param
        assert param != "messages" or "max_tokens" not in error["message"]
        assert param == "messages" or error["message"].startswith(f"{param}=1001 ")
    reply = client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 3000}], max_tokens=500)
    assert reply.choices


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": 5, "content": "x"}]}', "messages.0.role"),
        (b'{"messages": [{"content": "x"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n"),
        # Every call reaches vLLM streamed, where it refuses them speaking of a stream=True the
        # client never sent (the sim ignored them).
        (b'{"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}', "prompt_logprobs"),
        # Fields that need another (vLLM's ChatCompletionRequest validators): the gateway served them.
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -2}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}', "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "tool_choice": "always"}', "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": []}', "tools"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools.0.function"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "code", "function": {"name": "f"}}]}', "tools.0.type"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}], "tool_choice": "auto"}', "tools.0.function.name"),
        # A named tool_choice must name one of the tools (vLLM's check_tool_usage): the gateway served these.
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "search"}}], "tool_choice": {"type": "function", "function": {"name": "fetch"}}}', "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "search"}}], "tool_choice": {"type": "function"}}', "tool_choice.function"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "search"}}], "tool_choice": {"type": "function", "function": {"name": ""}}}', "tool_choice.function.name"),
        # vLLM refuses a top_p of 0 (its range is (0, 1]); the gateway took it for a valid one.
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
        # stream_options' flags are booleans (vLLM's StreamOptions): a string or a number was
        # taken by its truthiness ("no" asked for usage on every chunk) on the sim, a 400 without
        # the field's name from vLLM.
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"continuous_usage_stats": 3}}', "stream_options.continuous_usage_stats"),
        # Options of a stream for a call that is not one: vLLM and OpenAI refuse them (it was served).
        (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}', "stream_options"),
        # vLLM answers a structured_outputs that is no object with a 500, which opened the
        # replica's circuit breaker for every tenant (test_a_tenant_s_bad_structured_outputs_...).
        (b'{"messages": [{"role": "user", "content": "x"}], "structured_outputs": true}', "structured_outputs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "structured_outputs": ["yes", "no"]}', "structured_outputs"),
        (b"\xff\xfe", None),
        # Unpaired surrogates: the echoed model broke the answer (a cut stream, an ERROR log).
        (b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "x"}], "stream": true}', "model"),
        (b'{"messages": [{"role": "user", "content": "x\\udc00"}]}', "messages.0.content"),
        ('{"messages": [{"role": "user", "content": "x"}], "model": "m\\ud800"}'.encode("utf-16"), "model"),
    ],
)
def test_malformed_bodies_are_400(url, body, param):
    response = httpx.post(url + "/v1/chat/completions", content=body, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_every_answer_names_its_request(url):
    """`x-request-id` on every answer, as OpenAI's API sends it (the SDK shows it as
    `request_id`, on errors too): the client's own where it sent one, else the gateway's. It
    had none, and the gateway's logs named no call."""
    c = client(url)
    raw = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=1)
    assert re.fullmatch("req_[0-9a-f]{32}", raw.request_id or ""), raw.headers
    raw = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=1, stream=True, extra_headers={"X-Request-Id": "trace:7"})
    assert raw.request_id == "trace:7"
    with pytest.raises(openai.AuthenticationError) as refused:
        client(url, key="nope").chat.completions.create(model="m", messages=MSG, max_tokens=1, extra_headers={"X-Request-Id": "t1"})
    assert refused.value.request_id == "t1"
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model="m", messages=MSG, max_tokens=1, extra_headers={"X-Request-Id": "no spaces"})
    assert refused.value.body["param"] == "X-Request-Id" and refused.value.request_id.startswith("req_")
    assert httpx.get(url + "/v1/nothing").headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("kind", ["instant", "sim"])
def test_an_answer_is_named_after_its_request_on_every_backend(kind):
    """The answer's id is ``chatcmpl-`` and its request ID (``cmpl-`` for a text completion), as
    vLLM names it: on the sim and the instant backends it was a number that started again at 1
    with each process (``chatcmpl-fs1``)."""
    with serve_in_thread(gateway_settings(backend={"kind": kind})) as (_, url):
        c = client(url)
        raw = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=2)
        assert raw.parse().id == f"chatcmpl-{raw.request_id}"
        named = {"X-Request-Id": "trace:7"}
        chunks = c.chat.completions.create(model="m", messages=MSG, max_tokens=2, stream=True, extra_headers=named)
        assert {chunk.id for chunk in chunks} == {"chatcmpl-trace:7"}
        assert c.completions.create(model="m", prompt="once", max_tokens=2, extra_headers=named).id == "cmpl-trace:7"


@pytest.mark.parametrize("kind", ["instant", "sim"])
def test_a_text_prompt_is_counted_without_a_chat_template(kind):
    """vLLM's ``/v1/completions`` counts the prompt's tokens alone (no chat template), and so do
    the sim and instant backends now: they counted the prompt as a chat message, with its role's
    framing (104 tokens for 400 characters, where the estimate and the chat call say 100 and 104)."""
    with serve_in_thread(gateway_settings(backend={"kind": kind})) as (_, url):
        c = client(url)
        text = "y" * 400
        assert c.completions.create(model="m", prompt=text, max_tokens=2).usage.prompt_tokens == 100
        assert c.completions.create(model="m", prompt=[text], max_tokens=2).usage.prompt_tokens == 100
        chunks = list(c.completions.create(model="m", prompt=text, max_tokens=2, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens == 100
        chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2)
        assert chat.usage.prompt_tokens == 104
        # A chat call's tools beside a text prompt: vLLM's completions ignore them (the sim forced a call).
        tools = [{"type": "function", "function": {"name": "search"}}]
        answer = c.completions.create(model="m", prompt=text, max_tokens=2, extra_body={"tools": tools, "tool_choice": "required"})
        assert answer.choices[0].finish_reason != "tool_calls" and answer.choices[0].text


def test_a_key_or_session_header_sent_twice_is_refused(url):
    # The last one won: "bad key, then good key" was served, "good, then bad" a 401.
    chat = {"messages": MSG, "max_tokens": 1}
    for name, values in [("Authorization", ["Bearer nope", f"Bearer {ACME}"]), ("X-Session-ID", ["a", "b"]), ("X-Request-Id", ["a", "b"])]:
        headers = [("authorization", f"Bearer {ACME}")] if name != "Authorization" else []
        headers += [(name, value) for value in values]
        response = httpx.post(url + "/v1/chat/completions", json=chat, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name and "sent more than once" in response.json()["error"]["message"]


def test_a_refusal_of_the_engine_names_the_field_as_the_gateways_own_do():
    # The sim's refusals came with "param": null and "code": 400, the gateway's with the field.
    s = gateway_settings(backend={"kind": "sim"})
    with serve_in_thread(s) as (_, url):
        headers = {"authorization": f"Bearer {ACME}"}
        for extra, param in [({"stream_interval": 0}, "stream_interval"), ({"min_tokens": 9, "max_tokens": 2}, "min_tokens")]:
            response = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, **extra}, headers=headers)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (param, "invalid_request_error", "invalid_request_error")
        # A prompt of token ids was refused as "exactly one prompt per request".
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3]}, headers=headers)
        assert response.status_code == 400 and "prompts of token ids are not served" in response.json()["error"]["message"]


def test_a_bare_string_content_part_is_served_as_text(url):
    """vLLM takes a plain string among a message's content parts as text; the gateway refused it
    (400 on messages.0.content). A number among them is still refused."""
    text = "y" * 400
    for content in (text, [text[:100], {"type": "text", "text": text[100:]}]):
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}"})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == 104
    bad = {"model": "m", "messages": [{"role": "user", "content": ["x", 5]}]}
    response = httpx.post(url + "/v1/chat/completions", json=bad, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.content"


def test_a_tool_choice_naming_one_of_the_tools_is_served(url):
    tools = [{"type": "function", "function": {"name": "search"}}, {"type": "function", "function": {"name": "fetch"}}]
    choice = {"type": "function", "function": {"name": "fetch"}}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tools": tools, "tool_choice": choice}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 200, response.text


def test_a_surrogate_pair_is_text_and_served(url):
    body = b'{"model": "m\\ud83d\\ude00", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    response = httpx.post(url + "/v1/chat/completions", content=body, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 200 and response.json()["model"] == "m\U0001f600"


def test_body_over_the_limit_is_413():
    with serve_in_thread(gateway_settings(gateway={"max_body_bytes": 1000})) as (_, url):
        response = httpx.post(url + "/v1/completions", content=b" " * 2000, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 413 and "max_body_bytes" in response.json()["error"]["message"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]) | _json, "content": _json})
_fields = {
    "model": _json,
    "messages": st.lists(_message | _json, max_size=3) | _json,
    "prompt": st.text(max_size=30) | _json,
    "max_tokens": st.integers(-5, 5000) | _json,
    "max_completion_tokens": _json,
    "stream": st.booleans() | _json,
    "stream_options": _json,
    "temperature": st.floats() | _json,
    "n": _json,
    "stop": _json,
    "tools": _json,
    "seed": _json,
    "priority": _json,
    "fleetsched_replica": _json,
    "fleetsched_fallback": _json,
}
_bodies = st.fixed_dictionaries({}, optional=_fields) | _json


@hsettings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), session=st.none() | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=8))
def test_fuzzed_request_bodies_never_get_a_500(url, body, path, session):
    headers = {"authorization": f"Bearer {ACME}", "content-type": "application/json"}
    if session is not None:
        headers["x-session-id"] = session
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    response = httpx.post(url + path, content=content, headers=headers, timeout=10)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert "message" in response.json()["error"]


class SlowBackend(Backend):
    """Streams one chunk, then waits; records whether the call was aborted."""

    name = "slow"

    def __init__(self, wait_s: float = 30) -> None:
        self.started = 0
        self.aborted = 0
        self.wait_s = wait_s

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        self.started += 1
        try:
            yield make_chunk("chatcmpl-slow", "m", 0, role="assistant", content="a")
            await anyio.sleep(self.wait_s)
            yield make_chunk("chatcmpl-slow", "m", 0, finish_reason="stop", usage=usage_dict(1, 1))
        except BaseException:
            self.aborted += 1
            raise


class BrokenBackend(Backend):
    """Streams one chunk, then fails with an error that is not one of fleetsched's (a bug of a
    backend, say): the one failure no real backend here can be made to produce."""

    name = "broken"

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        yield make_chunk("chatcmpl-broken", "m", 0, role="assistant", content="a")
        raise RuntimeError("the backend broke mid-stream")


@pytest.mark.parametrize("case", ["refused by the engine", "abandoned, not streamed"])
def test_tokens_per_minute_come_back_from_a_call_refused_or_abandoned(case):
    """A budget of 1,000 tokens a minute; the first call asks for 800 and is refused by the engine
    (400) or left by its client before the answer: the second, as large, still fits (before: 429,
    only a streamed call left early got its tokens back)."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tokens_per_minute": 1000}}
    refused = case == "refused by the engine"
    s = gateway_settings(tenants, backend={"kind": "sim"}) if refused else gateway_settings(tenants)
    with serve_in_thread(s, **({} if refused else {"backend": SlowBackend()})) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        if refused:
            bad = {"messages": MSG, "max_tokens": 800, "stream_interval": 0}  # the sim engine refuses it
            assert httpx.post(url + "/v1/chat/completions", json=bad, headers=headers).status_code == 400
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 800}, headers=headers, timeout=0.5)
            assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        again = {"messages": MSG, "max_tokens": 800, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=again, headers=headers) as r:
            assert r.status_code == 200


def test_a_stream_that_fails_mid_way_with_any_error_ends_with_an_error_event(caplog):
    """Before: only fleetsched's own errors were turned into the last event; any other left the
    response unfinished (the client saw a cut connection, uvicorn logged an ERROR)."""
    with serve_in_thread(gateway_settings(), backend=BrokenBackend()) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": MSG, "stream": True}, headers=headers) as r:
            events = [line for line in r.iter_lines() if line]
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
    # As vLLM ends a stream that fails: the error event, then [DONE] (before: no [DONE]).
    assert r.status_code == 200 and len(events) == 3 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "internal_error"
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]


def test_a_stream_that_fails_mid_way_is_counted_as_a_stream_error_not_a_success():
    """Its 200 was sent, so requests_total says 200; the failure is counted in
    stream_errors_total, and the histogram of successful calls leaves it out (before: counted
    as a success, nothing said it failed)."""
    with serve_in_thread(gateway_settings(), backend=BrokenBackend()) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": MSG, "stream": True}, headers=headers) as r:
            list(r.iter_lines())
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        text = httpx.get(url + "/metrics", headers=headers).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    errors = [s for s in families["fleetsched_gateway_stream_errors"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in errors] == [({"tenant": "acme", "endpoint": "chat"}, 1.0)]
    requests = [s for s in families["fleetsched_gateway_requests"].samples if s.name.endswith("_total")]
    assert [(s.labels["code"], s.value) for s in requests] == [("200", 1.0)]
    assert "fleetsched_gateway_request_seconds" not in families or not families["fleetsched_gateway_request_seconds"].samples


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_client_disconnect_aborts_the_call():
    backend = SlowBackend()
    with serve_in_thread(gateway_settings(), backend=backend) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": MSG, "stream": True}, headers=headers) as r:
            assert next(r.iter_lines()).startswith("data: ")
        assert _wait_for(lambda: backend.aborted == 1)
        # Not streamed: the client gives up waiting, the call is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers=headers, timeout=0.5)
        assert _wait_for(lambda: backend.aborted == 2)
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        # Counted as nginx counts them, 499 (client closed request): the stream cut counted as a
        # 200 served, the call given up not at all.
        text = httpx.get(url + "/metrics", headers=headers).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = [s for s in families["fleetsched_gateway_requests"].samples if s.name.endswith("_total")]
    assert [(s.labels["code"], s.value) for s in requests] == [("499", 2.0)]
    assert "fleetsched_gateway_request_seconds" not in families or not families["fleetsched_gateway_request_seconds"].samples


def test_sessions_group_calls_and_are_admitted_as_sessions():
    """One session slot, tools kept: a second session waits until the first one expires."""
    s = gateway_settings(scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 0.5})
    with serve_in_thread(s) as (gw, url):
        a = client(url).with_options(default_headers={"X-Session-ID": "agent-a"})
        b = client(url, GLOBEX).with_options(default_headers={"X-Session-ID": "agent-a"})  # same id, other tenant
        a.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        a.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        stats = gw.scheduler.statistics()
        assert stats.running_total == 1 and len(gw.sessions) == 1
        start = time.monotonic()
        b.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert time.monotonic() - start >= 0.3  # waited for agent-a of acme to expire
        assert _wait_for(lambda: len(gw.sessions) == 0, 3)


def test_a_client_ends_its_session_and_frees_its_slot_at_once():
    """DELETE /v1/sessions/{id}: one slot, tools kept, 60 s idle. Session "a" ends at its
    client's word, so "b" is admitted at once (before: "b" waited for "a" to idle out); a later
    call of "a" starts a new session. Another tenant's key, an unknown id, the admin key and a
    malformed id are refused."""
    s = gateway_settings(scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 60})
    with serve_in_thread(s) as (gw, url):
        a = client(url).with_options(default_headers={"X-Session-ID": "agent/a"})
        a.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert gw.scheduler.statistics().running_total == 1

        def delete(session: str, key: str = ACME) -> httpx.Response:
            return httpx.delete(f"{url}/v1/sessions/{session}", headers={"authorization": f"Bearer {key}"}, timeout=10)

        assert delete("agent/a", GLOBEX).status_code == 404  # the same id of another tenant: none
        assert delete("nobody").status_code == 404
        assert delete("agent/a", ADMIN).status_code == 403
        assert delete("bad id").status_code == 400
        answer = delete("agent/a")
        assert answer.status_code == 200 and answer.json() == {"id": "agent/a", "object": "session", "deleted": True}
        assert delete("agent/a").status_code == 404  # ended: nothing left to end
        start = time.monotonic()
        b = client(url).with_options(default_headers={"X-Session-ID": "b"})
        b.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert time.monotonic() - start < 5  # not the 60 s "a" would have held the slot idle
        assert _wait_for(lambda: gw.scheduler.statistics().finished.get("cancelled", 0) == 1, 3)
        assert delete("b").status_code == 200
        a.chat.completions.create(model="m", messages=MSG, max_tokens=1)  # a new session of the id
        assert _wait_for(lambda: len(gw.sessions) == 1 and gw.scheduler.statistics().running_total == 1, 3)


def test_a_session_ended_while_its_call_waits_for_admission_is_closed_by_a_shutdown():
    """One slot, held by idle session "a"; "b"'s first call waits for admission when its client
    ends "b"; then the server shuts down. The call gets the shutdown's 503, as calls waiting
    for admission do (before: the ended session was out of the gateway's table, so the shutdown
    missed it, and "b" was admitted and served once "a" was gone)."""
    import threading

    s = gateway_settings(scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 60})
    headers = {"authorization": f"Bearer {ACME}"}
    answers: list[httpx.Response] = []
    with serve_in_thread(s) as (gw, url):

        def call(session: str) -> httpx.Response:
            body = {"messages": MSG, "max_tokens": 1}
            return httpx.post(url + "/v1/chat/completions", json=body, headers={**headers, "x-session-id": session}, timeout=30)

        assert call("a").status_code == 200
        waiting = threading.Thread(target=lambda: answers.append(call("b")))
        waiting.start()
        assert _wait_for(lambda: gw.scheduler.statistics().queued_total == 1)
        assert httpx.delete(url + "/v1/sessions/b", headers=headers).status_code == 200
        assert len(gw.sessions) == 2  # "b" still counts: it has a call to serve
    waiting.join(10)
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]


def test_sessions_released_during_client_time():
    """Tools released: between its calls a session lends its slot to another session."""
    s = gateway_settings(scheduler={"max_sessions": 1, "tool_policy": "release"}, gateway={"session_idle_s": 30})
    with serve_in_thread(s) as (gw, url):
        a = client(url).with_options(default_headers={"X-Session-ID": "a"})
        b = client(url).with_options(default_headers={"X-Session-ID": "b"})
        start = time.monotonic()
        for _ in range(3):
            a.chat.completions.create(model="m", messages=MSG, max_tokens=1)
            b.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert time.monotonic() - start < 5
        assert len(gw.sessions) == 2
        handles = gw.scheduler.running_sessions()
        # A call is counted once its answer is sent, so the client may see it a moment before.
        assert _wait_for(lambda: sorted(h.counters.calls for h in handles) == [3, 3], 3)
        assert all(h.parked_count >= 2 for h in handles)


def test_a_new_session_whose_client_gave_up_before_admission_is_not_kept():
    """One slot, held by session "a" until it idles out. Session "b"'s only call gives up while it
    waits for admission: "b" is dropped, so "c" is admitted when "a" expires (before: "b" was
    admitted then with no client, and held the slot for another idle period)."""
    s = gateway_settings(scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 2})
    with serve_in_thread(s) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}

        def call(session: str, timeout: float) -> httpx.Response:
            body = {"messages": MSG, "max_tokens": 1}
            return httpx.post(url + "/v1/chat/completions", json=body, headers={**headers, "x-session-id": session}, timeout=timeout)

        start = time.monotonic()
        assert call("a", 10).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            call("b", 0.5)
        assert _wait_for(lambda: len(gw.sessions) == 1 and gw.scheduler.statistics().queued_total == 0)
        assert call("c", 10).status_code == 200
        assert time.monotonic() - start < 3.5  # "a" expired at about 2 s; a kept "b" would hold until 4


def test_shutdown_answers_calls_waiting_for_admission_at_once():
    """Both slots held by idle sessions (tools kept, 60 s idle), a third session's call waits
    for admission, the server shuts down: that call gets a 503 and the server stops at once
    (before: the shutdown waited for an idle session to expire, 60 s here, 300 by default)."""
    import threading

    s = gateway_settings(scheduler={"max_sessions": 2, "tool_policy": "keep"}, gateway={"session_idle_s": 60})
    headers = {"authorization": f"Bearer {ACME}"}
    answers: list[httpx.Response] = []
    with serve_in_thread(s) as (gw, url):

        def call(session: str) -> httpx.Response:
            body = {"messages": MSG, "max_tokens": 1}
            return httpx.post(url + "/v1/chat/completions", json=body, headers={**headers, "x-session-id": session}, timeout=30)

        assert call("s1").status_code == 200 and call("s2").status_code == 200
        waiting = threading.Thread(target=lambda: answers.append(call("s3")))
        waiting.start()
        assert _wait_for(lambda: gw.scheduler.statistics().queued_total == 1)
        start = time.monotonic()
    waiting.join(10)
    assert time.monotonic() - start < 5
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]


class HoldingBackend(InstantBackend):
    """Answers at once, but a call whose last message says "hold" waits `wait_s` first."""

    name = "holding"

    def __init__(self, wait_s: float) -> None:
        super().__init__(completion_tokens=1)
        self.wait_s = wait_s

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        if body["messages"][-1]["content"] == "hold":
            await anyio.sleep(self.wait_s)
        async for chunk in super().stream_chat(body):
            yield chunk


@pytest.mark.parametrize("end", ["deadline", "shutdown"])
def test_a_session_call_waiting_for_re_admission_is_answered_when_its_session_ends(end):
    """One slot, tools released. Session "a" (deadline 1.5 s) made a call and lent its slot
    while its client was away; "b"'s slow call holds the slot when "a"'s next call comes, so
    it waits for re-admission. Then "a" passes its deadline, or the server shuts down: the call
    gets its 408 at the deadline, or the shutdown's 503 (before: no answer ever: its agent had
    taken the call's turn from the queue, and a session's end released only the turns still
    queued; the call waited for its client to give up, and held the shutdown as long)."""
    import threading

    sla = {"deadline_s": 1.5} if end == "deadline" else {}
    tenants = {"a": {"api_keys": [hash_key(ACME)], "sla": sla}, "b": {"api_keys": [hash_key(GLOBEX)]}}
    s = gateway_settings(tenants, scheduler={"max_sessions": 1, "tool_policy": "release"}, gateway={"session_idle_s": 60})
    answers: dict[str, httpx.Response | Exception] = {}

    def call(name: str, key: str, content: str = "hi") -> None:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        headers = {"authorization": f"Bearer {key}", "x-session-id": name}
        try:
            answers[name] = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        except Exception as exc:  # the client gave up: no answer came
            answers[name] = exc

    with serve_in_thread(s, backend=HoldingBackend(wait_s=4)) as (gw, url):
        call("a", ACME)
        assert answers.pop("a").status_code == 200
        holder = threading.Thread(target=call, args=("b", GLOBEX, "hold"))
        holder.start()
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 1)
        waiting = threading.Thread(target=call, args=("a", ACME))
        waiting.start()
        assert _wait_for(lambda: gw.scheduler.statistics().queued_total == 1)
        start = time.monotonic()
        if end == "deadline":
            waiting.join(10)
            assert time.monotonic() - start < 3  # at a's deadline, not after b's call (4 s) nor never
            assert _wait_for(lambda: len(gw.sessions) == 1)  # "b" alone
    waiting.join(10)
    holder.join(10)
    answer = answers["a"]
    assert isinstance(answer, httpx.Response), answer
    if end == "deadline":
        assert answer.status_code == 408
    else:
        assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
        assert answers["b"].status_code == 200  # the call under way finished


def test_a_session_past_its_deadline_ends_its_call_and_refuses_its_id():
    """Tenant deadline 1 s; each call streams one chunk, then waits 30 s (before: a call under
    way ran past the deadline to its end, and the next call of the id silently began a new
    session)."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 1}}}
    with serve_in_thread(gateway_settings(tenants), backend=SlowBackend()) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}

        def post(session: str, **body) -> httpx.Response:
            return httpx.post(
                url + "/v1/chat/completions", json={"messages": MSG, **body}, headers={**headers, "x-session-id": session}, timeout=10
            )

        start = time.monotonic()
        late = post("s1")
        assert late.status_code == 408 and "passed its deadline during this call" in late.json()["error"]["message"]
        assert time.monotonic() - start < 5
        refused = post("s1")
        assert refused.status_code == 408 and "needs a new X-Session-ID" in refused.json()["error"]["message"]
        # A retry cannot succeed: the SDK, which retries a 408 twice by default (each retry one of
        # the tenant's requests, and the first message lost), is told not to.
        assert late.headers["x-should-retry"] == refused.headers["x-should-retry"] == "false"
        def answered_408() -> float:
            text = httpx.get(url + "/metrics", headers=headers).text
            return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("fleetsched_gateway_requests_total{") and 'code="408"' in line)

        before = answered_408()
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=ACME)  # the SDK's default retries (2)
        with pytest.raises(openai.APIStatusError, match="needs a new X-Session-ID") as refusal:
            sdk.chat.completions.create(model="m", messages=MSG, extra_headers={"x-session-id": "s1"})
        assert refusal.value.status_code == 408 and answered_408() == before + 1
        streamed = post("s2", stream=True)
        events = [line for line in streamed.text.splitlines() if line]
        assert streamed.status_code == 200 and json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 408
        assert events[-1] == "data: [DONE]"
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0 and len(gw.sessions) == 0)


def test_a_session_ended_by_its_client_leaves_no_deadline_mark_on_its_id():
    """Its client ends session "s1" while its call runs, then the call passes the tenant's 2 s
    deadline. A later call of "s1" starts a new session (before: the ended session, reaching its
    deadline, marked the id past it, and the new session's call got a 408)."""
    import threading

    tenants = {"acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 2}}}
    backend = SlowBackend()
    with serve_in_thread(gateway_settings(tenants), backend=backend) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}", "x-session-id": "s1"}
        answers: list[httpx.Response] = []

        def post() -> httpx.Response:
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers=headers, timeout=10)

        first = threading.Thread(target=lambda: answers.append(post()))
        first.start()
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 1)
        assert httpx.delete(url + "/v1/sessions/s1", headers=headers).status_code == 200
        backend.wait_s = 0  # the next calls answer at once
        first.join(10)
        assert answers[0].status_code == 408
        assert _wait_for(lambda: len(gw.sessions) == 0)  # the ended session is gone, at its deadline
        assert post().status_code == 200


def test_a_session_ended_by_its_client_while_queued_leaves_no_deadline_mark_on_its_id():
    """One slot, held by an idle session of globex. Acme's session "b" waits for admission when
    its client ends it; it then passes acme's 1 s deadline in the queue, and its call gets the
    408. Once the slot is free, a later call of "b" starts a new session (before: the session
    closed before its deadline refusal, which then marked the id, and the new call got a 408)."""
    import threading

    tenants = {
        "acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 1}},
        "globex": {"api_keys": [hash_key(GLOBEX)]},
    }
    s = gateway_settings(tenants, scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 60})
    with serve_in_thread(s) as (gw, url):

        def call(key: str, session: str) -> httpx.Response:
            headers = {"authorization": f"Bearer {key}", "x-session-id": session}
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=headers, timeout=30)

        def delete(key: str, session: str) -> int:
            return httpx.delete(f"{url}/v1/sessions/{session}", headers={"authorization": f"Bearer {key}"}, timeout=10).status_code

        assert call(GLOBEX, "hold").status_code == 200  # holds the only slot, idle
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(call(ACME, "b")))
        waiting.start()
        assert _wait_for(lambda: gw.scheduler.statistics().queued_total == 1)
        assert delete(ACME, "b") == 200
        waiting.join(10)
        assert answers[0].status_code == 408
        assert delete(GLOBEX, "hold") == 200
        assert call(ACME, "b").status_code == 200


def test_a_session_past_its_deadline_before_its_first_call_is_served_gets_a_408():
    """Tenant b's deadline is 1 s. Its session waits for admission behind the only slot (held by
    an idle session of a): a 408 at the deadline (before: no answer ever; the session failed in
    the queue, its agent never ran, and the call waited on it, and so did the id's later calls).
    Then, with a's slow call holding the window's only place, b's streamed call waits for the
    place: a 408 at the deadline too (before: sent to the engine past it, a 200)."""
    import threading

    tenants = {"a": {"api_keys": [hash_key(ACME)]}, "b": {"api_keys": [hash_key(GLOBEX)], "sla": {"deadline_s": 1}}}
    s = gateway_settings(tenants, scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 3})
    with serve_in_thread(s) as (gw, url):

        def post(key: str, session: str) -> httpx.Response:
            headers = {"authorization": f"Bearer {key}", "x-session-id": session}
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=headers, timeout=10)

        assert post(ACME, "holder").status_code == 200
        start = time.monotonic()
        late = post(GLOBEX, "late")
        assert late.status_code == 408 and "before its first call was served" in late.json()["error"]["message"]
        assert time.monotonic() - start < 2.5
        assert post(GLOBEX, "late").status_code == 408  # the id stays refused for an idle period
        assert _wait_for(lambda: len(gw.sessions) == 0)

    s = gateway_settings(tenants, backend={"kind": "instant", "max_in_flight": 1}, dispatch={"adaptive_window": False})
    with serve_in_thread(s, backend=SlowBackend(wait_s=3)) as (gw, url):
        hog = threading.Thread(
            target=lambda: httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers={"authorization": f"Bearer {ACME}"}, timeout=40)
        )
        hog.start()
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 1)
        start = time.monotonic()
        body = {"messages": MSG, "stream": True}
        waited = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {GLOBEX}", "x-session-id": "s"}, timeout=10)
        assert waited.status_code == 408 and time.monotonic() - start < 2.5
    hog.join(10)


def test_a_session_that_can_never_run_is_a_400_and_leaves_no_session_behind():
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "memory_quota": "1GB", "session_memory": "2GB"}}
    with serve_in_thread(gateway_settings(tenants)) as (gw, url):
        c = client(url).with_options(default_headers={"X-Session-ID": "big"})
        for _ in range(2):  # the second finds no half-made session in the table
            with pytest.raises(openai.BadRequestError, match="memory quota"):
                c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert len(gw.sessions) == 0 and not gw.scheduler.running_sessions()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_the_gateway_starts_and_stops_on_the_embedded_sim_backend(anyio_backend):
    # The sim backend runs its engine loop in a task group it enters in the gateway's task; the
    # gateway once entered it after the scheduler and never left it, and every shutdown failed
    # with "Attempted to exit a cancel scope that isn't the current task's current cancel scope".
    gateway = Gateway(gateway_settings(backend={"kind": "sim"}))
    async with gateway.running():
        response = await gateway.scheduler.dispatcher.chat({"messages": MSG, "max_tokens": 3}, tenant="acme", tier=0)
        assert response["usage"]["completion_tokens"] == 3
    assert gateway.scheduler is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_startup_failure_tells_the_server_why_in_one_line(anyio_backend, tmp_path):
    # Here: no vLLM in this environment for the in-process engine (a model directory that exists:
    # one that does not is said first). The message reached uvicorn wrapped in two ExceptionGroup reprs.
    gateway = Gateway(gateway_settings(backend={"kind": "vllm-engine", "engine_model_path": str(tmp_path)}))
    messages, sent = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}], []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await gateway({"type": "lifespan"}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed", "message": ANY}]
    assert sent[0]["message"].startswith("BackendUnavailable: backend kind 'vllm-engine' needs vLLM installed")


def test_a_tenant_named_empty_is_refused_its_label_is_the_unauthenticated_requests(tmp_path):
    """The gateway counts requests without a valid key under tenant="", and a tenant sees the
    series labelled with its name: a tenant named "" saw everyone's 401s as its own (and in a
    report or a table it had no name)."""
    from fleetsched.errors import ConfigError
    from fleetsched.settings import load_settings

    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.""]\ntier = "batch"\n')
    with pytest.raises(ConfigError, match=r"^tenants: a tenant's name must not be empty"):
        load_settings(config)


def _mock_replicas(names: tuple[str, ...] = ("dead", "live"), dead: frozenset[str] = frozenset({"dead"}), completions: dict[str, str] | None = None):
    """A vLLM server backend over replicas `names` served by a mock transport: each answers with
    its own name, and those in `dead` cannot be reached (a connection refused); a replica named
    in `completions` answers /v1/completions with that text as its event stream. By default a
    session is placed on "dead" (the least loaded, the first of a tie)."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    def events(*chunks: dict) -> bytes:
        return ("".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n").encode()

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        name = next(name for name in names if f"//{name}." in base_url)

        def handler(request: httpx2.Request) -> httpx2.Response:
            if name in dead:
                raise httpx2.ConnectError("connection refused")
            if name in (completions or {}) and not request.url.path.endswith("/chat/completions"):
                body = completions[name].encode()
            elif request.url.path.endswith("/chat/completions"):
                body = events(
                    make_chunk(f"chatcmpl-{name}", "m", 0, role="assistant", content=name),
                    make_chunk(f"chatcmpl-{name}", "m", 0, finish_reason="stop", usage=usage_dict(2, 1)),
                )
            else:
                body = events(
                    {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": name, "logprobs": None, "finish_reason": "stop"}]},
                    {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "m", "choices": [], "usage": usage_dict(2, 1)},
                )  # fmt: skip
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

        client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=client)

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    urls = {name: f"http://{name}.invalid:8000" for name in names}
    return VLLMServerBackend(urls, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)


def test_a_session_placed_on_a_dead_replica_fails_over_to_the_live_one():
    """Before: the gateway named the session's replica in the body, which the backend takes as the
    caller's choice (no failover), and the dispatcher saw no replicas behind the gateway's
    wrapper: every call of the session, streamed or not, got a 502 for as long as it went on
    calling (each call renewed its placement on the dead replica)."""
    with serve_in_thread(gateway_settings(), backend=_mock_replicas()) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}", "x-session-id": "placed-on-dead"}
        for stream in (True, False, True):
            response = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "stream": stream}, headers=headers, timeout=10)
            assert response.status_code == 200, response.text
            assert "live" in response.text and (response.text.endswith("data: [DONE]\n\n") if stream else True)
        assert gw.sessions is not None and len(gw.sessions) == 1
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)


def test_a_completions_stream_that_fails_is_answered_as_a_chat_stream_would_be():
    """/v1/completions on vLLM servers, whose events the SDK parses: a failure vLLM reports in
    its stream is translated by its code, as on the chat path (it was a 502 whatever the code,
    and a 5xx did not fall over to another replica), and an event that is not JSON is the
    server's fault, a 502 (it was a 400, the client's)."""

    def error_event(code: int) -> str:
        return f'data: {json.dumps({"error": {"message": "it failed", "type": "Error", "code": code}})}\n\ndata: [DONE]\n\n'

    headers = {"authorization": f"Bearer {ACME}"}
    for answer, status in ((error_event(400), 400), ("data: {oops\n\ndata: [DONE]\n\n", 502)):
        backend = _mock_replicas(("only",), dead=frozenset(), completions={"only": answer})
        with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
            plain = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=headers, timeout=10)
            assert plain.status_code == status, plain.text
            streamed = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, headers=headers, timeout=10)
            assert streamed.status_code in (200, status)
            error = json.loads(next(line for line in streamed.text.splitlines() if '"error"' in line).removeprefix("data: "))
            assert error["error"]["type"] == plain.json()["error"]["type"], (streamed.text, plain.text)
    # A 500 in the stream before any chunk: the call falls over to a replica that answers.
    backend = _mock_replicas(("failing", "live"), dead=frozenset(), completions={"failing": error_event(500)})
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        for stream in (False, True):
            response = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream}, headers=headers, timeout=10)
            assert response.status_code == 200 and "live" in response.text, response.text


def test_a_text_completion_cut_off_mid_answer_says_so():
    """A vLLM server killed while it streams a text completion: the error (a 502, or the error
    event of a stream under way) said "cannot reach vLLM replica r0" though the replica had
    answered, where a chat call's says it broke off the answer."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": None}]}  # fmt: skip

    class CutStream(httpx2.AsyncByteStream):
        async def __aiter__(self):
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body (incomplete chunked read)")

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            return httpx2.Response(200, stream=CutStream(), headers={"content-type": "text/event-stream"})

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    backend = VLLMServerBackend({"r0": "http://r0.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        headers = {"authorization": f"Bearer {ACME}"}
        plain = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=headers, timeout=10)
        streamed = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, headers=headers, timeout=10)
    assert plain.status_code == 502 and streamed.status_code == 200 and '"text":"Once"' in streamed.text
    event = json.loads(next(line for line in streamed.text.splitlines() if '"error"' in line).removeprefix("data: "))
    for message in (plain.json()["error"]["message"], event["error"]["message"]):
        assert message.startswith("vLLM replica r0 broke off the answer after 1 chunks: peer closed connection"), message


def test_a_text_completion_stream_read_as_the_chat_path_reads_one():
    """The SDK parsed /v1/completions' stream, which ends quietly where the body does: an answer
    cut short (a body delimited by the connection's close, as some proxies send it) passed as
    whole, a 200 with "finish_reason": "stop" made up for it, and a body of no event at all was
    "the backend returned no completion"; an event that is JSON but no object was a 500 with a
    bare AttributeError. They are said as the chat path says them."""
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": None}]}  # fmt: skip
    answers = {
        f"data: {json.dumps(chunk)}\n\n": "vLLM replica only broke off the answer after 1 chunks: the stream ended before its 'data: [DONE]'",
        "": "vLLM replica only answered the call, then broke off: the stream ended before its 'data: [DONE]'",
        "data: []\n\ndata: [DONE]\n\n": "vLLM replica only: sent an event that is not a JSON object: '[]'",
    }
    headers = {"authorization": f"Bearer {ACME}"}
    for answer, said in answers.items():
        backend = _mock_replicas(("only",), dead=frozenset(), completions={"only": answer})
        with serve_in_thread(gateway_settings(), backend=backend) as (gw, url):
            plain = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=headers, timeout=10)
            assert plain.status_code == 502 and plain.json()["error"]["message"] == said, plain.text
            streamed = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, headers=headers, timeout=10)
            error = next(line for line in streamed.text.splitlines() if '"error"' in line)
            assert json.loads(error.removeprefix("data: "))["error"]["message"] == said, streamed.text
            assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)


def test_a_refusal_vllm_reports_in_its_stream_keeps_the_field_it_names():
    """vLLM reports some refusals in a stream it began with 200 (a logit_bias token out of the
    vocabulary, top_logprobs over --max-logprobs: ``{"error": {..., "param": "logit_bias",
    "code": 400}}``), and every call reaches it streamed. The gateway's 400 had ``"param":
    null`` where vLLM's own answer to the call names the field."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    event = {"error": {"message": "token_id(s) [99999] in logit_bias contain out-of-vocab token ids.", "type": "BadRequestError", "param": "logit_bias", "code": 400}}

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            return httpx2.Response(200, content=f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode(), headers={"content-type": "text/event-stream"})

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    backend = VLLMServerBackend({"r": "http://r.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        for endpoint, body in (("chat/completions", {"messages": MSG}), ("completions", {"prompt": "Once"})):
            for stream in (False, True):
                call = {**body, "max_tokens": 1, "logit_bias": {"99999": 1}, "stream": stream}
                response = httpx.post(f"{url}/v1/{endpoint}", json=call, headers={"authorization": f"Bearer {ACME}"}, timeout=10)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "logit_bias", (endpoint, stream, response.text)


def test_a_session_calls_the_replica_its_memory_is_reserved_on():
    """Memory devices named after the replicas: a session's calls go to the replica that holds
    its reservation, as an in-process agent's do. Before, they went to the replica proposed when
    the session began (the least loaded: r0 on a tie), here one whose KV cache is too small for
    the session, so the engine there would have had to preempt to serve it."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "session_memory": "2GB"}}
    devices = [{"name": "r0", "memory": "1GB"}, {"name": "r1", "memory": "80GB"}]
    settings = gateway_settings(tenants, resources={"devices": devices})
    with serve_in_thread(settings, backend=_mock_replicas(("r0", "r1"), dead=frozenset())) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}", "x-session-id": "big"}
        for stream in (False, True):
            response = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "stream": stream}, headers=headers, timeout=10)
            assert response.status_code == 200, response.text
            assert "r1" in response.text and "r0" not in response.text


@pytest.mark.parametrize("session", [None, "placed-on-dead"])
def test_a_text_completion_fails_over_from_a_dead_replica_before_its_first_chunk(session):
    """Before: /v1/completions went to the least loaded replica with no failover, which with
    calls to spare was the dead one (ties go to the first, and its breaker never opened: these
    calls do not count against it), so every call got a 502; a session's call fell back from its
    dead replica to the least loaded one, the dead one again."""
    with serve_in_thread(gateway_settings(), backend=_mock_replicas()) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}", **({"x-session-id": session} if session else {})}
        for stream in (True, False):
            body = {"prompt": "Once upon", "stream": stream}
            response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=10)
            assert response.status_code == 200, response.text
            assert "live" in response.text
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        assert [r.in_flight for r in gw.backend.inner.replicas.values()] == [0, 0]


def test_a_text_completion_takes_logprobs_as_a_count(url):
    """In /v1/completions `logprobs` is how many log probabilities per token (an integer, vLLM's
    CompletionRequest and OpenAI's API); only chat's is true or false. The gateway refused every
    count with "logprobs: must be true or false", and let `true` through. As vLLM reads it, true
    is 1 and 2.0 is 2, and text is refused. -1 (all) is a count too: the engine refuses it for
    its limit (vLLM's default --max-logprobs, 20), not for its form."""
    headers = {"authorization": f"Bearer {ACME}"}
    for logprobs, status in ((2, 200), (0, 200), (-1, 400), (True, 200), (2.0, 200), (-2, 400), ("2", 400)):
        body = {"prompt": "Once upon", "max_tokens": 1, "logprobs": logprobs}
        response = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == status, (logprobs, response.text)
        if status == 400:
            assert response.json()["error"]["param"] == "logprobs"
            assert ("at most 20" in response.json()["error"]["message"]) == (logprobs == -1)
    chat = {"messages": MSG, "max_tokens": 1, "logprobs": 2}
    response = httpx.post(url + "/v1/chat/completions", json=chat, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "logprobs": True}, headers=headers).status_code == 200
    # Chat's flag is read as vLLM reads it: "yes" and 1 are true (the gateway refused them).
    for flag in ("yes", 1):
        assert httpx.post(url + "/v1/chat/completions", json={**chat, "logprobs": flag}, headers=headers).status_code == 200, flag


def test_the_instant_backend_answers_the_log_probabilities_a_call_asks_for(url):
    """The instant backend (for benchmarks) answered a call that asked for log probabilities
    with ``"logprobs": null``, chat and text completion, streamed and not: a workload that reads
    them failed on it alone. Now, as vLLM lays them out: an entry a token counted, the tokens
    joined the text, the alternatives asked for (the token first); over 20, refused as vLLM's
    default --max-logprobs refuses them, naming the field the client sent."""
    c = client(url)
    for stream in (False, True):
        if stream:
            options = {"include_usage": True}
            chunks = list(c.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2, stream=True, stream_options=options))
            content = [entry for ch in chunks if ch.choices and ch.choices[0].logprobs for entry in ch.choices[0].logprobs.content]
            text, tokens = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens
        else:
            reply = c.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2)
            content, text, tokens = reply.choices[0].logprobs.content, reply.choices[0].message.content, reply.usage.completion_tokens
        assert len(content) == tokens == 3 and "".join(e.token for e in content) == text == "ok", stream
        assert all(e.logprob <= 0 and [t.token for t in e.top_logprobs][0] == e.token and len(e.top_logprobs) == 2 for e in content)
        assert all(sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 for e in content)
    plain = c.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], [], []]
    assert c.chat.completions.create(model="m", messages=MSG, max_tokens=3).choices[0].logprobs is None  # not asked for
    text = c.completions.create(model="m", prompt="Once upon", max_tokens=3, logprobs=2).choices[0]
    assert text.logprobs.tokens == ["ok", "", ""] and text.logprobs.text_offset == [0, 2, 2]
    assert [list(top) for top in text.logprobs.top_logprobs] == [["ok", " t00"], ["", " t00"], ["", " t00"]]
    with pytest.raises(openai.BadRequestError, match="top_logprobs: at most 20") as chat_refused:
        c.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs: at most 20") as text_refused:
        c.completions.create(model="m", prompt="Once upon", max_tokens=3, logprobs=21)
    assert chat_refused.value.body["param"] == "top_logprobs" and text_refused.value.body["param"] == "logprobs"


def test_any_role_is_taken_as_vllm_takes_it(url):
    """vLLM's server takes a message of any role (its custom message type: Llama 3's "ipython"
    tool role, say), leaving it to the model's chat template; the gateway refused every role but
    six with a 400, so a client that worked against vLLM failed behind it."""
    headers = {"authorization": f"Bearer {ACME}"}
    for role in ("ipython", "wizard", ""):
        messages = [*MSG, {"role": role, "content": "42"}]
        response = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, headers=headers)
        assert response.status_code == 200, (role, response.text)


def test_a_malformed_session_id_does_not_use_up_a_request_of_the_rate_limit():
    """The X-Session-ID header was checked after the tenant's requests per minute were taken:
    every call refused for it (400) used one up, and with 2 a minute two of them left the
    tenant's good calls with 429 for a minute."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2}})
    with serve_in_thread(s) as (gw, url):
        headers = {"authorization": f"Bearer {GLOBEX}"}
        body = {"messages": MSG, "max_tokens": 1}
        for _ in range(2):
            bad = httpx.post(url + "/v1/chat/completions", json=body, headers={**headers, "x-session-id": "no spaces"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Session-ID"
        for session in ("s1", None):
            good = httpx.post(url + "/v1/chat/completions", json=body, headers={**headers, **({"x-session-id": session} if session else {})})
            assert good.status_code == 200, good.text
        assert gw.scheduler.dispatcher.statistics().in_flight == 0


def _vllm_with_logprobs():
    """A vLLM server backend on one mock replica that streams two tokens with their log
    probabilities, one a chunk, as vLLM streams them (chat and text completion)."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    chat_chunks = []
    for token, logprob in (("Hel", -0.5), ("lo", -0.25)):
        chunk = make_chunk("chatcmpl-lp", "m", 0, content=token)
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        chunk["choices"][0]["logprobs"] = {"content": [entry]}
        chat_chunks.append(chunk)
    chat_chunks.append(make_chunk("chatcmpl-lp", "m", 0, finish_reason="stop", usage=usage_dict(2, 2)))
    text_chunks = [
        {"id": "cmpl-lp", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": token, "finish_reason": None,
                      "logprobs": {"text_offset": [offset], "token_logprobs": [logprob], "tokens": [token], "top_logprobs": [{token: logprob}]}}]}
        for token, logprob, offset in (("Hel", -0.5, 0), ("lo", -0.25, 3))
    ] + [{"id": "cmpl-lp", "object": "text_completion", "created": 0, "model": "m", "choices": [], "usage": usage_dict(2, 2)}]  # fmt: skip

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            chunks = chat_chunks if request.url.path.endswith("/chat/completions") else text_chunks
            body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
            return httpx2.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

        client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=client)

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    return VLLMServerBackend({"r": "http://r.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)


def test_a_call_not_streamed_keeps_the_log_probabilities_vllm_streamed():
    """The gateway collects a call that is not streamed from the backend's stream: the log
    probabilities vLLM sends with each chunk were dropped, and a chat completion or a text
    completion asked for them answered "logprobs": null."""
    with serve_in_thread(gateway_settings(), backend=_vllm_with_logprobs()) as (_, url):
        c = client(url)
        reply = c.chat.completions.create(model="m", messages=MSG, max_tokens=2, logprobs=True)
        assert reply.choices[0].message.content == "Hello"
        assert [(t.token, t.logprob) for t in reply.choices[0].logprobs.content] == [("Hel", -0.5), ("lo", -0.25)]
        text = c.completions.create(model="m", prompt="Say", max_tokens=2, logprobs=1)
        assert text.choices[0].text == "Hello"
        logprobs = text.choices[0].logprobs
        assert logprobs.tokens == ["Hel", "lo"] and logprobs.token_logprobs == [-0.5, -0.25]
        assert logprobs.text_offset == [0, 3] and logprobs.top_logprobs == [{"Hel": -0.5}, {"lo": -0.25}]


def test_a_key_with_characters_beyond_ascii_is_recognised_as_sent():
    """`hash_key` hashes a key's UTF-8 bytes, but the header was read as latin-1 and its text
    hashed as UTF-8: a key with any character beyond ASCII ("clé") was hashed from other bytes
    than those sent, and its tenant got 401 whatever it did."""
    key = "fs-clé-ключ"
    ring = KeyRing({"acme": gateway_settings({"acme": {"api_keys": [hash_key(key)]}}).tenants["acme"]})
    assert ring.identify_header(b"Bearer " + key.encode()).tenant == "acme"
    assert ring.identify_header(b"Bearer " + key.encode("latin-1", "replace")) is None
    assert ring.identify_header(b"Bearer \xff\xfe") is None  # not UTF-8: no key, no error


def test_log_probabilities_of_a_text_completion_over_a_chat_backend():
    """On a backend without text completions (the sim) the gateway asks the chat call for the
    alternatives a text completion's `logprobs` counts, and lays them out as vLLM's completions
    do: tokens, their log probabilities, alternatives and offsets. The sim refuses more than 20,
    as vLLM does by default. Before, they were dropped (always null)."""
    headers = {"authorization": f"Bearer {ACME}"}
    with serve_in_thread(gateway_settings(backend={"kind": "sim"})) as (_, url):
        body = {"prompt": "Once upon", "max_tokens": 3, "logprobs": 2}
        whole = httpx.post(url + "/v1/completions", json=body, headers=headers)
        streamed = []
        with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, headers=headers) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed += [c["logprobs"] for c in json.loads(line[6:])["choices"] if c["logprobs"]]
        too_many = httpx.post(url + "/v1/completions", json=body | {"logprobs": 21}, headers=headers)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["tokens"]) == 3
    assert logprobs["text_offset"] == [0, 4, 8]
    assert all(len(top) == 2 and top[token] == lp for top, token, lp in zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"]))
    assert sum(len(part["tokens"]) for part in streamed) == 3
    assert [o for part in streamed for o in part["text_offset"]] == [0, 4, 8]
    # Named as the client sent it: it travels as chat's top_logprobs, which the refusal named.
    assert too_many.status_code == 400 and too_many.json()["error"]["message"].startswith("logprobs: at most 20")
    assert too_many.json()["error"]["param"] == "logprobs"


def test_streamed_usage_on_the_sim_follows_the_client_s_stream_options():
    """The engine counts usage on every chunk for the dispatcher (it charges tenants as tokens
    stream); the client sees it as it asked, as from vLLM: none, a last chunk of it, or the
    count so far on every chunk (vLLM's `continuous_usage_stats`). Every client got all of it."""
    with serve_in_thread(gateway_settings(backend={"kind": "sim"})) as (_, url):
        c = client(url)

        def stream(**options):
            return list(c.chat.completions.create(model="m", messages=MSG, max_tokens=6, stream=True, **options))

        plain = stream()
        last_only = stream(stream_options={"include_usage": True})
        continuous = stream(stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(ch.choices and ch.usage is None for ch in plain)
    assert [ch.usage is not None for ch in last_only] == [False] * (len(last_only) - 1) + [True]
    assert last_only[-1].usage.completion_tokens == 6
    counts = [ch.usage.completion_tokens for ch in continuous]
    assert len(counts) > 2 and counts == sorted(counts) and counts[-1] == 6


def test_a_client_that_stops_reading_its_stream_gives_its_place_back():
    """A client opens a long stream and reads none of it. Its call held its place in the
    dispatcher's window for as long as the connection stayed open: with a window of 1, every
    other tenant's calls waited with no bound. Past `send_timeout_s` the call ends, as if the
    client had left."""
    import socket

    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tier": "critical"}, "globex": {"api_keys": [hash_key(GLOBEX)]}}
    s = gateway_settings(
        tenants,
        backend={"kind": "sim", "max_in_flight": 1, "sim": {"step_base_s": 0.0005, "max_model_len": 8192}},
        dispatch={"adaptive_window": False},
        gateway={"send_timeout_s": 0.5, "max_context_tokens": 8192},
    )
    # Big chunks (20 alternatives a token), so the answer overflows the socket's buffers.
    body = json.dumps({"messages": MSG, "max_tokens": 6000, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    with serve_in_thread(s) as (gateway, url), socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nAuthorization: Bearer {GLOBEX}\r\n\r\n"
        stalled.sendall(head.encode() + body)
        time.sleep(1)  # its call is under way, and its answer piles up unread
        assert gateway.scheduler.dispatcher.statistics().calls_started == 1
        reply = client(url).with_options(timeout=20).chat.completions.create(model="m", messages=MSG, max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert gateway.scheduler.dispatcher.statistics().in_flight == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_the_vllm_server_backend_asks_the_server_which_model_it_serves(anyio_backend, caplog):
    """Settings that name no model: the agents' calls name the one the server lists, as its
    --served-model-name says (before: "fleetsched-tiny", which a server started for another
    model refuses with a 404). Here the server is a gateway listing "other-model"; a model the
    settings name is used as it is; a server that cannot be reached leaves the default, with a
    warning that asks whether it is up (it said to set backend.model, which is no fix)."""
    from fleetsched import Scheduler

    served = gateway_settings(backend={"kind": "instant", "model": "other-model"})
    with serve_in_thread(served) as (_, url):

        async def agent(ctx):
            return await ctx.chat(MSG, max_tokens=2)

        backend = {"kind": "vllm-server", "urls": [url], "api_key": ACME}
        async with Scheduler(Settings(backend=backend)) as scheduler:
            assert scheduler.model == "other-model"
            answer = await (await scheduler.submit(agent, tenant="default"))
        assert answer["model"] == "other-model"
        async with Scheduler(Settings(backend={**backend, "model": "named"})) as scheduler:
            assert scheduler.model == "named"
    async with Scheduler(Settings(backend={"kind": "vllm-server", "urls": ["http://127.0.0.1:9"]})) as scheduler:
        assert scheduler.model == "fleetsched-tiny"
    assert "could be reached to list its model" in caplog.text and "is the server up?" in caplog.text
    assert "set backend.model" not in caplog.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_the_gateway_sizes_its_pool_from_the_kv_cache_as_the_scheduler_does(anyio_backend):
    """[resources.kv_cache] under `serve` (before: the gateway's wrapper of the backend reported
    no KV cache, and the gateway failed at start with BackendError)."""
    from fleetsched import Scheduler

    kv_cache = {"config": "examples/models/qwen2-7b-instruct", "context_tokens": 512}
    settings = gateway_settings(backend={"kind": "sim"}, resources={"kv_cache": kv_cache})
    async with Scheduler(settings) as scheduler:
        expected = scheduler.pool.statistics().total, scheduler._session_memory
    gateway = Gateway(settings)
    async with gateway.running():
        assert (gateway.scheduler.pool.statistics().total, gateway.scheduler._session_memory) == expected
    assert expected[0] > 0


def test_a_text_completion_over_a_chat_backend_is_answered_as_vllm_answers_it(url):
    """/v1/completions over a chat backend (the sim, the in-process engine): a call naming no
    max_tokens gets 16 tokens, vLLM's CompletionRequest default (it ran to 256 on the sim);
    echo puts the prompt first (it was dropped); suffix is refused, as vLLM refuses it (it was
    ignored); echo with logprobs, which this path cannot serve, is refused naming echo."""
    with serve_in_thread(gateway_settings(backend={"kind": "sim"})) as (_, sim_url):
        assert client(sim_url).completions.create(model="m", prompt="Once upon").usage.completion_tokens == 16
    c = client(url)
    for stream in (False, True):
        answer = c.completions.create(model="m", prompt="Once upon", max_tokens=2, echo=True, stream=stream)
        text = "".join(chunk.choices[0].text for chunk in answer) if stream else answer.choices[0].text
        assert text == "Once uponok", text
    for extra, param in (({"suffix": "The end."}, "suffix"), ({"echo": True, "logprobs": 1}, "echo")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.completions.create(model="m", prompt="Once upon", max_tokens=2, **extra)
        assert refused.value.body["param"] == param or refused.value.body["message"].startswith(f"{param}:"), refused.value.body


def test_a_collected_text_completion_keeps_the_stop_reason():
    """A text completion not streamed is folded from the replica's stream; the fold dropped the
    stop_reason that vLLM's streamed chunks carried (the chat fold keeps it)."""
    from fleetsched.gateway.backend import collect_completion

    chunks = [
        {"id": "cmpl-1", "model": "m", "created": 1, "choices": [{"index": 0, "text": "The", "finish_reason": None}]},
        {"id": "cmpl-1", "model": "m", "created": 1, "choices": [{"index": 0, "text": " end", "finish_reason": "stop", "stop_reason": "END"}]},
    ]
    assert collect_completion(chunks)["choices"][0] == {"index": 0, "text": "The end", "logprobs": None, "finish_reason": "stop", "stop_reason": "END"}
    assert "stop_reason" not in collect_completion(chunks[:1])["choices"][0]


class OverloadedBackend(Backend):
    """A backend every call of which is refused as overloaded (a vLLM replica's 503, say)."""

    name = "overloaded"

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        raise Overloaded("vLLM replica r0 is overloaded", retry_after_s=2)
        yield  # an async generator


def test_a_refusal_for_overload_is_not_logged_once_a_call(caplog):
    """A 503 with Retry-After is a refusal, as a 429 is: under the load that causes them, each
    was logged as a warning, "call of tenant 'acme' failed: Overloaded(...)" (120 lines in a
    probe's run of 50 clients)."""
    with serve_in_thread(gateway_settings(), backend=OverloadedBackend()) as (_, url):
        answers = [httpx.post(url + "/v1/chat/completions", json={"messages": MSG}, headers={"authorization": f"Bearer {ACME}"}) for _ in range(3)]
    assert [a.status_code for a in answers] == [503] * 3 and answers[0].headers["retry-after"] == "2"
    assert "failed" not in caplog.text


def _noting_refunds(gw) -> list:
    """The gateway's refunds to its tenants' limits, as (tenant, tokens, request) once made."""
    refunds: list = []
    refund = gw.state.refund

    async def noted(tenant, tokens, *, request=False):
        await refund(tenant, tokens, request=request)
        refunds.append((tenant, tokens, request))

    gw.state.refund = noted
    return refunds


def _until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_a_collected_call_cut_short_is_charged_what_the_engine_made(endpoint):
    """A call answered whole (not streamed) whose client leaves meanwhile: the tenant's tokens
    per minute were charged none of the output the engine made (8,000 of 8,004 taken given
    back after 475 tokens), where a stream cut the same way was charged its output."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tokens_per_minute": 600_000}}
    s = gateway_settings(tenants, backend={"kind": "sim"}, gateway={"max_context_tokens": None})
    with serve_in_thread(s) as (gw, url):
        refunds = _noting_refunds(gw)
        calls: list = []
        add_call = gw.scheduler.dispatcher.recorder.add_call
        gw.scheduler.dispatcher.recorder.add_call = lambda record: (calls.append(record), add_call(record))
        body = {"messages": MSG} if endpoint.startswith("chat") else {"prompt": "hi"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + f"/v1/{endpoint}", json={**body, "max_tokens": 8000}, headers={"authorization": f"Bearer {ACME}"}, timeout=0.5)
        _until(lambda: calls and refunds)
        made = calls[0].prompt_tokens + calls[0].completion_tokens
        taken = (4 if endpoint.startswith("chat") else 1) + 8000
        assert calls[0].completion_tokens > 10
        assert refunds == [("acme", taken - made, False)]


def test_a_call_whose_client_leaves_before_it_is_sent_gives_everything_back():
    """A call queued for a place in the dispatcher's window (one place, held by another
    tenant's stream) whose client leaves: no engine saw it, yet the tenant was charged its
    prompt estimate (1,004 tokens of a 1,200-token minute) and a request."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tokens_per_minute": 1200}, "globex": {"api_keys": [hash_key(GLOBEX)]}}
    s = gateway_settings(
        tenants, backend={"kind": "sim", "max_in_flight": 1}, dispatch={"adaptive_window": False}, gateway={"max_context_tokens": None}
    )
    with serve_in_thread(s) as (gw, url):
        refunds = _noting_refunds(gw)
        stop = threading.Event()

        def hold_the_place():
            stream = {"messages": MSG, "max_tokens": 8000, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=stream, headers={"authorization": f"Bearer {GLOBEX}"}) as held:
                for _ in held.iter_lines():
                    if stop.is_set():
                        break

        holder = threading.Thread(target=hold_the_place)
        holder.start()
        try:
            _until(lambda: gw.scheduler.dispatcher.statistics().in_flight == 1)
            with pytest.raises(httpx.ReadTimeout):
                body = {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 10}
                httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}"}, timeout=0.5)
            _until(lambda: any(tenant == "acme" for tenant, *_ in refunds))
        finally:
            stop.set()
            holder.join()
        assert [r for r in refunds if r[0] == "acme"] == [("acme", 1004 + 10, True)]


def test_max_completion_tokens_is_no_field_of_a_text_completion():
    """vLLM's completions endpoint ignores ``max_completion_tokens`` (chat's): here it won over
    ``max_tokens`` (3 asked, 40 made on the sim), and a large one was refused by name."""
    with serve_in_thread(gateway_settings(backend={"kind": "sim"})) as (_, url):
        c = client(url)
        reply = c.completions.create(model="m", prompt="hi", max_tokens=3, extra_body={"max_completion_tokens": 40})
        assert reply.usage.completion_tokens == 3
        reply = c.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"max_completion_tokens": 9000})
        assert reply.usage.completion_tokens == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_health_says_starting_with_a_503_until_the_gateway_runs(anyio_backend):
    """/health answers 503 "starting" before the gateway runs, so a load balancer sends it nothing yet."""
    gateway = Gateway(gateway_settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as c:
        response = await c.get("/health")
    assert response.status_code == 503 and response.json() == {"status": "starting"}


def test_requests_without_a_valid_key_are_counted_under_the_empty_tenant(url):
    """A 401 is counted as tenant "" in requests_total, which the admin sees."""
    assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer fs-nobody"}).status_code == 401
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert re.search(r'fleetsched_gateway_requests_total\{tenant="",endpoint="models",code="401"\} [1-9]', text), text


def test_a_body_nested_too_deep_to_parse_is_a_400(url):
    """JSON nested deeper than the parser's recursion limit is a 400, not a 500."""
    response = httpx.post(url + "/v1/chat/completions", content=b"[" * 100_000, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 400 and response.json()["error"]["param"] is None


def test_a_prompt_that_exactly_fills_the_context_is_refused_naming_the_prompt(url):
    """A text prompt estimated at exactly the context (1,000 tokens) is a 400 whose param is "prompt"."""
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).completions.create(model="m", prompt="x" * 4000, max_tokens=1)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt"


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock()})])  # time stands still
@pytest.mark.anyio
async def test_a_chat_call_naming_no_max_tokens_is_charged_256_up_front_then_what_it_used(anyio_backend):
    """Without max_tokens a chat call takes its prompt and 256 tokens, and gets back what it did not use."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 6000}})
    gateway = Gateway(s)
    headers = {"authorization": f"Bearer {GLOBEX}"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        first = await c.post("/v1/chat/completions", json={"messages": MSG})
        second = await c.post("/v1/chat/completions", json={"messages": MSG})
    used = first.json()["usage"]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 6000 - used["prompt_tokens"] - 256
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 6000 - used["total_tokens"] - used["prompt_tokens"] - 256


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)}), ("asyncio", {"loop_factory": VirtualTimeLoop})])
@pytest.mark.anyio
async def test_gateway_sessions_leave_no_queue_unclosed_however_they_end(anyio_backend):
    """A session's queue of turns is closed when it ends: at its client's DELETE, idle, or at the
    gateway's shutdown (which still ends it cancelled, not failed). Before, each session's two
    ends were collected unclosed: anyio's ResourceWarning "Unclosed <MemoryObject...Stream>"."""
    gateway = Gateway(gateway_settings(gateway={"session_idle_s": 5}))
    body = {"model": "m", "messages": MSG, "max_tokens": 2}
    gc.collect()  # what earlier tests left (their sockets, say) is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as c:
            for sid in ("deleted", "idle", "open"):
                answer = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}", "x-session-id": sid})
                assert answer.status_code == 200, answer.text
            assert (await c.delete("/v1/sessions/deleted", headers={"authorization": f"Bearer {ACME}"})).status_code == 200
            await anyio.sleep(3)
            answer = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}", "x-session-id": "open"})
            await anyio.sleep(3)  # "idle" idles out; "open" is still waiting for its next call
            handles = {s.key: s.handle for s in gateway.sessions._sessions.values()}
        assert [h.state.value for h in handles.values()] == ["cancelled"]  # "open", ended by the shutdown
        del gateway, handles, c
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and "MemoryObject" in str(w.message)] == []


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"loop_factory": VirtualTimeLoop})])
async def test_a_session_call_does_not_scan_every_idle_session(anyio_backend):
    """A gateway session sits in a tool (its client's time) until it ends, parked once its slot
    is lent. A call that met admission pressure looked at every session in a tool for one to
    park, the parked ones too: a cost in the number of open sessions on every such call (2,000
    open, 1,300 sessions looked at a call). Now it looks at those holding a slot alone."""
    gateway = Gateway(gateway_settings(gateway={"session_idle_s": 1000}, scheduler={"max_sessions": 10000}))
    body = {"model": "m", "messages": MSG, "max_tokens": 2}
    looked_at = [0]

    class Counted(dict):
        def __iter__(self):
            looked_at[0] += len(self)
            return super().__iter__()

        def items(self):
            looked_at[0] += len(self)
            return super().items()

    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as c:
        gateway.scheduler._in_tool = Counted()

        async def call(sid: str) -> None:
            answer = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}", "x-session-id": sid})
            assert answer.status_code == 200, answer.text

        async with anyio.create_task_group() as tg:
            for i in range(400):
                tg.start_soon(call, f"s{i}")
        await anyio.sleep(5)  # past tool_keep_s: the idle sessions are parked
        looked_at[0] = 0
        for i in range(0, 400, 8):
            await call(f"s{i}")
        assert looked_at[0] < 400  # not even one pass over the open sessions


def test_the_in_flight_gauge_is_back_to_zero_once_a_call_is_answered(url):
    """fleetsched_gateway_in_flight counts a call while it runs and drops back to 0 after."""
    client(url).chat.completions.create(model="m", messages=MSG, max_tokens=1)

    def in_flight() -> str:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ACME}"}).text
        return re.search(r'fleetsched_gateway_in_flight\{tenant="acme"\} (\S+)', text).group(1)

    assert _wait_for(lambda: in_flight() == "0"), in_flight()


def test_tokens_served_are_counted_per_tenant_streamed_or_not():
    """fleetsched_gateway_tokens_total counts the prompt and completion tokens of every call served, streams included."""
    with serve_in_thread(gateway_settings()) as (_, url):
        c = client(url)
        whole = c.chat.completions.create(model="m", messages=MSG, max_tokens=4)
        list(c.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True))
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ACME}"}).text
    assert f'fleetsched_gateway_tokens_total{{tenant="acme",kind="completion"}} 7' in text
    assert f'fleetsched_gateway_tokens_total{{tenant="acme",kind="prompt"}} {2 * whole.usage.prompt_tokens}' in text


def test_a_call_refused_by_the_engine_gives_its_prompt_tokens_back():
    """A 900-token prompt the engine refuses (400) costs no tokens: the same call, fixed, fits in 1,000 a minute."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tokens_per_minute": 1000}}
    long = {"messages": [{"role": "user", "content": "x" * 3560}], "max_tokens": 1}
    with serve_in_thread(gateway_settings(tenants, backend={"kind": "sim"})) as (_, url):
        headers = {"authorization": f"Bearer {ACME}"}
        refused = httpx.post(url + "/v1/chat/completions", json={**long, "stream_interval": 0}, headers=headers)
        assert refused.status_code == 400, refused.text
        assert httpx.post(url + "/v1/chat/completions", json=long, headers=headers).status_code == 200


def test_a_stream_left_before_any_count_is_charged_its_prompt():
    """A stream whose client leaves before the engine counted anything keeps its prompt charged; only max_tokens comes back."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "tokens_per_minute": 100_000}}
    with serve_in_thread(gateway_settings(tenants), backend=SlowBackend()) as (gw, url):
        refunds = _noting_refunds(gw)
        body = {"messages": MSG, "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}"}) as r:
            assert next(r.iter_lines()).startswith("data: ")
        _until(lambda: refunds)
    assert refunds == [("acme", 50, False)]


def test_an_engine_s_status_is_passed_on_only_for_a_refusal_of_the_body():
    """An engine's 4xx is passed on as it is, but a 429 or a 5xx from it is a 502, an invalid body stays a 400, and a shutdown's 503 says retry after 1 s."""
    from fleetsched.errors import BackendError, InvalidRequest, SchedulerClosed

    def caused_by(exc: Exception, status: int) -> Exception:
        request = httpx.Request("POST", "http://r.invalid/v1/chat/completions")
        exc.__cause__ = openai.APIStatusError("refused", response=httpx.Response(status, request=request), body=None)
        return exc

    assert _answer_for(caused_by(BackendError("r rejected the call (403)"), 403)).status_code == 403
    assert _answer_for(caused_by(BackendError("r rejected the call (429)"), 429)).status_code == 502
    assert _answer_for(caused_by(BackendError("r failed (500)"), 500)).status_code == 502
    assert _answer_for(caused_by(InvalidRequest("top_k: bad"), 422)).status_code == 400
    closed = _answer_for(SchedulerClosed("the gateway is shutting down"))
    assert closed.status_code == 503 and closed.headers["retry-after"] == "1"


def test_a_body_of_exactly_max_body_bytes_is_served():
    """The body limit is inclusive: max_body_bytes bytes are read, one more is a 413."""
    body = json.dumps({"messages": MSG, "max_tokens": 1}).encode()
    body += b" " * (1000 - len(body))
    with serve_in_thread(gateway_settings(gateway={"max_body_bytes": 1000})) as (_, url):
        headers = {"authorization": f"Bearer {ACME}", "content-type": "application/json"}
        assert httpx.post(url + "/v1/chat/completions", content=body, headers=headers).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", content=body + b" ", headers=headers).status_code == 413


def test_a_compressed_body_is_refused_naming_its_content_encoding():
    """A gzip-compressed body (``Content-Encoding: gzip``, which some HTTP clients and proxies
    send) is not decoded: it was refused as "the body is not valid JSON: 'utf-8' codec can't
    decode byte 0x8b", naming no cause. It is a 415 naming the encoding (the limit on the body
    holds either way: nothing is decompressed); an identity encoding is served."""
    import gzip

    body = json.dumps({"messages": MSG, "max_tokens": 1}).encode()
    headers = {"authorization": f"Bearer {ACME}", "content-type": "application/json"}
    with serve_in_thread(gateway_settings()) as (gateway, url):
        answer = httpx.post(url + "/v1/chat/completions", content=gzip.compress(body), headers={**headers, "content-encoding": "gzip"})
        assert answer.status_code == 415, answer.text
        error = answer.json()["error"]
        assert "Content-Encoding" in error["message"] and "gzip" in error["message"] and error["param"] == "Content-Encoding"
        assert answer.headers["accept-encoding"] == "identity"
        assert gateway.metrics.requests[("acme", "chat", 415)] == 1
        plain = httpx.post(url + "/v1/chat/completions", content=body, headers={**headers, "content-encoding": "identity"})
        assert plain.status_code == 200


def test_remaining_tokens_never_go_below_zero_in_the_headers():
    """A call larger than a full bucket leaves it in debt, but x-ratelimit-remaining-tokens says 0, not a negative."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 100}})
    with serve_in_thread(s) as (_, url):
        raw = client(url, GLOBEX).chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=150)
    assert raw.headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_reset_of_one_second_is_written_in_seconds():
    """1 s reads "1s", not "1000ms", as OpenAI writes it."""
    assert (duration_text(1), duration_text(0.999)) == ("1s", "999ms")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"messages": MSG, "x\ud800": 1}, "(a key)"),
        ("chat/completions", {"messages": MSG, "max_tokens": 2.5}, "max_tokens"),
        ("chat/completions", {"messages": MSG, "model": 5}, "model"),
        ("chat/completions", {"messages": MSG, "stream": True, "stream_options": "usage"}, "stream_options"),
        ("chat/completions", {"messages": MSG, "user": 5}, "user"),
        ("chat/completions", {"messages": [5]}, "messages.0"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
        ("chat/completions", {"messages": MSG, "functions": "search"}, "functions"),
        ("completions", {"prompt": "x", "echo": "maybe"}, "echo"),
        ("completions", {"prompt": ["a", "b"]}, "prompt"),
        ("completions", {"prompt": ""}, "prompt"),
    ],
)
def test_a_malformed_field_of_either_endpoint_is_a_400_naming_it(url, path, body, param):
    """Each field the gateway checks, sent malformed, is a 400 whose param names it."""
    content = json.dumps(body).encode()  # a lone surrogate travels escaped
    response = httpx.post(f"{url}/v1/{path}", content=content, headers={"authorization": f"Bearer {ACME}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_key_ring_refuses_a_key_hash_given_twice():
    """One key hash given to two tenants, or to a tenant and the admin, is a config error, never a tenant picked by order."""
    from fleetsched.errors import ConfigError

    tenants = gateway_settings().tenants
    twice = {"acme": tenants["acme"], "copy": tenants["acme"]}
    with pytest.raises(ConfigError, match="also given to tenant 'acme'"):
        KeyRing(twice)
    with pytest.raises(ConfigError, match="gateway.admin_api_keys"):
        KeyRing(tenants, [hash_key(ACME)])


def test_the_bearer_scheme_is_read_case_insensitively_and_the_header_trimmed():
    """`bearer KEY` and a header padded with spaces name the key's tenant, as RFC 9110 reads a scheme."""
    ring = KeyRing(gateway_settings().tenants)
    assert ring.identify_header(f"bearer {ACME}".encode()).tenant == "acme"
    assert ring.identify_header(f"  Bearer {ACME} ".encode()).tenant == "acme"


def test_a_text_completion_s_log_probabilities_name_the_token_itself_when_no_alternatives_are_asked():
    """With logprobs 0 (over a chat backend), each token's top_logprobs holds the token itself, as vLLM's completions answer."""
    with serve_in_thread(gateway_settings(backend={"kind": "sim"})) as (_, url):
        body = {"prompt": "Once", "max_tokens": 2, "logprobs": 0}
        reply = httpx.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {ACME}"})
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 2
    assert logprobs["top_logprobs"] == [{token: lp} for token, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]


def test_a_collected_text_completion_has_a_finish_reason_and_usage_and_needs_an_id():
    """Folded chunks without a finish reason or usage answer "stop" and zero usage; chunks without an id are a backend error."""
    from fleetsched.errors import BackendError
    from fleetsched.gateway.backend import collect_completion

    folded = collect_completion([{"id": "cmpl-1", "choices": [{"index": 0, "text": "a"}]}])
    assert folded["choices"][0]["finish_reason"] == "stop" and folded["usage"]["total_tokens"] == 0
    with pytest.raises(BackendError):
        collect_completion([{"choices": [{"index": 0, "text": "a"}]}])


def test_the_latency_histogram_counts_each_bound_inclusively_and_sums_the_seconds():
    """A call of 0.5 s falls in le="0.5"; one of 100 s only in +Inf; the sum adds both; a tenant name with a quote is escaped."""
    from prometheus_client.parser import text_string_to_metric_families

    from fleetsched.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.record('a"b', "chat", 200, 0.5)
    metrics.record('a"b', "chat", 200, 100.0)
    samples = {(s.name, s.labels.get("le")): (s.labels["tenant"], s.value) for f in text_string_to_metric_families(metrics.render(None)) for s in f.samples}
    assert samples[("fleetsched_gateway_request_seconds_bucket", "0.25")] == ('a"b', 0)
    assert samples[("fleetsched_gateway_request_seconds_bucket", "0.5")] == ('a"b', 1)
    assert samples[("fleetsched_gateway_request_seconds_bucket", "60.0")] == ('a"b', 1)
    assert samples[("fleetsched_gateway_request_seconds_bucket", "+Inf")] == ('a"b', 2)
    assert samples[("fleetsched_gateway_request_seconds_sum", None)] == ('a"b', 100.5)



@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock()})])  # time stands still
@pytest.mark.anyio
async def test_a_call_short_by_less_than_a_second_of_tokens_gets_a_429(anyio_backend):
    """A call its bucket cannot hold yet is refused with 429 and Retry-After 1 however short the wait."""
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "tokens_per_minute": 60_000}}, gateway={"max_context_tokens": None})
    gateway = Gateway(s, backend=InstantBackend(completion_tokens=10**6))  # uses all of max_tokens
    headers = {"authorization": f"Bearer {GLOBEX}"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        assert (await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 59_996})).status_code == 200
        short = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 496})  # 0.5 s of tokens short
    assert short.status_code == 429 and short.headers["retry-after"] == "1", short.text


def test_a_client_cannot_set_the_gateway_s_private_fields(url):
    """A private field sent by the client (here: count the prompt as a text prompt) is dropped, so a chat prompt is counted with its template."""
    content = [{"role": "user", "content": "y" * 400}]
    reply = client(url).chat.completions.create(model="m", messages=content, max_tokens=1, extra_body={"fleetsched_text_prompt": True})
    assert reply.usage.prompt_tokens == 104


def test_tokens_of_a_call_whose_client_left_are_not_counted_as_served():
    """tokens_total counts served calls only: a call whose client left before its answer adds nothing."""
    s = gateway_settings(backend={"kind": "sim"}, gateway={"max_context_tokens": None})
    with serve_in_thread(s) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8000}, headers=headers, timeout=0.5)
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        text = httpx.get(url + "/metrics", headers=headers).text
    assert 'code="499"' in text and "fleetsched_gateway_tokens_total{" not in text


def test_tokens_of_a_stream_whose_client_left_are_not_counted_as_served():
    """A stream its client leaves after the first chunk is counted 499, as a call given up
    before its answer: its tokens were added to tokens_total all the same (its 200 was sent)."""
    s = gateway_settings(backend={"kind": "sim"}, gateway={"max_context_tokens": None})
    with serve_in_thread(s) as (gw, url):
        headers = {"authorization": f"Bearer {ACME}"}
        body = {"messages": MSG, "max_tokens": 8000, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert next(r.iter_lines()).startswith("data: ")
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        assert _wait_for(lambda: 'code="499"' in httpx.get(url + "/metrics", headers=headers).text)
        text = httpx.get(url + "/metrics", headers=headers).text
    assert 'code="200"' not in text and "fleetsched_gateway_tokens_total{" not in text, text


def test_a_session_call_with_a_field_that_needs_another_opens_no_session(gateway):
    """top_logprobs without logprobs is refused by the gateway itself, before the call's X-Session-ID opens a session."""
    gw, url = gateway
    before = len(gw.sessions)
    body = {"messages": MSG, "max_tokens": 1, "top_logprobs": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ACME}", "x-session-id": "needs-logprobs"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert len(gw.sessions) == before


def test_a_session_ended_by_its_client_leaves_the_scheduler_at_once():
    """After DELETE /v1/sessions/{id} of an idle session, the scheduler runs no session for it (it was kept waiting for a call)."""
    s = gateway_settings(gateway={"session_idle_s": 60})
    with serve_in_thread(s) as (gw, url):
        client(url).with_options(default_headers={"X-Session-ID": "s1"}).chat.completions.create(model="m", messages=MSG, max_tokens=1)
        assert gw.scheduler.statistics().running_total == 1
        assert httpx.delete(url + "/v1/sessions/s1", headers={"authorization": f"Bearer {ACME}"}).status_code == 200
        assert _wait_for(lambda: gw.scheduler.statistics().running_total == 0 and len(gw.sessions) == 0)


def test_a_session_past_its_deadline_in_the_queue_leaves_its_id_refused():
    """A session that passes its deadline before its first call is served marks its id: the next call is told to use a new X-Session-ID."""
    tenants = {"a": {"api_keys": [hash_key(ACME)]}, "b": {"api_keys": [hash_key(GLOBEX)], "sla": {"deadline_s": 1}}}
    s = gateway_settings(tenants, scheduler={"max_sessions": 1, "tool_policy": "keep"}, gateway={"session_idle_s": 60})
    with serve_in_thread(s) as (_, url):

        def post(key: str, session: str) -> httpx.Response:
            headers = {"authorization": f"Bearer {key}", "x-session-id": session}
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=headers, timeout=10)

        assert post(ACME, "holder").status_code == 200
        assert post(GLOBEX, "late").status_code == 408
        again = post(GLOBEX, "late")
    assert again.status_code == 408 and "needs a new X-Session-ID" in again.json()["error"]["message"]


def test_a_text_completion_reaches_vllm_without_the_gateway_s_marker():
    """The gateway's private endpoint marker is removed before a text completion's body goes to a vLLM replica."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    sent: list[dict] = []

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            sent.append(json.loads(request.content))
            chunk = {"id": "cmpl-r", "object": "text_completion", "created": 0, "model": "m", "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}], "usage": usage_dict(2, 1)}
            return httpx2.Response(200, content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), headers={"content-type": "text/event-stream"})

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    backend = VLLMServerBackend({"r": "http://r.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        assert client(url).completions.create(model="m", prompt="Once upon", max_tokens=2).choices[0].text == "ok"
    assert sent and not [key for key in sent[0] if key.startswith("fleetsched")], sent


def test_a_tenant_sees_no_series_of_a_tenant_whose_name_contains_its_own():
    """Tenant "ac" sees its own series only, not those of tenant "acme"."""
    from fleetsched.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    for tenant in ("ac", "acme"):
        metrics.record(tenant, "chat", 200, 0.1)
        metrics.add_tokens(tenant, 3, 4)
        metrics.in_flight[tenant] = 0
    page = metrics.render("ac")
    assert 'tenant="ac"' in page and "acme" not in page


def test_counts_and_flags_given_as_vllms_server_reads_them_are_taken(url):
    """max_tokens "3" (or 3.0, or true for 1), stream "yes" and ignore_eos 1 are taken, as vLLM's
    server reads them (pydantic's lax mode); the gateway refused them with a 400."""
    headers = {"authorization": f"Bearer {ACME}"}
    for max_tokens, count in (("3", 3), (3.0, 3), (True, 1)):
        body = {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": 1}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == count, response.text
    body = {"messages": MSG, "max_tokens": "2", "stream": "yes"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert [line for line in response.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"


def test_a_tenant_s_bad_structured_outputs_do_not_open_the_replica_s_breaker_for_everyone():
    """vLLM 0.32 answers a ``structured_outputs`` that is not an object (true, a list) with a
    500 ("'bool' object has no attribute 'get'"). The gateway passed it on and took the 500 for
    the replica down: five such calls of one tenant opened the replica's circuit breaker, and
    every tenant's chat calls were answered 502 "circuit open" for `breaker_reset_s`. Refused
    with a 400 naming the field, they never reach the replica; an object is passed on."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    sent: list[dict] = []

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            body = json.loads(request.content)
            sent.append(body)
            given = body.get("structured_outputs")
            if given is not None and not isinstance(given, dict):  # as vLLM 0.32's server answers it
                error = {"message": f"'{type(given).__name__}' object has no attribute 'get'", "type": "InternalServerError", "param": None, "code": 500}
                return httpx2.Response(500, json={"error": error})
            chunks = (
                make_chunk("chatcmpl-r", "m", 0, role="assistant", content="ok"),
                make_chunk("chatcmpl-r", "m", 0, finish_reason="stop", usage=usage_dict(2, 1)),
            )
            events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
            return httpx2.Response(200, content=events.encode(), headers={"content-type": "text/event-stream"})

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    backend = VLLMServerBackend({"r": "http://r.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        for endpoint, body in (("chat/completions", {"messages": MSG}), ("completions", {"prompt": "Once"})):
            for _ in range(6):
                bad = {**body, "max_tokens": 1, "structured_outputs": True}
                response = httpx.post(f"{url}/v1/{endpoint}", json=bad, headers={"authorization": f"Bearer {ACME}"})
                assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs", response.text
        assert not [b for b in sent if "structured_outputs" in b], sent
        # Another tenant is served, and an object goes on to the replica.
        assert client(url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1).choices[0].message.content == "ok"
        reply = client(url).chat.completions.create(model="m", messages=MSG, max_tokens=1, extra_body={"structured_outputs": {"choice": ["ok"]}})
        assert reply.choices[0].message.content == "ok" and sent[-1]["structured_outputs"] == {"choice": ["ok"]}


def test_calls_of_a_session_whose_client_left_count_in_the_session_as_in_their_records():
    """A session's calls cut short by their client (a stream left after its first chunk, a call
    given up waiting) count in its counters, with the tokens the engine made for them, as their
    records count them (before: the session counted 1 call where its records counted 3)."""
    s = gateway_settings(backend={"kind": "sim"}, gateway={"max_context_tokens": None, "session_idle_s": 60})
    with serve_in_thread(s) as (gw, url):
        recorder = gw.scheduler.recorder
        recorder.keep_calls = True  # the gateway counts its calls only: these are compared
        headers = {"authorization": f"Bearer {ACME}", "x-session-id": "cut"}
        assert httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, headers=headers).status_code == 200
        body = {"messages": MSG, "max_tokens": 8000, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert next(r.iter_lines()).startswith("data: ")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8000}, headers=headers, timeout=0.5)
        assert _wait_for(lambda: gw.scheduler.dispatcher.statistics().in_flight == 0)
        (handle,) = gw.scheduler.running_sessions()
        records = recorder.calls
        assert [r.error for r in records][0] is None and all(r.error in CANCELLED for r in records[1:])
        counted = (len(records), sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records))
        assert len(records) == 3 and counted[2] > 3
        assert _wait_for(lambda: (handle.counters.calls, handle.counters.prompt_tokens, handle.counters.completion_tokens) == counted, 3)


class BreakingReplica(Backend):
    """Streams two tokens with the engine's count, then breaks off as a vLLM replica that fails
    mid-answer does (a `BackendError`) where the last message says "break", waits 30 s where it
    says "wait", and ends the answer otherwise."""

    name = "breaking"

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        yield make_chunk("chatcmpl-r", "m", 0, role="assistant", content="a", usage=usage_dict(5, 1))
        yield make_chunk("chatcmpl-r", "m", 0, content="b", usage=usage_dict(5, 2))
        said = body["messages"][-1]["content"]
        if said == "break":
            raise BackendError("vLLM replica r0 broke off the answer")
        if said == "wait":
            await anyio.sleep(30)
        yield make_chunk("chatcmpl-r", "m", 0, finish_reason="stop", usage=usage_dict(5, 2))


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_session_s_stream_its_replica_broke_off_is_no_call_in_the_session_as_in_its_record(anyio_backend):
    """A session's streams: one answered whole, one its replica broke off after two tokens (a
    200, then an error event), one cut by the session's 10 s deadline after two tokens. The
    records say: served, failed, cut; the session counts the served and the cut one, as an
    in-process agent's session does (before: 3 calls, 15 prompt and 6 completion tokens, the
    failed one counted)."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 10}}}
    gateway = Gateway(gateway_settings(tenants, gateway={"session_idle_s": 60}), backend=BreakingReplica())
    headers = {"authorization": f"Bearer {ACME}", "x-session-id": "s"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        recorder = gateway.scheduler.recorder
        recorder.keep_calls = True  # the gateway counts its calls only: these are compared

        async def stream(said: str) -> list[str]:
            body = {"messages": [{"role": "user", "content": said}], "stream": True}
            answer = await c.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200
            return [line for line in answer.text.splitlines() if line]

        assert not any("error" in event for event in await stream("end"))
        (handle,) = gateway.scheduler.running_sessions()
        assert "error" in (await stream("break"))[-2]
        assert '"code":408' in (await stream("wait"))[-2]
    records = recorder.calls
    assert [r.error for r in records] == [None, "BackendError", "Cancelled"]
    made = [r for r in records if r.error is None or r.error in CANCELLED]
    counted = (len(made), sum(r.prompt_tokens for r in made), sum(r.completion_tokens for r in made))
    assert counted == (2, 10, 4)
    assert (handle.counters.calls, handle.counters.prompt_tokens, handle.counters.completion_tokens) == counted


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_stream_cut_by_its_session_s_deadline_is_counted_apart_from_stream_errors(anyio_backend):
    """Streams of a session with a 10 s deadline: one answered whole, one its replica broke off,
    one the deadline cut. The metrics say what the calls' records say (served, failed, cut):
    one stream error, one stream cut, no latency but the served one's (before: 2 stream errors,
    the tenant's own deadline counted as a failure of the service)."""
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 10}}}
    gateway = Gateway(gateway_settings(tenants, gateway={"session_idle_s": 60}), backend=BreakingReplica())
    headers = {"authorization": f"Bearer {ACME}", "x-session-id": "s"}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        for said in ("end", "break", "wait"):
            answer = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": said}], "stream": True})
            assert answer.status_code == 200
        text = (await c.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def totals(name: str) -> list:
        return [(s.labels, s.value) for s in families[name].samples if s.name.endswith("_total")]

    assert totals("fleetsched_gateway_stream_errors") == [({"tenant": "acme", "endpoint": "chat"}, 1.0)]
    assert totals("fleetsched_gateway_streams_cut") == [({"tenant": "acme", "endpoint": "chat"}, 1.0)]
    assert totals("fleetsched_gateway_requests") == [({"tenant": "acme", "endpoint": "chat", "code": "200"}, 3.0)]
    assert [s.value for s in families["fleetsched_gateway_request_seconds"].samples if s.name.endswith("_count")] == [1.0]


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)}), ("asyncio", {"loop_factory": VirtualTimeLoop})])
@pytest.mark.parametrize("end", ["deadline", "shutdown"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.anyio
async def test_a_session_s_record_counts_the_call_under_way_when_it_ends(anyio_backend, end, stream):
    """A session ended with a call under way (cut by the session's 10 s deadline, or left to
    finish by a shutdown) is recorded after that call is counted: its record counts what its
    counters and its calls' records count (before: the record was written as the session ended,
    1 call, 5 prompt and 2 completion tokens, where the counters had 2, 10 and 4)."""
    sla = {"deadline_s": 10} if end == "deadline" else {}
    gateway = Gateway(gateway_settings({"acme": {"api_keys": [hash_key(ACME)], "sla": sla}}, gateway={"session_idle_s": 60}), backend=BreakingReplica())
    headers = {"authorization": f"Bearer {ACME}", "x-session-id": "s"}
    ended = []
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw", headers=headers) as c:
        recorder = gateway.scheduler.recorder
        recorder.keep_calls = True  # the gateway counts its calls only: these are compared
        recorder.add_session = ended.append  # the gateway forgets its sessions' records: these are read

        async def call(said: str) -> None:
            answer = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": said}], "stream": stream})
            assert answer.status_code == (200 if stream or said == "end" or end == "shutdown" else 408)

        await call("end")
        (handle,) = gateway.scheduler.running_sessions()
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "wait")
            await anyio.sleep(1)
            if end == "shutdown":
                gateway.stop_waiting()  # as the server does first: the call under way finishes
    (record,) = ended
    assert record.state == ("failed" if end == "deadline" else "cancelled")
    counted = (len(recorder.calls), sum(r.prompt_tokens for r in recorder.calls), sum(r.completion_tokens for r in recorder.calls))
    assert counted == (2, 10, 4)
    assert (handle.counters.calls, handle.counters.prompt_tokens, handle.counters.completion_tokens) == counted
    assert (record.calls, record.prompt_tokens, record.completion_tokens) == counted


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_text_completion_over_the_sim_names_the_stop_string_that_ended_it(anyio_backend):
    """A text completion ended by a stop string says which, as vLLM's completions and the
    gateway's chat answer say it (`stop_reason`). Served over the sim's chat stream, the text
    completion dropped it: `choice.stop_reason` read None, streamed and not, where the same call
    on /v1/chat/completions read "k t"."""
    gateway = Gateway(gateway_settings(backend={"kind": "sim"}))
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway)) as http:
        c = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=ACME, http_client=http, max_retries=0)
        whole = await c.completions.create(model="m", prompt="Once upon", max_tokens=8, stop=["k t"])
        chunks = [ch async for ch in await c.completions.create(model="m", prompt="Once upon", max_tokens=8, stop=["k t"], stream=True)]
        chat = await c.chat.completions.create(model="m", messages=MSG, max_tokens=8, stop=["k t"])
    assert chat.choices[0].stop_reason == "k t"
    assert whole.choices[0].text == " to" and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].stop_reason == "k t"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == "k t"
    assert all(ch.choices[0].stop_reason is None for ch in chunks[:-1])


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.anyio
async def test_a_chat_call_on_the_sim_echoes_the_message_it_continues(anyio_backend):
    """vLLM's ``echo`` on a chat call: the last message, where it is the answer's role's, comes
    back before the answer, in a chunk of its own when streamed. The sim ignored it: a call that
    asked for it got the answer alone, streamed and not, with nothing to say it was not served."""
    gateway = Gateway(gateway_settings(backend={"kind": "sim"}))
    prefix = [*MSG, {"role": "assistant", "content": "The answer is"}]
    options = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    async with gateway.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway)) as http:
        c = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=ACME, http_client=http, max_retries=0)
        whole = await c.chat.completions.create(model="m", messages=prefix, max_tokens=2, logprobs=True, extra_body=options)
        stream = await c.chat.completions.create(model="m", messages=prefix, max_tokens=2, stream=True, extra_body=options)
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(model="m", messages=MSG, max_tokens=2, extra_body={"echo": True})  # a user's message: none
    assert whole.choices[0].message.content == "The answer is tok tok" and whole.usage.completion_tokens == 2
    assert len(whole.choices[0].logprobs.content) == 2  # those of the answer's tokens, as vLLM's
    assert [ch.choices[0].delta.content for ch in chunks if ch.choices][:2] == ["", "The answer is"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "The answer is tok tok"
    assert plain.choices[0].message.content == " tok tok"


def test_a_text_completion_not_streamed_keeps_what_vllm_streamed_beside_the_text():
    """A text completion not streamed is collected from vLLM's stream: the ``system_fingerprint``
    vLLM puts on its last chunk, and with ``return_token_ids`` the answer's and the prompt's
    token IDs, were dropped (`system_fingerprint` read None), where vLLM's own non-streamed
    answer, and the gateway's chat answer, have them."""
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    def chunk(choices, **extra):
        return {"id": "cmpl-t", "object": "text_completion", "created": 1, "model": "m", "choices": choices, **extra}

    chunks = [
        chunk([{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None, "prompt_token_ids": [7, 8], "token_ids": [1]}]),
        chunk([{"index": 0, "text": "lo", "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": [2]}]),
        chunk([], usage=usage_dict(2, 2), system_fingerprint="vllm-0.32.0"),
    ]

    def factory(base_url: str, api_key: str) -> openai.AsyncOpenAI:
        def handler(request: httpx2.Request) -> httpx2.Response:
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx2.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))

    metrics = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    backend = VLLMServerBackend({"r": "http://r.invalid:8000"}, model="m", retry_attempts=1, client_factory=factory, http_client=metrics)
    with serve_in_thread(gateway_settings(), backend=backend) as (_, url):
        reply = client(url).completions.create(model="m", prompt="Say", max_tokens=2, extra_body={"return_token_ids": True})
    assert reply.choices[0].text == "Hello" and reply.system_fingerprint == "vllm-0.32.0"
    assert reply.choices[0].token_ids == [1, 2] and reply.choices[0].prompt_token_ids == [7, 8]
