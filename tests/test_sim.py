"""The sim backend on virtual time: streaming, batching, scheduling policy, KV cache, cancellation.

A step costs exactly `STEP` here (no per-token costs) unless a test says otherwise, so times are
whole numbers of steps.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import anyio
import pytest

from fleetsched.backends.base import TEXT_PROMPT_KEY, Received, collect_chat, estimate_prompt_tokens, output_so_far, tools_text
from fleetsched.backends.instant import InstantBackend
from fleetsched.backends.chat_options import echoed, output_params, prompt_cut, response_role, template_kwargs
from fleetsched.backends.sampling import constraint_params
from fleetsched.backends.sim import ContextTooLong, InvalidRequest, SimBackend, SimEngine
from fleetsched.errors import BackendError, BackendUnavailable, UnknownModel
from fleetsched.scheduler.dispatcher import Dispatcher
from fleetsched.settings import SimSettings

from .helpers import waiting_under_a_full_batch

pytestmark = pytest.mark.anyio

STEP = 0.01
_tags = itertools.count()


def flat(**overrides: object) -> SimSettings:
    """A profile where every step costs STEP, with small blocks so that tests stay small."""
    values: dict[str, object] = dict(
        step_base_s=STEP, step_per_token_s=0.0, step_per_context_token_s=0.0, step_per_seq_s=0.0,
        block_size=16, kv_cache_tokens=16384,
    )  # fmt: skip
    values.update(overrides)
    return SimSettings(**values)  # type: ignore[arg-type]


def body(prompt_tokens: int, max_tokens: int, *, priority: int | None = None, text: str | None = None) -> dict:
    """A request of exactly `prompt_tokens` (by estimate_prompt_tokens); unique text unless given."""
    if text is None:
        text = f"{next(_tags):08d}"
    content = (text * (4 * prompt_tokens))[: 4 * prompt_tokens - 16]
    b: dict = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if priority is not None:
        b["priority"] = priority
    return b


async def run_one(backend: SimBackend, b: dict, log: dict | None = None, key: object = None) -> dict:
    """Consume one stream; record (first token time, end time) under `key` in `log`."""
    chunks, first = [], None
    async for chunk in backend.stream_chat(b):
        if first is None:
            first = anyio.current_time()
        chunks.append(chunk)
    if log is not None:
        log[key] = (first, anyio.current_time())
    return collect_chat(chunks)


async def test_stream_shape_and_exact_times():
    async with SimBackend(flat(), model="sim-model") as backend:
        t0 = anyio.current_time()
        chunks = []
        times = []
        async for chunk in backend.stream_chat({**body(32, 5), "model": "sim-model"}):
            chunks.append(chunk)
            times.append(anyio.current_time() - t0)
    # As vLLM opens a stream: the role alone, then the first token, both when it comes.
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}, {"content": " tok"}]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "sim-model" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 32, "completion_tokens": 5, "total_tokens": 37}
    assert collect_chat(chunks)["choices"][0]["message"]["content"] == " tok" * 5
    # One prefill step yields the first token, then one token a step.
    assert times[:6] == pytest.approx([STEP, STEP, 2 * STEP, 3 * STEP, 4 * STEP, 5 * STEP])


@pytest.mark.parametrize("make", [lambda: SimBackend(flat()), InstantBackend], ids=["sim", "instant"])
async def test_a_stream_ends_as_vllms_does(make):
    """As vLLM's server streams: the finish reason comes with the last tokens, and the usage in a
    chunk of its own whose choices are empty (a client reading ``choices[0]`` of every chunk
    works on the sim only if it works on vLLM). It came in a last chunk with an empty delta."""
    async with make() as backend:
        chunks = [chunk async for chunk in backend.stream_chat(body(32, 5))]
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all(c["choices"] and "usage" not in c for c in answer)
    assert [c["choices"][0]["finish_reason"] for c in answer] == [None] * (len(answer) - 1) + [answer[-1]["choices"][0]["finish_reason"]]
    assert answer[-1]["choices"][0]["finish_reason"] in ("length", "stop") and answer[-1]["choices"][0]["delta"]["content"]


async def test_the_instant_backend_counts_on_every_chunk_and_ends_a_cut_answer_as_vllm_does():
    """Asked for usage on every chunk (`include_usage` and `continuous_usage_stats`, as the
    dispatcher asks every call), vLLM puts the count on the answer's chunks too: the instant
    backend put it on its last chunk alone, so a gateway client that asked saw none. An answer
    whose count is cut to max_tokens ends "length", as vLLM's and the sim's do: it said "stop"."""
    backend = InstantBackend(completion_tokens=16)
    both = {"include_usage": True, "continuous_usage_stats": True}
    answer, last = [chunk async for chunk in backend.stream_chat({**body(32, 5), "stream_options": both})]
    assert answer["usage"] == last["usage"] == {"prompt_tokens": 32, "completion_tokens": 5, "total_tokens": 37}
    assert answer["choices"][0]["finish_reason"] == "length"
    whole, last = [chunk async for chunk in backend.stream_chat({**body(32, 100), "stream_options": {"continuous_usage_stats": True}})]
    assert "usage" not in whole and whole["choices"][0]["finish_reason"] == "stop" and last["usage"]["completion_tokens"] == 16


async def test_throughput_grows_with_concurrency():
    settings = flat(step_base_s=0.005, step_per_seq_s=0.0005)

    async def throughput(concurrency: int) -> float:
        async with SimBackend(settings) as backend:
            t0 = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(run_one, backend, body(32, 50))
            return concurrency * 50 / (anyio.current_time() - t0)

    one, sixteen = await throughput(1), await throughput(16)
    assert sixteen > 5 * one


async def test_max_num_seqs_caps_the_batch_and_the_rest_waits():
    log: dict = {}
    async with SimBackend(flat(max_num_seqs=2)) as backend:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run_one, backend, body(32, 10), log, i)
                await anyio.sleep(STEP / 100)  # arrive in this order (trio starts tasks in any order)
            await anyio.sleep(STEP)
            signals = await backend.signals()
            assert (signals.running, signals.waiting) == (2, 2)
    # 0 starts a step alone, the rest arrive during it; 1 joins the next step. 2 takes 0's slot when
    # 0 has its 10 tokens, 3 takes 1's.
    assert [log[i][0] for i in range(4)] == pytest.approx([STEP, 2 * STEP, 11 * STEP, 12 * STEP])


@pytest.mark.parametrize(("policy", "expected"), [("priority", ["urgent", "b", "c"]), ("fcfs", ["b", "c", "urgent"])])
async def test_priority_policy_serves_urgent_first_and_never_preempts(policy: str, expected: list[str]):
    log: dict = {}
    async with SimBackend(flat(max_num_seqs=1, policy=policy)) as backend:  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 5, priority=0), log, "a")
            await anyio.sleep(STEP / 2)
            for key, priority in [("b", 0), ("c", 0), ("urgent", -10)]:
                tg.start_soon(run_one, backend, body(16, 5, priority=priority), log, key)
                await anyio.sleep(STEP / 100)
    assert log["a"][1] == pytest.approx(5 * STEP)  # the running request was not preempted
    assert sorted(log, key=lambda k: log[k][0])[1:] == expected
    assert (await backend.signals()).preemptions_total == 0


async def test_a_step_costs_the_context_it_attends_to_its_own_tokens_included():
    """`step_per_context_token_s` is paid on every token a step attends to: the cached ones and
    the step's own. Leaving the step's tokens out made a cold prefill cost nothing for context
    and every decode one token less."""
    per = STEP / 32
    async with SimBackend(flat(step_base_s=STEP, step_per_context_token_s=per)) as backend:
        start, times = anyio.current_time(), []
        async for chunk in backend.stream_chat(body(32, 3)):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(anyio.current_time() - start)
    # Besides STEP a step: the prefill attends to its 32 tokens, each decode to the cache and its own token.
    assert times == pytest.approx([STEP + 32 * per, 2 * STEP + (32 + 33) * per, 3 * STEP + (32 + 33 + 34) * per])


async def test_chunked_prefill_splits_a_long_prompt_across_steps():
    async with SimBackend(flat(max_num_batched_tokens=64, max_num_seqs=16)) as backend:
        log: dict = {}
        await run_one(backend, body(200, 1), log, "x")
        stats = backend.statistics()
    assert log["x"][0] == pytest.approx(4 * STEP)  # 64 + 64 + 64 + 8 tokens
    assert stats.steps == 4 and stats.prompt_tokens_computed == 200 and stats.generated_tokens == 1


async def test_prefix_cache_hit_shortens_ttft_and_counts_tokens():
    log: dict = {}
    async with SimBackend(flat(max_num_batched_tokens=64, max_num_seqs=16)) as backend:
        prompt = body(160, 2, text="the same system prompt and history ")
        await run_one(backend, prompt, log, "cold")
        t = anyio.current_time()
        await run_one(backend, prompt, log, "warm")
        signals = await backend.signals()
    assert log["cold"][0] == pytest.approx(3 * STEP)  # 64 + 64 + 32
    assert log["warm"][0] - t == pytest.approx(STEP)  # 9 of 10 blocks hit: 16 tokens left
    assert signals.prefix_cache_queries_total == 320
    assert signals.prefix_cache_hits_total == 144  # the last full block is always recomputed


async def test_without_prefix_caching_a_repeated_prompt_is_computed_again_and_counts_nothing():
    """vLLM's --no-enable-prefix-caching: before, the sim had no such switch and always served
    the second prompt from the cache (9 of 10 blocks hit, its first token one step in)."""
    log: dict = {}
    async with SimBackend(flat(max_num_batched_tokens=64, max_num_seqs=16, enable_prefix_caching=False)) as backend:
        prompt = body(160, 2, text="the same system prompt and history ")
        await run_one(backend, prompt, log, "cold")
        t = anyio.current_time()
        await run_one(backend, prompt, log, "again")
        signals = await backend.signals()
        stats = backend.statistics()
        backend.engine.pool.check()
    assert log["cold"][0] == pytest.approx(3 * STEP)  # 64 + 64 + 32
    assert log["again"][0] - t == pytest.approx(3 * STEP)  # all 160 tokens again
    assert stats.prompt_tokens_computed == 320
    # vLLM looks nothing up without a prefix cache, and counts no query.
    assert signals.prefix_cache_queries_total == signals.prefix_cache_hits_total == 0
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0


async def test_preemption_when_the_cache_is_short_and_all_finish():
    results: dict = {}
    async with SimBackend(flat(kv_cache_tokens=160)) as backend:  # 10 blocks; 4 requests want 16
        async with anyio.create_task_group() as tg:
            for i in range(4):

                async def one(i: int = i) -> None:
                    results[i] = await run_one(backend, body(20, 40))

                tg.start_soon(one)
        signals = await backend.signals()
        backend.engine.pool.check()
    assert signals.preemptions_total and signals.preemptions_total > 0
    assert all(r["usage"]["completion_tokens"] == 40 for r in results.values())
    assert all(r["choices"][0]["message"]["content"] == " tok" * 40 for r in results.values())
    assert signals.kv_cache_usage == 0.0 and signals.running == 0


async def test_leaving_the_stream_aborts_and_frees_blocks():
    async with SimBackend(flat()) as backend:
        stream = backend.stream_chat(body(64, 1000))
        async for _ in stream:
            if (await backend.signals()).kv_cache_usage > 0:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        signals = await backend.signals()
        assert signals.running == 0 and signals.kv_cache_usage == 0.0

        with anyio.move_on_after(3.5 * STEP):  # cancelled while waiting for a token
            await run_one(backend, body(64, 1000))
        signals = await backend.signals()
        assert signals.running == 0 and signals.kv_cache_usage == 0.0
        await anyio.sleep(STEP)  # the step under way when it was cancelled completes
        stats = backend.statistics()
        await anyio.sleep(10)  # idle: the loop waits on an event, it does not spin
        assert backend.statistics().steps == stats.steps
    assert stats.requests_aborted == 2 and stats.requests_finished == 0


async def test_bad_inputs_raise_at_once():
    async with SimBackend(flat(max_model_len=256, kv_cache_tokens=160)) as backend:
        with pytest.raises(ValueError, match="messages"):
            backend.stream_chat({"model": "fleetsched-sim", "messages": []})
        with pytest.raises(BackendError, match="n=1"):
            backend.stream_chat({**body(10, 5), "n": 2})
        with pytest.raises(InvalidRequest, match="max_tokens"):
            backend.stream_chat(body(10, 0) | {"max_tokens": -1})
        with pytest.raises(InvalidRequest, match="priority"):
            backend.stream_chat(body(10, 5) | {"priority": "high"})
        with pytest.raises(ContextTooLong, match="maximum context length is 256"):
            backend.stream_chat(body(256, 10))  # the prompt fills the context
        with pytest.raises(ContextTooLong, match="max_tokens=300 cannot be greater than"):
            backend.stream_chat(body(10, 300))
        with pytest.raises(ContextTooLong, match="whole cache holds 160"):
            backend.stream_chat(body(150, 20))
        assert backend.engine.queue.peek() is None
    with pytest.raises(BackendUnavailable, match="not running"):
        backend.stream_chat(body(10, 5))


@pytest.mark.parametrize(("overhead_steps", "aborted"), [(0, 2), (10, 0)])
async def test_calls_open_at_shutdown_fail_cleanly(overhead_steps: int, aborted: int):
    """A stream and a collected call open when the backend stops fail with `BackendUnavailable`:
    in the engine (aborted there), or still on their way through the front end (never counted)."""
    errors: list[BaseException] = []

    async def call(make) -> None:
        try:
            await make()
        except BackendUnavailable as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        async with SimBackend(flat(request_overhead_s=overhead_steps * STEP)) as backend:
            tg.start_soon(call, lambda: run_one(backend, body(16, 1000)))
            tg.start_soon(call, lambda: backend.complete_chat(body(16, 1000)))
            await anyio.sleep(5 * STEP)
        assert backend.statistics().requests_aborted == aborted
    assert len(errors) == 2 and all("stopped" in str(e) for e in errors)


async def test_a_call_still_waiting_in_the_engine_at_shutdown_fails_cleanly():
    """A call queued in the engine behind a full batch when the backend stops is aborted and fails
    with `BackendUnavailable`, as the running one does. Left in the queue, its caller waited for a
    token that never came."""
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await run_one(backend, body(16, 1000))
        except BackendUnavailable as exc:
            errors.append(exc)

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            async with SimBackend(flat(max_num_seqs=1)) as backend:
                tg.start_soon(call)
                tg.start_soon(call)
                await anyio.sleep(5 * STEP)
                assert (await backend.signals()).waiting == 1
    assert backend.statistics().requests_aborted == 2
    assert len(errors) == 2 and all("stopped" in str(e) for e in errors)


async def test_statistics_count_the_step_under_way_as_busy():
    """`busy_s` includes the part of the step under way done so far: halfway through a step, the
    engine has been busy all along. It left the step out until it ended."""
    async with SimBackend(flat()) as backend:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 10))
            await anyio.sleep(2.5 * STEP)
            stats = backend.statistics()
    assert stats.busy_s == pytest.approx(2.5 * STEP) and stats.busy_fraction == pytest.approx(1.0)


async def test_statistics_busy_fraction():
    async with SimBackend(flat()) as backend:
        await run_one(backend, body(16, 5))
        await anyio.sleep(5 * STEP)
        stats = backend.statistics()
    assert stats.steps == 5 and stats.busy_s == pytest.approx(5 * STEP)
    assert stats.busy_fraction == pytest.approx(0.5)
    assert stats.generated_tokens == 5 and stats.requests_finished == 1


async def test_statistics_count_a_waiting_request_from_its_arrival_and_signals_from_the_next_step():
    """`statistics().waiting` is the engine's queue now; `signals().waiting` is what the last step
    left waiting, as vLLM publishes it. Statistics read the signals' count, so a request that came
    during a step was missing from them until the next one."""
    async with SimBackend(flat(max_num_seqs=1)) as backend:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 10))
            await anyio.sleep(2.5 * STEP)
            tg.start_soon(run_one, backend, body(16, 10))
            await anyio.sleep(STEP / 10)  # it has reached the engine, in the middle of a step
            assert (backend.statistics().waiting, (await backend.signals()).waiting) == (1, 0)
            await anyio.sleep(STEP)
            assert (backend.statistics().waiting, (await backend.signals()).waiting) == (1, 1)


async def test_slow_consumer_does_not_stall_the_engine():
    async with SimBackend(flat()) as backend:
        fast_done: list[float] = []
        slow_chunks: list[dict] = []

        async def slow() -> None:
            async for chunk in backend.stream_chat(body(16, 20)):
                slow_chunks.append(chunk)
                await anyio.sleep(1.0)

        async def fast() -> None:
            await run_one(backend, body(16, 20))
            fast_done.append(anyio.current_time())

        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            tg.start_soon(fast)
    assert fast_done[0] - t0 == pytest.approx(20 * STEP)
    # The slow consumer got the tokens it missed coalesced: its third chunk (after the role's and
    # the first token's) carries 19 of them.
    assert [c["choices"][0]["delta"].get("content") for c in slow_chunks[:-1]] == ["", " tok", " tok" * 19]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_works_on_asyncio_in_real_time():
    settings = SimSettings(step_base_s=0.0005, step_per_seq_s=0.0, step_per_token_s=0.0, block_size=16)
    results: list[dict] = []
    with anyio.fail_after(10):
        async with SimBackend(settings) as backend:
            async with anyio.create_task_group() as tg:
                for _ in range(4):

                    async def one() -> None:
                        results.append(await run_one(backend, body(40, 8)))

                    tg.start_soon(one)
            stats = backend.statistics()
    assert [r["usage"]["completion_tokens"] for r in results] == [8, 8, 8, 8]
    assert stats.steps == 8 and stats.elapsed_s >= stats.busy_s > 0


async def test_stream_interval_groups_tokens_into_chunks():
    async with SimBackend(flat(stream_interval=4)) as backend:
        sizes = []
        async for chunk in backend.stream_chat(body(16, 10)):
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                sizes.append(len(content) // len(" tok"))
    assert sizes == [1, 4, 4, 1]  # the first token at once, then every 4, the rest at the end


async def test_a_request_sets_its_own_stream_interval_as_vllm_takes_it():
    """vLLM's output processor clamps a request's stream_interval to the server's: a request may
    ask for larger chunks, not smaller ones."""
    async with SimBackend(flat(stream_interval=4)) as backend:
        for asked, expected in ((5, [1, 5, 4]), (3, [1, 4, 4, 1])):
            sizes = []
            async for chunk in backend.stream_chat({**body(16, 10), "stream_interval": asked}):
                content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if content:
                    sizes.append(len(content) // len(" tok"))
            assert sizes == expected, asked
        for bad in (0, "8", 2.5, True):
            with pytest.raises(InvalidRequest, match="stream_interval"):
                backend.stream_chat({**body(16, 10), "stream_interval": bad})


async def test_continuous_usage_puts_the_count_so_far_on_every_chunk_as_vllm_does():
    """vLLM puts usage on every chunk only when both `include_usage` and
    `continuous_usage_stats` are asked for; otherwise only the last chunk has it."""
    both = {"include_usage": True, "continuous_usage_stats": True}
    async with SimBackend(flat(stream_interval=4)) as backend:
        for options, expected in ((both, [0, 1, 5, 9, 10, 10]), ({"continuous_usage_stats": True}, [10])):  # 0: the role chunk, as vLLM counts it
            counts = [
                chunk["usage"]["completion_tokens"]
                async for chunk in backend.stream_chat({**body(16, 10), "stream_options": options})
                if chunk.get("usage")
            ]
            assert counts == expected, options


async def test_a_collected_answer_wakes_its_consumer_for_the_first_token_and_the_end():
    async with SimBackend(flat(stream_interval=4)) as backend:
        start = anyio.current_time()
        streamed: dict = {}
        await run_one(backend, body(16, 10, text="a"), streamed, "a")
        streamed_times = tuple(t - start for t in streamed["a"])
        start, first, sizes = anyio.current_time(), None, []
        async for chunk in backend.stream_chat({**body(16, 10, text="b"), "stream": False}):
            first = first if first is not None else anyio.current_time() - start
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                sizes.append(len(content) // len(" tok"))
        collected_times = (first, anyio.current_time() - start)
    assert sizes == [1, 9]  # the first token at once, the rest at the end
    assert collected_times == pytest.approx(streamed_times)  # the same first-token and end times


async def test_a_model_the_sim_does_not_serve_is_refused_as_vllm_refuses_it():
    """A call naming another model than the sim's is a 404 (`UnknownModel`, param "model"), as on
    vLLM's server: it was served, so an agent developed on the sim with a wrong name failed on
    its first call to vLLM. A call naming none gets the sim's own, as on vLLM."""
    async with SimBackend(flat(), model="served") as backend:
        for call in (backend.stream_chat, backend.complete_chat):
            with pytest.raises(UnknownModel, match="The model `gpt-4o` does not exist. Valid aliases: served.") as refused:
                await call({**body(16, 2), "model": "gpt-4o"})
            assert refused.value.param == "model"
        nameless = {key: value for key, value in body(16, 2).items() if key != "model"}
        response, _ = await backend.complete_chat(nameless)
        assert response["model"] == "served" and response["usage"]["completion_tokens"] == 2
        assert not backend.engine.has_work


