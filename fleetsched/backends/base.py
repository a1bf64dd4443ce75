"""The backend seam: one small interface for a model backend.

A backend takes an OpenAI chat-completions request body (a dict, exactly what a client would POST
to ``/v1/chat/completions``) and streams OpenAI ``chat.completion.chunk`` dicts back. The last
chunk carries ``usage`` (prompt and completion token counts). Keeping the seam in the OpenAI wire
format means the vLLM server backend forwards bodies untouched, the gateway passes responses
through unchanged, and the simulator is checked against the same shapes a real server produces.

Cancelling the consumer of `stream_chat` (leaving the ``async for`` early or being cancelled)
aborts the call at the engine.
"""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import BackendError, ContextTooLong, InvalidRequest
from .chat_options import prompt_cut
from .sampling import lax_whole

if TYPE_CHECKING:
    from ..resources.kv_sizing import KVCacheCapacity

ChatBody = Mapping[str, Any]
Chunk = dict[str, Any]

REPLICA_KEY = "fleetsched_replica"
"""Body key naming the replica of a multi-replica backend a call must go to (removed before the
body is sent on)."""
FALLBACK_KEY = "fleetsched_fallback"
"""Body key set beside `REPLICA_KEY` by a caller that sends the call elsewhere itself when that
replica fails it before its first chunk (the dispatcher, for a session's affinity): an
unreachable replica is then given up at once instead of after backing off (removed too)."""
AVOID_KEY = "fleetsched_avoid"
"""Body key naming a replica that a call routed by load does not go to: the one a session's call
just failed on, which the dispatcher falls back from (removed too). With no other replica to take
it, the call fails at once with `BackendUnavailable`: it had its attempts there."""
REQUEST_ID_KEY = "fleetsched_request_id"
"""Body key carrying the ID the gateway gave the call (its client's ``X-Request-Id``, or one of its
own): a vLLM server gets it as its ``X-Request-Id`` header, which names the request in the
server's logs and in its answer's ``id`` (removed too)."""
TEXT_PROMPT_KEY = "fleetsched_text_prompt"
"""Body key set on a text completion served as a chat call (the gateway's ``/v1/completions`` on
the sim and instant backends): its one message is the prompt, counted without the role and
chat-template framing of a chat message, as vLLM counts a text prompt (removed too)."""
PRIVATE_KEYS = (REPLICA_KEY, FALLBACK_KEY, AVOID_KEY, REQUEST_ID_KEY, TEXT_PROMPT_KEY)
"""The body keys above: fleetsched's own, never a client's (the gateway strips them)."""


