"""The fields of a chat body that shape the prompt and the answer's text rather than its sampling:
the chat template's options, how the prompt is tokenised, echo, and the detokeniser's options.

`check_chat_options` refuses them as vLLM 0.32's OpenAI server (started with its default flags)
refuses them (a 400), for every backend; the rest read them as that server reads them, for the
in-process engine backend, which must hand vLLM what the server would (it checked a few of them,
then rendered and detokenised as if none were sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequest
from .sampling import is_flag, is_int, is_true, lax_int

#: The boolean fields, each with its default on vLLM's server (they are read laxly, as its
#: request model reads them: "yes" is true).
FLAGS: dict[str, bool] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "echo": False,
    "add_special_tokens": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "use_beam_search": False,
    "return_token_ids": False,
    "return_prompt_text": False,
}
#: The ``reasoning_effort`` values vLLM takes.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: vLLM's limits on a ``cache_salt`` (its `validate_cache_salt`).
MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
#: The fields of ``repetition_detection`` (vLLM's RepetitionDetectionParams).
_DETECTION_FIELDS = ("max_pattern_size", "min_pattern_size", "min_count")
#: The keys `check_chat_options` looks at.
_KEYS = frozenset(FLAGS) | {
    "watermarking", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "mm_processor_kwargs",
    "media_io_kwargs", "truncate_prompt_tokens", "truncation_side", "cache_salt", "thinking_token_budget",
    "repetition_detection", "vllm_xargs",
}  # fmt: skip


def flag(body: Mapping[str, Any], key: str) -> bool:
    """`body`'s boolean field `key` (one of `FLAGS`) as vLLM's server reads it: absent or null,
    its default. `body` must have passed `check_chat_options`."""
    value = body.get(key)
    return FLAGS[key] if value is None else is_true(value)


def prompt_cut(body: Mapping[str, Any]) -> int | None:
    """The ``truncate_prompt_tokens`` of `body` as vLLM's server reads it (laxly: "5" and 5.0 are
    5), None where it is absent or null. `body` must have passed `check_chat_options`."""
    value = body.get("truncate_prompt_tokens")
    return None if value is None else lax_int(value)


def check_chat_options(body: Mapping[str, Any]) -> None:
    """Raise `InvalidRequest` naming the first of `body`'s fields in this module's scope that
    vLLM's server refuses (`chat_options_problem`). A body with none of them costs one set test."""
    if _KEYS.isdisjoint(body):
        return
    problem = chat_options_problem(body)
    if problem is not None:
        raise InvalidRequest(f"{problem[0]}: {problem[1]}")


def chat_options_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM's server refuses in the fields of `body` that shape its prompt and its answer's
    text, as (the field, what is wrong), or None: a flag that is no boolean, or
    ``continue_final_message`` without ``add_generation_prompt`` set to false, then
    `_template_problem`, `_tokenize_problem` and `_extras_problem`."""
    for key in (*FLAGS, "watermarking"):
        value = body.get(key)
        if value is not None and not is_flag(value):
            return key, f"expected true or false, got {value!r:.80}"
    # vLLM refuses the two true together as sent ("no" is true there), then its template refuses
    # them as read (add_generation_prompt left out is true).
    both = body.get("continue_final_message") and body.get("add_generation_prompt")
    if both or (flag(body, "continue_final_message") and flag(body, "add_generation_prompt")):
        return "continue_final_message", "needs add_generation_prompt set to false (the model continues the last message, it starts no new one)"
    return _template_problem(body) or _tokenize_problem(body) or _extras_problem(body)


def _template_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM's server refuses in the chat template's fields: a template sent with the call,
    or per-call multimodal options (refused unless it was started trusting them), keyword
    arguments that are no object, ``documents`` that are no list of objects of strings, a
    ``reasoning_effort`` of none of `REASONING_EFFORTS`."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        return "chat_template_kwargs", f"expected an object of the template's variables, got {kwargs!r:.80}"
    templates = {"chat_template": body.get("chat_template"), "chat_template_kwargs.chat_template": (kwargs or {}).get("chat_template")}
    for field, template in templates.items():
        if template is not None:
            return field, "vLLM refuses a chat template sent with the call (unless its server trusts them: --trust-request-chat-template)"
    for field in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(field):
            return field, "vLLM refuses per-call multimodal options (unless its server trusts them: --trust-request-mm-kwargs)"
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, Mapping) and all(isinstance(v, str) for v in d.values()) for d in documents)
    ):
        return "documents", f'expected a list of objects of strings ({{"title": ..., "text": ...}}), got {documents!r:.80}'
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        return "reasoning_effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got {effort!r:.80}"
    return None


def _tokenize_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM's server refuses in the fields that tokenise the prompt: a
    ``truncate_prompt_tokens`` that is neither -1 nor an integer >= 1 (one past the model's
    context is left to the backend, which knows it), a ``truncation_side`` other than left or right, a
    ``cache_salt`` that is no string of 1 to `MAX_CACHE_SALT_LENGTH` characters without @, /, \\
    or NUL."""
    truncate = body.get("truncate_prompt_tokens")
    size = None if truncate is None else lax_int(truncate)  # read laxly, as vLLM's request model reads it: "5" is 5
    if truncate is not None and not (size is not None and (size >= 1 or size == -1)):
        # 0 (or false) passes vLLM's type check, then leaves an empty prompt, which it refuses.
        return "truncate_prompt_tokens", f"expected an integer >= 1 (the prompt tokens kept), or -1 for the model's context, got {truncate!r:.80}"
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        return "truncation_side", f'expected "left" or "right", got {side!r:.80}'
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_LENGTH and _CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
        return "cache_salt", f"expected a string of 1 to {MAX_CACHE_SALT_LENGTH} characters without @, /, \\ or NUL, got {salt!r:.80}"
    return None


