"""The window controller and the rate-limit buckets (pure), and both in the dispatcher."""

from __future__ import annotations

import re
from functools import partial

import anyio
import pytest

from fleetsched import Scheduler
from fleetsched.backends.base import EngineSignals, estimate_prompt_tokens, make_chunk, usage_dict
from fleetsched.errors import ContextTooLong, Overloaded, RateLimited
from fleetsched.policies.fair_queue import Entry, FairQueue
from fleetsched.policies.tiers import Tier
from fleetsched.policies.window import AimdWindow, WindowSignals
from fleetsched.resources.ratelimit import RateLimit, TenantRateLimits, TokenBucket
from fleetsched.scheduler import Dispatcher

from .helpers import settings
from .test_dispatcher import SlowBackend, body


def signals(**kw) -> WindowSignals:
    base = {"window": 32, "in_flight": 32, "queued": 10, "engine_waiting": 0, "kv_cache_usage": 0.5}
    return WindowSignals(**{**base, **kw})


def test_window_grows_while_we_hold_calls_back_and_the_engine_has_room():
    assert AimdWindow().next_window(signals()) == 33


def test_window_holds_when_nothing_waits_with_us():
    assert AimdWindow().next_window(signals(queued=0)) == 32
    assert AimdWindow().next_window(signals(in_flight=20)) == 32


def test_window_tolerates_up_to_waiting_target_calls_waiting_at_the_engine():
    assert AimdWindow(waiting_target=2).next_window(signals(engine_waiting=2)) == 33
    assert AimdWindow(waiting_target=2).next_window(signals(engine_waiting=3)) == 25


@pytest.mark.parametrize(
    "why", [{"engine_waiting": 5}, {"preemptions": 1.0}, {"kv_cache_usage": 0.99}]
)
def test_window_shrinks_when_the_engine_queues_preempts_or_fills(why):
    assert AimdWindow().next_window(signals(**why)) == 25


@pytest.mark.parametrize(
    "why", [{"engine_waiting": 5}, {"preemptions": 1.0}, {"kv_cache_usage": 0.99}]
)
def test_window_does_not_shrink_again_before_its_last_decrease_took_effect(why):
    """Calls sent before a decrease still at the engine (more in flight than the window) are the
    load that decrease answered: shrinking for them again went 64, 16, 3, 2 where 8 fitted."""
    assert AimdWindow().next_window(signals(window=25, in_flight=32, **why)) == 25
    assert AimdWindow().next_window(signals(window=25, in_flight=25, **why)) == 20


def test_window_grows_when_lower_tiers_fill_every_place_but_the_critical_reserve():
    """Lower tiers stop at window - reserve: the window grew only at in_flight >= window, so with
    a reserve it never grew (8 for 20 s where the same load without one grew it to 46)."""
    assert AimdWindow().next_window(signals(in_flight=30, reserve=2)) == 33
    assert AimdWindow().next_window(signals(in_flight=29, reserve=2)) == 32
    assert AimdWindow(min_window=1).next_window(signals(window=2, in_flight=1, reserve=4)) == 3  # lower tiers get 1 place at least


@pytest.mark.anyio
async def test_the_adaptive_window_grows_with_a_critical_reserve():
    s = settings(
        backend={"kind": "instant", "max_in_flight": 8},
        dispatch={"min_window": 4, "max_window": 64, "critical_reserve": 2, "window_interval_s": 1.0},
    )
    backend = SlowBackend()
    backend.seconds = 30.0
    async with Scheduler(s, backend=backend) as scheduler, anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(partial(scheduler.dispatcher.chat, body("long"), tenant="acme", tier=Tier.STANDARD))
        await anyio.sleep(5.5)
        assert scheduler.statistics().dispatcher.window > 8
        tg.cancel_scope.cancel()


def test_window_shrinks_on_ttft_climb_only_with_engine_queueing():
    policy = AimdWindow()
    policy.next_window(signals(ttft_s=0.01))
    assert policy.next_window(signals(ttft_s=0.1, engine_waiting=1)) == 25
    assert policy.next_window(signals(ttft_s=0.1, engine_waiting=0)) == 33


def test_window_shrinks_once_ttft_passes_ttft_ratio_times_the_lowest():
    policy = AimdWindow(ttft_ratio=4.0)
    policy.next_window(signals(ttft_s=0.01))
    assert policy.next_window(signals(ttft_s=0.03, engine_waiting=1)) == 33
    assert policy.next_window(signals(ttft_s=0.05, engine_waiting=1)) == 25


