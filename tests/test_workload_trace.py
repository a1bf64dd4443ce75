"""Replaying a JSONL trace: sessions arrive at their recorded times; bad lines are named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleetsched import Scheduler, SessionState
from fleetsched.agents import workload
from fleetsched.agents.workload import plan, run_workload
from fleetsched.errors import ConfigError
from fleetsched.settings import Settings, WorkloadSettings

from .helpers import check_released, settings


#: Settings that declare the tenant "acme" alone.
ACME = Settings(tenants={"acme": {}})


def write(path, *records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.anyio
async def test_trace_sessions_arrive_at_their_times(tmp_path):
    trace = write(
        tmp_path / "t.jsonl",
        {"at": 5, "tenant": "acme", "kind": "late", "turns": 2, "tool_s": 3},
        {"at": 0, "tenant": "acme", "kind": "early", "turns": 1},
        "",
        {"at": 2.5, "tenant": "acme", "turns": 1, "max_tokens": 8},
    )
    s = settings(workload={"trace": str(trace)})
    async with Scheduler(s) as scheduler:
        handles = await run_workload(scheduler, s.workload)
    submitted = sorted((h.timestamps[SessionState.QUEUED], h.kind) for h in handles)
    assert submitted == [(0.0, "early"), (2.5, "acme"), (5.0, "late")]
    late = [h for h in handles if h.kind == "late"][0]
    assert late.counters.calls == 2 and late.counters.tool_s == 3.0
    assert all(h.state is SessionState.DONE for h in handles)
    check_released(scheduler)


@pytest.mark.anyio
async def test_trace_arrivals_count_from_when_the_plan_is_made(tmp_path, monkeypatch):
    """Planning a trace of 100,000 lines takes seconds of wall time. The arrival clock started
    before it, so every session of those first seconds arrived at once when it was done: here
    the sessions at 0 and 2 s both at 3 s, where they keep their 2 s apart."""
    import trio

    made = workload.plan

    def slow_plan(*args):
        planned = made(*args)
        trio.lowlevel.current_clock().jump(3)  # the (virtual) time a big trace takes to plan
        return planned

    monkeypatch.setattr(workload, "plan", slow_plan)
    trace = write(tmp_path / "t.jsonl", {"at": 0, "tenant": "acme", "turns": 1}, {"at": 2, "tenant": "acme", "turns": 1})
    s = settings(workload={"trace": str(trace)})
    async with Scheduler(s) as scheduler:
        began = trio.current_time()
        handles = await run_workload(scheduler, s.workload)
    assert sorted(h.timestamps[SessionState.QUEUED] - began for h in handles) == [3.0, 5.0]
    check_released(scheduler)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("{not json", "workload.trace line 2"),
        ('{"at": 1}', "workload.trace line 2: tenant"),
        ('{"at": -1, "tenant": "acme"}', "workload.trace line 2"),
        ('{"tenant": "acme", "turns": 0}', "workload.trace line 2: turns"),
        ("[1, 2]", "workload.trace line 2"),
        # Before: a TypeError traceback (null, a list) or a run that never ended (inf).
        ('{"at": null, "tenant": "acme"}', "workload.trace line 2"),
        ('{"at": [1], "tenant": "acme"}', "workload.trace line 2"),
        ('{"at": Infinity, "tenant": "acme"}', "workload.trace line 2"),
        ('{"at": "inf", "tenant": "acme"}', "workload.trace line 2"),
        ('{"tenant": "acme", "think_s": Infinity}', "workload.trace line 2: think_s"),
        ('{"tenant": "acme", "count": 5}', "workload.trace line 2"),  # was taken, and ignored
        # A 400-digit integer: an OverflowError traceback mid-run (int too large for a float).
        ('{"at": 1' + "0" * 400 + ', "tenant": "acme"}', "workload.trace line 2"),
        # Its text made in memory: a MemoryError traceback at 1e11 tokens, 7.8 GB at 1e9.
        ('{"tenant": "acme", "prompt_tokens": 100000000000}', "workload.trace line 2: prompt_tokens"),
        # A check across fields is the line's: the key was "workload.trace line 2: " (no field).
        ('{"tenant": "acme", "tool_s": 1, "tool_dist": "uniform"}', "workload.trace line 2"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path, line, key):
    trace = write(tmp_path / "t.jsonl", {"tenant": "acme"}, line)
    with pytest.raises(ConfigError) as info:
        plan(WorkloadSettings(trace=trace), ACME)
    assert info.value.key == key


def test_a_trace_that_is_not_utf8_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b'{oops\n{"tenant": "acme"}\n\xff\xfe\n')
    # The byte counted from the start of the file, and named before any line's error.
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 25\)"):
        plan(WorkloadSettings(trace=trace), ACME)


def test_a_line_separator_inside_a_string_does_not_split_a_line(tmp_path):
    """JSON takes U+2028 and U+0085 unescaped in a string (json.dumps writes them so with
    ensure_ascii=False). The trace was split at them as at line ends: a valid line was refused as
    an unterminated string, and each line after it named by the wrong number."""
    trace = tmp_path / "t.jsonl"
    kinds = ["review\u2028agent", "batch\x85agent"]
    trace.write_text("".join(json.dumps({"tenant": "acme", "kind": kind}, ensure_ascii=False) + "\r\n" for kind in kinds), encoding="utf-8")
    assert [p.kind for p in plan(WorkloadSettings(trace=trace), ACME)] == kinds
    trace.write_text(trace.read_text(encoding="utf-8") + '{"tenant": "acme", "turns": 0}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        plan(WorkloadSettings(trace=trace), ACME)
    assert info.value.key == "workload.trace line 3: turns"


def test_unknown_tenant_and_missing_trace(tmp_path):
    trace = write(tmp_path / "t.jsonl", {"tenant": "ghost"})
    with pytest.raises(ConfigError, match="'ghost' is not a declared tenant"):
        plan(WorkloadSettings(trace=trace), ACME)
    with pytest.raises(ConfigError, match="cannot read"):
        plan(WorkloadSettings(trace=tmp_path / "missing.jsonl"))


def test_cli_runs_a_trace_and_refuses_a_bad_one(tmp_path):
    trace = write(tmp_path / "t.jsonl", {"at": 0, "tenant": "acme", "turns": 1}, {"at": 0.2, "tenant": "acme"})
    config = tmp_path / "c.toml"
    config.write_text(f'[backend]\nkind = "instant"\n[tenants.acme]\n[workload]\ntrace = "{trace}"\n')
    done = subprocess.run([sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    write(trace, {"tenant": "acme"}, "{oops")
    done = subprocess.run([sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "workload.trace line 2" in done.stderr
    # An empty trace ran nothing and exited 0; `simulate` refused it.
    write(trace, "", "")
    done = subprocess.run([sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "the config describes no sessions to run" in done.stderr


def test_an_unknown_tenant_is_named_by_its_line(tmp_path):
    """Before: 'workload.trace session 2', counted without the blank lines, while every other
    error of a trace names its line."""
    trace = write(tmp_path / "t.jsonl", "", {"tenant": "acme"}, "", {"tenant": "ghost"})
    with pytest.raises(ConfigError, match="'ghost' is not a declared tenant") as info:
        plan(WorkloadSettings(trace=trace), ACME)
    assert info.value.key == "workload.trace line 4: tenant"


def test_a_trace_of_more_sessions_than_are_run_is_refused(tmp_path, monkeypatch):
    # workload.agents refuses more than a million sessions; a trace of a million and one lines
    # was taken and took 4 GB before its first session ran.
    monkeypatch.setattr(workload, "MAX_WORKLOAD_SESSIONS", 3)
    trace = write(tmp_path / "t.jsonl", *[{"tenant": "acme"}] * 4)
    with pytest.raises(ConfigError, match="more than 3 sessions in the trace") as info:
        plan(WorkloadSettings(trace=trace), ACME)
    assert info.value.key == "workload.trace line 4"


def test_a_trace_session_that_could_never_be_admitted_is_refused(tmp_path):
    """As an agent mix is: a line whose session reserves more than any device holds, or than its
    tenant's quota. Before, the run started, and each such session was rejected at submission."""
    config = Settings(tenants={"acme": {}, "quota": {"memory_quota": "4GB"}})
    fits = {"tenant": "acme", "turns": 1}
    for line, limit in (
        ({"tenant": "acme", "session_memory": "500GB"}, "more than the largest device holds"),
        ({"tenant": "quota", "session_memory": "8GB"}, "more than the memory_quota of tenant 'quota'"),
    ):
        trace = write(tmp_path / "t.jsonl", fits, line)
        with pytest.raises(ConfigError, match=limit) as info:
            plan(WorkloadSettings(trace=trace), config)
        assert info.value.key == "workload.trace line 2"
        assert "(workload.trace line 2.session_memory)" in info.value.reason
    write(tmp_path / "t.jsonl", fits, {"tenant": "quota", "session_memory": "4GB"})
    assert len(plan(WorkloadSettings(trace=tmp_path / "t.jsonl"), config)) == 2


