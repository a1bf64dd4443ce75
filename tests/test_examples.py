"""Every example runs: the TOML configs on virtual time, tool_agents.py as users run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetsched import Scheduler
from fleetsched.agents.workload import plan, run_workload
from fleetsched.resources import session_bytes
from fleetsched.settings import load_settings
from fleetsched.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["quickstart.toml", "tenant_slas.toml", "mixed_pace.toml"])
async def test_config_example_runs_to_completion(name):
    settings = load_settings(ROOT / "examples" / name)
    settings = settings.model_copy(update={"scheduler": settings.scheduler.model_copy(update={"drain_grace_s": 10_000})})
    async with Scheduler(settings) as scheduler:
        await run_workload(scheduler, settings.workload)
    finished = scheduler.statistics().finished
    assert sum(finished.values()) == len(plan(settings.workload))
    # Only the batch tier may be shed (tenant_slas): everything else completes.
    failed = [s for s in scheduler.recorder.sessions if s.state != "done"]
    assert all(s.tier == 2 for s in failed), failed[:3]


def test_tool_agents_example():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tool_agents.py"), "--sessions", "12"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "12 of 12 agents answered" in done.stdout


@pytest.mark.parametrize(
    ("arguments", "code", "message"),
    [  # before: "0 of -3 agents answered" (exit 0), the --url ignored, a traceback, a traceback
        (["--sessions", "-3"], 2, "expected a whole number of sessions >= 1, got '-3'"),
        (["--url", "http://127.0.0.1:1"], 2, "--url applies only with --backend vllm-server"),
        (["--backend", "vllm-server", "--url", "nope"], 2, "--url: 'nope' is not http://host:port"),
        (["--backend", "vllm-server", "--url", "http://127.0.0.1:1", "--sessions", "2"], 1, "2 failed; the first: cannot reach vLLM replica"),
    ],
)
def test_tool_agents_example_refuses_bad_arguments_in_a_line(arguments, code, message):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tool_agents.py"), *arguments], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == code and message in done.stderr and "Traceback" not in done.stderr


def test_the_readmes_python_example_runs_as_written(monkeypatch, capsys):
    """It read a ./fleetsched.toml that the repository does not have (ConfigError: no such file)."""
    import anyio
    import trio.testing

    source = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    assert source.rstrip().endswith("anyio.run(main)")
    namespace: dict = {}
    exec(compile(source.rstrip().removesuffix("anyio.run(main)"), "README.md", "exec"), namespace)
    monkeypatch.chdir(ROOT)
    # On virtual time: its 100 sessions each spend 2 s in a tool.
    anyio.run(namespace["main"], backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
    printed = capsys.readouterr().out
    assert "finished={'done': 100}" in printed and "slots_in_use=0" in printed


def test_every_error_of_the_tree_is_a_public_name():
    # RateLimited (which the README names) and ReportSchemaError were in fleetsched.errors only.
    import fleetsched
    import fleetsched.errors

    errors = {name for name, value in vars(fleetsched.errors).items() if isinstance(value, type) and issubclass(value, fleetsched.FleetschedError)}
    assert errors - set(fleetsched.__all__) == set()


def test_the_kv_admission_example_admits_what_the_cache_holds_and_never_preempts():
    """examples/kv_admission.toml, in virtual time: Qwen2-7B's 56 KiB a token (its config.json
    shipped beside the example) over the A100 profile's 320,000 cached tokens holds 78 sessions of
    4,096 tokens; 200 may run, but no more than 78 do, and the engine never preempts."""
    settings = load_settings(ROOT / "examples" / "kv_admission.toml")
    report, _ = simulate(settings)
    per_session = session_bytes(4096, "examples/models/qwen2-7b-instruct")
    assert per_session == 4096 * 2 * 28 * 4 * 128 * 2
    total = report["memory"]["total_bytes"]
    assert total == 320_000 * 57_344 and total // per_session == 78
    timeline = report["timeline"]
    assert max(timeline["running_sessions"]) == 78 < settings.scheduler.max_sessions
    assert max(timeline["memory_allocated_bytes"]["sim"]) <= total
    assert report["sim"]["preemptions"] == 0
    assert report["sessions"] == {"done": 150}
