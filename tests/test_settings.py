"""Settings that a user can write but that cannot work are config errors at load, naming the key."""

from __future__ import annotations

import os

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


def test_an_agent_mix_of_zero_session_memory_is_refused(tmp_path):
    # Scheduler and tenants refuse 0 bytes; a mix took it, and the run read 0 as "not given":
    # its sessions reserved the tenant's or the scheduler's default without a word.
    error = refused(workload={"agents": [{"tenant": "default", "count": 1, "session_memory": 0}]})
    assert (error.key, error.reason) == ("workload.agents.0.session_memory", "must be > 0 bytes (got 0)")
    from fleetsched.agents.workload import read_trace

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"tenant": "default", "session_memory": "0GB"}\n')
    with pytest.raises(ConfigError, match="must be > 0 bytes") as info:
        read_trace(trace)
    assert info.value.key == "workload.trace line 1: session_memory"


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"scheduler": {"session_memory": True}}, "scheduler.session_memory"),
        ({"tenants": {"default": {"memory_quota": True}}}, "tenants.default.memory_quota"),
        ({"resources": {"page_size": True}}, "resources.page_size"),
        ({"resources": {"devices": [{"name": "g", "memory": False}]}}, "resources.devices.0.memory"),
    ],
)
def test_a_flag_where_a_size_belongs_is_refused(section, key):
    # pydantic's ByteSize read true as 1 byte: a session of 1 byte, a page of 1 byte.
    error = refused(**section)
    assert error.key == key
    assert "must be a size in bytes (a number, or a string such as '4GB'), got " in error.reason


@pytest.mark.parametrize(
    ("section", "key"),
    [
        # Sessions never ended when idle: one slot gone for good in memory, and with Redis
        # every session call a 503 (OverflowError turning the time into milliseconds).
        ({"gateway": {"session_idle_s": "inf"}}, "gateway.session_idle_s"),
        # An engine step that never ends: the run reported 0 tokens and no error.
        ({"backend": {"sim": {"step_base_s": "inf"}}}, "backend.sim.step_base_s"),
        ({"backend": {"sim": {"request_serial_s": "inf"}}}, "backend.sim.request_serial_s"),
        # A circuit breaker that never let a probe through: a replica down for good after
        # `breaker_failures` failures, `fleetsched run` answering "next probe in inf s".
        ({"backend": {"breaker_reset_s": "inf"}}, "backend.breaker_reset_s"),
        # Too short to move a clock that reads seconds (now + 1e-300 == now): a run never ended.
        ({"backend": {"sim": {"step_base_s": 1e-300, "step_per_token_s": 0, "step_per_seq_s": 0}}}, "backend.sim"),
        ({"dispatch": {"window_interval_s": 1e-300}}, "dispatch.window_interval_s"),
    ],
)
def test_a_time_that_cannot_pass_is_refused(section, key):
    assert refused(**section).key == key


@pytest.mark.parametrize("key", ["tokens_per_minute", "requests_per_minute"])
def test_a_rate_limit_of_infinity_is_refused(key):
    # It loaded: the library read it as no limit, the gateway answered every call of the tenant
    # with a 500 (its x-ratelimit headers floor the bucket's level). No limit is no value.
    error = refused(tenants={"acme": {key: "inf"}})
    assert error.key == f"tenants.acme.{key}" and "finite" in error.reason


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:port", "http://127.0.0.1:-1"])
def test_a_replica_url_without_a_valid_port_is_refused(url):
    # It loaded; every call then failed, the run printing "failed" for each session and, once,
    # "BackendError: vLLM replica r0 (...): unhandled errors in a TaskGroup".
    error = refused(backend={"urls": ["http://127.0.0.1:8000", url]})
    assert error.key == "backend.urls"
    assert f"{url!r} has no valid port" in error.reason


@pytest.mark.parametrize("second", ["http://gpu1:8000", "http://gpu1:8000/", "http://GPU1:8000/v1", "http://gpu1:8000/v1/"])
def test_the_same_server_given_twice_in_backend_urls_is_refused(second):
    # It made two replicas of one server: the window's engine signals, summed over replicas,
    # counted its running and waiting requests twice, and its throughput too.
    error = refused(backend={"urls": ["http://gpu0:8000", "http://gpu1:8000", second]})
    assert error.key == "backend.urls"
    assert error.reason.startswith(f"{second!r} is the server of 'http://gpu1:8000' again")


@pytest.mark.parametrize(
    ("backend", "key", "reason"),
    [
        # A retry then slept forever: the jitter is drawn up to retry_initial_s.
        ({"retry_initial_s": float("inf")}, "backend.retry_initial_s", "Input should be a finite number"),
        ({"retry_max_s": float("inf")}, "backend.retry_max_s", "Input should be a finite number"),
        # The jitter of up to retry_initial_s came on top of retry_max_s: backoffs of up to 11 s
        # under a "longest single retry backoff" of 1 s.
        ({"retry_initial_s": 10, "retry_max_s": 1}, "backend.retry_max_s", "must be at least retry_initial_s (10.0)"),
    ],
)
def test_retry_backoffs_are_finite_and_the_longest_is_not_below_the_first(backend, key, reason):
    error = refused(backend=backend)
    assert error.key == key and reason in error.reason


