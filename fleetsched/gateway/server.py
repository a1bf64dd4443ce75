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

import anyio

from .._args import tcp_port, url_host
from ..errors import BackendUnavailable, ConfigError
from ..gc_tuning import SERVING, gc_thresholds
from ..settings import Settings, load_settings
from .app import Gateway
from .auth import hash_key, new_key


def gateway_server(gateway: Gateway, host: str, port: int, **overrides: Any) -> Any:
    """A uvicorn server for `gateway` that, when it begins to shut down (a signal, or
    ``should_exit``), first tells the gateway: calls waiting for a session's admission then get
    a 503 at once instead of holding the shutdown until the sessions before them idle out.

    A signal before the gateway has started (its backend still being reached) abandons the
    start: `run` raises KeyboardInterrupt once the start is undone, and `stopped_starting` names
    the signal. uvicorn only noted it and let the start go on, as long as the backend took to
    answer (5 s a replica; a second Ctrl-C did not cut it), then stopped the server it had just
    started, or logged the start's failure as errors and exited 3.

    A start that fails by itself (`Gateway.start_failure`: its backend unreachable where the
    start needs it, a config error found as the scheduler starts) ends `run` without a word:
    the caller says why (`main`: one line, as a run's). uvicorn logged it as two ERROR lines
    and exited 3."""
    import asyncio
    import logging

    import uvicorn

    def unless_the_start_failed(record: logging.LogRecord) -> bool:
        return gateway.start_failure is None

    class GatewayServer(uvicorn.Server):
        #: The signal that abandoned the start, or None.
        stopped_starting: int | None = None
        _starting: anyio.CancelScope | None = None
        _loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            said = logging.getLogger("uvicorn.error")  # the lifespan's lines
            said.addFilter(unless_the_start_failed)
            try:
                with anyio.CancelScope() as self._starting:
                    await super().startup(sockets)
            except SystemExit:  # uvicorn's exit on a failed start
                if gateway.start_failure is None:
                    raise
                self.should_exit = True
            finally:
                said.removeFilter(unless_the_start_failed)
            self._starting = None
            if self.stopped_starting is not None and not self.started:
                # The loop's end cancels the lifespan's task, which undoes the gateway's start.
                raise KeyboardInterrupt

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self._starting is None or self._loop is None:
                super().handle_exit(sig, frame)
            else:  # handled in the loop: the handler runs between any two of its steps
                # (woken by the thread-safe call where the loop waits in `select`)
                self._loop.call_soon_threadsafe(self._abandon_start, sig)

        def _abandon_start(self, sig: int) -> None:
            if self._starting is None:  # started meanwhile: a stop as any other
                super().handle_exit(sig, None)
            elif self.stopped_starting is None:
                self.stopped_starting = sig
                self._starting.cancel()

        async def shutdown(self, sockets: Any = None) -> None:
            gateway.stop_waiting()
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C: the calls still under way are cut
                # Their connections dropped, each ends as a client's disconnect ends it (aborted
                # at the engine). Left to the loop's end, each was cancelled where it stood and
                # uvicorn logged it as an error, with its traceback.
                for connection in list(self.server_state.connections):
                    connection.transport.abort()
                while self.server_state.tasks:
                    await anyio.sleep(0.01)

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
        print(f"fleetsched serve: cannot listen on {url_host(host)}:{port}: {reason}", file=sys.stderr)  # [::1]:8080, not ::1:8080
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
    if server.stopped_starting is not None:
        # Stopped before it served: as a run is, by the handlers found in place (the command's
        # say "interrupted" or "terminated" and exit 130 or 143).
        signal.raise_signal(server.stopped_starting)
    if server.force_exit:  # a second Ctrl-C cut the calls under way: no clean stop
        raise KeyboardInterrupt
    if gateway.start_failure is not None:
        return _start_failed(gateway.start_failure, settings)
    return 0 if server.started else 1


def _start_failed(failure: BaseException, settings: Settings) -> int:
    """Say in one line why the gateway's start failed, as `fleetsched run` says it of a run's;
    the exit status (2 for a config error, else 1)."""
    if isinstance(failure, ConfigError):  # found as the scheduler starts: a KV cache smaller than a session's budget
        print(f"fleetsched: config error: {failure}", file=sys.stderr)
        return 2
    if isinstance(failure, BackendUnavailable):
        remedy = "start the server, fix backend.urls" if settings.backend.kind == "vllm-server" else "fix what it says"
        print(f"fleetsched serve: the {settings.backend.kind} backend cannot be reached: {failure} ({remedy})", file=sys.stderr)
        return 1
    print(f"fleetsched serve: the gateway could not start: {type(failure).__name__}: {failure}", file=sys.stderr)
    return 1


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
            failure = gateway.start_failure
            raise RuntimeError("the gateway did not start" + ("" if failure is None else f": {type(failure).__name__}: {failure}"))
        time.sleep(0.01)  # wall-clock ok
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield gateway, f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