def test_a_ttft_of_zero_is_not_taken_for_the_lowest():
    """Taken (calls answered at once, as by an instant backend), every later TTFT was a climb
    from 0 and the window shrank whenever a call waited at the engine."""
    policy = AimdWindow()
    policy.next_window(signals(ttft_s=0.0))
    assert policy.next_window(signals(ttft_s=0.02, engine_waiting=1)) == 33
    assert policy.ttft_floor_s == 0.02


def test_window_bounds():
    policy = AimdWindow(min_window=4, max_window=33)
    assert policy.next_window(signals(window=33, in_flight=33)) == 33
    assert policy.next_window(signals(window=4, engine_waiting=9)) == 4


def test_window_grows_from_below_min_window_to_it_at_once():
    # A window below min_window (the start, backend.max_in_flight, may be) is raised to it, not by one.
    assert AimdWindow(min_window=20, max_window=100).next_window(signals(window=4, in_flight=4)) == 20
    assert AimdWindow(min_window=4, max_window=8).next_window(signals(window=64, in_flight=64)) == 8


@pytest.mark.anyio
@pytest.mark.parametrize(("max_in_flight", "expected"), [(64, 8), (2, 4), (6, 6)])
async def test_adaptive_window_starts_within_min_and_max_window(max_in_flight, expected):
    # The window starts at backend.max_in_flight, held to [min_window, max_window]: before, a burst
    # at the start went to the engine 64 at once with max_window 8.
    s = settings(backend={"kind": "instant", "max_in_flight": max_in_flight}, dispatch={"min_window": 4, "max_window": 8})
    async with Scheduler(s) as scheduler:
        assert scheduler.statistics().dispatcher.window == expected
    off = settings(backend={"kind": "instant", "max_in_flight": 64}, dispatch={"adaptive_window": False, "max_window": 8})
    assert Scheduler(off).dispatcher.window == 64  # a fixed window is max_in_flight as it stands



class RestartingBackend(SlowBackend):
    """Reports the engine's preemption counter from `totals`, one value a call (then the last)."""

    def __init__(self, totals: list[float]) -> None:
        super().__init__()
        self.totals = totals

    async def signals(self) -> EngineSignals:
        total = self.totals.pop(0) if len(self.totals) > 1 else self.totals[0]
        return EngineSignals(waiting=0, kv_cache_usage=0.5, preemptions_total=total)


@pytest.mark.anyio
async def test_preemptions_after_a_server_restart_shrink_the_window():
    # The server restarted between the 2nd and 3rd readings (its counter went 100 -> 3): the 3
    # preemptions since are new ones. Counted as 3 - 100 = -97, none, the window held.
    s = settings(backend={"kind": "instant", "max_in_flight": 32}, dispatch={"window_interval_s": 1.0})
    backend = RestartingBackend([100.0, 100.0, 3.0, 3.0])
    backend.seconds = 10.0  # a call in flight throughout: the window is adjusted while calls are made
    async with Scheduler(s, backend=backend) as scheduler, anyio.create_task_group() as tg:
        tg.start_soon(partial(scheduler.dispatcher.chat, body("long"), tenant="acme", tier=Tier.STANDARD))
        await anyio.sleep(2.5)
        assert scheduler.statistics().dispatcher.window == 32  # no preemption yet: holds
        await anyio.sleep(1)
        assert scheduler.statistics().dispatcher.window == 25


def test_token_bucket():
    bucket = TokenBucket(rate_per_s=1.0, capacity=10)
    assert bucket.wait_s(10, now=0) == 0
    bucket.take(10, now=0)
    assert bucket.wait_s(3, now=1) == pytest.approx(2.0)
    assert bucket.wait_s(50, now=10) == 0  # larger than capacity: allowed once full


def test_rate_limits_take_both_or_neither():
    limits = TenantRateLimits({"a": RateLimit(requests_per_minute=60, tokens_per_minute=600)})
    assert limits.try_take("a", 600, now=0) == 0
    assert limits.try_take("a", 10, now=0) == pytest.approx(1.0)  # tokens short for 1 s
    limits.refund("a", 300, now=0)
    assert limits.try_take("a", 10, now=0) == 0
    assert limits.try_take("other", 10**9, now=0) == 0  # no limit declared