def test_an_environment_variable_of_no_section_is_refused(monkeypatch):
    # A misspelt section was ignored without a word (a misspelt key in a section is refused), and
    # the run went on with the value the user meant to override.
    monkeypatch.setenv("FLEETSCHED_SCHEDULR__MAX_SESSIONS", "8")
    error = refused()
    assert error.key == "FLEETSCHED_SCHEDULR__MAX_SESSIONS"
    assert error.reason.startswith("no section 'schedulr'; the sections are scheduler, resources, backend,")
    monkeypatch.delenv("FLEETSCHED_SCHEDULR__MAX_SESSIONS")
    monkeypatch.setenv("FLEETSCHED_VLLM_VENV", "/opt/vllm")  # the scripts' own variables: no __
    monkeypatch.setenv("fleetsched_scheduler__max_sessions", "8")  # names are case-insensitive
    assert load_settings().scheduler.max_sessions == 8



def test_an_environment_variable_cannot_set_a_tenant_whose_name_has_capitals(monkeypatch, tmp_path):
    # Environment names are read in lower case: FLEETSCHED_TENANTS__ACME__WEIGHT made a second
    # tenant "acme" (weight 3, no sessions) beside the config's "Acme" (weight 1), and exit 0.
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.Acme]\n[tenants.bob]\n')
    monkeypatch.setenv("FLEETSCHED_TENANTS__ACME__WEIGHT", "3")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert info.value.key == "FLEETSCHED_TENANTS__ACME__WEIGHT"
    assert "this sets a tenant 'acme' beside the config's 'Acme'" in info.value.reason
    monkeypatch.delenv("FLEETSCHED_TENANTS__ACME__WEIGHT")
    monkeypatch.setenv("FLEETSCHED_TENANTS__BOB__WEIGHT", "3")  # a lower-case name is set as before
    assert load_settings(config).tenants["bob"].weight == 3
    # Nor a '-': a shell cannot export one, and ..._SUPPORT_BOT__TIER made a tenant "support_bot".
    config.write_text('[tenants.support-bot]\n')
    monkeypatch.setenv("FLEETSCHED_TENANTS__SUPPORT_BOT__TIER", "batch")
    with pytest.raises(ConfigError, match="this sets a tenant 'support_bot' beside the config's 'support-bot'"):
        load_settings(config)


def test_a_variable_with_one_underscore_after_its_section_is_refused(monkeypatch, tmp_path):
    # FLEETSCHED_SCHEDULER_MAX_SESSIONS=8 was not read, and nothing said so.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLEETSCHED_SCHEDULER_MAX_SESSIONS", "8")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.key == "FLEETSCHED_SCHEDULER_MAX_SESSIONS"
    assert info.value.reason == "a key of section 'scheduler' is set with '__' after the section: FLEETSCHED_SCHEDULER__MAX_SESSIONS"
    monkeypatch.delenv("FLEETSCHED_SCHEDULER_MAX_SESSIONS")
    monkeypatch.setenv("FLEETSCHED_TENANTS", '{"acme": {}}')  # a whole section, as JSON
    monkeypatch.setenv("FLEETSCHED_TINY_MODEL", "/m")  # the scripts' own
    load_settings()

def test_an_environment_list_that_is_not_json_is_named_by_its_variable(monkeypatch, tmp_path):
    # It was named "FLEETSCHED_TENANTS__...": which of the section's variables, the reader guessed.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLEETSCHED_TENANTS__ACME__WEIGHT", "2")  # a number is not JSON to parse
    monkeypatch.setenv("FLEETSCHED_TENANTS__ACME__API_KEYS", "sha256:" + "0" * 64)  # a list, unquoted
    error = refused()
    assert error.key == "FLEETSCHED_TENANTS__ACME__API_KEYS"
    assert error.reason.startswith("an environment variable of this section does not parse")
    monkeypatch.setenv("FLEETSCHED_TENANTS__ACME__API_KEYS", '["sha256:' + "0" * 64 + '"]')
    monkeypatch.setenv("FLEETSCHED_BACKEND__MODEL", "m")
    monkeypatch.setenv("FLEETSCHED_BACKEND__URLS", "http://gpu0:8000")
    assert refused().key == "FLEETSCHED_BACKEND__URLS"
    monkeypatch.setenv("FLEETSCHED_BACKEND__URLS", '["http://gpu0:8000"]')
    monkeypatch.setenv("FLEETSCHED_DISPATCH__MIN_SHARE", "batch=0.2")  # a table, unquoted
    assert refused().key == "FLEETSCHED_DISPATCH__MIN_SHARE"


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    # It read "no such file: DIR", of a path that exists.
    with pytest.raises(ConfigError, match="a directory, not a TOML file"):
        load_settings(tmp_path)
    pipe = tmp_path / "fleet.toml"
    os.mkfifo(pipe)  # as <(envsubst < fleet.toml) gives: it read "no such file"
    with pytest.raises(ConfigError, match=r"not a regular file \(a pipe or a device\)"):
        load_settings(pipe)


