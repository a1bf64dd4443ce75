"""Model fidelity: the default sim profile against the tiny CPU vLLM measured on these machines.

DESIGN.md: 500 / 4,300 / 8,600 output tok/s at concurrency 1 / 16 / 64 (max_tokens 128,
ignore_eos). Each of N clients sends requests back to back; throughput is completion tokens over
virtual time. The prompt length of the measurement was not recorded; 64 tokens is assumed.
"""

from __future__ import annotations

import anyio
import pytest

from fleetsched.backends.sim import SimBackend
from fleetsched.settings import SimSettings

pytestmark = pytest.mark.anyio

MEASURED = {1: 500, 16: 4300, 64: 8600}


async def closed_loop_throughput(settings: SimSettings, concurrency: int, rounds: int = 4) -> float:
    tokens = 0
    async with SimBackend(settings) as backend:
        t0 = anyio.current_time()

        async def client(i: int) -> None:
            nonlocal tokens
            for r in range(rounds):
                content = f"client {i} request {r} ".ljust(4 * 64 - 16, "x")  # 64 prompt tokens, unique
                body = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 128}
                async for chunk in backend.stream_chat(body):
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]

        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(client, i)
        return tokens / (anyio.current_time() - t0)


@pytest.mark.parametrize("concurrency", sorted(MEASURED))
async def test_default_profile_matches_measured_cpu_vllm(concurrency: int):
    throughput = await closed_loop_throughput(SimSettings(), concurrency)
    assert throughput == pytest.approx(MEASURED[concurrency], rel=0.2)
