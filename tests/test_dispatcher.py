"""The dispatcher's window and call order, on virtual time against a slow fake engine.

`SlowBackend` stands in for an engine only to make calls take a known time; everything under
test (window, order, fairness, cancellation) is the real dispatcher.
"""

from __future__ import annotations

import re
from collections import Counter
from decimal import Decimal
from functools import partial

import anyio
import pytest
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetsched.backends.base import Backend, estimate_prompt_tokens, make_chunk, usage_dict
from fleetsched.errors import BackendUnavailable, DeadlineExceeded, InvalidRequest
from fleetsched.policies.tiers import Tier
from fleetsched.resources.ratelimit import RateLimit, TenantRateLimits
from fleetsched.scheduler import Dispatcher

from .helpers import virtual_loop

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    """Both loops on virtual time: a waiting call parks differently on each (see `_parking`)."""
    return virtual_loop(request.param)


class SlowBackend(Backend):
    """Each call takes `seconds` and yields one token chunk; records the order calls started."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self.started: list[str] = []
        self.aborted = 0

    async def stream_chat(self, body):
        self.started.append(body["messages"][0]["content"])
        try:
            await anyio.sleep(self.seconds)
            yield make_chunk("c", "m", 0, role="assistant", content="x")
            yield make_chunk("c", "m", 0, finish_reason="stop", usage=usage_dict(10, int(body.get("max_tokens", 1))))
        except BaseException:
            self.aborted += 1
            raise


def body(label: str, max_tokens: int = 1) -> dict:
    return {"messages": [{"role": "user", "content": label}], "max_tokens": max_tokens}


async def test_window_caps_calls_in_flight_and_tiers_reorder_the_rest():
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("first"), tenant="a", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        for label, tier in (("batch", Tier.BATCH), ("standard", Tier.STANDARD), ("critical", Tier.CRITICAL)):
            tg.start_soon(partial(dispatcher.chat, body(label), tenant=label, tier=tier))
        await anyio.sleep(0.1)
        stats = dispatcher.statistics()
        assert stats.in_flight == 1 and stats.queued == 3
    assert backend.started == ["first", "critical", "standard", "batch"]
    assert anyio.current_time() == 4.0
    finished = {r.tenant: r.finished for r in dispatcher.recorder.calls}
    assert finished == {"a": 1.0, "critical": 2.0, "standard": 3.0, "batch": 4.0}


async def test_tier_is_passed_on_as_priority():
    seen = []

    class Spy(SlowBackend):
        async def stream_chat(self, body):
            seen.append(body["priority"])
            async for chunk in super().stream_chat(body):
                yield chunk

    dispatcher = Dispatcher(Spy(0.0), window=4)
    await dispatcher.chat(body("x"), tenant="a", tier=Tier.CRITICAL)
    await dispatcher.chat(body("y"), tenant="a", tier=Tier.BATCH)
    assert seen == [0, 2]


async def test_backlogged_tenants_share_by_weighted_tokens():
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, weights={"gold": 2.0, "tin": 1.0})
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("warmup"), tenant="x", tier=1))
        await anyio.sleep(0.1)
        for _ in range(30):
            tg.start_soon(partial(dispatcher.chat, body("gold", 50), tenant="gold", tier=1))
            tg.start_soon(partial(dispatcher.chat, body("tin", 50), tenant="tin", tier=1))
    first_half = Counter(backend.started[1:31])
    # Twice the weight, twice the calls of equal size while both are backlogged (+-1 call).
    assert abs(first_half["gold"] - 2 * first_half["tin"]) <= 3


@pytest.mark.parametrize("due", ["due", "due_in"])
async def test_a_tenants_queued_calls_go_earliest_due_first(due):
    """`due` (a time) and `due_in` (seconds from the call) order a tenant's queued calls: taken
    as no due at all, the call due soon waited behind the one due later (first come, first served)."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("blocker"), tenant="a", tier=Tier.STANDARD))
        await anyio.sleep(0.1)
        tg.start_soon(partial(dispatcher.chat, body("due later"), tenant="a", tier=Tier.STANDARD, **{due: 10.0}))
        await anyio.sleep(0.1)
        tg.start_soon(partial(dispatcher.chat, body("due soon"), tenant="a", tier=Tier.STANDARD, **{due: 1.0}))
    assert backend.started == ["blocker", "due soon", "due later"]


async def test_cancelled_waiting_call_leaves_no_trace():
    backend = SlowBackend(10.0)
    dispatcher = Dispatcher(backend, window=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("running"), tenant="a", tier=1))
        await anyio.sleep(1)
        with anyio.move_on_after(1):
            await dispatcher.chat(body("gives up"), tenant="b", tier=0)
        assert dispatcher.statistics().queued == 0
        tg.start_soon(partial(dispatcher.chat, body("next"), tenant="c", tier=1))
    assert backend.started == ["running", "next"]
    assert dispatcher.statistics().in_flight == 0


async def test_cancelled_running_call_aborts_at_the_backend_and_frees_its_place():
    backend = SlowBackend(10.0)
    dispatcher = Dispatcher(backend, window=1)
    with anyio.move_on_after(2):
        await dispatcher.chat(body("slow"), tenant="a", tier=1)
    assert backend.aborted == 1
    assert dispatcher.statistics().in_flight == 0
    (record,) = dispatcher.recorder.calls
    assert record.error is not None and record.finished == 2.0


