"""An httpx transport that serves the OpenAI API from the dispatcher, for ``ctx.openai``.

Agent code written for the `openai` SDK runs unchanged: `SessionContext.openai` is a real
``openai.AsyncOpenAI`` whose HTTP transport is this one, so its requests never touch the network.
``POST .../chat/completions`` goes through the scheduler's dispatcher with the session's tenant,
tier and deadline; streamed responses are sent back as server-sent events, and refusals as the
HTTP errors the SDK knows (429 rate-limited, 503 shed, both with ``Retry-After``). A stream is
answered once its first chunk came, so a failure up to it is such an HTTP error too; a failure
after it ends the stream with an error event, which the SDK raises as ``openai.APIError``. The
SDK's `timeout` is its read timeout: the longest wait for the answer, or for each streamed chunk.
Every answer names its request (``x-request-id``), as the gateway's do: the agent's own
``X-Request-Id`` where it sent one, else a new ``req_`` ID; a vLLM server gets the same ID for the
call (its logs, and the answer's ``id``: ``chatcmpl-<ID>``).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from ..backends.base import REQUEST_ID_KEY, Chunk, model_list
from ..backends.sampling import is_flag, is_true
from ..errors import BackendError, BackendUnavailable, ContextTooLong, DeadlineExceeded, InvalidRequest, Overloaded, RateLimited, UnknownModel

if TYPE_CHECKING:
    from .context import SessionContext


#: The longest Retry-After an error response says, in seconds.
MAX_RETRY_AFTER_S = 86_400

#: An ID a client chooses: a request's (X-Request-Id) or a gateway session's (X-Session-ID).
CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
CLIENT_ID_FORM = "1 to 128 characters of A-Z a-z 0-9 . _ : @ / + = -"


def request_id(given: str | None) -> tuple[str, bool]:
    """The ID a request goes by, and whether the client's `given` one may be used (none given, or
    one of the form `CLIENT_ID`): `given` where it is of that form, else a new ``req_`` + 32 hex
    digits (which names the refusal of a malformed one)."""
    if given is not None and CLIENT_ID.fullmatch(given):
        return given, True
    return f"req_{uuid.uuid4().hex}", given is None


def error_response(
    status: int,
    message: str,
    kind: str,
    *,
    retry_after_s: float | None = None,
    code: str | None = None,
    param: str | None = None,
) -> httpx.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}`` (`code`:
    OpenAI's name for the error where it has one, else the status; `param`: the field of the
    request at fault, where one is). Retry-After is `retry_after_s` rounded up to whole seconds:
    a client that waits that long is not refused again for being early. It is at most a day
    (`MAX_RETRY_AFTER_S`): under a tokens_per_minute of 1e-300 the wait is infinite. A 408
    tells the client not to retry (``x-should-retry: false``)."""
    headers = {}
    if status == 408:
        # Past a deadline: a retry cannot succeed (a gateway session's id stays refused). OpenAI's
        # SDKs retry a 408 twice by default, each retry one of the tenant's requests and the first
        # message lost; ``x-should-retry: false`` tells them not to.
        headers["x-should-retry"] = "false"
    if retry_after_s is not None:
        if not retry_after_s <= MAX_RETRY_AFTER_S:  # nan too
            retry_after_s = MAX_RETRY_AFTER_S
        headers["retry-after"] = f"{max(1, math.ceil(retry_after_s))}"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    return httpx.Response(status, json=body, headers=headers)


def model_not_found(message: str) -> httpx.Response:
    """The 404 for a call or a lookup naming a model that is not served, as vLLM and OpenAI
    answer it (the SDK's ``NotFoundError``, not retried)."""
    return error_response(404, message, "invalid_request_error", code="model_not_found", param="model")


