"""The gateway's view of the backend: chat passes through, ``/v1/completions`` is added.

The backend seam speaks chat completions only. Text completions travel through the same
dispatcher (same window, order, limits and abort) as chat bodies marked with `ENDPOINT_KEY`;
this wrapper turns them into ``text_completion`` chunks: forwarded as they are to a vLLM server's
``/v1/completions``, or, for the other backends (sim, instant), served by their chat stream with
the prompt as one user message (counted without a chat template's framing, as vLLM counts a
text prompt: `TEXT_PROMPT_KEY`) and each delta rewritten as completion text.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio

from ..backends.base import AVOID_KEY, DEFAULT_MODEL, FALLBACK_KEY, PRIVATE_KEYS, REPLICA_KEY, REQUEST_ID_KEY, TEXT_PROMPT_KEY, Backend, ChatBody, Chunk, EngineSignals, Received, merge_logprobs
from ..backends.vllm_server import VLLMServerBackend, _ErrorEvent, _EventStream, broken_off, request_id_header, translate_error
from ..errors import BackendError, BackendUnavailable, InvalidRequest
from ..resources.kv_sizing import KVCacheCapacity

ENDPOINT_KEY = "fleetsched_endpoint"
"""Body key marking a text-completion call (removed before the backend sees the body)."""


class GatewayBackend(Backend):
    """Wraps the configured backend; enter it instead of the backend it wraps."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        if body.get(ENDPOINT_KEY) == "completions":
            request = dict(body)
            del request[ENDPOINT_KEY]
            if isinstance(self.inner, VLLMServerBackend):
                return _vllm_completions(self.inner, request)
            return _completions_over_chat(self.inner, request)
        return self.inner.stream_chat(body)

    async def complete_chat(self, body: ChatBody, received: Received | None = None) -> tuple[dict[str, Any], float | None]:
        if body.get(ENDPOINT_KEY) == "completions":
            return await super().complete_chat(body, received)  # the text-completion chunks, collected
        return await self.inner.complete_chat(body, received)

    @property
    def replicas(self) -> Mapping[str, Any]:
        """The replicas a session can be placed on, by name (empty: the backend has no choice).
        A mapping, as on the backend wrapped: the dispatcher reads it to route a session's call to
        its replica, and to fail over from it when it is down."""
        if isinstance(self.inner, VLLMServerBackend) and len(self.inner.replicas) > 1:
            return self.inner.replicas
        return {}

    def pick_replica(self) -> str | None:
        if not self.replicas:
            return None
        assert isinstance(self.inner, VLLMServerBackend)
        return self.inner.pick_replica().name

    async def signals(self) -> EngineSignals:
        return await self.inner.signals()

    async def served_model(self) -> str | None:
        return await self.inner.served_model()

    async def kv_capacities(self) -> dict[str, KVCacheCapacity]:
        return await self.inner.kv_capacities()

    def kv_capacities_seen(self) -> dict[str, KVCacheCapacity]:
        return self.inner.kv_capacities_seen()

    def replicas_down(self) -> frozenset[str]:
        return self.inner.replicas_down()

    async def max_model_len(self) -> int | None:
        return await self.inner.max_model_len()

    async def __aenter__(self) -> GatewayBackend:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        # The inner backend's own exit, not `aclose`: the sim's leaves the task group it entered.
        await self.inner.__aexit__(*exc_info)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _vllm_completions(backend: VLLMServerBackend, body: dict[str, Any]) -> AsyncIterator[Chunk]:
    """Stream ``/v1/completions`` from a vLLM replica, chunks as the server sent them.

    No retries and no circuit breaker here (the chat path has both). A call routed by load (no
    replica named) that its replica fails before the first chunk with `BackendUnavailable` goes
    to the least loaded of the others, as a chat call does: without that, with one replica down,
    the call went to it again and again (ties go to the first, and no failure here opens its
    breaker), and so did a session's call falling back from its dead replica.
    """
    import openai

    named = body.pop(REPLICA_KEY, None)
    body.pop(FALLBACK_KEY, None)  # no retries here to skip: a failure is the caller's at once
    avoid = body.pop(AVOID_KEY, None)
    headers = request_id_header(body.pop(REQUEST_ID_KEY, None))
    target = backend.pick_replica(named, avoid=avoid)
    body.pop("stream", None)
    stream_options = {**(body.pop("stream_options", None) or {}), "include_usage": True}
    model = body.pop("model", None) or backend.model or DEFAULT_MODEL
    prompt = body.pop("prompt")
    tried = backend._tried_first(target, avoid)
    while True:
        target.in_flight += 1
        stream = None
        streamed = 0  # chunks received
        try:
            try:
                # Read as the chat path reads its stream (`_EventStream`), not parsed by the SDK:
                # the SDK's stream ends quietly where the body does, so an answer cut short
                # (a body delimited by the connection's close) passed as whole, "finish_reason":
                # "stop" made up for it; keep-alive lines held a stalled one open for ever; and an
                # event that is no JSON object failed the call with a bare AttributeError.
                opened = target.client.completions.with_streaming_response.create(
                    model=model, prompt=prompt, stream=True, stream_options=stream_options, extra_body=body, extra_headers=headers,
                    timeout=backend.timeout,
                )
                response = await opened.__aenter__()
                stream = _EventStream(opened, response.iter_lines(), backend.timeout.read or math.inf)
                while (chunk := await stream.next()) is not None:
                    streamed += 1
                    yield chunk
                return
            # ValueError: an event that is no JSON object, the server's fault; _ErrorEvent: a
            # failure vLLM reported in the stream.
            except (openai.OpenAIError, ValueError, _ErrorEvent, *_transport_errors()) as exc:
                broken = broken_off(exc, target, streamed) if streamed else None  # said as the chat path says it
                if broken is not None:
                    raise broken from exc
                error = translate_error(exc, target.name, target.url)
                others = [] if named is not None or streamed else backend._untried(tried)
                if not isinstance(error, BackendUnavailable) or not others:
                    raise error from exc
        finally:
            target.in_flight -= 1
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.close()
        target = min(others, key=lambda r: r.in_flight)
        tried.append(target)


