"""The tool call a chat request forces, as the sim answers it.

With ``tool_choice`` "required" or naming a tool, vLLM constrains the answer to a call of a tool
(structured output over the tools' parameter schemas) and returns it as ``tool_calls``. The sim
answers the call the model could least avoid: the named tool, or for "required" the first tool,
with arguments that fill the schema's required properties with the first value their schema
allows (an ``enum``'s first, a ``const``, a ``default``, else an empty value of the type). The
answer is as many tokens as what the model generates (the arguments, or for "required" the list
of calls) at `CHARS_PER_TOKEN` characters a token.

With "auto" (or no ``tool_choice``) the model may answer in text, and the sim's model does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from fleetsched.errors import InvalidRequest
from ._kv_cache import CHARS_PER_TOKEN

#: A type's empty value, for a property whose schema gives no value of its own.
_EMPTY: dict[str, Any] = {"string": "", "integer": 0, "number": 0, "boolean": False, "array": [], "null": None}

#: Nesting beyond which a schema's objects are answered empty (a schema may refer to itself).
_MAX_DEPTH = 8


class ForcedToolCall:
    """The call the sim answers a request whose ``tool_choice`` forces one.

    `named`: the request named the tool. The model then generates the arguments alone, and
    vLLM's answer ends with "stop"; for "required" it generates the list of calls,
    ``[{"name": ..., "parameters": ...}]`` (`text`), and the answer ends with "tool_calls". The
    arguments stream as the tokens come, in proportion.
    """

    __slots__ = ("name", "arguments", "named", "call_id", "tokens")

    def __init__(self, name: str, arguments: Any, named: bool, call_id: str) -> None:
        self.name = name
        self.arguments = json.dumps(arguments)  # as vLLM writes a parsed call's (", " and ": ")
        self.named = named
        self.call_id = call_id
        text = self.arguments if named else json.dumps([{"name": name, "parameters": arguments}])
        #: The answer's length: what the model generates, `CHARS_PER_TOKEN` characters a token.
        self.tokens = max(1, -(-len(text) // CHARS_PER_TOKEN))

    def arguments_of(self, start: int, end: int) -> str:
        """The arguments' text that tokens `start` to `end` make (the last token ends them)."""
        n = len(self.arguments)
        return self.arguments[n * start // self.tokens : None if end >= self.tokens else n * end // self.tokens]

    def delta(self, start: int, end: int) -> list[dict[str, Any]]:
        """A streamed chunk's ``tool_calls`` for tokens `start` to `end`, as vLLM streams them:
        the first names the call (its id, type and function name), the others add arguments."""
        function: dict[str, Any] = {"arguments": self.arguments_of(start, end)}
        call: dict[str, Any] = {"index": 0, "function": function}
        if start == 0:
            call["id"], call["type"] = self.call_id, "function"
            function["name"] = self.name
        return [call]

    def message_calls(self, tokens: int) -> list[dict[str, Any]]:
        """The answer's ``tool_calls`` after its first `tokens` tokens. Cut short, a named call
        has the arguments made so far; a "required" one none: vLLM parses the list of calls
        whole, and drops one that is not (its JSON unfinished)."""
        if tokens < self.tokens and not self.named:
            return []
        function = {"name": self.name, "arguments": self.arguments_of(0, tokens)}
        return [{"id": self.call_id, "type": "function", "function": function}]

    def prompt_text(self, tokens: int) -> str:
        """The answer after its first `tokens` tokens as the next turn's prompt holds it (see
        `tool_call_texts`): each of its calls' name and arguments."""
        return "".join(call["function"]["name"] + call["function"]["arguments"] for call in self.message_calls(tokens))


def forced_tool_call(body: Mapping[str, Any]) -> ForcedToolCall | None:
    """The tool call that `body` forces, or None (no ``tool_choice``, "none" or "auto"). The
    fields are checked already (`check_sampling`): a named tool is one of the tools."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    tools = body["tools"]
    if choice == "required":
        function = tools[0]["function"]
    else:
        name = choice["function"]["name"]
        function = next(t["function"] for t in tools if t["function"].get("name") == name)
    arguments = _example(function.get("parameters"), 0)  # a function's arguments are an object
    arguments = arguments if isinstance(arguments, dict) else {}
    try:
        return ForcedToolCall(function["name"], arguments, named=choice != "required", call_id=f"chatcmpl-tool-{uuid.uuid4().hex}")
    except (TypeError, ValueError):  # a schema's value that is no JSON (a default given from Python)
        raise InvalidRequest(f"tools: the parameters of {function['name']!r:.80} hold a value that is not JSON") from None


def _example(schema: Any, depth: int) -> Any:
    """A value that `schema` allows: its first listed value, else an empty one of its type (an
    object's required properties filled in)."""
    if not isinstance(schema, Mapping):
        return None
    for listed in ("const", "default"):
        if listed in schema:
            return schema[listed]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for union in ("anyOf", "oneOf"):
        options = schema.get(union)
        if isinstance(options, list) and options:
            return _example(options[0], depth)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = kind[0] if kind else None
    if kind == "object":
        properties = schema.get("properties")
        required = schema.get("required")
        if depth >= _MAX_DEPTH or not isinstance(properties, Mapping) or not isinstance(required, list):
            return {}
        return {name: _example(properties.get(name), depth + 1) for name in required if isinstance(name, str)}
    return _EMPTY.get(kind) if isinstance(kind, str) else None
