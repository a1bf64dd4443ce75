"""The sampling parameters of a chat body, checked as vLLM's OpenAI server refuses them (a 400).

The sim must refuse what vLLM refuses, or an agent developed against it fails on its first call
to vLLM; the in-process engine must refuse them before they reach the engine core, which checks
the types only when it decodes the request, in its own thread: a float seed there killed that
thread, and every later call of every session hung.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidRequest


def is_int(value: object) -> bool:
    """An integer the engine takes: 64-bit (a larger seed was vLLM's EngineGenerateError)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


#: The most stop strings vLLM 0.32 takes (its default VLLM_MAX_STOP_STRINGS).
MAX_STOP_STRINGS = 4


def lax_int(value: object) -> int | None:
    """`value` as vLLM's request model reads an integer field, in pydantic's lax mode (true is 1,
    2.0 is 2, "5" and " 5.0 " are 5), if 64-bit (a larger seed was vLLM's EngineGenerateError);
    None for a value it refuses (2.5, "x", inf, a list)."""
    count = lax_whole(value)
    return count if count is not None and -(2**63) <= count < 2**63 else None


def lax_whole(value: object) -> int | None:
    """`lax_int` without its 64-bit bounds: for a field whose own bounds a caller names."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            try:
                value = float(value.strip())
            except ValueError:
                return None
    if isinstance(value, float):
        if not (math.isfinite(value) and value == int(value)):
            return None
        value = int(value)
    return int(value) if isinstance(value, int) else None  # true is 1


def lax_number(value: object) -> float | None:
    """`value` as vLLM's request model reads a number field, in pydantic's lax mode (true is 1.0,
    "0.5" is 0.5); None for a value it refuses. Infinities and NaN come back as they are: vLLM
    parses "inf" and then refuses it as out of range, as `RULES` do."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) else None


def _stop(value: object) -> object:
    """A ``stop`` vLLM takes: a non-empty string, or a list of at most `MAX_STOP_STRINGS` of them."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list) and len(value) <= MAX_STOP_STRINGS and all(isinstance(v, str) and v for v in value):
        return value
    return None


def _flag(value: object) -> bool | None:
    return is_true(value) if is_flag(value) else None


def _token_ids(value: object) -> list[int] | None:
    """A list of token IDs (integers >= 0, lax); a negative ID is out of every vocabulary, one
    past the model's end is left to vLLM."""
    if not isinstance(value, list):
        return None
    ids = [lax_int(v) for v in value]
    return None if any(i is None or i < 0 for i in ids) else ids  # type: ignore[return-value]


def _between(low: float, high: float) -> Callable[[float], bool]:
    return lambda value: low <= value <= high  # NaN and infinities fail


def _any(_: object) -> bool:
    return True


#: Per key: how vLLM's request model reads its value (None where it refuses the value's type),
#: whether the value read is one vLLM 0.32 takes (its SamplingParams' ranges), and what it takes
#: in words. A key absent or null is left to the engine's default. Values are read laxly, as
#: the server reads them: temperature "0.5", seed "5", top_k 2.0 and ignore_eos "yes" are taken
#: there, and the sim refused them.
RULES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], bool], str]] = {
    "temperature": (lax_number, _between(0.0, 2.0), "a number from 0 to 2"),
    "top_p": (lax_number, lambda v: 0.0 < v <= 1.0, "a number over 0, at most 1"),
    "min_p": (lax_number, _between(0.0, 1.0), "a number from 0 to 1"),
    "presence_penalty": (lax_number, _between(-2.0, 2.0), "a number from -2 to 2"),
    "frequency_penalty": (lax_number, _between(-2.0, 2.0), "a number from -2 to 2"),
    "repetition_penalty": (lax_number, lambda v: 0.0 < v < math.inf, "a number over 0"),
    "top_k": (lax_int, lambda v: v >= -1, "an integer, 0 (or -1) for none or at least 1"),
    "seed": (lax_int, _any, "a 64-bit integer"),
    "min_tokens": (lax_int, lambda v: v >= 0, "an integer >= 0"),
    "ignore_eos": (_flag, _any, "true or false"),
    "stop": (_stop, _any, f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them"),
    "stop_token_ids": (_token_ids, _any, "a list of token IDs (integers >= 0)"),
    # Every call reaches the engine streamed (the dispatcher observes its first token), and vLLM
    # refuses prompt log probabilities on a stream: its 400 spoke of a stream=True never sent.
    "prompt_logprobs": (lax_int, lambda v: v == 0, "0 or none: fleetsched streams every call, and vLLM serves no prompt log probabilities on a stream"),
}
#: The keys `check_sampling` looks at: those of `RULES`, and those `pairs_problem` and
#: `constraints_problem` do.
_KEYS = frozenset(RULES) | {"logprobs", "top_logprobs", "tools", "tool_choice"} | {
    "logit_bias", "bad_words", "allowed_token_ids", "logprob_token_ids", "response_format", "structured_outputs",
}  # fmt: skip


def rule_problem(body: Mapping[str, Any], key: str) -> tuple[str, str] | None:
    """(`key`, what is wrong) if `body`'s value for `key` breaks its rule in `RULES`, else None."""
    value = body.get(key)
    if value is None:
        return None
    read, ok, expected = RULES[key]
    taken = read(value)
    if taken is not None and ok(taken):
        return None
    return key, f"expected {expected}, got {value!r:.80}"


def sampling_values(body: Mapping[str, Any]) -> dict[str, Any]:
    """The values of `body`'s keys of `RULES`, as vLLM reads them (``"5"`` a seed of 5, ``"yes"``
    true), for a body `check_sampling` passed; absent and null keys left out."""
    return {key: RULES[key][0](body[key]) for key in RULES if body.get(key) is not None}


def check_sampling(body: Mapping[str, Any], max_tokens: int) -> None:
    """Raise `InvalidRequest` naming the first sampling parameter of `body` that vLLM would
    refuse (of the wrong type or out of range; ``min_tokens`` over `max_tokens`, the completion
    length the call gets; then `pairs_problem` and `constraints_problem`). A body with none of
    them costs one set test."""
    if _KEYS.isdisjoint(body):
        return
    for key in RULES:
        problem = rule_problem(body, key)
        if problem is not None:
            raise InvalidRequest(f"{problem[0]}: {problem[1]}")
    min_tokens = lax_int(body.get("min_tokens"))
    if min_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens: expected at most max_tokens ({max_tokens}), got {min_tokens}")
    problem = pairs_problem(body) or constraints_problem(body)
    if problem is not None:
        raise InvalidRequest(f"{problem[0]}: {problem[1]}")


def pairs_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM's chat request validators refuse across fields, as (the field, what is wrong),
    or None: a `logprobs` that is no boolean ("yes", 1 and 0 are, as vLLM's request model reads
    them), `top_logprobs` without `logprobs`, `tool_choice` without `tools`, of an unknown kind
    or naming none of them, `tools` empty or of the wrong shape."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not is_flag(logprobs):
        return "logprobs", f"expected true or false, got {logprobs!r:.80}"
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        # As vLLM's request model reads an integer: 2.0 is 2 and true is 1 there.
        whole = isinstance(top_logprobs, (int, float)) and math.isfinite(top_logprobs) and top_logprobs == int(top_logprobs)
        if not whole or top_logprobs < -1:
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


def constraints_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM refuses in the fields that bias, ban, restrict or constrain the answer's tokens
    (`logit_bias`, `bad_words`, `allowed_token_ids`, `logprob_token_ids`, `response_format`,
    `structured_outputs`), as (the field, what is wrong), or None."""
    return (
        _logit_bias_problem(body.get("logit_bias"))
        or _token_lists_problem(body)
        or _response_format_problem(body.get("response_format"))
        or _structured_outputs_problem(body)
    )


#: The strings vLLM's request model reads as true or false (pydantic's lax booleans).
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_BOOL_WORDS = _TRUE_WORDS | {"0", "off", "f", "false", "n", "no"}
#: The most ``logprob_token_ids`` vLLM 0.32 takes (its MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128


#: The most ``top_logprobs`` a call may ask for (vLLM's default ``--max-logprobs``; -1, "all",
#: asks for the vocabulary, more than that).
MAX_LOGPROBS = 20


def requested_top_logprobs(body: Mapping[str, Any]) -> int | None:
    """How many alternatives a token a call asks for (``top_logprobs``; 0 without it), or None
    where it asks for no log probabilities. The body is checked by `check_sampling` first. Raises
    `InvalidRequest` naming the field for more than `MAX_LOGPROBS` or -1 (all), as a vLLM server
    with the default ``--max-logprobs`` refuses them (measured: 21 and -1 answered 400)."""
    if not is_true(body.get("logprobs")):  # a boolean (`check_sampling`): "yes", 1 and 0 too
        return None
    top = int(body.get("top_logprobs") or 0)  # an integer >= -1 (`check_sampling`; 2.0 and true too)
    if top == -1 or top > MAX_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs: at most {MAX_LOGPROBS} (vLLM's default --max-logprobs), got {top}"
            + (" (all of the vocabulary)" if top == -1 else "")
        )
    return top


def is_flag(value: object) -> bool:
    """A value vLLM's request model takes for a boolean: true, false, 0, 1 or a word for them."""
    if isinstance(value, str):
        return value.lower() in _BOOL_WORDS
    return isinstance(value, (bool, int, float)) and value in (0, 1)


def is_true(value: object) -> bool:
    """A value vLLM's request model reads as true (of those `is_flag` takes; None, absent, is not)."""
    return value.lower() in _TRUE_WORDS if isinstance(value, str) else value == 1


def _is_bias(value: object) -> bool:
    """A ``logit_bias`` value vLLM takes: any number (it clamps it to [-100, 100]; NaN and
    infinities too), true or false, or a string that reads as a number ("2", "inf")."""
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


def _token_id(key: object) -> int | None:
    """The token ID a ``logit_bias`` key names, read as vLLM reads it (``int(key)``: " 50",
    "+50" and "1_0" name one; a key travels as a JSON string, so an integer key is its own ID),
    or None if it names none."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


def _logit_bias_problem(bias: object) -> tuple[str, str] | None:
    """What vLLM refuses in `logit_bias` (null: nothing): not an object, a key that is no
    integer token ID or a negative one (out of every vocabulary), a value that is no number.
    An ID at or past the end of the model's vocabulary is refused by vLLM but served here:
    the sim knows no vocabulary size."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        return "logit_bias", f'expected an object of token IDs to biases ({{"50": -100}}), got {bias!r:.80}'
    for key, value in bias.items():
        token = _token_id(key)
        if token is None:
            return "logit_bias", f"expected integer token IDs as keys, got {key!r:.80}"
        if token < 0:
            return "logit_bias", f"token ID {token} is out of the vocabulary"
        if not _is_bias(value):
            return f"logit_bias.{key}", f"expected a number, got {value!r:.80}"
    return None


def _is_id(value: object) -> bool:
    """A token ID in a list vLLM takes: an integer >= 0 (true and false are 1 and 0 there)."""
    return isinstance(value, int) and value >= 0


def _token_lists_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM refuses in `bad_words` (not a list of non-empty strings: null too),
    `allowed_token_ids` (not a non-empty list of token IDs) and `logprob_token_ids` (not a list
    of at most `MAX_LOGPROB_TOKEN_IDS` token IDs, or some without `logprobs`). IDs past the end
    of the vocabulary, and bad words that make no token, are left to vLLM, as in `logit_bias`."""
    if "bad_words" in body:
        words = body["bad_words"]
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            return "bad_words", f"expected a list of non-empty strings, got {words!r:.80}"
    allowed = body.get("allowed_token_ids")
    if allowed is not None and not (isinstance(allowed, list) and allowed and all(map(_is_id, allowed))):
        return "allowed_token_ids", f"expected a non-empty list of token IDs (integers >= 0), got {allowed!r:.80}"
    ids = body.get("logprob_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(map(_is_id, ids)):
            return "logprob_token_ids", f"expected a list of token IDs (integers >= 0), got {ids!r:.80}"
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            return "logprob_token_ids", f"expected at most {MAX_LOGPROB_TOKEN_IDS} token IDs, got {len(ids)}"
        if ids and not body.get("logprobs"):
            return "logprob_token_ids", "needs logprobs set to true"
    return None


#: The ``response_format`` types vLLM takes.
_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _response_format_problem(form: object) -> tuple[str, str] | None:
    """What vLLM refuses in `response_format` (null: nothing): not an object, a type of none of
    `_FORMATS`, a ``json_schema`` type without ``json_schema`` or its ``schema``, a
    ``json_schema`` (with any type) without a ``name`` or of the wrong shape, a structural tag
    whose ``format`` is no object (without the older ``structures``). What a structural tag
    holds is left to vLLM's grammar engine, as whether a schema compiles."""
    if form is None:
        return None
    if not isinstance(form, Mapping):
        return "response_format", f'expected an object ({{"type": "json_object"}}, say), got {form!r:.80}'
    kind = form.get("type")
    if kind not in _FORMATS:
        return "response_format.type", f'expected "text", "json_object", "json_schema" or "structural_tag", got {kind!r:.80}'
    if kind == "structural_tag":
        if form.get("structures") is None and not isinstance(form.get("format"), Mapping):
            return "response_format.format", f'expected a structural tag (an object, or "structures" and "triggers"), got {form.get("format")!r:.80}'
        return None
    spec = form.get("json_schema")
    if spec is None:
        return ("response_format.json_schema", 'needed with type "json_schema": {"name": ..., "schema": {...}}') if kind == "json_schema" else None
    if not isinstance(spec, Mapping):
        return "response_format.json_schema", f'expected an object ({{"name": ..., "schema": {{...}}}}), got {spec!r:.80}'
    if not isinstance(spec.get("name"), str):
        return "response_format.json_schema.name", f"expected the schema's name (a string), got {spec.get('name')!r:.80}"
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, Mapping):
        return "response_format.json_schema.schema", f"expected a JSON schema (an object), got {schema!r:.80}"
    if spec.get("strict") is not None and not is_flag(spec["strict"]):
        return "response_format.json_schema.strict", f"expected true or false, got {spec['strict']!r:.80}"
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        return "response_format.json_schema.description", f"expected a string, got {spec['description']!r:.80}"
    if schema is None and kind == "json_schema":
        return "response_format.json_schema.schema", 'needed with type "json_schema": the JSON schema the answer must follow'
    return None


