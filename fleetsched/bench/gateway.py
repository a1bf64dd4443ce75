"""``fleetsched bench gateway``: what the gateway adds to a call's latency, under load.

Open-loop load (requests sent at a fixed rate whatever the answers do) from this process, over
loopback and HTTP/1.1 keep-alive connections, against servers in other processes:

- instant: a minimal ASGI app on the same uvicorn setup answering what the instant backend
  answers (the direct baseline, no fleetsched), then the gateway in front of the instant backend.
- vllm (``--vllm``): the real CPU vLLM directly, then the gateway in front of it.

Added latency is the gateway's percentile minus the direct one's at the same rate. The client
is raw asyncio sockets (uvloop when installed) so that its own cost stays small and equal on
both sides. Wall-clock measurements, marked as such.

    fleetsched bench gateway [--json] [--rate 1000] [--duration 10] [--vllm] [--vllm-rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import json_text
from .._args import applies_only, positive_float, positive_int

API_KEY = "fs-bench-key"
MAX_REQUESTS = 10_000_000  # per server measured (the defaults send 10,000)
_BODY = {"model": "fleetsched-tiny", "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 8}


# -- the servers (run in subprocesses) ----------------------------------------------------------


def _direct_app() -> Any:
    """A minimal ASGI app answering like the instant backend: the direct baseline."""
    from fleetsched.backends.base import collect_chat, estimate_prompt_tokens, make_chunk, requested_max_tokens, usage_dict

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"] == "/health":
            payload = b'{"status":"ok"}'
        else:
            body = json.loads(b"".join(chunks))
            n = min(16, requested_max_tokens(body))
            model = body.get("model") or "instant"
            response = collect_chat(
                [
                    make_chunk("chatcmpl-direct", model, 0, role="assistant", content="ok"),
                    make_chunk("chatcmpl-direct", model, 0, finish_reason="stop", usage=usage_dict(estimate_prompt_tokens(body), n)),
                ]
            )
            payload = json.dumps(response, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def _serve(kind: str, port: int, config: str | None) -> int:
    import uvicorn

    from fleetsched.gateway.server import uvicorn_config

    if kind == "direct":
        app = _direct_app()
    else:
        from fleetsched.gateway import Gateway
        from fleetsched.settings import load_settings

        app = Gateway(load_settings(config))
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", port)).run()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, process: subprocess.Popen, path: str = "/health", timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s  # wall-clock ok
    while time.monotonic() < deadline:  # wall-clock ok
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # wall-clock ok
    raise RuntimeError("the server did not become healthy")


@contextmanager
def _server(kind: str, config: str | None = None) -> Iterator[int]:
    port = _free_port()
    argv = [sys.executable, "-m", "fleetsched.bench.gateway", "--serve", kind, "--port", str(port)]
    if config:
        argv += ["--config", config]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        _wait_healthy(port, process)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _gateway_config(directory: str, backend: dict[str, Any]) -> str:
    from fleetsched.gateway.auth import hash_key

    lines = ["[backend]"]
    for key, value in backend.items():
        lines.append(f"{key} = {json.dumps(value)}")
    lines += [
        "max_in_flight = 512",
        "[dispatch]",
        "adaptive_window = false",
        "[resources]",
        'strategy = "counting"',
        "[tenants.bench]",
        f'api_keys = ["{hash_key(API_KEY)}"]',
    ]
    path = Path(directory) / "gateway.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# -- the load ------------------------------------------------------------------------------------


def _request(port: int, body: dict[str, Any], auth: bool) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n"
    )
    if auth:
        head += f"Authorization: Bearer {API_KEY}\r\n"
    return head.encode() + b"\r\n" + payload


async def _load(port: int, request: bytes, rate: float, duration_s: float, warmup_s: float, max_connections: int) -> dict[str, Any]:
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened = 0
    latencies: list[float] = []
    errors: dict[str, int] = {}
    done = asyncio.Event()
    pending = 0
    slot = asyncio.Condition()

    async def connection() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        nonlocal opened
        if idle:
            return idle.pop()
        while opened >= max_connections:
            async with slot:
                await slot.wait()
            if idle:
                return idle.pop()
        opened += 1
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except BaseException:
            opened -= 1  # no connection came of it: its place is free again (or a waiter hangs)
            raise

    async def one(measure: bool, start: float) -> None:
        """One request, sent by the load at `start`: its latency counts from then, the wait for
        a free connection included (open-loop: timed from the connection only, a server that
        fell behind held every connection and its queue of requests never showed in the figures)."""
        nonlocal pending, opened
        conn = None
        try:
            conn = await connection()
            reader, writer = conn
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            lower = head.lower()
            at = lower.find(b"content-length:")
            if at < 0:
                raise RuntimeError("no content-length")
            length = int(lower[at + 15 : lower.find(b"\r\n", at)])
            await reader.readexactly(length)
            elapsed = time.perf_counter() - start  # wall-clock ok
            if measure:
                if status == 200:
                    latencies.append(elapsed)
                else:
                    errors[str(status)] = errors.get(str(status), 0) + 1
            idle.append(conn)
        except Exception as exc:  # noqa: BLE001 - every failure is counted as an error
            if measure:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if conn is not None:
                conn[1].close()
                opened -= 1
        finally:
            async with slot:
                slot.notify()
            pending -= 1
            if pending == 0:
                done.set()

    tasks = set()
    total = int(rate * (warmup_s + duration_s))
    warm = int(rate * warmup_s)
    start = time.perf_counter()  # wall-clock ok
    measured_start = measured_end = start
    for i in range(total):
        target = start + i / rate
        delay = target - time.perf_counter()  # wall-clock ok
        if delay > 0:
            await asyncio.sleep(delay)  # wall-clock ok: the load generator paces real requests
        if i == warm:
            measured_start = time.perf_counter()  # wall-clock ok
        # Counted pending when sent, not when its task first runs: the last request sent has not
        # run yet when the loop below looks, and would not be waited for.
        pending += 1
        task = asyncio.ensure_future(one(i >= warm, time.perf_counter()))  # wall-clock ok
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while pending:  # every request answered (or failed) before the figures are taken
        done.clear()
        await done.wait()
    measured_end = time.perf_counter()  # wall-clock ok
    for _, writer in idle:
        writer.close()
    latencies.sort()

    def pct(q: float) -> float | None:
        # None (JSON null) when no request was answered: NaN would print as NaN, which is not JSON.
        # Nearest rank, ceil(q n): p99 of 100 latencies is the 99th (it read the 100th).
        return round(latencies[max(0, math.ceil(round(q / 100 * len(latencies), 9)) - 1)] * 1000, 3) if latencies else None

    # Over at least the time the measured requests were offered in: from the first one's send to
    # the last one's answer is (n - 1) / rate plus a latency, and one request read as 1 / latency
    # (911.8 rps at --rate 1).
    window = max(measured_end - measured_start, (total - warm) / rate)
    return {
        "requests": total - warm,
        "rps": round(len(latencies) / window, 1),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "connections": opened,
    }


def _run_load(port: int, body: dict[str, Any], auth: bool, rate: float, duration_s: float, connections: int) -> dict[str, Any]:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    request = _request(port, body, auth)
    return runner(_load(port, request, rate, duration_s, min(2.0, duration_s / 4), connections))


def _compare(direct: dict[str, Any], gateway: dict[str, Any], rate: float) -> dict[str, Any]:
    def added(key: str) -> float | None:  # None where either side answered no request
        if direct[key] is None or gateway[key] is None:
            return None
        return round(gateway[key] - direct[key], 3)

    return {
        "rate": rate,
        "rps": gateway["rps"],
        "added_latency_ms": {"p50": added("p50_ms"), "p99": added("p99_ms")},
        "errors": gateway["errors"] + direct["errors"],
        "direct": direct,
        "gateway": gateway,
    }


def bench_instant(rate: float, duration_s: float, connections: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = _gateway_config(tmp, {"kind": "instant"})
        with _server("direct") as port:
            direct = _run_load(port, _BODY, False, rate, duration_s, connections)
        with _server("gateway", config) as port:
            gateway = _run_load(port, _BODY, True, rate, duration_s, connections)
    return _compare(direct, gateway, rate)


def bench_vllm(rate: float, duration_s: float, connections: int) -> dict[str, Any]:
    from fleetsched.testing.vllm_server import VLLMServer, missing_setup

    missing = missing_setup()
    if missing:
        return {"skipped": f"no vLLM install ({'; '.join(missing)}): run scripts/setup-vllm.sh"}
    body = {**_BODY, "max_tokens": 8, "ignore_eos": True}
    with VLLMServer(max_num_seqs=64, max_model_len=2048) as server, tempfile.TemporaryDirectory() as tmp:
        url = server.base_url.removesuffix("/v1")
        port = int(url.rsplit(":", 1)[1])
        _run_load(port, body, False, rate, 2.0, connections)  # warm the engine
        direct = _run_load(port, body, False, rate, duration_s, connections)
        config = _gateway_config(tmp, {"kind": "vllm-server", "urls": [url], "model": body["model"]})
        with _server("gateway", config) as gport:
            gateway = _run_load(gport, body, True, rate, duration_s, connections)
    return _compare(direct, gateway, rate)


def _ms(value: float | None, sign: str = "") -> str:
    """A latency for the text output: "-" where no request was answered."""
    return "-" if value is None else f"{value:{sign}.3f} ms"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched bench gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--rate", type=positive_float, default=1000.0, help="requests per second against the instant backend")
    parser.add_argument("--duration", type=positive_float, default=10.0, help="seconds of measured load per server")
    parser.add_argument("--connections", type=positive_int, default=64, help="keep-alive connections at most")
    parser.add_argument("--vllm", action="store_true", help="also measure in front of the real CPU vLLM")
    parser.add_argument("--vllm-rate", type=positive_float, help="with --vllm: requests per second against vLLM (20)")
    parser.add_argument("--serve", choices=["direct", "gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    applies_only(parser, args, {"vllm_rate": 20.0}, args.vllm, "with --vllm")
    # Requests sent in a measured stretch: none leaves nothing to measure, and beyond what one
    # process can send the load generator queues them without end (1e308 a second hung the run).
    loads = [("--rate", args.rate)] + ([("--vllm-rate", args.vllm_rate)] if args.vllm else [])
    for flag, rate in loads:
        requests = rate * args.duration
        if not 1 <= requests <= MAX_REQUESTS:
            parser.error(f"{flag} x --duration sends {requests:.3g} requests to measure; expected 1 to {MAX_REQUESTS:,}")
    if args.serve:
        return _serve(args.serve, args.port, args.config)
    results: dict[str, Any] = {"cpus": os.cpu_count()}
    results["instant"] = bench_instant(args.rate, args.duration, args.connections)
    if args.vllm:
        results["vllm"] = bench_vllm(args.vllm_rate, args.duration, args.connections)
    # The headline figures are the instant backend's: the gateway's own cost.
    results.update({k: results["instant"][k] for k in ("rps", "added_latency_ms", "errors")})
    if args.json:
        print(json_text(results))
        return 0
    for name in ("instant", "vllm"):
        r = results.get(name)
        if not r:
            continue
        if "skipped" in r:
            print(f"{name}: skipped: {r['skipped']}")
            continue
        d, g, a = r["direct"], r["gateway"], r["added_latency_ms"]
        print(
            f"{name:8} rate {r['rate']:.0f}/s: direct p50 {_ms(d['p50_ms'])} p99 {_ms(d['p99_ms'])} | gateway "
            f"{g['rps']:.0f} req/s p50 {_ms(g['p50_ms'])} p99 {_ms(g['p99_ms'])} | added p50 "
            f"{_ms(a['p50'], '+')} p99 {_ms(a['p99'], '+')} | errors {r['errors']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