class Received:
    """What a call collected whole has received so far, counted by its backend as the tokens
    come (`Backend.complete_chat`): a call cut short (cancelled, failed) is then charged and
    reported with the output the engine made for it, as a stream left early is.
    `prompt_tokens` is the engine's count of the prompt, 0 until one came. `sent`: the call has
    left the dispatcher's queue for its backend (one cut before used no engine time)."""

    __slots__ = ("output_tokens", "prompt_tokens", "sent")

    def __init__(self) -> None:
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.sent = False


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What an engine says about its own load; None where the backend cannot tell."""

    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None


class Backend(ABC):
    """A model backend. Subclasses implement `stream_chat`; the rest has defaults."""

    #: Short name used in statistics, metrics and logs.
    name: str = "backend"

    @abstractmethod
    def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        """Stream the chunks of one chat completion for `body`.

        Yields ``chat.completion.chunk`` dicts; the final one has ``usage`` set. Raises
        `fleetsched.errors.BackendError` subclasses for failures of the backend itself.
        ``"stream": False`` in `body` says the caller collects the whole answer and looks only at
        when the first chunk and the last arrive: a backend may then send the tokens after the
        first in fewer chunks. Without it, stream as the engine produces.
        """

    async def complete_chat(self, body: ChatBody, received: Received | None = None) -> tuple[dict[str, Any], float | None]:
        """One chat completion collected whole (`body` says ``"stream": False``): the
        ``chat.completion`` response dict and the time on the anyio clock its first token came
        (None if none did). The dispatcher's `chat` calls this. By default `stream_chat`, read
        to its end (`collect_stream`); a backend may do it more cheaply. Cancelling it aborts
        the request, as leaving a stream does; `received` then holds the output the call had
        received (at least when it ends, however it ends)."""
        return await collect_stream(self.stream_chat(body), received)

    async def signals(self) -> EngineSignals:
        """The engine's current load signals (used to size the in-flight window)."""
        return EngineSignals()

    async def kv_capacities(self) -> dict[str, KVCacheCapacity]:
        """Each replica's KV cache, by replica name (``resources.kv_cache`` sizes the memory pool
        from them). Raises `BackendError` for a backend that has none to report."""
        raise BackendError(f"the {self.name} backend reports no KV cache to size the memory pool from (resources.kv_cache)")

    def kv_capacities_seen(self) -> dict[str, KVCacheCapacity]:
        """Each replica's KV cache as the backend last saw it while running (a vLLM server's
        /metrics, read in `signals`), which a restarted replica may have changed since
        `kv_capacities`; empty where it does not watch them."""
        return {}

    def replicas_down(self) -> frozenset[str]:
        """The replicas that take no calls now (a vLLM server's whose circuit breaker is open):
        the scheduler admits no new session to their devices meanwhile. Empty where it cannot tell."""
        return frozenset()

    async def served_model(self) -> str | None:
        """The model a call that names none asks for, where the backend knows better than the
        settings' ``backend.model`` default (a vLLM server's own list); None: it does not."""
        return None

    async def max_model_len(self) -> int | None:
        """The model's context in tokens, where the backend learns it from its engine rather than
        the settings (a vLLM server's own list); None: it does not."""
        return None

    async def aclose(self) -> None:
        """Release connections and engines. Idempotent."""

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


#: The model name a call that names none goes out with, where the backend knows no other (the
#: tiny test model's ``--served-model-name``; `VLLMServerBackend` asks its servers instead).
DEFAULT_MODEL = "fleetsched-tiny"

_ids = itertools.count(1)


def new_completion_id(body: ChatBody | None = None) -> str:
    """The answer's ``id``: ``chatcmpl-`` and the call's request ID where it has one (`body`'s
    `REQUEST_ID_KEY`: the ``X-Request-Id`` it came with), as vLLM's server names it; else one
    numbered in this process."""
    request_id = None if body is None else body.get(REQUEST_ID_KEY)
    if isinstance(request_id, str) and request_id:
        return f"chatcmpl-{request_id}"
    return f"chatcmpl-fs{next(_ids)}"


def make_chunk(
    completion_id: str,
    model: str,
    created: int,
    *,
    content: str | None = None,
    role: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    usage: Mapping[str, int] | None = None,
) -> Chunk:
    """Build one ``chat.completion.chunk`` dict in the OpenAI wire format."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    chunk: Chunk = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        # logprobs and stop_reason null, as vLLM sends them (code that indexes the raw dict finds them).
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}] if delta or finish_reason else [],
    }
    if usage is not None:
        chunk["usage"] = dict(usage)
    return chunk


def checked_stream_options(body: ChatBody) -> Mapping[str, Any]:
    """The call's own ``stream_options`` (none: empty); `InvalidRequest` for one that is not an
    object ([] and "" too), as vLLM refuses it."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidRequest(f"stream_options: expected an object, got {options!r:.80}")
    return options


