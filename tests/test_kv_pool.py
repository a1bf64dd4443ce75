"""`resources.kv_cache`: the memory pool sized from the backend's KV caches, from settings alone.

On the sim backend (its engine's cache) and on the real CPU vLLM (the cache it reports on
``/metrics``): a device per replica of the cache's bytes, a page per KV block, and sessions that
reserve `session_bytes` of their context budget, so that the pool admits what the cache holds.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from fleetsched import Scheduler, cli, simulate
from fleetsched.errors import BackendError, ConfigError
from fleetsched.resources import KVCacheCapacity, kv_pool, session_bytes
from fleetsched.settings import Settings, load_settings
from fleetsched.testing.vllm_server import model_path

pytestmark = pytest.mark.anyio

# The project's tiny model: 2 layers, 2 KV heads of 64, float32 (1,024 bytes a token and layer).
TINY = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 128, "dtype": "float32"}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def sim_settings(config, context_tokens: int = 1024, sim_cache_tokens: int = 8192, **resources) -> Settings:
    return Settings(
        backend={"kind": "sim", "sim": {"kv_cache_tokens": sim_cache_tokens, "block_size": 128, "max_model_len": 1024}},
        resources={"kv_cache": {"config": str(config), "context_tokens": context_tokens}, **resources},
        scheduler={"max_sessions": 100},
    )


@pytest.mark.parametrize("given", [{"devices": [{"name": "gpu0", "memory": "1GB"}]}, {"page_size": "1MB"}])
def test_devices_or_a_page_size_beside_the_kv_cache_are_refused(tiny_config, given):
    # They were taken, and left unused without a word: the pool is the backend's KV caches.
    key = next(iter(given))
    with pytest.raises(ValidationError, match=f"{key} is not used with \\[resources.kv_cache\\]"):
        sim_settings(tiny_config, **given)


async def test_on_the_sim_the_pool_is_its_cache_and_admits_what_it_holds(tiny_config):
    """8,192 tokens of cache at 2,048 bytes a token: 16 MiB in 64 blocks of 256 KiB; a session of
    1,024 tokens reserves 8 blocks, so 8 run at once and the ninth waits."""
    release = anyio.Event()
    running = 0

    async def agent(ctx) -> None:
        nonlocal running
        running += 1
        await release.wait()

    async with Scheduler(sim_settings(tiny_config)) as scheduler:
        stats = scheduler.pool.statistics()
        assert [(d.name, d.total) for d in stats.devices] == [("sim", 8192 * 2048)]
        handles = [await scheduler.submit(agent, tenant="default") for _ in range(9)]
        await anyio.sleep(1)
        assert running == 8
        assert scheduler.pool.statistics().allocated == 8 * session_bytes(1024, TINY, block_size=128)
        release.set()
        for handle in handles:
            await handle
    assert running == 9


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_session_budget_larger_than_the_cache_is_a_config_error(tiny_config, tmp_path, capsys, loop):
    """8,193 tokens against a cache of 8,192: no session could ever be admitted. Before, the
    scheduler started, every session was rejected at submission, and `run` exited 0."""

    # Refused at load where the settings hold the cache (below); checked again at the start for
    # the caches learned there: a vLLM server's, or the sim's of `simulate --profile`.
    settings = sim_settings(tiny_config, context_tokens=8193, sim_cache_tokens=16384)
    sim = settings.backend.sim.model_copy(update={"kv_cache_tokens": 8192})
    settings = settings.model_copy(update={"backend": settings.backend.model_copy(update={"sim": sim})})

    async def enter() -> None:
        async with Scheduler(settings):
            pytest.fail("the scheduler started")

    with pytest.raises(ConfigError, match=r"budget of 8,193 tokens .* more than the largest KV cache holds \(replica 'sim': 8,192 tokens") as info:
        anyio.run(enter, backend=loop)
    assert info.value.key == "resources.kv_cache.context_tokens"
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 8193\n'
        '[[workload.agents]]\ntenant = "default"\ncount = 2\nturns = 1\n'
    )
    assert cli.main(["run", str(config), "--no-live"]) == 2
    assert "fleetsched: config error: resources.kv_cache.context_tokens: a session's budget" in capsys.readouterr().err
    assert simulate.main([str(config)]) == 2
    assert "fleetsched simulate: config error: resources.kv_cache.context_tokens" in capsys.readouterr().err


def test_a_session_budget_larger_than_the_sim_s_cache_is_refused_at_load(tiny_config, tmp_path, capsys):
    """The sim's cache is in the settings (backend.sim.kv_cache_tokens): a context_tokens it cannot
    hold was loaded without a word, and refused only when the scheduler started."""
    with pytest.raises(ValidationError, match=r"resources.kv_cache.context_tokens: a session's budget of 8,193 tokens"):
        sim_settings(tiny_config, context_tokens=8193)
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 8193\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert info.value.key == "resources.kv_cache.context_tokens"
    assert info.value.reason == (
        "a session's budget of 8,193 tokens reserves 17,039,360 bytes, more than the sim's KV cache holds "
        "(backend.sim.kv_cache_tokens: 8,192 tokens, 16,777,216 bytes): no session could be admitted"
    )
    # On another backend the caches are learned at the start, and checked there.
    config.write_text(config.read_text().replace("[backend.sim]", '[backend]\nkind = "vllm-engine"\n[backend.sim]'))
    assert load_settings(config).resources.kv_cache.context_tokens == 8193


async def test_a_replica_restarted_smaller_than_one_tenant_s_sessions_names_that_tenant(tiny_config, caplog):
    """Tenant small's sessions reserve 2 blocks, default's the budget's 8. The one replica
    restarted with 4 usable blocks was said to take no session, none being able to, compared with
    the budget alone; small's sessions still ran there. Now the warning names the tenant whose
    sessions it cannot take, and small's session runs."""
    blocks = {"r0": 49}
    started: dict[str, anyio.Event] = {}
    ends: dict[str, anyio.Event] = {}

    async def agent(ctx) -> None:
        started[ctx.tenant].set()
        while not ends[ctx.tenant].is_set():  # a call a second: the window's polls read /metrics meanwhile
            await ctx.chat([{"role": "user", "content": "hi"}], max_tokens=1)
            with anyio.move_on_after(1):
                await ends[ctx.tenant].wait()

    async def until(condition) -> None:
        with anyio.fail_after(600):
            while not condition():
                await anyio.sleep(0.5)

    settings = Settings(
        backend={"kind": "vllm-server", "urls": ["http://r0.invalid:8000"]},
        resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 1024}},
        tenants={"default": {}, "small": {"session_memory": "512KiB"}},  # 2 blocks of 256 KiB
        scheduler={"max_sessions": 100},
    )
    backend = restarting_replica(blocks)
    async with Scheduler(settings, backend=backend) as scheduler:
        page = scheduler.pool.page_size
        started["default"], ends["default"] = anyio.Event(), anyio.Event()
        first = await scheduler.submit(agent, tenant="default")
        with anyio.fail_after(600):
            await started["default"].wait()
        blocks["r0"] = 5  # 4 usable blocks: less than default's 8, more than small's 2
        await until(lambda: scheduler.pool.device_limit("r0") == 4 * page)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "session's budget" in r.getMessage()]
        assert warned == [
            f"vLLM replica r0 reports 4 usable KV blocks ({4 * page:,} bytes), less than a session's budget of {8 * page:,} "
            "bytes (resources.kv_cache.context_tokens): it takes no session of tenant 'default' until it is restarted "
            "with a larger cache; no replica can take one, and sessions wait for admission until then"
        ]
        ends["default"].set()
        await first
        started["small"], ends["small"] = anyio.Event(), anyio.Event()
        second = await scheduler.submit(agent, tenant="small")
        with anyio.fail_after(600):
            await started["small"].wait()
        ends["small"].set()
        await second
    await backend.aclose()


