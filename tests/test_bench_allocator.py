"""The allocator bench's replay: pin changes at the cycle's edges, honest figures on small traces."""

import math

import pytest

from fleetsched.bench.allocator import (
    LOAD,
    Session,
    _pinned_floor,
    _room_by_moving,
    _unpacked,
    offered_load,
    replay,
    traces,
)
from fleetsched.resources import DeviceSpec, ExtentPool

PAGE = 1 << 20


def test_next_change_walks_the_cycle_edges():
    s = Session(arrival=10.0, nbytes=1, lifetime=5.0, idle_share=0.25, cycle=2.0, phase=0.5)
    t, idle = s.next_change(10.0)  # busy until 0.75 of the cycle: 0.25 cycles = 0.5 later
    assert (t, idle) == (pytest.approx(10.5), True)
    assert not s.movable_at(10.49) and s.movable_at(10.51)
    t, idle = s.next_change(10.6)  # idle until the cycle ends
    assert (t, idle) == (pytest.approx(11.0), False)
    assert not s.movable_at(11.01)
    assert Session(0.0, 1, 1.0).next_change(0.0)[0] == math.inf  # never idle: never changes


def test_traces_offer_the_load_they_claim():
    # Within the noise of the arrival gaps: 500 bursts of 8 make the batch trace's span vary ~5 %.
    for seed in (0, 1):
        for trace in traces(4000, seed=seed):
            assert offered_load(trace) == pytest.approx(LOAD, abs=0.05), (seed, trace.name)


@pytest.fixture(scope="module")
def small():
    return {t.name: t for t in traces(300, seed=0)}


def test_replay_figures_hold_together(small):
    trace = small["tool-agents"]
    shipped = replay(trace, "frag-aware")
    still = replay(trace, "first-fit", compact=False)
    counting = replay(trace, "counting")
    assert 0 <= shipped["failures_no_room"] <= shipped["frag_failures"]
    assert still["moves"] == 0 and still["moved_gb_per_gb_granted"] == 0 and still["settles"] == 0
    assert shipped["moves"] > 0 and shipped["settles"] > 0
    assert counting["frag_failures"] == 0 and counting["frag_mean"] == 0
    assert 0 <= shipped["frag_mean"] <= shipped["frag_p95"] <= 1
    # A repacking of the movable sessions never leaves more fragmentation than there is.
    for row in (shipped, still):
        assert 0 <= row["frag_pinned_floor"] <= row["frag_mean"]
    assert still["frag_pinned_floor"] < still["frag_mean"]  # placement only leaves packing undone


def test_batch_sessions_never_move(small):
    row = replay(small["batch"], "frag-aware")
    assert row["moves"] == 0  # a batch job generates without pause: never movable
    assert row["frag_pinned_floor"] == pytest.approx(row["frag_mean"])  # so no repacking helps


def test_room_by_moving_sees_what_pinned_sessions_allow():
    pool = ExtentPool([DeviceSpec("gpu0", 10 * PAGE)], strategy="first-fit", page_size=PAGE, compact=False)
    held = [pool.reserve_nowait(2 * PAGE) for _ in range(5)]
    held[1].release()
    held[3].release()  # [r0][ ][r2][ ][r4]: 4 pages free, 2 at most in one run
    assert not _room_by_moving(pool, 4 * PAGE)  # all pinned
    held[2].movable = True
    assert _room_by_moving(pool, 4 * PAGE)  # r2 slides down: 4 pages at 4-7
    assert not _room_by_moving(pool, 5 * PAGE)


def test_pinned_floor_is_what_repacking_the_movable_sessions_leaves():
    pool = ExtentPool([DeviceSpec("gpu0", 10 * PAGE)], strategy="first-fit", page_size=PAGE, compact=False)
    held = [pool.reserve_nowait(2 * PAGE) for _ in range(5)]
    held[1].release()
    held[3].release()  # [r0][ ][r2][ ][r4]: 4 pages free in two runs
    assert _pinned_floor(pool) == pytest.approx(0.5)  # all pinned: as fragmented as it is
    held[2].movable = True
    assert _pinned_floor(pool) == 0.0  # r2 could slide down: one run of 4
    held[2].movable = False
    held[4].movable = True  # r4 fits the hole at 2-3: the run 6-9 could be whole
    assert _pinned_floor(pool) == 0.0


def test_unpacked_counts_what_first_fit_decreasing_leaves_out():
    assert _unpacked([3, 2, 2], [4, 3]) == 0
    assert _unpacked([3, 3], [4, 2]) == 3
    assert _unpacked([], []) == 0


@pytest.mark.parametrize("value", ["bogus", "best-fit,bogus", ",", ""])
def test_bad_strategies_are_a_usage_error_naming_the_option(value, capsys):
    """Before: a ValueError traceback from the replay ("bogus"), or a run of no strategy at all
    whose tables were empty ("," and "")."""
    from fleetsched.bench.allocator import main

    with pytest.raises(SystemExit) as exited:
        main(["--sessions", "10", "--strategies", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --strategies:" in err and "known: frag-aware" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--load", "1e-15"], "argument --load: expected a number from 0.01 to 10"),  # the replay looped for ever
        (["--load", "1e-320"], "argument --load: expected a number from 0.01 to 10"),  # a ValueError traceback
        (["--hint-noise", "1000"], "argument --hint-noise: expected a number from 0 to 5"),  # an OverflowError
    ],
)
def test_values_that_break_the_replay_are_a_usage_error(argv, expected, capsys):
    from fleetsched.bench.allocator import main

    with pytest.raises(SystemExit) as exited:
        main(["--sessions", "10", *argv])
    assert exited.value.code == 2 and expected in capsys.readouterr().err