async def test_streaming_observes_time_to_first_token():
    dispatcher = Dispatcher(SlowBackend(3.0), window=2)
    async with dispatcher.stream(body("s"), tenant="a", tier=1) as chunks:
        got = [chunk async for chunk in chunks]
    assert len(got) == 2
    (record,) = dispatcher.recorder.calls
    assert record.ttft_s == 3.0 and record.completion_tokens == 1


async def test_a_collected_call_observes_time_to_first_token_and_usage():
    """`chat` collects through `Backend.complete_chat`; by default that reads `stream_chat`."""
    dispatcher = Dispatcher(SlowBackend(3.0), window=2)
    response = await dispatcher.chat(body("c", max_tokens=4), tenant="a", tier=1)
    assert response["choices"][0]["message"]["content"] == "x" and response["usage"]["completion_tokens"] == 4
    (record,) = dispatcher.recorder.calls
    assert record.ttft_s == 3.0 and (record.prompt_tokens, record.completion_tokens) == (10, 4)


async def test_call_after_the_session_deadline_is_refused():
    backend = SlowBackend(0.0)
    dispatcher = Dispatcher(backend, window=1)
    await anyio.sleep(5)
    with pytest.raises(DeadlineExceeded, match="after its deadline"):
        await dispatcher.chat(body("late"), tenant="a", tier=1, deadline=4.0)
    assert backend.started == [] and dispatcher.statistics().in_flight == 0


def test_invalid_window():
    with pytest.raises(ValueError, match="window must be >= 1"):
        Dispatcher(SlowBackend(), window=0)


class Replicated(SlowBackend):
    """Two named replicas; 'down' refuses every call like an unreachable server."""

    replicas = {"r0": None, "r1": None, "down": None}

    def __init__(self) -> None:
        super().__init__(0.0)
        self.served_by: list[str | None] = []

    async def stream_chat(self, body):
        replica = body.get("fleetsched_replica")
        if replica == "down":
            from fleetsched.errors import BackendUnavailable

            raise BackendUnavailable("replica down")
        self.served_by.append(replica)
        async for chunk in super().stream_chat(body):
            yield chunk


async def test_calls_follow_their_replica_and_fall_back_when_it_is_down():
    backend = Replicated()
    dispatcher = Dispatcher(backend, window=4)
    await dispatcher.chat(body("a"), tenant="t", tier=1, replica="r1")
    await dispatcher.chat(body("b"), tenant="t", tier=1, replica="down")
    await dispatcher.chat(body("c"), tenant="t", tier=1, replica="gpu-not-a-replica")
    async with dispatcher.stream(body("d"), tenant="t", tier=1, replica="r0") as chunks:
        assert len([c async for c in chunks]) == 2
    # r1 by affinity; 'down' fell back to the backend's own choice; an unknown name is ignored.
    assert backend.served_by == ["r1", None, None, "r0"]
    assert dispatcher.statistics().in_flight == 0


class Refusing(SlowBackend):
    """Refuses every body when the stream is made, as the sim backend refuses a context too long."""

    def stream_chat(self, body):
        raise ValueError("context too long")


async def test_call_the_backend_refuses_at_once_gives_its_place_back():
    dispatcher = Dispatcher(Refusing(), window=1)
    with anyio.fail_after(60):  # with the place kept, the second call would wait for ever
        for _ in range(3):
            with pytest.raises(ValueError, match="too long"):
                await dispatcher.chat(body("x"), tenant="a", tier=1)
            with pytest.raises(ValueError, match="too long"):
                async with dispatcher.stream(body("y"), tenant="a", tier=1):
                    pass
    assert dispatcher.statistics().in_flight == 0
    assert [r.error for r in dispatcher.recorder.calls] == ["ValueError"] * 6


