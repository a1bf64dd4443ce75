"""`fleetsched bench qos`: the pieces that need no server (the bench itself runs for minutes)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from functools import partial

import pytest

from fleetsched.backends.sim._fit import answer_draws
from fleetsched import bench
from fleetsched.bench.qos import CallTally, DirectClients, Tally, _cpus, summarise, verdict, window_cap
from fleetsched.policies.tiers import Tier
from fleetsched.testing.vllm_server import default_engine_cpus, free_port


def test_engine_cpus_parse_and_default():
    assert _cpus("none") == frozenset()
    assert _cpus("1,3") == frozenset({1, 3})
    cpus = sorted(os.sched_getaffinity(0))
    assert default_engine_cpus() == (frozenset({cpus[-1]}) if len(cpus) >= 2 else frozenset())


def test_answer_lengths_vary_alike_in_every_mode():
    draws = list(itertools.islice(answer_draws(64, 32), 2000))
    assert draws == list(itertools.islice(answer_draws(64, 32), 2000))  # each mode gets the same
    assert min(draws) == 32 and max(draws) == 96
    assert abs(sum(draws) / len(draws) - 64) < 1.5
    assert set(itertools.islice(answer_draws(64, 0), 10)) == {64}


@pytest.mark.anyio
async def test_direct_clients_take_turns():
    clients = DirectClients("http://127.0.0.1:9", shards=3, per_shard=4)
    try:
        picked = [clients.pick() for _ in range(6)]
        assert len(set(map(id, picked))) == 3 and picked[:3] == picked[3:]
    finally:
        await clients.aclose()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_verdict_reports_the_effective_overload_against_the_best_rate():
    """A probe that read half the engine's rate: the load offered at 2.5x its rate was 1.25x."""

    def mode(tok_s: float, critical_p99: float = 1.0) -> dict:
        return {
            "fairness_gap_sampled_tokens": {"p50": 120, "p90": 300, "max": 400, "samples": 120},
            "throughput_tok_s": tok_s,
            "ttft_s": {"critical": {"p50": 0.1, "p99": critical_p99}},
            "ttft_s_warmup_included": {"critical": {"p50": 0.1, "p99": 2 * critical_p99}},
        }

    result = {
        "saturation_tok_s": 1000.0,
        "offered_calls_per_s": 2500.0 / 64,
        "unloaded_ttft_s": {"p50": 0.01, "p99": 0.02},
        "modes": {"direct-fcfs": mode(2000.0), "direct-priority": mode(1800.0), "fleetsched": mode(1900.0, 0.05)},
    }

    tally = Tally()
    tally.service.update({"batch-a": 100, "batch-b": 90, "batch-c": 95})
    tally.largest_prompt = 40
    verdict(result, tally, argparse.Namespace(max_tokens=64, max_tokens_spread=0))
    assert result["saturation_probe_tok_s"] == 1000.0 and result["saturation_tok_s"] == 2000.0
    assert result["effective_overload"] == 1.25
    assert result["targets"] == {
        "critical_ttft_p99_over_unloaded": 2.5,
        "critical_ttft_p99_over_unloaded_warmup_included": 5.0,
        "throughput_over_saturation": 0.95,
        "fairness_within_vtc_bound": True,
        "fairness_within_vtc_bound_throughout": False,  # 400 sampled during the load > 2 x 168
    }
    assert result["fairness_gap_tokens"] == 10 and result["vtc_bound_tokens"] == 336
    # No critical call measured: null, not NaN (which is no JSON, and --json printed it).
    result["modes"]["fleetsched"]["ttft_s"] = {}
    verdict(result, tally, argparse.Namespace(max_tokens=64, max_tokens_spread=0))
    assert result["targets"]["critical_ttft_p99_over_unloaded"] is None
    json.loads(json.dumps(result, allow_nan=False))


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--duration", "5", "--warmup", "10"], "--warmup (10 s) must be below --duration (5 s)"),
        (["--max-tokens", "3", "--max-tokens-spread", "0"], "argument --max-tokens: expected at least 4"),
    ],
)
def test_options_that_leave_no_critical_call_measured_are_refused(argv, said, capsys):
    from fleetsched.bench.qos import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--url", "http://127.0.0.1:9", *argv])
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_server_that_takes_calls_and_never_answers_is_given_up_on(monkeypatch, capsys):
    """It held `bench qos` (5 probes of 120 s) and `bench sim-fidelity` (600 s) for ten minutes."""
    import socket
    import threading

    from fleetsched.bench import qos, sim_fidelity

    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.extend(listener.accept() for _ in range(2)), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(qos, "FIRST_CONTACT_S", 0.5)
    monkeypatch.setattr(sim_fidelity, "FIRST_CONTACT_S", 0.5)
    try:
        assert bench.run("qos", ["--url", url, "--duration", "1", "--warmup", "0"]) == 1
        assert f"the server at {url} answered none of 5 small probe calls within 0.5 s" in capsys.readouterr().err
        assert bench.run("sim-fidelity", ["--url", url, "--no-speed", "--no-calibrate"]) == 1
        assert f"cannot reach the vLLM server at {url}" in capsys.readouterr().err
    finally:
        listener.close()
        for connection, _ in held:
            connection.close()


