"""Random fleets on virtual time: whatever the sessions do, everything they held comes back.

Each seed draws a configuration (slots, memory, window, engine size, tool policy, critical
reserve) and 20-120 sessions of random kinds on the sim backend, with the default allocator (it
moves sessions that sit in tool calls): chats, streams read to the end or left after two chunks,
a body the engine refuses, agents that raise, tool calls, and on top of that cancellations at
random times and deadlines. When the scheduler has closed, nothing may be held anywhere: slots,
memory, queues, the dispatcher's window, the engine's requests and its KV blocks; and every stream
left early was aborted at the engine. No session is harmed by the others either: every critical
session that did nothing wrong itself, had no deadline and was not cancelled finished its work.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import anyio
import pytest

from fleetsched import Scheduler, SessionCancelled, SessionFailed, SessionHandle, SessionState
from fleetsched.settings import Settings
from fleetsched.virtual_time import run_virtual

from .helpers import check_released

#: Kinds of agent; the first ones do nothing wrong themselves.
WELL_BEHAVED = ("chat", "stream", "stream-left", "tool")
KINDS = (*WELL_BEHAVED, "refused", "raises")


def random_settings(rng: random.Random) -> Settings:
    return Settings(
        scheduler={
            "max_sessions": rng.choice([4, 16, 64]),
            "session_memory": rng.choice(["1GB", "6GB", "20GB"]),
            "tool_policy": rng.choice(["keep", "release", "adaptive"]),
            "tool_keep_s": 1.0,
            "drain_grace_s": 5.0,
        },
        resources={"devices": [{"name": "gpu0", "memory": "40GB"}, {"name": "gpu1", "memory": "24GB"}]},
        backend={
            "kind": "sim",
            "max_in_flight": rng.choice([2, 8, 64]),
            "sim": {
                "max_num_seqs": rng.choice([2, 16]),
                "kv_cache_tokens": rng.choice([2048, 65536]),  # 2,048: preemptions
                "block_size": 16,
                "max_model_len": 2048,
            },
        },
        dispatch={"critical_reserve": rng.choice([0, 2]), "stream_interval": {"batch": 8}},
        tenants={
            "pager": {"tier": "critical"},
            "web": {
                "tier": "standard",
                "max_sessions": 5,
                "memory_quota": "30GB",
                "requests_per_minute": 600,
                "tokens_per_minute": 200_000,
            },
            "bulk": {"tier": "batch", "sla": {"ttft_p99_s": 2.0}, "session_memory": "10GB"},
        },
    )


def random_agent(rng: random.Random, kind: str, left: list[int]) -> Any:
    """An agent of `kind`; a "stream-left" one notes in `left` each stream it leaves unfinished."""
    turns = rng.randint(1, 4)
    prompt = "x" * rng.randint(10, 3000)

    async def agent(ctx: Any) -> str:
        messages = [{"role": "user", "content": prompt}]
        for turn in range(turns):
            last = turn == turns - 1
            if kind == "refused" and last:
                await ctx.chat(messages, max_tokens=100_000)  # ContextTooLong
            if kind == "stream":
                async with ctx.stream(messages, max_tokens=rng.randint(1, 64)) as chunks:
                    async for _ in chunks:
                        pass
            elif kind == "stream-left":
                async with ctx.stream(messages, max_tokens=rng.randint(200, 400)) as chunks:
                    async for _ in chunks:
                        left.append(ctx.session_id)  # 25 chunks at least: this one is not the last
                        break  # leaving early must abort the call at the engine
            else:
                await ctx.chat(messages, max_tokens=rng.randint(1, 64))
            if kind == "tool":
                async with ctx.tool("search"):
                    await anyio.sleep(rng.uniform(0, 3))
            if kind == "raises" and last:
                raise RuntimeError("the agent's own bug")
            await anyio.sleep(rng.uniform(0, 0.5))
        return kind

    return agent


async def random_fleet(seed: int) -> None:
    rng = random.Random(seed)
    handles: list[SessionHandle] = []
    innocent: list[SessionHandle] = []  # critical, well-behaved, no deadline, not cancelled
    left: list[int] = []
    with anyio.fail_after(3600):  # virtual seconds: a wait that never ends fails here, not in CI's timeout
        async with Scheduler(random_settings(rng)) as scheduler:
            async with anyio.create_task_group() as tg:
                for _ in range(rng.randint(20, 120)):
                    tenant = rng.choice(["pager", "web", "bulk"])
                    kind = rng.choice(KINDS)
                    deadline = rng.uniform(0.5, 10) if rng.random() < 0.3 else None
                    handle = await scheduler.submit(random_agent(rng, kind, left), tenant=tenant, deadline_s=deadline)
                    handles.append(handle)
                    if rng.random() < 0.15:
                        tg.start_soon(_cancel_later, handle, rng.uniform(0, 5))
                    elif tenant == "pager" and kind in WELL_BEHAVED and deadline is None:
                        innocent.append(handle)
                    await anyio.sleep(rng.expovariate(20))
            for handle in handles:  # all end on their own (leaving the block would cancel the slow ones)
                with contextlib.suppress(SessionCancelled, SessionFailed):
                    await handle
    check_released(scheduler)
    engine = scheduler.backend.engine
    assert not engine.running and len(engine.queue) == 0
    assert engine.aborted >= len(left)  # cancellations and deadlines abort calls too
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_blocks
    harmed = [(h.name, h.state, h.error) for h in innocent if h.state is not SessionState.DONE]
    assert not harmed


async def _cancel_later(handle: Any, delay: float) -> None:
    await anyio.sleep(delay)
    handle.cancel()


@pytest.mark.parametrize("seed", range(40))
def test_a_random_fleet_gives_everything_back(seed: int) -> None:
    run_virtual(random_fleet, seed)


@pytest.mark.parametrize("seed", range(100, 110))
def test_a_random_fleet_gives_everything_back_on_trio(seed: int) -> None:
    run_virtual(random_fleet, seed, loop="trio")