def response_for(exc: BaseException) -> httpx.Response | None:
    """The HTTP answer for one of our errors (None: not ours to answer)."""
    if isinstance(exc, RateLimited):
        return error_response(429, str(exc), "rate_limit_exceeded", retry_after_s=exc.retry_after_s, code="rate_limit_exceeded")
    if isinstance(exc, Overloaded):
        return error_response(503, str(exc), "overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, DeadlineExceeded):
        return error_response(408, str(exc), "deadline_exceeded")
    if isinstance(exc, UnknownModel):
        return model_not_found(str(exc))
    if isinstance(exc, InvalidRequest):  # the engine refused the body: the client's to change
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else "invalid_request_error"
        return error_response(400, str(exc), "invalid_request_error", code=code, param=exc.param or field_named(str(exc)))
    if isinstance(exc, BackendUnavailable):
        return error_response(502, str(exc), "backend_unavailable")
    if isinstance(exc, BackendError):
        return error_response(500, str(exc), "backend_error")
    if isinstance(exc, ValueError):
        return error_response(400, str(exc), "invalid_request_error")
    return None


#: The field an error message starts with ("max_tokens: expected ...", "messages.0.role: missing").
_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): ")


def field_named(message: str) -> str | None:
    """The request field a refusal's message names first, or None."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


class UsageShape:
    """A stream's chunks as the client's ``stream_options`` ask for them, as OpenAI and vLLM send
    them: the dispatcher asks the engine for usage on every chunk (it charges the tenant as
    tokens stream). With no ``include_usage`` the client sees no usage; with it, a last chunk of
    usage alone (`end`), and usage on the others only with vLLM's ``continuous_usage_stats``
    too. (The gateway sent all of it to every client, and the chunk of usage alone, whose empty
    ``choices`` broke the usual ``chunk.choices[0]`` loop.)"""

    def __init__(self, include_usage: bool, continuous: bool = False) -> None:
        self.include_usage = include_usage
        self.continuous = include_usage and continuous
        self._last: Chunk | None = None  # the last chunk that carried usage

    def __call__(self, chunk: Chunk) -> Chunk | None:
        """`chunk` as the client sees it; None for one of usage alone (its usage comes at the end)."""
        if chunk.get("usage") is not None:
            self._last = chunk
        if not chunk.get("choices"):
            return None
        if self.continuous or "usage" not in chunk:
            return chunk
        return {key: value for key, value in chunk.items() if key != "usage"}

    def end(self) -> Chunk | None:
        """The stream's last chunk, of usage alone, where the client asked for it."""
        return {**self._last, "choices": []} if self.include_usage and self._last is not None else None


