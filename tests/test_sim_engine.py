"""The simulated engine's synchronous core: block pool, queue policies, scheduler steps. No event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetsched.backends.sim import BlockPool, FcfsQueue, PriorityQueue, SimEngine, SimRequest, make_queue
from fleetsched.backends.sim._engine import FINISHED
from fleetsched.backends.sim._kv_cache import block_hashes, prompt_text
from fleetsched.settings import SimSettings


def test_pool_allocates_frees_and_keeps_invariants():
    pool = BlockPool(8, 16)
    a: list[int] = []
    pool.allocate(5, a)
    assert pool.num_free == 3 and pool.usage == pytest.approx(5 / 8)
    pool.free(a)
    assert pool.num_free == 8 and pool.usage == 0.0
    pool.check()


def test_pool_cached_blocks_survive_free_and_are_evicted_lru_tail_first():
    pool = BlockPool(4, 16)
    a: list[int] = []
    pool.allocate(2, a)
    pool.cache(a[0], 101)
    pool.cache(a[1], 102)
    pool.free(a)  # a[1] (the tail) joins the queue before a[0]
    assert pool.lookup([101, 102], 2) == a
    b: list[int] = []
    pool.allocate(3, b)  # two never-used blocks, then the LRU cached one: the chain's tail
    assert a[1] in b and pool.lookup([101, 102], 2) == [a[0]]
    pool.check()


def test_pool_touch_takes_cached_blocks_off_the_free_queue():
    pool = BlockPool(4, 16)
    a: list[int] = []
    pool.allocate(1, a)
    pool.cache(a[0], 7)
    pool.free(a)
    hits = pool.lookup([7], 1)
    assert pool.num_evictable(hits) == 1
    pool.touch(hits)
    assert pool.num_free == 3
    pool.check()


def test_block_hashes_chain_over_full_blocks_only():
    text = prompt_text([{"role": "user", "content": "a" * 200}])
    same = block_hashes(text, 16, len(text) // 4)
    assert len(same) == len(text) // 4 // 16
    other = block_hashes(prompt_text([{"role": "user", "content": "b" + "a" * 199}]), 16, len(text) // 4)
    assert not set(same) & set(other)  # a change in block 0 changes every later hash


def test_queue_policies_order_and_victims():
    reqs = [SimRequest(i, 10, 10, [], priority=p) for i, p in enumerate([0, 5, -10, 0], start=1)]
    fcfs, prio = FcfsQueue(), PriorityQueue()
    for r in reqs:
        fcfs.add(r)
        prio.add(r)
    assert [fcfs.pop().seq for _ in range(4)] == [1, 2, 3, 4]
    assert [prio.pop().seq for _ in range(4)] == [3, 1, 4, 2]
    assert FcfsQueue.victim(reqs).seq == 4
    assert PriorityQueue.victim(reqs).seq == 2  # highest value (lowest priority), then latest
    with pytest.raises(ValueError, match="policy"):
        make_queue("lifo")  # type: ignore[arg-type]


def test_running_requests_go_first_and_prefill_is_chunked():
    engine = SimEngine(SimSettings(max_num_batched_tokens=64, max_num_seqs=16, block_size=16, kv_cache_tokens=4096), coast=False)
    a = engine.new_request(10, 5, [])
    step = engine.schedule()
    assert step is not None and step.counts == [10]
    engine.complete(step)
    assert a.num_output == 1
    b = engine.new_request(200, 5, [])
    counts = []
    while b.num_output == 0:
        step = engine.schedule()
        assert step is not None
        counts.append(step.counts)
        engine.complete(step)
    # a decodes 1 token a step (until it finishes); b's prompt fills the rest of the budget.
    assert counts == [[1, 63], [1, 63], [1, 63], [1, 11]]
    assert engine.prompt_computed == 210
    engine.pool.check()


def test_preempted_request_recomputes_prompt_and_output():
    engine = SimEngine(SimSettings(block_size=16, kv_cache_tokens=64, policy="fcfs"))
    a = engine.new_request(30, 20, [])
    b = engine.new_request(30, 20, [])
    while engine.has_work:
        step = engine.schedule()
        assert step is not None
        engine.complete(step)
    assert a.num_output == b.num_output == 20
    assert engine.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert engine.pool.usage == 0.0
    engine.pool.check()


@pytest.mark.parametrize("coast", [False, True])
def test_a_request_that_is_its_own_victim_leaves_the_engine_busy_not_idle(coast):
    """Priority policy: a, of the worse priority, runs first in running order; when it needs a
    block and none is free, it is its own victim, and nothing was scheduled. schedule() said
    None (idle) with b still running: the sim backend's loop then waited for an arrival, and
    both calls hung. vLLM steps again at once and runs b."""
    engine = SimEngine(SimSettings(policy="priority", block_size=4, kv_cache_tokens=32), coast=coast)
    a = engine.new_request(8, 20, [], priority=1)
    engine.complete(engine.schedule())
    b = engine.new_request(8, 20, [], priority=0)
    while (step := engine.schedule()) is not None:
        engine.complete(step)
    assert not engine.has_work and a.num_output == b.num_output == 20
    assert (a.num_preemptions, b.num_preemptions) == (1, 0)
    engine.pool.check()


def test_a_preempted_request_hits_the_blocks_of_its_own_answer_when_it_resumes():
    """Blocks its answer filled are hashed when a preemption frees them, as vLLM hashes every
    full block: resumed, the request recomputes only what was evicted meanwhile."""
    engine = SimEngine(SimSettings(block_size=16, kv_cache_tokens=128, policy="fcfs"), coast=False)
    a = engine.new_request(16, 60, block_hashes("a" * 64, 16, 16), text="a" * 64)
    b = engine.new_request(16, 60, block_hashes("b" * 64, 16, 16), text="b" * 64)
    while (step := engine.schedule()) is not None:
        engine.complete(step)
    assert (a.num_preemptions, b.num_preemptions, engine.finished) == (0, 1, 2)
    # b was preempted with 64 tokens computed (4 full blocks: its prompt's and 3 of its answer's);
    # a's next block evicted the last. Resumed at 65 tokens, b hit 3 blocks and recomputed 17
    # (65 - 16 without its answer's blocks). Prompts: 16 + 16.
    assert engine.prompt_computed == 16 + 16 + 17
    engine.pool.check()


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    kv_blocks=st.integers(6, 40),
    budget=st.integers(8, 128),
    max_seqs=st.integers(1, 8),
    requests=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(-2, 2), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=12,
    ),
)
def test_random_workloads_keep_invariants_and_finish(policy, kv_blocks, budget, max_seqs, requests):
    """Random arrivals, shared prefixes, aborts and a small cache: invariants hold at every step."""
    bs = 8
    engine = SimEngine(
        SimSettings(policy=policy, block_size=bs, kv_cache_tokens=kv_blocks * bs, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    )
    pending = [r for r in requests if -(-(r[0] + r[1] - 1) // bs) <= kv_blocks]  # the backend refuses the rest
    live = []
    step = 0
    while pending or engine.has_work:
        if pending and step % 2 == 0:
            prompt, out, priority, prefix, abort = pending.pop()
            hashes = [prefix * 1000 + i for i in range(prompt // bs)]  # same prefix id: same blocks
            text = str(prefix) * 4 * prompt  # with it the blocks of the answer are cached too
            live.append((engine.new_request(prompt, out, hashes, priority, text=text), abort))
        if step % 5 == 3:
            for request, abort in live:
                if abort and not request.done:
                    engine.abort(request)
                    break
        planned = engine.schedule()
        if planned is not None:
            assert planned.tokens <= budget and len(engine.running) <= max_seqs
            assert len(set(planned.requests)) == len(planned.requests)
            engine.complete(planned)
        else:  # idle, as the backend takes it: nothing left to run (it hung on a request its own victim)
            assert not engine.has_work
        engine.pool.check()
        step += 1
        assert step < 10_000
    for request, _ in live:
        assert request.done and not request.blocks
        if request.status == FINISHED:
            assert request.num_output == request.max_tokens
    assert engine.pool.usage == 0.0


def _trace(coast: bool, policy, kv_blocks, budget, max_seqs, requests, wake_every, lag):
    """Drive an engine as the backend does, with consumers that wait, wake and lag; record everything.

    A glide is gone through step by step as the backend's `_settle` would: the steps done are
    applied (`advance`) before anything happens in it, and anything that happens ends it at the
    step under way (an arrival or abort at a step boundary, a consumer's `watch`).
    """
    bs = 8
    engine = SimEngine(
        SimSettings(policy=policy, block_size=bs, kv_cache_tokens=kv_blocks * bs, max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        coast=coast,
    )
    engine.MIN_GLIDE = 2  # glide whenever it can
    pending = [r for r in requests if -(-(r[0] + r[1] - 1) // bs) <= kv_blocks]
    live: list = []
    waking: dict = {}  # request -> steps before its consumer runs again
    events = []
    n = 0

    def happens_at(m: int) -> bool:  # an arrival or an abort comes before step m
        return (bool(pending) and m % 3 == 0) or m % 7 == 5

    while pending or engine.has_work:
        if pending and n % 3 == 0:
            prompt, out, priority, prefix, abort = pending.pop()
            hashes = [prefix * 1000 + i for i in range(prompt // bs)]
            request = engine.new_request(prompt, out, hashes, priority, text=str(prefix) * 4 * prompt)
            request.wake_every = wake_every
            request.waiter = "parked"
            live.append((request, abort))
        if n % 7 == 5:
            for request, abort in live:
                if abort and not request.done:
                    engine.abort(request)
                    events.append((n, "abort", request.seq, request.num_output))
                    break
        step = engine.schedule()
        if step is None:
            n += 1
            continue
        assert coast or step.repeat == 1
        first = engine.steps
        end = step.repeat  # steps of this glide (1: a plain step)
        i = 0
        while True:
            events.append((n, "step", step.tokens, step.seqs, step.context, round(step.duration, 9)))
            # Consumers run while the step is under way.
            for request in list(waking):
                waking[request] -= 1
                if waking[request] < 0:
                    del waking[request]
                    request.delivered = request.num_output
                    if not request.done:
                        until = engine.watch(request)
                        if until is not None:
                            end = min(end, until - first)
                        request.waiter = "parked"
            if i + 1 >= end or happens_at(n + 1):
                break
            engine.advance(step, 1)
            i += 1
            n += 1
        for request in engine.complete(step):
            if request.waiter is not None and (
                request.num_output - request.delivered >= request.wake_every or request.delivered == 0 or request.status == FINISHED
            ):
                request.waiter = None
                waking[request] = lag
                events.append((n, "wake", request.seq, request.num_output, request.status))
        n += 1
        assert n < 20_000
    counters = (engine.generated_tokens, engine.computed_tokens, engine.prompt_computed, engine.preemptions, engine.prefix_hits, engine.finished, engine.aborted)
    engine.pool.check()
    return events, counters


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    kv_blocks=st.integers(6, 60),
    budget=st.integers(8, 160),
    max_seqs=st.integers(1, 10),
    requests=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(-2, 2), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=14,
    ),
    wake_every=st.integers(1, 12),
    lag=st.integers(0, 3),
)
def test_coasting_changes_nothing_but_the_work(policy, kv_blocks, budget, max_seqs, requests, wake_every, lag):
    """Coasting requests are not looked at every step and glides are slept through at once, yet every
    step, wake-up and counter is the same."""
    reference = _trace(False, policy, kv_blocks, budget, max_seqs, requests, wake_every, lag)
    coasting = _trace(True, policy, kv_blocks, budget, max_seqs, requests, wake_every, lag)
    assert coasting == reference


def test_coasting_looks_at_few_requests_a_step():
    """A batch of long decodes: most steps look at only the requests that need something."""
    engine = SimEngine(SimSettings(block_size=16, kv_cache_tokens=1 << 16, max_num_seqs=64, max_num_batched_tokens=4096))
    for i in range(64):
        engine.new_request(32, 200, [], 0)
    looked_at = []
    schedules = 0
    while (step := engine.schedule()) is not None:
        schedules += 1
        looked_at.append(len(step.requests))
        engine.complete(step, step.repeat)
    assert engine.finished == 64 and engine.generated_tokens == 64 * 200
    # Each request is looked at when it needs a block (every 16 tokens), at its last token and in prefill.
    assert sum(looked_at) <= 64 * (200 // 16 + 4)
    assert sum(looked_at) < engine.steps * 64 / 8
    # The steps in between are glided through: one schedule covers many steps.
    assert schedules < engine.steps / 2


def test_pool_reuses_blocks_without_a_hash_first_and_keeps_cached_ones():
    """vLLM's ``BlockPool.free_blocks`` puts a freed block that caches nothing at the front of the
    free queue (reused first) and a cached one at the end (evicted last, LRU)."""
    pool = BlockPool(3, 16)
    a: list[int] = []
    pool.allocate(1, a)
    pool.cache(a[0], 101)
    pool.free(a)  # cached: the end of the queue
    b: list[int] = []
    pool.allocate(2, b)  # the two never-used blocks
    pool.free(b)  # they cache nothing: the front of the queue
    c: list[int] = []
    pool.allocate(1, c)
    assert c[0] in b and pool.lookup([101], 1) == a
    pool.check()


def test_pool_keeps_every_block_cached_under_a_hash_and_hits_the_oldest_left():
    """Two requests that computed the same prompt block each cache it (vLLM's
    ``BlockHashToBlockMap`` keeps both): when the first copy is evicted, the second still hits."""
    pool = BlockPool(4, 16)
    a: list[int] = []
    b: list[int] = []
    pool.allocate(1, a)
    pool.allocate(1, b)
    pool.cache(a[0], 7)
    pool.cache(b[0], 7)
    assert pool.lookup([7], 1) == a  # the first cached
    pool.free(a)
    c: list[int] = []
    pool.allocate(3, c)  # evicts a's copy
    assert a[0] in c and pool.lookup([7], 1) == b
    pool.free(b)
    pool.free(c)
    pool.allocate(4, [])  # evicts b's copy too
    assert pool.lookup([7], 1) == []
    pool.check()


def test_prefix_cache_counters_leave_out_preempted_requests_as_vllm_does():
    """vLLM's ``vllm:prefix_cache_queries``/``hits`` count a request's lookup when it is first
    admitted; a preempted request's lookup on resuming goes to separate preempted counters."""
    bs = 16
    engine = SimEngine(SimSettings(block_size=bs, kv_cache_tokens=64, policy="fcfs"))
    a = engine.new_request(32, 20, [1, 2])
    b = engine.new_request(32, 20, [3, 4])
    while engine.has_work:
        step = engine.schedule()
        assert step is not None
        engine.complete(step)
    assert b.num_preemptions >= 1
    assert engine.prefix_queries == 64 and engine.prefix_hits == 0


def test_a_one_token_chunk_of_a_recompute_counts_as_prefill():
    """A preempted request recomputes its prompt and output in chunks; a chunk the budget cuts to
    one token inside its output is still recomputation (prompt_computed), not a decode: only the
    token computed right after it was sampled is."""
    engine = SimEngine(
        SimSettings(block_size=4, kv_cache_tokens=16, max_num_batched_tokens=2, max_num_seqs=2, policy="fcfs"),
        coast=False,
    )
    engine.new_request(2, 14, [])
    engine.new_request(2, 14, [])
    decodes = 0
    while (step := engine.schedule()) is not None:
        for request, n in zip(step.requests, step.counts):
            decodes += n == 1 and request.num_output > 0 and request.num_computed == request.prompt_tokens + request.num_output - 1
        engine.complete(step)
    assert engine.preemptions > 0 and engine.finished == 2
    assert engine.prompt_computed == engine.computed_tokens - decodes


def test_a_request_is_admitted_only_when_its_whole_prompt_fits():
    """vLLM 0.32 admits a waiting request only when the blocks of its whole sequence are free
    (`scheduler_reserve_full_isl`). The sim admitted it when its first chunk fit: B (13 blocks
    of prompt, 7 free) started beside A, stalled at its next chunk and was preempted. Checked
    against vLLM's own Scheduler, step by step: A alone until it ends, then B."""
    engine = SimEngine(SimSettings(block_size=16, kv_cache_tokens=20 * 16, max_num_batched_tokens=128, max_model_len=1024), coast=False)
    a = engine.new_request(200, 40, [hash(("a", i)) for i in range(12)])
    b = engine.new_request(200, 10, [hash(("b", i)) for i in range(12)])
    steps = []
    while engine.running or engine.queue:
        step = engine.schedule()
        steps.append({("a" if r is a else "b"): n for r, n in zip(step.requests, step.counts)})
        engine.complete(step)
    assert steps[:3] == [{"a": 128}, {"a": 72}, {"a": 1}]
    assert engine.preemptions == 0
    assert steps.index({"b": 128}) == steps.index({"a": 1}) + 39  # when a has ended


def test_a_preempted_request_goes_back_ahead_of_those_that_never_ran():
    """fcfs: a preempted request goes back to the head of the waiting queue (vLLM's
    ``prepend_request``), so a request that arrived after it cannot overtake it. Queued at the
    tail, b (preempted when a needed a block) let c, which arrived last, start while a ran alone."""
    engine = SimEngine(SimSettings(policy="fcfs", block_size=4, kv_cache_tokens=32, max_num_seqs=2), coast=False)
    a = engine.new_request(8, 13, [])
    b = engine.new_request(8, 13, [])
    c = engine.new_request(4, 2, [])
    names = {a: "a", b: "b", c: "c"}
    steps = []
    while (step := engine.schedule()) is not None:
        steps.append({names[r]: n for r, n in zip(step.requests, step.counts)})
        engine.complete(step)
    assert (a.num_preemptions, b.num_preemptions, engine.finished) == (0, 1, 3)
    # b was preempted at its 9th token and waits at the head, too big to fit beside a: c waits behind it.
    assert steps[8:14] == [{"a": 1, "b": 1}, {"a": 1}, {"a": 1}, {"a": 1}, {"a": 1}, {"b": 17, "c": 4}]
    engine.pool.check()


def test_under_priority_the_latest_of_equal_priority_is_preempted():
    """Priority policy, the same priority: the victim is the latest to arrive (vLLM's max over
    (priority, arrival)), so the request that came first keeps its blocks. Picking the earliest
    preempted a, which had been running longest, and let b run on."""
    engine = SimEngine(SimSettings(block_size=16, kv_cache_tokens=64, policy="priority"), coast=False)
    a = engine.new_request(30, 20, [], priority=0)
    b = engine.new_request(30, 20, [], priority=0)
    while (step := engine.schedule()) is not None:
        engine.complete(step)
    assert (a.num_preemptions, b.num_preemptions, engine.finished) == (0, 1, 2)
    engine.pool.check()


def test_a_step_that_preempts_admits_no_waiting_request():
    """As vLLM's scheduler: a step that preempted schedules no waiting request, even one that
    fits; it is admitted at the next step. c, arriving as a's next block made b its victim, was
    admitted in that very step."""
    engine = SimEngine(SimSettings(policy="priority", block_size=4, kv_cache_tokens=32, max_num_seqs=3), coast=False)
    a = engine.new_request(8, 20, [], priority=0)
    b = engine.new_request(8, 20, [], priority=1)
    names = {a: "a", b: "b"}
    steps = []
    while (step := engine.schedule()) is not None:
        steps.append({names[r]: n for r, n in zip(step.requests, step.counts)})
        engine.complete(step)
        if a.num_computed == 16 and len(names) == 2:  # the cache is full: a's next token needs a block
            names[engine.new_request(4, 2, [], priority=0)] = "c"
    assert (a.num_preemptions, b.num_preemptions, engine.finished) == (0, 1, 3)
    assert steps[8:12] == [{"a": 1, "b": 1}, {"a": 1}, {"a": 1, "c": 4}, {"a": 1, "c": 1}]
    engine.pool.check()


def test_pool_hits_the_oldest_copy_left_when_the_oldest_is_evicted():
    """Three blocks cache the same hash: once the oldest is evicted, a lookup finds the oldest of
    the two left (vLLM's ``BlockHashToBlockMap`` keeps them in the order cached), not the newest."""
    pool = BlockPool(4, 16)
    a: list[int] = []
    b: list[int] = []
    c: list[int] = []
    for blocks in (a, b, c):
        pool.allocate(1, blocks)
        pool.cache(blocks[0], 7)
    pool.free(a)
    pool.allocate(2, [])  # the never-used block, then a's copy
    assert pool.lookup([7], 1) == b
    pool.check()


def test_pool_lookup_hits_only_a_prefix_of_the_hashes():
    """A hit is the longest cached prefix: a cached block after one that is not is no hit (its
    request would skip computing the block before it)."""
    pool = BlockPool(4, 16)
    a: list[int] = []
    pool.allocate(2, a)
    pool.cache(a[1], 102)
    assert pool.lookup([101, 102], 2) == []
    pool.cache(a[0], 101)
    assert pool.lookup([101, 102, 103], 3) == a
    pool.check()


def test_a_prompt_block_only_partly_computed_is_no_prefix_hit():
    """A prompt block is cached once a chunk covers it in full, not before. a's first chunk (cut
    by the budget to 3 tokens) ends inside its first block; preempted at its next chunk, a must
    recompute that block on resuming. Hashed as soon as it was begun, it was a hit: a resumed at
    6 tokens of 10, and skipped a token it never computed."""
    bs = 4
    engine = SimEngine(SimSettings(policy="fcfs", block_size=bs, kv_cache_tokens=4 * bs, max_num_batched_tokens=7, max_num_seqs=4), coast=False)
    r = engine.new_request(4, 6, [hash(("r", 0))])
    a = engine.new_request(10, 2, [hash(("a", i)) for i in range(2)])
    counts = []
    while (step := engine.schedule()) is not None:
        counts.append(step.counts)
        engine.complete(step)
    assert (r.num_preemptions, a.num_preemptions, engine.finished) == (0, 1, 2)
    assert counts == [[4, 3], [1], [1], [1], [1], [1], [7], [3], [1]]
    assert engine.prompt_computed == 4 + 3 + 10
    engine.pool.check()
