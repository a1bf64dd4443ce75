"""Reports `fleetsched report` cannot read for what they are, not for a field: the schema
version, and JSON nested too deeply to parse."""

from __future__ import annotations

import json

import pytest

from fleetsched.errors import ReportSchemaError
from fleetsched.observability.render import main as render_main
from fleetsched.report import load_report


@pytest.mark.parametrize(
    ("schema", "hint"),
    [
        ("fleetsched.run/1", "(written by an older fleetsched: run it again to get a new report)"),
        ("fleetsched.run/3", "(written by a newer fleetsched: render it with that version, or upgrade this one)"),
    ],
)
def test_another_schema_version_says_older_or_newer(tmp_path, schema, hint):
    """Before: /3 was said to be written by an older fleetsched."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"schema": schema}))
    with pytest.raises(ReportSchemaError) as info:
        load_report(path)
    assert str(info.value).endswith(f"but this fleetsched reads only 'fleetsched.run/2' {hint}")


@pytest.mark.parametrize("schema", ["fleetsched.run/x", "other.run/3"])
def test_an_unknown_schema_gets_no_version_hint(tmp_path, schema):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"schema": schema}))
    with pytest.raises(ReportSchemaError) as info:
        load_report(path)
    assert str(info.value).endswith("but this fleetsched reads only 'fleetsched.run/2'")


def test_json_nested_too_deeply_is_not_a_run_report(tmp_path, capsys):
    """Before: a RecursionError traceback from json.loads."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    assert render_main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"fleetsched report: {path}: not a JSON run report (nested too deeply)\n"


def test_a_capacity_search_s_result_is_named_for_what_it_is(tmp_path, capsys):
    """`simulate --find-max-sessions --report` writes the search's result, which `report`
    refuses (docs/report-schema.md); before, it said "no 'schema' field", as of a report cut
    short or edited by hand."""
    from fleetsched.simulate import main as simulate_main

    config = tmp_path / "fleet.toml"
    config.write_text(
        '[scheduler]\nmax_sessions = 2\n[tenants.a]\nsla = { ttft_p99_s = 1 }\n'
        '[[workload.agents]]\ntenant = "a"\ncount = 2\nturns = 1\nmax_tokens = 8\n'
    )
    result = tmp_path / "search.json"
    assert simulate_main([str(config), "--duration", "5s", "--find-max-sessions", "--report", str(result), "--json"]) == 0
    capsys.readouterr()
    assert render_main([str(result), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{result}: a capacity search's result (simulate --find-max-sessions), not a run report" in err
    assert "no 'schema' field" not in err
