"""Request validation: a malformed body is a 400 that names the field, never a 500.

The fields the gateway reads, the sampling parameters (as vLLM 0.32 refuses them) and those that
commonly carry the wrong type are checked; the rest travel to the backend untouched (vLLM checks
its own extras and its 400 is passed through).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..backends.sampling import RULES, is_flag, is_true, lax_int, lax_whole, pairs_problem, rule_problem

class Invalid(ValueError):
    """A malformed request; `param` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


#: A JSON escape of a UTF-16 surrogate: valid only as the half of a pair (an emoji escaped, say).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_text(raw: bytes, body: Any) -> None:
    """Refuse a lone UTF-16 surrogate (``"\\ud800"`` unpaired) in any string of the request,
    naming where: no text holds one, and an answer echoing it could not be encoded. Looked for
    only when the raw body has such an escape at all (rarely: valid pairs have them too), or is
    not plain UTF-8 JSON (a BOM, UTF-16)."""
    if _SURROGATE_ESCAPE.search(raw) or raw[:1] not in b"{[ \t\r\n":
        where = _lone_surrogate(body, "")
        if where is not None:
            raise Invalid(where or None, "contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is not text")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """Where in `value` a string with a lone surrogate is (a dotted path), or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key, path) is not None:
            return path or "(a key)"
        found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _integer(body: dict[str, Any], name: str, low: int, high: int = 2**31 - 1, text: bool = True) -> int | None:
    """The integer `body` gives for `name`, read as vLLM's server reads it ("8" and 8.0 are 8,
    true is 1; no text where `text` is false), and written back as that integer for what reads
    the body after."""
    value = body.get(name)
    if value is None:
        return None
    count = None if isinstance(value, str) and not text else lax_whole(value)
    if count is None:
        raise Invalid(name, f"must be an integer, got {value!r:.40}")
    if not low <= count <= high:
        raise Invalid(name, f"must be between {low} and {high}, got {count}")
    body[name] = count
    return count


def _common(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise Invalid("model", "must be a string")
    for name in ("stream", "ignore_eos", "echo"):  # read as vLLM's server reads them ("yes", 1), written back as booleans
        if body.get(name) is not None:
            if not is_flag(body[name]):
                raise Invalid(name, "must be true or false")
            body[name] = is_true(body[name])
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Invalid("stream_options", "must be an object")
    # Its flags are booleans, as in vLLM's StreamOptions: the sim read them by truthiness ("no"
    # asked for usage on every chunk), and vLLM refused them without naming the field.
    for name in ("include_usage", "continuous_usage_stats"):
        if options and options.get(name) is not None and not isinstance(options[name], bool):
            raise Invalid(f"stream_options.{name}", "must be true or false")
    if options and not body.get("stream"):  # as vLLM and OpenAI answer it: no stream, no stream options
        raise Invalid("stream_options", "is only allowed when stream is true")
    _integer(body, "max_tokens", 1)
    _integer(body, "max_completion_tokens", 1)
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise Invalid("n", "only n=1 is served by this gateway; send n requests instead")
    # Checked here as vLLM refuses them, before the rate limits are taken: left to the engine,
    # a top_k of -5 from a tenant at its limit was answered 429 ("retry after"), not 400.
    for key in RULES:
        problem = rule_problem(body, key)
        if problem is not None:
            raise Invalid(*problem)
    min_tokens = lax_int(body.get("min_tokens"))
    limit = body.get("max_completion_tokens") or body.get("max_tokens")  # the first wins, as in vLLM
    if min_tokens is not None and limit is not None and min_tokens > limit:
        raise Invalid("min_tokens", f"expected at most max_tokens ({limit}), got {min_tokens}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise Invalid("user", "must be a string")
    # vLLM 0.32's server answers one that is not an object with a 500 ("'bool' object has no
    # attribute 'get'"), which the backend takes for a replica down: retried, and counted by its
    # circuit breaker, so five such calls of one tenant had every tenant's chat calls answered
    # 502 "circuit open" for `breaker_reset_s`.
    constraints = body.get("structured_outputs")
    if constraints is not None and not isinstance(constraints, dict):
        raise Invalid("structured_outputs", f'must be an object ({{"choice": ["yes", "no"]}}, say), got {constraints!r:.40}')


def check_chat(body: Any) -> dict[str, Any]:
    """The body of a ``/v1/chat/completions`` request, checked; raises `Invalid`."""
    if not isinstance(body, dict):
        raise Invalid(None, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Invalid(f"messages.{i}", "must be an object with `role` and `content`")
        # Any text, as vLLM's server takes it (its custom message: Llama 3's "ipython" tool role,
        # say); the model's chat template has the last word.
        if not isinstance(message.get("role"), str):
            raise Invalid(f"messages.{i}.role", "must be a string (user, assistant, system, tool, ...)")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            # A part is an object, or a bare string, which vLLM takes as a text part.
            if not isinstance(content, list) or not all(isinstance(p, (dict, str)) for p in content):
                raise Invalid(f"messages.{i}.content", "must be a string, a list of content parts or null")
            for j, part in enumerate(content):
                if isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
                    raise Invalid(f"messages.{i}.content.{j}.text", "must be a string")
    for name in ("tools", "functions"):
        value = body.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
            raise Invalid(name, "must be a list of objects")
    logprobs = body.get("logprobs")
    if logprobs is not None and not is_flag(logprobs):  # "yes" and 1 are true, as vLLM reads them
        raise Invalid("logprobs", "must be true or false")
    _needs(body)
    _common(body)
    return body


def _needs(body: Mapping[str, Any]) -> None:
    """The chat fields that need another, refused as vLLM's request validators refuse them."""
    problem = pairs_problem(body)
    if problem is not None:
        raise Invalid(*problem)


#: The answer's length a text completion gets when it names none, as vLLM's CompletionRequest.
COMPLETION_MAX_TOKENS = 16


def check_completion(body: Any) -> dict[str, Any]:
    """The body of a ``/v1/completions`` request, checked; raises `Invalid`."""
    if not isinstance(body, dict):
        raise Invalid(None, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if any(isinstance(token, (int, list)) for token in prompt):  # token ids, one prompt or several
            raise Invalid("prompt", "prompts of token ids are not served by this gateway; send the text")
        if len(prompt) != 1:
            raise Invalid("prompt", "exactly one prompt per request is served by this gateway")
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise Invalid("prompt", "must be a non-empty string")
    if body.get("suffix") is not None:  # as vLLM answers it
        raise Invalid("suffix", "is not supported")
    if body.get("max_tokens") is None:  # vLLM's CompletionRequest default (a chat call's is the context)
        body["max_tokens"] = COMPLETION_MAX_TOKENS
    # A stray chat field is ignored, as vLLM's completions endpoint ignores it, and dropped here:
    # left in, it made the prompt estimate count the messages, so a long prompt passed the
    # context check and the tokens-per-minute charge as a short one.
    # max_completion_tokens is chat's too: it made a text completion's max_tokens of 3 give 40.
    for chat_field in ("messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens"):  # a tool_choice made the sim answer a call
        body.pop(chat_field, None)
    # In a text completion `logprobs` is how many log probabilities to return per token (an
    # integer, as in vLLM's CompletionRequest: -1 for the whole vocabulary), not chat's flag.
    _integer(body, "logprobs", -1, text=False)  # vLLM's own check refuses "2" (true and 2.0 pass)
    _common(body)
    return body
