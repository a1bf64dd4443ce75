"""The run report (schema fleetsched.run/2): rendering, schema versions, SLAs flagged at start."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from fleetsched.errors import ReportSchemaError
from fleetsched.observability.render import PLOTS, main as render_main
from fleetsched.report import SCHEMA, load_report, sla_rows, write_report
from fleetsched.settings import Settings
from fleetsched.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    """A small run on the sim backend in virtual time, with SLAs some tenants miss."""
    settings = Settings(
        backend={"kind": "sim", "max_in_flight": 4, "sim": {"max_num_seqs": 4}},
        scheduler={"max_sessions": 8},
        resources={"devices": [{"name": "gpu0", "memory": "40GB"}, {"name": "gpu1", "memory": "20GB"}]},
        tenants={
            "pager": {"tier": "critical", "sla": {"ttft_p99_s": 0.05, "latency_p95_s": 1.0, "deadline_s": 30}},
            "product": {"tier": "standard", "requests_per_minute": 20, "sla": {"ttft_p99_s": 0.2, "min_tokens_per_s": 5}},
            "batch": {"tier": "batch", "session_memory": "8GB", "sla": {"ttft_p99_s": 0.5}},
        },
        workload={
            "arrival_rate": 8,
            "agents": [
                {"tenant": "pager", "count": 12, "turns": 2, "prompt_tokens": 100, "max_tokens": 32, "tool_s": 0.5},
                {"tenant": "product", "count": 12, "turns": 3, "prompt_tokens": 300, "max_tokens": 64},
                {"tenant": "batch", "count": 6, "turns": 1, "prompt_tokens": 1500, "max_tokens": 128},
            ],
        },
    )
    data, _ = simulate(settings)
    return json.loads(json.dumps(data))  # as it would be read back


def test_report_has_the_v2_sections(report):
    assert report["schema"] == SCHEMA == "fleetsched.run/2"
    tenants = {t["tenant"]: t for t in report["tenants"]}
    pager = tenants["pager"]["sla"]["objectives"]
    assert set(pager) == {"ttft_p99", "admission_p99", "latency_p95", "admission_p95", "deadline"}
    assert pager["ttft_p99"]["events"] == 24 and 0 <= pager["ttft_p99"]["attainment"] <= 1
    assert tenants["product"]["sla"]["refused"]["rate_limited"] > 0  # 20 a minute: refusals recorded
    by_reason = report["sla"]["breaches"]["by_reason"]
    assert by_reason["rate-limited"] > 0 and sum(by_reason.values()) == report["sla"]["breaches"]["total"]
    assert report["sla"]["feasibility"]["method"] == "sim engine model"
    tl = report["timeline"]
    assert len(tl["t"]) >= 3 and set(tl["fragmentation"]) == {"gpu0", "gpu1"}
    assert len(report["distributions"]["ttft_s"]["tier"]["critical"]) == 101


def test_the_sla_table_shows_an_objectives_own_breaches_only(report):
    """A tenant's refusals were shown on every objective of its that had no breach of its own,
    an objective met among them ("admission p99 ... met | 5 rate-limited")."""
    from fleetsched.report import OBJECTIVES

    objectives = [t["sla"]["objectives"][name] for t in report["tenants"] for name in OBJECTIVES if name in t["sla"]["objectives"]]
    rows = sla_rows(report)
    assert len(rows) == len(objectives)
    assert [bool(row[8]) for row in rows] == [bool(o["breaches"]) for o in objectives]
    assert any(row[8] for row in rows) and any(t["sla"]["refused"]["rate_limited"] for t in report["tenants"])


def test_report_renders_plots_and_html(report, tmp_path):
    path = tmp_path / "run.json"
    write_report(report, path)
    out = tmp_path / "out"
    assert render_main([str(path), "--out", str(out)]) == 0
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    page = (out / "index.html").read_text()
    assert all(f"src='{name}'" in page for name in PLOTS)
    assert "pager" in page and "TTFT p99" in page and "rate-limited" in page
    missed = sum(row[7].startswith("MISSED") for row in sla_rows(report))  # red, as in the terminal
    assert missed > 0 and page.count("<tr class='bad'>") == missed


def test_other_schema_versions_get_a_clear_error(report, tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**report, "schema": "fleetsched.run/1"}))
    with pytest.raises(ReportSchemaError, match=r"schema 'fleetsched.run/1', but this fleetsched reads only 'fleetsched.run/2'"):
        load_report(old)
    assert render_main([str(old), "--out", str(tmp_path / "x")]) == 2
    assert "fleetsched.run/1" in capsys.readouterr().err and not (tmp_path / "x").exists()
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ReportSchemaError, match="no 'schema' field"):
        load_report(other)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    with pytest.raises(ReportSchemaError, match="not a JSON run report"):
        load_report(garbage)


def test_a_report_cut_short_or_holding_nan_is_refused_by_name(report, tmp_path, capsys):
    """Before: a KeyError traceback (no distributions), "inf s" and "nan%" shown as figures, an
    IsADirectoryError for a directory, a FileExistsError for an --out that is a file."""
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({"schema": SCHEMA, **{k: v for k, v in report.items() if k not in ("distributions", "timeline")}}))
    with pytest.raises(ReportSchemaError, match="report without distributions, timeline"):
        load_report(cut)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(report).replace('"duration_s": ', '"duration_s": NaN, "x": ', 1))
    with pytest.raises(ReportSchemaError, match="NaN is not a number a report holds"):
        load_report(nan)
    with pytest.raises(ReportSchemaError, match="cannot read it"):
        load_report(tmp_path)
    good = tmp_path / "good.json"
    write_report(report, good)
    (tmp_path / "taken").write_text("")
    assert render_main([str(good), "--out", str(tmp_path / "taken")]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a directory that cannot be written, even by root")
def test_the_page_is_written_in_utf_8_whatever_the_locale(report, tmp_path):
    """The page declares UTF-8; under a locale of another encoding (ASCII here, cp1252 on
    Windows) a tenant's name outside it failed the page ("cannot plot its figures"), or was
    written in the locale's encoding."""
    import os

    path = tmp_path / "run.json"
    write_report(_edited(report, lambda r: r["tenants"][0].__setitem__("tenant", "ünï 日本")), path)
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "fleetsched.cli", "report", str(path), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, encoding="utf-8", cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "<td>ünï 日本</td>" in (tmp_path / "out" / "index.html").read_bytes().decode("utf-8")