async def test_complete_chat_gives_the_streamed_answer_and_its_first_token_time():
    async with SimBackend(flat(stream_interval=4)) as backend:
        start = anyio.current_time()
        streamed: dict = {}
        expected = await run_one(backend, body(16, 10, text="a"), streamed, "a")
        streamed_times = tuple(t - start for t in streamed["a"])
        start = anyio.current_time()
        response, first_token_at = await backend.complete_chat(body(16, 10, text="b"))
        end = anyio.current_time() - start
        assert first_token_at is not None
        assert (first_token_at - start, end) == pytest.approx(streamed_times)
        assert response["choices"] == expected["choices"] and response["usage"] == expected["usage"]
        assert response["object"] == "chat.completion" and response["model"] == "fleetsched-sim"

        received = Received()
        await backend.complete_chat(body(16, 10, text="c"), received)
        assert received.output_tokens == 10
        received = Received()
        with anyio.move_on_after(3.5 * STEP):  # cancelled on the way: aborted in the engine
            await backend.complete_chat(body(64, 1000), received)
        assert (received.output_tokens, received.prompt_tokens) == (3, 64)  # the steps done by then: the prefill's token and two
        await anyio.sleep(STEP)
        signals = await backend.signals()
        assert signals.running == 0 and signals.kv_cache_usage == 0.0
        assert backend.statistics().requests_aborted == 1
        with pytest.raises(ContextTooLong):
            await backend.complete_chat(body(20_000, 10))
    with pytest.raises(BackendUnavailable, match="not running"):
        await backend.complete_chat(body(10, 5))