def test_a_nan_refund_leaves_the_bucket_as_it_is():
    """min(capacity, tokens + nan) is the capacity: a NaN refund filled the bucket."""
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=600)})
    assert limits.try_take("a", 500, now=0) == 0
    limits.refund("a", float("nan"), now=0)
    assert limits.try_take("a", 500, now=0) == pytest.approx(40.0)


def test_a_charge_at_a_call_s_end_is_taken_from_the_level_at_its_end():
    """10 tokens a second, 600 at most: a call charged 110 at 0 s ends at 30 s with a prompt 400
    tokens longer than its estimate. The charge was given on the level as of 0 s (490 - 400),
    and the refill to 30 s was then cut at the cap: 390 left where 200 are (min(600, 490 + 300)
    - 400), and a 300-token call went through that must wait 10 s."""
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=600)})
    assert limits.try_take("a", 110, now=0) == 0
    limits.refund("a", -400, now=30)
    assert limits.try_take("a", 300, now=30) == pytest.approx(10.0)



@pytest.mark.parametrize(
    ("limit", "now", "first", "second"),
    [(RateLimit(1, 23), 0.0, 27, 23), (RateLimit(60, 1000), 1e6 + 0.3, 1000, 999), (RateLimit(7, 70000), 12345.678, 70000, 1)],
)
def test_a_call_made_when_its_wait_is_over_is_taken(limit, now, first, second):
    # The wait is what refilling takes, but refilling over it in floats came up short by 1e-15
    # to 1e-9 tokens: a caller that waited retry_after_s was refused again (for 1e-11 s or so).
    limits = TenantRateLimits({"a": limit})
    assert limits.try_take("a", first, now) == 0
    wait = limits.try_take("a", second, now)
    assert wait > 0
    assert limits.try_take("a", second, now + wait) == 0

@pytest.mark.anyio
async def test_dispatcher_refuses_over_the_rate_limit_with_retry_after():
    limits = TenantRateLimits({"a": RateLimit(requests_per_minute=3)})
    backend = SlowBackend(0.0)
    dispatcher = Dispatcher(backend, window=4, rate_limits=limits)
    for _ in range(3):
        await dispatcher.chat(body("ok"), tenant="a", tier=1)
    with pytest.raises(RateLimited) as info:
        await dispatcher.chat(body("no"), tenant="a", tier=1)
    assert info.value.retry_after_s == pytest.approx(20.0)
    assert len(backend.started) == 3 and dispatcher.statistics().rate_limited == 1
    await anyio.sleep(20)
    await dispatcher.chat(body("ok again"), tenant="a", tier=1)


@pytest.mark.anyio
async def test_rate_limit_refusal_names_the_limit_and_what_the_call_asks():
    # Before, both read "tenant 'a' is over its requests or tokens per minute": which limit, and
    # that one call asked more than a minute's tokens, were left to guess.
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10), "b": RateLimit(requests_per_minute=1)})
    dispatcher = Dispatcher(SlowBackend(0.0), window=4, rate_limits=limits)
    big = body("x" * 200, max_tokens=16)  # about 66 tokens: more than a minute's worth
    await dispatcher.chat(big, tenant="a", tier=1)  # taken from the full bucket, which goes below 0
    with pytest.raises(RateLimited) as info:
        await dispatcher.chat(big, tenant="a", tier=1)
    message = str(info.value)
    assert "tokens_per_minute (10)" in message and "requests" not in message
    assert re.search(r"this call asks \d+ tokens \(prompt plus max_tokens\), more than a minute's", message)
    await dispatcher.chat(body("one"), tenant="b", tier=1)
    with pytest.raises(RateLimited, match=r"tenant 'b' is over its requests_per_minute \(1\)"):
        await dispatcher.chat(body("two"), tenant="b", tier=1)


@pytest.mark.anyio
async def test_a_call_cancelled_before_its_place_gives_its_rate_limit_back():
    # Its request and tokens were taken when it queued for the window; it never reached the
    # backend, yet the tenant's next call was refused for a minute.
    limits = TenantRateLimits({"a": RateLimit(requests_per_minute=1, tokens_per_minute=1000)})
    backend = SlowBackend(10.0)
    dispatcher = Dispatcher(backend, window=1, rate_limits=limits)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, body("holds the place"), tenant="other", tier=1))
        await anyio.sleep(1)
        with anyio.move_on_after(1):
            await dispatcher.chat(body("gives up", max_tokens=900), tenant="a", tier=1)
        assert dispatcher.statistics().in_flight == 1 and dispatcher.statistics().queued == 0
        await dispatcher.chat(body("goes", max_tokens=900), tenant="a", tier=1)
    assert backend.started == ["holds the place", "goes"]