def test_an_out_directory_that_cannot_be_written_is_one_line(report, tmp_path, capsys):
    """Before: a FileNotFoundError traceback from the first plot's savefig (the directory
    exists, so making it succeeded)."""
    good = tmp_path / "good.json"
    write_report(report, good)
    assert render_main([str(good), "--out", "/proc/self"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetsched report: --out /proc/self: cannot write ttft_cdf.png (") and len(err.splitlines()) == 1


def test_unreachable_ttft_is_flagged_at_start(tmp_path):
    config = tmp_path / "fast.toml"
    config.write_text(
        '[backend]\nkind = "sim"\n'
        '[tenants.eager]\nsla = { ttft_p99_s = 0.0005 }\n'  # below the idle engine's ~2.5 ms
        '[tenants.calm]\nsla = { ttft_p99_s = 1.0 }\n'
        '[[workload.agents]]\ntenant = "eager"\ncount = 2\nprompt_tokens = 100\n'
        '[[workload.agents]]\ntenant = "calm"\ncount = 2\n'
    )
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "fleetsched.cli", "run", str(config), "--no-live", "--report", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("fleetsched: warning: tenant 'eager': sla.ttft_p99_s = 0.0005 s cannot be met")
    assert "calm" not in done.stderr
    feasibility = json.loads(out.read_text())["sla"]["feasibility"]
    assert [u["tenant"] for u in feasibility["unreachable"]] == ["eager"]
    assert feasibility["unreachable"][0]["unloaded_s"] > 0.0005
    assert "(unreachable)" in done.stdout


def test_a_tenant_missing_from_the_timelines_attainment_is_drawn_without_its_line(report, tmp_path):
    """Before: matplotlib's ValueError (x and y must have same first dimension) from the plot."""
    edited = json.loads(json.dumps(report))
    del edited["timeline"]["attainment"]["pager"]
    path = tmp_path / "run.json"
    write_report(edited, path)
    assert render_main([str(path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "sla_attainment.png").read_bytes()[:4] == b"\x89PNG"


def _edited(report, edit):
    edited = json.loads(json.dumps(report))
    edit(edited)
    return edited


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["tenants"][0].pop("sla"), r"tenants\.0\.sla: Field required"),
        (lambda r: r["tenants"][1].__setitem__("weight", "2"), r"tenants\.1\.weight: Input should be a valid number \(got '2'\)"),
        (lambda r: r.__setitem__("backend", None), r"backend: Input should be a valid string \(got None\)"),
        (lambda r: r.__setitem__("distributions", None), r"distributions: Input should be an object \(got None\)"),
        (lambda r: r["distributions"]["ttft_s"]["tier"].__setitem__("critical", [0.1, 0.2]), r"distributions\.ttft_s\.tier\.critical: List should have at least 101 items"),
        (lambda r: r["timeline"]["attainment"].__setitem__("pager", [0.5]), r"timeline\.attainment\.pager: 1 values for the \d+ times of timeline\.t"),
        (lambda r: r["timeline"].__setitem__("in_flight", "3"), r"timeline\.in_flight: Input should be a valid list"),
        (lambda r: r.pop("memory"), r"memory: Field required"),
        # The tenant table's "cancelled" column: a list was a TypeError traceback, a string "cannot plot its figures".
        (lambda r: r["tenants"][0].__setitem__("sessions_cancelled", []), r"tenants\.0\.sessions_cancelled: Input should be a valid integer \(got \[\]\)"),
        (lambda r: r["tenants"][0].__setitem__("sessions_cancelled", "3"), r"tenants\.0\.sessions_cancelled: Input should be a valid integer \(got '3'\)"),
    ],
)
def test_a_report_edited_by_hand_is_refused_naming_the_field(report, tmp_path, capsys, edit, message):
    """Before: a KeyError, TypeError or matplotlib ValueError traceback from the plot or page that read it."""
    path = tmp_path / "edited.json"
    write_report(_edited(report, edit), path)
    with pytest.raises(ReportSchemaError, match=message):
        load_report(path)
    assert render_main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fleetsched report: {path}: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.__setitem__("calls", -3), r"calls: Input should be greater than or equal to 0 \(got -3\)"),
        (lambda r: r["tenants"][0].__setitem__("sessions_done", -1), r"tenants\.0\.sessions_done: Input should be greater than or equal to 0"),
        (lambda r: r["tenants"][0].__setitem__("sessions_cancelled", -4), r"tenants\.0\.sessions_cancelled: Input should be greater than or equal to 0"),
        (lambda r: r.__setitem__("duration_s", -5.0), r"duration_s: Input should be greater than or equal to 0"),
        (lambda r: r["tenants"][0]["sla"]["objectives"]["ttft_p99"].__setitem__("attainment", 1.5), r"tenants\.0\.sla\.objectives\.ttft_p99\.attainment: Input should be less than or equal to 1 \(got 1\.5\)"),
        (lambda r: r["timeline"]["attainment"]["pager"].__setitem__(0, -0.5), r"timeline\.attainment\.pager\.0: Input should be greater than or equal to 0"),
        (lambda r: r["tenants"][0]["ttft_s"].__setitem__("p50", -3.0), r"tenants\.0\.ttft_s\.p50: Input should be greater than or equal to 0 \(got -3\.0\)"),
        (lambda r: r["tenants"][0]["sla"]["objectives"]["ttft_p99"].__setitem__("value", -0.1), r"tenants\.0\.sla\.objectives\.ttft_p99\.value: Input should be greater than or equal to 0"),
        (lambda r: r["distributions"]["ttft_s"]["tier"]["critical"].__setitem__(0, -1.0), r"distributions\.ttft_s\.tier\.critical\.0: Input should be greater than or equal to 0"),
        (lambda r: r["timeline"].__setitem__("window_s", -1.0), r"timeline\.window_s: Input should be greater than 0 \(got -1\.0\)"),
        (lambda r: r["timeline"]["t"].reverse(), r"timeline\.t\.1: [\d.]+ comes after [\d.]+ \(its times go forward\)"),
        # The timeline's own series were taken below 0, and drawn so.
        (lambda r: r["timeline"]["running_sessions"].__setitem__(0, -5), r"timeline\.running_sessions\.0: Input should be greater than or equal to 0"),
        (lambda r: r["timeline"]["t"].__setitem__(0, -100.0), r"timeline\.t\.0: Input should be greater than or equal to 0"),
    ],
)
def test_a_figure_out_of_its_range_is_refused_naming_the_field(report, tmp_path, edit, message):
    """Counts and durations are at least 0 and ratios from 0 to 1 (docs/report-schema.md), the
    timeline's times go forward; before, -3 calls or an attainment of 1.5 were read and shown
    ('150.0%'), a TTFT p50 of -3 s as '-3,000' ms, a window of -1 s in a plot's title, and a
    reversed timeline drawn as 0 tokens/s throughout."""
    path = tmp_path / "edited.json"
    write_report(_edited(report, edit), path)
    with pytest.raises(ReportSchemaError, match=message):
        load_report(path)