def test_the_service_gap_is_sampled_during_the_load():
    tally = Tally()
    tally.sample_gap(0.25)  # nothing served yet
    for tenant, tokens in (("batch-a", 30), ("batch-b", 10), ("batch-c", 20)):
        for _ in range(tokens):
            tally.token(tenant)
    tally.sample_gap(0.5)
    tally.sample_gap(0.75)
    assert tally.gaps == [0, 40, 40]  # VTC-weighted: 2 a token
    assert summarise(tally, 1.0, 0.0)["fairness_gap_sampled_tokens"] == {
        "p50": 40, "p90": 40, "max": 40, "max_at_s": 0.5, "samples": 3  # the first sample of the largest
    }
    assert summarise(Tally(), 1.0, 0.0)["fairness_gap_sampled_tokens"]["max"] is None


def test_the_ttft_figures_leave_out_the_calls_made_in_the_warmup():
    from fleetsched.bench.qos import Tally as RealTally

    tally = RealTally(since=10.0)
    tally.first_token("critical", "c", 9.5, 0.2, 40)  # made in the warm-up
    tally.first_token("critical", "c", 10.0, 0.01, 40)
    tally.never_started("batch", 12.0, 3.0)
    assert tally.ttft == {"critical": [0.01], "batch": [3.0]}
    assert tally.ttft_all == {"critical": [0.2, 0.01], "batch": [3.0]}
    assert tally.service["c"] == 80  # service counts every call


@pytest.mark.anyio
async def test_summary_counts_every_call_for_the_cpu_a_call():
    tally = Tally()
    for i in range(4):
        call = CallTally(tally, Tier.BATCH, "batch-a")
        if i < 3:
            call.token()  # the fourth never started
    summary = summarise(tally, duration=1.0, cpu_s=0.02)
    assert summary["process_cpu_ms_per_call"] == 5.0
    assert summary["throughput_tok_s"] == 3.0 and summary["ttft_s"]["batch"]["calls"] == 3


@pytest.mark.anyio
async def test_the_min_share_counts_the_calls_that_ended_each_whole():
    """The calls cut at the phase's end count in no band: a batch call streaming 64 tokens a
    chunk has delivered its first token only when it is cut, a standard one every token it made,
    so the tokens delivered would let the stream interval decide part of the share."""
    from fleetsched.bench.qos import BATCH_TENANTS, STANDARD_TENANT, min_share_figures

    PROMPT_TOKENS = 40
    tally = Tally()
    for tenant, tier in [(BATCH_TENANTS[0], Tier.BATCH)] + [(STANDARD_TENANT, Tier.STANDARD)] * 19:
        call = CallTally(tally, tier, tenant)
        call.prompt_tokens = PROMPT_TOKENS
        for _ in range(10):
            call.token()
        call.ended()
    cut_standard, cut_batch = CallTally(tally, Tier.STANDARD, STANDARD_TENANT), CallTally(tally, Tier.BATCH, BATCH_TENANTS[1])
    cut_standard.prompt_tokens = cut_batch.prompt_tokens = PROMPT_TOKENS
    for _ in range(10):
        cut_standard.token()
    cut_batch.token()  # its other 9 tokens were made, not yet sent
    figures = min_share_figures(tally, 1.0, 0.05)
    assert tally.completed_service[STANDARD_TENANT] == 19 * (PROMPT_TOKENS + 20)
    assert figures["service_share"] == {"critical": 0.0, "standard": 0.95, "batch": 0.05}
    assert figures["delivered_share"]["batch"] == round((60 + 42) / (21 * 60 + 42), 4)


def test_the_reserve_is_in_the_engines_batch_or_beyond_it():
    assert window_cap(36, 4, "in-batch") == 36  # 32 places for batch calls, 4 slots kept free
    assert window_cap(32, 4, "beyond-batch") == 36  # 32 for batch calls, 4 waiting in vLLM's queue
    with pytest.raises(ValueError, match="reserve must be"):
        window_cap(32, 4, "inside")


