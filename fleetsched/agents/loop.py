"""A tool-calling agent loop in the OpenAI tool-call format.

The model asks for tools; the loop runs them (concurrently when several are asked), feeds the
results back as ``tool`` messages, and stops on an answer or a turn limit. The session's deadline
ends it as it ends the rest of the session (the scheduler cancels the session then: it fails with
`DeadlineExceeded`); a turn is not begun past it (``stopped == "deadline"``). A model call
refused for the tenant's rate limits or shed (`Overloaded`) is made again after the wait the
refusal names, a few times at most (`max_refusals`), where that wait ends before the session's
deadline and is at most `MAX_REFUSAL_WAIT_S`. Malformed model output never hangs or crashes the
loop: an unknown tool, arguments that are not JSON, a tool that raises, times out or returns
something that is not text, and an empty reply each become a clear error message in the
conversation, and the model gets another turn. A reply cut at `max_tokens` inside a tool call
does too: that call (the reply's last) is not run, its arguments being unfinished; the calls
before it are.

Where the model cannot be trusted to decide (a tiny random model in tests and benchmarks), a
`script` decides the tool calls turn by turn; the loop still makes every model call for real,
asking for text (``tool_choice`` "none"). Without a script the model's own calls are run: its
backend must parse them (vLLM's server started with ``--tool-call-parser``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from .._cancellation import stray_cancelled_error
from ..errors import Overloaded
from ..virtual_time import run_sync_in_thread
from .context import SessionContext

#: The longest wait a refused model call is made again after, in seconds; a refusal that asks for
#: longer is raised. A vLLM server's (or a proxy's) Retry-After is the wait: one of 86400 held a
#: session without a deadline asleep for a day, the refusal's reason unseen.
MAX_REFUSAL_WAIT_S = 300.0

ToolFn = Callable[..., Any]  # an async function, a callable returning an awaitable, or a plain function


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call: `fn(**arguments)`, at most `timeout_s` seconds.

    `fn` is an async function, or any callable returning an awaitable, which is awaited; a plain
    (synchronous) function runs in a worker thread, so that a blocking tool does not stall every
    other session of the event loop (past `timeout_s` the loop goes on without it; the thread
    ends in its own time). On a virtual clock the clock holds still while the thread works
    (`run_sync_in_thread`): the call takes no virtual time, and its `timeout_s` cannot pass
    meanwhile, so a plain function that never returns stalls the simulation.
    """

    name: str
    fn: ToolFn
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        # Checked here, where the mistake is made: once taken, every call of the tool would be an
        # error the model sees, or the model would be offered a function of a garbled name.
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a tool's name must be a non-empty str, got {self.name!r:.80}")
        if not callable(self.fn):
            raise TypeError(f"tool {self.name!r}: fn must be a function, got {self.fn!r:.80}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:  # also NaN
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0 seconds (inf: no limit), got {self.timeout_s!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"tool {self.name!r}: description must be a str, got {self.description!r:.80}")
        # The function's arguments are one JSON object: its schema is an object's (OpenAI's format).
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON schema of an object "
                f"({{\"type\": \"object\", \"properties\": {{...}}}}), got {self.parameters!r:.80}"
            )

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


@dataclass(slots=True)
class LoopResult:
    answer: str | None
    stopped: Literal["answer", "turn_limit", "deadline"]
    turns: int
    messages: list[dict[str, Any]]
    tool_errors: int = 0


#: One scripted turn: the tool calls to make, as {"name": ..., "arguments": dict or raw string}.
ScriptTurn = Sequence[Mapping[str, Any]]
_call_ids = itertools.count(1)