def test_a_number_too_large_for_a_float_is_refused(report, tmp_path):
    """Before: JSON's 1e400 read as inf, and the page said 'fleetsched run: inf s'."""
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(report).replace('"duration_s": ', '"duration_s": 1e400, "x": ', 1))
    with pytest.raises(ReportSchemaError, match=r"duration_s: Input should be a finite number"):
        load_report(path)


def test_times_no_axis_can_span_are_refused_in_one_line(report, tmp_path, capsys):
    """Times near the largest float pass the schema (forward, at least 0) but no axis spans
    them: matplotlib's ValueError came out as a traceback."""
    path = tmp_path / "far.json"
    write_report(_edited(report, lambda r: r["timeline"].__setitem__("t", [1e308] * len(r["timeline"]["t"]))), path)
    assert render_main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fleetsched report: {path}: cannot plot its figures (") and len(err.splitlines()) == 1


def test_an_unknown_breach_reason_or_a_null_unreachable_list_still_renders(report, tmp_path):
    """Before: KeyError 'weird' (the SLA table) and TypeError (iterating None, the HTML page)."""

    def edit(r):
        r["tenants"][0]["sla"]["objectives"]["ttft_p99"]["breaches"] = {"weird": 3}
        r["sla"]["feasibility"]["unreachable"] = None

    path = tmp_path / "run.json"
    write_report(_edited(report, edit), path)
    assert render_main([str(path), "--out", str(tmp_path / "out")]) == 0
    assert "3 weird" in (tmp_path / "out" / "index.html").read_text()


def test_a_run_without_a_throughput_draws_no_mean_line(report, tmp_path, monkeypatch):
    """A run of no duration has throughput_tok_s null: the plot drew a 'run mean' line at 0,
    labelled '- tok/s'."""
    from matplotlib.axes import Axes

    from fleetsched.observability.render import plot_throughput

    lines = []
    monkeypatch.setattr(Axes, "axhline", lambda self, y=0, *args, **kw: lines.append(y))
    plot_throughput({**report, "throughput_tok_s": None}, tmp_path / "t.png")
    assert lines == []
    plot_throughput(report, tmp_path / "t.png")
    assert lines == [report["throughput_tok_s"]]


@pytest.mark.parametrize(
    ("tenant", "key"),
    [
        ({"weight": float("inf")}, "tenants.acme.weight"),
        ({"sla": {"ttft_p99_s": float("inf")}}, "tenants.acme.sla.ttft_p99_s"),
        ({"sla": {"latency_p95_s": float("inf")}}, "tenants.acme.sla.latency_p95_s"),
        ({"sla": {"deadline_s": float("inf")}}, "tenants.acme.sla.deadline_s"),
        ({"sla": {"min_tokens_per_s": float("inf")}}, "tenants.acme.sla.min_tokens_per_s"),
    ],
)
def test_a_tenant_figure_the_report_carries_must_be_finite(tenant, key):
    """Before: TOML's ``inf`` loaded, the report held ``"weight": Infinity`` or ``"target": Infinity``
    (not JSON), and ``fleetsched report`` refused the run's own report."""
    from fleetsched.errors import ConfigError
    from fleetsched.settings import load_settings

    with pytest.raises(ConfigError) as info:
        load_settings(tenants={"acme": tenant})
    assert info.value.key == key and "finite" in info.value.reason


def test_the_reports_shared_sorts_give_the_figures_of_sorting_apart():
    """`build_report` sorts each tenant's and tier's call times once and shares them with
    `summarise` and `evaluate`: the same figures as each computing its own, for a tenant whose
    calls span two tiers, a failed call and a call without a first token among them."""
    import math

    from fleetsched.observability.sla import evaluate
    from fleetsched.report import _call_times
    from fleetsched.scheduler import summarise
    from fleetsched.scheduler.records import CallRecord, Recorder, rank_percentile

    recorder = Recorder()
    for i in range(40):
        tenant, tier = ("a", i % 2) if i % 4 else ("b", 2)
        call = CallRecord(tenant, tier, i, submitted=i, started=i + 0.1, first_token=i + 0.2 + (i % 7) / 10, finished=i + 1 + (i % 5) / 3)
        if i == 5:
            call.error = "Overloaded"
        if i == 9:
            call.first_token = math.nan
        recorder.add_call(call)
    tenants = Settings(tenants={"a": {"sla": {"ttft_p99_s": 0.5, "latency_p95_s": 1.5}}, "b": {}}).tenants
    by_tenant, by_tier = _call_times(recorder.calls)
    assert summarise(recorder, tenants, by_tenant) == summarise(recorder, tenants)
    assert repr(evaluate(recorder, tenants, by_tenant)) == repr(evaluate(recorder, tenants))  # a breach's value may be nan
    ok = [c for c in recorder.calls if c.error is None]
    for tier, times in by_tier.items():
        assert times.ttft_s == sorted(c.ttft_s for c in ok if c.tier == tier and not math.isnan(c.ttft_s))
    assert by_tenant["a"].latency_s == sorted(c.latency_s for c in ok if c.tenant == "a")
    assert rank_percentile([c.ttft_s for c in ok if c.tenant == "a"], 99) == summarise(recorder, tenants, by_tenant)[0].ttft_p99_s


def test_a_recorder_that_keeps_no_calls_keeps_no_refusals_but_counts_them():
    """`keep_calls=False` (a server, a long run) kept every refused call: a tenant retrying
    against its rate limit grew the gateway's recorder for ever. The report reads the count."""
    from fleetsched.scheduler import CallRecord, Recorder

    for keep in (True, False):
        recorder = Recorder(keep_calls=keep)
        for i in range(1000):
            recorder.add_refusal(CallRecord("a", 2, i, float(i), math.nan, float(i), float(i), 0, 0, error="RateLimited"))
        assert recorder.refusal_count == 1000 and len(recorder.refusals) == (1000 if keep else 0)


@pytest.mark.parametrize(("low", "high", "expected"), [(0.003, 3.0, ["10 ms", "100 ms", "1 s"]), (0.01, 0.5, ["20 ms", "50 ms", "100 ms", "200 ms"])])
def test_time_axes_read_in_milliseconds_and_seconds(low, high, expected):
    """The TTFT plots' log axes read "$\\mathdefault{10^{-2}}$": matplotlib's labels are math
    text, which the renderer turns off (names are never math). They read 10 ms, 100 ms, 1 s; at
    1, 2 and 5 a decade over up to two decades."""
    from fleetsched.observability.render import _log_seconds, _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots()
    ax.plot([low, high], [0, 1])
    _log_seconds(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high]
    plt.close(fig)
    assert all(label in labels for label in expected) and not any("$" in label for label in labels), labels


def test_names_starting_with_an_underscore_keep_their_legend_entries(report, tmp_path, monkeypatch):
    """matplotlib leaves out of a legend every artist whose label starts with "_": a tenant named
    "_pager" had no entry in the TTFT and rolling attainment plots (its line drawn, unnamed), a
    device "_gpu0" none in the memory plot."""
    from matplotlib.figure import Figure

    from fleetsched.observability.render import plot_memory, plot_sla_attainment, plot_ttft_cdf

    def rename(r):
        r["tenants"][0]["tenant"] = "_pager"
        for metric in r["distributions"].values():
            metric["tenant"]["_pager"] = metric["tenant"].pop("pager")
        r["timeline"]["attainment"]["_pager"] = r["timeline"]["attainment"].pop("pager")
        r["memory"]["devices"][0]["name"] = "_gpu0"
        for series in ("memory_allocated_bytes", "fragmentation"):
            r["timeline"][series]["_gpu0"] = r["timeline"][series].pop("gpu0")

    edited = _edited(report, rename)
    assert edited["tenants"][0]["tier"] == "critical"
    legends = []
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *args, **kwargs: legends.extend(text.get_text().lstrip("\u200b") for ax in fig.axes if ax.get_legend() for text in ax.get_legend().get_texts())
    )
    for plot in (plot_ttft_cdf, plot_sla_attainment, plot_memory):
        plot(edited, tmp_path / "plot.png")
    assert {"_pager (critical)", "_pager", "_gpu0 allocated", "_gpu0 total", "_gpu0"} <= set(legends), legends