def test_a_trace_is_parsed_once_while_it_stays_the_same(tmp_path, monkeypatch):
    """A run reads its trace up to four times (the command line's check and count, the start-up
    note, the replay): each parsed every line again, up to a million. The text parsed last is kept,
    with the settings it was checked against."""
    parsed = []
    parse = workload._parse_trace
    monkeypatch.setattr(workload, "_parse_trace", lambda lines, settings, *kv: parsed.append(settings) or parse(lines, settings, *kv))
    trace = write(tmp_path / "t.jsonl", {"at": 1, "tenant": "acme"}, {"at": 2, "tenant": "acme"})
    first = plan(WorkloadSettings(trace=trace), ACME)
    assert [p.at for p in plan(WorkloadSettings(trace=trace))] == [p.at for p in first] == [1.0, 2.0]
    plan(WorkloadSettings(trace=trace), ACME)
    assert parsed == [ACME]  # unchecked, or checked against equal settings: not parsed again
    with pytest.raises(ConfigError, match="'acme' is not a declared tenant"):
        plan(WorkloadSettings(trace=trace), Settings(tenants={"other": {}}))  # other settings: checked again
    write(trace, {"at": 3, "tenant": "acme"})
    assert [p.at for p in plan(WorkloadSettings(trace=trace), ACME)] == [3.0]  # a changed file: parsed again
    assert len(parsed) == 3