def _extras_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM refuses in ``thinking_token_budget`` (no integer >= -1), ``repetition_detection``
    (sizes that are no integers >= 0, a minimum over the maximum, a count under 2 with a maximum
    set) and ``vllm_xargs`` (no object of strings, numbers and lists of them). Whether the
    engine was started to serve a thinking budget (a reasoning parser) is left to the engine."""
    budget = body.get("thinking_token_budget")
    if budget is not None and not (is_int(budget) and budget >= -1):
        return "thinking_token_budget", f"expected an integer >= 0, or -1 for none, got {budget!r:.80}"
    detection = body.get("repetition_detection")
    if detection is not None:
        if not isinstance(detection, Mapping):
            return "repetition_detection", f'expected an object ({{"max_pattern_size": ..., "min_count": ...}}), got {detection!r:.80}'
        sizes = repetition_sizes(detection)
        for key, value in sizes.items():
            if value is None or value < 0:
                return f"repetition_detection.{key}", f"expected an integer >= 0, got {detection[key]!r:.80}"
        if sizes["min_pattern_size"] > sizes["max_pattern_size"]:
            maximum, minimum = sizes["max_pattern_size"], sizes["min_pattern_size"]
            return "repetition_detection.min_pattern_size", f"expected at most max_pattern_size ({maximum}), got {minimum}"
        if sizes["max_pattern_size"] and sizes["min_count"] < 2:
            return "repetition_detection.min_count", f"expected at least 2 (the repeats that end the answer), got {sizes['min_count']}"
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        scalar = (str, int, float)
        if not isinstance(xargs, Mapping) or not all(
            isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(i, scalar) for i in v)) for v in xargs.values()
        ):
            return "vllm_xargs", f"expected an object of strings, numbers or lists of them, got {xargs!r:.80}"
    return None


def repetition_sizes(detection: Mapping[str, Any]) -> dict[str, int | None]:
    """The fields of a ``repetition_detection`` object as vLLM reads them (laxly: "2" and 2.0 are
    2; left out, 0), None for a value it refuses."""
    return {key: lax_int(detection.get(key, 0)) for key in _DETECTION_FIELDS}


# -- the fields as the engine takes them ------------------------------------------------------------


def _set(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` less what sets nothing, as vLLM merges template arguments: null, and "auto"."""
    return {key: value for key, value in kwargs.items() if value is not None and not (isinstance(value, str) and value == "auto")}


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's keyword arguments for `body`, merged as vLLM's server merges them: the
    call's ``chat_template_kwargs`` over ``tools``, under the fields that set the template's own
    options (``add_generation_prompt``, ``continue_final_message``, ``documents`` and
    ``reasoning_effort``, which turns ``enable_thinking`` on unless "none", where the call's
    arguments leave it out). `body` must have passed `check_chat_options`."""
    given = body.get("chat_template_kwargs") or {}
    effort = body.get("reasoning_effort")
    fields = {
        "add_generation_prompt": flag(body, "add_generation_prompt"),
        "continue_final_message": flag(body, "continue_final_message"),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in given:
        fields["enable_thinking"] = effort != "none"  # templates that think only when asked (Gemma 4's)
    return _set({"tools": body.get("tools")}) | _set(given) | _set(fields)


def output_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` for the fields of `body` that shape the
    answer's text and its end rather than the tokens sampled, as vLLM's server passes them:
    ``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
    ``watermarking``, ``thinking_token_budget``, ``repetition_detection`` (the keyword arguments
    of a ``RepetitionDetectionParams``) and ``vllm_xargs`` (as ``extra_args``, which custom
    logits processors read). Fields left out or null are absent. `body` must have passed
    `check_chat_options`."""
    params: dict[str, Any] = {}
    for key in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "watermarking"):
        if body.get(key) is not None:
            params[key] = is_true(body[key])
    if body.get("thinking_token_budget") is not None:
        params["thinking_token_budget"] = body["thinking_token_budget"]
    detection = body.get("repetition_detection")
    if detection is not None:
        params["repetition_detection"] = {key: size for key, size in repetition_sizes(detection).items() if key in detection}  # as read: "2" is 2
    if body.get("vllm_xargs"):
        params["extra_args"] = dict(body["vllm_xargs"])
    return params


def response_role(body: Mapping[str, Any]) -> str:
    """The role the answer comes with, as vLLM's server names it: the assistant's, or with no
    generation prompt, the last message's (the model goes on in that message's voice)."""
    if flag(body, "add_generation_prompt"):
        return "assistant"
    return str(body["messages"][-1]["role"])


def echoed(body: Mapping[str, Any], conversation: Sequence[Mapping[str, Any]], role: str) -> str:
    """The text `body` asks to have echoed before its answer, as vLLM's server echoes it: with
    ``echo``, the last message's content when that message is of the answer's `role` (the
    prefix that ``continue_final_message`` continues), else nothing. `conversation`: the
    messages as vLLM's parser made them, whose content is text or, for a template that reads
    content parts, text parts, given joined (the server's stream failed on them)."""
    if not flag(body, "echo") or not conversation or conversation[-1].get("role") != role:
        return ""
    content = conversation[-1].get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if isinstance(part, Mapping) and part.get("type") == "text")
