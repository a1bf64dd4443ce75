"""Admission by KV capacity on a real vLLM server: no preemption storm when reservations fit.

A dedicated server (the session one has a 1 GiB cache and 4 sequences, which never preempts) with
48 KV blocks of 128 tokens (6,144 tokens), 32 sequences at once, no prefix caching, and chat
content passed as a plain string (the tiny model's template drops list-form content). Fourteen
sessions each stream one completion of 600 tokens (``ignore_eos``) after a prompt of a few hundred
tokens, so that every sequence really grows towards its budget of 1,024 tokens.

- Without admission (a pool whose device is far larger than the cache) all fourteen run at once,
  the cache overflows and ``vllm:num_preemptions_total`` climbs.
- With admission (the device is the server's KV capacity read from ``/metrics`` x the model's
  bytes per token, less the null block vLLM holds back, one pool page per vLLM block, each session
  reserving its budget) five run at a time, the counter stays flat, and every session finishes:
  built by hand, and by a `Scheduler` from ``[resources.kv_cache]`` alone.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator

import anyio
import httpx
import pytest
from openai import AsyncOpenAI, Timeout

from fleetsched import Scheduler
from fleetsched.observability.feasibility import check_feasibility
from fleetsched.resources import (
    DeviceSpec,
    ExtentPool,
    kv_bytes_per_token,
    kv_device,
    kv_page_size,
    read_vllm_kv_capacity,
    session_bytes,
)
from fleetsched.settings import Settings
from fleetsched.testing.fixtures import require_vllm_setup
from fleetsched.testing.vllm_server import VLLMServer, model_path

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

SESSIONS = 14
MAX_TOKENS = 600
BUDGET_TOKENS = 1024  # prompt (< 400 tokens, checked) + MAX_TOKENS, whole blocks
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def small_cache_server() -> Iterator[VLLMServer]:
    require_vllm_setup()
    server = VLLMServer(
        max_model_len=2048,
        max_num_seqs=32,
        extra_args=(
            "--num-gpu-blocks-override", "48",
            "--no-enable-prefix-caching",
            "--chat-template-content-format", "string",
        ),
    )  # fmt: skip
    with server:
        yield server


async def _preemptions(client: httpx.AsyncClient, server: VLLMServer) -> float:
    text = (await client.get(server.metrics_url)).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions_total"))


async def _run_load(server: VLLMServer, pool: ExtentPool, nbytes: int) -> list[tuple[int, int]]:
    """Run SESSIONS sessions at once, each holding a reservation of `nbytes` while it generates."""
    # The SDK's default gives a connection 5 s, its only timeout shorter than the load's own
    # bound (the fail_after below): a clean-clone CI once failed here on an APITimeoutError.
    # The SDK's own Timeout class: openai >= 2 speaks httpx2, which refuses an httpx.Timeout.
    openai = AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=Timeout(120.0, connect=60.0))
    usage: list[tuple[int, int]] = []

    async def session(i: int) -> None:
        rng = random.Random(i)
        prompt = " ".join(rng.choice(WORDS) for _ in range(60))
        async with pool.reserve(nbytes, owner=i):
            response = await openai.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True},
            )
        assert response.usage is not None
        usage.append((response.usage.prompt_tokens, response.usage.completion_tokens))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(SESSIONS):
                tg.start_soon(session, i)
    await openai.close()
    return usage


async def test_admission_by_kv_capacity_keeps_preemptions_flat(small_cache_server: VLLMServer) -> None:
    server = small_cache_server
    capacity = await read_vllm_kv_capacity(server.url)
    config = model_path()
    per_token = kv_bytes_per_token(config)
    assert capacity.tokens == 48 * capacity.block_size
    nbytes = session_bytes(BUDGET_TOKENS, bytes_per_token=per_token, block_size=capacity.block_size)
    device = kv_device("vllm0", capacity, config)
    page = kv_page_size(capacity, config)
    assert device["memory"] == (capacity.num_gpu_blocks - 1) * capacity.block_size * per_token  # all but the null block

    async with httpx.AsyncClient(timeout=10.0) as client:
        # Without admission: a device far larger than the cache lets every session in at once.
        unbounded = ExtentPool([DeviceSpec("vllm0", 1000 * device["memory"])], page_size=page)
        before = await _preemptions(client, server)
        usage = await _run_load(server, unbounded, nbytes)
        without = await _preemptions(client, server) - before

        # With admission: the device is the server's KV capacity.
        bounded = ExtentPool([DeviceSpec("vllm0", device["memory"])], page_size=page)
        before = await _preemptions(client, server)
        usage_admitted = await _run_load(server, bounded, nbytes)
        with_admission = await _preemptions(client, server) - before

    print(f"preemptions without admission: {without:.0f}, with admission: {with_admission:.0f}")
    assert all(p + c <= BUDGET_TOKENS and c == MAX_TOKENS for p, c in usage + usage_admitted)
    assert min(p for p, _ in usage) > 100, "prompts should be hundreds of tokens long"
    assert len(usage) == len(usage_admitted) == SESSIONS
    assert without > 0, "the load should overflow the KV cache without admission"
    assert with_admission == 0
    assert bounded.statistics().allocated == 0


async def test_sliding_window_layers_are_sized_as_the_server_bounds_them(tmp_path) -> None:
    """The tiny model served with five layers, three sliding-window (128 tokens) and two full
    (random weights), at a 4,096-token context: the sessions `kv_device`'s memory holds at
    `session_bytes` each are the maximum concurrency vLLM computes itself (60.24 on the CPU
    build). vLLM caches such a model in groups of two layers, the third sliding layer padded to a
    group of its own: 4,096 blocks of two layers in 1 GiB, and a request holds 2 x 18 blocks in
    the sliding groups (the window and the 2,048 tokens of a step in flight) and 32 in the full
    one. Counted without the padding, 69.42 would be admitted; with every layer whole, 51.2."""
    require_vllm_setup()
    model = tmp_path / "tiny-sliding"
    shutil.copytree(model_path(), model)
    config = json.loads((model / "config.json").read_text())
    sliding, full = "sliding_attention", "full_attention"
    config.update(num_hidden_layers=5, sliding_window=128, layer_types=[sliding, full, sliding, full, sliding])
    (model / "config.json").write_text(json.dumps(config))
    with VLLMServer(model_dir=model, max_model_len=4096, extra_args=("--load-format", "dummy")) as server:
        capacity = await read_vllm_kv_capacity(server.url)
    reported = float(capacity.labels["kv_cache_max_concurrency"])
    memory = kv_device("sliding", capacity, model)["memory"]
    whole = int(capacity.labels["kv_cache_memory_bytes"])  # vLLM's concurrency counts its null block too
    assert memory == whole - whole // capacity.num_gpu_blocks
    sessions = whole / session_bytes(4096, model, block_size=capacity.block_size, in_flight_tokens=2048)
    assert sessions == pytest.approx(reported, rel=1e-6)
    assert memory / session_bytes(4096, bytes_per_token=kv_bytes_per_token(model), block_size=capacity.block_size) < reported


async def test_admission_from_settings_alone_keeps_preemptions_flat(small_cache_server: VLLMServer) -> None:
    """The same load through a `Scheduler` whose pool `[resources.kv_cache]` builds from the
    server's /metrics and the model's config.json, each session reserving its 1,024-token budget
    (no devices, page size or session memory given)."""
    server = small_cache_server
    settings = Settings(
        backend={"kind": "vllm-server", "urls": [server.url], "model": server.model, "max_in_flight": 32},
        resources={"kv_cache": {"config": str(model_path()), "context_tokens": BUDGET_TOKENS}},
        scheduler={"max_sessions": SESSIONS},
    )
    usage: list[tuple[int, int]] = []

    async def session(ctx) -> None:
        prompt = " ".join(random.Random(ctx.session_id).choice(WORDS) for _ in range(60))
        response = await ctx.chat([{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, ignore_eos=True)
        usage.append((response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"]))

    async with httpx.AsyncClient(timeout=10.0) as client:
        before = await _preemptions(client, server)
        with anyio.fail_after(180):
            async with Scheduler(settings) as scheduler:
                devices = [(d.name, d.total) for d in scheduler.pool.statistics().devices]
                handles = [await scheduler.submit(session, tenant="default") for _ in range(SESSIONS)]
                for handle in handles:
                    await handle
        preemptions = await _preemptions(client, server) - before

    capacity = await read_vllm_kv_capacity(server.url)
    assert devices == [("r0", (capacity.num_gpu_blocks - 1) * kv_page_size(capacity, model_path()))]
    assert len(usage) == SESSIONS and all(c == MAX_TOKENS for _, c in usage)
    assert preemptions == 0


async def test_sessions_that_fill_their_budgets_at_once_are_not_preempted(small_cache_server: VLLMServer) -> None:
    """vLLM's block pool holds back one of its blocks (the null block): of the 48 reported, 47 go
    to requests. Counted as 48, the pool admitted six sessions of 8 blocks at once, and when the
    six filled their 1,024-token budgets together, one of them was preempted."""
    server = small_cache_server
    capacity = await read_vllm_kv_capacity(server.url)
    pool = ExtentPool(
        [DeviceSpec("vllm0", kv_device("vllm0", capacity, model_path())["memory"])], page_size=kv_page_size(capacity, model_path())
    )
    nbytes = session_bytes(BUDGET_TOKENS, model_path(), block_size=capacity.block_size)
    openai = AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=Timeout(120.0, connect=60.0))
    messages = [{"role": "user", "content": " ".join(WORDS * 20)}]
    probe = await openai.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert probe.usage is not None
    fill = BUDGET_TOKENS - probe.usage.prompt_tokens  # prompt and answer: the whole budget

    async def session(i: int) -> None:
        async with pool.reserve(nbytes, owner=i):
            await openai.chat.completions.create(
                model=server.model, messages=messages, max_tokens=fill, extra_body={"ignore_eos": True}
            )

    async with httpx.AsyncClient(timeout=10.0) as client:
        before = await _preemptions(client, server)
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(capacity.tokens // BUDGET_TOKENS):  # six budgets in 48 blocks
                    tg.start_soon(session, i)
        preempted = await _preemptions(client, server) - before
    await openai.close()
    assert preempted == 0


async def test_a_kv_cache_budget_beyond_the_server_s_context_is_named_at_start(small_cache_server: VLLMServer) -> None:
    """The server runs with --max-model-len 2048, as its GET /v1/models lists it: no call holds
    more than 2,048 tokens of its cache, yet a budget of 4,096 reserved twice that a session,
    and half the sessions the cache holds were admitted. On the sim and the in-process engine
    the settings' context named it at start; against the server nothing did."""
    server = small_cache_server
    settings = Settings(
        backend={"kind": "vllm-server", "urls": [server.url], "model": server.model},
        resources={"kv_cache": {"config": str(model_path()), "context_tokens": 4096}},
    )
    kv_cache = settings.resources.kv_cache.model_copy(update={"context_tokens": 2048})
    fits = settings.model_copy(update={"resources": settings.resources.model_copy(update={"kv_cache": kv_cache})})
    with anyio.fail_after(120):
        async with Scheduler(settings) as scheduler:
            wide = await check_feasibility(settings, scheduler.backend, scheduler.model)
            within = await check_feasibility(fits, scheduler.backend, scheduler.model)
            expected = "resources.kv_cache.context_tokens (4096) is more than the model's context (2048 tokens)"
            assert expected in (wide["note"] or "")
            assert "is more than the model's context" not in (within["note"] or "")
            assert await scheduler.backend.max_model_len() == 2048