async def test_truncate_prompt_tokens_cuts_the_prompt_as_vllm_does():
    """As vLLM's server (measured on the CPU build): the prompt is cut to its last N tokens, or
    its first with truncation_side "right"; -1 cuts it to the context, less a token for the
    answer when the call asks for a length (none asked: the prompt fills the context, refused);
    a size over the context is refused naming it. The sim served none of these prompts longer
    than its context, and counted a cut prompt whole."""
    async with SimBackend(flat(max_model_len=256)) as backend:

        async def usage(prompt_tokens: int, **extra: object) -> tuple[int, int]:
            response, _ = await backend.complete_chat({**body(prompt_tokens, 10, text="abcdefgh"), **extra})
            return response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"]

        assert await usage(1000, truncate_prompt_tokens=100) == (100, 10)
        assert await usage(1000, truncate_prompt_tokens=100, max_tokens=200) == (100, 156)  # cut to the context
        assert await usage(50, truncate_prompt_tokens=100) == (50, 10)  # shorter: whole
        assert await usage(1000, truncate_prompt_tokens=-1) == (255, 1)
        with pytest.raises(ContextTooLong):
            await usage(1000, truncate_prompt_tokens=-1, max_tokens=None)
        with pytest.raises(ContextTooLong):
            await usage(1000, truncate_prompt_tokens=256)  # the context, no room left
        with pytest.raises(InvalidRequest, match=r"^truncate_prompt_tokens: expected at most the model's context \(256 tokens\), got 257"):
            await usage(10, truncate_prompt_tokens=257)
        # The length over the context is named as the call sent it (it read max_tokens).
        for field in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(ContextTooLong, match=f"^{field}=300 cannot be greater") as caught:
                await usage(10, **{"max_tokens": None, field: 300})
            assert caught.value.param == field

        # Which end is kept: a prompt cut to its first 64 tokens shares its blocks with the same
        # text's start, sent next; cut to its last 64, it shares none.
        for side, shared in (("left", False), ("right", True)):
            text = "".join(f"{side:>5}{i:03d}" for i in range(500))
            await backend.complete_chat({"messages": [{"role": "user", "content": text}], "max_tokens": 1, "truncate_prompt_tokens": 64, "truncation_side": side})
            hits = backend.statistics().prefix_cache_hits
            await backend.complete_chat({"messages": [{"role": "user", "content": text[: 4 * 64]}], "max_tokens": 1})
            assert (backend.statistics().prefix_cache_hits > hits) == shared, side


async def test_a_collected_call_cut_before_its_first_token_has_no_engine_count_of_its_prompt():
    """`Received.prompt_tokens` is the engine's count, which a stream's first chunk brings (as
    vLLM's does, with the first token). A collected call cut before it (on its way through the
    API server, or waiting in the engine) reported the whole prompt as counted: the dispatcher
    recorded it, and a run's report counted it among the tokens in, where the same call streamed
    counted none."""
    async with SimBackend(flat(request_overhead_s=5 * STEP, max_num_seqs=1)) as backend:
        received = Received()
        with anyio.move_on_after(2 * STEP):  # in the front end
            await backend.complete_chat(body(64, 10), received)
        assert (received.output_tokens, received.prompt_tokens) == (0, 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.complete_chat, body(16, 20))  # holds the engine's one slot
            await anyio.sleep(STEP)
            received = Received()
            with anyio.move_on_after(10 * STEP):  # waiting in the engine behind it
                await backend.complete_chat(body(64, 10), received)
            assert (received.output_tokens, received.prompt_tokens) == (0, 0)
        received = Received()
        with anyio.move_on_after(7.5 * STEP):  # its first token came at 6 steps
            await backend.complete_chat(body(64, 10), received)
        assert (received.output_tokens, received.prompt_tokens) == (2, 64)
        # Through the dispatcher: recorded as the same call streamed is, with no prompt counted,
        # and no share of max_tokens learned from it (it taught the tenant a share of 0, and its
        # next calls were charged no output up front).
        dispatcher = Dispatcher(backend, window=1)
        with anyio.move_on_after(2 * STEP):
            await dispatcher.chat(body(64, 10), tenant="acme", tier=1)
        (call,) = dispatcher.recorder.calls
        assert (call.error, call.prompt_tokens, call.completion_tokens) == ("Cancelled", 0, 0)
        assert dispatcher._predict_output("acme", 100) == 0 and "acme" not in dispatcher._output_share


async def test_a_request_cancelled_in_the_front_end_never_reaches_the_engine():
    """Requests on their way through the API server (`request_overhead_s`) are the engine loop's
    to queue when they arrive; one whose caller gives up first leaves no trace, and the others
    arrive as if it had never been sent."""
    settings = flat(request_overhead_s=5 * STEP)
    async with SimBackend(settings) as backend:
        log: dict = {}
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(2 * STEP):
                await run_one(backend, body(16, 4))  # cancelled on its way
            tg.start_soon(run_one, backend, body(16, 4), log, "later")
        await anyio.sleep(STEP)
        stats = backend.statistics()
    assert stats.requests_aborted == 0 and stats.requests_finished == 1 and stats.steps == 4
    # Sent at 2 steps: 5 steps on its way, then 4 steps of tokens.
    assert log["later"][1] - start == pytest.approx(11 * STEP)