class ShortContextBackend(SlowBackend):
    """Refuses a call asking more than 100 tokens of output, as an engine refuses one over its context."""

    async def stream_chat(self, body):
        if body.get("max_tokens", 1) > 100:
            raise ContextTooLong(f"max_tokens {body['max_tokens']} is over the context")
        async for chunk in super().stream_chat(body):
            yield chunk


@pytest.mark.anyio
async def test_a_call_refused_by_the_engine_gives_its_unused_output_back():
    # max_tokens is charged up front and what the call did not generate is refunded; a call that
    # failed was refunded nothing, so one call with max_tokens far too large (the engine refused
    # it at once) left the tenant 99 minutes in debt.
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10_000)})
    dispatcher = Dispatcher(ShortContextBackend(0.0), window=4, rate_limits=limits)
    with pytest.raises(ContextTooLong):
        await dispatcher.chat(body("too long", max_tokens=1_000_000), tenant="a", tier=1)
    await dispatcher.chat(body("fits", max_tokens=100), tenant="a", tier=1)


class DownBackend(SlowBackend):
    """A server that answers every call with an error before it makes anything."""

    def __init__(self, error: Exception) -> None:
        super().__init__(0.0)
        self.error = error

    async def stream_chat(self, body):
        self.started.append(body["messages"][0]["content"])
        raise self.error
        yield  # an async generator, as a backend's stream_chat is


@pytest.mark.anyio
async def test_a_call_that_failed_with_nothing_made_gives_its_prompt_back():
    """The prompt estimate stayed charged: one prompt over the context (refused by the engine)
    left a tenant of 10,000 tokens a minute 40,000 below empty, refused for 240 s, and calls
    failing while the server was down used up the bucket, as the gateway's calls did not."""
    from fleetsched.backends import create_backend
    from fleetsched.errors import BackendUnavailable
    from fleetsched.settings import BackendSettings

    async with create_backend(BackendSettings(kind="sim", sim={"max_model_len": 4096})) as backend:
        limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10_000, requests_per_minute=1)})
        dispatcher = Dispatcher(backend, window=2, rate_limits=limits)
        with pytest.raises(ContextTooLong):
            await dispatcher.chat(body("x" * 200_000, max_tokens=16), tenant="a", tier=1)
        # All back, the request too (refused as invalid): the next call goes at once.
        assert limits._tokens["a"].tokens == 10_000 and limits._requests["a"].tokens == 1
        await dispatcher.chat(body("fits", max_tokens=4), tenant="a", tier=1)
    for error in (BackendUnavailable("replica down"), Overloaded("engine busy", retry_after_s=1.0)):
        limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10_000, requests_per_minute=10)})
        dispatcher = Dispatcher(DownBackend(error), window=2, rate_limits=limits)
        for _ in range(4):
            with pytest.raises(type(error)):
                await dispatcher.chat(body("x" * 20_000, max_tokens=500), tenant="a", tier=1)
        # The tokens back; the requests kept: made, and retried at once they would hammer.
        assert limits._tokens["a"].tokens == 10_000 and limits._requests["a"].tokens == 6


@pytest.mark.anyio
async def test_a_call_cut_short_keeps_its_prompt_charged():
    # The engine may have read it: a cancelled call is charged its prompt, not its output.
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10_000)})
    dispatcher = Dispatcher(SlowBackend(5.0), window=2, rate_limits=limits)
    request = body("x" * 4_000, max_tokens=500)
    with anyio.move_on_after(1):
        await dispatcher.chat(request, tenant="a", tier=1)
    assert limits._tokens["a"].tokens == pytest.approx(10_000 - estimate_prompt_tokens(request) + 1_000 / 6, abs=1)