def test_a_workload_session_memory_larger_than_the_cache_is_a_config_error(tiny_config, tmp_path, capsys):
    """A tenant's (or an agent mix's) session_memory over the cache's 16 MiB: no such session
    could be admitted. Checked at load without a cache (`Settings.inadmissible`), but with the
    cache left to the scheduler's start: every one was rejected at submission, and `run` and
    `simulate` exited 0."""
    head = (
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 512\n'
    )
    config = tmp_path / "fleet.toml"
    config.write_text(head + '[tenants.big]\nsession_memory = "1GB"\n[[workload.agents]]\ntenant = "big"\ncount = 2\nturns = 1\n')
    assert cli.main(["run", str(config), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "fleetsched: config error: workload.agents.0: a session reserves 1,000,000,000 bytes (tenants.big.session_memory)" in err
    assert "more than the largest KV cache holds (replica 'sim'" in err
    assert simulate.main([str(config)]) == 2
    assert "fleetsched simulate: config error: workload.agents.0" in capsys.readouterr().err
    config.write_text(head + '[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\nsession_memory = "32MiB"\n')
    assert simulate.main([str(config)]) == 2
    assert "(workload.agents.0.session_memory), more than the largest KV cache" in capsys.readouterr().err
    # One that fits runs.
    config.write_text(head + '[tenants.a]\nsession_memory = "1MiB"\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n')
    assert simulate.main([str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"] == {"done": 2}


def test_a_tenant_quota_smaller_than_the_sized_session_is_a_config_error(tiny_config, tmp_path, capsys):
    """A session of 512 tokens reserves 1 MiB of the cache, more than tenant q's quota of 1 MB.
    Without the cache the same quota under scheduler.session_memory is refused at load; sized from
    the cache it was left unchecked: every session of q was rejected at submission, and `run` and
    `simulate` exited 0."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 512\n'
        '[tenants.a]\n[tenants.q]\nmemory_quota = "1MB"\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n[[workload.agents]]\ntenant = "q"\ncount = 2\nturns = 1\n'
    )
    assert cli.main(["run", str(config), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "config error: workload.agents.1: a session reserves 1,048,576 bytes (resources.kv_cache.context_tokens)" in err
    assert "more than the memory_quota of tenant 'q' (1,000,000 bytes)" in err
    assert simulate.main([str(config)]) == 2
    assert "fleetsched simulate: config error: workload.agents.1" in capsys.readouterr().err


def test_a_trace_line_that_could_never_be_admitted_in_the_cache_is_a_config_error(tiny_config, tmp_path, capsys):
    """A trace line's session_memory over the cache's 16 MiB, or a line of a tenant whose quota
    is smaller than the sized session: checked at load against no cache, and not at the
    scheduler's start as the agents are, every such session was rejected at submission, and
    `run` and `simulate` exited 0 with the trace's other sessions done."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"tenant": "a", "turns": 1}\n\n{"at": 1, "tenant": "a", "turns": 1, "session_memory": "32MiB"}\n')
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 512\n'
        f'[tenants.a]\n[tenants.q]\nmemory_quota = "1MB"\n[workload]\ntrace = "{trace}"\n'
    )
    assert simulate.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "fleetsched simulate: config error: workload.trace line 3: a session reserves 33,554,432 bytes" in err
    assert "more than the largest KV cache holds (replica 'sim'" in err
    assert cli.main(["run", str(config), "--no-live"]) == 2
    assert "fleetsched: config error: workload.trace line 3" in capsys.readouterr().err
    trace.write_text('{"tenant": "a", "turns": 1}\n{"at": 1, "tenant": "q", "turns": 1}\n')
    assert simulate.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "config error: workload.trace line 2: a session reserves 1,048,576 bytes (resources.kv_cache.context_tokens)" in err
    assert "more than the memory_quota of tenant 'q' (1,000,000 bytes)" in err
    # One that fits runs.
    trace.write_text('{"tenant": "a", "turns": 1}\n{"at": 1, "tenant": "a", "turns": 1, "session_memory": "1MiB"}\n')
    assert simulate.main([str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"] == {"done": 2}


async def test_a_tenant_s_own_session_memory_still_wins(tiny_config):
    settings = sim_settings(tiny_config)
    settings = settings.model_copy(update={"tenants": {"small": settings.tenants["default"].model_copy(update={"session_memory": 1 << 20})}})
    _, held = await reservations(settings, tenant="small")
    assert held == [1 << 20]


def load(tmp_path, text: str) -> Settings:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return load_settings(path)


def test_the_model_config_is_read_when_the_settings_load(tmp_path):
    with pytest.raises(ConfigError, match=r"resources\.kv_cache: .*cannot read .*missing\.json"):
        load(tmp_path, f'[resources.kv_cache]\nconfig = "{tmp_path}/missing.json"\ncontext_tokens = 512\n')
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 0}))
    with pytest.raises(ConfigError, match="num_hidden_layers must be a positive integer, got 0"):
        load(tmp_path, f'[resources.kv_cache]\nconfig = "{tmp_path}"\ncontext_tokens = 512\n')


def test_a_backend_without_caches_to_read_is_refused_at_load(tmp_path, tiny_config):
    with pytest.raises(ConfigError, match="the instant backend has no KV cache to size the memory pool from"):
        load(tmp_path, f'[backend]\nkind = "instant"\n[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 512\n')


def test_replicas_whose_blocks_differ_are_refused_by_name():
    caches = {"r0": KVCacheCapacity(4096, 128, {}), "r1": KVCacheCapacity(8192, 64, {})}
    with pytest.raises(ValueError, match=r"blocks differ \(r0: 262,144 B, r1: 131,072 B\)"):
        kv_pool(caches, TINY, context_tokens=1024)
    with pytest.raises(ValueError, match="at least one replica"):
        kv_pool({}, TINY, context_tokens=1024)


async def reservations(settings: Settings, tenant: str = "default") -> tuple[Any, list[int]]:
    """The pool's statistics on entering, and the bytes one session of `tenant` reserves."""
    held = []

    async def agent(ctx) -> None:
        held.append(ctx.reservation.nbytes)

    async with Scheduler(settings) as scheduler:
        stats = scheduler.pool.statistics()
        await scheduler.run(agent, tenant=tenant)
    return stats, held


@pytest.mark.vllm
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real server: a real clock
async def test_on_a_real_server_the_pool_is_the_cache_it_reports(vllm_server, anyio_backend):
    """The shared server: 1 GiB of KV cache in 128-token blocks of the tiny model (4,096 blocks
    of 256 KiB), read from its /metrics, less the null block vLLM holds back. A session of 4,096
    tokens reserves 32 blocks: 127 fit."""
    settings = Settings(
        backend={"kind": "vllm-server", "urls": [vllm_server.url]},
        resources={"kv_cache": {"config": str(model_path()), "context_tokens": 4096}},
    )
    stats, held = await reservations(settings)
    assert [(d.name, d.total) for d in stats.devices] == [("r0", (1 << 30) - 128 * 2048)]
    assert held == [32 * 128 * 2048]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real socket: a real clock
async def test_a_server_that_does_not_answer_is_named(tiny_config, anyio_backend):
    settings = Settings(
        backend={"kind": "vllm-server", "urls": ["http://127.0.0.1:9"]},
        resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 1024}},
    )
    with pytest.raises(BackendError, match=r"vLLM replica r0 \(http://127.0.0.1:9\): cannot read its KV cache"):
        async with Scheduler(settings):
            pass


