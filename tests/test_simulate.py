"""`fleetsched simulate`: the real scheduler on the sim backend in virtual time (asyncio's or trio's)."""

from __future__ import annotations

import json
import os

import pytest

from fleetsched.cli import main as cli_main
from fleetsched.settings import ResourceSettings, Settings, SimSettings, load_settings
from fleetsched.simulate import find_max_sessions, parse_duration, scale_fleet, sim_settings, simulate, sla_checks

pytest.importorskip("trio")


def fleet(count: int = 6, ttft_p99_s: float | None = None) -> Settings:
    return Settings(
        scheduler={"max_sessions": 512, "session_memory": "64MB"},
        backend={"kind": "instant", "max_in_flight": 64, "sim": {"max_num_seqs": 8}},
        tenants={"live": {"tier": "critical", "sla": {"ttft_p99_s": ttft_p99_s} if ttft_p99_s else {}}, "bulk": {"tier": "batch"}},
        workload={
            "agents": [
                {"tenant": "live", "count": count, "turns": 2, "prompt_tokens": 100, "max_tokens": 32, "think_s": 1.0},
                {"tenant": "bulk", "count": count // 2, "turns": 1, "prompt_tokens": 300, "max_tokens": 64, "tool_s": 2.0},
            ]
        },
    )


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("2h", 7200), ("1h30m", 5400)])
def test_parse_duration(text: str, seconds: float):
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_junk():
    with pytest.raises(ValueError, match="2h"):
        parse_duration("two hours")
    for nothing in ("0", "0s", "", "99999999999999999999d"):  # ran an empty report, or for ever
        with pytest.raises(ValueError):
            parse_duration(nothing)


@pytest.mark.parametrize("text", ["1h30", "2m30", "90 90", "1 30", "1m1m", "30m1h", "1m1min"])
def test_parse_duration_rejects_a_number_without_its_unit_among_others(text: str):
    """Before: '1h30' was 1 h 30 s (3,630 s, not the 90 minutes meant), '90 90' 180 s, '1m1m' 120 s."""
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_sessions_still_running_at_the_end_get_the_drain_grace_only():
    """A 600-s tool call in a 60-s simulation: the run ends at 60 s plus the 5-s drain (before:
    at 1,805 s, its throughput diluted accordingly)."""
    base = fleet(count=2)
    agents = [m.model_copy(update={"tool_s": 600.0}) for m in base.workload.agents]
    settings = sim_settings(base.model_copy(update={
        "workload": base.workload.model_copy(update={"agents": agents}),
        "scheduler": base.scheduler.model_copy(update={"drain_grace_s": 5.0}),
    }))  # fmt: skip
    report, _ = simulate(settings, 60.0)
    assert 60 <= report["duration_s"] <= 66


def test_a_fleet_whose_sessions_are_rejected_does_not_fit():
    """Sessions larger than the only device are rejected: the search's first probe fails (before:
    "every fleet up to 49,152 sessions meets every SLA", having measured nothing)."""
    base = sim_settings(fleet(count=2, ttft_p99_s=5.0))
    settings = base.model_copy(update={
        "scheduler": base.scheduler.model_copy(update={"session_memory": 8 * 10**9}),
        "resources": ResourceSettings(devices=[{"name": "g", "memory": "4GB"}]),
    })  # fmt: skip
    result = find_max_sessions(settings, 10.0, echo=lambda _: None, limit=64)
    assert result["max_sessions"] == 0 and not any(result["probes"].values())


def test_the_search_labels_a_fleet_with_the_sessions_it_ran():
    """Each kind runs at least one session, so a probe may hold more sessions than asked: it is
    recorded under the sessions that ran (before: a fleet of 3 was reported as 2)."""
    settings = sim_settings(fleet(count=10, ttft_p99_s=0.5))
    result = find_max_sessions(settings, 10.0, echo=lambda _: None, limit=64)
    for size, _ in result["probes"].items():
        assert size == sum(m.count for m in scale_fleet(settings.workload.agents, size))
    assert result["max_sessions"] == sum(result["agents"].values())


def test_the_fleet_found_counts_every_entry_of_a_kind_shared_by_tenants():
    """Two entries of kind 'chat' (two tenants): a fleet of 6 sessions that met every SLA was
    reported as 2 sessions {'chat': 2} (before), the second entry's count written over the first's."""
    base = sim_settings(fleet(count=2, ttft_p99_s=60.0))
    agents = [m.model_copy(update={"kind": "chat"}) for m in base.workload.agents]
    settings = base.model_copy(update={"workload": base.workload.model_copy(update={"agents": agents})})
    result = find_max_sessions(settings, 10.0, echo=lambda _: None, limit=8)
    assert result["max_sessions"] == 6 and result["agents"] == {"chat": 6}


def test_a_miss_with_nothing_measured_says_so():
    """Every call over the model's context fails: the smallest fleet 'misses live.ttft_p99_s
    (nan vs 5)' before; now '(none measured vs 5)'."""
    base = sim_settings(fleet(count=2, ttft_p99_s=5.0))
    agents = [m.model_copy(update={"prompt_tokens": 9000}) for m in base.workload.agents]
    settings = base.model_copy(update={"workload": base.workload.model_copy(update={"agents": agents})})
    result = find_max_sessions(settings, 10.0, echo=lambda _: None, limit=8)
    assert result["max_sessions"] == 0
    assert "live.ttft_p99_s (none measured vs 5)" in result["smallest_misses"] and "nan" not in result["smallest_misses"]


def test_sim_settings_switch_to_sim_and_raise_the_stream_interval():
    settings = sim_settings(fleet())
    assert settings.backend.kind == "sim"
    assert settings.backend.sim.max_num_seqs == 8 and settings.backend.sim.stream_interval == 8
    hermes = sim_settings(fleet(), profile="hermes3-70b-4xa100", stream_interval=2).backend.sim
    assert hermes.max_num_seqs == 256 and hermes.stream_interval == 2


def test_a_fleet_without_prefix_caching_computes_every_prompt_and_its_report_says_so():
    """The sim always cached prefixes: `enable_prefix_caching = false` (vLLM's
    --no-enable-prefix-caching) was refused as an unknown field."""
    def run(caching: bool) -> dict:
        base = fleet(count=4)
        sim = base.backend.sim.model_dump(exclude_unset=True) | {"enable_prefix_caching": caching}
        backend = base.backend.model_copy(update={"sim": SimSettings(**sim)})
        report, _ = simulate(sim_settings(base.model_copy(update={"backend": backend})), 60)
        return report

    cached, uncached = run(True), run(False)
    assert cached["sim"]["enable_prefix_caching"] is True and uncached["sim"]["enable_prefix_caching"] is False
    # Each session's second turn finds its first turn's blocks; with no cache, nothing is looked up.
    assert cached["sim"]["prefix_cache_hits"] > 0
    assert uncached["sim"]["prefix_cache_queries"] == uncached["sim"]["prefix_cache_hits"] == 0
    again = run(False)  # deterministic: the same report but for the wall time it took
    assert {k: v for k, v in again.items() if k != "wall_s"} == {k: v for k, v in uncached.items() if k != "wall_s"}


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_quarter_hour_of_a_small_fleet_in_virtual_time(loop):
    report, scheduler = simulate(sim_settings(fleet(count=2)), 900, loop)
    assert 900 <= report["duration_s"] < 900 + 60
    live = next(t for t in report["tenants"] if t["tenant"] == "live")
    assert live["sessions_done"] > 100 and live["call_errors"] == 0
    # The same report as `fleetsched run`, plus the engine's figures.
    assert {"schema", "tenants", "throughput_tok_s", "sim", "wall_s"} <= set(report)
    assert report["sim"]["engine_steps"] > 0