def test_the_sla_chart_names_objectives_as_the_tables_do_and_only_those_measured(report, tmp_path, monkeypatch):
    """Its legend read the report's keys (ttft_p99), and every tenant kept a slot for each of the
    six objectives, measured or not: bars stood off their tenant's name."""
    from matplotlib.axes import Axes

    from fleetsched.observability.render import plot_sla_attainment

    bars = []
    monkeypatch.setattr(Axes, "bar", lambda self, x, height, **kw: bars.append((x, kw.get("label"))))
    plot_sla_attainment(report, tmp_path / "sla.png")
    assert {label for _, label in bars if label} == {"TTFT p99", "admission p99", "call p95", "admission p95", "deadline", "tok/s"}
    for i, tenant in enumerate(t for t in report["tenants"] if t["sla"]["objectives"]):
        mine = [x for x, _ in bars if abs(x - i) < 0.5]
        assert len(mine) == sum(o["attainment"] is not None for o in tenant["sla"]["objectives"].values())
        assert sum(mine) / len(mine) == pytest.approx(i)  # centred under its name


# -- what the HTML page and the terminal tables show ----------------------------------------------


def _printed(renderable, width: int, crop: bool = True) -> list[str]:
    """`renderable` as a terminal `width` columns wide prints it; without `crop`, whole lines as
    drawn, wider ones too (rich cuts them at `width`, as a terminal does)."""
    import io

    from rich.console import Console

    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable, crop=crop)
    return console.export_text().splitlines()