async def test_critical_reserve_keeps_places_for_critical_calls():
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=3, critical_reserve=1)
    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(partial(dispatcher.chat, body(f"batch{i}"), tenant="bulk", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        stats = dispatcher.statistics()
        assert stats.in_flight == 2 and stats.queued == 1  # the third place is kept
        tg.start_soon(partial(dispatcher.chat, body("critical"), tenant="vip", tier=Tier.CRITICAL))
        await anyio.sleep(0.1)
        assert dispatcher.statistics().in_flight == 3  # it took the kept place at once
    assert backend.started[2] == "critical" and len(backend.started) == 4  # the waiting batch call last
    finished = {r.tenant: r.finished for r in dispatcher.recorder.calls if r.tenant == "vip"}
    assert finished == {"vip": 1.1}


async def test_lower_tiers_keep_one_place_when_the_reserve_is_the_whole_window():
    """With `critical_reserve` >= the window, a standard call still goes through, one at a time:
    left no place at all, it waited for ever."""
    dispatcher = Dispatcher(SlowBackend(1.0), window=2, critical_reserve=2)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(partial(dispatcher.chat, body(f"standard{i}"), tenant="a", tier=Tier.STANDARD))
    assert sorted(r.started for r in dispatcher.recorder.calls) == [0.0, 1.0]


async def test_a_place_freed_in_the_reserve_is_kept_for_critical_calls():
    """A critical call in the reserve ends while a batch call waits: lower tiers already fill the
    window but its reserve, so the freed place is not handed to the batch call."""
    backend = SlowBackend(10.0)
    dispatcher = Dispatcher(backend, window=2, critical_reserve=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("batch0"), tenant="bulk", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        backend.seconds = 1.0
        tg.start_soon(partial(dispatcher.chat, body("critical"), tenant="vip", tier=Tier.CRITICAL))
        await anyio.sleep(0.1)
        tg.start_soon(partial(dispatcher.chat, body("batch1"), tenant="bulk", tier=Tier.BATCH))
        await anyio.sleep(2.0)  # the critical call ended at 1.1
        stats = dispatcher.statistics()
        assert stats.in_flight == 1 and stats.queued == 1
    assert [r.started for r in dispatcher.recorder.calls if r.tenant == "bulk"] == [0.0, 10.0]


async def test_a_critical_call_that_ended_leaves_the_reserve_to_the_next_one():
    """The reserve counts the critical calls in flight: once the window shrinks below the calls
    in flight, a critical call still goes in at once, though another critical call used the
    reserve before and ended."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=3, critical_reserve=1)
    await dispatcher.chat(body("critical0"), tenant="vip", tier=Tier.CRITICAL)
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(partial(dispatcher.chat, body(f"batch{i}"), tenant="bulk", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        dispatcher.resize(2)
        await dispatcher.chat(body("critical1"), tenant="vip", tier=Tier.CRITICAL)
    assert [r.started for r in dispatcher.recorder.calls if r.tenant == "vip"] == [0.0, 1.1]


async def test_growing_the_window_starts_queued_calls_at_once():
    """Not only when a call in flight ends."""
    backend = SlowBackend(10.0)
    dispatcher = Dispatcher(backend, window=1)
    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(partial(dispatcher.chat, body(f"call{i}"), tenant="a", tier=Tier.STANDARD))
        await anyio.sleep(1.0)
        dispatcher.resize(3)
    assert sorted(r.started for r in dispatcher.recorder.calls) == [0.0, 1.0, 1.0]


async def test_output_is_charged_as_it_streams():
    """A tenant's counter grows with each chunk its call receives, before the call ends; the
    usage at the end corrects it to the exact count."""

    class Streaming(SlowBackend):
        async def stream_chat(self, body):
            for _ in range(5):
                await anyio.sleep(1.0)
                yield make_chunk("c", "m", 0, content="x")
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 7))

    dispatcher = Dispatcher(Streaming(), window=1)
    queue = dispatcher._queue
    async with dispatcher.stream(body("x"), tenant="a", tier=Tier.BATCH) as chunks:
        start = queue.counter("a")
        seen = 0
        async for chunk in chunks:
            if chunk["choices"][0]["delta"].get("content"):
                seen += 1
                assert queue.counter("a") == start + 2.0 * seen
    # The prompt estimate corrected to the 10 tokens of the usage; 7 output tokens, not the 5 chunks.
    assert queue.counter("a") == 10 * 1.0 + 7 * 2.0


async def test_a_finished_call_is_charged_before_its_place_is_handed_on():
    """Chunks that carry many tokens are charged as one each until the usage at the end corrects
    the count. The correction must land before the freed place is handed on: otherwise the
    tenant whose call just ended looks cheaper than it is and keeps winning the place."""

    class Bulky(SlowBackend):
        async def stream_chat(self, body):
            self.started.append(body["messages"][0]["content"])
            await anyio.sleep(1.0)
            yield make_chunk("c", "m", 0, content="many tokens in one chunk")
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 50))

    backend = Bulky()
    dispatcher = Dispatcher(backend, window=1)

    async def call(tenant: str, i: int) -> None:
        async with dispatcher.stream(body(f"{tenant}{i}"), tenant=tenant, tier=Tier.BATCH) as chunks:
            async for _ in chunks:
                pass

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, "a", i)
            await anyio.sleep(0.01)
            tg.start_soon(call, "b", i)
            await anyio.sleep(0.01)
    tenants = [label[0] for label in backend.started]
    assert tenants == ["a", "b", "a", "b", "a", "b"]


async def test_a_call_refused_by_the_engine_is_not_charged_its_prompt():
    """A call the engine refuses with nothing made (a prompt over the context) was served
    nothing, yet its prompt estimate stayed on its tenant's counter: one such call of 10,000
    tokens put all 12 of b's queued calls before any of a's (its tokens per minute got the
    prompt back, its fair share did not). Nor is it work the backend served, for the rate."""
    from fleetsched.errors import ContextTooLong

    class ShortContext(SlowBackend):
        async def stream_chat(self, body):
            if len(body["messages"][0]["content"]) > 10_000:
                raise ContextTooLong("the prompt is over the context")
            async for chunk in super().stream_chat(body):
                yield chunk

    async def too_long() -> None:
        with pytest.raises(ContextTooLong):
            await dispatcher.chat(body("x" * 40_000), tenant="a", tier=Tier.STANDARD)

    backend = ShortContext(1.0)
    dispatcher = Dispatcher(backend, window=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("hold"), tenant="c", tier=Tier.STANDARD))
        await anyio.sleep(0.01)
        tg.start_soon(too_long)
        await anyio.sleep(0.01)
        for i in range(6):
            tg.start_soon(partial(dispatcher.chat, body(f"a{i}"), tenant="a", tier=Tier.STANDARD))
            tg.start_soon(partial(dispatcher.chat, body(f"b{i}"), tenant="b", tier=Tier.STANDARD))
            await anyio.sleep(0.01)
    order = [label[0] for label in backend.started[1:]]
    assert order.index("a") <= 1, order
    # The rate: 13 calls of a few tokens a second, not the refused prompt's 10,000 with them.
    assert dispatcher.statistics().service_rate < 100


async def test_a_call_is_charged_its_tenants_recent_output_when_it_takes_its_place():
    """VTC with length prediction: after a call of 7 output tokens, the tenant's next call is
    charged 7 up front, so its calls in flight count in its counter; chunks within the
    prediction add nothing, and the end corrects to what the call used."""

    class Streaming(SlowBackend):
        async def stream_chat(self, body):
            for _ in range(3):
                await anyio.sleep(1.0)
                yield make_chunk("c", "m", 0, content="x")
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 3 if self.started else 7))
            self.started.append("done")

    dispatcher = Dispatcher(Streaming(), window=1)
    queue = dispatcher._queue
    async with dispatcher.stream(body("x", max_tokens=100), tenant="a", tier=Tier.BATCH) as chunks:
        _ = [c async for c in chunks]
    assert queue.counter("a") == 10 + 7 * 2.0
    async with dispatcher.stream(body("x", max_tokens=100), tenant="a", tier=Tier.BATCH) as chunks:
        taken = queue.counter("a") - (10 + 7 * 2.0)
        estimate = estimate_prompt_tokens(body("x"))
        assert taken == estimate * 1.0 + 7 * 2.0  # the prompt estimate and the predicted 7
        _ = [c async for c in chunks]
        assert queue.counter("a") == 10 + 7 * 2.0 + taken  # 3 chunks, all within the prediction
    assert queue.counter("a") == 2 * 10 + (7 + 3) * 2.0  # corrected: 3 tokens used, not 7


async def test_a_new_tenant_is_charged_the_output_other_tenants_calls_used():
    """Tenant a's call ended using all its 64 tokens. Then c fills the 4 places while a and a new
    tenant b queue calls of 64 behind it. b's calls are charged the share every tenant's calls
    used (all of max_tokens), as a's are, so when c's calls end the places go 2 and 2. Charged
    only their prompts, b's calls looked cheaper than a's until one of them ended: b took 3 or 4."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=4)
    await dispatcher.chat(body("a-first", max_tokens=64), tenant="a", tier=Tier.BATCH)
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(partial(dispatcher.chat, body(f"c{i}", max_tokens=64), tenant="c", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        for i in range(6):
            for tenant in ("a", "b"):
                tg.start_soon(partial(dispatcher.chat, body(f"{tenant}{i}", max_tokens=64), tenant=tenant, tier=Tier.BATCH))
        await anyio.sleep(1.5)  # c's calls ended at 2.0 and handed their places on
        second_round = sorted(label[0] for label in backend.started[5:])
        tg.cancel_scope.cancel()
    assert second_round == ["a", "a", "b", "b"]


async def test_a_tenant_is_charged_its_share_of_max_tokens_up_front():
    """The prediction scales with the call's own max_tokens: after a call that used all of its
    10 tokens, a call asking for 40 is charged 40 when it takes its place."""
    dispatcher = Dispatcher(SlowBackend(1.0), window=1)
    queue = dispatcher._queue
    await dispatcher.chat(body("x", max_tokens=10), tenant="a", tier=Tier.BATCH)
    before = queue.counter("a")
    async with dispatcher.stream(body("x", max_tokens=40), tenant="a", tier=Tier.BATCH) as chunks:
        assert queue.counter("a") - before == estimate_prompt_tokens(body("x")) + 40 * 2.0
        _ = [c async for c in chunks]
    assert queue.counter("a") - before == 10 + 40 * 2.0  # SlowBackend uses all max_tokens


async def test_each_tenant_is_charged_its_own_calls_share_of_max_tokens():
    """a's calls use all of their max_tokens, b's a quarter: each tenant's next call is predicted
    its own share, not the share of every tenant's calls (which is for a tenant with none ended)."""

    class Using(SlowBackend):
        """Each call uses the number of output tokens its message names."""

        async def stream_chat(self, body):
            used = int(body["messages"][0]["content"])
            yield make_chunk("c", "m", 0, content="x", finish_reason="length", usage=usage_dict(10, used))

    dispatcher = Dispatcher(Using(0.0), window=1)
    for tenant, used in (("a", "40"), ("b", "10"), ("a", "40"), ("b", "10")):
        await dispatcher.chat(body(used, max_tokens=40), tenant=tenant, tier=Tier.BATCH)
    # a's first call: nothing ended yet; b's first: the share every tenant's calls used.
    assert [r.predicted_output for r in dispatcher.recorder.calls] == [0, 40, 40, 10]


async def test_streamed_output_is_charged_by_the_engines_count_not_by_chunks():
    """The dispatcher asks for usage on every chunk and charges the engine's count: the batch
    tier streams 8 tokens a chunk, but the engine sent the first token alone, then 20 (a
    reader that fell behind). It asks whatever the caller asked (a caller that turned usage on
    every chunk off was charged nothing for a stream it left early, at the gateway); an engine
    that does not send it has 8 a chunk with content charged, until the usage at the end."""

    class Coarse(SlowBackend):
        def __init__(self, continuous: bool) -> None:
            super().__init__()
            self.continuous = continuous

        async def stream_chat(self, body):
            self.options = body.get("stream_options")
            usage = self.continuous and self.options.get("continuous_usage_stats")
            yield make_chunk("c", "m", 0, role="assistant", content="")
            yield make_chunk("c", "m", 0, content="x", usage=usage_dict(10, 1) if usage else None)
            await anyio.sleep(1.0)
            yield make_chunk("c", "m", 0, content="x" * 20, usage=usage_dict(10, 21) if usage else None)
            await anyio.sleep(1.0)
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 21))

    cases = (
        (None, True, [0, 2, 42, 42]),
        ({"continuous_usage_stats": False, "include_usage": False}, True, [0, 2, 42, 42]),
        (None, False, [0, 16, 32, 42]),
    )
    for options, continuous, charged in cases:
        backend = Coarse(continuous)
        dispatcher = Dispatcher(backend, window=1, stream_interval={Tier.BATCH: 8})
        queue = dispatcher._queue
        request = {**body("x", max_tokens=100), "stream_options": options}
        async with dispatcher.stream(request, tenant="a", tier=Tier.BATCH) as chunks:
            start = queue.counter("a")  # the prompt estimate: no prediction before a call ends
            assert [queue.counter("a") - start async for _ in chunks] == charged
        assert queue.counter("a") == 10 + 21 * 2.0  # corrected to the usage in every case
        assert backend.options == {"continuous_usage_stats": True, "include_usage": True}


async def test_a_tiers_stream_interval_is_asked_of_the_backend_for_its_streamed_calls():
    seen = []

    class Spy(SlowBackend):
        async def stream_chat(self, body):
            seen.append(body.get("stream_interval"))
            async for chunk in super().stream_chat(body):
                yield chunk

    dispatcher = Dispatcher(Spy(0.0), window=2, stream_interval={Tier.BATCH: 8})
    for tier in (Tier.BATCH, Tier.STANDARD):
        async with dispatcher.stream(body("x"), tenant="a", tier=tier) as chunks:
            _ = [c async for c in chunks]
    assert seen == [8, None]  # a tier with no interval set streams every token


async def test_the_critical_reserve_holds_when_the_window_shrinks():
    """The window shrinks below the calls in flight (the engine queues): lower tiers wait until
    enough calls end, but critical calls still take the reserve at once."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=5, critical_reserve=1)
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(partial(dispatcher.chat, body(f"batch{i}"), tenant="bulk", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        dispatcher.resize(3)
        tg.start_soon(partial(dispatcher.chat, body("late batch"), tenant="bulk", tier=Tier.BATCH))
        tg.start_soon(partial(dispatcher.chat, body("critical"), tenant="vip", tier=Tier.CRITICAL))
        await anyio.sleep(0.1)
        assert backend.started[4:] == ["critical"]  # the batch call waits; the critical one is in
        assert dispatcher.statistics().in_flight == 5
    started = {r.tenant + ":" + str(r.started) for r in dispatcher.recorder.calls if r.tenant == "vip"}
    assert started == {"vip:0.1"}


@pytest.mark.parametrize("anyio_backend", [virtual_loop("asyncio")])
@pytest.mark.parametrize("stagger", [True, False])
async def test_calls_granted_together_start_one_per_turn_of_the_loop_when_staggered(stagger: bool):
    """Four calls end together and hand their places to four queued ones: staggered, those open
    their requests in four turns of the event loop, and the loop runs other tasks between them.
    On asyncio only: trio shuffles the tasks of a turn, so a task counting turns cannot tell two
    starts in one turn from two in turns next to each other."""
    turn = 0
    turns: dict[str, int] = {}

    class Recording(SlowBackend):
        async def stream_chat(self, body):
            turns[body["messages"][0]["content"]] = turn
            async for chunk in super().stream_chat(body):
                yield chunk

    async def count_turns() -> None:
        nonlocal turn
        await anyio.sleep(1.0)  # when the first four calls end
        for _ in range(100):
            turn += 1
            await anyio.lowlevel.checkpoint()

    dispatcher = Dispatcher(Recording(1.0), window=4, stagger_starts=stagger)
    async with anyio.create_task_group() as tg:
        tg.start_soon(count_turns)
        for i in range(8):
            tg.start_soon(partial(dispatcher.chat, body(f"call {i}"), tenant="a", tier=Tier.BATCH))
    second_wave = sorted(turns[f"call {i}"] for i in range(4, 8))
    if stagger:
        assert all(later > earlier for earlier, later in zip(second_wave, second_wave[1:])), second_wave
    else:
        assert len(set(second_wave)) == 1, second_wave
    assert anyio.current_time() == 2.0  # no call waited longer for it


@pytest.mark.parametrize("anyio_backend", [virtual_loop("asyncio")])
async def test_a_critical_call_does_not_wait_for_a_turn_when_starts_are_staggered():
    """Staggering spaces out lower-tier starts so that critical calls' chunks are read between
    them; a critical call itself starts at once, ahead of the batch calls that took their places
    in the same turn. On asyncio only: trio shuffles the tasks of a turn."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=8, stagger_starts=True)
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(partial(dispatcher.chat, body(f"batch{i}"), tenant="bulk", tier=Tier.BATCH))
        tg.start_soon(partial(dispatcher.chat, body("critical"), tenant="vip", tier=Tier.CRITICAL))
    assert backend.started[0] == "critical"


async def test_a_call_cancelled_while_it_waits_for_its_turn_gives_its_place_back():
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=2, stagger_starts=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("first"), tenant="a", tier=Tier.BATCH))
        with anyio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(anyio.get_cancelled_exc_class()):
                await dispatcher.chat(body("cancelled"), tenant="a", tier=Tier.BATCH)
        assert dispatcher.statistics().in_flight == 1
    assert backend.started == ["first"]



async def test_a_call_cancelled_as_its_place_is_handed_to_it_is_not_charged():
    """A queued call is cancelled in the turn a finished call hands it its place: it never
    reached the backend, so neither its tenant's counter, nor its band's service, nor the calls
    started count it (the pick charged its cost when it took the place)."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1)
    queue = dispatcher._queue
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("first"), tenant="a", tier=Tier.BATCH))
        await anyio.sleep(0.5)
        lifted = queue.counter("a")  # b, arriving from idle, starts at the band's last counter served
        with anyio.move_on_after(0.5):  # at 1.0, when "first" ends and hands its place on
            await dispatcher.chat(body("second", 50), tenant="b", tier=Tier.BATCH)
    assert backend.started == ["first"]
    assert queue.counter("b") == lifted
    assert queue.served(Tier.BATCH) == 0.0  # the band was alone: nobody was denied (`FairQueue.charge`)
    stats = dispatcher.statistics()
    assert stats.calls_started == 1 and stats.in_flight == 0


async def test_a_call_cancelled_while_it_waits_for_its_turn_is_not_charged():
    dispatcher = Dispatcher(SlowBackend(1.0), window=2, stagger_starts=True)
    queue = dispatcher._queue
    with anyio.CancelScope() as scope:
        scope.cancel()
        await dispatcher.chat(body("cancelled", 50), tenant="a", tier=Tier.BATCH)
    assert queue.counter("a") == 0.0 and queue.served(Tier.BATCH) == 0.0
    assert dispatcher.statistics().calls_started == 0


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"tier": 3}, "tier"),
        ({"tier": -1}, "tier"),
        ({"tier": "1"}, "tier"),
        ({"tier": None}, "tier"),
        ({"due": -1.0}, "due"),
        ({"due": float("nan")}, "due"),
        ({"due": "soon"}, "due"),
        ({"due_in": -1.0}, "due_in"),
        ({"due_in": float("nan")}, "due_in"),
        ({"due_in": "soon"}, "due_in"),
        # A bool is no tier and no time: True was taken for the standard tier (it took a place,
        # then the sim refused its "priority"), and for a due or a due_in of 1 s.
        ({"tier": True}, "tier"),
        ({"tier": False}, "tier"),
        ({"due": True}, "due"),
        ({"due_in": True}, "due_in"),
        # A Decimal compares with floats, so it passed the check, then `now + due_in` raised a
        # bare TypeError; a Decimal NaN raised decimal.InvalidOperation from the check itself.
        ({"due_in": Decimal("5")}, "due_in"),
        ({"due_in": Decimal("NaN")}, "due_in"),
        ({"due": Decimal("5")}, "due"),
        ({"due": Decimal("NaN")}, "due"),
        ({"body": ["not", "a", "dict"]}, "body"),
        ({"body": None}, "body"),
        # A NaN deadline never passed; "soon" and a list of tenants raised bare TypeErrors.
        ({"deadline": float("nan")}, "deadline"),
        ({"deadline": "soon"}, "deadline"),
        ({"deadline": Decimal("5")}, "deadline"),
        ({"tenant": ["a"]}, "tenant"),
        ({"tenant": None}, "tenant"),
    ],
)
async def test_a_call_with_a_bad_argument_is_refused_naming_it_and_holds_nothing(bad, named):
    """Checked before the call takes anything. Before, a tier of "1" was queued behind a busy
    window and failed only after, leaving its entry in the queue: the next pick compared it with
    the others and every call that ended afterwards raised TypeError. A tier out of range went to
    the engine as that priority, and a NaN due broke the earliest-deadline order."""
    from fleetsched.resources.ratelimit import RateLimit, TenantRateLimits

    limits = TenantRateLimits({"a": RateLimit(requests_per_minute=10, tokens_per_minute=1000)})
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, rate_limits=limits)
    args = {"body": body("x"), "tenant": "a", "tier": Tier.STANDARD, **bad}
    request = args.pop("body")
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("busy"), tenant="b", tier=Tier.STANDARD))
        tg.start_soon(partial(dispatcher.chat, body("queued"), tenant="b", tier=Tier.BATCH))
        await anyio.sleep(0.1)
        with pytest.raises((ValueError, TypeError), match=f"^{named}: "):
            await dispatcher.chat(request, **args)
        with pytest.raises((ValueError, TypeError), match=f"^{named}: "):
            async with dispatcher.stream(request, **args):
                pass
        assert dispatcher.statistics().queued == 1
    assert sorted(backend.started) == ["busy", "queued"]
    assert [r.error for r in dispatcher.recorder.calls] == [None, None]
    assert limits._requests["a"].tokens == 10 and limits._tokens["a"].tokens == 1000
    assert dispatcher._queue.counter("a") == 0.0


@pytest.mark.parametrize("window", [0, -3, float("nan"), 2.5, "4", None])
async def test_a_bad_window_is_refused_naming_it_and_the_window_stands(window):
    """A NaN window passed `window < 1` and was taken: no call had a place any more but the one
    that `max(1, ...)` left for lower tiers (and none for critical calls once one was in)."""
    dispatcher = Dispatcher(SlowBackend(1.0), window=4)
    with pytest.raises((ValueError, TypeError), match="in-flight window"):
        dispatcher.resize(window)
    assert dispatcher.statistics().window == 4
    with pytest.raises((ValueError, TypeError), match="in-flight window"):
        Dispatcher(SlowBackend(1.0), window=window)


@pytest.mark.parametrize("reserve", [-1, float("nan"), 0.5])
def test_a_bad_critical_reserve_is_refused_naming_it(reserve):
    with pytest.raises((ValueError, TypeError), match="critical reserve"):
        Dispatcher(SlowBackend(1.0), window=4, critical_reserve=reserve)


async def test_engine_ttfts_kept_for_the_window_are_bounded(monkeypatch):
    """Each finished call keeps its engine-side TTFT until the window controller takes them; with
    a fixed window (dispatch.adaptive_window = false) nothing takes them, and a gateway kept one
    per call for as long as it ran. The most recent are kept."""
    import fleetsched.scheduler.dispatcher as module

    monkeypatch.setattr(module, "TTFT_SAMPLES", 64, raising=False)
    dispatcher = Dispatcher(SlowBackend(0.0), window=4)
    for _ in range(200):
        await dispatcher.chat(body("x"), tenant="a", tier=Tier.STANDARD)
    assert 32 <= len(dispatcher._engine_ttfts) <= 64
    assert dispatcher.take_engine_ttft() == 0.0 and not dispatcher._engine_ttfts


async def test_until_a_call_waits_while_no_call_is_made():
    # The window's adjustments woke every window_interval_s whatever happened: a simulation of
    # three sessions a year apart spun through every half second of the year between them.
    dispatcher = Dispatcher(SlowBackend(10.0), window=1)
    with anyio.move_on_after(3600) as idle:
        await dispatcher.until_a_call()
    assert idle.cancelled_caught  # no call in an hour: still waiting
    async with anyio.create_task_group() as tg:
        tg.start_soon(dispatcher.until_a_call)
        await anyio.sleep(5)
        start = anyio.current_time()
        tg.start_soon(partial(dispatcher.chat, body("a"), tenant="t", tier=Tier.STANDARD))
        with anyio.fail_after(1):
            await dispatcher.until_a_call()  # a call in flight: at once
        assert anyio.current_time() == start


async def test_a_collected_call_cut_short_is_charged_the_output_it_received():
    """A call collected whole (`chat`) and cancelled mid-answer was charged its prompt alone:
    nothing of the output the engine had made for it counted in its tenant's counter or rate
    limit, so a tenant whose calls time out got that service free. It is charged as a stream
    left early is: the engine's count on every chunk, else a token a chunk with content."""

    class Steady(SlowBackend):
        def __init__(self, continuous: bool) -> None:
            super().__init__()
            self.continuous = continuous

        async def stream_chat(self, body):
            self.options = body.get("stream_options")
            for n in range(1, 6):
                await anyio.sleep(1.0)
                usage = usage_dict(10, 4 * n) if self.continuous else None
                yield make_chunk("c", "m", 0, content="x" * 4, usage=usage)
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 20))

    for continuous, output in ((True, 12), (False, 3)):  # the engine's count, or a token a chunk
        limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=120)})  # 2 tokens a second
        backend = Steady(continuous)
        dispatcher = Dispatcher(backend, window=1, rate_limits=limits)
        queue = dispatcher._queue
        request = body("x", max_tokens=100)
        estimate = estimate_prompt_tokens(request)
        with anyio.move_on_after(3.5):  # three chunks in
            await dispatcher.chat(request, tenant="a", tier=Tier.BATCH)
        prompt = 10 if continuous else estimate  # the engine's count where one came
        assert queue.counter("a") == prompt + output * 2.0
        # Taken: the estimate and 100 at the start; 7 flowed in over 3.5 s; given back: the
        # output not made (and the estimate corrected to the engine's count).
        assert limits._tokens["a"].tokens == pytest.approx(120 - prompt + 7 - output)
        assert backend.options == {"continuous_usage_stats": True, "include_usage": True}
        # Reported as a stream cut short is: the engine's counts where they came.
        record = dispatcher.recorder.calls[-1]
        assert (record.prompt_tokens, record.completion_tokens) == ((10, 12) if continuous else (0, 0))


