"""Inputs that got through unchecked (or crashed without naming what was wrong), found by probing
the pool, the KV sizing, the settings and the command line."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from fleetsched.resources import DeviceSpec, ExtentPool, parse_vllm_cache_config
from fleetsched.resources.kv_sizing import layer_windows
from fleetsched.settings import Settings, SimSettings, load_settings

from .test_cli import fleetsched

MB = 2**20


def _pool() -> ExtentPool:
    return ExtentPool([DeviceSpec("g0", 8 * MB)], page_size=MB)


def test_an_end_hint_beyond_any_float_is_a_value_error_and_holds_nothing():
    # It raised a bare OverflowError out of math.isfinite.
    pool = _pool()
    with pytest.raises(ValueError, match="ends_at: expected a finite number"):
        pool.reserve_nowait(MB, ends_at=10**400)
    assert pool.statistics().allocated == 0


def test_a_device_that_is_not_a_name_is_named():
    # A list raised "unhashable type: 'list'", naming neither the argument nor what it should be.
    pool = _pool()
    with pytest.raises(TypeError, match=r"device: expected a device name, got \['g0'\]"):
        pool.reserve_nowait(MB, device=["g0"])  # type: ignore[arg-type]
    assert pool.statistics().allocated == 0


def test_a_quota_needs_a_tenant_name():
    # set_quota(None, n) was accepted and never enforced: a reservation without a tenant has no quota.
    pool = _pool()
    with pytest.raises(TypeError, match="memory quota: expected a tenant's name, got None"):
        pool.set_quota(None, MB)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a tenant's name"):
        ExtentPool([DeviceSpec("g0", 8 * MB)], page_size=MB, quotas={None: MB})  # type: ignore[dict-item]


def test_a_model_config_with_absurdly_many_layers_is_a_value_error():
    # It raised OverflowError building one entry per layer, which pydantic does not turn into a config error.
    with pytest.raises(ValueError, match="num_hidden_layers must be at most 10,000"):
        layer_windows({"num_hidden_layers": 10**30})


def test_a_malformed_max_window_layers_is_named():
    # A string was ignored, and every layer then sized as sliding.
    config = {"num_hidden_layers": 2, "sliding_window": 64, "use_sliding_window": True}
    assert layer_windows({**config, "max_window_layers": 1}) == [None, 64]
    with pytest.raises(ValueError, match="max_window_layers must be an integer >= 0, got '1'"):
        layer_windows({**config, "max_window_layers": "1"})


def test_a_kv_cache_smaller_than_a_block_is_refused():
    # It read as 0 blocks, and a pool of 0 bytes was built over it.
    metrics = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="8"} 1.0\n'
    with pytest.raises(ValueError, match=r"kv_cache_size_tokens \(8\) holds no whole block of block_size \(16\)"):
        parse_vllm_cache_config(metrics)


def test_the_sim_needs_a_cache_of_one_block_and_steps_that_take_time():
    # The first divided by zero in the cache's usage gauge; the second made `simulate --duration` spin forever.
    with pytest.raises(ValidationError, match=r"kv_cache_tokens \(16\) must hold at least one block of block_size \(128\)"):
        SimSettings(kv_cache_tokens=16, block_size=128)
    with pytest.raises(ValidationError, match="an engine step would take no time"):
        SimSettings(step_base_s=0, step_per_token_s=0, step_per_context_token_s=1e-6, step_per_seq_s=0)
    SimSettings(step_base_s=0, step_per_token_s=1e-6, step_per_context_token_s=0, step_per_seq_s=0)


def test_the_sim_refuses_more_blocks_than_it_can_build():
    """kv_cache_tokens of 10**9 was taken: the engine built 7.8 million blocks (1.1 GB) when it
    started, for every engine a calibration's fit runs. The bound names both fields."""
    with pytest.raises(ValidationError, match=r"kv_cache_tokens \(1000000000\) makes 7,812,500 blocks of block_size \(128\) tokens: the sim holds 4,194,304 at most"):
        SimSettings(kv_cache_tokens=10**9, block_size=128)
    SimSettings(kv_cache_tokens=2**22 * 128, block_size=128)  # the most it holds


def test_the_sim_refuses_a_token_budget_below_max_num_seqs_as_vllm_does():
    """vLLM refuses max_num_batched_tokens < max_num_seqs at start-up. The sim ran it, each step
    decoding only max_num_batched_tokens of its running requests: 64 requests of 20 tokens took
    120 steps at a budget of 16 and 227 at 8, against 20 at 2048, and nothing said why."""
    with pytest.raises(ValidationError, match=r"max_num_batched_tokens \(16\) must be greater than or equal to max_num_seqs \(128\)"):
        SimSettings(max_num_batched_tokens=16)
    with pytest.raises(ValidationError, match=r"max_num_batched_tokens \(128\) .* max_num_seqs \(256\)"):
        SimSettings(profile="hermes3-70b-4xa100", max_num_batched_tokens=128)  # the profile's 256 sequences
    SimSettings(max_num_batched_tokens=128, max_num_seqs=128)  # equal is what vLLM takes


def test_backend_on_the_command_line_gets_the_checks_the_config_file_would(tmp_path):
    # --backend instant over a config sized from the KV cache ran, and failed with a traceback.
    done = fleetsched("run", "examples/kv_admission.toml", "--backend", "instant", "--no-live")
    assert done.returncode == 2, done.stderr
    assert "config error: --backend: resources.kv_cache: the instant backend has no KV cache" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("dispatch", "backend", "named"),
    [
        ({"critical_reserve": 40, "max_window": 8}, {}, "window of at most 8 (dispatch.max_window)"),
        ({"critical_reserve": 8, "adaptive_window": False}, {"max_in_flight": 8}, "window of at most 8 (backend.max_in_flight (the window is fixed))"),
    ],
)
def test_a_critical_reserve_as_large_as_the_window_is_refused(dispatch, backend, named):
    """It was taken: with a window of 8 and a reserve of 40, 40 critical calls ran at once, and
    lower tiers were held to one place without a word."""
    with pytest.raises(ValidationError, match=re.escape(f"dispatch.critical_reserve: {dispatch['critical_reserve']} places for critical calls leave none of the {named}")):
        Settings(dispatch=dispatch, backend=backend)
    Settings(dispatch={**dispatch, "critical_reserve": 7}, backend=backend)


@pytest.mark.parametrize(("interval", "message"), [(True, "expected a number, got true"), (1.5, "Input should be a valid integer")])
def test_a_tier_s_stream_interval_must_be_an_integer(interval, message):
    """true was read as 1, where every other count refuses it."""
    with pytest.raises(ValidationError, match=r"stream_interval\.batch\n  .*" + message):
        Settings(dispatch={"stream_interval": {"batch": interval}})


def test_a_tier_s_stream_interval_is_set_from_the_environment_as_any_count(monkeypatch, tmp_path):
    """FLEETSCHED_DISPATCH__STREAM_INTERVAL__BATCH=64 was refused ("Input should be a valid
    integer (got '64')"): a variable's value is text, and the field took integers only."""
    monkeypatch.chdir(tmp_path)  # no ./fleetsched.toml
    monkeypatch.setenv("FLEETSCHED_DISPATCH__STREAM_INTERVAL__BATCH", "64")
    assert load_settings().dispatch.stream_interval == {"batch": 64}