async def run_tool_loop(
    ctx: SessionContext,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Tool],
    *,
    max_turns: int = 8,
    max_tokens: int = 256,
    script: Sequence[ScriptTurn] | None = None,
    max_refusals: int = 3,
) -> LoopResult:
    """Run the loop from `messages`. Returns the answer and why the loop stopped.

    A model call refused (`Overloaded`, `RateLimited`) is made again after the refusal's
    `retry_after_s`, up to `max_refusals` times a call; the refusal after those, or one whose
    wait would pass the session's deadline or is longer than `MAX_REFUSAL_WAIT_S`, is raised.
    (Each failed the session at once, the turns done lost, though it said when the call would go
    through.)"""
    messages, tools, script = _check_arguments(messages, tools, max_turns, script)
    if isinstance(max_refusals, bool) or not isinstance(max_refusals, int) or max_refusals < 0:
        raise ValueError(f"max_refusals must be >= 0 (an integer), got {max_refusals!r}")
    by_name = {tool.name: tool for tool in tools}
    conversation = [dict(m) for m in messages]
    # No tools, no tools field: vLLM refuses an empty list.
    offered: dict[str, Any] = {"tools": [tool.schema() for tool in tools]} if tools else {}
    if offered and script is not None:
        # The script makes the calls: the model is asked for text ("none"), which every backend
        # serves. "auto" (none named) needs one that parses tool calls (vLLM's server started with
        # --tool-call-parser): vLLM's server without one, and the vllm-engine backend, refuse it.
        offered["tool_choice"] = "none"
    errors = 0
    for turn in range(max_turns):
        if anyio.current_time() >= ctx.deadline:
            return LoopResult(None, "deadline", turn, conversation, errors)
        response = await _chat(ctx, conversation, max_refusals, max_tokens=max_tokens, **offered)
        message = response["choices"][0]["message"]
        # Cut at max_tokens: a server streams a tool call as it is parsed, so the reply's last call
        # may be unfinished (vLLM's gave arguments "", which ran the tool with none, or half the
        # JSON, read as a malformed call), or held back whole (the reply read as empty).
        cut = response["choices"][0].get("finish_reason") == "length"
        calls = list(message.get("tool_calls") or ())
        if script is not None:
            calls = [_scripted_call(c) for c in script[turn]] if turn < len(script) else []
        if not calls:
            answer = message.get("content") or ""
            if answer.strip():
                conversation.append({"role": "assistant", "content": answer})
                return LoopResult(answer, "answer", turn + 1, conversation, errors)
            errors += 1
            said = f"your reply was cut at max_tokens ({max_tokens}) before any of it could be used" if cut else "your reply was empty"
            conversation.append({"role": "assistant", "content": ""})
            conversation.append({"role": "user", "content": f"error: {said}; answer, or call one of the tools"})
            continue
        conversation.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
        unfinished = cut and script is None  # the model's last call: those before it are complete
        ran = calls[:-1] if unfinished else calls
        results = await _run_calls(ctx, ran, by_name) if ran else []
        if unfinished:
            results.append(f"error: your reply was cut at max_tokens ({max_tokens}) in this call, its arguments unfinished: it was not run")
        errors += sum(result.startswith("error:") for result in results)
        for call, result in zip(calls, results):
            call_id = call.get("id", "") if isinstance(call, Mapping) else ""
            conversation.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return LoopResult(None, "turn_limit", max_turns, conversation, errors)


def _check_arguments(messages: Any, tools: Any, max_turns: Any, script: Any) -> tuple[list[Any], list[Tool], list[list[Any]] | None]:
    """Refuse what the loop cannot run, naming it, before its first model call (a misshapen
    argument failed later with an error about something else, and two tools of one name ran the
    second for both). Returns the messages, tools and script as lists: read once, so that a
    generator given for one is not used up by these checks."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise TypeError(f"messages: expected a list of {{role, content}} objects, got {messages!r:.80}")
    messages = list(messages)
    if not all(isinstance(m, Mapping) for m in messages):
        raise TypeError(f"messages: expected a list of {{role, content}} objects, got {messages!r:.80}")
    if isinstance(tools, (str, bytes, Mapping, Tool)) or not isinstance(tools, Iterable):
        raise TypeError(f"tools: expected a list of Tool, got {tools!r:.80}")
    tools = list(tools)
    names: set[str] = set()
    for tool in tools:
        if not isinstance(tool, Tool):
            raise TypeError(f"tools: expected a list of Tool, got {tool!r:.80} in it")
        if tool.name in names:
            raise ValueError(f"tools: two tools are named {tool.name!r}; the model calls a tool by its name")
        names.add(tool.name)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 (an integer), got {max_turns!r}")
    if script is None:
        return messages, tools, None
    if isinstance(script, (str, bytes, Mapping)) or not isinstance(script, Iterable):
        raise ValueError(f"script: expected a list of turns (each a list of tool calls), got {script!r:.80}")
    turns = []
    for turn, steps in enumerate(script):
        if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Iterable):
            raise ValueError(f"script turn {turn}: expected a list of tool calls, got {steps!r:.80}")
        checked = []
        for step in steps:
            if not isinstance(step, Mapping):
                raise ValueError(f"script turn {turn}: expected a list of tool calls, got {step!r:.80} in it")
            if "name" not in step:
                raise ValueError(f"script turn {turn}: a tool call needs a 'name', got {step!r:.80}")
            # A name that is no str (the Tool itself, say) went into the conversation as the call's
            # name: the sim took it, a vLLM server's body could not be sent ("not JSON serializable").
            if not isinstance(step["name"], str) or not step["name"]:
                raise ValueError(f"script turn {turn}: a tool call's 'name' must be a tool's name (a str), got {step['name']!r:.80}")
            # Arguments are sent as JSON text: encoded here, where a value JSON cannot hold (a date)
            # is named, not as a bare TypeError after the turns before it were made and paid for.
            arguments = step.get("arguments", {})
            if not isinstance(arguments, str):
                try:
                    arguments = json.dumps(arguments)
                except (TypeError, ValueError, RecursionError) as exc:
                    raise ValueError(f"script turn {turn}: the arguments for {step['name']!r} are not JSON ({exc})") from None
            checked.append({**step, "arguments": arguments})
        turns.append(checked)
    return messages, tools, turns


async def _chat(ctx: SessionContext, conversation: list[dict[str, Any]], max_refusals: int, **options: Any) -> dict[str, Any]:
    """`ctx.chat`, made again after each refusal's wait, `max_refusals` times at most."""
    refusals = 0
    while True:
        try:
            return await ctx.chat(conversation, **options)
        except Overloaded as exc:
            wait = exc.retry_after_s
            if refusals == max_refusals or not wait <= MAX_REFUSAL_WAIT_S or anyio.current_time() + wait >= ctx.deadline:
                raise
            refusals += 1
            await anyio.sleep(wait)