class _EventStream(httpx.AsyncByteStream):
    """Server-sent events over an already opened dispatcher stream, from its `first` chunk on
    (None: it had none); closing it ends the call.

    Usage as `usage` (`UsageShape`) shapes it. A failure of ours ends it with an error event.

    A task beside the session (`_drain`) reads the rest of the answer into a buffer as the engine
    sends it, and ends the call when the answer ends, as a server's answer waits unread in its
    connection: an agent that leaves the SDK's stream without closing it (``break`` out of
    ``async for``), then makes another call or sits in a tool, holds no place of the dispatcher's
    window past its answer. The buffer holds one answer at most, and goes with the stream.
    Closing it, or a read cut short (cancelled, or past the SDK's timeout), cuts the answer at once:
    the engine aborts it. Its session's end closes it too: a task still reading it then (one that
    outlived the agent) has its wait cut, and gets `SessionEnded`.
    """

    def __init__(
        self,
        opened: AbstractAsyncContextManager[AsyncIterator[Chunk]],
        chunks: AsyncIterator[Chunk],
        first: Chunk | None,
        ctx: SessionContext,
        request: httpx.Request,
        usage: UsageShape,
    ) -> None:
        self._opened = opened
        self._usage = usage
        self._chunks = chunks
        self._first = first
        self._request = request
        self._closing = False  # no more reads: `aclose` was called
        self._reading: anyio.CancelScope | None = None  # a read under way
        self._ctx = ctx
        # The chunks `_drain` read and the agent has not; closed at the answer's end.
        self._buffered_in, self._buffered = anyio.create_memory_object_stream[Chunk](math.inf)
        self._failure: Exception | None = None  # what ended the answer early, for the reader after its chunks
        self._draining = anyio.CancelScope()  # cancelled: end the call now
        self._cut: BaseException | None = None  # what cut a read short, which the call's record keeps
        self._ended = anyio.Event()  # the call ended
        ctx._open_streams.add(self)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            try:
                async for event in self._events():
                    yield event
            except Exception as exc:  # mid-stream: the error travels as an event, as vLLM sends one
                answer = response_for(exc)
                if answer is None:
                    raise
                yield b"data: " + answer.content + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            await self.aclose()

    async def _events(self) -> AsyncIterator[bytes]:
        chunk = self._first
        while chunk is not None:
            shown = self._usage(chunk)
            if shown is not None:
                yield _event(shown)
            chunk = await self._next()
        if (usage := self._usage.end()) is not None:
            yield _event(usage)

    async def _drain(self) -> None:
        """Read the answer into the buffer, and end the call when it ends (the engine's end, a
        failure, or `_stop`). Runs beside the session (`SessionContext._start_soon`): it raises
        nothing but what cancels it from outside (the scheduler's end)."""
        failure: BaseException | None = None
        try:
            with self._draining:
                while (chunk := await anext(self._chunks, None)) is not None:
                    self._buffered_in.send_nowait(chunk)
                    # An engine far ahead answers every read at once: let a stop cut in.
                    await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:  # the call ends with it, which its record keeps
            failure = exc
            if not isinstance(exc, Exception):
                self._closing = True  # not the answer's failure: its reader gets `StreamClosed`
                raise
            self._failure = exc  # the reader's, after the chunks before it
        finally:
            self._buffered_in.close()
            with anyio.CancelScope(shield=True):
                try:
                    await _leave(self._opened, self._cut if self._draining.cancel_called else failure)
                finally:
                    self._ended.set()

    async def _next(self) -> Chunk | None:
        """The next chunk (None: no more). A read that fails or is cut ends the call, which its
        record keeps. Closed meanwhile or before, raise `SessionEnded` if its session ended, else
        `httpx.StreamClosed`."""
        if not self._closing:
            with _read_timeout(self._request), anyio.CancelScope() as self._reading:
                try:
                    chunk: Chunk | None = await self._buffered.receive()
                except anyio.EndOfStream:
                    if self._failure is not None:
                        raise self._failure from None
                    chunk = None
                except BaseException as exc:
                    await self._stop(exc)
                    raise
                finally:
                    self._reading = None
                if not self._closing:
                    self._ctx._check_live()  # a task that outlived its session reads no more of it
                    return chunk
        self._ctx._check_live()
        raise httpx.StreamClosed()

    async def aclose(self) -> None:
        self._closing = True
        # Kept among the session's streams until here, its answer ended or not: the session's
        # end closes one its agent left unclosed.
        self._ctx._open_streams.discard(self)
        if self._reading is not None:  # another task waits for a chunk: cut its wait
            self._reading.cancel()
        await self._stop(None)
        # Nothing reads the buffer from here on (`_closing`): left open, anyio warned of it
        # (ResourceWarning "Unclosed MemoryObjectReceiveStream") for every stream once collected.
        self._buffered.close()

    async def _stop(self, cut: BaseException | None) -> None:
        """End the call now if it is under way, the engine's answer cut short (`cut`: the
        exception that cut a read short, which its record keeps), and wait until it has ended."""
        if not self._draining.cancel_called:
            self._cut = cut
            self._draining.cancel()
        with anyio.CancelScope(shield=True):  # `_drain` ends it promptly (`abort_stream` is bounded)
            await self._ended.wait()


async def _leave(opened: AbstractAsyncContextManager[Any], failure: BaseException | None) -> None:
    """Leave the block of a dispatcher stream, normally or with the exception that ended it."""
    if failure is None:
        await opened.__aexit__(None, None, None)
    else:
        await opened.__aexit__(type(failure), failure, failure.__traceback__)


