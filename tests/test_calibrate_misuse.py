"""`fleetsched calibrate` against servers that answer what vLLM never would: one line and exit 1,
not a traceback or a sweep that never ends. No real vLLM can be made to send these answers, so
each is a small local server."""

from __future__ import annotations

import http.server
import json
import threading
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
    return calibrate_main(["--url", url, "--out", out, "--concurrency", "1", "--shapes", "64:16", "--repeats", "1", "--rounds", "1", *extra])


@pytest.mark.parametrize(
    "chunks",
    [  # before: a KeyError, AttributeError or TypeError traceback from one_request
        (TEXT, json.dumps({"choices": [], "usage": {"total_tokens": 5}})),
        ("[1, 2, 3]",),
        (json.dumps({"choices": ["x"]}),),
        (TEXT, json.dumps({"choices": [], "usage": "lots"})),
        (TEXT, json.dumps({"choices": [], "usage": {"prompt_tokens": "64", "completion_tokens": 1}})),
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