def _scripted_call(step: Mapping[str, Any]) -> dict[str, Any]:
    arguments = step.get("arguments", {})
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_fs{next(_call_ids)}", "type": "function", "function": {"name": step["name"], "arguments": raw}}


async def _run_calls(ctx: SessionContext, calls: list[Any], tools: Mapping[str, Tool]) -> list[str]:
    """Run the requested tools concurrently, as one tool period of the session."""
    results = [""] * len(calls)

    async def run(index: int, call: Any) -> None:
        results[index] = _sendable(await _run_one(call, tools))

    names = "+".join(sorted({str(_function(c).get("name")) for c in calls}))
    async with ctx.tool(names):
        async with anyio.create_task_group() as tg:
            for index, call in enumerate(calls):
                tg.start_soon(run, index, call)
    return results


async def _run_one(call: Any, tools: Mapping[str, Tool]) -> str:
    if not isinstance(call, Mapping) or not isinstance(call.get("function") or {}, Mapping):
        return f"error: a tool call must be an object with a `function` object (its name and arguments), got {call!r:.80}"
    function = _function(call)
    name = function.get("name")
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"error: unknown tool {name!r}; available tools: {', '.join(sorted(tools)) or '(none)'}"
    # OpenAI's format sends the arguments' JSON text; some servers send the object itself.
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f"error: the arguments for {name!r} are not valid JSON ({exc.msg} at position {exc.pos})"
        except RecursionError:
            return f"error: the arguments for {name!r} are nested too deeply"
    if not isinstance(arguments, dict):
        return f"error: the arguments for {name!r} must be a JSON object, got {type(arguments).__name__}"
    try:
        with anyio.move_on_after(tool.timeout_s) as scope:  # not fail_after: a tool may raise TimeoutError itself
            if _is_plain_function(tool.fn):
                # Boxed: a `def` may return an awaitable (``lambda q: search(q)``), awaited below
                # in the loop; trio's worker threads refuse to return one bare.
                (result,) = await run_sync_in_thread(lambda: (tool.fn(**arguments),), abandon_on_cancel=True)
            else:
                result = tool.fn(**arguments)
            if inspect.isawaitable(result):  # an async function's, or a callable's that returns one
                result = await result
    except Exception as exc:  # a tool's failure is the model's to handle, not the session's
        return f"error: tool {name!r} raised {type(exc).__name__}: {_said(exc)}"
    except BaseException as exc:
        # A CancelledError of the tool's own (a future something else cancelled) ended its task
        # as if cancelled: the model was given an empty result, counted as no error.
        if stray_cancelled_error(exc):
            return f"error: tool {name!r} raised CancelledError: {_said(exc)}"
        raise
    if scope.cancelled_caught:
        return f"error: tool {name!r} did not finish within {tool.timeout_s:g} s"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, allow_nan=False)  # NaN and infinity are no JSON
    except (TypeError, ValueError, RecursionError) as exc:
        return f"error: tool {name!r} returned a {type(result).__name__} that is not JSON ({exc})"


def _sendable(text: str) -> str:
    """A tool's result or error `text` as it can go to the model: a lone surrogate (in a file name
    or a command's output that Python decoded with "surrogateescape") written as its escape, as
    `json.dumps` writes it in a result that is not text. Such a text has no UTF-8: a vLLM server's
    request could not be sent, and the session failed at its next model call (the sim took it)."""
    if text.isascii():  # the usual: nothing to look at
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _said(exc: BaseException) -> str:
    """`str(exc)`, or what its failure was: an exception whose own ``__str__`` raised escaped
    the loop (the session failed with that error, the tool's lost), where the model was to be told."""
    try:
        return str(exc)
    except Exception as failure:
        return f"(its message could not be read: its __str__ raised {type(failure).__name__})"


def _function(call: Any) -> Mapping[str, Any]:
    """The `function` part (name, arguments) of a tool call the model made; empty if it has none,
    or if the call is not shaped as one (`_run_one` answers the model so)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    return function if isinstance(function, Mapping) else {}


def _is_plain_function(fn: Any) -> bool:
    """Whether `fn` is a synchronous function (``def``, lambda, builtin, method, or a partial of
    one), which runs in a worker thread. An ``async def`` is not; nor is a callable object, called
    in the event loop as ever, since its call may return an awaitable that needs the loop."""
    if inspect.iscoroutinefunction(fn):  # also a method or a partial of one
        return False
    return inspect.isroutine(fn.func if isinstance(fn, functools.partial) else fn)
