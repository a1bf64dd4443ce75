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
    engine = SimEngine(SimSettings(max_num_batched_tokens=64, block_size=16, kv_cache_tokens=4096))
    a = engine.new_request(10, 5, [])
    step = engine.schedule()
    assert step is not None and step[1] == [10]
    engine.complete(*step)
    assert a.num_output == 1
    b = engine.new_request(200, 5, [])
    counts = []
    while b.num_output == 0:
        step = engine.schedule()
        assert step is not None
        counts.append(step[1])
        engine.complete(*step)
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
        engine.complete(*step)
    assert a.num_output == b.num_output == 20
    assert engine.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert engine.pool.usage == 0.0
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
    pending = [r for r in requests if -(-(r[0] + r[1]) // bs) <= kv_blocks]  # the backend refuses the rest
    live = []
    step = 0
    while pending or engine.has_work:
        if pending and step % 2 == 0:
            prompt, out, priority, prefix, abort = pending.pop()
            hashes = [prefix * 1000 + i for i in range(prompt // bs)]  # same prefix id: same blocks
            live.append((engine.new_request(prompt, out, hashes, priority), abort))
        if step % 5 == 3:
            for request, abort in live:
                if abort and not request.done:
                    engine.abort(request)
                    break
        planned = engine.schedule()
        if planned is not None:
            requests_, counts, _ = planned
            assert sum(counts) <= budget and len(engine.running) <= max_seqs
            assert len(set(requests_)) == len(requests_)
            engine.complete(*planned)
        engine.pool.check()
        step += 1
        assert step < 10_000
    for request, _ in live:
        assert request.done and not request.blocks
        if request.status == FINISHED:
            assert request.num_output == request.max_tokens
    assert engine.pool.usage == 0.0