def test_a_trace_is_read_a_line_at_a_time(tmp_path, monkeypatch):
    """The file was read whole, decoded whole and split: 3.5 times its size held at once over the
    sessions parsed (88 MB for a trace of 26 MB)."""
    import tracemalloc

    monkeypatch.setattr(workload, "_last_trace", None)
    padding = " " * 1000  # JSON's whitespace: 2 MB of text to read, 2,000 sessions to parse
    trace = write(tmp_path / "t.jsonl", *[json.dumps({"at": i, "tenant": "acme"}) + padding for i in range(2000)])
    tracemalloc.start()
    try:
        sessions = workload.read_trace(trace, ACME)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(sessions) == 2000
    assert peak - held < trace.stat().st_size / 4


@pytest.mark.parametrize("command", ["run", "simulate"])
def test_a_run_plans_its_sessions_once(tmp_path, monkeypatch, capsys, command):
    """`fleetsched run` planned a trace three times (its check, the live view's count, the
    replay), `simulate` twice: each plan a session and an agent a line, 0.7 KB, and seconds of a
    large trace's start. And the parsed trace, 1.5 KB a line, stayed in memory after the run."""
    from fleetsched import cli

    planned = []
    made = workload.plan
    monkeypatch.setattr(workload, "plan", lambda *args: planned.append(args) or made(*args))
    trace = write(tmp_path / "t.jsonl", {"at": 0, "tenant": "acme", "turns": 1}, {"at": 0.2, "tenant": "acme"})
    config = tmp_path / "c.toml"
    config.write_text(f'[backend]\nkind = "instant"\n[tenants.acme]\n[workload]\ntrace = "{trace}"\n')
    assert cli.main([command, str(config), *(["--no-live"] if command == "run" else [])]) == 0, capsys.readouterr().err
    assert len(planned) == 1
    assert workload._last_trace is None