@pytest.mark.parametrize(("sent", "first", "end"), [(10.5, 19.5, 22.5), (5.25, 14.5, 17.5)])
async def test_a_glide_ends_at_the_step_under_way_when_a_request_arrives(sent: float, first: float, end: float):
    """A request that arrives in the middle of a glide (steps of coasting requests only) is
    admitted at the next step boundary, as vLLM's scheduler sees it at its next step: whether it
    was sent during the glide or before the glide began."""
    settings = flat(request_overhead_s=7.5 * STEP, stream_interval=64)  # the long one coasts to its end
    async with SimBackend(settings) as backend:
        log: dict = {}
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 40), log, "long")
            await anyio.sleep(sent * STEP)
            tg.start_soon(run_one, backend, body(16, 4), log, "short")
        stats = backend.statistics()
    # The long request arrives at 7.5 steps: its first token at 8.5, its 40th at 47.5; its steps
    # end at 8.5, 9.5, ... The short one arrives 7.5 steps after it is sent, mid-step, and starts
    # at the next boundary.
    assert log["long"][1] - start == pytest.approx(47.5 * STEP)
    assert log["short"][0] - start == pytest.approx(first * STEP)
    assert log["short"][1] - start == pytest.approx(end * STEP)
    assert stats.steps == 40 and stats.requests_finished == 2



async def test_a_glide_ends_at_the_step_under_way_when_a_request_comes_with_no_front_end_delay():
    """With no front-end delay a request reaches the engine as it is sent: in the middle of a
    glide, it is admitted at the next step boundary. The glide went on to its end instead, and
    the request waited for the long one's last token."""
    async with SimBackend(flat(stream_interval=64)) as backend:  # the long one coasts to its end
        log: dict = {}
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 40), log, "long")
            await anyio.sleep(10.5 * STEP)
            tg.start_soon(run_one, backend, body(16, 4), log, "short")
    assert log["long"][1] - start == pytest.approx(40 * STEP)
    assert (log["short"][0] - start, log["short"][1] - start) == pytest.approx((12 * STEP, 15 * STEP))


async def test_a_prompt_that_fills_the_cache_is_served_when_its_last_token_needs_no_slot():
    """The last token a request generates is sampled, never written to the KV cache: vLLM serves a
    request that needs prompt + max_tokens - 1 slots, so a prompt that fills the cache alone can
    still get one token."""
    async with SimBackend(flat(kv_cache_tokens=160, max_num_batched_tokens=64, max_num_seqs=16)) as backend:
        assert (await run_one(backend, body(160, 1)))["usage"]["completion_tokens"] == 1
        assert (await run_one(backend, body(150, 11)))["usage"]["completion_tokens"] == 11
        with pytest.raises(ContextTooLong, match="needs 161 tokens of KV cache"):
            backend.stream_chat(body(160, 2))
        assert backend.engine.pool.usage == 0.0 and backend.engine.preemptions == 0


@pytest.mark.parametrize(
    "messages",
    [["hello"], [{"role": "user", "content": [{"type": "text", "text": None}]}], [{"role": "user", "content": "a"}, 7]],
)
async def test_malformed_messages_raise_invalid_request_naming_messages(messages: list):
    """As `estimate_prompt_tokens` words it: a clear InvalidRequest, not an AttributeError or a
    TypeError from deep inside, and nothing reaches the engine."""
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match="messages"):
            backend.stream_chat({"model": "fleetsched-sim", "messages": messages})
        with pytest.raises(InvalidRequest, match="messages"):
            await backend.complete_chat({"model": "fleetsched-sim", "messages": messages})
        assert not backend.engine.has_work
        assert (await run_one(backend, body(16, 3)))["usage"]["completion_tokens"] == 3


# Each refused by vLLM 0.32's server with a 400 (measured; prompt_logprobs on a stream, as every
# call reaches vLLM, read in its check_logprobs), and each served by the sim.
BAD_SAMPLING = [
    ("temperature", "hot"), ("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 2), ("top_k", 2.5),
    ("top_k", -2), ("seed", 1.5), ("seed", 2**70), ("stop", 3), ("stop", [1]), ("presence_penalty", "x"),
    ("frequency_penalty", 5), ("min_tokens", 10), ("prompt_logprobs", 1),
    # Measured against vLLM 0.32's server as well: "stop cannot contain an empty string", at most
    # 4 stop strings (VLLM_MAX_STOP_STRINGS), and a negative stop token ID is out of vocabulary.
    ("stop", ""), ("stop", ["a", ""]), ("stop", ["a", "b", "c", "d", "e"]), ("stop_token_ids", [-1]),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
async def test_sampling_parameters_vllm_refuses_are_refused_naming_the_field(field, value):
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{field}: expected"):
            backend.stream_chat({**body(16, 4), field: value})


TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}

# Each refused by vLLM 0.32's chat request validators (its chat_completion/protocol.py), one
# field needing another; each served by the sim.
BAD_PAIRS = [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"tools": [{"type": "function"}], "tool_choice": "always"}, "tool_choice"),
    ({"tools": []}, "tools"),
    # A named tool_choice must name one of the tools (vLLM's check_tool_usage): the sim served these.
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "fetch"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice.function.name"),
    # Tools of the wrong shape (vLLM's ChatCompletionToolsParam): the sim served these.
    ({"tools": "search"}, "tools"), ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [TOOL, {"type": "code", "function": {"name": "f"}}]}, "tools.1.type"),
    ({"tools": [{"function": {"description": "no name"}}], "tool_choice": "none"}, "tools.0.function.name"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "field"), BAD_PAIRS)
async def test_fields_that_need_another_are_refused_naming_the_field(extra, field):
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{field}: "):
            backend.stream_chat({**body(16, 4), **extra})
        good = {"logprobs": True, "top_logprobs": 2, "tools": [TOOL], "tool_choice": "none"}
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), **good})]
        assert chunks[-1]["usage"]["completion_tokens"] == 4


OBJECT_SCHEMA = {"type": "object"}

# Each refused by vLLM 0.32's server, measured against it (streamed, as fleetsched sends every
# call: a 400, or an error event with code 400 before any token; a structured_outputs that is no
# object was a 500 there), and each served by the sim.
BAD_CONSTRAINTS = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"1.5": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": [50]}, "logit_bias"), ({"logit_bias": {"50": "x"}}, "logit_bias.50"), ({"logit_bias": {"50": None}}, "logit_bias.50"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": OBJECT_SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": OBJECT_SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT_SCHEMA, "strict": "maybe"}}}, "response_format.json_schema.strict"),
    ({"response_format": {"type": "xml"}}, "response_format.type"), ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json_object"}, "response_format"), ({"response_format": {"type": "structural_tag"}}, "response_format.format"),
    ({"structured_outputs": "x"}, "structured_outputs"), ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"), ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"), ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": " "}}, "structured_outputs.grammar"), ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": 5}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}}, "structured_outputs"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": None}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids"), ({"logprobs": True, "logprob_token_ids": [-1]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "field"), BAD_CONSTRAINTS)
async def test_constraints_vllm_refuses_are_refused_naming_the_field(extra, field):
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}: "):
            backend.stream_chat({**body(16, 4), **extra})
        assert not backend.engine.has_work


# Each taken by vLLM 0.32's server, measured against it: the sim must not refuse them. (A token ID
# past the end of the vocabulary, which vLLM refuses, is served too: the sim knows no vocabulary.)
GOOD_CONSTRAINTS = [
    {"logit_bias": {"50": -100, " 7": "2", "+8": True, "9": 1000, "10": "inf"}},
    {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object", "extra": 1}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT_SCHEMA, "strict": "yes"}}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}},
    {"structured_outputs": {"choice": ["a", "b"], "foo": 1}}, {"structured_outputs": {"regex": ""}},
    {"structured_outputs": {"json_object": "yes"}}, {"structured_outputs": {"json": '{"type": "object"}', "disable_any_whitespace": True}},
    {"structured_outputs": {"json": OBJECT_SCHEMA}, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT_SCHEMA}}},
    {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
    {"guided_json": 5, "guided_choice": "x", "best_of": "x"},  # vLLM ignores the removed guided fields
    {"stop": ["a", "b", "c", "\t"], "stop_token_ids": [0], "bad_words": [], "allowed_token_ids": [5, True]},
    {"logprobs": True, "logprob_token_ids": list(range(128))}, {"logprob_token_ids": []},
    # Read laxly, as vLLM's request model reads them: "yes" and 1 are true, 0 and "no" false, 2.0 is 2.
    {"logprobs": "yes", "top_logprobs": 2.0}, {"logprobs": 1, "top_logprobs": True}, {"logprobs": 0}, {"logprobs": "no"},
]  # fmt: skip


