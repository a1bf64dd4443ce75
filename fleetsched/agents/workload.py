"""Workloads: the agent mix a config describes, turned into sessions submitted over time.

Each `AgentMix` entry becomes `count` scripted chat sessions for its tenant: `turns` model calls
with a prompt of about `prompt_tokens` tokens and `max_tokens` to generate, a tool call of
`tool_s` seconds and `think_s` seconds of agent work between turns. The conversation grows turn
by turn (the assistant's answers and tool results are fed back), as a real agent's does. Sessions
arrive all at once, or as a Poisson process of `arrival_rate` per second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import random
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from pydantic import ValidationError

from ..errors import ConfigError, FleetschedError
from ..scheduler import Scheduler, SessionHandle
from ..scheduler.session import Agent
from ..settings import MAX_WORKLOAD_SESSIONS, AgentMix, Settings, WorkloadSettings, first_error

#: The latest arrival a trace line may give, in seconds from the start (a year, as `simulate`'s
#: longest --duration).
MAX_TRACE_AT_S = 365 * 86400.0

_WORDS = "the fleet of agents shares one engine and every tenant gets its fair part of tokens".split()
SYSTEM_PROMPT = "You are a careful assistant. Use the tools when they help, and answer briefly."
# Prompts are slices of one long random text: distinct prompts (so no accidental prefix-cache
# hits between sessions) at the cost of a slice, not a word-by-word draw per prompt.
@functools.cache
def _corpus() -> str:
    return " ".join(random.Random(0).choices(_WORDS, k=200_000))


def filler_text(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of text (4 characters a token, as the estimators count)."""
    return _filler(tokens, _filler_start(tokens, rng))


def _filler_start(tokens: int, rng: random.Random) -> int:
    """Where in the corpus `filler_text` of `tokens` tokens starts: the draw it makes of `rng`."""
    length = tokens * 4
    corpus = _corpus()
    return 0 if length >= len(corpus) else rng.randrange(len(corpus) - length)


