"""How the benches place a vLLM server's processes: niceness and CPU pinning by process group.

A `sleep` child in its own session stands in for the server (no vLLM needed): its group leader
is the API server's place, and a child named ``VLLM::...`` would be an engine process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetsched.testing.vllm_server import _group_threads, off_cpus, pin_engine, renice_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def group():
    # A leader (the API server's place) with one child (an engine process's place).
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & exec sleep 30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10  # wall-clock ok: waiting for another process
        while len({pid for pid, _, _ in _group_threads(proc.pid)}) < 2:
            assert time.monotonic() < deadline, "the child process never appeared"
            time.sleep(0.01)
        yield proc.pid
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_group_threads_lists_leader_and_children(group):
    pids = {pid for pid, _, _ in _group_threads(group)}
    assert group in pids and len(pids) == 2
    assert all(comm == "sleep" for _, comm, _ in _group_threads(group))


def test_renice_leaves_the_leader_alone(group):
    renice_children(group, 5)
    for pid, _, thread in _group_threads(group):
        assert os.getpriority(os.PRIO_PROCESS, thread) == (0 if pid == group else 5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pin_engine_puts_other_processes_on_the_other_cpus(group):
    cpu = min(os.sched_getaffinity(0))
    pin_engine(group, {cpu})
    # No process here is named VLLM::..., so all of them go to the CPUs other than the engine's.
    for _, comm, thread in _group_threads(group):
        assert not comm.startswith("VLLM::")
        assert os.sched_getaffinity(thread) == os.sched_getaffinity(0) - {cpu}


def test_the_load_generator_keeps_off_the_engine_cpus_for_the_block_only():
    before = os.sched_getaffinity(0)
    engine = frozenset(sorted(before)[-1:]) if len(before) >= 2 else frozenset()
    with off_cpus(engine):
        assert os.sched_getaffinity(0) == (before - engine or before)
    assert os.sched_getaffinity(0) == before
    with off_cpus(frozenset(before)):  # every CPU taken: it stays where it was
        assert os.sched_getaffinity(0) == before


def test_a_log_path_given_as_text_is_a_path(tmp_path):
    """VLLMServer(log_path="...") raised AttributeError ('str' object has no attribute ...)."""
    from fleetsched.testing.vllm_server import VLLMServer

    log = tmp_path / "vllm.log"
    log.write_text("one\ntwo\n")
    assert VLLMServer(log_path=str(log)).log_tail() == "one\ntwo"


def test_a_venv_and_model_given_as_text_are_paths():
    """VLLMServer(venv=".venv-vllm") raised a TypeError where it joined the venv's paths."""
    from fleetsched.testing.vllm_server import VLLMServer

    server = VLLMServer(venv=".venv-vllm", model_dir=".cache/tiny-model")
    assert server.venv == Path(".venv-vllm") and server.model_dir == Path(".cache/tiny-model")