def wants_continuous_usage(body: ChatBody) -> bool:
    """Whether a streamed call asks for usage on every chunk: as vLLM's server takes it, both
    ``stream_options.include_usage`` and ``continuous_usage_stats``."""
    options = body.get("stream_options")
    if options is None:  # the usual: spared the check against the Mapping ABC (about 3,000 instructions)
        return False
    return bool(isinstance(options, Mapping) and options.get("include_usage") and options.get("continuous_usage_stats"))


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def collect_chat(chunks: Iterable[Chunk]) -> dict[str, Any]:
    """Fold streamed chunks into one non-streamed ``chat.completion`` response dict, one choice per
    choice index the chunks carry (a call with ``n`` > 1 streams its choices interleaved)."""
    completion_id, model, created = "", "", 0
    choices: dict[int, _Choice] = {}
    usage: dict[str, int] | None = None
    extras: dict[str, Any] = {}
    for chunk in chunks:
        completion_id = chunk.get("id", completion_id)
        model = chunk.get("model", model)
        created = chunk.get("created", created)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for key in _RESPONSE_EXTRAS:
            if chunk.get(key) is not None:
                extras[key] = chunk[key]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            folded = choices.get(index)
            if folded is None:
                folded = choices[index] = _Choice()
            folded.add(choice)
    response = chat_completion(completion_id, model, created, {}, "stop", usage or usage_dict(0, 0))
    response["choices"] = [choice.result(index) for index, choice in sorted(choices.items())] or [_Choice().result(0)]
    response.update(extras)
    return response


#: The fields of a streamed answer's chunks that vLLM's non-streamed answer has at its top level:
#: ``system_fingerprint`` (on its last chunk), and with ``return_token_ids`` / ``return_prompt_text``,
#: ``prompt_token_ids`` and ``prompt_text`` (on its first). They were dropped: a call collected
#: whole lost them, which a direct non-streamed call to the server has.
_RESPONSE_EXTRAS = ("system_fingerprint", "prompt_token_ids", "prompt_text")


#: The delta fields `_Choice` folds on their own (the rest of its text is joined as it comes).
_FOLDED_APART = frozenset({"role", "content", "tool_calls"})


class _Choice:
    """One choice of a streamed answer, folded: its content, tool calls and finish reason, and
    the other text its deltas carry (a reasoning model's ``reasoning``, or ``reasoning_content``
    as older vLLM servers name it) with the ``stop_reason``, as vLLM's non-streamed answer has
    them (they were dropped: a reasoning model's thinking reached a streaming caller only)."""

    __slots__ = ("content", "texts", "tool_calls", "finish_reason", "stop_reason", "logprobs", "token_ids")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.texts: dict[str, list[str]] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: dict[str, list[Any]] | None = None
        self.token_ids: list[int] | None = None  # with ``return_token_ids``: each chunk's, joined

    def add(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        for key, value in delta.items():
            if key not in _FOLDED_APART and isinstance(value, str) and value:
                self.texts.setdefault(key, []).append(value)
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]
        for call in delta.get("tool_calls") or ():
            slot = self.tool_calls.setdefault(
                call.get("index", 0),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.logprobs = merge_logprobs(self.logprobs, choice.get("logprobs"))
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list):
            if self.token_ids is None:
                self.token_ids = []
            self.token_ids.extend(token_ids)

    def result(self, index: int) -> dict[str, Any]:
        """The choice as a ``chat.completion`` response lists it."""
        content = "".join(self.content) if self.content or not self.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        message.update((key, "".join(parts)) for key, parts in self.texts.items())
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        result = {"index": index, "message": message, "logprobs": self.logprobs, "finish_reason": self.finish_reason or "stop", "stop_reason": self.stop_reason}
        if self.token_ids is not None:  # as vLLM's non-streamed choice has them (``return_token_ids``)
            result["token_ids"] = self.token_ids
        return result


def merge_logprobs(folded: dict[str, list[Any]] | None, part: Any) -> dict[str, list[Any]] | None:
    """The log probabilities of a streamed choice so far, with those of its next chunk appended.

    A chunk carries those of its own tokens, as lists: ``{"content": [...]}`` in a chat chunk,
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` in a text completion's (its
    offsets already count from the start of the text). The answer collected whole has them all."""
    if not isinstance(part, Mapping):
        return folded
    folded = {} if folded is None else folded
    for key, items in part.items():
        if isinstance(items, list):
            folded.setdefault(key, []).extend(items)
    return folded