def _filler(tokens: int, start: int) -> str:
    corpus = _corpus()
    length = tokens * 4
    if length >= len(corpus):  # longer than the corpus (about 260k tokens): it repeats
        return (corpus * (length // len(corpus) + 1))[:length]
    return corpus[start : start + length]


def tool_time(mix: AgentMix, rng: random.Random) -> float:
    """One draw of the mix's tool duration."""
    if mix.tool_dist == "exponential":
        return rng.expovariate(1 / mix.tool_s)
    if mix.tool_dist == "uniform":
        assert mix.tool_s_max is not None
        return rng.uniform(mix.tool_s, mix.tool_s_max)
    return mix.tool_s


def scripted_chat_agent(mix: AgentMix, rng: random.Random) -> Agent:
    """A session of `mix`'s kind. It makes real model calls; its decisions follow the script.

    Its prompt is drawn now and written when the session starts: a plan of thousands of
    sessions held every prompt's text from the start (2.4 GB for 60 of 10M tokens, two of
    them running at a time)."""
    start = _filler_start(mix.prompt_tokens, rng)

    async def agent(ctx: Any) -> int:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": _filler(mix.prompt_tokens, start)},
        ]
        for turn in range(mix.turns):
            response = await ctx.chat(messages, max_tokens=mix.max_tokens)
            messages.append({"role": "assistant", "content": response["choices"][0]["message"]["content"] or ""})
            if turn == mix.turns - 1:
                break
            if mix.tool_s or mix.tool_s_max:  # a uniform time from 0 is a tool call too
                async with ctx.tool(mix.tool_name):
                    await anyio.sleep(tool_time(mix, rng))
                messages.append({"role": "user", "content": f"tool result {turn}: " + filler_text(16, rng)})
            if mix.think_s:
                await anyio.sleep(mix.think_s)
        return mix.turns

    return agent


@dataclass(frozen=True, slots=True)
class PlannedSession:
    at: float
    kind: str
    mix: AgentMix
    agent: Agent


#: The last trace parsed: (its path, a digest of its text), the settings and KV cache it was
#: checked against (None: not checked), and its sessions. A run reads its trace up to five times
#: (the command line's check and count, the scheduler's start, the start-up note, the replay),
#: and a trace may hold a million lines. The replay, its last reader, drops it (`run_workload`):
#: kept, a run's trace stayed in memory for the life of the process (1.5 KB a line).
_last_trace: tuple[tuple[Path, bytes], tuple[Settings, tuple[str, int] | None, int | None] | None, list[tuple[float, AgentMix]]] | None = None


def read_trace(
    path: Path, settings: Settings | None = None, cache: tuple[str, int] | None = None, sized: int | None = None
) -> list[tuple[float, AgentMix]]:
    """The sessions of a JSONL trace as (arrival offset, agent mix of one). Raises `ConfigError`
    naming the line and the field that is wrong; with `settings`, a tenant they do not declare
    too, and a session that could never be admitted (as `Settings` refuses such an agent mix;
    with ``[resources.kv_cache]``, against the largest cache, `cache`, and the session's budget
    in it, `sized`, once they are known: `Settings.inadmissible`).

    The text is parsed again only when it changed since the last trace parsed, or when
    `settings` (or the cache) differ from those it was checked against."""
    global _last_trace
    digest = hashlib.blake2b()
    for _ in _trace_lines(path, digest):  # its digest; and a text not UTF-8 is named before any line
        pass
    if _last_trace is not None and _last_trace[0] == (path.resolve(), digest.digest()):
        checked = _last_trace[1]
        # Checked against a cache, it was checked against none too.
        if settings is None or (checked is not None and checked[0] == settings and (cache, sized) in ((None, None), checked[1:])):
            return list(_last_trace[2])
    digest = hashlib.blake2b()  # of the text parsed, should the file change between the readings
    with contextlib.closing(_trace_lines(path, digest)) as lines:
        sessions = _parse_trace(lines, settings, cache, sized)
    _last_trace = ((path.resolve(), digest.digest()), None if settings is None else (settings, cache, sized), sessions)
    return list(sessions)


def _trace_lines(path: Path, digest: hashlib.blake2b) -> Generator[str, None, None]:
    """The lines of the trace at `path`, read one at a time (the text whole, split, took 3.5 times
    the file's size), each added to `digest` as read.

    Lines end at "\n" alone (a "\r" before it is JSON's whitespace): `splitlines` also split at
    U+2028, U+0085 and the like, which JSON takes unescaped in a string (json.dumps writes them
    so with ensure_ascii=False), failing a valid line and naming every later one wrongly."""
    offset = 0
    try:
        with path.open("rb") as file:
            for data in file:
                digest.update(data)
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(
                        "workload.trace", f"{path} is not UTF-8 text (byte {offset + exc.start}): a trace is JSON lines"
                    ) from None
                offset += len(data)
                yield line.removesuffix("\n")
    except OSError as exc:
        raise ConfigError("workload.trace", f"cannot read {path}: {exc.strerror}") from None


def _parse_trace(
    lines: Iterable[str], settings: Settings | None, cache: tuple[str, int] | None, sized: int | None
) -> list[tuple[float, AgentMix]]:
    sessions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key = f"workload.trace line {number}"
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("a line must be a JSON object")
            at = record.pop("at", 0.0)
            # A 400-digit integer passed `< inf`, then failed to become a float mid-run.
            if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at <= MAX_TRACE_AT_S:
                raise ValueError(f"at must be a number of seconds from 0 to {MAX_TRACE_AT_S:,.0f} (a year), got {at!r:.40}")
            at = float(at)
            if "count" in record:
                raise ValueError("count: a trace line is one session (write one line per session)")
            mix = AgentMix.model_validate({"count": 1, **record})
        except ValidationError as exc:
            field, message = first_error(exc)
            raise ConfigError(f"{key}: {field}" if field else key, message) from None
        except ValueError as exc:  # JSON syntax, or `at`
            raise ConfigError(key, str(exc)) from None
        if settings is not None:
            if mix.tenant not in settings.tenants:
                raise ConfigError(f"{key}: tenant", f"{mix.tenant!r} is not a declared tenant")
            reason = settings.inadmissible(mix, key, cache, sized)
            if reason is not None:
                raise ConfigError(key, reason)
        if len(sessions) == MAX_WORKLOAD_SESSIONS:  # as workload.agents: a bigger trace filled memory for minutes
            raise ConfigError(key, f"more than {MAX_WORKLOAD_SESSIONS:,} sessions in the trace; at most that many are run")
        sessions.append((at, mix))
    return sessions


def session_count(workload: WorkloadSettings, settings: Settings | None = None) -> int:
    """How many sessions `plan` makes of the workload, checking a trace as it does, without
    making them (a planned session and its agent take 0.5 KB, and a run planned its trace three
    times: its check, its count, its replay)."""
    sessions = sum(mix.count for mix in workload.agents)
    if workload.trace is not None:
        sessions += len(read_trace(workload.trace, settings))
    return sessions


def plan(workload: WorkloadSettings, settings: Settings | None = None) -> list[PlannedSession]:
    """Every session of the workload, generated and replayed, with its arrival offset (seconds),
    in arrival order. With `settings`, a trace line they would refuse as an agent mix (another
    tenant, a session that could never be admitted) is a `ConfigError`."""
    rng = random.Random(workload.seed)
    kinds = []
    for index, mix in enumerate(workload.agents):
        kind = mix.kind or f"{mix.tenant}-{index}"
        kinds += [(kind, mix)] * mix.count
    rng.shuffle(kinds)
    sessions = []
    at = 0.0
    for kind, mix in kinds:
        if workload.arrival_rate:
            at += rng.expovariate(workload.arrival_rate)
        sessions.append(PlannedSession(at, kind, mix, scripted_chat_agent(mix, rng)))
    if workload.trace is not None:
        for offset, mix in read_trace(workload.trace, settings):
            sessions.append(PlannedSession(offset, mix.kind or mix.tenant, mix, scripted_chat_agent(mix, rng)))
        sessions.sort(key=lambda planned: planned.at)
    return sessions


async def run_workload(
    scheduler: Scheduler,
    workload: WorkloadSettings,
    on_submit: Callable[[SessionHandle], None] | None = None,
) -> list[SessionHandle]:
    """Submit the workload's sessions at their arrival times and wait for all of them.

    Failed, rejected and cancelled sessions are recorded by the scheduler, not raised here.
    """
    global _last_trace
    # The clock starts once the plan is made: a trace of 100,000 lines takes seconds to plan,
    # and the sessions of those first seconds all arrived at once, when it was done.
    sessions = plan(workload, scheduler.settings)
    _last_trace = None  # the run's last reading of its trace: the plan holds what the run needs
    start = anyio.current_time()
    handles: list[SessionHandle] = []
    for planned in sessions:
        delay = start + planned.at - anyio.current_time()
        if delay > 0:
            await anyio.sleep(delay)
        memory = int(planned.mix.session_memory) if planned.mix.session_memory else None
        try:
            handle = await scheduler.submit(planned.agent, tenant=planned.mix.tenant, memory=memory, kind=planned.kind)
        except FleetschedError:
            continue  # rejected at once; the scheduler recorded it
        handles.append(handle)
        if on_submit is not None:
            on_submit(handle)
    for handle in handles:
        try:
            await handle
        except FleetschedError:
            pass
    return handles
