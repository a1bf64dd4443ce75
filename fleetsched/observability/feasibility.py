"""SLAs that cannot be met even on an idle engine, found at start rather than by breaches.

The engine's unloaded TTFT is what one call alone takes to its first token. For the ``sim``
backend it follows from the engine model (`sim_unloaded_ttft_s`: the prefill steps of the
prompt); for the others it is measured by one probe call straight to the backend, before the
workload starts (`probe_unloaded_ttft_s`). A tenant whose ``ttft_p99_s`` is below it is flagged.
The prompt is the tenant's shortest first turn in the workload (system prompt included), or a
one-line prompt when the workload has no agents of that tenant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import anyio

from ..backends.base import Backend, completion_room, estimate_prompt_tokens
from ..backends.sim._engine import check_request_fits
from ..errors import BackendUnavailable, ContextTooLong
from ..settings import AgentMix, Settings, SimSettings

_PROBE_TEXT = "Reply with one word."


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A tenant objective below what the idle engine achieves."""

    tenant: str
    objective: str
    target_s: float
    unloaded_s: float
    prompt_tokens: int

    def message(self) -> str:
        return (
            f"tenant {self.tenant!r}: sla.{self.objective}_s = {self.target_s:g} s cannot be met: the idle engine "
            f"takes {self.unloaded_s:.4g} s to the first token of a {self.prompt_tokens}-token prompt; "
            "raise the target or use a faster engine"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "message": self.message()}


def sim_unloaded_ttft_s(sim: SimSettings, prompt_tokens: int) -> float:
    """TTFT of one call alone on the sim engine: its turn in the API server and the hand-off
    (request_serial_s and request_overhead_s, which a calibrated profile sets), then its
    prefill in chunks of max_num_batched_tokens, each one engine step with one sequence; the
    first token comes with the last chunk."""
    total, done = sim.request_serial_s + sim.request_overhead_s, 0
    while done < prompt_tokens:
        chunk = min(sim.max_num_batched_tokens, prompt_tokens - done)
        done += chunk
        total += sim.step_base_s + sim.step_per_token_s * chunk + sim.step_per_context_token_s * done + sim.step_per_seq_s
    return total


def tenant_prompt_tokens(settings: Settings, traced: list[tuple[str, AgentMix]] | None = None) -> dict[str, int]:
    """Each tenant's shortest first prompt in the workload (its agents and its trace's sessions,
    `traced`: `_trace_kinds`, read here if not given), as the dispatcher estimates it; the probe's
    for a tenant with none. (The trace's sessions were left out: a tenant of a trace alone was
    judged by the probe's 9-token prompt.)"""
    traced = _trace_kinds(settings) if traced is None else traced
    mixes = [*settings.workload.agents, *(mix for _, mix in traced)]
    out = {}
    for name in settings.tenants:
        sizes = [first_prompt_tokens(m) for m in mixes if m.tenant == name]
        out[name] = min(sizes) if sizes else probe_body()[1]
    return out


def first_prompt_tokens(mix: AgentMix) -> int:
    """The prompt of an agent's first call (system prompt included), as the dispatcher estimates it."""
    return _prompt_tokens(mix, turns=1)


def last_prompt_tokens(mix: AgentMix) -> int:
    """The prompt of an agent's last call, as the dispatcher estimates it, where every answer
    before it took its whole max_tokens (the sim's do): the conversation so far, each answer
    and tool result included (`scripted_chat_agent`)."""
    return _prompt_tokens(mix, turns=mix.turns)


def _prompt_tokens(mix: AgentMix, turns: int) -> int:
    """The prompt of the call of `mix`'s turn `turns` (1: the first), answers at their max_tokens."""
    from ..agents.workload import SYSTEM_PROMPT

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "x" * 4 * mix.prompt_tokens}]
    for turn in range(turns - 1):
        messages.append({"role": "assistant", "content": "x" * 4 * mix.max_tokens})
        if mix.tool_s or mix.tool_s_max:
            messages.append({"role": "user", "content": f"tool result {turn}: " + "x" * 4 * 16})
    return estimate_prompt_tokens({"messages": messages})


def probe_body() -> tuple[dict[str, Any], int]:
    body = {"messages": [{"role": "user", "content": _PROBE_TEXT}], "max_tokens": 1}
    return body, estimate_prompt_tokens(body)


