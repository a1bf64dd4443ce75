"""The command line, run as users run it (a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleetsched.testing.vllm_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def fleetsched(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetsched.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_quickstart_runs_and_writes_a_report(tmp_path):
    report = tmp_path / "run.json"
    done = fleetsched("run", "examples/quickstart.toml", "--no-live", "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert "support-bot" in done.stdout and "nightly-batch" in done.stdout
    data = json.loads(report.read_text())
    assert data["schema"] == "fleetsched.run/2"
    assert data["sessions"] == {"done": 210}
    tenants = {t["tenant"]: t for t in data["tenants"]}
    assert tenants["support-bot"]["calls"] == 360 and tenants["nightly-batch"]["sessions_done"] == 30


def test_bad_config_exits_2_naming_the_key(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[tenants.acme]\nweight = -1\n[[workload.agents]]\ntenant = "acme"\ncount = 1\n')
    done = fleetsched("run", str(config))
    assert done.returncode == 2
    assert "tenants.acme.weight" in done.stderr and "greater than or equal to 0.000001 (got -1)" in done.stderr


def test_a_server_that_cannot_be_reached_stops_the_run_at_once():
    # It used to run the whole workload, fail every call and exit 0.
    closed = f"http://127.0.0.1:{free_port()}"
    done = fleetsched("run", "examples/quickstart.toml", "--no-live", "--backend", "vllm-server", env={"FLEETSCHED_BACKEND__URLS": json.dumps([closed])})
    assert done.returncode == 1
    assert "the vllm-server backend cannot be reached" in done.stderr and "--backend sim" in done.stderr
    assert "Traceback" not in done.stderr and "support-bot" not in done.stdout


def test_backend_override_leaves_the_model_to_the_server_unless_the_config_names_it(tmp_path):
    """`run --backend vllm-server` on a config that names no backend.model: the scheduler asks
    the server which model it serves (before: the override read the default back as set, and
    every call named fleetsched-tiny, a 404 on a server of another model). A model the config
    names stays named; the other settings stay as they were."""
    from fleetsched.cli import _load
    from fleetsched.settings import load_settings

    quickstart = ROOT / "examples" / "quickstart.toml"
    overridden = _load(str(quickstart), "vllm-server").backend
    assert overridden.kind == "vllm-server" and "model" not in overridden.model_fields_set
    assert {**overridden.model_dump(), "kind": "sim"} == load_settings(str(quickstart)).backend.model_dump()
    named = tmp_path / "named.toml"
    named.write_text(quickstart.read_text().replace("[backend]\n", '[backend]\nmodel = "qwen"\n', 1))
    overridden = _load(str(named), "vllm-server").backend
    assert overridden.model == "qwen" and "model" in overridden.model_fields_set


def test_a_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = fleetsched("run", "examples/quickstart.toml", "--no-live", "--metrics-port", str(port))
    assert done.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_metrics_url_printed_for_an_ipv6_host_is_a_url(tmp_path):
    # It printed http://::1:PORT/metrics, which no client reads as a host and a port.
    config = tmp_path / "one.toml"
    config.write_text('[tenants.acme]\n[[workload.agents]]\ntenant = "acme"\ncount = 1\nturns = 1\n')
    done = fleetsched("run", str(config), "--no-live", "--metrics-port", "0", "--metrics-host", "::1")
    if "cannot serve metrics" in done.stderr:
        pytest.skip(f"no IPv6 loopback here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "fleetsched: metrics on http://[::1]:" in done.stderr


def test_a_metrics_port_in_use_on_ipv6_names_the_address_as_urls_write_it():
    # It read "cannot serve metrics on ::1:PORT".
    try:
        taken = socket.socket(socket.AF_INET6)
        taken.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with taken:
        taken.listen()
        port = taken.getsockname()[1]
        done = fleetsched("run", "examples/quickstart.toml", "--no-live", "--metrics-port", str(port), "--metrics-host", "::1")
    assert done.returncode == 1 and f"cannot serve metrics on [::1]:{port}: Address already in use" in done.stderr


def test_env_overrides_and_its_errors(tmp_path):
    config = tmp_path / "ok.toml"
    config.write_text('[tenants.acme]\n[[workload.agents]]\ntenant = "acme"\ncount = 1\n')
    done = fleetsched("run", str(config), env={"FLEETSCHED_SCHEDULER__MAX_SESSIONS": "0"})
    assert done.returncode == 2 and "scheduler.max_sessions" in done.stderr


def test_an_environment_list_that_is_not_json_names_the_variable():
    # It was reported as an error of the TOML file, which was fine.
    done = fleetsched("run", "examples/quickstart.toml", env={"FLEETSCHED_BACKEND__URLS": "http://host:8000"})
    assert done.returncode == 2
    assert "config error: FLEETSCHED_BACKEND__URLS: an environment variable of this section does not parse" in done.stderr
    # A whole section as JSON is named as set (it read FLEETSCHED_SCHEDULER__...).
    done = fleetsched("run", "examples/quickstart.toml", env={"FLEETSCHED_SCHEDULER": "notjson"})
    assert done.returncode == 2 and "config error: FLEETSCHED_SCHEDULER: an environment variable" in done.stderr


def test_the_in_process_engine_missing_is_not_told_to_start_a_server():
    """Without vLLM installed, --backend vllm-engine said so, then advised starting the server
    and fixing backend.urls, which the in-process engine has neither of."""
    try:  # the test environment has no vLLM (it is in .venv-vllm)
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    done = fleetsched("run", "examples/quickstart.toml", "--backend", "vllm-engine")
    assert done.returncode == 1 and "needs vLLM installed" in done.stderr, done.stderr
    assert "start the server" not in done.stderr and "--backend sim" in done.stderr


def test_unknown_workload_tenant_and_missing_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[tenants.acme]\n[[workload.agents]]\ntenant = "ghost"\ncount = 1\n')
    done = fleetsched("run", str(config))
    assert done.returncode == 2 and "workload.agents.0.tenant" in done.stderr and "ghost" in done.stderr
    assert "(got {" not in done.stderr  # not the whole config echoed after the message
    done = fleetsched("run", str(tmp_path / "nope.toml"))
    # It read "--config: no such file", of an option `run` does not have.
    assert done.returncode == 2 and f"{tmp_path / 'nope.toml'}: no such file" in done.stderr and "--config" not in done.stderr


@pytest.mark.parametrize(
    ("sections", "why"),
    [
        # memory_quota "1GB" is below the default session_memory of 1 GiB.
        ('[tenants.acme]\nmemory_quota = "1GB"\n', "more than the memory_quota of tenant 'acme' (1,000,000,000 bytes)"),
        (
            '[tenants.acme]\nsession_memory = "100GB"\n',
            "more than the largest device holds (resources.devices, in whole pages of resources.page_size: 79,997,960,192 bytes)",
        ),
        # The whole device is 38,146.9 pages of 2 MiB: a pool of pages holds the whole ones only
        # (this passed the check, and the pool refused every session at submission).
        ('[tenants.acme]\nsession_memory = "80GB"\n', "in whole pages of resources.page_size: 79,997,960,192 bytes"),
        (
            '[tenants.acme]\nsession_memory = "100GB"\n[resources]\nstrategy = "counting"\n',
            "more than the largest device holds (resources.devices: 80,000,000,000 bytes)",
        ),
    ],
)
def test_a_workload_whose_sessions_could_never_be_admitted_is_a_config_error(tmp_path, sections, why):
    # It ran and printed "failed 2" for the tenant, without a word of why (each was rejected at submission).
    config = tmp_path / "never.toml"
    config.write_text(sections + '[[workload.agents]]\ntenant = "acme"\ncount = 2\n')
    done = fleetsched("run", str(config), "--no-live")
    assert done.returncode == 2, done.stdout
    assert "config error: workload.agents.0: a session reserves" in done.stderr and why in done.stderr


def test_bench_overhead_prints_json():
    done = fleetsched("bench", "overhead", "--sessions", "500", "--latency-sessions", "50", "--calls", "5", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["sessions"] == 500 and data["calls"] == 250
    assert {"p50", "p99"} <= set(data["added_latency_ms"]) and data["peak_rss_mb"] > 0


def test_a_bench_option_out_of_range_is_a_usage_error_naming_it():
    # --sessions 0 ended in a StatisticsError traceback; --rate 0 printed NaN figures.
    for argv, message in [
        (["bench", "allocator", "--sessions", "0"], "argument --sessions: expected an integer >= 1, got '0'"),
        (["bench", "gateway", "--rate", "0"], "argument --rate: expected a number > 0, got '0'"),
        (["bench", "qos", "--max-tokens", "8", "--max-tokens-spread", "8"], "--max-tokens-spread (8) must be below --max-tokens (8)"),
        (["simulate", "examples/quickstart.toml", "--stream-interval", "0"], "argument --stream-interval: expected an integer >= 1"),
        (["run", "examples/quickstart.toml", "--sample-interval", "0"], "argument --sample-interval: expected a number > 0"),
        (["serve", "--port", "70000"], "argument --port: expected a port from 0 to 65535, got '70000'"),
        # Beyond what the machine holds: 10 million sessions filled its memory instead of failing.
        (["bench", "overhead", "--sessions", "10000000"], "--sessions and --latency-sessions: at most 100,000"),
        (["bench", "overhead", "--calls", "100000"], "--latency-sessions x --calls makes 100,000,000 calls; at most 10,000,000"),
    ]:
        done = fleetsched(*argv)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr[-300:])


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_and_stops_cleanly(tmp_path, stop):
    """The gateway on its default backend (the embedded sim) as users start it; stopping it with
    Ctrl-C once ended in a cancel-scope error from the lifespan. SIGTERM is how service managers
    stop a server (systemd, docker stop, Kubernetes): uvicorn shut down gracefully, then raised
    the SIGTERM it caught again, and the process was killed by it (status -15, 143 in a shell,
    "Error" to a container runtime) after a clean stop that Ctrl-C ends with 0."""
    config = tmp_path / "gateway.toml"
    key = fleetsched("serve", "--hash-key", "fs-test-key").stdout.strip()
    config.write_text(f'[tenants.acme]\napi_keys = ["{key}"]\n')
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):  # up to 30 s to start
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer fs-test-key"}, timeout=10)
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.send_signal(stop)
        _, err = server.communicate(timeout=30)
    assert server.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "ERROR" not in err, err[-2000:]


@pytest.mark.parametrize(("stop", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_serve_stopped_while_it_reaches_its_backend_stops_at_once_with_one_line(tmp_path, stop, status, said):
    """Ctrl-C while the gateway still waited for its backend (a vLLM server that accepts and
    does not answer, as one still loading does) was noted and the start went on: 5 s a replica
    for its model, then the server started and stopped, exit 0; where the start then failed
    (its KV cache unread), uvicorn's ERROR lines and exit 3. A second Ctrl-C did not cut it."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(60)
        config = tmp_path / "gateway.toml"
        config.write_text(f'[backend]\nkind = "vllm-server"\nurls = ["http://127.0.0.1:{silent.getsockname()[1]}"]\n[tenants.acme]\n')
        server = subprocess.Popen(
            [sys.executable, "-m", "fleetsched.cli", "serve", "--config", str(config), "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
        )
        try:
            asked, _ = silent.accept()  # the gateway's start asks the backend for its model
            with asked:  # open, unanswered, until the gateway has gone
                server.send_signal(stop)
                _, err = server.communicate(timeout=60)
        finally:
            server.kill()
    assert server.returncode == status, err[-2000:]
    assert err.endswith(f"\nfleetsched: {said}\n") and "ERROR" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize(
    ("backend", "context_tokens", "status", "said"),
    [
        ("vllm-server", 4096, 1, "fleetsched serve: the vllm-server backend cannot be reached: vLLM replica r0 (http://127.0.0.1:"),
        ("sim", 400_000, 2, "fleetsched: config error: resources.kv_cache.context_tokens: "),
    ],
)
def test_serve_whose_start_fails_says_why_in_one_line_as_a_run(tmp_path, backend, context_tokens, status, said):
    """A start that failed by itself (the KV cache of a vLLM server that cannot be reached, or
    a session's budget larger than the cache) ended in uvicorn's "ERROR:    BackendUnavailable:
    ..." and "ERROR:    Application startup failed. Exiting.", and exit 3, where `run` on the
    same config says why in one line and exits 1 (2 for a config error)."""
    if backend == "vllm-server":  # none listens on its port
        backend = f'kind = "vllm-server"\nurls = ["http://127.0.0.1:{free_port()}"]'
    else:
        backend = '[backend.sim]\nprofile = "qwen2-7b-a100-40gb"'
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"[backend]\n{backend}\n[resources.kv_cache]\nconfig = \"examples/models/qwen2-7b-instruct\"\n"
        f"context_tokens = {context_tokens}\n[tenants.acme]\n"
    )
    done = fleetsched("serve", "--config", str(config), "--port", "0")
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(said), done.stderr[-2000:]
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_second_ctrl_c_cuts_the_calls_under_way_with_one_line_and_status_130(tmp_path):
    """Ctrl-C once waits for the calls under way; twice, uvicorn stopped waiting and the calls
    were cancelled where they stood by the loop's end: an "Exception in ASGI application" and an
    "Exception in 'lifespan' protocol", each with a traceback, and exit 0 as after a clean stop."""
    config = tmp_path / "gateway.toml"
    key = fleetsched("serve", "--hash-key", "fs-test-key").stdout.strip()
    config.write_text(f'[backend.sim]\nmax_model_len = 200000\n[tenants.acme]\napi_keys = ["{key}"]\n')
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # up to 30 s to start
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}  # minutes
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer fs-test-key"}, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(signal.SIGINT)
            for _ in range(300):  # the shutdown has begun once the server no longer listens
                try:
                    httpx.get(url + "/health", timeout=1)
                    time.sleep(0.1)
                except httpx.ConnectError:
                    break
            else:
                pytest.fail("the gateway went on listening after Ctrl-C")
            server.send_signal(signal.SIGINT)
            with pytest.raises(httpx.RemoteProtocolError):  # cut, not ended
                for _ in lines:
                    pass
        _, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 130 and err.endswith("\nfleetsched: interrupted\n"), err[-2000:]
    assert "ERROR" not in err and "Traceback" not in err, err[-2000:]


