"""`fleetsched calibrate` against servers that answer what vLLM never would: one line and exit 1,
not a traceback or a sweep that never ends. No real vLLM can be made to send these answers, so
each is a small local server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import pytest

from fleetsched.calibrate import main as calibrate_main

from .test_calibration import _http_server

TEXT = json.dumps({"choices": [{"index": 0, "text": " a"}]})


class _Streams(http.server.BaseHTTPRequestHandler):
    """Serves the model "tiny" and streams each completion as `chunks` (the data of each SSE line)."""

    protocol_version = "HTTP/1.1"
    chunks: tuple[str, ...] = ()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200, "application/json", json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.answer(body)

    def answer(self, body: dict[str, Any]) -> None:
        self._answer(200, "text/event-stream", "".join(f"data: {chunk}\n\n" for chunk in (*self.chunks, "[DONE]")))

    def _answer(self, status: int, content_type: str, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _streaming(*chunks: str) -> type[_Streams]:
    return type("Streams", (_Streams,), {"chunks": chunks})


def _calibrate(url: str, out: str, *extra: str) -> int:
    # Two prompt lengths: from one, the fit may put decoding on the context alone (refused).
    return calibrate_main(["--url", url, "--out", out, "--concurrency", "1", "--shapes", "64:16,256:16", "--repeats", "1", "--rounds", "1", *extra])


@pytest.mark.parametrize(
    "chunks",
    [  # before: a KeyError, AttributeError or TypeError traceback from one_request
        (TEXT, json.dumps({"choices": [], "usage": {"total_tokens": 5}})),
        ("[1, 2, 3]",),
        (json.dumps({"choices": ["x"]}),),
        (TEXT, json.dumps({"choices": [], "usage": "lots"})),
        (TEXT, json.dumps({"choices": [], "usage": {"prompt_tokens": "64", "completion_tokens": 1}})),
        (TEXT, json.dumps({"choices": [], "usage": {"prompt_tokens": True, "completion_tokens": 1}})),  # a bool is no count
    ],
)
def test_a_stream_of_json_not_of_openais_shape_is_one_line(chunks, tmp_path, capsys):
    out = tmp_path / "p.toml"
    with _http_server(_streaming(*chunks)) as url:
        code = _calibrate(url, str(out))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [f"fleetsched calibrate: {url}: the server streamed a chunk that is not an OpenAI completion chunk: {chunks[-1]}"]
    assert not out.exists()


class _CountsNoPromptTokens(_Streams):
    """Usage says 0 prompt tokens whatever the prompt; a prompt over 100,000 characters is
    refused (HTTP 400) as a server refuses one past its context."""

    def answer(self, body: dict[str, Any]) -> None:
        if len(body["prompt"]) > 100_000:
            self._answer(400, "application/json", json.dumps({"error": {"message": "prompt too long"}}))
            return
        self.chunks = (TEXT, json.dumps({"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": body["max_tokens"]}}))
        super().answer(body)


def test_a_server_that_counts_no_prompt_tokens_is_refused_after_one_probe(tmp_path, capsys):
    """Before: each probe multiplied the prompt by 64 (64, 4,096, 262,144 characters... up to
    a gigabyte, which a server without a limit took, RSS past 4 GB); here the third probe is refused."""
    with _http_server(_CountsNoPromptTokens) as url:
        code = _calibrate(url, str(tmp_path / "p.toml"))
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [
        f"fleetsched calibrate: {url}: the server counted 0 prompt tokens for a 64-character prompt (a token is 32 characters at most): is it vLLM?"
    ]


class _CountsATokenIn64Characters(_Streams):
    """Counts one prompt token in 64 characters: fewer than any tokenizer of this text makes."""

    def answer(self, body: dict[str, Any]) -> None:
        usage = {"prompt_tokens": len(body["prompt"]) // 64, "completion_tokens": body["max_tokens"]}
        self.chunks = (TEXT, json.dumps({"choices": [], "usage": usage}))
        super().answer(body)


def test_a_server_that_counts_a_token_past_32_characters_is_refused(tmp_path, capsys):
    """A token spans 32 characters at most: 1 token for a 64-character prompt is no count of it."""
    with _http_server(_CountsATokenIn64Characters) as url:
        assert _calibrate(url, str(tmp_path / "p.toml")) == 1
    assert "the server counted 1 prompt tokens for a 64-character prompt (a token is 32 characters at most)" in capsys.readouterr().err


class _Silent(_Streams):
    """Takes each completion and never answers it (until `release` is set)."""

    release = threading.Event()

    def answer(self, body: dict[str, Any]) -> None:
        self.release.wait(30)
        self.close_connection = True


def test_a_server_that_never_answers_is_given_up_after_the_read_timeout(tmp_path, capsys):
    """Before: each request waited 600 s without a word (and there was no --read-timeout)."""
    with _http_server(_Silent) as url:
        try:
            code = _calibrate(url, str(tmp_path / "p.toml"), "--read-timeout", "0.5")
        finally:
            _Silent.release.set()  # the server's handler threads may end
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [
        f"fleetsched calibrate: {url}: ReadTimeout: the server sent nothing for 0.5 s (is it stuck? --read-timeout waits longer)"
    ]


class _Trickles(_Streams):
    """Sends its model list a byte every 0.2 s (a choked proxy), for 10 s or until `release` is set."""

    release = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "10000")
        self.end_headers()
        self.close_connection = True
        for _ in range(50):  # then it closes: 10 s in all, past the timeout
            if self.release.wait(0.2):  # wall-clock ok: a stand-in server's pace
                return
            self.wfile.write(b" ")
            self.wfile.flush()


@pytest.mark.parametrize("model", [[], ["--model", "tiny"]])
def test_a_model_list_that_trickles_in_is_given_up_after_the_read_timeout(model, tmp_path, capsys):
    """The read timeout bounds each read: a list that came a byte at a time held calibrate
    before its first request, without a word, for as long as it trickled."""
    _Trickles.release.clear()  # set by the test before
    with _http_server(_Trickles) as url:
        began = time.monotonic()
        try:
            code = _calibrate(url, str(tmp_path / "p.toml"), "--read-timeout", "1", *model)
        finally:
            _Trickles.release.set()
    assert time.monotonic() - began < 8
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fleetsched calibrate: {url}: GET /v1/models did not answer whole within 1 s (is it stuck? --read-timeout waits longer)"
    ]


class _CountsAsVllm(_Streams):
    """Counts a prompt token every 4 characters and generates every token asked for, the first
    at once and the rest a millisecond a token later (a fit to answers that take their first
    token's time and no more gives the engine's steps no time, and calibrate writes no profile)."""

    def answer(self, body: dict[str, Any]) -> None:
        usage = {"prompt_tokens": len(body["prompt"]) // 4, "completion_tokens": body["max_tokens"]}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # no length: the answer ends with the connection
        self.close_connection = True
        self.wfile.write(f"data: {TEXT}\n\n".encode())
        self.wfile.flush()
        time.sleep(0.001 * body["max_tokens"])  # wall-clock ok: a stand-in server's decoding
        self.wfile.write("".join(f"data: {chunk}\n\n" for chunk in (TEXT, json.dumps({"choices": [], "usage": usage}), "[DONE]")).encode())


def test_a_sweep_writes_the_profile_it_fitted_with_the_engine_shape_given(tmp_path, capsys):
    """The profile holds the costs as printed (4 significant digits), the engine shape from the
    command line, and the sweep's record."""
    from fleetsched.backends.sim._fit import PARAMS
    from fleetsched.backends.sim._profiles import load_profile

    out = tmp_path / "p.toml"
    with _http_server(_CountsAsVllm) as url:
        assert _calibrate(url, str(out), "--max-num-seqs", "16", "--max-model-len", "512", "--shapes", "64:16,64:64") == 0
    printed = dict(item.split(" = ") for item in capsys.readouterr().out.split("fit: ", 1)[1].splitlines()[0].split(", "))
    profile = load_profile(str(out))
    assert {k: profile.sim[k] for k in PARAMS} == {k: float(printed[k]) for k in PARAMS}
    shape = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "block_size": 128, "kv_cache_tokens": 524288, "max_model_len": 512}
    assert {k: profile.sim[k] for k in shape} == shape
    assert profile.fit["concurrency"] == [1, 1] and profile.fit["max_tokens"] == [16, 64] and profile.fit["max_ttft_p50_rel_err"] >= 0