@pytest.mark.parametrize("strategy", ["buddy", "size-class"])
def test_a_strategy_that_rounds_beyond_the_engines_blocks_is_refused_with_the_kv_cache(tiny_config, strategy):
    # Their rounding went on top of the blocks: size-class admitted 20 sessions where the cache held 78.
    with pytest.raises(ValidationError, match=f"strategy '{strategy}' rounds a session's blocks up"):
        sim_settings(tiny_config, strategy=strategy)
    assert sim_settings(tiny_config, strategy="first-fit").resources.strategy == "first-fit"


def test_a_model_directory_without_its_config_names_the_file_it_looked_for(tmp_path):
    # It named the directory ("cannot read .../model: No such file or directory"), which exists.
    with pytest.raises(ValidationError, match=f"cannot read {tmp_path / 'config.json'}: No such file or directory"):
        sim_settings(tmp_path)


def replicas_backend(*names: str, block_sizes: dict[str, int] | None = None) -> Any:
    """A vLLM server backend over replicas `names` that each report 1 GiB of the tiny model's
    cache on /metrics, in blocks of 128 tokens unless `block_sizes` says otherwise (no call is
    made to them)."""
    import httpx

    from fleetsched.backends.vllm_server import VLLMServerBackend

    def page(request: httpx.Request) -> httpx.Response:
        size = (block_sizes or {}).get(request.url.host.removesuffix(".invalid"), 128)
        info = f'vllm:cache_config_info{{block_size="{size}",engine="0",num_gpu_blocks="{(1 << 19) // size}"}} 1.0\n'
        return httpx.Response(200, text="# TYPE vllm:cache_config_info gauge\n" + info)

    http = httpx.AsyncClient(transport=httpx.MockTransport(page))
    return VLLMServerBackend({name: f"http://{name}.invalid:8000" for name in names}, model="tiny", http_client=http)


