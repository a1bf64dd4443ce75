"""``fleetsched serve --config CONFIG``: the gateway on uvicorn (httptools, uvloop where present).

    fleetsched serve --config fleetsched.toml [--host H] [--port P]
    fleetsched serve --hash-key KEY      print the stored form of an API key
    fleetsched serve --new-key           make a random key and print it with its stored form

`serve_in_thread` runs a gateway in a background thread of the calling process, for tests and
benchmarks that need a real socket.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._args import tcp_port, url_host
from ..errors import ConfigError
from ..gc_tuning import SERVING, gc_thresholds
from ..settings import Settings, load_settings
from .app import Gateway
from .auth import hash_key, new_key


def gateway_server(gateway: Gateway, host: str, port: int, **overrides: Any) -> Any:
    """A uvicorn server for `gateway` that, when it begins to shut down (a signal, or
    ``should_exit``), first tells the gateway: calls waiting for a session's admission then get
    a 503 at once instead of holding the shutdown until the sessions before them idle out."""
    import uvicorn

    class GatewayServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            gateway.stop_waiting()
            await super().shutdown(sockets)

    return GatewayServer(uvicorn_config(gateway, host, port, **overrides))


def uvicorn_config(app: Any, host: str, port: int, **overrides: Any) -> Any:
    """A uvicorn config tuned for the gateway: httptools, uvloop if installed, no access log."""
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    options: dict[str, Any] = dict(
        host=host, port=port, loop=loop, http="httptools", lifespan="on", log_level="warning", access_log=False,
        timeout_keep_alive=30, backlog=4096,
    )
    options.update(overrides)
    return uvicorn.Config(app, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched serve", description="Serve the OpenAI-compatible multi-tenant gateway.")
    parser.add_argument("--config", help="TOML settings file (tenants with api_keys, backend, [gateway])")
    parser.add_argument("--host", help="override gateway.host")
    parser.add_argument("--port", type=tcp_port, help="override gateway.port")
    parser.add_argument("--hash-key", metavar="KEY", help="print the stored form (sha256:...) of KEY and exit")
    parser.add_argument("--new-key", action="store_true", help="print a new random key and its stored form, and exit")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.hash_key is not None:  # not its truth: `--hash-key ""` (an unset $KEY) started the server
        if not args.hash_key:
            parser.error("argument --hash-key: the key is empty")
        # The gateway trims the Authorization header, so such a key's hash matched no client's
        # (a key file saved with CRLF and read with "$(cat key)" keeps its "\r").
        if args.hash_key != args.hash_key.strip():
            parser.error("argument --hash-key: the key begins or ends with white space, which no client can present (the header is trimmed)")
        print(hash_key(args.hash_key))
        return 0
    if args.new_key:
        key = new_key()
        print(f"key:    {key}\nstored: {hash_key(key)}")
        return 0
    try:
        settings = load_settings(args.config)
        gateway = Gateway(settings)
    except ConfigError as exc:
        print(f"fleetsched: config error: {exc}", file=sys.stderr)
        return 2
    if not len(gateway.keys):
        print("fleetsched serve: warning: no API keys configured; every call will get 401", file=sys.stderr)
    host = args.host or settings.gateway.host
    port = args.port if args.port is not None else settings.gateway.port
    # Bound here, before the address is printed: uvicorn said nothing of a port in use but its
    # own error line (after ours, "serving"), and exited 3; port 0 printed as port 0.
    try:
        listening = listen(host, port)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).split(" (while attempting", 1)[0]  # socket.create_server adds the address again
        print(f"fleetsched serve: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        return 1
    server = gateway_server(gateway, host, port)
    url = f"http://{url_host(host)}:{listening.getsockname()[1]}/v1"
    print(f"fleetsched gateway on {url} (instance {gateway.instance})", file=sys.stderr, flush=True)
    # uvicorn stops gracefully on SIGINT and SIGTERM, then raises the signal again with the
    # handlers it found in place: SIGINT's raises KeyboardInterrupt, SIGTERM's default killed the
    # process (status -15) after a clean stop. Both are a clean stop here: exit 0.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    with gc_thresholds(SERVING):
        try:
            server.run(sockets=[listening])
        except KeyboardInterrupt:  # uvicorn shut down, then re-raised the signal it caught: a clean stop
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` (0: a free port), as uvicorn would bind it; raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=4096)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextmanager
def serve_in_thread(settings: Settings, *, host: str = "127.0.0.1", port: int = 0, **gateway_options: Any) -> Iterator[tuple[Gateway, str]]:
    """Run a gateway on uvicorn in a daemon thread; yields it and its root URL (``http://host:port``)."""
    gateway = Gateway(settings, **gateway_options)
    server = gateway_server(gateway, host, port, loop="asyncio")
    thread = threading.Thread(target=server.run, name="fleetsched-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # wall-clock ok: waits on another thread
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:  # wall-clock ok: waiting for a server thread
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)  # wall-clock ok
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield gateway, f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