def test_a_sweep_that_fails_on_more_than_the_server_is_not_blamed_on_it():
    """An error group with an error of the sweep's own beside the server's is raised, not one line."""
    import httpx

    from fleetsched.calibrate import _server_error

    assert _server_error(ExceptionGroup("sweep", [httpx.ReadError(""), KeyError("x")])) is None
    assert _server_error(ExceptionGroup("sweep", [httpx.ReadError(""), RuntimeError("x")])) == "ReadError (the server closed the connection: did it stop?)"


class _RecordsBodies(_CountsAsVllm):
    bodies: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> None:
        self.bodies.append(body)
        super().answer(body)


def test_the_sweep_asks_for_a_stream_interval_only_past_one_token(tmp_path, capsys):
    """The sweep's requests leave the field out at --stream-interval 1 (vLLM's default) and send 16 by default."""
    with _http_server(_RecordsBodies) as url:
        assert _calibrate(url, str(tmp_path / "p.toml"), "--stream-interval", "1") == 0
        measured = [body for body in _RecordsBodies.bodies if body["max_tokens"] == 16]  # not the warm-up's or probes'
        assert measured and not any("stream_interval" in body for body in measured)
        _RecordsBodies.bodies.clear()
        assert _calibrate(url, str(tmp_path / "p.toml")) == 0
    assert {body.get("stream_interval") for body in _RecordsBodies.bodies if body["max_tokens"] == 16} == {16}