@pytest.mark.anyio
async def test_batch_call_is_shed_when_its_predicted_wait_exceeds_its_ttft_objective():
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, shed_after_s={"bulk": 5.0})
    async with anyio.create_task_group() as warm:  # measure the service rate: 4 calls of 1 s, 3 of them queued
        for _ in range(4):
            warm.start_soon(partial(dispatcher.chat, body("warm"), tenant="bulk", tier=Tier.BATCH))
    assert dispatcher.statistics().service_rate is not None
    async with anyio.create_task_group() as tg:
        for _ in range(12):  # twelve seconds of work queued
            tg.start_soon(partial(dispatcher.chat, body("queued"), tenant="std", tier=Tier.STANDARD))
        await anyio.sleep(0.5)
        with pytest.raises(Overloaded, match="predicted wait") as info:
            await dispatcher.chat(body("shed me"), tenant="bulk", tier=Tier.BATCH)
        assert info.value.retry_after_s > 5.0
        # A standard-tier call is never shed; it waits its turn.
        await dispatcher.chat(body("waits"), tenant="std", tier=Tier.STANDARD)
    assert "shed me" not in backend.started and dispatcher.statistics().shed == 1


@pytest.mark.anyio
async def test_an_invalid_batch_call_is_refused_as_invalid_not_shed():
    """A batch call with max_tokens 0 under a backlog was shed (Overloaded, a 503 with
    Retry-After through `ctx.openai`): its client waited and sent it again, to be shed again or
    told at last that the call itself was wrong, and each try counted as a shed call."""
    from fleetsched.errors import InvalidRequest

    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, shed_after_s={"bulk": 5.0})
    async with anyio.create_task_group() as warm:  # measure the service rate
        for _ in range(4):
            warm.start_soon(partial(dispatcher.chat, body("warm"), tenant="bulk", tier=Tier.BATCH))
    async with anyio.create_task_group() as tg:
        for _ in range(12):  # twelve seconds of work queued
            tg.start_soon(partial(dispatcher.chat, body("queued"), tenant="std", tier=Tier.STANDARD))
        await anyio.sleep(0.5)
        with pytest.raises(InvalidRequest, match="max_tokens"):
            await dispatcher.chat(body("wrong", max_tokens=0), tenant="bulk", tier=Tier.BATCH)
    assert dispatcher.statistics().shed == 0


@pytest.mark.anyio
async def test_the_wait_predicted_after_the_first_calls_end_counts_their_output():
    """The first calls are charged no output (no call has ended to predict it from), the later
    ones their predicted output: a service rate measured in the first calls' costs made the
    next backlog's wait 20 times too long (a fresh gateway shed batch calls with a Retry-After
    of 187 s where its backlog cleared in 11 s)."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, shed_after_s={"bulk": 60.0})
    async with anyio.create_task_group() as warm:  # measure the service rate: 4 calls of 1 s, 3 of them queued
        for _ in range(4):
            warm.start_soon(partial(dispatcher.chat, body("warm", max_tokens=100), tenant="std", tier=Tier.STANDARD))
    async with anyio.create_task_group() as tg:
        for _ in range(12):  # twelve seconds of work queued
            tg.start_soon(partial(dispatcher.chat, body("queued", max_tokens=100), tenant="std", tier=Tier.STANDARD))
        await anyio.sleep(0.5)
        assert 8.0 < dispatcher.predicted_wait_s() < 16.0
        await dispatcher.chat(body("served", max_tokens=100), tenant="bulk", tier=Tier.BATCH)  # not shed
    assert dispatcher.statistics().shed == 0


@pytest.mark.anyio
async def test_a_ttft_objective_of_zero_sheds_no_call_while_nothing_waits():
    """Shed only when the predicted wait exceeds the objective: an idle dispatcher predicts no
    wait, and a call that need not wait at all is served."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, shed_after_s={"bulk": 0.0})
    await dispatcher.chat(body("served"), tenant="bulk", tier=Tier.BATCH)
    assert backend.started == ["served"] and dispatcher.statistics().shed == 0


