"""The sampling parameters of a chat body, checked as vLLM's OpenAI server refuses them (a 400).

The sim must refuse what vLLM refuses, or an agent developed against it fails on its first call
to vLLM; the in-process engine must refuse them before they reach the engine core, which checks
the types only when it decodes the request, in its own thread: a float seed there killed that
thread, and every later call of every session hung.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidRequest


def _is_int(value: object) -> bool:
    """An integer the engine takes: 64-bit (a larger seed was vLLM's EngineGenerateError)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_stop(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _between(low: float, high: float) -> Callable[[object], bool]:
    return lambda value: _is_number(value) and low <= value <= high  # type: ignore[operator]


#: Per key: whether a value is one vLLM 0.32 takes (its SamplingParams' ranges), and what it
#: takes in words. A key absent or null is left to the engine's default.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_between(0.0, 2.0), "a number from 0 to 2"),
    "top_p": (lambda v: _is_number(v) and 0.0 < v <= 1.0, "a number over 0, at most 1"),
    "min_p": (_between(0.0, 1.0), "a number from 0 to 1"),
    "presence_penalty": (_between(-2.0, 2.0), "a number from -2 to 2"),
    "frequency_penalty": (_between(-2.0, 2.0), "a number from -2 to 2"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0.0, "a number over 0"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer, 0 (or -1) for none or at least 1"),
    "seed": (_is_int, "a 64-bit integer"),
    "min_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "stop": (_is_stop, "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of token IDs (integers)"),
    # Every call reaches the engine streamed (the dispatcher observes its first token), and vLLM
    # refuses prompt log probabilities on a stream: its 400 spoke of a stream=True never sent.
    "prompt_logprobs": (lambda v: v == 0 and _is_int(v), "0 or none: fleetsched streams every call, and vLLM serves no prompt log probabilities on a stream"),
}
#: The keys `check_sampling` looks at: those of `RULES`, and those `_check_pairs` does.
_KEYS = frozenset(RULES) | {"top_logprobs", "tools", "tool_choice"}


def rule_problem(body: Mapping[str, Any], key: str) -> tuple[str, str] | None:
    """(`key`, what is wrong) if `body`'s value for `key` breaks its rule in `RULES`, else None."""
    value = body.get(key)
    ok, expected = RULES[key]
    if value is None or ok(value):
        return None
    return key, f"expected {expected}, got {value!r:.80}"


def check_sampling(body: Mapping[str, Any], max_tokens: int) -> None:
    """Raise `InvalidRequest` naming the first sampling parameter of `body` that vLLM would
    refuse (of the wrong type or out of range; ``min_tokens`` over `max_tokens`, the completion
    length the call gets). A body with none of them costs one set test."""
    if _KEYS.isdisjoint(body):
        return
    for key in RULES:
        problem = rule_problem(body, key)
        if problem is not None:
            raise InvalidRequest(f"{problem[0]}: {problem[1]}")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens: expected at most max_tokens ({max_tokens}), got {min_tokens}")
    _check_pairs(body)


def _check_pairs(body: Mapping[str, Any]) -> None:
    problem = pairs_problem(body)
    if problem is not None:
        raise InvalidRequest(f"{problem[0]}: {problem[1]}")


def pairs_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM's chat request validators refuse across fields, as (the field, what is wrong),
    or None: `top_logprobs` without `logprobs`, `tool_choice` without `tools`, of an unknown
    kind or naming none of them, `tools` empty or of the wrong shape."""
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        if not _is_int(top_logprobs) or top_logprobs < -1:
            return "top_logprobs", f"expected an integer >= 0 (or -1 for all), got {top_logprobs!r:.80}"
        if top_logprobs != 0 and not body.get("logprobs"):
            return "top_logprobs", "needs logprobs set to true"
    tools = body.get("tools")
    if tools == []:
        return "tools", "expected at least one tool (or no tools field)"
    choice = body.get("tool_choice")
    if choice is not None and choice != "none":
        if tools is None:
            return "tool_choice", "needs tools"
        if choice not in ("auto", "required"):
            if not isinstance(choice, Mapping):
                return "tool_choice", f'expected "none", "auto", "required" or a named tool, got {choice!r:.80}'
            problem = _named_tool_problem(choice, tools)
            if problem is not None:
                return problem
    return _tools_problem(tools)  # after tool_choice, as vLLM checks its fields after it


def _tools_problem(tools: object) -> tuple[str, str] | None:
    """What vLLM refuses in `tools` (absent: nothing), each ``{"type": "function", "function":
    {"name": ...}}``: (the field, what is wrong), or None."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools", f"expected a list of tools, got {tools!r:.80}"
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            return f"tools.{i}", f'expected an object ({{"type": "function", "function": {{"name": ...}}}}), got {tool!r:.80}'
        if tool.get("type", "function") != "function":
            return f"tools.{i}.type", f'expected "function", got {tool["type"]!r:.80}'
        function = tool.get("function")
        if not isinstance(function, Mapping):
            return f"tools.{i}.function", f'expected an object ({{"name": ...}}), got {function!r:.80}'
        if not isinstance(function.get("name"), str):
            return f"tools.{i}.function.name", f"expected the tool's name, got {function.get('name')!r:.80}"
    return None


def _named_tool_problem(choice: Mapping[str, Any], tools: object) -> tuple[str, str] | None:
    """What vLLM's `check_tool_usage` refuses in a named `tool_choice`, ``{"type": "function",
    "function": {"name": ...}}``: (the field, what is wrong), or None if it names one of `tools`."""
    function = choice.get("function")
    if not isinstance(function, Mapping):
        return "tool_choice.function", f'expected an object naming one of the tools ({{"name": ...}}), got {function!r:.80}'
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return "tool_choice.function.name", f"expected the name of one of the tools, got {name!r:.80}"
    for tool in tools if isinstance(tools, list) else ():
        given = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(given, Mapping) and given.get("name") == name:
            return None
    return "tool_choice", f"names the tool {name!r:.80}, which is none of the tools given"