async def test_sessions_are_spread_over_the_replicas_and_come_back_to_theirs_after_a_tool(tiny_config):
    """A session's calls go to the replica its memory is on. The pool packed sessions onto the
    fullest device, so every session, and every call, went to r0 while r1 stood idle (a run with
    two real replicas: 55 calls on r0, none on r1). Spread, a session re-admitted after a tool in
    which it gave its memory back still goes to its replica, where its conversation is cached."""
    placed: list[str] = []
    before_tool: list[Any] = []
    after_tool: list[tuple[str, str]] = []
    release = anyio.Event()

    async def agent(ctx) -> None:
        placed.append(ctx.reservation.device)
        await release.wait()
        before = ctx.reservation.device
        if before == "r1":
            return
        before_tool.append(ctx)
        async with ctx.tool("search"):  # back one after the other, r1 empty by then
            await anyio.sleep(5 + before_tool.index(ctx))
        after_tool.append((before, ctx.reservation.device))
        with anyio.fail_after(10):  # held, for the next ones back
            while len(after_tool) < 3:
                await anyio.sleep(0.5)

    settings = Settings(
        backend={"kind": "vllm-server", "urls": ["http://r0.invalid:8000", "http://r1.invalid:8000"]},
        resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 1024}},
        scheduler={"max_sessions": 100, "tool_policy": "release"},
    )
    backend = replicas_backend("r0", "r1")
    async with Scheduler(settings, backend=backend) as scheduler:
        handles = [await scheduler.submit(agent, tenant="default") for _ in range(6)]
        await anyio.sleep(1)
        assert sorted(placed) == ["r0"] * 3 + ["r1"] * 3, placed
        # r1's sessions end, r0's give their memory back in a tool: the second back found r1
        # emptier than r0, and went there.
        release.set()
        for handle in handles:
            await handle
    await backend.aclose()
    assert after_tool == [("r0", "r0")] * 3, after_tool