def test_a_config_saved_with_a_byte_order_mark_says_so(tmp_path):
    # Some Windows editors save UTF-8 so; tomllib said "Invalid statement (at line 1, column 1)".
    config = tmp_path / "fleet.toml"
    config.write_text('[tenants.acme]\ntier = "batch"\n', encoding="utf-8-sig")
    with pytest.raises(ConfigError, match=r"fleet.toml: it starts with a byte-order mark \(BOM\)"):
        load_settings(config)
    config.write_text('[tenants.acme]\ntier = "batch"\n[oops\n')  # a syntax error still reads as one
    with pytest.raises(ConfigError, match="fleet.toml: Expected ']'"):
        load_settings(config)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"backend": {"sim": {"max_num_seqs": True}}}, "backend.sim.max_num_seqs"),  # ran one sequence at a time
        ({"scheduler": {"max_sessions": True}}, "scheduler.max_sessions"),
        ({"workload": {"agents": [{"tenant": "default", "count": True}]}}, "workload.agents.0.count"),
        ({"tenants": {"default": {"sla": {"ttft_p99_s": False}}}}, "tenants.default.sla.ttft_p99_s"),
    ],
)
def test_a_flag_where_a_number_belongs_is_refused(overrides, key):
    # pydantic reads true as 1 and false as 0, without a word.
    error = refused(**overrides)
    assert error.key == key and error.reason.startswith("expected a number, got ")


@pytest.mark.parametrize("weight", [1e-306, 1e-7, 2e6])
def test_a_tenant_weight_beyond_what_the_fair_share_can_tell_apart_is_refused(weight):
    # 1e-306 took the tenant's counter to inf, and with it its tier's: weights were then ignored.
    assert refused(tenants={"acme": {"weight": weight}}).key == "tenants.acme.weight"


@pytest.mark.parametrize("section", ['[tenants.acme]\napi_keys = ["sk-my-secret"]\n', '[tenants.acme]\n[gateway]\nadmin_api_keys = ["sk-my-secret"]\n'])
def test_a_key_written_in_clear_is_refused_without_being_repeated(section, tmp_path):
    """The error quoted the input, the key itself, into whatever logs the error went to."""
    config = tmp_path / "keys.toml"
    config.write_text(section)
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert "not in clear" in str(caught.value) and "sk-my-secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        ({"tenants": {"a": {"sla": {"ttft_p99_s": 0}}}}, "tenants.a.sla.ttft_p99_s", "greater than 0"),
        ({"tenants": {"a": {"api_keys": ["sha256:" + "ab" * 16]}}}, "tenants.a.api_keys", "sha256:<64 lowercase hex digits>"),
        ({"dispatch": {"stream_interval": {"batch": 0}}}, "dispatch.stream_interval", "stream interval of 'batch' must be >= 1"),
        ({"dispatch": {"min_share": {"batch": 1.0}}}, "dispatch.min_share", "share of 'batch' must be in [0, 1)"),
        ({"dispatch": {"min_share": {"standard": 0.5, "batch": 0.5}}}, "dispatch.min_share", "shares must add up to less than 1"),
        ({"dispatch": {"min_share": {"standard": 0.1, "Standard": 0.2}}}, "dispatch.min_share", "tier standard is named twice"),
        ({"backend": {"sim": {"kv_cache_tokens": 100, "block_size": 128}}}, "backend.sim", "must hold at least one block"),
        ({"backend": {"urls": ["http://gpu1", "http://gpu1:80"]}}, "backend.urls", "is the server of 'http://gpu1' again"),
        ({"tenants": {}}, "tenants", "at least one tenant must be declared"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(overrides, key, reason):
    """Each value that cannot work is a config error naming its field and why."""
    error = refused(**overrides)
    assert error.key == key and reason in error.reason


@pytest.mark.parametrize(
    "overrides",
    [
        {"dispatch": {"min_window": 8, "max_window": 8}},
        {"backend": {"retry_initial_s": 2, "retry_max_s": 2}},
        {"workload": {"agents": [{"tenant": "default", "count": 1, "tool_dist": "uniform", "tool_s": 2, "tool_s_max": 2}]}},
        {"tenants": {"a": {"memory_quota": "1GiB"}}, "workload": {"agents": [{"tenant": "a", "count": 1, "session_memory": "1GiB"}]}},
        {"resources": {"devices": [{"name": "g", "memory": "1GiB"}]}, "workload": {"agents": [{"tenant": "default", "count": 1, "session_memory": "1GiB"}]}},
    ],
)
def test_values_at_the_edge_of_what_works_load(overrides):
    """Bounds are inclusive where the value still works: equal windows, backoffs, tool times, quota and device."""
    assert load_settings(**overrides)


def test_a_compaction_threshold_for_a_counting_pool_is_refused_naming_both():
    # Taken without a word: a counting pool has no address space, and never compacted.
    error = refused(resources={"strategy": "counting", "compact_threshold": 0.3})
    assert error.key == "resources"
    assert "compact_threshold is not used with strategy 'counting'" in error.reason
    assert load_settings(resources={"strategy": "counting", "compact": False})  # the default threshold: none