@pytest.mark.parametrize("kind", ["instant", "sim"])
async def test_stream_options_that_are_no_object_are_refused_collected_as_streamed(kind):
    """vLLM refuses them (400), and so did a stream here; a collected call took them on the sim
    and instant backends, and went without the engine's count it is charged by."""
    from fleetsched.backends import create_backend
    from fleetsched.settings import BackendSettings

    async with create_backend(BackendSettings(kind=kind)) as backend:
        dispatcher = Dispatcher(backend, window=2)
        for options in (5, [], ""):  # the empty ones were taken as none
            request = {**body("x", max_tokens=4), "stream_options": options}
            with pytest.raises(InvalidRequest, match=re.escape(f"stream_options: expected an object, got {options!r}")):
                await dispatcher.chat(request, tenant="a", tier=Tier.STANDARD)
            with pytest.raises(InvalidRequest, match=re.escape(f"stream_options: expected an object, got {options!r}")):
                async with dispatcher.stream(request, tenant="a", tier=Tier.STANDARD):
                    pass
        stats = dispatcher.statistics()
        assert (stats.in_flight, stats.calls_started) == (0, 0)
        assert (await dispatcher.chat({**request, "stream_options": None}, tenant="a", tier=Tier.STANDARD))["usage"]["completion_tokens"] > 0