async def test_replicas_that_serve_different_block_sizes_are_a_config_error(tiny_config):
    """One replica restarted with --block-size 64 beside another at 128: `fleetsched run` ended in
    a traceback (kv_pool's ValueError); now the config error it prints and exits 2 on."""
    settings = Settings(
        backend={"kind": "vllm-server", "urls": ["http://r0.invalid:8000", "http://r1.invalid:8000"]},
        resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 1024}},
    )
    backend = replicas_backend("r0", "r1", block_sizes={"r1": 64})
    with pytest.raises(ConfigError, match=r"^resources.kv_cache: the replicas' KV blocks differ \(r0: 262,144 B, r1: 131,072 B\)"):
        async with Scheduler(settings, backend=backend):
            pass
    await backend.aclose()


def test_a_scheduler_session_memory_beside_the_kv_cache_is_refused(tiny_config, tmp_path, monkeypatch, capsys):
    """With [resources.kv_cache] a session reserves the KV bytes of context_tokens: a
    scheduler.session_memory given beside it was left unused without a word (sessions of 1 MiB
    where 100 KB was asked, so fewer ran at once than the config said)."""
    with pytest.raises(ValidationError, match=r"scheduler.session_memory: not used with \[resources.kv_cache\]"):
        Settings(
            backend={"kind": "sim", "sim": {"kv_cache_tokens": 8192, "block_size": 128, "max_model_len": 1024}},
            resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 512}},
            scheduler={"session_memory": "100KB"},
        )
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nkv_cache_tokens = 8192\nblock_size = 128\nmax_model_len = 1024\n'
        f'[resources.kv_cache]\nconfig = "{tiny_config}"\ncontext_tokens = 512\n'
        '[[workload.agents]]\ntenant = "default"\ncount = 2\nturns = 1\n'
    )
    monkeypatch.setenv("FLEETSCHED_SCHEDULER__SESSION_MEMORY", "100KB")
    assert simulate.main([str(config)]) == 2
    assert "fleetsched simulate: config error: scheduler.session_memory: not used with [resources.kv_cache]" in capsys.readouterr().err
    # Set for a tenant (or an agent mix) it is used, as documented.
    monkeypatch.delenv("FLEETSCHED_SCHEDULER__SESSION_MEMORY")
    monkeypatch.setenv("FLEETSCHED_TENANTS__DEFAULT__SESSION_MEMORY", "100KB")
    assert load_settings(config).tenants["default"].session_memory == 100_000