async def probe_unloaded_ttft_s(backend: Backend, model: str) -> float:
    """One short call straight to `backend` (not through the dispatcher): seconds to its first chunk
    with a choice. Raises what the backend raises."""
    body, _ = probe_body()
    start = anyio.current_time()
    stream = backend.stream_chat({**body, "model": model})
    try:
        async for chunk in stream:
            if chunk.get("choices"):
                return anyio.current_time() - start
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return anyio.current_time() - start


def unreachable(settings: Settings, unloaded_ttft_s: dict[str, float], prompt_tokens: dict[str, int]) -> list[Unreachable]:
    """Tenants whose TTFT objective is below the idle engine's TTFT for their prompt."""
    out = []
    for name, tenant in settings.tenants.items():
        target = tenant.sla.ttft_p99_s
        floor = unloaded_ttft_s.get(name)
        if target is not None and floor is not None and target < floor:
            out.append(Unreachable(name, "ttft_p99", target, floor, prompt_tokens[name]))
    return out


async def check_feasibility(settings: Settings, backend: Backend, model: str | None = None) -> dict[str, Any]:
    """The report's ``sla.feasibility``: the unloaded TTFT per tenant and the unreachable SLAs.

    For the sim backend it is computed; for others one probe call is made. A failing probe is
    skipped with a note, but a backend that cannot be reached raises its `BackendUnavailable`:
    a run against it could only fail every call.
    """
    traced = _trace_kinds(settings)  # read once: a trace holds up to a million sessions
    prompts = tenant_prompt_tokens(settings, traced)
    kind = settings.backend.kind
    note = None
    if kind == "sim":
        # None for a tenant whose every first prompt fills the context: its calls are refused
        # (the note says so), not slow ("the idle engine takes 6.7 s" for a prompt it refuses).
        context = settings.backend.sim.max_model_len
        floors = {name: sim_unloaded_ttft_s(settings.backend.sim, n) for name, n in prompts.items() if n < context}
        method = "sim engine model"
    elif kind == "instant":
        floors = {name: 0.0 for name in prompts}
        method = "instant backend"
    else:
        method = "probe call"
        try:
            with anyio.fail_after(30):
                measured = await probe_unloaded_ttft_s(backend, model or settings.backend.model)
        except BackendUnavailable:
            raise
        except Exception as exc:  # any other failure: skip the check, say why
            floors = {}
            note = f"unloaded TTFT not probed: {type(exc).__name__}: {exc}"
        else:
            # One short prompt measured: a floor for every tenant (longer prompts only add).
            floors = {name: measured for name in prompts}
            prompts = {name: probe_body()[1] for name in prompts}
    flagged = unreachable(settings, floors, prompts)
    # A vLLM server's context is its own (--max-model-len), not the settings': asked of it. A
    # budget of 8,192 tokens against a server of 4,096 was named on the sim and the engine only.
    served = await backend.max_model_len() if backend is not None and _settings_context(settings) is None else None
    too_long = over_context(settings, traced, context=served) + over_budget(settings, traced, context=served)
    if too_long:
        note = "; ".join([*too_long, *([note] if note else [])])
    return {
        "method": method,
        "unloaded_ttft_s": {name: round(v, 6) for name, v in floors.items()},
        "unreachable": [u.as_dict() for u in flagged],
        "note": note,
    }


def over_context(settings: Settings, traced: list[tuple[str, AgentMix]] | None = None, *, context: int | None = None) -> list[str]:
    """The workload's agents (and trace sessions, alike ones counted together) whose first call
    already does not fit the model's context (where the settings know it: the sim and the
    in-process engine; else `context`, a vLLM server's own, `Backend.max_model_len`): refused
    (every call of theirs will fail), or its answer cut short (as vLLM cuts `max_tokens` to what
    the prompt leaves). A trace's sessions were left out: a line with a 9,000,000-token prompt
    failed its session without a word, and the run exited 0."""
    kind = settings.backend.kind
    limit = context if context is not None else _settings_context(settings)
    if limit is None:
        return []
    agents = [(f"workload.agents[{index}] ({mix.kind or mix.tenant})", mix) for index, mix in enumerate(settings.workload.agents)]
    out = []
    for agent, mix in agents + (_trace_kinds(settings) if traced is None else traced):
        prompt = first_prompt_tokens(mix)
        agent = f"{agent}: its first call has about {prompt} prompt tokens"
        try:
            room = completion_room(limit, prompt, mix.max_tokens)
        except ContextTooLong:
            out.append(f"{agent} and max_tokens {mix.max_tokens}, over the model's context of {limit}: every call will fail with ContextTooLong")
            continue
        if kind == "sim":  # a call the whole KV cache cannot hold is refused too (vLLM would not start)
            try:
                check_request_fits(settings.backend.sim, prompt, mix.max_tokens)
            except ContextTooLong as exc:
                out.append(f"{agent} and max_tokens {mix.max_tokens}: every call will fail with ContextTooLong: {exc}")
                continue
        if room < mix.max_tokens:
            out.append(f"{agent}: the model's context of {limit} leaves {room} of its max_tokens {mix.max_tokens}, and its answers will be cut short")
            continue
        last = last_prompt_tokens(mix)
        if last >= limit:  # the first fits; a later turn's, the conversation so far, does not
            out.append(
                f"{agent}, its last (turn {mix.turns}) up to {last} (the answers before it at their max_tokens "
                f"{mix.max_tokens}), over the model's context of {limit}: its later calls may fail with ContextTooLong"
            )
    return out


