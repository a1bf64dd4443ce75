"""The sim against the real CPU vLLM, on a closed loop the calibration did not see.

As ``fleetsched bench sim-fidelity`` does: a server of its own with the engine pinned to its own
CPU at nice 19 (as the shipped profile was calibrated), a profile fitted to it by the
calibration sweep, its passes alternating with five runs of the unseen workload (concurrency 24,
200-token prompts, answers of 16-112 tokens). Simulated throughput and TTFT p50 must be within
15% of the measured medians. About two and a half minutes.

The measured side moves with the machine's other load (on this project's 2-core machine, the
same loop ran at 3,800 and at 5,800 tok/s twenty minutes apart). A measurement that misses is
taken again, each time from a fresh sweep and fresh runs, and the test fails only if three in a
row miss: seven bench runs had the fitted profile 0.7-8.5% off on throughput and 4.9-15.0% on
TTFT p50 (the worst 14.98%), so a miss now and then is the machine, three in a row the sim.
`-m fidelity` selects this test alone.

Three in a row did miss on TTFT p50 on the machine of 2026-11-24 (the twenty-eighth session),
19.0, 17.4 and 23.1 %, the sim's TTFT low each time, and the test then reported a TTFT miss as an
expected failure. The profile has since had a delay per request the engine runs
(`request_delay_per_running_s`): over nine sweeps, each beside the unseen loop, the fitted TTFT
p50 went from 3-31 % low (15 % on average, within 15 % in 4 of 9) to 0.3-18 % off either way
(7.9 %, within 15 % in 6 of 9), and a TTFT missed three times fails the test again.
"""

from __future__ import annotations

import pytest

from fleetsched.bench.sim_fidelity import real_fidelity
from fleetsched.settings import SimSettings
from fleetsched.testing.fixtures import require_vllm_setup
from fleetsched.testing.vllm_server import VLLMServer, default_engine_cpus, off_cpus

pytestmark = [pytest.mark.vllm, pytest.mark.fidelity]

TOLERANCE = 0.15
ATTEMPTS = 3


def _within(result: dict) -> bool:
    return result["throughput_rel_err"] <= TOLERANCE and result["ttft_p50_rel_err"] <= TOLERANCE


def test_sim_matches_real_vllm_on_an_unseen_workload():
    require_vllm_setup()
    cpus = default_engine_cpus()
    attempts = []
    with VLLMServer(max_model_len=1024, engine_nice=19, engine_cpus=cpus) as server, off_cpus(cpus):
        for _ in range(ATTEMPTS):
            attempts.append(real_fidelity(server.url, SimSettings(profile="tiny-cpu-vllm")))
            if _within(attempts[-1]):
                break
    errors = [(round(r["throughput_rel_err"], 3), round(r["ttft_p50_rel_err"], 3)) for r in attempts]
    print(f"fidelity (throughput, TTFT p50 errors) per attempt: {errors}")
    assert all(r["compared"] == "profile fitted beside the runs" for r in attempts)
    assert any(_within(r) for r in attempts), errors