def _interruptible() -> None:
    """Ctrl-C's default in the child: started from a shell's background job (``make test &``),
    this process ignores SIGINT, and so does every child; Python then leaves it ignored, and
    the run or simulation went on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_run_with_one_line_and_status_130():
    run = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "run", "examples/quickstart.toml", "--no-live"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
    )
    time.sleep(3)  # the quick start runs for about 18 s
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130 and err == "fleetsched: interrupted\n"


def test_sigterm_stops_a_run_on_a_terminal_cleanly_with_one_line_and_status_143():
    """SIGTERM (`kill`, `timeout`, a service manager) killed the run where it stood: no word,
    the live dashboard left half drawn and the terminal's cursor hidden (status -15)."""
    import pty
    import threading

    controller, terminal = pty.openpty()
    run = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "run", "examples/quickstart.toml"],
        cwd=ROOT, stdout=terminal, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
        env={**os.environ, "COLUMNS": "120", "LINES": "40"},
    )
    os.close(terminal)
    shown = bytearray()

    def read() -> None:  # the terminal's side, read as it comes: a full pty would block the run
        try:
            while chunk := os.read(controller, 65536):
                shown.extend(chunk)
        except OSError:  # the run has gone (EIO)
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        time.sleep(3)  # the quick start runs for about 18 s
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=30)
        reader.join(timeout=10)
    finally:
        os.close(controller)
    assert run.returncode == 143 and err == "fleetsched: terminated\n", (run.returncode, err[-2000:])
    assert b"\x1b[?25l" in shown  # the dashboard was drawn, its cursor hidden, and shown again
    assert shown.rfind(b"\x1b[?25h") > shown.rfind(b"\x1b[?25l")


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_ctrl_c_stops_a_simulation_with_one_line_and_status_130(loop):
    """Before, on trio: a traceback of the KeyboardInterrupt in an exception group, status 1."""
    run = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "simulate", "examples/tenant_slas.toml", "--duration", "1h", "--loop", loop],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
    )
    # Its note says the config is read (a busy machine took over 3 s to import the command, and
    # the Ctrl-C meant for the simulation stopped the import); an hour takes minutes.
    note = run.stderr.readline()
    assert note.startswith("fleetsched simulate: note:"), note
    time.sleep(2)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130 and err.endswith("fleetsched: interrupted\n"), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "module"),
    [("fleetsched", "fleetsched.scheduler"), ("fleetsched", "fleetsched.cli"), ("fleetsched.cli", "fleetsched.scheduler")],
)
def test_ctrl_c_while_the_command_is_imported_stops_it_with_one_line_and_status_130(tmp_path, command, module):
    """Ctrl-C in the command's first second or two (`python -m fleetsched run ...`, imports
    still under way: the package imported the whole library) ended in the import's traceback.
    The import of `module` is held here until the Ctrl-C comes (an import hook, in place from
    the interpreter's start: `sitecustomize`)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\n"
        "class Hold:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            print('importing', flush=True)\n"
        "            time.sleep(60)\n"
        "sys.meta_path.insert(0, Hold())\n"
    )
    path = os.pathsep.join([str(tmp_path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = subprocess.Popen(
        [sys.executable, "-m", command, "run", "examples/quickstart.toml", "--no-live"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert run.stdout.readline() == "importing\n"
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130 and err == "fleetsched: interrupted\n", (run.returncode, err[-2000:])


def test_ctrl_c_leaves_no_warning_of_a_task_it_stopped_before_its_start():
    """On trio, Ctrl-C can land in `start_soon` between a task's coroutine being made and its
    start: that coroutine's "never awaited" warning followed "fleetsched: interrupted" (seen once
    in CI, with simulate --loop trio). Provoked here where it happens: inside the command."""
    code = (
        "import fleetsched.cli as cli\n"
        "async def task(): pass\n"
        "def command(argv):\n"
        "    made = task()  # made, never started\n"
        "    raise KeyboardInterrupt\n"
        "cli._main = command\n"
        "raise SystemExit(cli.main([]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 130 and run.stderr == "fleetsched: interrupted\n", run.stderr


@pytest.mark.parametrize("command", [["run", "examples/quickstart.toml"], ["simulate", "examples/quickstart.toml", "--duration", "5s"]])
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(command, capsys):
    """Before: a FileNotFoundError traceback after the whole run, its results lost."""
    from fleetsched.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main([*command, "--report", "/nonexistent/run.json"])
    assert exit_.value.code == 2 and "no directory '/nonexistent' to write it in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # it said "'' is a directory"
        cli_main([*command, "--report", ""])
    assert exit_.value.code == 2 and "--report: expected a file name, got an empty one" in capsys.readouterr().err


def test_a_tool_s_max_without_a_uniform_tool_time_is_refused():
    """tool_s_max bounds the uniform tool time only: with tool_dist "fixed" (the default) it was
    ignored without a word, and a mix meant to draw 0-2 s ran tools of tool_s every time."""
    from fleetsched.settings import Settings

    agents = [{"tenant": "acme", "count": 1, "tool_s": 0, "tool_s_max": 2}]
    with pytest.raises(ValueError, match='tool_s_max: applies to tool_dist = "uniform" only'):
        Settings(tenants={"acme": {}}, workload={"agents": agents})
    Settings(tenants={"acme": {}}, workload={"agents": [{**agents[0], "tool_dist": "uniform"}]})


def test_python_dash_m_fleetsched_is_the_command():
    # `python -m fleetsched` was "No module named fleetsched.__main__".
    done = subprocess.run([sys.executable, "-m", "fleetsched", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: fleetsched" in done.stdout


def test_serve_hash_key_of_an_empty_key_is_a_usage_error_not_a_server():
    """`fleetsched serve --hash-key "$KEY"` with KEY unset went on to start the gateway (on the
    default port, serving until killed) instead of printing a hash."""
    done = subprocess.run(
        [sys.executable, "-m", "fleetsched.cli", "serve", "--hash-key", "", "--port", "0"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "argument --hash-key: the key is empty" in done.stderr, done.stderr[-500:]


def test_serve_hash_key_refuses_a_key_no_client_could_present(capsys):
    """A key with white space at an end (a key file saved with CRLF, read with "$(cat key)",
    keeps its "\\r") was hashed as given, but the gateway trims the Authorization header: the
    tenant got 401 whatever it sent. A key that is not UTF-8 was a UnicodeEncodeError's
    traceback; it is hashed from its bytes, as the gateway reads a header's."""
    from fleetsched.gateway.auth import KeyRing, hash_key
    from fleetsched.gateway.server import main
    from fleetsched.settings import TenantSettings

    for key in ("fs-key\r", " fs-key", "fs-key\t"):
        with pytest.raises(SystemExit) as exited:
            main(["--hash-key", key])
        assert exited.value.code == 2
        assert "argument --hash-key: the key begins or ends with white space" in capsys.readouterr().err
    key = b"fs-\xff-key".decode("utf-8", "surrogateescape")  # as Python reads such a byte of argv
    assert main(["--hash-key", key]) == 0
    stored = capsys.readouterr().out.strip()
    ring = KeyRing({"acme": TenantSettings(api_keys=[stored])})
    assert ring.identify_header(b"Bearer fs-\xff-key").tenant == "acme"
    assert hash_key("fs-clé") == hash_key(b"fs-cl\xc3\xa9".decode("utf-8", "surrogateescape"))