def test_one_session_per_trace_gives_json_without_infinity(capsys):
    # One session: no span between arrivals, so no offered load to measure. It was math.inf,
    # which json.dumps writes as Infinity (not JSON); the figure is null instead.
    import json

    from fleetsched.bench.allocator import main

    assert main(["--sessions", "1", "--strategies", "first-fit", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert all(t["offered_load"] is None for t in data["traces"].values())


def test_hinted_replay_hands_every_session_its_expected_end(small):
    trace = small["batch"]
    exact = replay(trace, "frag-aware", expected=trace.hints(0.0))
    noisy = replay(trace, "frag-aware", expected=trace.hints(0.5))
    plain = replay(trace, "frag-aware")
    assert trace.hints(0.0) == [s.lifetime for s in trace.sessions]
    spread = [h / s.lifetime for h, s in zip(trace.hints(0.5), trace.sessions)]
    assert min(spread) < 0.7 and max(spread) > 1.4 and trace.hints(0.5) == trace.hints(0.5)  # seeded
    # Hints move placements (batch jobs never move, so only placement differs), not the load.
    assert exact["frag_mean"] != plain["frag_mean"] and noisy["frag_mean"] != plain["frag_mean"]
    assert exact["peak_util"] <= 1 and exact["moves"] == 0


def test_kind_means_are_each_kinds_mean_lifetime(small):
    trace = small["mixed"]
    means = dict(zip((s.kind for s in trace.sessions), trace.kind_means()))
    assert set(means) == {"chat", "tool", "batch"}
    for kind, mean in means.items():
        assert mean == pytest.approx(sum(s.lifetime for s in trace.sessions if s.kind == kind) / sum(s.kind == kind for s in trace.sessions))
    assert {s.kind for s in small["seeds-80g"].sessions} == {"seeds"}


def test_the_json_reports_the_hinted_row_beside_the_shipped_one(capsys):
    import json

    from fleetsched.bench.allocator import main

    assert main(["--sessions", "200", "--strategies", "frag-aware,first-fit", "--hint-noise", "0.3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hint_noise"] == 0.3 and data["default_hinted"]["frag_failures"] >= 0
    for name, target in data["targets"].items():
        for row in ("hinted", "kind_hinted"):
            failures = data["traces"][name][row]["frag_failures"]
            assert target[f"default_{row}"] == failures
            first_fit = target["first_fit_placement_only"]
            assert target[f"default_{row}_over_first_fit"] == (round(failures / first_fit, 3) if first_fit else None)


def test_a_ratio_over_a_first_fit_with_no_failures_is_null_not_a_number():
    """Before: a zero denominator was read as 1, so 0 failures of 0 reported 0.0 (the target of
    1/5 met) and 3 of 0 reported 3.0; multi-gpu has none either way at 200 sessions."""
    from fleetsched.bench.allocator import _targets

    def rows(default: int, first_fit: int) -> dict:
        return {"t": {"frag-aware": {"frag_failures": default, "frag_mean": 0.1, "frag_pinned_floor": 0.0},
                      "first-fit": {"frag_failures": first_fit, "frag_mean": 0.2, "frag_pinned_floor": 0.0}}}  # fmt: skip

    def one(default: int) -> dict:
        return {"t": {"frag_failures": default, "frag_mean": 0.1}}

    for default in (0, 3):
        target = _targets(rows(default, 0), rows(default, 0), rows(default, 0), one(default), one(default), one(default))["t"]
        ratios = {k: v for k, v in target.items() if "_over_first_fit" in k}
        assert len(ratios) == 9 and all(v is None for v in ratios.values()), ratios
    target = _targets(rows(3, 4), rows(3, 4), rows(1, 2), one(3), one(3), one(3))["t"]
    assert target["default_over_first_fit_shipped"] == 0.75 and target["default_shipped_over_first_fit"] == 1.5


def test_the_rows_over_all_traces_keep_each_figure_what_it_says(small):
    """Before: peak_util over the traces was the mean of their peaks, held at no moment of any
    trace; the module docstring now says how each figure is carried over the traces."""
    from fleetsched.bench.allocator import _aggregate

    rows = [replay(small[name], "first-fit", compact=False) for name in ("chat", "multi-gpu")]
    assert rows[0]["peak_util"] != rows[1]["peak_util"]
    total = _aggregate(rows)
    assert total["peak_util"] == max(r["peak_util"] for r in rows)
    assert total["frag_p95"] == max(r["frag_p95"] for r in rows)
    assert total["frag_mean"] == pytest.approx((rows[0]["frag_mean"] + rows[1]["frag_mean"]) / 2)
    assert total["frag_failures"] == rows[0]["frag_failures"] + rows[1]["frag_failures"]


def test_bytes_moved_per_byte_granted_over_the_traces_counts_every_trace(small):
    """Before: the bytes granted were read back from each trace's ratio, so a trace that moved
    nothing (batch: its jobs never pause) dropped out of the denominator: 1.94 instead of 1.39
    on the six traces of 200 sessions."""
    from fleetsched.bench.allocator import GB, _aggregate

    rows = [replay(small[name], "frag-aware") for name in ("chat", "batch")]
    assert rows[0]["moved_gb"] > 0 and rows[1]["moved_gb"] == 0
    granted = sum(s.nbytes for name in ("chat", "batch") for s in small[name].sessions) / GB
    assert rows[0]["granted_gb"] + rows[1]["granted_gb"] == pytest.approx(granted)
    assert _aggregate(rows)["moved_gb_per_gb_granted"] == pytest.approx(rows[0]["moved_gb"] / granted)
