"""bench gateway's argument handling and figures, without starting its servers."""

import asyncio
import json
import socket

import pytest

from fleetsched.bench import gateway


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_answered_request_gives_null_percentiles_not_nan():
    """Every request failing (here: nothing listens) leaves no latency to take percentiles of;
    they were float('nan'), which json.dumps writes as NaN (not JSON)."""
    port = _closed_port()
    load = asyncio.run(gateway._load(port, gateway._request(port, gateway._BODY, False), 20.0, 0.1, 0.0, 4))
    assert load["requests"] == 2 and load["errors"] >= 1
    compared = gateway._compare(load, load, 20.0)
    text = json.dumps(compared)
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert load["p50_ms"] is None and compared["added_latency_ms"] == {"p50": None, "p99": None}


def test_every_request_sent_is_waited_for_and_counted():
    """The figures are taken once every request is answered or failed. A request counted itself
    pending only once its task ran, so the last one sent, not yet started when the earlier ones
    were done, was not waited for: here 1 error of 2 requests."""
    port = _closed_port()
    load = asyncio.run(gateway._load(port, gateway._request(port, gateway._BODY, False), 20.0, 0.1, 0.0, 4))
    assert load["requests"] == 2 and load["errors"] == 2


def test_a_failed_connect_gives_its_connection_slot_back():
    """A connection that failed to open still held one of --connections: with one allowed, the
    second request waited for it for ever (the run hung)."""
    port = _closed_port()

    async def load() -> dict:
        return await asyncio.wait_for(gateway._load(port, gateway._request(port, gateway._BODY, False), 20.0, 0.1, 0.0, 1), 5)

    result = asyncio.run(load())
    assert result["errors"] == 2 and result["connections"] == 0


@pytest.mark.parametrize("argv", [["--rate", "1", "--duration", "0.5"], ["--rate", "1e308"], ["--vllm", "--vllm-rate", "1e308"]])
def test_a_load_of_no_request_or_too_many_is_a_usage_error(argv, capsys):
    """Before: 0.5 requests ran with nothing measured (null figures); 1e308 a second queued
    requests without end (the run hung, its memory growing)."""
    with pytest.raises(SystemExit) as exited:
        gateway.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "x --duration" in err


def test_a_vllm_rate_without_vllm_is_a_usage_error(capsys):
    """Before: `--vllm-rate 5` without `--vllm` was ignored without a word (no vLLM was measured)."""
    with pytest.raises(SystemExit) as exited:
        gateway.main(["--vllm-rate", "5"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--vllm-rate applies only with --vllm" in err


def _load_on_a_server(delay_s: float, *, rate: float, duration_s: float, connections: int) -> dict:
    """`gateway._load`'s figures against a server that answers each request `{}` after `delay_s`."""

    async def main() -> dict:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while not reader.at_eof():
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

        server = await asyncio.start_server(lambda r, w: answer(r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await gateway._load(port, gateway._request(port, gateway._BODY, False), rate, duration_s, 0.0, connections)

    return asyncio.run(main())


def test_the_rate_answered_is_taken_over_the_time_the_requests_were_offered_in():
    """One request at --rate 1 read 911.8 rps: its count over its own latency, the span from the
    first request's send to the last one's answer being (n - 1) / rate plus a latency."""
    load = _load_on_a_server(0.0, rate=1.0, duration_s=1.0, connections=4)
    assert load["requests"] == 1 and load["errors"] == 0 and load["rps"] <= 1.0


def test_a_request_waiting_for_a_connection_counts_the_wait_in_its_latency():
    """Open-loop load: a server answering in 50 ms over one connection, sent 100 requests a
    second, falls behind, and the requests queue for the connection. Timed from the moment each
    had its connection, every one read about 50 ms (p50 50.5 ms), the queue unseen; sent 10 ms
    apart, the 20th waits for 19 answers before it."""
    load = _load_on_a_server(0.05, rate=100.0, duration_s=0.2, connections=1)
    assert load["requests"] == 20 and load["errors"] == 0 and load["connections"] == 1
    assert load["p50_ms"] > 300 and load["p99_ms"] > 700  # about 50 + 40 i ms for the i-th