def sdk_client(base_url: str, api_key: str, chat: Any) -> Any:
    """An OpenAI SDK client whose calls `chat` answers (an httpx2 MockTransport handler), with the
    platform it sends read here. The SDK reads it on a worker thread at a client's first call;
    on the tests' clock, which jumps to the next deadline whenever every task waits, the test's
    sleeps ran out while that thread ran, and sessions were still in their first call 12 virtual
    seconds on (under load, half the runs)."""
    import httpx2
    from openai import AsyncOpenAI, _base_client

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(chat)))
    assert client._platform is None  # the attribute the SDK's first call reads it into
    client._platform = _base_client.get_platform()
    return client


def metrics_page(blocks: int) -> str:
    """A vLLM server's /metrics of a KV cache of `blocks` blocks of 128 tokens, nothing waiting."""
    info = f'vllm:cache_config_info{{block_size="128",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
    waiting = 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0\n'
    return "# TYPE vllm:cache_config_info gauge\n" + info + waiting


def short_answer() -> bytes:
    """A vLLM server's streamed answer of one token ("hi"), with its usage."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    answer = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
    ]
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in answer) + b"data: [DONE]\n\n"


def restarting_replica(blocks: dict[str, int]) -> Any:
    """A vLLM server backend over one replica, r0, that reports `blocks["r0"]` KV blocks of 128
    tokens of the tiny model's cache on /metrics (change it to play a restart with another
    cache) and answers every chat call with one short streamed answer. (A mock: a real server's
    restart mid-test takes minutes here.)"""
    import httpx
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    def page(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/metrics":
            return httpx.Response(404)
        return httpx.Response(200, text=metrics_page(blocks["r0"]))

    stream = short_answer()

    def chat(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    def client(base_url: str, api_key: str) -> Any:
        return sdk_client(base_url, api_key, chat)

    http = httpx.AsyncClient(transport=httpx.MockTransport(page))
    return VLLMServerBackend({"r0": "http://r0.invalid:8000"}, model="tiny", http_client=http, client_factory=client)


def calling_agent(started: list[int], ends: list[anyio.Event]) -> Any:
    """An agent that notes its start in `started`, and its end event in `ends` (set it to end
    the session), and makes a call a second meanwhile: the window's polls read /metrics then."""

    async def agent(ctx) -> None:
        started.append(ctx.session_id)
        end = anyio.Event()
        ends.append(end)
        while not end.is_set():
            await ctx.chat([{"role": "user", "content": "hi"}], max_tokens=1)
            with anyio.move_on_after(1):
                await end.wait()

    return agent


def one_replica_settings(config) -> Settings:
    """KV admission over the one replica of `restarting_replica`: sessions of 1,024 tokens."""
    return Settings(
        backend={"kind": "vllm-server", "urls": ["http://r0.invalid:8000"]},
        resources={"kv_cache": {"config": str(config), "context_tokens": 1024}},
        scheduler={"max_sessions": 100},
    )