def test_scale_fleet_keeps_the_mix():
    agents = fleet(count=6).workload.agents
    assert [m.count for m in scale_fleet(agents, 90)] == [60, 30]
    assert [m.count for m in scale_fleet(agents, 1)] == [1, 1]


def test_find_max_sessions_is_the_edge_of_the_sla():
    settings = sim_settings(fleet(count=4, ttft_p99_s=0.5))
    result = find_max_sessions(settings, 30.0, echo=lambda _: None, limit=2048)
    best = result["max_sessions"]
    assert 4 <= best < 2048 and not result["bounded_by_limit"]
    assert result["probes"][best] is True
    assert any(not ok and n > best for n, ok in result["probes"].items())
    # The answer's fleet meets the SLA when run again (deterministic virtual time).
    scaled = settings.model_copy(update={"workload": settings.workload.model_copy(update={"agents": scale_fleet(settings.workload.agents, best)})})
    report, scheduler = simulate(scaled, 30.0)
    assert all(c.ok for c in sla_checks(scheduler, scaled, report["duration_s"]))


def test_sessions_left_waiting_for_admission_do_not_fit():
    # With 8 session slots, every fleet up to the search's limit used to "meet" the SLA: the
    # sessions beyond the slots only waited, and waiting sessions make no calls to be late.
    base = sim_settings(fleet(count=4, ttft_p99_s=5.0))
    settings = base.model_copy(update={"scheduler": base.scheduler.model_copy(update={"max_sessions": 8})})
    result = find_max_sessions(settings, 60.0, echo=lambda _: None, limit=512)
    assert not result["bounded_by_limit"] and 8 <= result["max_sessions"] < 128  # measured: 62


def test_the_search_needs_an_objective(tmp_path, capsys):
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 4\n')
    assert cli_main(["simulate", str(config), "--duration", "1m", "--find-max-sessions"]) == 2
    assert "none of the workload's tenants (a) sets one" in capsys.readouterr().err


def test_cli_simulate_json(tmp_path, capsys):
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[tenants.a]\ntier = "standard"\n[workload]\n[[workload.agents]]\ntenant = "a"\ncount = 4\nturns = 2\nmax_tokens = 16\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "2m", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "sim" and 120 <= report["duration_s"] < 200