async def test_a_forced_tool_choice_is_answered_with_a_call_of_the_tool():
    """vLLM constrains the answer to a call of the tool that ``tool_choice`` names (or, for
    "required", of one of the tools) and answers it as ``tool_calls``: "stop" for a named tool,
    "tool_calls" for "required". The sim answered text, so an agent loop that forces a call got
    none. With "auto" the model may answer in text, and the sim's does."""
    named = {"tools": [{"type": "function", "function": {"name": "fetch"}}, TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}}
    async with SimBackend(flat()) as backend:
        # A named tool's arguments ("{}": 1 token at 4 characters a token); for "required" the
        # list of calls, '[{"name": "fetch", "parameters": {}}]' (37 characters: 10 tokens).
        for choice, name, finish, tokens in ((named["tool_choice"], "search", "stop", 1), ("required", "fetch", "tool_calls", 10)):
            request = {**body(16, 40), **named, "tool_choice": choice}
            response, _ = await backend.complete_chat(request)
            (answer,) = response["choices"]
            assert answer["finish_reason"] == finish
            assert answer["message"]["content"] == ""
            (call,) = answer["message"]["tool_calls"]
            assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            assert call["function"] == {"name": name, "arguments": "{}"}
            assert response["usage"]["completion_tokens"] == tokens
            chunks = [chunk async for chunk in backend.stream_chat(request)]
            assert collect_chat(chunks)["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]
            assert chunks[-1]["usage"]["completion_tokens"] == tokens
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), **named, "tool_choice": "auto"})]
        assert "tool_calls" not in collect_chat(chunks)["choices"][0]["message"]
        assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_a_forced_call_fills_the_required_arguments_and_streams_them():
    """The arguments fill the schema's required properties with the first value it allows; the
    answer is as long as they are (4 characters a token), streamed as vLLM streams a call (the
    first delta names it, the others add arguments), and cut at max_tokens ("length")."""
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string"}, "top": {"type": "integer", "default": 5}, "mode": {"enum": ["fast", "deep"]},
            "where": {"type": "object", "properties": {"site": {"type": "string", "const": "docs"}}, "required": ["site"]},
            "tags": {"type": ["array", "null"]}, "skip": {"type": "boolean"},
        },
        "required": ["query", "top", "mode", "where", "tags"],
    }  # fmt: skip
    tool = {"type": "function", "function": {"name": "search", "parameters": parameters}}
    expected = {"query": "", "top": 5, "mode": "fast", "where": {"site": "docs"}, "tags": []}
    arguments = json.dumps(expected)
    tokens = -(-len(json.dumps([{"name": "search", "parameters": expected}])) // 4)  # the list of calls the model writes
    async with SimBackend(flat()) as backend:
        request = {**body(16, 100), "tools": [tool], "tool_choice": "required", "stream_interval": 3}
        response, _ = await backend.complete_chat(request)
        assert json.loads(response["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == expected
        assert response["usage"]["completion_tokens"] == tokens
        chunks = [chunk async for chunk in backend.stream_chat(request)]
        deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:] if c["choices"]]  # after the role's
        assert len(deltas) > 2 and deltas[0]["function"]["name"] == "search" and deltas[0]["id"]
        assert all("name" not in d["function"] and "id" not in d for d in deltas[1:])
        assert "".join(d["function"]["arguments"] for d in deltas) == arguments
        # Cut at max_tokens: a named call has the arguments made so far; a "required" one none,
        # as vLLM drops a list of calls whose JSON is unfinished.
        cut, _ = await backend.complete_chat({**request, "max_tokens": 5})
        assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 5
        assert cut["choices"][0]["message"]["tool_calls"] == []
        named = {"type": "function", "function": {"name": "search"}}
        cut, _ = await backend.complete_chat({**request, "tool_choice": named, "max_tokens": 5})
        assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 5
        made = len(arguments) * 5 // -(-len(arguments) // 4)  # the arguments stream in proportion to the tokens
        assert cut["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == arguments[:made]


async def test_an_assistants_tool_calls_count_in_the_next_prompt():
    """A chat template writes an assistant's tool calls into the prompt: their names and arguments
    count, on the sim and in the estimate, and the next turn hits the blocks of a call the sim
    answered, as it hits those of an answer in text. They counted nothing."""
    arguments = json.dumps({"query": "q" * 200})
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": arguments}}
    messages = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    request = {"model": "fleetsched-sim", "messages": messages, "max_tokens": 1}
    expected = (16 + 100 + 16 + len("search") + len(arguments)) // 4
    assert estimate_prompt_tokens(request) == expected
    async with SimBackend(flat()) as backend:
        assert (await backend.complete_chat(request))[0]["usage"]["prompt_tokens"] == expected
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"default": "y" * 600}}, "required": ["q"]}}}
    async with SimBackend(flat(block_size=16)) as backend:
        messages = [{"role": "user", "content": "x" * (4 * 40 - 16)}]  # 40 tokens
        first = {"model": "fleetsched-sim", "messages": messages, "tools": [tool], "tool_choice": "required"}
        answer, _ = await backend.complete_chat(first)
        output = answer["usage"]["completion_tokens"]
        messages += [answer["choices"][0]["message"], {"role": "tool", "tool_call_id": "c1", "content": "y" * 100}]
        before = (await backend.signals()).prefix_cache_hits_total
        await backend.complete_chat({"model": "fleetsched-sim", "messages": messages, "tools": [tool], "max_tokens": 1})
        hit = (await backend.signals()).prefix_cache_hits_total - before
    # The blocks of the tools, the prompt, the assistant's frame and the call (4 characters a token).
    assert hit == (len(tools_text([tool])) + 4 * (40 + 4 + output)) // (4 * 16) * 16


async def test_a_text_completions_next_prompt_hits_the_blocks_of_its_answer():
    """A text completion (the gateway's /v1/completions, a prompt with no chat template) is
    continued by sending the prompt, the answer and more: vLLM hits every full block computed,
    the answer's too, as in a chat's next turn. The sim hashed the answer as a chat's, after an
    assistant's frame that a text prompt never holds, and hit the prompt's own blocks only."""
    async with SimBackend(flat(block_size=16)) as backend:
        prompt = "abcd" * 40  # 40 tokens
        first = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, TEXT_PROMPT_KEY: True}
        answer, _ = await backend.complete_chat(first)
        before = (await backend.signals()).prefix_cache_hits_total
        text = prompt + answer["choices"][0]["message"]["content"] + "wxyz" * 20
        await backend.complete_chat({**first, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
        hit = (await backend.signals()).prefix_cache_hits_total - before
    assert hit == (40 + 64 - 1) // 16 * 16  # 6 blocks: the 103 tokens computed (the last token never is)


async def test_sampling_parameters_vllm_takes_are_taken():
    good = {"temperature": 0, "top_p": 1, "top_k": -1, "seed": -5, "stop": "x", "min_tokens": 4, "presence_penalty": None}
    async with SimBackend(flat()) as backend:
        for extra in (good, *GOOD_CONSTRAINTS):
            chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), **extra})]
            assert chunks[-1]["usage"]["completion_tokens"] == 4, extra


def test_constraints_are_read_as_vllms_server_reads_them():
    """What the in-process engine backend hands vLLM's SamplingParams (`constraint_params`): the
    lax values of vLLM's request model read as it reads them, a response_format's constraint
    over structured_outputs' own, and every body vLLM takes read without an error."""
    for extra in GOOD_CONSTRAINTS:
        constraint_params(extra)
    assert constraint_params(GOOD_CONSTRAINTS[0]) == {"logit_bias": {50: -100.0, 7: 2.0, 8: 1.0, 9: 100.0, 10: 100.0}}
    assert constraint_params({"allowed_token_ids": [5, True], "bad_words": []}) == {"allowed_token_ids": [5, 1]}
    assert constraint_params({"response_format": {"type": "text"}}) == {}
    so = {"json_object": "yes", "disable_any_whitespace": "no", "foo": 1}
    assert constraint_params({"structured_outputs": so}) == {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT_SCHEMA}}
    merged = {"structured_outputs": {"json": '{"type": "string"}', "whitespace_pattern": " "}, "response_format": schema}
    assert constraint_params(merged)["structured_outputs"] == {"json": OBJECT_SCHEMA, "whitespace_pattern": " "}
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert json.loads(constraint_params({"response_format": tag})["structured_outputs"]["structural_tag"]) == tag


# Each refused by vLLM 0.32's server as fleetsched's tests start it (no --trust-request-* flags),
# and each served by the sim before: the chat template's options, the prompt's tokenisation and
# the answer's text options of the wrong type or out of range.
BAD_CHAT_OPTIONS = [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message"),  # add_generation_prompt is true unless set false
    ({"continue_final_message": True, "add_generation_prompt": "no"}, "continue_final_message"),  # "no" is true to vLLM's first check
    ({"echo": "maybe"}, "echo"), ({"skip_special_tokens": 2}, "skip_special_tokens"), ({"use_beam_search": "x"}, "use_beam_search"),
    ({"chat_template": "{{ messages }}"}, "chat_template"), ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"), ({"mm_processor_kwargs": {"num_crops": 2}}, "mm_processor_kwargs"),
    ({"documents": [{"title": 1}]}, "documents"), ({"documents": "text"}, "documents"), ({"reasoning_effort": "huge"}, "reasoning_effort"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),  # an empty prompt
    ({"truncate_prompt_tokens": False}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": "x"}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": "a/b"}, "cache_salt"), ({"cache_salt": "s" * 129}, "cache_salt"),
    ({"thinking_token_budget": -2}, "thinking_token_budget"), ({"thinking_token_budget": 1.5}, "thinking_token_budget"),
    ({"thinking_token_budget": "5"}, "thinking_token_budget"), ({"thinking_token_budget": 5.0}, "thinking_token_budget"),  # vLLM reads it strictly
    ({"repetition_detection": {"max_pattern_size": 2.5, "min_count": 3}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_count": "x"}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}}, "repetition_detection.min_pattern_size"),
    ({"vllm_xargs": {"a": {"b": 1}}}, "vllm_xargs"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "field"), BAD_CHAT_OPTIONS)
async def test_chat_options_vllm_refuses_are_refused_naming_the_field(extra, field):
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}: "):
            backend.stream_chat({**body(16, 4), **extra})
        assert not backend.engine.has_work
    with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}: "):
        _ = [chunk async for chunk in InstantBackend().stream_chat({**body(16, 4), **extra})]