def test_a_simulated_report_says_so_in_its_title_and_heading(report):
    """The page of a `fleetsched simulate` report (virtual time, the sim engine's model) was
    titled "fleetsched run report", as a measured run's: its figures read as measured ones."""
    from fleetsched.observability.render import render_html

    page = render_html(report)
    assert "<title>fleetsched simulated run report</title>" in page
    heading = page[page.index("<h1>") : page.index("</h1>")]
    assert "simulated" in heading and "virtual time" in heading
    run = {k: v for k, v in report.items() if k not in ("sim", "wall_s")}  # as `fleetsched run` writes it
    page = render_html(run)
    assert "<title>fleetsched run report</title>" in page and "simulated" not in page


def test_counts_show_thousands_separators_in_every_table(report):
    """Tokens read 5,254,686 beside 18834 calls and 6278 sessions done, in the same row."""
    from fleetsched.observability.render import render_html
    from fleetsched.report import sla_table, tenant_table

    def edit(r):
        t = r["tenants"][0]
        t.update(sessions_done=12345, sessions_failed=2345, sessions_cancelled=3456, calls=123456, prompt_tokens=4567890)
        t["sla"]["objectives"]["ttft_p99"]["breaches"] = {"queued": 5678}
        t["sla"]["refused"]["shed"] = 6789
        r["sessions"] = {"done": 12345, "failed": 2345}
        r["sla"]["breaches"] = {"total": 5678, "by_reason": {**r["sla"]["breaches"]["by_reason"], "queued": 5678}}

    edited = _edited(report, edit)
    page = render_html(edited)
    assert re.findall(r"<td>\d{4,}</td>", page) == []
    assert all(n in page for n in ("12,345", "2,345", "3,456", "123,456", "4,567,890", "5,678", "14,690 sessions"))
    text = "\n".join(_printed(tenant_table(edited), 200) + _printed(sla_table(edited), 200))
    assert re.findall(r"(?<![\d,.])\d{4,}", text) == [], text
    assert all(n in text for n in ("12,345", "2,345", "3,456", "123,456", "4,567,890", "5,678"))


LONG_NAMES = {"pager": "customer-support-bot-production-eu", "product": "customer-support-bot-production-us", "batch": "nightly"}


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_tenant_table_fits_the_terminal_one_line_a_tenant(report, width):
    """120 columns wide with short names, the table folded long names over several lines and
    cut figures (5,254,6…) to fit a terminal of 80 to 120 columns: now each tenant is one line,
    its name shortened where need be (still told apart), its figures whole."""
    from fleetsched.report import tenant_table

    def edit(r):
        for t in r["tenants"]:
            t.update(tenant=LONG_NAMES[t["tenant"]], calls=t["calls"] * 1000, prompt_tokens=t["prompt_tokens"] * 1000)

    edited = _edited(report, edit)
    lines = _printed(tenant_table(edited), width)
    assert all(len(line) <= width for line in lines), lines
    tables = sum(line.startswith("┏") for line in lines)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert len(rows) == tables * len(edited["tenants"]), lines  # one line a tenant in each table
    assert all("…" not in cell for row in rows for cell in row[1:]), lines
    figures = {cell for row in rows for cell in row[1:]}
    assert all(f"{t['calls']:,}" in figures and f"{t['prompt_tokens']:,}" in figures for t in edited["tenants"]), lines
    for n in range(tables):
        names = [row[0] for row in rows[n * 3 : n * 3 + 3]]
        assert len(set(names)) == 3 and names[2] == "nightly", names
        assert [name[-2:] for name in names[:2]] == ["eu", "us"], names


@pytest.mark.parametrize(("width", "headings"), [(140, 3), (200, 1)])
def test_the_tenant_table_shows_whole_names_where_the_terminal_has_room(report, width, headings):
    """Whole names first, then headings on one line, where the terminal has room for them."""
    from fleetsched.report import tenant_table

    edited = _edited(report, lambda r: [t.update(tenant=LONG_NAMES[t["tenant"]]) for t in r["tenants"]])
    lines = _printed(tenant_table(edited), width)
    assert sum(line.startswith("┏") for line in lines) == 1
    assert all(any(f"│ {name} " in line for line in lines) for name in LONG_NAMES.values()), lines
    assert sum(line.startswith("┃") for line in lines) == headings, lines


def test_an_attainment_just_under_its_share_is_written_under_it():
    """29,699 of 30,000 on time, rounded, read 0.99 beside ``required: 0.99, met: false``."""
    from fleetsched.report import _floor

    assert _floor(29_699 / 30_000) == 0.9899
    assert (_floor(0.99), _floor(1.0), _floor(float("nan"))) == (0.99, 1.0, None)


def test_a_measured_value_differing_from_its_target_never_reads_equal_to_it():
    """Whole milliseconds read "500 ms" measured against a target of "500 ms" beside MISSED,
    and a target of 2.3 ms read "2 ms"."""
    from fleetsched.report import sla_rows

    def row(objective, target, value, met):
        o = {"target": target, "value": value, "attainment": 0.5, "met": met, "breaches": {}}
        t = {"tenant": "t", "tier": "standard", "weight": 1.0, "sla": {"refused": {}, "objectives": {objective: o}}}
        ((*_, shown_target, shown_value, _, verdict, _),) = sla_rows({"sla": {"feasibility": None}, "tenants": [t]})
        return shown_target, shown_value, verdict

    assert row("ttft_p99", 0.5, 0.5003, False) == ("500 ms", "500.3 ms", "MISSED")
    assert row("ttft_p99", 0.5, 0.25, True) == ("500 ms", "250 ms", "met")
    assert row("ttft_p99", 0.0023, 0.0024, False) == ("2.3 ms", "2.4 ms", "MISSED")
    assert row("min_tokens_per_s", 5, 4.96, False) == ("5", "4.96", "MISSED")
    assert row("latency_p95", 2.0, None, None) == ("2,000 ms", "-", "not measured")


