"""Benchmarks misused from the command line: one line saying what is wrong, not a traceback, and
options refused where they would be ignored."""

from __future__ import annotations

import functools
import http.server
import threading

import pytest

from fleetsched import bench
from fleetsched.bench import mixed_pace
from fleetsched.testing.vllm_server import free_port


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # its request log would be on the stderr under test
        pass


@pytest.fixture
def not_vllm(tmp_path):
    """A real HTTP server that is not vLLM (``python -m http.server``): 404 for /v1/models."""
    handler = functools.partial(_QuietFiles, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_sim_fidelity_against_a_server_that_is_down_says_so_in_one_line(capsys):
    """Before: a traceback ending in httpx.ConnectError."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert bench.run("sim-fidelity", ["--url", url, "--no-speed"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fleetsched bench sim-fidelity: cannot reach the vLLM server at {url} (ConnectError")
    assert len(err.splitlines()) == 1


def test_sim_fidelity_against_a_server_that_is_not_vllm_says_so_in_one_line(not_vllm, capsys):
    """Before: a traceback ending in json.JSONDecodeError (the 404 page read as JSON)."""
    assert bench.run("sim-fidelity", ["--url", not_vllm, "--no-speed"]) == 1
    err = capsys.readouterr().err
    assert err == f"fleetsched bench sim-fidelity: GET {not_vllm}/v1/models answered 404 with no model: is this a vLLM server?\n"


class _ListsAModelThenDrops(http.server.BaseHTTPRequestHandler):
    """Answers GET /v1/models as vLLM does, then closes the connection on every request after:
    a server that dies once the run is under way."""

    def do_GET(self):
        if self.path != "/v1/models":
            self.close_connection = True
            return
        body = b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.close_connection = True  # no answer at all: the client reads a closed connection

    def log_message(self, format, *args):
        pass


def test_sim_fidelity_against_a_server_that_stops_answering_mid_run_says_so_in_one_line(capsys):
    """Before: a traceback ending in httpx.RemoteProtocolError (only the check at the start was
    one line)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ListsAModelThenDrops)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert bench.run("sim-fidelity", ["--url", url, "--no-speed"]) == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    err = capsys.readouterr().err
    assert err.startswith(f"fleetsched bench sim-fidelity: the vLLM server at {url} stopped answering partway through the run (")
    assert len(err.splitlines()) == 1


def test_an_unknown_benchmark_is_a_usage_error(capsys):
    """Before: exit 1, as a failed run, not argparse's 2 for a usage error."""
    assert bench.run("nosuch", []) == 2
    assert "unknown benchmark 'nosuch'; known: allocator, gateway" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "flag"),
    [(["--engine-cpus", "0"], "--engine-cpus"), (["--engine-nice", "5"], "--engine-nice"), (["--client-off-engine"], "--client-off-engine")],
)
def test_qos_options_of_the_servers_it_starts_are_refused_with_url(option, flag, capsys):
    """Before: accepted and ignored without a word (the server at --url is not the bench's to pin
    or renice)."""
    from fleetsched.bench.qos import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--url", "http://127.0.0.1:1", *option])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"{flag} applies only to the servers the bench starts (not with --url)" in err


def test_qos_options_of_the_servers_it_starts_keep_their_defaults():
    from fleetsched.bench.qos import parse_args
    from fleetsched.testing.vllm_server import default_engine_cpus

    for argv in ([], ["--url", "http://127.0.0.1:1"]):
        args = parse_args(argv)
        assert (args.engine_nice, args.engine_cpus, args.client_off_engine) == (19, default_engine_cpus(), False)
    args = parse_args(["--engine-nice", "0", "--engine-cpus", "none", "--client-off-engine"])
    assert (args.engine_nice, args.engine_cpus, args.client_off_engine) == (0, frozenset(), True)


def test_mixed_pace_engine_nice_is_refused_with_url(capsys):
    """Before: accepted and ignored without a word."""
    with pytest.raises(SystemExit) as exited:
        mixed_pace.main(["--backend", "vllm-server", "--url", "http://127.0.0.1:1", "--engine-nice", "5"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--engine-nice applies only with --backend vllm-server, to the server it starts (not with --url)" in err