# Each taken by vLLM 0.32's server: the sim must not refuse them. (Echo of a message of the
# answer's role is left out: the tiny model's template reads content parts, on which vLLM's stream
# fails; the engine backend echoes their text.)
GOOD_CHAT_OPTIONS = [
    {"add_generation_prompt": False, "continue_final_message": "yes"}, {"add_generation_prompt": "no"}, {"echo": True},
    {"chat_template_kwargs": {"enable_thinking": False, "chat_template": None}, "reasoning_effort": "low", "documents": [{"title": "a", "text": "b"}]},
    {"truncate_prompt_tokens": -1, "truncation_side": "left", "add_special_tokens": "false", "cache_salt": "s" * 128},
    {"include_stop_str_in_output": 1, "skip_special_tokens": False, "spaces_between_special_tokens": "off", "watermarking": False},
    {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "thinking_token_budget": -1, "vllm_xargs": {"a": 1, "b": ["x", 2.5]}},
]  # fmt: skip


async def test_integer_chat_options_are_read_laxly_as_vllms_server_reads_them():
    """truncate_prompt_tokens "100" or 100.0 and repetition_detection's sizes "2" or 3.0, which
    vLLM's request model reads as integers (checked against vLLM 0.32's): the sim refused them.
    The prompt is cut as by 100, and the engine backend is handed the integers read."""
    async with SimBackend(flat(max_model_len=256)) as backend:
        for size in ("100", 100.0, " 100 ", "100.0"):
            response, _ = await backend.complete_chat({**body(1000, 10), "truncate_prompt_tokens": size})
            assert response["usage"]["prompt_tokens"] == 100, size
        detection = {"max_pattern_size": "2", "min_pattern_size": True, "min_count": 3.0}
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), "repetition_detection": detection})]
        assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert prompt_cut({"truncate_prompt_tokens": "-1"}) == -1 and prompt_cut({}) is None
    assert output_params({"repetition_detection": detection}) == {"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 3}}
    assert estimate_prompt_tokens({"prompt": "x" * 20_000, "truncate_prompt_tokens": "100"}) == 100


async def test_chat_options_vllm_takes_are_taken():
    async with SimBackend(flat()) as backend:
        for extra in GOOD_CHAT_OPTIONS:
            chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), **extra})]
            assert chunks[-1]["usage"]["completion_tokens"] == 4, extra


def test_chat_options_are_read_as_vllms_server_reads_them():
    """What the in-process engine backend hands vLLM's renderer and SamplingParams: the template's
    arguments merged as the server merges them (the call's own over tools, under the fields that
    set the template's options; null and "auto" set nothing), the answer's text options read
    laxly, and the role and echo of an answer that continues the last message."""
    tools = [TOOL]
    assert template_kwargs({}) == {"add_generation_prompt": True, "continue_final_message": False}
    given = {"tools": None, "add_generation_prompt": True, "custom": "auto", "flavour": 1}
    merged = template_kwargs({"tools": tools, "add_generation_prompt": "no", "chat_template_kwargs": given, "reasoning_effort": "none"})
    assert merged == {
        "tools": tools, "flavour": 1, "add_generation_prompt": False, "continue_final_message": False,
        "reasoning_effort": "none", "enable_thinking": False,
    }  # fmt: skip
    assert template_kwargs({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})["enable_thinking"] is False
    assert template_kwargs({"chat_template_kwargs": {"tools": tools}})["tools"] == tools
    assert output_params({}) == {}
    text_options, extras = GOOD_CHAT_OPTIONS[-2:]
    read = output_params({**text_options, **extras})
    assert read == {
        "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False, "watermarking": False,
        "thinking_token_budget": -1, "repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "extra_args": {"a": 1, "b": ["x", 2.5]},
    }  # fmt: skip
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}], "echo": True}
    parsed = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "The "}, {"type": "text", "text": "answer is"}]}]
    assert response_role(turn) == "assistant" and echoed(turn, parsed, "assistant") == "The answer is"
    assert echoed({**turn, "echo": "no"}, parsed, "assistant") == "" and echoed(turn, parsed[:1], "assistant") == ""
    question = {**turn, "messages": turn["messages"][:1], "add_generation_prompt": False}
    assert response_role(question) == "user" and echoed(question, parsed[:1], "user") == "hi"


async def test_log_probabilities_asked_for_laxly_are_served_as_vllm_serves_them():
    """logprobs "yes" or 1 and top_logprobs 2.0 or true, which vLLM's request model reads as true,
    2 and 1 (the sim refused them); logprobs "no" or 0 asks for none. "maybe" is refused."""
    async with SimBackend(flat()) as backend:
        for extra, top in (({"logprobs": "yes", "top_logprobs": 2.0}, 2), ({"logprobs": 1, "top_logprobs": True}, 1), ({"logprobs": "no"}, None)):
            response, _ = await backend.complete_chat({**body(16, 2), **extra})
            logprobs = response["choices"][0].get("logprobs")
            assert (None if logprobs is None else len(logprobs["content"][0]["top_logprobs"])) == top, extra
        with pytest.raises(InvalidRequest, match="^logprobs: expected true or false"):
            backend.stream_chat({**body(16, 2), "logprobs": "maybe"})


async def test_a_bad_max_completion_tokens_is_named_in_the_error():
    async with SimBackend(flat()) as backend:
        b = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": "hi"}]}
        # 5.0 is 5, as vLLM's request model and the dispatcher read it (the sim alone refused it).
        chunks = [chunk async for chunk in backend.stream_chat({**b, "max_tokens": 5.0})]
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        for bad in (0, "five", 2.5, -1, 2**31):
            with pytest.raises(InvalidRequest, match="^max_completion_tokens"):
                backend.stream_chat({**b, "max_completion_tokens": bad, "max_tokens": 5})
            with pytest.raises(InvalidRequest, match="^max_tokens"):
                backend.stream_chat({**b, "max_tokens": bad})


@pytest.mark.parametrize("coast", [False, True])
async def test_a_request_arriving_exactly_at_a_step_boundary_in_a_glide_is_admitted_at_that_boundary(coast: bool):
    """Stepping, the engine loop queues a request that reached it by the end of a step (`_arrive_due`
    takes ``at <= now``) and admits it in the next step; a glide must end at that same step, not
    one later. Step times are binary fractions here, so the boundary is exact."""
    step = 1 / 64
    settings = flat(step_base_s=step, request_overhead_s=7.5 * step, stream_interval=64)
    backend = SimBackend(settings)
    backend.engine = SimEngine(settings, coast=coast)
    async with backend:
        log: dict = {}
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_one, backend, body(16, 40), log, "long")
            await anyio.sleep(11 * step)
            tg.start_soon(run_one, backend, body(16, 4), log, "short")  # arrives at 18.5, a step's end
    assert log["short"][0] - start == 19.5 * step
    assert log["short"][1] - start == 22.5 * step


async def test_a_max_tokens_the_prompt_leaves_no_room_for_is_cut_as_vllm_cuts_it():
    """vLLM 0.32's server cuts max_tokens to what the prompt leaves of the context, and the
    answer ends with finish_reason "length" (a 4,014-token prompt with max_tokens 200 got 82
    tokens on a 4,096 context); the sim refused the call with ContextTooLong."""
    async with SimBackend(flat(max_model_len=256, kv_cache_tokens=1024)) as backend:
        response, _ = await backend.complete_chat(body(250, 10))
    assert response["usage"]["completion_tokens"] == 6 and response["choices"][0]["finish_reason"] == "length"


async def test_an_answer_of_no_named_length_that_the_context_cuts_ends_with_length():
    """A call naming no max_tokens gets the sim's default length and "stop" (the model's own end),
    but only when the context leaves room for it: cut at the context, the answer ends with
    "length", as vLLM ends it. Any call naming no max_tokens said "stop", so a client never saw
    that its answer was cut."""
    async with SimBackend(flat(max_model_len=512)) as backend:
        whole, _ = await backend.complete_chat({**body(16, 1), "max_tokens": None})
        cut, _ = await backend.complete_chat({**body(300, 1), "max_tokens": None})
    assert (whole["usage"]["completion_tokens"], whole["choices"][0]["finish_reason"]) == (256, "stop")
    assert (cut["usage"]["completion_tokens"], cut["choices"][0]["finish_reason"]) == (212, "length")