def test_a_value_over_its_target_by_less_than_the_report_s_rounding_reads_over_it():
    """The report keeps 4 decimals of seconds: a p99 of 500.04 ms is written 0.5, and read "500
    ms" beside a target of "500 ms" and MISSED."""
    from types import SimpleNamespace

    from fleetsched.report import _sla_section, sla_rows
    from fleetsched.scheduler import CallRecord, Recorder
    from fleetsched.settings import TenantSettings

    recorder = Recorder()
    for i in range(100):
        ttft = 0.50004 if i < 2 else 0.1
        recorder.add_call(CallRecord("t", 1, i, float(i), float(i), i + ttft, i + 1.0, 5, 10))
    scheduler = SimpleNamespace(recorder=recorder, settings=SimpleNamespace(tenants={"t": TenantSettings(sla={"ttft_p99_s": 0.5})}))
    _, by_tenant = _sla_section(scheduler, 0.0, {})
    tenant = {"tenant": "t", "tier": "standard", "weight": 1.0, "sla": by_tenant["t"]}
    (row,) = [row for row in sla_rows({"sla": {"feasibility": None}, "tenants": [tenant]}) if row[3] == "TTFT p99"]
    assert row[4:8] == ["500 ms", "> 500 ms", "98.0%", "MISSED"]


def test_a_value_within_its_target_reads_not_over_it_when_refusals_missed_the_objective():
    """Every served call's TTFT within its target (p99 499.96 ms, written 0.5), the objective
    missed by refused calls: it read "> 500 ms", a figure over the target that was not."""
    from types import SimpleNamespace

    from fleetsched.report import _sla_section, sla_rows
    from fleetsched.scheduler import CallRecord, Recorder
    from fleetsched.settings import TenantSettings

    recorder = Recorder()
    for i in range(100):
        refused = i < 2
        ttft = 0.1 if refused else 0.49996
        recorder.add_call(CallRecord("t", 1, i, float(i), float(i), i + ttft, i + 1.0, 5, 10, error="Overloaded" if refused else None))
    scheduler = SimpleNamespace(recorder=recorder, settings=SimpleNamespace(tenants={"t": TenantSettings(sla={"ttft_p99_s": 0.5})}))
    _, by_tenant = _sla_section(scheduler, 0.0, {})
    tenant = {"tenant": "t", "tier": "standard", "weight": 1.0, "sla": by_tenant["t"]}
    (row,) = [row for row in sla_rows({"sla": {"feasibility": None}, "tenants": [tenant]}) if row[3] == "TTFT p99"]
    assert row[4:8] == ["500 ms", "500 ms", "98.0%", "MISSED"]


def test_wide_character_names_fit_their_cells():
    """Names of CJK characters (two cells each) were measured in characters: folded over two
    lines even at 160 columns, two tenants read alike on their first."""
    from fleetsched.report import short_names
    from rich.cells import cell_len

    names = ("客户支持机器人-生产环境-东京", "客户支持机器人-生产环境-大阪")
    short = short_names(names, 12)
    assert all(cell_len(s) <= 12 for s in short.values()) and len(set(short.values())) == 2, short
    assert short_names(names, 30) == {name: name for name in names}


def test_shortened_names_are_cut_where_they_differ():
    """Names alike at both ends keep the part that tells them apart; none is cut that fits."""
    from fleetsched.report import short_names

    names = ("team-eu-west-prod", "team-us-east-prod", "batch")
    assert short_names(names, 20) == {name: name for name in names}
    short = short_names(names, 10)
    assert all(len(s) <= 10 for s in short.values()) and len(set(short.values())) == 3, short
    assert short["team-eu-west-prod"].startswith("team-e") and short["batch"] == "batch", short
    assert short_names(("abcdef", "abcxef"), 3) == {"abcdef": "abcdef", "abcxef": "abcxef"}  # no cut tells them apart: whole


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_sla_table_cuts_no_word_or_figure_to_fit_the_terminal(report, width):
    """Squeezed into 80 columns by rich, the SLA table read "criti…" for the tier and "100.…" for
    an attainment. Where every column cannot fit whole, tier and weight are left out (the
    tenant table shows the tier); cells wrap between words. Measured as drawn, uncut: the
    whole table was drawn 102 columns wide for a terminal of 100, its right edge lost."""
    from fleetsched.report import sla_rows, sla_table

    lines = _printed(sla_table(report), width, crop=False)
    assert all(len(line) <= width for line in lines), lines
    assert not any("…" in line for line in lines), lines
    text = " ".join(lines)
    assert all(row[6] in text for row in sla_rows(report)), lines  # each attainment whole
    assert ("┃ tier" in "\n".join(lines)) == (width > 100), lines


@pytest.mark.parametrize("width", [80, 90])
def test_a_long_breach_reason_is_folded_not_cut_at_the_terminal_s_edge(report, width):
    """Beside "(unreachable)" and "rate-limited", the reduced table was still too wide at 80
    columns: a terminal cut the reasons at its edge ("rate-limit")."""
    from fleetsched.report import sla_table

    def widen(r):
        r["sla"]["feasibility"]["unreachable"] = [{"tenant": t["tenant"]} for t in r["tenants"]]
        for t in r["tenants"]:
            t["sla"]["objectives"]["ttft_p99"]["breaches"] = {"rate-limited": 12345, "engine-slow": 1}

    lines = _printed(sla_table(_edited(report, widen)), width, crop=False)
    assert max(map(len, lines)) <= width, lines
    breaches = "".join(line.split("│")[-2].strip() for line in lines if line.startswith("│"))
    assert "rate-limited" in breaches, lines  # folded, not cut