#: The constraints of ``structured_outputs`` (one, exactly), each with whether a value is one
#: vLLM's StructuredOutputsParams takes and what it takes in words; then its options.
_CONSTRAINTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "json": (lambda v: isinstance(v, (str, Mapping)), "a JSON schema (an object or its text)"),
    "regex": (lambda v: isinstance(v, str), "a string"),
    "choice": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(c, str) for c in v), "a list of strings"),
    "grammar": (lambda v: isinstance(v, str), "a string"),
    "json_object": (is_flag, "true"),
    "structural_tag": (lambda v: isinstance(v, str), "a string"),
}
_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "disable_any_whitespace": (is_flag, "true or false"),
    "disable_additional_properties": (is_flag, "true or false"),
    "whitespace_pattern": (lambda v: isinstance(v, str), "a string"),
}


def _structured_outputs_problem(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """What vLLM refuses in `structured_outputs` (null: nothing): not an object (a 500 there), a
    field of the wrong type, not exactly one constraint, another one than a json_object or
    json_schema `response_format` sets, an empty one (no choices, a blank grammar, schema or
    tag, json_object false, a NUL in a regex), or a json, regex or choice with a named
    `tool_choice`. Whether a schema, regex or grammar compiles is left to vLLM's grammar engine."""
    given = body.get("structured_outputs")
    if given is None:
        return None
    if not isinstance(given, Mapping):
        return "structured_outputs", f'expected an object ({{"choice": ["yes", "no"]}}, say), got {given!r:.80}'
    for key, (ok, expected) in (*_CONSTRAINTS.items(), *_OPTIONS.items()):
        value = given.get(key)
        if value is not None and not ok(value):
            return f"structured_outputs.{key}", f"expected {expected}, got {value!r:.80}"
    kinds = [key for key in _CONSTRAINTS if given.get(key) is not None]
    if len(kinds) != 1:
        return "structured_outputs", f"expected one constraint of {', '.join(_CONSTRAINTS)}, got {', '.join(kinds) or 'none'}"
    (kind,) = kinds
    form = body.get("response_format")
    overrides = {"json_object": "json_object", "json_schema": "json"}.get(form.get("type") if isinstance(form, Mapping) else None)
    if overrides is not None and overrides != kind:
        return "structured_outputs", f"expected no {kind} with a response_format that sets {overrides} (one constraint only)"
    value = given[kind]
    if overrides is None and (
        (kind == "choice" and not value) or (kind == "json_object" and not is_true(value)) or (kind != "regex" and isinstance(value, str) and not value.strip())
    ):
        return f"structured_outputs.{kind}", f"expected a constraint that is not empty, got {value!r:.80}"
    if kind == "regex" and "\x00" in value:
        return "structured_outputs.regex", "contains a NUL character"
    if kind in ("json", "regex", "choice") and isinstance(body.get("tool_choice"), Mapping):
        return "structured_outputs", "cannot be used with a named tool_choice (the constraint or the tool, not both)"
    return None


# -- the constraints as the engine takes them -------------------------------------------------------
#
# vLLM's server reads a request with pydantic (lax: "2" is 2.0, "yes" is true) and hands the engine
# a SamplingParams built from what it read. The in-process engine backend gets the raw body, checked
# by `constraints_problem`; these read it as the server does.


def _clamped_bias(value: object) -> float:
    """A ``logit_bias`` value as vLLM applies it: a float within [-100, 100] (NaN reads as -100
    there: ``max(-100.0, nan)`` is -100.0)."""
    return min(100.0, max(-100.0, float(value)))  # type: ignore[arg-type]


def constraint_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` for the fields of `body` that bias, ban,
    restrict or constrain the answer's tokens, as vLLM's server builds them from the same body:
    ``logit_bias`` (token ID to bias), ``bad_words``, ``allowed_token_ids``, and
    ``structured_outputs`` as the keyword arguments of a ``StructuredOutputsParams``
    (`structured_outputs_kwargs`). Fields left out or null are absent. `body` must have passed
    `constraints_problem`."""
    params: dict[str, Any] = {}
    bias = body.get("logit_bias")
    if bias is not None:
        params["logit_bias"] = {_token_id(key): _clamped_bias(value) for key, value in bias.items()}
    if body.get("bad_words"):
        params["bad_words"] = list(body["bad_words"])
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        params["allowed_token_ids"] = [int(token) for token in allowed]  # true and false are 1 and 0
    structured = structured_outputs_kwargs(body)
    if structured is not None:
        params["structured_outputs"] = structured
    return params


def structured_outputs_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments of vLLM's ``StructuredOutputsParams`` that `body`'s
    ``structured_outputs`` and ``response_format`` make, as vLLM's server merges them (a
    ``json_object`` or ``json_schema`` format sets its constraint over the other's; a
    ``structural_tag`` format goes as its JSON text), or None for no constraint."""
    given = body.get("structured_outputs")
    kwargs: dict[str, Any] = {}
    if given is not None:
        for key in _CONSTRAINTS.keys() | _OPTIONS.keys():  # vLLM's request model drops other keys
            value = given.get(key)
            if value is not None:
                kwargs[key] = is_true(value) if key in _FLAGS else value
    form = body.get("response_format")
    kind = form.get("type") if form is not None else None
    if kind == "json_object":
        kwargs["json_object"] = True
    elif kind == "json_schema":
        kwargs["json"] = form["json_schema"]["schema"]
    elif kind == "structural_tag":
        kwargs["structural_tag"] = json.dumps(form)
    return kwargs or None


#: The fields of ``structured_outputs`` that are booleans (read laxly, as vLLM's request model does).
_FLAGS = frozenset({"json_object", "disable_any_whitespace", "disable_additional_properties"})