async def test_a_bare_string_content_part_counts_as_its_text():
    """vLLM 0.32's chat parser takes a plain string among a message's content parts as text
    (`_parse_chat_message_content_part`); the sim and the dispatcher's estimate dropped it."""
    from fleetsched.backends.base import estimate_prompt_tokens

    text = "x" * 400
    as_string = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    as_parts = {"model": "fleetsched-sim", "messages": [{"role": "user", "content": [text[:100], {"type": "text", "text": text[100:]}]}], "max_tokens": 1}
    assert estimate_prompt_tokens(as_parts) == estimate_prompt_tokens(as_string) == 104
    async with SimBackend(flat()) as backend:
        usages = [(await backend.complete_chat(b))[0]["usage"]["prompt_tokens"] for b in (as_string, as_parts)]
    assert usages == [104, 104]


async def test_the_next_turn_hits_the_blocks_of_the_answer_as_in_vllm():
    """vLLM hashes every full block, generated tokens included: the next turn of a conversation
    hits the previous answer's blocks too. Measured on the tiny CPU model (128-token blocks): a
    298-token prompt answered in 128 tokens, then the next turn hit 384 tokens, (298 + 127) // 128
    blocks, where the prompt alone holds 2."""
    async with SimBackend(flat(block_size=128)) as backend:
        messages = [{"role": "user", "content": "x" * (4 * 298 - 16)}]  # 298 tokens, as `body` counts
        answer = await run_one(backend, {"model": "fleetsched-sim", "messages": messages, "max_tokens": 128})
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "tool result: " + "y" * 100}]
        before = (await backend.signals()).prefix_cache_hits_total
        await run_one(backend, {"model": "fleetsched-sim", "messages": messages, "max_tokens": 1})
        after = (await backend.signals()).prefix_cache_hits_total
        backend.engine.pool.check()
    assert after - before == 3 * 128


async def test_logprobs_come_with_every_token_as_vllm_gives_them():
    """Asked for, each chunk carries its tokens' log probabilities (vLLM's shape: token, logprob,
    bytes, and ``top_logprobs`` alternatives, the token itself first); not asked, none."""
    asked = body(10, 5) | {"logprobs": True, "top_logprobs": 3, "stream_interval": 2}
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat(asked)]
        collected, _ = await backend.complete_chat(asked)
        plain, _ = await backend.complete_chat(body(10, 5))
        plain_chunks = [chunk async for chunk in backend.stream_chat(body(10, 2))]
    token_chunks = [c["choices"][0] for c in chunks[1:] if c["choices"]]  # after the role's
    assert [len(c["logprobs"]["content"]) for c in token_chunks] == [1, 2, 2]  # the first token, then 2 a chunk
    for choice in (collect_chat(chunks)["choices"][0], collected["choices"][0]):
        entries = choice["logprobs"]["content"]
        assert len(entries) == 5
        for entry in entries:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["bytes"] == list(entry["token"].encode())
            top = entry["top_logprobs"]
            assert len(top) == 3 and top[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert sum(math.exp(t["logprob"]) for t in top) <= 1.0
    assert plain["choices"][0]["logprobs"] is None  # null, as vLLM sends it
    assert all(c["choices"][0]["logprobs"] is None for c in plain_chunks if c["choices"])


async def test_logprobs_asked_beyond_what_vllm_allows_are_refused_naming_the_field():
    async with SimBackend(flat()) as backend:
        for top, match in [(21, "top_logprobs: at most 20"), (-1, "all of the vocabulary")]:
            with pytest.raises(InvalidRequest, match=match):
                backend.stream_chat(body(10, 5) | {"logprobs": True, "top_logprobs": top})
        with pytest.raises(InvalidRequest, match="logprobs: expected true or false"):
            backend.stream_chat(body(10, 5) | {"logprobs": "maybe"})
        with pytest.raises(InvalidRequest, match="top_logprobs: needs logprobs"):
            backend.stream_chat(body(10, 5) | {"top_logprobs": 2})
        assert backend.engine.queue.peek() is None
        response, _ = await backend.complete_chat(body(10, 2) | {"logprobs": True, "top_logprobs": 20})
    assert len(response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


async def test_engine_waiting_counts_only_what_a_step_left_waiting():
    """As vLLM publishes num_requests_waiting: a request that arrives during a step is not
    counted, so with no more in flight than max_num_seqs it stays 0 (the real server's test of the
    same name). Counting the arrivals would read as a queue to the dispatcher's window, which
    shrinks on it."""
    async with SimBackend(SimSettings(profile="tiny-cpu-vllm", max_num_seqs=4)) as backend:

        async def chat(request: dict) -> None:
            await backend.complete_chat(request)

        seen = await waiting_under_a_full_batch(chat, backend.signals, clients=4, seconds=4, model="fleetsched-sim")
    assert sum(running == 4 for running, _ in seen) > len(seen) / 4  # the batch was full
    assert {waiting for _, waiting in seen} == {0}


async def test_a_forced_call_whose_schema_holds_no_json_value_is_refused_naming_the_tool():
    # A default given from Python that JSON cannot write escaped as a bare TypeError.
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"default": {1, 2}}}, "required": ["q"]}}}
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match="tools: the parameters of 'search' hold a value that is not JSON"):
            await backend.complete_chat({**body(16, 4), "tools": [tool], "tool_choice": "required"})


async def test_the_tools_a_call_offers_are_part_of_its_prompt():
    """A chat template writes the request's tools into the prompt (the tiny model's as JSON, one
    a line): ten tools of 2,000-character descriptions are about 5,000 tokens. The sim counted
    none of them (prompt_tokens 4), nor did the estimate that the rate limits, the fair share and
    the gateway's context check read."""
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 2000, "parameters": {}}} for i in range(10)]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    text = tools_text(tools)
    assert text.count("\n") == 10 and len(text) > 20_000
    assert estimate_prompt_tokens({**body, "tools": tools}) == estimate_prompt_tokens(body) + len(text) // 4
    async with SimBackend(flat()) as backend:
        bare, _ = await backend.complete_chat(body)
        offered, _ = await backend.complete_chat({**body, "tools": tools})
    assert offered["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"] + len(text) // 4