@pytest.mark.parametrize("width", [56, 64, 72])
def test_the_sla_table_of_a_narrow_terminal_shows_every_verdict(report, width):
    """Under about 80 columns even the folded table was drawn wider than the terminal, which
    cut it at its right edge: the breaches went first, then the verdicts (no MISSED to be seen).
    It is printed as two tables there: the figures, then the verdicts and breaches."""
    from fleetsched.report import sla_rows, sla_table

    lines = _printed(sla_table(report), width, crop=False)
    assert max(map(len, lines)) <= width, lines
    rows = sla_rows(report)
    verdicts = [line.split("│")[3].strip() for line in lines if line.startswith("│") and line.split("│")[1].strip()]
    assert verdicts[-len(rows):] == [row[7] for row in rows], lines
    assert "MISSED" in verdicts, lines  # the fixture's run misses objectives
    text = " ".join(lines)
    assert all(row[6] in text for row in rows), lines  # each attainment whole


def test_a_long_run_s_timeline_stays_on_one_grid_as_it_thins():
    """Past its size the timeline keeps every other sample and samples half as often. It dropped
    the sample just taken, so the next came an interval and a half after the last kept: gaps of
    5 s in a series that said 4 s apart."""
    from fleetsched import Scheduler
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.observability.timeline import Timeline
    from fleetsched.virtual_time import run_virtual

    from .helpers import settings

    async def main():
        async with Scheduler(settings()) as scheduler:
            timeline = Timeline(scheduler, SlaTracker(scheduler.settings.tenants), interval_s=1.0, max_samples=10)
            with anyio.move_on_after(100):
                await timeline.run()
        return timeline.as_dict()

    sampled = run_virtual(main)
    t = sampled["t"]
    assert sampled["interval_s"] == 16.0 and len(t) <= 11
    assert {round(b - a, 6) for a, b in zip(t, t[1:])} == {16.0} and t[0] == 0.0


def test_a_last_sample_taken_on_a_tick_replaces_the_tick_s():
    """A run that ends on a sampling tick was sampled twice at its end: ``t`` ended 65.0, 65.0."""
    from fleetsched import Scheduler
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.observability.timeline import Timeline
    from fleetsched.virtual_time import run_virtual

    from .helpers import settings

    async def main():
        async with Scheduler(settings()) as scheduler:
            timeline = Timeline(scheduler, SlaTracker(scheduler.settings.tenants), interval_s=1.0)
            async with anyio.create_task_group() as tg:
                tg.start_soon(timeline.run)
                await anyio.sleep(3)
                await anyio.sleep(0)  # the tick at 3.0 samples
                tg.cancel_scope.cancel()
            timeline.sample()  # at 3.0 too, as a run's end takes its last
        return timeline.as_dict()

    sampled = run_virtual(main)
    assert sampled["t"] == [0.0, 1.0, 2.0, 3.0]
    assert len(sampled["window"]) == 4 and all(len(v) == 4 for v in sampled["queued_calls"].values())


def test_a_timeline_s_samples_count_from_its_start_and_accumulate_tokens():
    """Timeline times count from its start, its tokens add up, and no events read null attainment."""
    from fleetsched import Scheduler
    from fleetsched.observability.sla import SlaTracker
    from fleetsched.observability.timeline import Timeline
    from fleetsched.scheduler import CallRecord
    from fleetsched.virtual_time import run_virtual

    from .helpers import settings

    async def main():
        await anyio.sleep(5)
        async with Scheduler(settings({"acme": {"sla": {"ttft_p99_s": 1.0}}})) as scheduler:
            timeline = Timeline(scheduler, SlaTracker(scheduler.settings.tenants))
            for tokens in (10, 20):
                scheduler.recorder.add_call(CallRecord("acme", 1, 0, 0.0, completion_tokens=tokens, error="Cancelled"))
                timeline.sample()
                await anyio.sleep(1)
        return timeline.as_dict()

    sampled = run_virtual(main)
    assert sampled["t"] == [0.0, 1.0] and sampled["completion_tokens"] == [10, 30]
    assert sampled["attainment"] == {"acme": [None, None]}


def test_a_share_just_under_a_tenth_of_a_percent_reads_under_it():
    """98.999 % of calls on time reads 98.9 %, not 99.0 %, in the tables."""
    from fleetsched.report import share_text

    assert (share_text(0.98999), share_text(1.0), share_text(None)) == ("98.9%", "100.0%", "-")


def test_breach_events_are_timed_from_the_run_s_start():
    """A breach's ``t`` in the report is seconds since the run's start, not the clock's reading."""
    from types import SimpleNamespace

    from fleetsched.report import _sla_section
    from fleetsched.scheduler import CallRecord, Recorder
    from fleetsched.settings import TenantSettings

    recorder = Recorder()
    recorder.add_call(CallRecord("t", 1, 0, 100.0, 100.0, 103.0, 105.0, 5, 10))  # TTFT 3 s, ends at 105
    scheduler = SimpleNamespace(recorder=recorder, settings=SimpleNamespace(tenants={"t": TenantSettings(sla={"ttft_p99_s": 1.0})}))
    section, _ = _sla_section(scheduler, 100.0, {})
    assert [(e["t"], e["objective"], e["value"]) for e in section["events"]] == [(5.0, "ttft_p99", 3.0)]


def test_a_tenant_s_ttft_and_latency_figures_are_its_p50_and_p99():
    """The report's per-tenant TTFT and latency are the p50 and p99 (nearest rank) of its successful calls."""
    from fleetsched import Scheduler
    from fleetsched.report import build_report
    from fleetsched.scheduler import CallRecord

    from .helpers import settings

    async def main():
        async with Scheduler(settings({"t": {}})) as scheduler:
            for i in range(1, 11):  # TTFTs 0.1 .. 1.0 s, latencies 1 .. 10 s
                scheduler.recorder.add_call(CallRecord("t", 1, 0, 0.0, 0.0, i / 10, float(i), 5, 10))
            return build_report(scheduler, duration_s=10.0, backend="instant")

    (tenant,) = anyio.run(main)["tenants"]
    assert (tenant["ttft_s"], tenant["latency_s"]) == ({"p50": 0.5, "p99": 1.0}, {"p50": 5.0, "p99": 10.0})