def test_cli_simulate_bad_config_exits_2(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text('[backend.sim]\nprofile = "nope"\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\n')
    assert cli_main(["simulate", str(config), "--duration", "1m"]) == 2
    assert "config error" in capsys.readouterr().err


def test_both_loops_simulate_the_same_fleet_alike():
    """Same fleet on asyncio's and trio's virtual clocks: the same work, the same engine figures
    (task order may differ between the loops, so the counts may differ a little, not more)."""
    settings = sim_settings(fleet(count=8))
    on_asyncio, _ = simulate(settings, 600, "asyncio")
    on_trio, _ = simulate(settings, 600, "trio")
    for key in ("calls", "throughput_tok_s"):
        assert on_asyncio[key] == pytest.approx(on_trio[key], rel=0.05), key
    assert on_asyncio["sim"]["engine_busy_frac"] == pytest.approx(on_trio["sim"]["engine_busy_frac"], rel=0.05)


def test_simulate_checks_a_trace_before_the_run_and_runs_one_without_agents(tmp_path, capsys):
    """Before: a bad trace line was a 53-line traceback, a config with a trace and no agents
    was refused, and a bad --profile printed pydantic's multi-line dump."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tenant": "a", "turns": 1}\n{not json\n')
    config = tmp_path / "trace.toml"
    config.write_text(f'[tenants.a]\n[workload]\ntrace = "{trace}"\n')
    assert cli_main(["simulate", str(config)]) == 2
    assert "workload.trace line 2" in capsys.readouterr().err
    trace.write_text('{"tenant": "a", "turns": 1}\n')
    assert cli_main(["simulate", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tenants"][0]["calls"] == 1
    agents = tmp_path / "agents.toml"
    agents.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\n')
    assert cli_main(["simulate", str(agents), "--duration", "5s", "--profile", "BAD"]) == 2
    err = capsys.readouterr().err
    assert "no sim profile 'BAD'" in err and len(err.strip().splitlines()) == 1
    # A bad field of a profile file was named alone ("bogus: Extra inputs are not permitted").
    profile = tmp_path / "prof.toml"
    profile.write_text("[sim]\nbogus = 1\n")
    assert cli_main(["simulate", str(agents), "--duration", "5s", "--profile", str(profile)]) == 2
    assert f"config error: --profile {profile}: bogus: Extra inputs are not permitted" in capsys.readouterr().err



def test_a_profile_on_the_command_line_says_it_replaces_the_config_s_section(tmp_path, capsys):
    """The config's [backend.sim] fields do not apply under --profile: said on stderr (before:
    its kv_cache_tokens, say, was dropped without a word). Nothing to say without the section."""
    config = tmp_path / "c.toml"
    agents = '[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\n'
    config.write_text(agents)
    assert cli_main(["simulate", str(config), "--profile", "tiny-cpu-vllm", "--json"]) == 0
    assert "--profile" not in capsys.readouterr().err
    config.write_text("[backend.sim]\nkv_cache_tokens = 4096\n" + agents)
    assert cli_main(["simulate", str(config), "--profile", "tiny-cpu-vllm", "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: --profile replaces the config's [backend.sim] section; its profile and fields are not used" in err


def test_calls_cancelled_at_the_end_of_a_probe_are_no_call_errors():
    """Calls still under way when the probe's drain grace ends are cancelled with their session:
    no event of the SLA (as in the report), so no failure of the fleet. Before: each counted as a
    call error, and a search failed fleets for the cut that ends every probe ("misses
    solo.call_errors (62 vs 0)" with an infinite TTFT objective)."""
    base = sim_settings(fleet(count=2, ttft_p99_s=5.0))
    agents = [m.model_copy(update={"max_tokens": 4000, "think_s": 0.0, "tool_s": 0.0}) for m in base.workload.agents]
    settings = base.model_copy(update={
        "workload": base.workload.model_copy(update={"agents": agents}),
        "scheduler": base.scheduler.model_copy(update={"drain_grace_s": 1.0}),
    })  # fmt: skip
    report, scheduler = simulate(settings, 10.0)
    assert any(c.error == "CancelledError" for c in scheduler.recorder.calls)  # the case at hand
    checks = {(c.tenant, c.metric): c for c in sla_checks(scheduler, settings, report["duration_s"])}
    assert checks[("live", "call_errors")].value == 0 and checks[("bulk", "call_errors")].value == 0
    assert all(c.ok for c in checks.values())


def test_a_search_where_even_the_smallest_fleet_misses_says_so_and_why(tmp_path, capsys):
    """A TTFT objective below the idle engine's: before, the search printed "largest fleet meeting
    every SLA: 0 sessions {}" (no fleet of 0 was run; nothing said what was missed or that the
    objective cannot be met), having run its smallest fleet twice."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[tenants.solo]\nsla = { ttft_p99_s = 0.0001 }\n[tenants.other]\nsla = { latency_p95_s = 100 }\n'
        '[[workload.agents]]\ntenant = "solo"\ncount = 4\n[[workload.agents]]\ntenant = "other"\ncount = 4\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "20s", "--find-max-sessions"]) == 0
    out, err = capsys.readouterr()
    probes = [line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(probes) == len(set(line.split(":")[0] for line in probes))  # each fleet run once
    assert out.splitlines()[-1].startswith("no fleet meets every SLA: the smallest, 2 sessions (one of each kind), misses solo.ttft_p99_s")
    assert "tenant 'solo': sla.ttft_p99_s = 0.0001 s cannot be met" in err


def test_a_fleet_larger_than_the_searchs_limit_starts_the_search_at_the_limit(monkeypatch):
    """Nearly a million sessions in the config: before, the first probe ran all of them (no answer in
    minutes, memory growing), though the search stops at its limit anyway."""
    import fleetsched.simulate as module

    settings = sim_settings(fleet(count=600_000, ttft_p99_s=5.0))  # 900,000 in all
    real = module.simulate

    def bounded(scaled, *args, **kwargs):
        assert sum(m.count for m in scaled.workload.agents) <= 64, "a probe past the search's limit"
        return real(scaled, *args, **kwargs)

    monkeypatch.setattr(module, "simulate", bounded)
    result = find_max_sessions(settings, 10.0, echo=lambda _: None, limit=64)
    assert result["bounded_by_limit"] and result["max_sessions"] == 64 and list(result["probes"]) == [64]


def test_the_summary_says_why_more_was_simulated_than_the_duration(tmp_path, capsys):
    """Sessions under way at --duration get drain_grace_s to finish: '45 s simulated' for a
    --duration of 30 s said nothing of why (before)."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[scheduler]\ndrain_grace_s = 20\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 4\nturns = 40\nmax_tokens = 16\ntool_s = 1\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "30s"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "s simulated (the fleet for 30 s, then up to 20 s for the sessions under way to finish)" in out


def test_an_arrival_rate_ignored_by_duration_is_noted(tmp_path, capsys):
    """--duration holds `count` sessions at once from the start; workload.arrival_rate = 0.0001
    (3 sessions in about 8 hours) ran 2,249 sessions in 2 minutes without a word (before)."""
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\n[workload]\narrival_rate = 0.0001\n[[workload.agents]]\ntenant = "a"\ncount = 3\nturns = 1\n')
    assert cli_main(["simulate", str(config), "--duration", "20s", "--json"]) == 0
    assert "workload.arrival_rate is used without --duration only" in capsys.readouterr().err


def test_a_fleet_of_more_sessions_than_are_run_is_a_config_error(tmp_path, capsys):
    # A fleet of ten million sessions was taken: `simulate --duration` started a task for each at
    # once, and `run` planned them all, until the machine ran out of memory.
    config = tmp_path / "huge.toml"
    config.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 9000000\n[[workload.agents]]\ntenant = "a"\ncount = 1000001\n')
    assert cli_main(["simulate", str(config), "--duration", "1m"]) == 2
    error = capsys.readouterr().err
    assert "workload.agents" in error and "10,000,001 sessions" in error and "at most 1,000,000" in error


def test_calls_refused_by_the_rate_limit_do_not_fit():
    """A tenant over its requests_per_minute: most calls are refused (rate-limited) and their
    sessions fail, and the report says the SLA was missed. Before, the search's checks read only
    the calls that reached the backend, so this fleet "met every SLA": refused calls (shed too)
    were counted nowhere, and a larger fleet refused more and still fitted."""
    settings = sim_settings(Settings(
        scheduler={"max_sessions": 512, "session_memory": "64MB"},
        backend={"kind": "instant", "max_in_flight": 64, "sim": {"max_num_seqs": 8}},
        tenants={"live": {"requests_per_minute": 60, "sla": {"ttft_p99_s": 3.0}}},
        workload={"agents": [{"tenant": "live", "count": 20, "turns": 2, "prompt_tokens": 300, "max_tokens": 64, "think_s": 1.0}]},
    ))  # fmt: skip
    report, scheduler = simulate(settings, 30.0)
    assert scheduler.recorder.refusals and report["tenants"][0]["sla"]["met"] is False  # the case at hand
    checks = {c.metric: c for c in sla_checks(scheduler, settings, report["duration_s"])}
    assert checks["rate_limited_calls"].value == len(scheduler.recorder.refusals)
    assert not all(c.ok for c in checks.values())


def test_min_tokens_per_s_is_measured_while_the_tenant_is_backlogged():
    """min_tokens_per_s is tokens per second the tenant had a call outstanding (`SlaSettings`,
    and the report's value). Before, the search divided by the whole run: a session thinking 5 s
    between calls got 11.5 tok/s and "missed" 100 (the report: 476 tok/s, met), while 16
    sessions "met" it, so more sessions fitted where fewer did not."""
    settings = sim_settings(Settings(
        backend={"kind": "instant", "sim": {"max_num_seqs": 8}},
        tenants={"live": {"sla": {"min_tokens_per_s": 100.0}}},
        workload={"agents": [{"tenant": "live", "count": 1, "turns": 2, "prompt_tokens": 100, "max_tokens": 32, "think_s": 5.0}]},
    ))  # fmt: skip
    report, scheduler = simulate(settings, 30.0)
    measured = report["tenants"][0]["sla"]["objectives"]["min_tokens_per_s"]
    assert measured["met"] is True
    checks = {c.metric: c for c in sla_checks(scheduler, settings, report["duration_s"])}
    assert checks["min_tokens_per_s"].value == pytest.approx(measured["value"], rel=1e-3)
    assert all(c.ok for c in checks.values())


def test_min_tokens_per_s_counts_the_tokens_of_calls_cut_at_the_runs_end():
    """The search's rate is the report's: tokens of the calls that succeeded or were cut with
    their session, over the backlogged time. Cut calls' time counted without their tokens: a
    fleet whose calls the run's end cut read 821 tok/s in the search, where its report said
    1,546 tok/s, met (the search called it a miss of a 1,000 tok/s objective)."""
    settings = sim_settings(Settings(
        backend={"kind": "sim", "sim": {"max_num_seqs": 8}},
        scheduler={"drain_grace_s": 0},
        tenants={"live": {"sla": {"min_tokens_per_s": 1000.0}}},
        workload={"agents": [{"tenant": "live", "count": 4, "turns": 1, "prompt_tokens": 100, "max_tokens": 4000}]},
    ))  # fmt: skip
    report, scheduler = simulate(settings, 20.0)
    assert any(c.error == "CancelledError" and c.completion_tokens for c in scheduler.recorder.calls)  # the case at hand
    measured = report["tenants"][0]["sla"]["objectives"]["min_tokens_per_s"]
    assert measured["met"] is True
    checks = {c.metric: c for c in sla_checks(scheduler, settings, report["duration_s"])}
    assert checks["min_tokens_per_s"].value == pytest.approx(measured["value"], rel=1e-3)
    assert checks["min_tokens_per_s"].ok


def test_a_p99_objective_fits_only_when_99_percent_of_calls_meet_it():
    """150 calls, 2 of them late: 98.7 % within the TTFT objective, which the report calls missed
    (at least 99 % of events must meet it). Before, the search compared the p99 by linear
    interpolation (0.58 s, between the 148th and 149th values) with the target and the fleet fitted:
    with n not a multiple of 100, or few calls (p99 of 0.1 and 10 s is 9.9 s), the two disagreed."""
    from types import SimpleNamespace

    from fleetsched.observability.sla import evaluate
    from fleetsched.scheduler import CallRecord, Recorder

    settings = Settings(tenants={"live": {"sla": {"ttft_p99_s": 1.0}}})
    recorder = Recorder()
    for i, ttft in enumerate([0.1] * 148 + [1.05] * 2):
        recorder.add_call(CallRecord("live", 0, i, float(i), float(i), i + ttft, i + ttft + 0.5, 5, 10))
    rows, _ = evaluate(recorder, settings.tenants)
    assert rows[0].met is False  # the report's verdict
    checks = {c.metric: c for c in sla_checks(SimpleNamespace(recorder=recorder), settings, 200.0)}
    assert checks["ttft_p99_s"].value == pytest.approx(1.05) and not checks["ttft_p99_s"].ok


DEADLINE_ONLY = (
    '[scheduler]\nmax_sessions = 4\ntool_policy = "keep"\n[tenants.a]\nsla = { deadline_s = 100 }\n'
    '[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 3\ntool_s = 5\n'
)


def test_a_deadline_search_needs_probes_as_long_as_the_deadline(tmp_path, capsys):
    # Every fleet up to the search's limit (65,536) "met" a 100-s deadline in 20-s probes: the
    # sessions cut at a probe's end were younger than the deadline.
    config = tmp_path / "fleet.toml"
    config.write_text(DEADLINE_ONLY)
    assert cli_main(["simulate", str(config), "--duration", "20s", "--find-max-sessions"]) == 2
    assert "--duration: 20 s is shorter than every objective a fleet too large would miss (the shortest: the deadline_s of tenant 'a', 100 s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sla", "message"),
    [
        ("latency_p95_s = 1000", "--duration: 30 s is shorter than every objective a fleet too large would miss (the shortest: the latency_p95_s of tenant 'a', 1000 s)"),
        ("min_tokens_per_s = 10", "needs an objective that a fleet too large misses, and none of the workload's tenants (a) sets one"),
    ],
)
def test_a_search_needs_an_objective_that_waiting_sessions_can_miss(sla, message, tmp_path, capsys):
    """8 slots: before, both searches said "every fleet up to 65536 sessions meets every SLA",
    exit 0, though at 1,024 sessions 984 were never admitted (the tenant's rate, 237.7 tok/s,
    was the same at every size)."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[backend.sim]\nmax_num_seqs = 8\n[scheduler]\nmax_sessions = 8\n[tenants.a]\nsla = {{ {sla} }}\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 4\nturns = 2\nprompt_tokens = 100\nmax_tokens = 16\ntool_s = 1\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "30s", "--find-max-sessions"]) == 2
    assert message in capsys.readouterr().err


def test_a_latency_objective_bounds_the_search_by_the_sessions_wait_for_admission(tmp_path, capsys):
    """Before: every fleet up to 65,536 met a 5 s latency_p95_s, since only the calls of admitted
    sessions were held to it; now their wait for admission is too (42 sessions fit 8 slots)."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nmax_num_seqs = 8\n[scheduler]\nmax_sessions = 8\n[tenants.a]\nsla = { latency_p95_s = 5 }\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 4\nturns = 2\nprompt_tokens = 100\nmax_tokens = 16\ntool_s = 1\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "30s", "--find-max-sessions"]) == 0
    out = capsys.readouterr().out
    assert "misses a.admission_wait_p95_s" in out
    assert out.splitlines()[-1].startswith("largest fleet meeting every SLA: ")
    assert int(out.splitlines()[-1].split(": ")[1].split()[0]) < 100