class _RoutesAsVllm(_CountsAsVllm):
    """`_CountsAsVllm` with vLLM's routes only: any other path is a 404, as vLLM's own."""

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            return self._answer(404, "application/json", '{"detail":"Not Found"}')
        super().do_GET()

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            return self._answer(404, "application/json", '{"detail":"Not Found"}')
        super().do_POST()


@pytest.mark.parametrize("suffix", ["/", "/v1", "/v1/"])
def test_a_url_with_the_openai_v1_suffix_is_the_servers_root(suffix, tmp_path, capsys):
    """The OpenAI base URL (http://host:port/v1), as the vllm-server backend takes it. Before:
    GET /v1/v1/models answered 404, and calibrate asked whether the server was vLLM at all."""
    out = tmp_path / "p.toml"
    with _http_server(_RoutesAsVllm) as url:
        assert _calibrate(url + suffix, str(out)) == 0, capsys.readouterr().err
    assert f"fleetsched calibrate --url {url}:" in out.read_text()


class _ListsAContextLength(_CountsAsVllm):
    """`_CountsAsVllm` listing its model with a context length of 256 tokens, as vLLM lists it."""

    posts: list[dict[str, Any]] = []

    def do_GET(self) -> None:
        model = {"id": "tiny", "object": "model", "max_model_len": 256}
        self._answer(200, "application/json", json.dumps({"object": "list", "data": [model]}))

    def answer(self, body: dict[str, Any]) -> None:
        self.posts.append(body)
        super().answer(body)


def test_shapes_past_the_servers_context_length_are_refused_before_the_sweep(tmp_path, capsys):
    """Before: the default shapes' 384-token prompt on a server started with --max-model-len 256
    ended the sweep after its warm-up with "the server refused a 384-character prompt with 1
    max_tokens", naming no shape; a shape whose answer the server cut was measured as asked."""
    with _http_server(_ListsAContextLength) as url:
        assert _calibrate(url, str(tmp_path / "p.toml"), "--shapes", "64:16,200:64") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fleetsched calibrate: {url}: --shapes 200:64: 200 prompt + 64 completion tokens exceed the server's max_model_len of 256 "
        "(give --shapes that fit it, and --max-model-len 256)"
    ]
    assert _ListsAContextLength.posts == []
    assert not (tmp_path / "p.toml").exists()


def test_an_error_the_server_streams_is_reported_in_its_words(tmp_path, capsys):
    """vLLM streams a failure after its 200 as an event (its engine killed mid-sweep: what the real
    server sent, then [DONE]). Before: "the server answered no tokens or no usage for a 8-token
    request", the server's message lost."""
    message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    event = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    out = tmp_path / "p.toml"
    with _http_server(_streaming(TEXT, event)) as url:
        assert _calibrate(url, str(out)) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"fleetsched calibrate: {url}: the server streamed an error: {message}"]
    assert not out.exists()