def test_the_throughput_is_of_the_duration_the_report_writes():
    """`throughput_tok_s` is `completion_tokens` over `duration_s` as written (rounded to the
    millisecond), and null where that reads 0: from the unrounded duration, a run of 0.8 ms read
    0.001 s beside 20,000 tok/s for its 16 tokens, and one of 0.4 ms 0.0 s beside 40,000 tok/s."""
    from fleetsched import Scheduler
    from fleetsched.report import build_report
    from fleetsched.scheduler import CallRecord

    from .helpers import settings

    async def main(duration_s):
        async with Scheduler(settings({"t": {}})) as scheduler:
            scheduler.recorder.add_call(CallRecord("t", 1, 0, 0.0, 0.0, 0.0001, 0.0003, 5, 16))
            return build_report(scheduler, duration_s=duration_s, backend="instant")

    short = anyio.run(main, 0.0008)
    assert (short["duration_s"], short["completion_tokens"], short["throughput_tok_s"]) == (0.001, 16, 16000.0)
    shorter = anyio.run(main, 0.0004)
    assert (shorter["duration_s"], shorter["throughput_tok_s"]) == (0.0, None)


def test_times_under_10_ms_show_a_tenth_of_a_millisecond():
    """The tenant table writes 5 ms as 5.0 and 50 ms as 50."""
    from fleetsched.report import _ms

    assert (_ms(0.005), _ms(0.05), _ms(None)) == ("5.0", "50", "-")


def _sla_cells(objective, target, value, met, **flags):
    """The target, measured and verdict cells of a one-objective SLA row."""
    o = {"target": target, "value": value, "attainment": 0.5, "met": met, "breaches": {}, **flags}
    t = {"tenant": "t", "tier": "standard", "weight": 1.0, "sla": {"refused": {}, "objectives": {objective: o}}}
    ((*_, shown_target, shown_value, _, verdict, _),) = sla_rows({"sla": {"feasibility": None}, "tenants": [t]})
    return shown_target, shown_value, verdict


def test_a_measured_time_under_10_ms_shows_a_decimal():
    """A measured 2.5 ms reads "2.5 ms" beside a target of 100 ms, not "2 ms"."""
    assert _sla_cells("ttft_p99", 0.1, 0.0025, True) == ("100 ms", "2.5 ms", "met")


def test_a_measured_value_a_hair_over_its_target_shows_the_digits_that_tell_them_apart():
    """500.0003 ms against 500 ms reads with as many decimals as it takes, up to 6."""
    assert _sla_cells("ttft_p99", 0.5, 0.5000003, False)[1] == "500.0003 ms"


def test_a_token_rate_under_its_target_by_less_than_the_rounding_reads_under_it():
    """A min_tokens_per_s missed by less than the report's rounding reads "< 5" beside a target
    of 5; missed by refused or failed calls alone, the rate itself at its target, "5.0"."""
    assert _sla_cells("min_tokens_per_s", 5, 5, False, value_past_target=True) == ("5", "< 5.0", "MISSED")
    assert _sla_cells("min_tokens_per_s", 5, 5, False) == ("5", "5.0", "MISSED")


def test_failed_sessions_count_cancelled_ones_among_those_that_ended():
    """"2 of 5 sessions failed" counts done, failed and cancelled sessions as ended."""
    from fleetsched.report import failed_sessions

    tenant = {"sessions_done": 1, "sessions_failed": 2, "sessions_cancelled": 2, "session_errors": {"ContextTooLong": 2}}
    assert failed_sessions({"tenants": [tenant]}) == "2 of 5 sessions failed (ContextTooLong 2)"


def test_a_run_in_which_nothing_failed_is_not_a_run_in_which_nothing_worked():
    """nothing_done is true only when sessions failed and none completed."""
    from fleetsched.report import nothing_done

    def report(done, failed):
        return {"tenants": [{"sessions_done": done, "sessions_failed": failed, "sessions_cancelled": 3}]}

    assert (nothing_done(report(0, 0)), nothing_done(report(0, 2)), nothing_done(report(1, 2))) == (False, True, False)


def test_an_unreachable_tenant_s_ttft_row_alone_says_so():
    """"(unreachable)" marks the TTFT p99 verdict of a flagged tenant, not its other objectives."""
    objectives = {name: {"target": 1.0, "value": 0.5, "attainment": 1.0, "met": True, "breaches": {}} for name in ("ttft_p99", "latency_p95")}
    t = {"tenant": "t", "tier": "standard", "weight": 1.0, "sla": {"refused": {}, "objectives": objectives}}
    rows = sla_rows({"sla": {"feasibility": {"unreachable": [{"tenant": "t"}]}}, "tenants": [t]})
    assert [(row[3], row[7]) for row in rows] == [("TTFT p99", "met (unreachable)"), ("call p95", "met")]


def test_a_tenant_without_an_sla_lists_only_the_refusals_it_had():
    """A tenant with no objectives gets a "no SLA" row naming its non-zero refusals only."""
    t = {"tenant": "t", "tier": "batch", "weight": 2.0, "sla": {"refused": {"shed": 0, "rate_limited": 1234}, "objectives": {}}}
    (row,) = sla_rows({"sla": {"feasibility": None}, "tenants": [t]})
    assert row == ["t", "batch", "2", "-", "-", "-", "-", "no SLA", "1,234 rate-limited"]