class _Scripted(Backend):
    """Answers each call as its script says: the prompt tokens the engine counts, the output it
    makes (a token a chunk, the engine's count on each), and whether it fails after `fail_after`."""

    def __init__(self, script: dict[str, tuple[int, int, int | None]]) -> None:
        self.script = script
        self.received: dict[str, int] = {}

    async def stream_chat(self, body):
        label = body["messages"][0]["content"]
        prompt, output, fail_after = self.script[label]
        if fail_after == -1:
            raise InvalidRequest("refused at once")
        for n in range(1, output + 1):
            await anyio.sleep(0.01)
            if fail_after is not None and n > fail_after:
                raise BackendUnavailable("the server went away")
            self.received[label] = n
            yield make_chunk("c", "m", 0, content="x", usage=usage_dict(prompt, n))
        yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(prompt, output))


_CALL = st.tuples(
    st.integers(1, 300),  # prompt tokens as the engine counts them
    st.integers(0, 30),  # output tokens it would make
    st.sampled_from(["whole", "whole", "cut", "failed", "refused"]),
    st.integers(0, 30),  # where a cut or failed call stops
    st.integers(1, 60),  # max_tokens
)


@settings(max_examples=30, deadline=None)
@given(st.lists(_CALL, min_size=1, max_size=6), st.lists(_CALL, min_size=1, max_size=6), st.sampled_from([0.5, 1.0, 2.0]), st.integers(1, 3))
def test_counters_are_charged_the_tokens_calls_used_cut_and_failed_ones_included(calls_a, calls_b, weight_b, window):
    """Whatever was charged up front (the prompt's estimate, a predicted output), a backlogged
    tenant's counter ends at the service its calls got: the engine's prompt plus 2 x the output
    received, over its weight; a call that failed with nothing made, nothing."""
    script: dict[str, tuple[int, int, int | None]] = {f"x{i}": (1, 5, None) for i in range(window)}
    for tenant, calls in (("a", calls_a), ("b", calls_b)):
        for i, (prompt, output, how, stop, _) in enumerate(calls):
            script[f"{tenant}{i}"] = (prompt, output, {"failed": stop, "refused": -1}.get(how))
    backend = _Scripted(script)
    dispatcher = Dispatcher(backend, window=window, weights={"b": weight_b})

    async def call(tenant: str, i: int, how: str, stop: int, max_tokens: int) -> None:
        label = f"{tenant}{i}"
        try:
            async with dispatcher.stream(body(label, max_tokens), tenant=tenant, tier=Tier.STANDARD) as chunks:
                async for _ in chunks:
                    if how == "cut" and backend.received.get(label, 0) >= stop:
                        break
        except (BackendUnavailable, InvalidRequest):
            pass

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            # Critical calls fill the window first, so both tenants queue from the start (and
            # stay backlogged: no lift moves their counters).
            for i in range(window):
                tg.start_soon(partial(dispatcher.chat, body(f"x{i}", 5), tenant="x", tier=Tier.CRITICAL))
            await anyio.sleep(0.001)
            for tenant, calls in (("a", calls_a), ("b", calls_b)):
                for i, (_, _, how, stop, max_tokens) in enumerate(calls):
                    tg.start_soon(call, tenant, i, how, stop, max_tokens)

    anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
    for tenant, calls, weight in (("a", calls_a, 1.0), ("b", calls_b, weight_b)):
        used = 0
        for i, (prompt, output, how, stop, _) in enumerate(calls):
            received = backend.received.get(f"{tenant}{i}", 0)
            nothing_made = how == "refused" or (how == "failed" and stop < output and received == 0)
            used += 0 if nothing_made else prompt + 2 * received
        assert dispatcher._queue.counter(tenant) == pytest.approx(used / weight)


async def test_a_band_keeps_its_minimum_share_after_a_stretch_with_no_band_above_it():
    """Standard calls served beside batch calls alone take 95 % of the calls (batch is held to its
    5 %). When critical calls come, standard, backlogged throughout, still gets its 10 %: counted
    against the whole service, its 57 calls stood for 10 % of 570, and it got none of the next 40
    (only the batch band its 5 %)."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, min_share={Tier.STANDARD: 0.1, Tier.BATCH: 0.05})
    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(partial(dispatcher.chat, body("std"), tenant="s", tier=Tier.STANDARD))
            tg.start_soon(partial(dispatcher.chat, body("bat"), tenant="b", tier=Tier.BATCH))
        await anyio.sleep(60.5)
        assert 3 <= backend.started.count("bat") <= 4  # of the 61 started (which first: the loop's order)
        for _ in range(100):
            tg.start_soon(partial(dispatcher.chat, body("cri"), tenant="c", tier=Tier.CRITICAL))
        await anyio.sleep(40)
        tg.cancel_scope.cancel()
    assert Counter(backend.started[61:101]) == {"cri": 34, "std": 4, "bat": 2}