@pytest.mark.parametrize(
    "argv",
    [
        ["mixed-pace", "--backend", "vllm-server", "--url", "notaurl", "--seconds", "1"],
        ["mixed-pace", "--backend", "vllm-server", "--url", "http://127.0.0.1:99999", "--seconds", "1"],
        ["sim-fidelity", "--url", "localhost:8000", "--no-speed", "--no-calibrate"],
        ["qos", "--url", "ftp://127.0.0.1:8000"],
    ],
)
def test_a_bench_url_that_is_not_a_server_root_is_a_usage_error(argv, capsys):
    """Before: mixed-pace ended in a pydantic ValidationError traceback from its settings,
    sim-fidelity in an httpx UnsupportedProtocol traceback, qos in 'probe calls failed', exit 1."""
    from fleetsched import bench

    with pytest.raises(SystemExit) as exited:
        bench.run(argv[0], argv[1:])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --url: expected http://host:port" in err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_the_benchmarks(flag, capsys):
    # `fleetsched bench --help` was "unrecognized arguments: --help", exit 2 (its parser has no
    # -h of its own, so that `bench NAME --help` reaches the benchmark's).
    from fleetsched.cli import main as cli_main

    assert cli_main(["bench", flag]) == 0
    assert "allocator" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_before_a_name_is_that_benchmarks_help(flag, capsys):
    # `fleetsched bench -h overhead` ran the benchmark (10,000 sessions; `-h qos` a real vLLM),
    # its -h ignored. The options after the name (here one that the run would refuse) are not run.
    from fleetsched.cli import main as cli_main

    with pytest.raises(SystemExit) as exited:
        cli_main(["bench", flag, "overhead", "--sessions", "10000000"])
    assert exited.value.code == 0
    assert "usage: fleetsched bench overhead" in capsys.readouterr().out