@pytest.mark.anyio
async def test_a_batch_call_with_a_minimum_share_is_shed_by_the_wait_its_share_gives_it():
    """The wait was predicted behind all the queued work; a band with a minimum share is served
    as soon as it is behind it, so batch calls waiting 0.1-0.6 s were shed with predicted waits
    of 2-6 s (the batch band's default share, 0.05)."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1, shed_after_s={"bulk": 5.0}, min_share={Tier.BATCH: 0.05})
    async with anyio.create_task_group() as warm:  # measure the service rate
        for _ in range(4):
            warm.start_soon(partial(dispatcher.chat, body("warm"), tenant="bulk", tier=Tier.BATCH))
    started = []

    async def bulk(label: str) -> None:
        await dispatcher.chat(body(label), tenant="bulk", tier=Tier.BATCH)
        started.append((label, anyio.current_time()))

    async with anyio.create_task_group() as tg:
        for _ in range(12):  # twelve seconds of work queued
            tg.start_soon(partial(dispatcher.chat, body("queued"), tenant="std", tier=Tier.STANDARD))
        await anyio.sleep(0.5)
        start = anyio.current_time()
        assert dispatcher.predicted_wait_s() > 5.0 and dispatcher.predicted_wait_s(Tier.BATCH) == 0.0
        await bulk("served")  # its band is empty: it goes after a pick or two
        assert started[0][1] - start < 5.0
    assert dispatcher.statistics().shed == 0


def test_the_cost_ahead_of_a_band_with_a_share_is_its_own_queue_over_its_share():
    queue = FairQueue(min_share={Tier.BATCH: 0.05})
    for _ in range(10):
        queue.push(Entry("std", Tier.STANDARD, 0.0, cost=100.0))
    queue.push(Entry("vip", Tier.CRITICAL, 0.0, cost=50.0))
    assert queue.cost_ahead(Tier.CRITICAL) == 50.0 and queue.cost_ahead(Tier.STANDARD) == 1_050.0
    assert queue.cost_ahead(Tier.BATCH) == 0.0  # an empty band with a share: picked when behind
    queue.push(Entry("bulk", Tier.BATCH, 0.0, cost=20.0))
    assert queue.cost_ahead(Tier.BATCH) == pytest.approx(20.0 / 0.05)
    queue.push(Entry("bulk", Tier.BATCH, 0.0, cost=100.0))  # its own queue over its share, or all: the less
    assert queue.cost_ahead(Tier.BATCH) == pytest.approx(1_170.0)
    while queue.pick(0.0) is not None:
        pass
    assert queue.cost_ahead(Tier.BATCH) == 0.0 and queue.cost_ahead(Tier.STANDARD) == 0.0
    assert FairQueue().cost_ahead(Tier.BATCH) == 0.0



def test_the_cost_ahead_of_a_band_served_to_its_share_counts_what_it_must_wait_off():
    """A backlogged band with a share is ahead of it after each pick (by that call's cost): its
    next call goes only once the others have served that off too. Predicted as its queue over
    its share alone, a batch call behind one queued was predicted 5 s and waited 10 s (28 of 33
    admitted batch calls past their 5 s objective, std 1.5x overloaded, share 0.05)."""
    queue = FairQueue(min_share={Tier.BATCH: 0.05})
    for _ in range(200):
        queue.push(Entry("std", Tier.STANDARD, 0.0, cost=100.0))
    for _ in range(2):
        queue.push(Entry("bulk", Tier.BATCH, 0.0, cost=100.0))
    while queue.pick(0.0).tier != Tier.BATCH:  # the band's first call goes: it is ahead again
        pass
    predicted = queue.cost_ahead(Tier.BATCH)
    mine = queue.push(Entry("bulk", Tier.BATCH, 0.0, cost=100.0))
    served = 0.0
    while (entry := queue.pick(0.0)) is not mine:
        served += entry.cost
    assert served == pytest.approx(predicted, abs=100.0)  # within one pick

@pytest.mark.anyio
async def test_the_service_rate_is_measured_while_calls_queue_not_over_idle_time():
    """Calls one every 3 s, never queued, then a burst: the rate was measured over the idle time
    too (the demand's pace, 1 call in 3 s), and 31 of 40 burst calls were shed with a retry-after
    of 3.1 s where the burst cleared in under a second. Now no rate is measured while nothing
    queues, and the burst is served."""
    backend = SlowBackend(0.1)
    dispatcher = Dispatcher(backend, window=8, shed_after_s={"bulk": 2.0})
    for _ in range(4):
        await dispatcher.chat(body("trickle"), tenant="bulk", tier=Tier.BATCH)
        await anyio.sleep(3.0)
    assert dispatcher.statistics().service_rate is None
    async with anyio.create_task_group() as tg:
        for _ in range(40):
            tg.start_soon(partial(dispatcher.chat, body("burst"), tenant="bulk", tier=Tier.BATCH))
    assert dispatcher.statistics().shed == 0 and backend.started.count("burst") == 40


@pytest.mark.anyio
async def test_the_service_rate_is_smoothed_over_periods():
    """A period at a call a second, then one at two calls a second (calls of equal cost): the
    rate is the mean of the two, not the last period's alone."""
    backend = SlowBackend(1.0)
    dispatcher = Dispatcher(backend, window=1)
    await dispatcher.chat(body("warm"), tenant="a", tier=Tier.BATCH)  # the later calls' predicted output

    async def backlog(calls: int) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(calls):
                tg.start_soon(partial(dispatcher.chat, body("x"), tenant="a", tier=Tier.BATCH))

    await backlog(4)  # the period runs from the 1st call's end to the 3rd's
    first = dispatcher.statistics().service_rate
    backend.seconds = 0.5
    await backlog(6)  # from the 1st call's end to the 5th's
    assert dispatcher.statistics().service_rate == pytest.approx(1.5 * first)


@pytest.mark.anyio
async def test_a_streamed_call_is_refunded_the_output_its_usage_says_it_did_not_use():
    # A caller that turns usage on every chunk off gets chunks counted at the tier's stream
    # interval (8) until the usage at the end: 4 chunks with content were counted as 32 tokens,
    # and the refund at the end trusted that over the usage's 21, so the tenant lost 11 tokens
    # of its minute for every such call.
    class Coarse(SlowBackend):
        async def stream_chat(self, body):
            for n in (1, 8, 8, 4):  # the first token alone, then up to 8 a chunk
                yield make_chunk("c", "m", 0, content="x" * n)
            yield make_chunk("c", "m", 0, finish_reason="length", usage=usage_dict(10, 21))

    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=1000)})
    dispatcher = Dispatcher(Coarse(), window=1, rate_limits=limits, stream_interval={Tier.BATCH: 8})
    request = {**body("x", max_tokens=100), "stream_options": {"continuous_usage_stats": False}}
    async with dispatcher.stream(request, tenant="a", tier=Tier.BATCH) as chunks:
        _ = [c async for c in chunks]
    # Taken: the prompt estimate and max_tokens; given back: the 79 tokens not generated, and
    # the estimate corrected to the usage's 10 prompt tokens.
    assert limits._tokens["a"].tokens == 1000 - 10 - 21