def test_the_bench_load_on_the_sim_backend_stays_within_the_vtc_bound_throughout():
    """The fleetsched mode's load (2.5x overload, three equal batch tenants, critical agents,
    batch answers streamed 64 tokens a chunk) on the sim backend, 20 s of virtual time: the
    service gap sampled during the load stays within 2 x the largest request (measured: at most
    175 against 350, the sim's prompt being 47 tokens; with no output charged up front it reached
    3,024)."""
    from fleetsched.bench.qos import BATCH_TENANTS, build_parser, fleetsched_call, fleetsched_settings, offered_load
    from fleetsched.scheduler import Scheduler
    from fleetsched.virtual_time import run_virtual

    args = build_parser().parse_args([])  # the bench's defaults: 36 slots, 4 kept, 64 tokens a chunk
    settings = fleetsched_settings({"kind": "sim", "sim": {"profile": "tiny-cpu-vllm", "max_num_seqs": args.max_num_seqs}}, args)
    tally = Tally()

    async def main() -> None:
        async with Scheduler(settings) as scheduler:
            call = partial(fleetsched_call, scheduler, tally)
            await offered_load(call, tally, rate=2.5 * 8000 / args.max_tokens, duration=20.0, max_tokens=args.max_tokens)

    run_virtual(main)
    assert len(tally.gaps) >= 70 and min(tally.service[t] for t in BATCH_TENANTS) > 50_000
    assert tally.largest_prompt == 47  # the sim's count of the bench's prompt
    assert max(tally.gaps) <= 2 * (tally.largest_prompt + 2 * args.max_tokens)


@pytest.mark.parametrize(("min_share", "met"), [(0.05, True), (0.0, False)])
def test_the_min_share_phase_on_the_sim_backend_gives_the_batch_band_its_minimum(min_share: float, met: bool):
    """The min-share phase's load (the batch load and as much again of standard-tier calls, both
    bands backlogged) on the sim backend, 15 s of virtual time: with a minimum share of 5 % the
    batch band receives it (measured 0.0523); with none, strict tiers leave it the calls it took
    before the standard band's queue formed (measured 0.0077)."""
    from fleetsched.bench.qos import build_parser, fleetsched_call, fleetsched_settings, min_share_figures, offered_load
    from fleetsched.scheduler import Scheduler
    from fleetsched.virtual_time import run_virtual

    args = build_parser().parse_args(["--batch-min-share", str(min_share)])
    settings = fleetsched_settings({"kind": "sim", "sim": {"profile": "tiny-cpu-vllm", "max_num_seqs": args.max_num_seqs}}, args)
    tally = Tally()
    rate = 2.5 * 8000 / args.max_tokens

    async def main() -> None:
        async with Scheduler(settings) as scheduler:
            call = partial(fleetsched_call, scheduler, tally)
            await offered_load(call, tally, rate=rate, duration=15.0, max_tokens=args.max_tokens, standard_rate=rate)

    run_virtual(main)
    figures = min_share_figures(tally, 15.0, 0.05)  # both runs judged against 5 %
    share = figures["service_share"]
    assert share["standard"] > 0.9 and tally.errors == 0
    assert (share["batch"] >= 0.05) is met and share["batch"] > 0  # the batch band's first calls, taken before the queue formed

    result = {
        "saturation_tok_s": 8000.0, "offered_calls_per_s": rate, "unloaded_ttft_s": {"p50": 0.01, "p99": 0.02},
        "modes": {
            m: {"fairness_gap_sampled_tokens": {"max": 0}, "throughput_tok_s": 1.0, "ttft_s": {}, "ttft_s_warmup_included": {}}
            for m in ("direct-fcfs", "direct-priority", "fleetsched")
        },
        "min_share": figures,
    }  # fmt: skip
    verdict(result, tally, argparse.Namespace(max_tokens=64, max_tokens_spread=0))
    assert result["targets"]["batch_min_share_met"] is met


def test_a_server_that_does_not_answer_is_a_clear_error_not_a_traceback(capsys):
    # It was a ZeroDivisionError deep in the load generator once every probe call had failed.
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert bench.run("qos", ["--url", closed, "--duration", "1", "--warmup", "0"]) == 1
    err = capsys.readouterr().err
    assert f"5 of 5 probe calls to the vLLM server at {closed} failed" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--window", "-3"], "--window"),  # was a ValidationError traceback when the last mode built its settings
        (["--window", "0"], "--window"),  # was taken as "the default", silently
        (["--warmup", "nan"], "--warmup"),  # every call then fell out of (or into) the TTFT figures
        (["--warmup", "-1"], "--warmup"),
        (["--engine-cpus", "-1"], "--engine-cpus"),  # was an OSError from pinning, after the server started
        (["--engine-cpus", "0,x"], "--engine-cpus"),
    ],
)
def test_bad_option_values_are_usage_errors_naming_the_option(argv, named, capsys):
    """Parsed only: `main` with these would start vLLM servers on the old code."""
    from fleetsched.bench.qos import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {named}: expected" in err


