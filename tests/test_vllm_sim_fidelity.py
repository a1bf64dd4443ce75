"""The tiny-cpu-vllm profile against the real CPU vLLM, on a closed loop the calibration did not see.

Starts the real server (the session fixture: 4 sequences at once, which the sim is told too).
Simulated throughput and TTFT p50 must be within 15% of measured. The machine's other load
moves the measured side; run it on a quiet machine.

Not in the default run (`-m fidelity` selects it): the shipped tiny-cpu-vllm profile does not
meet this target yet (issue #6 is open). On this project's 2-core machine `fleetsched bench
sim-fidelity` (engine pinned to its own CPU, medians of 5 runs) had the sim 6.1% off on
throughput and 52.6% on TTFT p50, with the runs' TTFT p50 between 24 and 49 ms.
"""

from __future__ import annotations

import pytest

from fleetsched.backends.sim._fit import Workload
from fleetsched.bench.sim_fidelity import real_fidelity
from fleetsched.settings import SimSettings

pytestmark = [pytest.mark.vllm, pytest.mark.fidelity]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_sim_matches_real_vllm_on_an_unseen_workload(vllm_server):
    settings = SimSettings(profile="tiny-cpu-vllm", max_num_seqs=4, max_model_len=2048)
    result = real_fidelity(vllm_server.url, settings, Workload(concurrency=12, prompt_tokens=200, max_tokens=64, rounds=3))
    assert result["throughput_rel_err"] <= 0.15, result
    assert result["ttft_p50_rel_err"] <= 0.15, result