@pytest.mark.anyio
async def test_a_prompt_the_engine_counts_longer_than_its_estimate_is_charged_the_difference():
    # The estimate counts characters (four a token); a real tokenizer may count more (Chinese
    # text: about a token a character). The difference was never charged.
    class CharTokens(SlowBackend):
        async def stream_chat(self, body):
            characters = sum(len(m["content"]) for m in body["messages"])
            yield make_chunk("c", "m", 0, content="x", finish_reason="stop", usage=usage_dict(characters, 1))

    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=10_000)})
    dispatcher = Dispatcher(CharTokens(), window=1, rate_limits=limits)
    request = body("你好" * 600, max_tokens=100)
    assert estimate_prompt_tokens(request) < 400
    await dispatcher.chat(request, tenant="a", tier=Tier.STANDARD)
    assert limits._tokens["a"].tokens == pytest.approx(10_000 - 1200 - 1, abs=1)


@pytest.mark.anyio
async def test_a_prompt_cut_by_truncate_prompt_tokens_is_charged_as_cut():
    # 20,000 characters (5,000 tokens by the estimate) that the engine cuts to its last 100: the
    # call took 5,010 tokens of a 1,000-token minute up front, and a second call made while it
    # ran was refused for four minutes, though each costs 110.
    limits = TenantRateLimits({"a": RateLimit(tokens_per_minute=1000)})
    dispatcher = Dispatcher(SlowBackend(1.0), window=2, rate_limits=limits)
    request = {**body("x" * 20_000, max_tokens=10), "truncate_prompt_tokens": 100}
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(dispatcher.chat, request, tenant="a", tier=Tier.STANDARD))
        await anyio.sleep(0.5)
        await dispatcher.chat(request, tenant="a", tier=Tier.STANDARD)
    assert estimate_prompt_tokens(request) == 100
    assert estimate_prompt_tokens({"prompt": "x" * 20_000, "truncate_prompt_tokens": 100}) == 100
    assert estimate_prompt_tokens({**request, "truncate_prompt_tokens": -1}) == 5004  # the context: the engine's to cut


def test_a_short_retry_after_does_not_read_as_zero():
    """A wait of 0.01 s read "retry after 0.0 s": rounded up to the tenth shown now."""
    assert str(RateLimited("tenant 'a' is over its requests_per_minute (60)", retry_after_s=0.01)).endswith("(retry after 0.1 s)")
    assert str(Overloaded("shed", retry_after_s=float("inf"))).endswith("(retry after inf s)")
