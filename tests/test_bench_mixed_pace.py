"""The mixed-pace benchmark's modes on virtual time (short run): JSON shape and the direction."""

import json
import subprocess
import sys

import pytest

from fleetsched.bench import mixed_pace


def _without_wall_time(data: dict) -> dict:
    return {**data, "modes": {mode: {k: v for k, v in figures.items() if k != "wall_s"} for mode, figures in data["modes"].items()}}


def test_mixed_pace_bench_json():
    """Two runs of the same arguments give the same figures: on trio's MockClock, which runs the
    tasks ready at one instant in a random order, they did not (the agents' tool times went to
    whichever session ran first)."""
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "fleetsched.cli", "bench", "mixed-pace", "--hours", "0.03", "--json"],
            capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr
        runs.append(_without_wall_time(json.loads(done.stdout)))
    assert runs[0] == runs[1]
    data = runs[0]
    modes = data["modes"]
    assert set(modes) == {"baseline", "fleetsched", "fleetsched-keep"}
    for figures in modes.values():
        assert set(figures["jct_s"]) == {"chatty", "long-tool", "summariser"}
        assert 0 < figures["engine_busy_frac"] <= 1
    # Deterministic on virtual time: lending the slots of sessions in long tools serves more.
    assert modes["fleetsched"]["sessions_per_hour"] > modes["baseline"]["sessions_per_hour"]
    # The baseline queues (its capacity is measured); a mode that served every arrival says so,
    # and the ratio is then a lower bound (it grew with --arrival-rate: a claim of capacity).
    assert modes["baseline"]["queued_at_end"] > 0 and not modes["baseline"]["arrival_limited"]
    for figures in modes.values():
        assert figures["arrival_limited"] == (figures["queued_at_end"] == 0)
    assert data["ratio_is_lower_bound"] == modes["fleetsched"]["arrival_limited"]


def test_a_url_with_the_sim_backend_is_a_usage_error(capsys):
    """Before: --url was ignored without a word and the bench ran on the sim backend."""
    with pytest.raises(SystemExit) as exited:
        mixed_pace.main(["--url", "http://127.0.0.1:1", "--hours", "0.001"])
    assert exited.value.code == 2
    assert "--url needs --backend vllm-server" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--hours", "1e308"], ["--arrival-rate", "1e308"], ["--hours", "1e9"]])
def test_a_session_count_too_large_is_a_usage_error(argv, capsys):
    """Before: 1e308 was an OverflowError traceback (int of infinity sessions); 1e9 hours tried to
    build the settings of billions of sessions."""
    with pytest.raises(SystemExit) as exited:
        mixed_pace.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--arrival-rate x --hours" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--seconds", "30"], "--seconds"),
        (["--time-scale", "0.5"], "--time-scale"),
        (["--engine-nice", "0"], "--engine-nice"),
        (["--backend", "vllm-server", "--hours", "0.1"], "--hours"),
    ],
)
def test_an_option_of_the_other_backend_is_a_usage_error(argv, flag, capsys):
    """Before: `--seconds 30` on the sim backend was ignored without a word, and the run took its
    0.5 simulated hours; `--hours` against a real vLLM likewise."""
    with pytest.raises(SystemExit) as exited:
        mixed_pace.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"{flag} applies only with --backend" in err