def model_list(model: str, max_model_len: int | None = None) -> dict[str, Any]:
    """The ``/v1/models`` answer for one served model, in the OpenAI wire format; with its
    context in tokens where known, as vLLM's server lists it (``max_model_len``: clients size
    their prompts by it)."""
    entry: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "fleetsched"}
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return {"object": "list", "data": [entry]}


def chat_completion(
    completion_id: str, model: str, created: int, message: dict[str, Any], finish_reason: str, usage: dict[str, int]
) -> dict[str, Any]:
    """One non-streamed ``chat.completion`` response dict in the OpenAI wire format."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "usage": usage,
    }


async def collect_stream(stream: AsyncIterator[Chunk], received: Received | None = None) -> tuple[dict[str, Any], float | None]:
    """Read a chat stream to its end: (the ``chat.completion`` response dict, the time on the
    anyio clock its first token came, or None). Leaving early closes the stream (`abort_stream`).

    `received` counts the output as it comes: the engine's count where a chunk carries usage
    (``stream_options.continuous_usage_stats``, with the prompt's count), else one token for
    each chunk with content."""
    chunks: list[Chunk] = []
    first: float | None = None
    try:
        async for chunk in stream:
            if first is None and chunk.get("choices"):
                first = anyio.current_time()
            chunks.append(chunk)
            if received is not None:
                received.output_tokens = output_so_far(chunk, received.output_tokens)
                usage = chunk.get("usage")
                if usage:
                    received.prompt_tokens = usage.get("prompt_tokens") or 0
    except BaseException:
        await abort_stream(stream)
        raise
    return collect_chat(chunks), first


def forced_call_content(response: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """`response`, collected from a stream, with the content vLLM's own non-streamed answer gives a
    call whose ``tool_choice`` forces a tool call ("required" or a named tool): "" beside its
    ``tool_calls``, not None. The stream cannot tell: it streams the same as for "auto", whose
    answer has None there. (Through a vLLM server the content was None, where the server itself
    and the sim answer "": ``message.content.strip()`` passed on the sim and failed on vLLM.)"""
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return response
    for answered in response.get("choices") or ():
        message = answered.get("message")
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = ""
    return response


def output_so_far(chunk: Chunk, before: int, tokens_per_chunk: int = 1) -> int:
    """The output a call has received with `chunk`, `before` it: the engine's count where the
    chunk carries usage, else `tokens_per_chunk` more for a chunk with content (an estimate,
    which the usage at the end corrects). Never less than `before`."""
    usage = chunk.get("usage")
    if usage:
        return max(before, usage.get("completion_tokens") or 0)
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return before + tokens_per_chunk
    return before


async def abort_stream(stream: AsyncIterator[Chunk]) -> None:
    """Close a backend's stream so the engine aborts the call; shielded, bounded cleanup.

    Raises `RuntimeError` for a stream another task is reading: it cannot be closed under that
    read (Python's own error said only that ``aclose()`` found the generator running)."""
    if getattr(stream, "ag_running", None) is False and getattr(stream, "ag_frame", True) is None:
        return  # exhausted: nothing to abort
    if getattr(stream, "ag_running", False):
        raise RuntimeError(
            "a model call's stream was closed while another task was reading it: read a stream "
            "inside its block, and let the block end after the task that reads it"
        )
    with anyio.move_on_after(5, shield=True):
        await stream.aclose()  # type: ignore[attr-defined]


def estimate_prompt_tokens(body: ChatBody) -> int:
    """A cheap estimate of a request's prompt tokens (about 4 characters a token), for a chat
    body (``messages``) or a completions body (``prompt``).

    Used for ordering and fair-share accounting before the engine has counted; the engine's
    own ``usage`` replaces it once the call completes. Raises `InvalidRequest`, naming the
    message, for messages that vLLM's server refuses (see `invalid_messages`).

    A body with ``messages`` is a chat body, counted by its messages whatever else it holds: a
    stray ``prompt`` beside them (the engine ignores it) must not make a long chat call look
    short to the rate limits and the fair share. A prompt cut by ``truncate_prompt_tokens`` (N
    tokens kept) counts at most N.
    """
    messages = body.get("messages")
    if messages is None:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return _truncated(body, max(1, len(prompt) // 4))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return _truncated(body, max(1, len(prompt[0]) // 4))
        messages = ()
    chars = len(tools_text(body.get("tools")))
    framing = 0 if body.get(TEXT_PROMPT_KEY) else 16  # role and chat-template tokens, a message
    try:
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(map(len, content_part_texts(content)))
            elif content is not None:
                raise TypeError
            if not isinstance(message.get("role"), str):
                raise TypeError
            chars += framing
            calls = message.get("tool_calls")
            if calls:  # an assistant's calls of tools: the chat template writes them out
                chars += sum(map(len, tool_call_texts(calls)))
    except (AttributeError, TypeError):  # checked here, where they are read anyway: no cost when right
        raise invalid_messages(messages) from None
    return _truncated(body, max(1, chars // 4))


def _truncated(body: ChatBody, tokens: int) -> int:
    """`tokens`, or the ``truncate_prompt_tokens`` that `body` cuts its prompt to, if fewer (-1,
    the model's context, is left to the engine; a size that is no count, to the checks)."""
    size = prompt_cut(body)
    if size is not None and 0 < size < tokens:
        return size
    return tokens


def tool_call_texts(calls: Any) -> Iterator[str]:
    """The text of an assistant message's ``tool_calls`` that its prompt holds: each call's
    function name and arguments (a chat template writes them out; what else it adds of its own
    is not counted). Parts that are not text count nothing: vLLM's server checks them."""
    if not isinstance(calls, list):
        return
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    yield function[key]


def tools_text(tools: Any) -> str:
    """The text of a chat request's ``tools`` that its prompt holds: a chat template writes each
    tool's function out as JSON, one a line (the tiny model's does, as tool-calling models'
    templates do); what else it adds of its own is not counted. A tool of another shape counts
    nothing: vLLM's server checks them."""
    if not tools or not isinstance(tools, list):
        return ""
    lines = []
    for tool in tools:
        if isinstance(tool, Mapping):
            try:
                lines.append(json.dumps(tool.get("function", tool), ensure_ascii=False) + "\n")
            except (TypeError, ValueError):  # not JSON: refused by the checks
                continue
    return "".join(lines)


def content_part_texts(parts: list[Any]) -> Iterator[str]:
    """The text of each of a message's content parts: a text part's ``text``, or a bare string,
    which vLLM's chat parser takes as text too; other parts (images, ...) have none here.
    Raises `TypeError` for a part that is neither, or a ``text`` that is not a string."""
    for part in parts:
        if isinstance(part, str):
            yield part
        elif isinstance(part, Mapping):
            text = part.get("text", "")
            if not isinstance(text, str):
                raise TypeError
            yield text
        else:
            raise TypeError


def invalid_messages(messages: object) -> InvalidRequest:
    """The error for chat messages that vLLM's server refuses (a 400), naming the first wrong one:
    a message that is not an object, a ``role`` that is not a string (missing included), a
    ``content`` that is not a string, a list of content parts or null, a part that is neither an
    object nor a string, or a part's ``text`` that is not a string."""
    if isinstance(messages, (list, tuple)):
        for i, message in enumerate(messages):
            problem = _message_problem(message)
            if problem is not None:
                return InvalidRequest(f"messages.{i}{problem}")
    return InvalidRequest(f"messages: expected a list of {{role, content}} objects with text content, got {messages!r:.80}")


def _message_problem(message: object) -> str | None:
    """What is wrong with one chat message (the field's path after ``messages.N``), or None."""
    if not isinstance(message, Mapping):
        return f": expected a {{role, content}} object, got {type(message).__name__}"
    role = message.get("role")
    if not isinstance(role, str):
        return ".role: missing" if role is None else f".role: expected a string, got {type(role).__name__}"
    content = message.get("content")
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f".content: expected a string, a list of content parts or null, got {type(content).__name__}"
    for j, part in enumerate(content):
        if not isinstance(part, (str, Mapping)):
            return f".content.{j}: expected a content part object, got {type(part).__name__}"
        if isinstance(part, Mapping) and not isinstance(part.get("text", ""), str):
            return f".content.{j}.text: expected a string, got {type(part['text']).__name__}"
    return None


#: The most completion tokens a call may ask for, as vLLM's server and the gateway take them (a
#: 32-bit count): a larger count went into float sums in the dispatcher's rate limits and fair
#: share, where a refused 10**30 wiped out the tenant's real figures.
MAX_TOKENS_LIMIT = 2**31 - 1


def requested_max_tokens(body: ChatBody, default: int = 256) -> int:
    """The completion tokens `body` asks for (``max_completion_tokens``, else ``max_tokens``), or
    `default` where it names none (absent or null); raises `InvalidRequest` for a value that is
    not a count from 1 to `MAX_TOKENS_LIMIT` (vLLM's server refuses 0 too)."""
    field = max_tokens_field(body)
    value = body.get(field)
    if value is None:
        return default
    count = value if type(value) is int else lax_whole(value)  # as vLLM's server reads it: "8" and 8.0 are 8, true is 1; 2.5 is refused
    if count is None or count < 1:
        raise InvalidRequest(f"{field}: expected an integer >= 1, got {value!r:.80}")
    if count > MAX_TOKENS_LIMIT:
        raise InvalidRequest(f"{field}: expected at most {MAX_TOKENS_LIMIT}, got {value!r:.80}")
    return count


def max_tokens_field(body: ChatBody) -> str:
    """The field that limits the completion in `body`: ``max_completion_tokens`` where given (it
    wins, as in vLLM), else ``max_tokens``."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def checked_stream_interval(value: object) -> int:
    """`value` as a request's ``stream_interval`` (tokens a streamed chunk): an integer >= 1, as
    vLLM takes it; raises `InvalidRequest` naming the field otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(f"stream_interval: expected an integer >= 1, got {value!r:.80}")
    return value


def completion_room(max_model_len: int, prompt_tokens: int, max_tokens: int, field: str = "max_tokens") -> int:
    """The completion tokens a call gets in a context of `max_model_len`, as vLLM's OpenAI
    server (0.32) decides: `max_tokens` cut to what the prompt leaves of the context (the answer
    then ends with ``finish_reason "length"``). Raises `ContextTooLong` where the server refuses
    the call: a prompt that fills the context, or a `max_tokens` larger than the whole context
    (named as `field`, the one the call sent: `max_tokens_field`)."""
    if prompt_tokens >= max_model_len:
        raise ContextTooLong(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt takes "
            f"{prompt_tokens}, which leaves no room for the completion; shorten the prompt"
        )
    if max_tokens > max_model_len:
        raise ContextTooLong(f"{field}={max_tokens} cannot be greater than the model's maximum context length ({max_model_len})", param=field)
    return min(max_tokens, max_model_len - prompt_tokens)


#: How vLLM words a request that does not fit the model's context (prompt, or prompt + max_tokens).
_CONTEXT_MARKERS = ("maximum context length", "maximum model length", "max_model_len")


def invalid_request(message: str, param: str | None = None) -> InvalidRequest:
    """The error for a body the engine refused: `ContextTooLong` when `message` (the engine's
    own words) says the request does not fit the model's context, else `InvalidRequest`;
    `param`, the field the engine named."""
    if any(marker in message for marker in _CONTEXT_MARKERS):
        return ContextTooLong(message, param=param)
    return InvalidRequest(message, param=param)