@pytest.mark.parametrize(
    ("extra", "content", "tokens"),
    [
        ({"stop": ["o"]}, " t", 1),  # the first token's text holds it: cut before it
        ({"stop": "tok tok"}, " ", 2),  # across two tokens
        ({"stop": ["zz", "k t"], "min_tokens": 3}, " tok to", 3),  # not before min_tokens, as vLLM checks
        ({"stop": "o", "include_stop_str_in_output": True}, " to", 1),
    ],
)
async def test_a_stop_string_ends_the_answer_as_vllm_ends_it(extra, content, tokens):
    """`stop` was checked and then ignored: the answer ran to max_tokens ("length"), the stop
    string in its text. vLLM ends it at the token that completes the string, leaves the string
    out (unless include_stop_str_in_output), says "stop" and which string (stop_reason)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **extra}
    async with SimBackend(flat()) as backend:
        whole, _ = await backend.complete_chat(dict(body))
        chunks = [chunk async for chunk in backend.stream_chat({**body, "stream_options": {"include_usage": True}})]
    choice = whole["choices"][0]
    stop = extra["stop"] if isinstance(extra["stop"], str) else extra["stop"][-1]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (content, "stop", stop)
    assert whole["usage"]["completion_tokens"] == tokens == chunks[-1]["usage"]["completion_tokens"]
    streamed = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in streamed) == content
    assert (streamed[-1]["finish_reason"], streamed[-1]["stop_reason"]) == ("stop", stop)


async def test_a_stop_string_the_answer_never_holds_changes_nothing():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stop": ["\n", "x"]}
    async with SimBackend(flat()) as backend:
        whole, _ = await backend.complete_chat(body)
    assert whole["choices"][0]["finish_reason"] == "length" and whole["choices"][0]["stop_reason"] is None
    assert whole["usage"]["completion_tokens"] == 5


async def test_an_answer_carries_the_null_fields_vllm_sends():
    """vLLM's choices carry ``logprobs`` and ``stop_reason``, null where there are none, in an
    answer and in every chunk: code that indexes the raw dict (``choice["logprobs"]``) got a
    KeyError on the sim, which left them out."""
    async with SimBackend(flat()) as backend:
        whole, _ = await backend.complete_chat(body(16, 3))
        chunks = [chunk async for chunk in backend.stream_chat(body(16, 3))]
    for choice in [whole["choices"][0], *(chunk["choices"][0] for chunk in chunks if chunk["choices"])]:
        assert choice["logprobs"] is None and choice["stop_reason"] is None


# Each (field, a value vLLM 0.32 takes at the edge of its range, one just past it or of a type it
# refuses), as `fleetsched.backends.sampling.RULES` holds them.
SAMPLING_EDGES = [
    ("temperature", 2.0, 2.01), ("min_p", 1.0, 1.5), ("presence_penalty", 2.0, 2.5), ("frequency_penalty", -2.0, -2.5),
    ("repetition_penalty", 0.01, 0), ("repetition_penalty", 1.1, math.inf), ("min_tokens", 0, -1),
    ("seed", 2**63 - 1, 2**63), ("seed", -(2**63), -(2**63) - 1), ("ignore_eos", True, 5), ("stop_token_ids", [0, 1], 5),
]  # fmt: skip


@pytest.mark.parametrize(("field", "taken", "refused"), SAMPLING_EDGES)
async def test_a_sampling_field_takes_its_limit_and_refuses_past_it_naming_the_field(field, taken, refused):
    """A sampling field takes a value at its limit and refuses one past it (or of a wrong type), naming the field."""
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), field: taken})]
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        with pytest.raises(InvalidRequest, match=f"^{field}: expected"):
            backend.stream_chat({**body(16, 4), field: refused})


# Values of another type that vLLM 0.32's server reads as its request model's type (pydantic's
# lax mode), each answered 200 there, and values of the kind it refuses with a 400 (seen on the
# CPU server with the tiny model).
LAX_TAKEN = [
    ("temperature", "0.5"), ("temperature", True), ("temperature", " 0.5"), ("top_p", "1"), ("presence_penalty", True),
    ("repetition_penalty", "1.1"), ("seed", "5"), ("seed", 5.0), ("seed", "5.0"), ("seed", " 5 "), ("seed", True),
    ("top_k", "2"), ("top_k", True), ("top_k", 2.0), ("min_tokens", "1"), ("min_tokens", 1.0), ("min_tokens", True),
    ("stop_token_ids", [1.0, "1", True]), ("prompt_logprobs", False), ("prompt_logprobs", 0.0),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("ignore_eos", "off"), ("ignore_eos", 0.0), ("n", "1"), ("n", 1.0), ("priority", "5"), ("priority", True), ("priority", 2.0),
]  # fmt: skip
LAX_REFUSED = [("priority", 2.7), ("seed", 5.5), ("seed", 2**63), ("ignore_eos", 5), ("stop_token_ids", 5), ("temperature", "inf"), ("min_p", "nan"), ("top_k", "two")]


@pytest.mark.parametrize(("field", "value"), LAX_TAKEN)
async def test_a_sampling_value_vllms_server_reads_as_its_type_is_taken(field, value):
    """temperature "0.5", seed "5", top_k 2.0, ignore_eos "yes": vLLM's server takes them, and
    the sim refused them, so an agent that worked there failed on the sim."""
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), field: value})]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("field", "value"), LAX_REFUSED)
async def test_a_sampling_value_vllms_server_cannot_read_is_refused_naming_the_field(field, value):
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{field}: expected"):
            backend.stream_chat({**body(16, 4), field: value})


async def test_min_tokens_given_as_text_holds_a_stop_string_back_as_a_number_does():
    """A min_tokens of "3" (vLLM reads it as 3) keeps a stop string from ending the answer sooner."""
    async with SimBackend(flat()) as backend:
        answers = [(await backend.complete_chat({**body(16, 8), "stop": "tok", "min_tokens": m}))[0] for m in (3, "3")]
    assert answers[0]["usage"] == answers[1]["usage"] and answers[0]["usage"]["completion_tokens"] == 3


async def test_top_logprobs_must_be_whole_and_needs_logprobs_only_above_0():
    """top_logprobs of 2.5 is refused naming top_logprobs; 0 is taken without logprobs."""
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match="^top_logprobs: expected an integer"):
            backend.stream_chat({**body(16, 4), "logprobs": True, "top_logprobs": 2.5})
        response, _ = await backend.complete_chat({**body(16, 4), "top_logprobs": 0})
        assert response["usage"]["completion_tokens"] == 4 and response["choices"][0]["logprobs"] is None


async def test_a_fractional_logit_bias_and_a_structural_tag_of_structures_are_taken():
    """A fractional logit bias, and a structural tag in its older form (structures and triggers), are taken."""
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": OBJECT_SCHEMA, "end": "</a>"}], "triggers": ["<a>"]}
    async with SimBackend(flat()) as backend:
        for extra in ({"logit_bias": {"50": 0.5}}, {"response_format": tag}):
            chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), **extra})]
            assert chunks[-1]["usage"]["completion_tokens"] == 4, extra


def test_a_logit_bias_below_minus_100_is_clamped_as_vllm_clamps_it():
    """A logit bias under -100 reaches the engine as -100."""
    assert constraint_params({"logit_bias": {"7": -1000, "8": "-inf"}}) == {"logit_bias": {7: -100.0, 8: -100.0}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT_SCHEMA, "description": 5}}}, "response_format.json_schema.description"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ],
)  # fmt: skip
async def test_constraint_fields_of_the_wrong_type_are_refused_naming_the_field(extra, field):
    """A schema description that is no string, and a regex that is no string, are refused naming the field."""
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}: expected a string"):
            backend.stream_chat({**body(16, 4), **extra})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"watermarking": "maybe"}, "watermarking"), ({"media_io_kwargs": {"video": {"num_frames": 4}}}, "media_io_kwargs"),
        ({"cache_salt": "a@b"}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"), ({"vllm_xargs": [1]}, "vllm_xargs"),
        ({"repetition_detection": {"max_pattern_size": -1, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ],
)  # fmt: skip
async def test_more_chat_options_vllm_refuses_are_refused_naming_the_field(extra, field):
    """A watermarking that is no flag, per-call media options, a salt with @ or of no string, xargs of no object and a negative pattern size are refused, naming the field."""
    async with SimBackend(flat()) as backend:
        with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}: "):
            backend.stream_chat({**body(16, 4), **extra})


async def test_repetition_detection_takes_equal_sizes_and_a_count_of_2():
    """Repetition detection with its minimum pattern size equal to its maximum and a count of 2 is taken."""
    detection = {"max_pattern_size": 2, "min_pattern_size": 2, "min_count": 2}
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 4), "repetition_detection": detection})]
        assert chunks[-1]["usage"]["completion_tokens"] == 4


async def forced_arguments(properties: dict, required: list) -> dict:
    """The arguments the sim answers for a tool of these parameters that the call requires."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties, "required": required}}}
    async with SimBackend(flat()) as backend:
        response, _ = await backend.complete_chat({**body(16, 400), "tools": [tool], "tool_choice": "required"})
    return json.loads(response["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


async def test_a_forced_call_fills_unions_empty_enums_and_untyped_objects():
    """A oneOf takes its first option, an empty enum its type's empty value, and properties without a type make an object."""
    properties = {
        "n": {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s": {"type": "string", "enum": []},
        "o": {"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    }  # fmt: skip
    assert await forced_arguments(properties, ["n", "s", "o"]) == {"n": 0, "s": "", "o": {"a": False}}


async def test_a_forced_call_of_a_schema_that_refers_to_itself_nests_8_deep():
    """A schema that refers to itself is answered with its objects nested 8 deep, then empty."""
    node: dict = {"type": "object", "properties": {}, "required": ["child"]}
    node["properties"]["child"] = node
    arguments, depth = await forced_arguments({"child": node}, ["child"]), 0
    while arguments:
        arguments, depth = arguments["child"], depth + 1
    assert depth == 8


async def test_a_forced_calls_first_streamed_delta_names_its_id_and_type():
    """The first streamed delta of a forced call carries its id and type "function", as the collected answer does."""
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 40), "tools": [TOOL], "tool_choice": "required"})]
    (first,) = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert first["type"] == "function" and first["id"] == collect_chat(chunks)["choices"][0]["message"]["tool_calls"][0]["id"]


async def test_a_stream_with_usage_on_every_chunk_collects_to_its_last_usage():
    """Collected, a stream with usage on every chunk has its last chunk's usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with SimBackend(flat(stream_interval=4)) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 10), "stream_options": options})]
    assert collect_chat(chunks)["usage"] == {"prompt_tokens": 16, "completion_tokens": 10, "total_tokens": 26}


async def test_a_stream_cut_before_its_end_collects_to_one_choice_ending_stop():
    """Collected, a stream cut before its finish reason (or before any chunk) still has one choice, ending "stop"."""
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat(body(16, 4))]
    for cut in (chunks[:2], []):
        (choice,) = collect_chat(cut)["choices"]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "".join(c["choices"][0]["delta"]["content"] for c in cut)


async def test_a_streamed_forced_call_collects_to_a_call_with_no_content_and_counts_as_output():
    """A streamed forced call collects to its call (its id kept) with content null, and each of its chunks counts as output received."""
    async with SimBackend(flat()) as backend:
        chunks = [chunk async for chunk in backend.stream_chat({**body(16, 40), "tools": [TOOL], "tool_choice": "required"})]
    (call,) = collect_chat(chunks)["choices"][0]["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and collect_chat(chunks)["choices"][0]["message"]["content"] is None
    assert output_so_far(chunks[1], 0) == 1 and "tool_calls" in chunks[1]["choices"][0]["delta"]


def test_the_output_received_never_falls_when_a_chunk_says_less():
    """The output counted so far stays where it was when a chunk's usage says less."""
    assert output_so_far({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, 5) == 5


async def test_the_largest_max_tokens_is_refused_only_as_past_the_context():
    """A max_tokens of 2**31 - 1 is a count: the sim refuses it as longer than the model's context (ContextTooLong), naming max_tokens."""
    async with SimBackend(flat()) as backend:
        with pytest.raises(ContextTooLong, match="^max_tokens=2147483647 cannot be greater") as info:
            backend.stream_chat(body(16, 2**31 - 1))
    assert info.value.param == "max_tokens"


async def test_a_max_tokens_as_long_as_the_context_is_cut_not_refused():
    """A max_tokens equal to the model's context is cut to what the prompt leaves; one past it is ContextTooLong."""
    async with SimBackend(flat(max_model_len=256, kv_cache_tokens=1024)) as backend:
        response, _ = await backend.complete_chat(body(250, 256))
        assert response["usage"]["completion_tokens"] == 6 and response["choices"][0]["finish_reason"] == "length"
        with pytest.raises(ContextTooLong, match="^max_tokens=257 cannot be greater"):
            backend.stream_chat(body(16, 257))