def _transport_errors() -> tuple[type[BaseException], ...]:
    from ..backends import vllm_server

    return vllm_server._TRANSPORT_ERRORS


async def _completions_over_chat(backend: Backend, body: dict[str, Any]) -> AsyncIterator[Chunk]:
    prompt = body.pop("prompt")
    if isinstance(prompt, list):
        prompt = "".join(str(p) for p in prompt)
    for private in PRIVATE_KEYS:
        if private != REQUEST_ID_KEY:  # the answer is named after it, as vLLM names it
            body.pop(private, None)
    count = body.pop("logprobs", None)
    echo = body.pop("echo", None)
    if echo and count is not None:
        raise InvalidRequest("echo: the prompt's log probabilities are not served on this backend; ask for echo or logprobs")
    if count is not None:  # a text completion's alternatives a token: chat's top_logprobs
        body["logprobs"], body["top_logprobs"] = True, count
    created = int(time.time())  # wall-clock ok: a response field, not a measurement
    offset = 0  # characters of text so far, where the next chunk's tokens start
    upstream = None
    try:
        upstream = backend.stream_chat({**body, "messages": [{"role": "user", "content": prompt}], TEXT_PROMPT_KEY: True})
        async for chunk in upstream:
            choices = []
            for c in chunk.get("choices") or ():
                text = (c.get("delta") or {}).get("content") or ""
                if echo:  # the prompt first, as vLLM answers it
                    text, echo = prompt + text, False
                logprobs = _text_logprobs(c.get("logprobs"), offset)
                offset += len(text)
                # stop_reason too: the stop string or token that ended the answer, as vLLM's
                # completions name it (it was dropped here, where the chat answer kept it).
                choices.append(
                    {"index": c.get("index", 0), "text": text, "logprobs": logprobs, "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
                )
            out: Chunk = {
                "id": str(chunk.get("id", "")).replace("chatcmpl-", "cmpl-", 1),
                "object": "text_completion",
                "created": chunk.get("created") or created,
                "model": chunk.get("model", ""),
                "choices": choices,
            }
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            yield out
    except InvalidRequest as exc:
        # Named as the client sent it (logprobs, prompt): refused when the call is made, or at
        # its first read by a backend that checks the body there (an async generator's, the
        # instant's: its refusal named top_logprobs, a field the client never sent).
        message = str(exc)
        for chat_field, field in (("top_logprobs:", "logprobs:"), ("messages:", "prompt:"), ("messages.0.content:", "prompt:")):
            if message.startswith(chat_field):
                raise type(exc)(field + message.removeprefix(chat_field)) from None
        raise
    finally:
        aclose = getattr(upstream, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()


def _text_logprobs(chat: Any, offset: int) -> dict[str, list[Any]] | None:
    """A chat chunk's ``logprobs`` as a text completion's: tokens, their log probabilities, a
    dict of alternatives each (the token itself at least) and their offsets in the text (its
    tokens start at `offset`). None without them."""
    entries = chat.get("content") if isinstance(chat, Mapping) else None
    if not entries:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or ()} or {e["token"]: e["logprob"]} for e in entries],
        "text_offset": offsets,
    }


def collect_completion(chunks: list[Chunk]) -> dict[str, Any]:
    """Fold ``text_completion`` chunks into one non-streamed response."""
    cid, model, created = "", "", 0
    text: list[str] = []
    finish: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it, as vLLM says
    usage: dict[str, int] | None = None
    logprobs: dict[str, list[Any]] | None = None  # asked for with `logprobs`: vLLM sends them per chunk
    fingerprint = None  # vLLM's, on its stream's last chunk
    token_ids: list[int] | None = None  # with ``return_token_ids``: each chunk's, joined
    prompt_token_ids = None  # with ``return_token_ids``, on the first chunk
    for chunk in chunks:
        cid = chunk.get("id") or cid
        model = chunk.get("model") or model
        created = chunk.get("created") or created
        usage = chunk.get("usage") or usage
        fingerprint = chunk.get("system_fingerprint") or fingerprint
        for choice in chunk.get("choices") or ():
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
            stop_reason = stop_reason if choice.get("stop_reason") is None else choice["stop_reason"]
            logprobs = merge_logprobs(logprobs, choice.get("logprobs"))
            if isinstance(choice.get("token_ids"), list):
                token_ids = [] if token_ids is None else token_ids
                token_ids.extend(choice["token_ids"])
            prompt_token_ids = choice.get("prompt_token_ids") or prompt_token_ids
    if not cid:
        raise BackendError("the backend returned no completion")
    choice: dict[str, Any] = {"index": 0, "text": "".join(text), "logprobs": logprobs, "finish_reason": finish or "stop"}
    if stop_reason is not None:  # as the chat fold (`base._Choice`) keeps it
        choice["stop_reason"] = stop_reason
    # As vLLM's non-streamed answer has them (they were dropped, as the chat fold once dropped its own).
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    response = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    if fingerprint is not None:
        response["system_fingerprint"] = fingerprint
    return response