def over_budget(settings: Settings, traced: list[tuple[str, AgentMix]] | None = None, *, context: int | None = None) -> list[str]:
    """With ``[resources.kv_cache]``, the workload's agents (and trace sessions, `traced`, as in
    `over_context`) whose sessions reach more context (the last turn's prompt and its answer) than
    ``context_tokens`` reserves for them: admission then holds less than they use, and the engine
    may run out of blocks and preempt, which it is there to prevent; and a ``context_tokens``
    beyond the model's context (known as `over_context` knows it). Agents whose tenant or mix
    sets ``session_memory`` are the user's to size. (A trace's sessions were left out: the note
    an agent mix got, the same session as a trace line went without.)"""
    kv_cache = settings.resources.kv_cache
    if kv_cache is None:
        return []
    out = []
    limit = context if context is not None else _settings_context(settings)
    if limit is not None and kv_cache.context_tokens > limit:
        # No call holds more than the model's context in the cache: a budget beyond it reserved
        # blocks that no session's call could fill, and admitted fewer sessions than the cache
        # holds (half as many at twice the context), without a word.
        out.append(
            f"resources.kv_cache.context_tokens ({kv_cache.context_tokens}) is more than the model's context "
            f"({limit} tokens): a session's call holds at most {limit} tokens of the KV cache, and reserving more "
            "admits fewer sessions than the cache holds"
        )
    agents = [(f"workload.agents[{index}] ({mix.kind or mix.tenant})", mix) for index, mix in enumerate(settings.workload.agents)]
    for agent, mix in agents + (_trace_kinds(settings) if traced is None else traced):
        if settings.session_memory_of(mix, "workload")[1] != "scheduler.session_memory":
            continue
        peak = last_prompt_tokens(mix) + mix.max_tokens
        if peak > kv_cache.context_tokens:
            out.append(
                f"{agent}: its sessions reach about {peak} tokens of context, more "
                f"than resources.kv_cache.context_tokens ({kv_cache.context_tokens}) reserves: admitted sessions may outgrow "
                "the KV cache, and the engine preempt"
            )
    return out


def _settings_context(settings: Settings) -> int | None:
    """The model's context where the settings set it (the sim's, the in-process engine's), else None."""
    kind = settings.backend.kind
    return settings.backend.sim.max_model_len if kind == "sim" else settings.backend.engine_max_model_len if kind == "vllm-engine" else None


def _trace_kinds(settings: Settings) -> list[tuple[str, AgentMix]]:
    """The trace's sessions for `over_context` and `over_budget`, one per kind and what those
    checks read of a session (its prompt, max_tokens, turns, tool calls, memory), named by their
    first line and how many there are (a trace holds up to a million). Alike by kind, prompt and
    max_tokens alone, a line of 1 turn stood for one of 20 whose later calls overflow the context,
    and that one went without a word."""
    if settings.workload.trace is None:
        return []
    from ..agents.workload import read_trace

    first: dict[tuple[object, ...], tuple[int, AgentMix]] = {}
    counts: dict[tuple[object, ...], int] = {}
    for number, (_, mix) in enumerate(read_trace(settings.workload.trace, settings), 1):
        tools = bool(mix.tool_s or mix.tool_s_max)  # a tool result is fed back between turns
        key = (mix.tenant, mix.kind or "", mix.prompt_tokens, mix.max_tokens, mix.turns, tools, mix.session_memory)
        first.setdefault(key, (number, mix))
        counts[key] = counts.get(key, 0) + 1
    return [
        (f"workload.trace session {number} ({mix.kind or mix.tenant}{f', and {counts[key] - 1} alike' if counts[key] > 1 else ''})", mix)
        for key, (number, mix) in first.items()
    ]