def test_sessions_ended_at_their_deadline_missed_it(tmp_path):
    # Sessions queued past their deadline fail at it, spanning it exactly: that read as met, and
    # the search passed every fleet to its limit even in probes longer than the deadline.
    config = tmp_path / "fleet.toml"
    config.write_text(DEADLINE_ONLY)
    settings = sim_settings(load_settings(config))
    result = find_max_sessions(settings, 100.0, echo=lambda _: None, limit=1024)
    assert not result["bounded_by_limit"] and 4 <= result["max_sessions"] < 128  # measured: 36


def test_simulate_prints_the_note_run_prints(tmp_path, capsys):
    # `run` said every call would fail with ContextTooLong; `simulate` said nothing (only its
    # JSON held the note).
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\nprompt_tokens = 20000\n')
    assert cli_main(["simulate", str(config)]) == 1  # its one session failed, none done
    err = capsys.readouterr().err
    assert "fleetsched simulate: note: workload.agents[0] (a): its first call has about" in err
    assert "fleetsched simulate: 1 of 1 sessions failed (ContextTooLong 1)" in err


def test_sessions_cancelled_at_the_end_are_in_the_tenant_table(tmp_path, capsys):
    """A fleet held for --duration ends with its sessions under way cancelled: the table showed
    only done and failed, so they were in no table (13 done, 0 failed; the JSON said 18 more)."""
    config = tmp_path / "c.toml"
    config.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 3\nturns = 50\ntool_s = 5\n')
    assert cli_main(["simulate", str(config), "--duration", "20s", "--report", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    cancelled = json.loads((tmp_path / "r.json").read_text())["tenants"][0]["sessions_cancelled"]
    assert cancelled > 0
    header = next(line for line in table.splitlines() if "┃ tenant" in line)  # the first table's
    row = next(line for line in table.splitlines() if line.startswith("│ a "))
    columns = [cell.strip() for cell in header.split("┃")[1:-1]]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[columns.index("cancelled")] == str(cancelled)


def test_the_sla_table_title_counts_the_objectives_missed(tmp_path, capsys):
    """A missed min_tokens_per_s is no breach event: the title read "SLA: 0 breaches" above
    its MISSED row."""
    config = tmp_path / "c.toml"
    config.write_text('[tenants.a]\nsla = { min_tokens_per_s = 1000000 }\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n')
    assert cli_main(["simulate", str(config)]) == 0
    assert "SLA: 0 breaches, 1 objective missed" in capsys.readouterr().out


def _passes_the_check_and_cannot_be_written(path: str) -> bool:
    """Whether `path` passes --report's check and yet cannot be written: /proc, for root."""
    import argparse

    from fleetsched._args import writable_file

    try:
        writable_file(path)
    except argparse.ArgumentTypeError:
        return False
    return os.path.isdir("/proc/self")


@pytest.mark.skipif(not _passes_the_check_and_cannot_be_written("/proc/report.json"), reason="needs /proc as root")
@pytest.mark.parametrize("command", ["run", "simulate"])
def test_a_report_that_cannot_be_written_at_the_end_is_printed_not_lost(tmp_path, capsys, command):
    """--report is checked before the run, yet the write can fail at its end (a disk fills, a
    directory goes): a FileNotFoundError traceback, and the run's figures were lost."""
    config = tmp_path / "c.toml"
    config.write_text('[backend]\nkind = "instant"\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n')
    extra = ["--no-live"] if command == "run" else []
    assert cli_main([command, str(config), "--report", "/proc/report.json", *extra]) == 1
    out, err = capsys.readouterr()
    assert f"fleetsched {command}: cannot write /proc/report.json (" in err and "the report is printed above" in err
    report, end = json.JSONDecoder().raw_decode(out)  # first: the tables come after it
    assert report["schema"] == "fleetsched.run/2" and "SLA" in out[end:]


@pytest.mark.skipif(not _passes_the_check_and_cannot_be_written("/proc/report.json"), reason="needs /proc as root")
def test_a_report_that_cannot_be_written_is_printed_once_with_json(tmp_path, capsys):
    """With --json too, the JSON was printed twice: by the failed write, and as asked."""
    config = tmp_path / "c.toml"
    config.write_text('[backend]\nkind = "instant"\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n')
    assert cli_main(["simulate", str(config), "--json", "--report", "/proc/report.json"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out)["schema"] == "fleetsched.run/2"  # one document, nothing after it


def test_a_profile_on_the_command_line_keeps_its_own_stream_interval(tmp_path, capsys):
    """--profile FILE whose [sim] sets a stream_interval simulates with it, as the same profile
    named in the config's [backend.sim] does; before, --profile put simulate's default of 8 over
    it. A profile without one gets the default, and --stream-interval goes over both."""
    profile = tmp_path / "p.toml"
    profile.write_text("[profile]\ndescription = 'one token a chunk'\n[sim]\nstream_interval = 1\n")
    config = tmp_path / "c.toml"
    config.write_text('[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\n')

    def interval(*extra: str) -> int:
        assert cli_main(["simulate", str(config), "--duration", "10s", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["sim"]["stream_interval"]

    assert interval("--profile", str(profile)) == 1
    assert interval("--profile", "tiny-cpu-vllm") == 8
    assert interval("--profile", str(profile), "--stream-interval", "4") == 4


def test_the_start_up_check_s_ttft_floor_is_what_a_lone_call_takes_on_a_calibrated_profile(tmp_path, capsys):
    """The floor left out the API server's turn and the hand-off (request_serial_s and
    request_overhead_s, which calibrated profiles set): 2.9 ms on tiny-cpu-vllm where a lone call
    took 9.0 ms, so a 5 ms objective was not flagged, then missed."""
    config = tmp_path / "floor.toml"
    config.write_text(
        '[tenants.a]\nsla = { ttft_p99_s = 0.005 }\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\nprompt_tokens = 100\nmax_tokens = 16\n'
    )
    assert cli_main(["simulate", str(config), "--profile", "tiny-cpu-vllm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    floor = report["sla"]["feasibility"]["unloaded_ttft_s"]["a"]
    assert floor == pytest.approx(report["tenants"][0]["ttft_s"]["p50"], rel=0.01)
    assert [u["tenant"] for u in report["sla"]["feasibility"]["unreachable"]] == ["a"]


def test_the_start_up_check_reads_a_trace_s_prompts_and_warns_with_json_too(tmp_path, capsys):
    """A tenant whose sessions all come from a trace was judged by the probe's 9-token prompt
    (not flagged, then every call missed); and with --json the warning was not printed, where the
    report's schema says it is printed on stderr."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"at": 0, "tenant": "a", "turns": 1, "prompt_tokens": 4000, "max_tokens": 4}\n')
    config = tmp_path / "trace.toml"
    config.write_text(f'[tenants.a]\nsla = {{ ttft_p99_s = 0.005 }}\n[workload]\ntrace = "{trace}"\n')
    assert cli_main(["simulate", str(config), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [u["tenant"] for u in report["sla"]["feasibility"]["unreachable"]] == ["a"]
    assert "4027-token prompt" in report["sla"]["feasibility"]["unreachable"][0]["message"]
    assert "fleetsched simulate: warning: tenant 'a': sla.ttft_p99_s = 0.005 s cannot be met" in captured.err


def test_trace_sessions_whose_first_call_cannot_fit_are_noted_at_the_start(tmp_path, capsys):
    """As agent mixes are: a trace line with a 9,000,000-token prompt failed its session without
    a word (exit 0). Alike sessions are counted in one note, not one note each."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tenant": "a", "prompt_tokens": 9000000, "turns": 1}\n' * 3 + '{"tenant": "a", "turns": 1}\n')
    config = tmp_path / "trace.toml"
    config.write_text(f'[tenants.a]\n[workload]\ntrace = "{trace}"\n')
    assert cli_main(["simulate", str(config)]) == 0
    err = capsys.readouterr().err
    assert "workload.trace session 1 (a, and 2 alike): its first call has about 9000027 prompt tokens" in err
    assert "every call will fail with ContextTooLong" in err and "session 4" not in err


def test_a_tenant_whose_prompts_cannot_fit_is_not_called_slow_at_the_start(tmp_path, capsys):
    """Its TTFT objective was flagged as beyond "the idle engine['s] 6.691 s to the first token of
    a 900027-token prompt", a prompt the engine refuses: every call fails, as the note says."""
    config = tmp_path / "long.toml"
    config.write_text(
        '[tenants.a]\nsla = { ttft_p99_s = 1.0 }\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\nprompt_tokens = 9000\nmax_tokens = 16\n'
    )
    assert cli_main(["simulate", str(config), "--json"]) == 1  # every session failed
    captured = capsys.readouterr()
    feasibility = json.loads(captured.out)["sla"]["feasibility"]
    assert feasibility["unreachable"] == [] and "a" not in feasibility["unloaded_ttft_s"]
    assert "every call will fail with ContextTooLong" in feasibility["note"] and "cannot be met" not in captured.err


def test_the_search_looks_past_fleets_refused_only_by_their_own_rate_limits(monkeypatch):
    """A tenant's own rate limit refuses its calls in small fleets, where the engine runs them
    fast, and not in larger ones, where the higher tiers slow them under it. The search took a
    larger fleet to miss whatever a smaller one missed: `examples/tenant_slas.toml` at
    `--duration 10m` answered 6 sessions (7 to 45 refused, 90 and 180 past the engine's edge)
    where 48 to 72 meet every objective; run for real it now answers 72. The verdicts of that
    run, by fleet size, stand in for the simulations here (each took 3-13 s)."""
    import fleetsched.simulate as simulate_module
    from fleetsched.simulate import RATE_LIMITED, SlaCheck

    def verdict(sessions: int) -> list[SlaCheck]:
        if 7 <= sessions <= 45:
            return [SlaCheck("warehouse", RATE_LIMITED, 0, 170)]
        if sessions >= 74:
            return [SlaCheck("warehouse", "admission_wait_p99_s", 20, 60)]
        return []

    def fake_simulate(settings, duration_s, loop):
        sessions = sum(m.count for m in settings.workload.agents)
        report = {"duration_s": duration_s, "wall_s": 0.0, "sla": {"feasibility": {"unreachable": [], "note": None}}}
        return report, sessions

    monkeypatch.setattr(simulate_module, "simulate", fake_simulate)
    monkeypatch.setattr(simulate_module, "sla_checks", lambda sessions, settings, duration_s: verdict(sessions))
    monkeypatch.setattr(simulate_module, "throughput_text", lambda report: "")
    for count in (4, 20, 40, 60, 180):  # the search starts from the config's fleet
        settings = Settings(tenants={"warehouse": {}}, workload={"agents": [{"tenant": "warehouse", "count": count}]})
        result = find_max_sessions(settings, 600.0, echo=lambda _: None)
        assert result["max_sessions"] == 73 and result["first_miss"] == 74, count
        assert all(not result["probes"][n] for n in result["rate_limited"]) and (count > 45 or result["rate_limited"])


def test_the_search_says_how_much_of_a_rate_limit_a_probe_hides(tmp_path, capsys):
    """A bucket starts with a minute's worth: in 2-minute probes a tenant 18-26 % over its
    tokens_per_minute met it (refused from the fifth minute on), and nothing said so."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[backend.sim]\nmax_num_seqs = 8\n[scheduler]\nmax_sessions = 8\n[tenants.a]\ntokens_per_minute = 100000\n'
        'sla = { latency_p95_s = 5 }\n[[workload.agents]]\ntenant = "a"\ncount = 4\nturns = 2\nprompt_tokens = 100\n'
        "max_tokens = 16\ntool_s = 1\n"
    )
    assert cli_main(["simulate", str(config), "--duration", "2m", "--find-max-sessions"]) == 0
    err = capsys.readouterr().err
    assert "a set rate limits" in err and "up to 50 % over its limit is not refused" in err
    assert cli_main(["simulate", str(config), "--duration", "1x"]) == 2
    assert "--duration: not a duration" in capsys.readouterr().err


def test_with_repeats_every_run_of_the_answer_meets_every_sla():
    """One run of a size is one sample: near the edge a size passed by chance, and the search
    trusted it (one seed answered 108 sessions where runs of 95 to 104 missed). With repeats,
    the answer met its objectives in each of its runs, one seed each."""
    settings = sim_settings(fleet(count=4, ttft_p99_s=0.5))
    result = find_max_sessions(settings, 30.0, echo=lambda _: None, limit=2048, repeats=3)
    best = result["max_sessions"]
    assert result["repeats"] == 3 and result["probes"][best] is True
    for seed in range(3):
        workload = settings.workload.model_copy(update={"agents": scale_fleet(settings.workload.agents, best), "seed": seed})
        scaled = settings.model_copy(update={"workload": workload})
        report, scheduler = simulate(scaled, 30.0)
        assert all(c.ok for c in sla_checks(scheduler, scaled, report["duration_s"])), seed


def test_repeats_apply_to_the_search_only(tmp_path, capsys):
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\nsla = { ttft_p99_s = 1 }\n[[workload.agents]]\ntenant = "a"\ncount = 2\n')
    with pytest.raises(SystemExit):
        cli_main(["simulate", str(config), "--duration", "10s", "--repeats", "3"])
    assert "--repeats applies only with --find-max-sessions" in capsys.readouterr().err


def test_the_search_says_what_the_start_up_check_notes_and_which_objectives_a_probe_cannot_see(tmp_path, capsys):
    """An agent whose every call is over the context failed the search's smallest fleet with
    "misses big.call_errors (N vs 0)", where a plain run says why (the start-up check's note);
    and an objective longer than a probe went unsaid, the answer resting on the others alone."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[tenants.a]\nsla = { ttft_p99_s = 1, deadline_s = 300 }\n[tenants.big]\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 2\n'
        '[[workload.agents]]\ntenant = "big"\ncount = 1\nprompt_tokens = 2000000\n'
    )
    assert cli_main(["simulate", str(config), "--duration", "20s", "--find-max-sessions"]) == 0
    out, err = capsys.readouterr()
    assert "misses big.call_errors" in out
    assert "note: a probe of 20 s cannot see the deadline_s of tenant 'a' (300 s) missed" in err
    assert "fleetsched simulate: note: workload.agents[1]" in err and "ContextTooLong" in err


def test_the_sla_table_rounds_attainment_down():
    """98.99 % of calls on time read "99.0%" beside MISSED against a 99 % objective."""
    from fleetsched.report import sla_rows

    report, _ = simulate(sim_settings(fleet(count=2, ttft_p99_s=2.0)), 10.0)
    objective = report["tenants"][0]["sla"]["objectives"]["ttft_p99"]
    objective.update(attainment=0.9899, met=False)
    cells = [cell for row in sla_rows(report) for cell in row]
    assert "98.9%" in cells and "99.0%" not in cells


def _search_with_verdicts(monkeypatch, verdict, unreachable=(), note=None):
    """Stand the simulations of a search in by `verdict(sessions, seed)` (a list of SlaChecks
    missed), as `test_the_search_looks_past_fleets_refused_only_by_their_own_rate_limits` does."""
    import fleetsched.simulate as simulate_module

    def fake_simulate(settings, duration_s, loop):
        report = {"duration_s": duration_s, "wall_s": 0.0, "sla": {"feasibility": {"unreachable": [{"message": m} for m in unreachable], "note": note}}}
        return report, (sum(m.count for m in settings.workload.agents), settings.workload.seed)

    monkeypatch.setattr(simulate_module, "simulate", fake_simulate)
    monkeypatch.setattr(simulate_module, "sla_checks", lambda ran, settings, duration_s: verdict(*ran))
    monkeypatch.setattr(simulate_module, "throughput_text", lambda report: "")


def _one_tenant(count: int) -> Settings:
    return Settings(tenants={"a": {"sla": {"ttft_p99_s": 1.0}}}, workload={"agents": [{"tenant": "a", "count": count}]})


def test_the_search_bisects_to_the_last_fleet_before_the_first_miss(monkeypatch):
    """Fleets of 50 and more miss: grown 4, 8, ... 64, then bisected to 49, the next run 50."""
    from fleetsched.simulate import SlaCheck

    _search_with_verdicts(monkeypatch, lambda n, seed: [SlaCheck("a", "ttft_p99_s", 1.0, 2.0)] if n >= 50 else [])
    result = find_max_sessions(_one_tenant(4), 60.0, echo=lambda _: None)
    assert (result["max_sessions"], result["first_miss"], result["bounded_by_limit"]) == (49, 50, False)
    assert result["smallest_misses"] is None and result["agents"] == {"a-0": 49}


def test_a_search_that_reaches_its_limit_runs_the_limit_and_says_it_is_bounded(monkeypatch):
    """Every fleet meets: grown by doubling up to the limit itself (64), which is the answer."""
    _search_with_verdicts(monkeypatch, lambda n, seed: [])
    result = find_max_sessions(_one_tenant(4), 60.0, echo=lambda _: None, limit=64)
    assert result["bounded_by_limit"] and result["max_sessions"] == 64 and list(result["probes"]) == [4, 8, 16, 32, 64]


def test_a_search_bounded_only_by_rate_limits_at_its_limit_is_not_bounded_by_it(monkeypatch):
    """Fleets of 32 and more are refused only by their own rate limits up to the limit: the
    answer (31) is below the limit, so the search is not bounded by it."""
    from fleetsched.simulate import RATE_LIMITED, SlaCheck

    _search_with_verdicts(monkeypatch, lambda n, seed: [SlaCheck("a", RATE_LIMITED, 0, 5)] if n >= 32 else [])
    result = find_max_sessions(_one_tenant(4), 60.0, echo=lambda _: None, limit=64)
    assert result["max_sessions"] == 31 and not result["bounded_by_limit"] and result["first_miss"] == 32


def test_the_start_up_check_s_messages_are_taken_from_the_first_probe_only(monkeypatch):
    """Each probe's report repeats them: the result lists each message and note once."""
    _search_with_verdicts(monkeypatch, lambda n, seed: [], unreachable=["objective x cannot be met"], note="a note")
    result = find_max_sessions(_one_tenant(4), 60.0, echo=lambda _: None, limit=64)
    assert len(result["probes"]) > 1 and result["unreachable"] == ["objective x cannot be met"] and result["notes"] == ["a note"]


def test_a_miss_names_its_seed_only_when_sizes_are_repeated(monkeypatch):
    """With --repeats the miss says which run missed; with one run there is no seed to name."""
    from fleetsched.simulate import SlaCheck

    _search_with_verdicts(monkeypatch, lambda n, seed: [SlaCheck("a", "ttft_p99_s", 1.0, 2.0)] if n >= 50 - 10 * seed else [])
    lines: list[str] = []
    assert find_max_sessions(_one_tenant(4), 60.0, echo=lines.append)["max_sessions"] == 49
    assert any("misses a.ttft_p99_s (2 vs 1)" in line for line in lines) and not any("seed" in line for line in lines)
    lines.clear()
    assert find_max_sessions(_one_tenant(4), 60.0, echo=lines.append, repeats=2)["max_sessions"] == 39
    assert any(line.endswith("misses a.ttft_p99_s (2 vs 1) (seed 1, run 2 of 2) [0.0 s wall]") for line in lines)


def test_a_smallest_fleet_refused_by_rate_limits_is_no_miss_when_a_larger_one_meets(monkeypatch):
    """smallest_misses says what the smallest fleet missed only when no fleet meets."""
    from fleetsched.simulate import RATE_LIMITED, SlaCheck

    def verdict(n, seed):
        return [SlaCheck("a", RATE_LIMITED, 0, 5)] if n < 4 else [SlaCheck("a", "ttft_p99_s", 1.0, 2.0)] if n >= 20 else []

    _search_with_verdicts(monkeypatch, verdict)
    result = find_max_sessions(_one_tenant(1), 60.0, echo=lambda _: None)
    assert result["max_sessions"] == 19 and 1 in result["rate_limited"] and result["smallest_misses"] is None


def test_parse_duration_takes_a_year_and_no_more():
    """365 days is the longest --duration taken; a day more is refused."""
    assert parse_duration("365d") == 365 * 86400
    with pytest.raises(ValueError, match="at most 365 days"):
        parse_duration("366d")


def test_scale_fleet_rounds_each_entry_to_the_nearest():
    """2:1 scaled to 5 sessions is 3 and 2 (3.33 and 1.67 rounded), not 3 and 1."""
    assert [m.count for m in scale_fleet(fleet(count=2).workload.agents, 5)] == [3, 2]


def _checks(recorder, **sla):
    from types import SimpleNamespace

    settings = Settings(tenants={"live": {"sla": sla}, "idle": {"sla": {"ttft_p99_s": 1.0}}})
    return {(c.tenant, c.metric): c for c in sla_checks(SimpleNamespace(recorder=recorder), settings, 100.0)}


def _session(state: str, span: float, error: str | None = None):
    from fleetsched.scheduler.records import SessionRecord

    return SessionRecord("live", 0, "k", state, 0.0, 0.0, span, 1, 10, 10, error=error)


def test_a_tenant_of_no_calls_or_sessions_has_no_checks():
    """A tenant with an SLA that the workload never ran is not held to it (nothing measured)."""
    from fleetsched.scheduler import CallRecord, Recorder

    recorder = Recorder()
    recorder.add_call(CallRecord("live", 0, 0, 0.0, 0.0, 0.1, 1.0, 5, 10))
    recorder.add_session(_session("done", 1.0))
    checks = _checks(recorder, ttft_p99_s=1.0)
    assert not any(tenant == "idle" for tenant, _ in checks) and all(c.ok for c in checks.values())


def test_min_tokens_per_s_is_met_at_exactly_the_target():
    """100 tokens in the one second the tenant was backlogged meets 100 tok/s."""
    from fleetsched.scheduler import CallRecord, Recorder

    recorder = Recorder()
    recorder.add_call(CallRecord("live", 0, 0, 0.0, 0.0, 0.1, 1.0, 5, 100))
    assert _checks(recorder, min_tokens_per_s=100.0)[("live", "min_tokens_per_s")].ok


def test_min_tokens_per_s_with_no_backlog_is_none_measured():
    """A tenant whose sessions never made a call has no rate to show: it misses, 'none measured'."""
    from fleetsched.scheduler import Recorder

    recorder = Recorder()
    recorder.add_session(_session("cancelled", 5.0))
    check = _checks(recorder, min_tokens_per_s=10.0)[("live", "min_tokens_per_s")]
    assert not check.ok and check.measured == "none measured"


@pytest.mark.parametrize(
    ("session", "met"),
    [
        (_session("done", 100.0), True),  # done at the deadline: met
        (_session("failed", 99.0), True),  # failed for another reason within it: its span counts
        (_session("cancelled", 100.0), False),  # unfinished at the deadline: missed it
        (_session("failed", 99.0, "DeadlineExceeded"), False),  # ended by its deadline: missed
    ],
)
def test_a_session_misses_its_deadline_unless_it_ended_before_it_or_was_done(session, met):
    """Only a done session may span the deadline exactly; one its deadline ended missed it."""
    from fleetsched.scheduler import Recorder

    recorder = Recorder()
    recorder.add_session(session)
    assert _checks(recorder, deadline_s=100.0)[("live", "deadline_s")].ok is met


def test_a_fleet_that_misses_more_than_its_rate_limits_is_past_the_edge(monkeypatch):
    """Refused by its rate limits and late too: a miss, not a fleet within the engine's edge."""
    from fleetsched.simulate import RATE_LIMITED, SlaCheck

    def verdict(n, seed):
        refused = [SlaCheck("a", RATE_LIMITED, 0, 5)] if n >= 20 else []
        return refused + ([SlaCheck("a", "ttft_p99_s", 1.0, 2.0)] if n >= 50 else [])

    _search_with_verdicts(monkeypatch, verdict)
    result = find_max_sessions(_one_tenant(4), 60.0, echo=lambda _: None, limit=256)
    assert result["max_sessions"] == 19 and not result["bounded_by_limit"] and 64 not in result["rate_limited"]


def test_a_search_of_one_entry_where_the_smallest_misses_names_one_session(tmp_path, capsys):
    """One entry: the smallest fleet is one session, said in the singular, with no 'of each kind'."""
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\nsla = { ttft_p99_s = 0.0001 }\n[[workload.agents]]\ntenant = "a"\ncount = 4\n')
    assert cli_main(["simulate", str(config), "--duration", "20s", "--find-max-sessions"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("no fleet meets every SLA: the smallest, 1 session, misses a.ttft_p99_s (")


def test_the_search_s_answer_says_the_next_miss_and_that_each_size_ran_once(tmp_path, capsys, monkeypatch):
    """Fleets refused by their rate limits below the answer are no note; one run a size is noted."""
    from fleetsched.simulate import RATE_LIMITED, SlaCheck

    def verdict(n, seed):
        return [SlaCheck("a", RATE_LIMITED, 0, 5)] if 7 <= n <= 45 else [SlaCheck("a", "ttft_p99_s", 1.0, 2.0)] if n >= 74 else []

    _search_with_verdicts(monkeypatch, verdict)
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\nsla = { ttft_p99_s = 1 }\n[[workload.agents]]\ntenant = "a"\ncount = 4\n')
    assert cli_main(["simulate", str(config), "--duration", "1m", "--find-max-sessions"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "largest fleet meeting every SLA: 73 sessions {'a-0': 73}; the next fleet run, 74 sessions, misses"
    assert "each size ran once" in err
    assert cli_main(["simulate", str(config), "--duration", "1m", "--find-max-sessions", "--repeats", "2"]) == 0
    assert "each size ran once" not in capsys.readouterr().err


def test_a_deadline_missed_by_an_unfinished_session_says_so(monkeypatch):
    """A deadline missed by a session cut at it reads 'a session ended past it', not 'inf'."""
    import math

    from fleetsched.simulate import SlaCheck

    _search_with_verdicts(monkeypatch, lambda n, seed: [SlaCheck("a", "deadline_s", 100.0, math.inf)] if n >= 8 else [])
    lines: list[str] = []
    find_max_sessions(_one_tenant(4), 100.0, echo=lines.append)
    assert any("misses a.deadline_s (a session ended past it vs 100)" in line for line in lines)


def test_a_probe_as_long_as_the_objectives_is_long_enough(tmp_path, capsys, monkeypatch):
    """--duration 1m holds a fleet to 60 s objectives: the search runs, and notes none unseen."""
    from fleetsched.simulate import SlaCheck

    _search_with_verdicts(monkeypatch, lambda n, seed: [SlaCheck("a", "ttft_p99_s", 60.0, 90.0)] if n >= 8 else [])
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.a]\nsla = { ttft_p99_s = 60, deadline_s = 60 }\n[[workload.agents]]\ntenant = "a"\ncount = 4\n')
    assert cli_main(["simulate", str(config), "--duration", "1m", "--find-max-sessions"]) == 0
    out, err = capsys.readouterr()
    assert "largest fleet meeting every SLA: 7 sessions" in out and "cannot see" not in err


def test_a_config_with_nothing_to_run_is_a_config_error(tmp_path, capsys):
    """No agents and no trace: without --duration there is nothing to simulate, said as run says it."""
    config = tmp_path / "empty.toml"
    config.write_text("[tenants.a]\n")
    assert cli_main(["simulate", str(config)]) == 2
    assert "config error: workload: the config describes no sessions to run (agents or a trace)" in capsys.readouterr().err


def test_a_run_cut_at_its_duration_says_nothing_of_a_drain(tmp_path, capsys):
    """With drain_grace_s = 0 the run ends at --duration: no word of sessions given time to finish."""
    config = tmp_path / "fleet.toml"
    config.write_text('[scheduler]\ndrain_grace_s = 0\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 40\nmax_tokens = 16\ntool_s = 1\n')
    assert cli_main(["simulate", str(config), "--duration", "10s"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "10 s simulated in" in out and "then up to" not in out


def test_duration_needs_agents_and_the_search_needs_duration(tmp_path, capsys):
    """--duration holds the config's agents (a trace alone is refused), and the search needs it."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tenant": "a", "turns": 1}\n')
    config = tmp_path / "trace.toml"
    config.write_text(f'[tenants.a]\n[workload]\ntrace = "{trace}"\n')
    assert cli_main(["simulate", str(config), "--duration", "10s"]) == 2
    assert "config error: workload.agents: --duration holds a fleet of the config's agents, and it describes none" in capsys.readouterr().err
    config.write_text('[tenants.a]\nsla = { ttft_p99_s = 1 }\n[[workload.agents]]\ntenant = "a"\ncount = 2\n')
    assert cli_main(["simulate", str(config), "--find-max-sessions"]) == 2
    assert "config error: --duration: --find-max-sessions needs --duration" in capsys.readouterr().err


def test_a_trace_ignored_by_duration_is_not_judged_at_the_start(tmp_path, capsys):
    """--duration holds the config's agents and says the trace is ignored; the start-up check
    still read the trace and noted its sessions ("every call will fail with ContextTooLong"),
    sessions the run never ran."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tenant": "a", "prompt_tokens": 9000000, "turns": 1}\n')
    config = tmp_path / "both.toml"
    config.write_text(f'[tenants.a]\n[workload]\ntrace = "{trace}"\n[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\n')
    assert cli_main(["simulate", str(config), "--duration", "10s"]) == 0
    err = capsys.readouterr().err
    assert "workload.trace is replayed without --duration only; ignored" in err
    assert "workload.trace session" not in err and "ContextTooLong" not in err


def test_an_empty_profile_on_the_command_line_is_refused(tmp_path, capsys):
    """`--profile ""` ran the config on the default engine, its note saying the config's
    [backend.sim] was replaced, and the report's sim.profile read ""."""
    config = tmp_path / "c.toml"
    config.write_text('[backend.sim]\nmax_num_seqs = 4\n[tenants.a]\n[[workload.agents]]\ntenant = "a"\ncount = 1\nturns = 1\n')
    assert cli_main(["simulate", str(config), "--profile", "", "--json"]) == 2
    assert "no sim profile ''" in capsys.readouterr().err