def test_engine_cpus_this_machine_lacks_are_a_usage_error(capsys):
    """Before: sched_setaffinity's OSError once the first server had started (minutes in)."""
    from fleetsched.bench.qos import parse_args

    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as exited:
        parse_args(["--engine-cpus", str(missing)])
    assert exited.value.code == 2 and f"--engine-cpus: CPU {missing} is not one this process may run on" in capsys.readouterr().err


@pytest.mark.anyio
async def test_a_direct_call_counts_the_engines_tokens_not_its_chunks():
    """vLLM merges a call's pending tokens into one chunk when its API server falls behind the
    engine (under the saturation the probe makes). The direct modes and the probe counted one
    token a chunk with content: 56 of 64 here, which read the ratio of fleetsched's throughput
    (counted from the usage) to theirs 1.14 at equal rates."""
    import httpx

    from fleetsched.bench.qos import direct_call

    per_chunk = [1] * 48 + [2] * 6 + [0] + [3] + [1]  # 64 tokens: 6 pairs and a triple merged, one empty
    usage = '"usage":{"prompt_tokens":100,"completion_tokens":%d}'
    lines, done = ['data: {"choices":[{"delta":{"role":"assistant","content":""}}],%s}' % (usage % 0)], 0
    for n in per_chunk:
        done += n
        text = " w" * n
        lines.append('data: {"choices":[{"delta":{"content":"%s"}}],%s}' % (text, usage % done))
    lines.append('data: {"choices":[],%s}' % (usage % done))
    payload = ("\n\n".join([*lines, "data: [DONE]"]) + "\n\n").encode()
    sent = []

    def answer(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=payload)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://vllm") as client:
        tally = Tally()
        await direct_call(client, tally, Tier.BATCH, "batch-a", 64, priority=False)
    assert tally.tokens == 64
    assert tally.service["batch-a"] == 100 + 2 * 64 and tally.completed_service["batch-a"] == 100 + 2 * 64  # VTC-weighted
    assert sent[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_bench_json_names_a_figure_that_is_not_a_number_null():
    """The p99 of no calls is nan, which json.dumps wrote as NaN: not JSON."""
    assert json.loads(bench.json_text({"p99": float("nan"), "figures": [1.5, float("inf")]})) == {"p99": None, "figures": [1.5, None]}


def test_the_allocator_bench_percentile_is_the_nearest_rank():
    from fleetsched.bench.allocator import _pct

    assert _pct(list(range(1, 101)), 0.99) == 99  # it read the 100th
    assert _pct([1, 2, 3, 4], 0.5) == 2
    assert _pct(list(range(1, 101)), 0.07) == 7


def test_the_service_figures_and_the_vtc_bound_count_the_prompt_as_the_engine_does():
    """The bench's prompt is 100 tokens to the CPU vLLM's tiny model (its chat template and
    tokenizer) and 47 to the sim: each call's service and the VTC bound counted it as 40, so
    the bound read 336 where VTC's is 2 x (100 + 2 x 64) = 456, and a tenant one call ahead
    read 42 tokens ahead, not 102."""
    from fleetsched.bench.qos import BATCH_TENANTS, build_parser, fleetsched_call, fleetsched_settings
    from fleetsched.scheduler import Scheduler
    from fleetsched.virtual_time import run_virtual

    args = build_parser().parse_args([])
    settings = fleetsched_settings({"kind": "sim", "sim": {"profile": "tiny-cpu-vllm", "max_num_seqs": args.max_num_seqs}}, args)
    tally = Tally()

    async def main() -> None:
        async with Scheduler(settings) as scheduler:
            await fleetsched_call(scheduler, tally, Tier.BATCH, BATCH_TENANTS[0], 8)
            (record,) = scheduler.recorder.calls
            assert record.prompt_tokens == 47 and record.completion_tokens == 8

    run_virtual(main)
    assert tally.service[BATCH_TENANTS[0]] == 47 + 2 * 8 == tally.completed_service[BATCH_TENANTS[0]]

    tally = Tally()
    tally.first_token("batch", BATCH_TENANTS[0], 0.0, 0.01, 100)  # the real vLLM's count
    result = {
        "saturation_tok_s": 1000.0, "offered_calls_per_s": 1.0, "unloaded_ttft_s": {"p50": 0.01, "p99": 0.02},
        "modes": {
            m: {"fairness_gap_sampled_tokens": {"max": 400}, "throughput_tok_s": 1.0, "ttft_s": {}, "ttft_s_warmup_included": {}}
            for m in ("direct-fcfs", "direct-priority", "fleetsched")
        },
    }  # fmt: skip
    verdict(result, tally, argparse.Namespace(max_tokens=64, max_tokens_spread=0))
    assert result["vtc_bound_tokens"] == 456 and result["fairness_gap_tokens"] == 100
    assert result["targets"]["fairness_within_vtc_bound_throughout"]  # 400 <= 456