def _event(chunk: Chunk) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class SessionTransport(httpx.AsyncBaseTransport):
    """Routes one session's OpenAI requests through the dispatcher."""

    def __init__(self, ctx: SessionContext) -> None:
        self._ctx = ctx

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        named, usable = request_id(request.headers.get("x-request-id"))
        if usable:
            answer = await self._answer(request, named)
        else:
            answer = error_response(400, f"X-Request-Id: {CLIENT_ID_FORM}", "invalid_request_error", param="X-Request-Id")
        answer.headers["x-request-id"] = named
        return answer

    async def _answer(self, request: httpx.Request, named: str) -> httpx.Response:
        """The answer to `request`, which goes by the ID `named`."""
        path = request.url.path
        if request.method == "GET" and path.endswith("/models"):  # as vLLM's clients begin: the model's name
            return httpx.Response(200, json=model_list(self._ctx.model))
        if request.method == "GET" and path.endswith(f"/models/{self._ctx.model}"):
            return httpx.Response(200, json=model_list(self._ctx.model)["data"][0])
        if request.method == "GET" and "/models/" in path:  # another model, answered as vLLM answers it
            name = path.split("/models/", 1)[1]
            return model_not_found(f"The model `{name}` does not exist: this session's model is `{self._ctx.model}`")
        if request.method != "POST" or not path.endswith("/chat/completions"):
            return error_response(404, f"{request.method} {path} is not served to agents (chat completions and models are)", "not_found")
        try:
            body: dict[str, Any] = json.loads(await request.aread())
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("the request body must be a JSON object with a `messages` list")
        except ValueError as exc:
            return error_response(400, f"malformed request: {exc}", "invalid_request_error")
        stream = body.pop("stream", None)
        if stream is not None and not is_flag(stream):  # as vLLM's server and the gateway refuse it
            return error_response(400, f"stream: must be true or false, got {stream!r:.80}", "invalid_request_error", param="stream")
        # Read as they read it: "false" and "no" are false (bool() took any word for true, and the
        # SDK, which asked for one answer, was sent a stream of events).
        streaming = stream is not None and is_true(stream)
        options = body.pop("stream_options", None)
        if options is not None and (not streaming or not isinstance(options, dict)):  # refused as vLLM refuses it
            said = "an object" if streaming else "set only with stream=true"
            return error_response(400, f"stream_options: {said}, got {options!r:.80}", "invalid_request_error", param="stream_options")
        # Continuous usage is not offered to agents: their streams carry it at the end alone.
        usage = UsageShape(isinstance(options, dict) and bool(options.get("include_usage")))
        body[REQUEST_ID_KEY] = named
        try:
            with _read_timeout(request):
                if not streaming:
                    return httpx.Response(200, json=await self._ctx.chat(body=body))
                opened = self._ctx.stream(body=body)
                chunks = await opened.__aenter__()
                try:  # answered once the first chunk came: a failure up to it is an HTTP error, as a server's
                    first = await anext(chunks, None)
                except BaseException as exc:
                    await _leave(opened, exc)
                    raise
        except Exception as exc:
            answer = response_for(exc)
            if answer is None:
                raise
            return answer
        events = _EventStream(opened, chunks, first, self._ctx, request, usage)
        try:
            self._ctx._start_soon(events._drain, name=f"{self._ctx._handle.name}: ctx.openai stream")
        except BaseException as exc:
            self._ctx._open_streams.discard(events)
            await _leave(opened, exc)
            raise
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=events)


@contextmanager
def _read_timeout(request: httpx.Request) -> Iterator[None]:
    """Bound the block by the request's read timeout (the SDK's `timeout`); past it, raise
    `httpx.ReadTimeout`, which the SDK turns into `openai.APITimeoutError`."""
    seconds = (request.extensions.get("timeout") or {}).get("read")
    if seconds is None:
        yield
        return
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        raise httpx.ReadTimeout(f"no answer within the timeout of {seconds:g} s", request=request) from None
