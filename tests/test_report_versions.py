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
