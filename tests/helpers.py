"""Small builders shared by tests."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx

from fleetsched.backends.metrics import VLLMMetrics, parse_vllm_metrics
from fleetsched.settings import Settings


def settings(tenants: dict[str, dict[str, Any]] | None = None, **sections: dict[str, Any]) -> Settings:
    """Settings for tests: the instant backend, one 80 GB device, and the given overrides."""
    sections.setdefault("backend", {"kind": "instant"})
    sections.setdefault("resources", {"strategy": "counting", "devices": [{"name": "gpu0", "memory": "80GB"}]})
    return Settings(tenants=tenants or {"acme": {}}, **sections)


def virtual_loop(name: str) -> tuple[str, dict[str, Any]]:
    """An `anyio_backend` value: the asyncio or trio loop on virtual time."""
    if name == "asyncio":
        from fleetsched.virtual_time import VirtualTimeLoop

        return ("asyncio", {"loop_factory": VirtualTimeLoop})
    import trio.testing

    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def check_released(scheduler: Any) -> None:
    """The invariants after every session ended: no slot, no memory, nothing queued."""
    stats = scheduler.statistics()
    assert stats.slots_in_use == 0
    assert stats.memory.allocated == 0
    assert stats.queued_total == 0 and stats.running_total == 0
    assert not scheduler.pool.reservations()
    assert stats.dispatcher.in_flight == 0


class EngineLoad:
    """Long non-streamed calls, sent straight to a vLLM server from threads, that hold its slots.

    The fragile way to see a scheduling effect on 2 shared cores is to fire calls and sleep a
    moment: there the API server, not the engine, is the bottleneck (it feeds requests to the engine
    late and streams tokens late), and the test process itself can stall for seconds while the
    engine runs (measured with the engine at nice 0: up to 9 s). Whether a queue forms in time is
    then luck. Instead a test
    queues several waves of these calls (each wave holds the engine's slots for about 7 s) and
    watches ``/metrics`` until the engine reports the state it needs (`wait_until`); the waves still
    queued are its margin.

    One `httpx.Client` serves all the threads (a client per request would build an SSL context
    each time: CPU, under the GIL, that the test does not need).
    """

    def __init__(self, server: Any, calls: int, max_tokens: int = 4000) -> None:
        self.server = server
        self.body = {
            "model": "fleetsched-tiny",
            "messages": [{"role": "user", "content": "Tell me about schedulers."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        self.finished: list[str] = []
        self.failed: list[BaseException] = []
        self.client = httpx.Client(timeout=300)
        self.threads = [threading.Thread(target=self._call, args=(f"low{i}",)) for i in range(calls)]

    def _call(self, name: str) -> None:
        try:
            response = self.client.post(f"{self.server.base_url}/chat/completions", json=self.body)
            assert response.json()["usage"]["completion_tokens"] == self.body["max_tokens"], response.text[:300]
        except BaseException as exc:  # kept for `wait_until` to report: a thread's error is otherwise lost
            self.failed.append(exc)
            raise
        self.finished.append(name)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout=300)
        self.client.close()

    def admitted(self, page: VLLMMetrics) -> bool:
        """Whether every call of the load has reached the engine (running, waiting or finished).

        A call's response can reach `finished` a moment after the engine let it go, so this
        may answer False for a moment too long, never True too early."""
        in_engine = (page.signals.running or 0) + (page.signals.waiting or 0)
        return in_engine + len(self.finished) >= len(self.threads)

    def _scrape(self) -> VLLMMetrics:
        """One read of ``/metrics``. The pool this shares with the load's threads may hand it a
        keep-alive connection the server is closing that moment (seen once in CI: "Server
        disconnected without sending a response"); a second try takes another connection."""
        try:
            response = self.client.get(self.server.metrics_url)
        except httpx.TransportError:
            response = self.client.get(self.server.metrics_url)
        return parse_vllm_metrics(response.text)

    def wait_until(self, predicate: Callable[[VLLMMetrics], bool], within_s: float = 120) -> VLLMMetrics:
        """Poll ``/metrics`` until `predicate` holds (and fail after `within_s`)."""
        began = time.monotonic()
        seen: list[tuple[float, int | None, int | None, int]] = []  # (s, running, waiting, finished)
        while True:
            if self.failed:
                raise AssertionError(f"a call of the load failed: {self.failed[0]!r}")
            page = self._scrape()
            if predicate(page):
                return page
            state = (page.signals.running, page.signals.waiting, len(self.finished))
            if not seen or seen[-1][1:] != state:
                seen.append((round(time.monotonic() - began, 2), *state))
            if time.monotonic() - began > within_s:
                raise AssertionError(f"engine state not reached in {within_s} s; (s, running, waiting, finished): {seen}")
            time.sleep(0.05)


async def waiting_under_a_full_batch(
    chat: Callable[[dict[str, Any]], Any], signals: Callable[[], Any], *, clients: int, seconds: float, model: str
) -> list[tuple[int | None, int | None]]:
    """(running, waiting) as the engine reports them, sampled every 10 ms while `clients` closed
    loops call `chat` back to back with answers of 8 to 40 tokens: each call arrives when another
    ends, at any moment of a step, and never more are in flight than `clients`."""
    seen: list[tuple[int | None, int | None]] = []
    rng = random.Random(7)

    async def client() -> None:
        while True:
            await chat({"model": model, "messages": [{"role": "user", "content": "status?"}],
                        "max_tokens": rng.randint(8, 40), "ignore_eos": True})  # fmt: skip

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(client)
            while True:
                await anyio.sleep(0.01)
                s = await signals()
                seen.append((s.running, s.waiting))
    return seen