@pytest.mark.anyio
async def test_a_replayed_trace_is_not_kept_after_its_plan_is_made(tmp_path):
    """The last trace parsed was kept for the process's life: 150 MB for a run of 100,000 lines,
    held by a service or a test session after the run ended. Its last reader, the replay, drops it."""
    trace = write(tmp_path / "t.jsonl", {"at": 0, "tenant": "acme", "turns": 1})
    s = settings(workload={"trace": str(trace)})
    async with Scheduler(s) as scheduler:
        plan(s.workload, s)
        assert workload._last_trace is not None  # the check's parse, kept for the run
        (handle,) = await run_workload(scheduler, s.workload)
    assert handle.state is SessionState.DONE
    assert workload._last_trace is None
    check_released(scheduler)


@pytest.mark.anyio
async def test_a_planned_session_writes_its_prompt_when_it_starts():
    """A plan held every session's prompt text from the start: 60 sessions of 10M tokens took
    2.4 GB before the first was admitted, two at a time. The prompt is drawn at planning (the
    same draws of the seed as before) and written when the session runs."""
    mix = {"tenant": "acme", "count": 3, "turns": 1, "prompt_tokens": 100_000, "max_tokens": 1}
    planned = plan(WorkloadSettings(agents=[mix], seed=7))
    for session in planned:
        held = [cell.cell_contents for cell in session.agent.__closure__ or ()]
        assert not any(isinstance(value, str) and len(value) > 10_000 for value in held)
    rng = workload.random.Random(7)
    rng.shuffle([0, 1, 2])  # plan's shuffle of the sessions, then one draw a prompt
    expected = [workload.filler_text(100_000, rng) for _ in range(3)]
    prompts = []

    class Recorder:
        async def chat(self, messages, max_tokens):
            prompts.append(messages[1]["content"])
            return {"choices": [{"message": {"content": "ok"}}]}

    for session in planned:
        await session.agent(Recorder())
    assert prompts == expected


def test_an_exponential_tool_time_averages_tool_s():
    """An exponential tool time draws durations whose mean is tool_s."""
    from fleetsched.settings import AgentMix

    mix, rng = AgentMix(tenant="acme", count=1, tool_s=10, tool_dist="exponential"), workload.random.Random(1)
    draws = [workload.tool_time(mix, rng) for _ in range(4000)]
    assert 9 < sum(draws) / len(draws) < 11


@pytest.mark.anyio
async def test_a_uniform_tool_time_from_0_is_a_tool_call_between_turns():
    """A mix whose tool time is uniform from 0 makes a tool call between each pair of turns."""
    mix = {"tenant": "acme", "count": 1, "turns": 3, "max_tokens": 2, "tool_s": 0, "tool_dist": "uniform", "tool_s_max": 2}
    s = settings(workload={"agents": [mix]})
    async with Scheduler(s) as scheduler:
        (handle,) = await run_workload(scheduler, s.workload)
    assert handle.state is SessionState.DONE and handle.counters.tool_calls == 2
    check_released(scheduler)


def test_an_at_of_true_is_refused_not_read_as_1_s(tmp_path):
    """A trace line whose at is true is refused, naming the line, not read as 1 second."""
    trace = write(tmp_path / "t.jsonl", {"at": True, "tenant": "acme"})
    with pytest.raises(ConfigError, match="workload.trace line 1"):
        plan(WorkloadSettings(trace=trace), ACME)


@pytest.mark.anyio
async def test_a_mix_s_session_memory_is_what_its_sessions_reserve():
    """Each session of a mix that sets session_memory asks the scheduler for that memory."""
    mix = {"tenant": "acme", "count": 1, "turns": 1, "max_tokens": 2, "session_memory": "2GB"}
    s = settings(workload={"agents": [mix]})
    async with Scheduler(s) as scheduler:
        (handle,) = await run_workload(scheduler, s.workload)
    assert handle.state is SessionState.DONE and handle.memory == 2 * 10**9
    check_released(scheduler)