async def test_a_replica_restarted_with_a_smaller_cache_is_admitted_to_as_that_cache(tiny_config):
    """The pool is sized from the caches at the start; a replica restarted with a smaller one
    (64 blocks, then 20) was warned about and admitted to as before, and preempted (3 times).
    Now its device takes no new session while its sessions hold more than the new cache, and
    takes them again when they hold less, or when the cache is back to its size."""
    blocks = {"r0": 49}  # 48 usable (vLLM holds back its null block): six sessions of 8 blocks
    started: list[int] = []
    ends: list[anyio.Event] = []
    agent = calling_agent(started, ends)
    settings = one_replica_settings(tiny_config)
    backend = restarting_replica(blocks)
    async with Scheduler(settings, backend=backend) as scheduler:
        handles = [await scheduler.submit(agent, tenant="default") for _ in range(6)]
        await anyio.sleep(3)
        assert len(started) == 6
        blocks["r0"] = 21  # restarted with 20 usable blocks: two sessions
        await anyio.sleep(3)
        for end in ends[:3]:  # three sessions (24 blocks) still hold more than the cache
            end.set()
        handles.append(await scheduler.submit(agent, tenant="default"))
        await anyio.sleep(3)
        assert len(started) == 6, "admitted to a replica whose sessions hold more than its cache"
        assert scheduler.pool.device_limit("r0") == 20 * scheduler.pool.page_size
        for end in ends[3:5]:  # one session left: 8 blocks, and the waiting one's 8 fit in 20
            end.set()
        await anyio.sleep(3)
        assert len(started) == 7
        handles += [await scheduler.submit(agent, tenant="default") for _ in range(2)]
        await anyio.sleep(3)
        assert len(started) == 7  # two running (16 blocks): a third does not fit in 20
        blocks["r0"] = 49  # restarted as before: the whole device again
        await anyio.sleep(3)
        assert len(started) == 9 and scheduler.pool.device_limit("r0") is None
        for end in ends:
            end.set()
        for handle in handles:
            await handle
    await backend.aclose()


async def test_a_lone_replica_restarted_smaller_than_a_session_is_warned_of_while_sessions_wait(tiny_config, caplog):
    """The one replica restarted with 4 usable blocks, a session's budget being 8: a session
    submitted then waited for admission with no word of why (the pool limits the device, and a
    request over every device's limit waits rather than failing). Now a warning names the
    replica and the sizes, and says sessions wait until it is restarted with a larger cache;
    restarted back, the waiting session runs."""
    blocks = {"r0": 49}
    started: list[int] = []
    ends: list[anyio.Event] = []
    agent = calling_agent(started, ends)
    settings = one_replica_settings(tiny_config)
    backend = restarting_replica(blocks)
    async with Scheduler(settings, backend=backend) as scheduler:
        handles = [await scheduler.submit(agent, tenant="default")]
        await anyio.sleep(3)
        page = scheduler.pool.page_size
        blocks["r0"] = 5  # 4 usable blocks: less than one session's 8
        await anyio.sleep(3)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "session's budget" in r.getMessage()]
        assert warned == [
            f"vLLM replica r0 reports 4 usable KV blocks ({4 * page:,} bytes), less than a session's budget of {8 * page:,} "
            "bytes (resources.kv_cache.context_tokens): it takes no session until it is restarted with a larger cache; "
            "no replica can take one, and sessions wait for admission until then"
        ]
        r0 = scheduler.pool.statistics().devices[0]
        assert (r0.limit, r0.usable, r0.free) == (4 * page, 0, 40 * page)
        ends[0].set()
        await handles[0]
        handles.append(await scheduler.submit(agent, tenant="default"))  # 8 blocks, over the 4 it may hold: it waits
        await anyio.sleep(3)
        assert len(started) == 1 and not handles[1].done
        blocks["r0"] = 49  # restarted back, with no session running to make a call
        await anyio.sleep(3)
        assert len(started) == 2, "the replica, restarted back, was not read again: the session waited on"
        assert scheduler.pool.device_limit("r0") is None
        ends[1].set()
        await handles[1]
    await backend.aclose()


