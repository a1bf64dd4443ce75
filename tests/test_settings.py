"""Settings that a user can write but that cannot work are config errors at load, naming the key."""

from __future__ import annotations

import pytest

from fleetsched.cli import main
from fleetsched.errors import ConfigError
from fleetsched.settings import load_settings


def refused(**overrides: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    return info.value


def test_an_unknown_placement_strategy_is_refused_at_load(tmp_path, capsys):
    # It loaded, and `fleetsched run` then ended in a ValueError traceback from create_pool.
    error = refused(resources={"strategy": "worst-fit"})
    assert error.key == "resources.strategy"
    assert "unknown strategy 'worst-fit'; known: counting, frag-aware, first-fit" in error.reason
    config = tmp_path / "bad.toml"
    config.write_text('[resources]\nstrategy = "firstfit"\n[[workload.agents]]\ntenant = "default"\ncount = 1\n')
    assert main(["run", str(config), "--no-live"]) == 2
    assert "config error: resources.strategy: unknown strategy 'firstfit'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "resources",
    [
        {"devices": [{"name": "g", "memory": 100}]},
        {"page_size": "1TB"},  # the default device holds 80 GB
    ],
)
def test_a_device_smaller_than_one_page_is_refused_at_load(resources):
    # It loaded, and the scheduler then failed to start with ExtentPool's ValueError traceback.
    error = refused(resources=resources)
    assert error.key == "resources.devices"
    assert "is smaller than one page (resources.page_size: " in error.reason


def test_a_counting_pool_has_no_pages_to_fit():
    assert load_settings(resources={"strategy": "counting", "devices": [{"name": "g", "memory": 100}]})