def test_tenant_names_are_printed_and_plotted_as_written(tmp_path):
    # "team[/]" is rich markup: the run ended in a MarkupError after its last session, before its
    # report was written. "$a$" is matplotlib math: `fleetsched report` failed to plot.
    config = tmp_path / "odd.toml"
    config.write_text(
        '[backend]\nkind = "instant"\n[tenants."team[/]"]\n[tenants."$a$"]\n'
        '[[workload.agents]]\ntenant = "team[/]"\ncount = 1\nturns = 1\n'
        '[[workload.agents]]\ntenant = "$a$"\ncount = 1\nturns = 1\n'
    )
    report = tmp_path / "run.json"
    done = fleetsched("run", str(config), "--no-live", "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert "team[/]" in done.stdout and report.exists()
    plotted = fleetsched("report", str(report), "--out", str(tmp_path / "plots"))
    assert plotted.returncode == 0, plotted.stderr


def test_simulate_prints_its_tables_at_the_terminal_s_width():
    """On a terminal 80 columns wide, simulate printed its tables 160 wide: the terminal folded
    every line of them. Off a terminal (logs, CI) they stay 160 wide, as run's do."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    run = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "simulate", "examples/quickstart.toml", "--duration", "20s"],
        cwd=ROOT, stdout=follower, stderr=subprocess.DEVNULL, env=env,
    )
    os.close(follower)
    printed = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        printed += chunk
    os.close(leader)
    assert run.wait(timeout=60) == 0
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in printed.decode().splitlines()]
    assert any(line.startswith("┏") for line in lines), lines
    assert max(len(line) for line in lines) <= 80, lines


def test_serve_on_a_port_in_use_is_a_clear_error_and_port_0_prints_the_port_bound(tmp_path):
    """`serve` printed "fleetsched gateway on http://127.0.0.1:PORT/v1" before it bound, then
    uvicorn's own error line, and exited 3; with --port 0 it printed port 0."""
    config = tmp_path / "gateway.toml"
    config.write_text("[tenants.acme]\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = fleetsched("serve", "--config", str(config), "--port", str(port))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"fleetsched serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "fleetsched gateway on" not in done.stderr
    server = subprocess.Popen(
        [sys.executable, "-m", "fleetsched.cli", "serve", "--config", str(config), "--port", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = ""
        while "fleetsched gateway on" not in line:
            line = server.stderr.readline()
            assert line, "the gateway ended before saying where it serves"
        url = line.split(" on ")[1].split(" ")[0].removesuffix("/v1")
        assert not url.endswith(":0")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=30)


def test_serve_on_an_ipv6_port_in_use_names_the_address_in_brackets(tmp_path):
    """The port in use on an IPv6 host was said as "cannot listen on :::8080", which reads as
    no address a user gave (the run's metrics port says [::1]:PORT)."""
    try:
        taken = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    config = tmp_path / "gateway.toml"
    config.write_text("[tenants.acme]\n")
    with taken:
        port = taken.getsockname()[1]
        done = fleetsched("serve", "--config", str(config), "--host", "::1", "--port", str(port))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"fleetsched serve: cannot listen on [::1]:{port}: Address already in use", done.stderr


def test_json_to_a_reader_that_has_gone_is_no_error():
    """`fleetsched ... --json | head -1`: the reader gone, the write raised BrokenPipeError, and
    a traceback came (5 runs in 8 of `bench sim-fidelity --json | head -1`)."""
    command = [sys.executable, "-m", "fleetsched.cli", "simulate", "examples/quickstart.toml", "--duration", "10s", "--json"]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # before it writes (it simulates first)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


PIPED_RUN = """
[backend]
kind = "sim"
[tenants.a]
tier = "standard"
[[workload.agents]]
tenant = "a"
count = 4
turns = 3
prompt_tokens = 100
max_tokens = 300
think_s = 1.0
"""


@pytest.mark.parametrize(
    "command",
    [["simulate", "--json"], ["simulate"], ["run"]],  # run: its progress lines, every 2 s, then the tables
    ids=["simulate-json", "simulate-tables", "run-progress"],
)
def test_a_reader_of_stdout_that_stops_early_loses_no_report(command, tmp_path):
    """`... --report r.json | head -1`: the tables (or JSON) were printed before the file was
    written, and the closed pipe ended the command first, without a word (simulate), or with a
    traceback from the progress line's task and the run stopped part-way (run)."""
    config, report = tmp_path / "fleet.toml", tmp_path / "r.json"
    config.write_text(PIPED_RUN)
    argv = [sys.executable, "-m", "fleetsched.cli", command[0], str(config), *command[1:], "--report", str(report)]
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.readline()
    child.stdout.close()  # as `head -1` leaves
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert json.loads(report.read_text())["sessions"] == {"done": 4}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_run_whose_stdout_cannot_be_written_goes_on_and_writes_its_report(tmp_path):
    """`fleetsched run ... > run.log` on a full disk: the first progress line's write raised
    out of the run (an exception group traceback, status 1), which stopped part-way with no
    report. It goes on, says once that its output is dropped, and fails only with status 1."""
    config, report = tmp_path / "fleet.toml", tmp_path / "r.json"
    config.write_text(PIPED_RUN)
    argv = [sys.executable, "-m", "fleetsched.cli", "run", str(config), "--report", str(report)]
    with open("/dev/full", "w") as full:
        done = subprocess.run(argv, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr == "fleetsched: cannot write to stdout (No space left on device); its output is dropped\n"
    assert json.loads(report.read_text())["sessions"] == {"done": 4}


def test_a_report_cut_short_by_a_full_disk_leaves_no_broken_file(tmp_path):
    """The disk fills as the report is written (here: a file size limit, which fails the write
    as a full disk does): the report was printed and said not written, yet its first part was
    left at the path, which `fleetsched report` then refused as "not a JSON run report"."""
    import resource

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG), not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    config, report = tmp_path / "fleet.toml", tmp_path / "r.json"
    config.write_text(PIPED_RUN)
    argv = [sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live", "--report", str(report)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=limited)
    assert done.returncode == 1 and f"cannot write {report} (File too large); the report is printed above" in done.stderr, done.stderr
    assert '"schema": "fleetsched.run/2"' in done.stdout
    assert not report.exists()


def test_a_metrics_host_without_a_port_is_refused():
    """It was ignored without a word: no metrics were served, the run went on."""
    done = fleetsched("run", "examples/quickstart.toml", "--no-live", "--metrics-host", "0.0.0.0")
    assert done.returncode == 2 and "--metrics-host applies only with --metrics-port" in done.stderr


FAILING_FLEET = """
[backend]
kind = "sim"
[backend.sim]
max_model_len = 512
[tenants.a]
tier = "standard"
[tenants.b]
tier = "batch"
[[workload.agents]]
tenant = "a"
count = 3
prompt_tokens = 600
max_tokens = 16
"""


@pytest.mark.parametrize("command", [["run", "--no-live"], ["simulate"], ["simulate", "--duration", "20s"]])
def test_a_run_in_which_every_session_failed_says_why_and_exits_1(tmp_path, command):
    """Every call over the context: the tables showed "failed 3" and the run exited 0, which a
    script or CI job running a fleet read as success; the report did not say what they failed with."""
    config = tmp_path / "fleet.toml"
    config.write_text(FAILING_FLEET)
    report = tmp_path / "run.json"
    done = fleetsched(command[0], str(config), *command[1:], "--report", str(report))
    assert done.returncode == 1, done.stderr
    failed = json.loads(report.read_text())["tenants"][0]
    assert failed["session_errors"] == {"ContextTooLong": failed["sessions_failed"]}
    n = failed["sessions_failed"]
    assert n >= 3 and f"{n} of {n} sessions failed (ContextTooLong {n})" in done.stderr


def test_a_run_in_which_some_sessions_failed_says_why_and_exits_0(tmp_path):
    config = tmp_path / "fleet.toml"
    config.write_text(FAILING_FLEET + '[[workload.agents]]\ntenant = "b"\ncount = 2\nprompt_tokens = 50\nmax_tokens = 8\n')
    done = fleetsched("run", str(config), "--no-live")
    assert done.returncode == 0, done.stderr
    assert "3 of 5 sessions failed (ContextTooLong 3)" in done.stderr