def replicas_that_go_down(down: set[str], how: str) -> Any:
    """A vLLM server backend over replicas r0 and r1 that each report 48 usable KV blocks of 128
    tokens of the tiny model's cache on /metrics (six sessions of 1,024 tokens) and answer every
    chat call with one short streamed answer; a replica named in `down` refuses every connection
    (`how` "refused": a server killed) or answers nothing until the read times out ("hangs").
    (A mock: a real server's restart mid-test takes minutes here.)"""
    import httpx
    import httpx2

    from fleetsched.backends.vllm_server import VLLMServerBackend

    async def page(request: httpx.Request) -> httpx.Response:
        if request.url.host.removesuffix(".invalid") in down:
            if how == "hangs":
                await anyio.sleep_forever()  # the poll gives up on it
            raise httpx.ConnectError("connection refused")
        if request.url.path != "/metrics":
            return httpx.Response(404)
        return httpx.Response(200, text=metrics_page(49))

    stream = short_answer()

    def client(base_url: str, api_key: str) -> Any:
        name = httpx.URL(base_url).host.removesuffix(".invalid")

        async def chat(request: httpx2.Request) -> httpx2.Response:
            if name in down:
                if how == "hangs":
                    await anyio.sleep(60)  # backend.read_timeout_s
                    raise httpx2.ReadTimeout("timed out")
                raise httpx2.ConnectError("connection refused")
            return httpx2.Response(200, content=stream, headers={"content-type": "text/event-stream"})

        return sdk_client(base_url, api_key, chat)

    http = httpx.AsyncClient(transport=httpx.MockTransport(page))
    urls = {name: f"http://{name}.invalid:8000" for name in ("r0", "r1")}
    return VLLMServerBackend(urls, model="tiny", http_client=http, client_factory=client)


@pytest.mark.parametrize("how", ["refused", "hangs"])
async def test_a_replica_that_is_down_takes_no_new_session_until_it_is_up(tiny_config, how):
    """Sessions placed on a replica that died have their calls served by the others, as they
    should; but new sessions were still admitted to its device, and their calls went to the
    others too, past the caches admission had sized their devices to (two replicas of six
    sessions each, one down: the other served ten). Now a replica whose breaker is open, or whose
    /metrics stopped answering (a replica that hangs opens its breaker only after calls that each
    waited the read timeout), takes no new session; back, it does."""
    down: set[str] = set()
    placed: list[str] = []
    end = anyio.Event()

    async def agent(ctx) -> None:
        placed.append(ctx.reservation.device)
        while not end.is_set():  # a call a second: r1's sessions open its breaker, the polls see it
            await ctx.chat([{"role": "user", "content": "hi"}], max_tokens=1)
            with anyio.move_on_after(1):
                await end.wait()

    settings = Settings(
        backend={"kind": "vllm-server", "urls": ["http://r0.invalid:8000", "http://r1.invalid:8000"], "breaker_reset_s": 30},
        resources={"kv_cache": {"config": str(tiny_config), "context_tokens": 1024}},
        scheduler={"max_sessions": 100},
    )
    backend = replicas_that_go_down(down, how)
    async with Scheduler(settings, backend=backend) as scheduler:
        handles = [await scheduler.submit(agent, tenant="default") for _ in range(4)]
        await anyio.sleep(3)
        assert sorted(placed) == ["r0", "r0", "r1", "r1"]
        down.add("r1")  # its two sessions' calls go to r0 (at once, or after the read timeout)
        await anyio.sleep(10)  # a poll gives up on a /metrics that hangs after 5 s
        handles += [await scheduler.submit(agent, tenant="default") for _ in range(4)]
        await anyio.sleep(3)
        assert placed[4:] == ["r0"] * 4, "admitted to a replica that is down"
        assert scheduler.pool.device_limit("r1") == 0
        handles.append(await scheduler.submit(agent, tenant="default"))  # r0 is full: it waits
        await anyio.sleep(3)
        assert len(placed) == 8
        down.clear()  # back: r1 takes new sessions again (refused: from its breaker's probe on)
        await anyio.sleep(30)
        assert placed[8:] == ["r1"] and scheduler.pool.device_limit("r1") is None
        end.set()
        for handle in handles:
            await handle  # none failed: every call of r1's sessions was served by r0 meanwhile
    await backend.aclose()
