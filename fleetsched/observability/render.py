"""``fleetsched report RUN.json --out DIR``: plots of a run report and an HTML page that shows them.

Writes into DIR: ``ttft_cdf.png`` (TTFT CDF per tier and per tenant, SLA targets dashed),
``throughput.png``, ``queue_depth.png``, ``memory.png`` (allocated memory and fragmentation per
device), ``sla_attainment.png`` (attainment per tenant and objective, and the rolling attainment
over time) and ``index.html`` (the plots with the tenant and SLA tables). Exit codes: 0 done,
2 when the report cannot be read or is of another schema version, or DIR cannot be written.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any

from ..errors import ReportSchemaError
from ..report import SLA_COLUMNS, TENANT_COLUMNS, count_text, is_simulated, load_report, objective_text, run_title, sla_rows, tenant_rows, throughput_text
from .sla import OBJECTIVES, REASON_TEXT

PLOTS = ("ttft_cdf.png", "throughput.png", "queue_depth.png", "memory.png", "sla_attainment.png")
TIER_COLORS = {"critical": "tab:red", "standard": "tab:blue", "batch": "tab:green"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Labels are tenants' and devices' names, never math: "$a$b" failed the whole render.
    plt.rcParams["text.parse_math"] = False
    return plt


def _label(name: str) -> str:
    """A tenant's or device's name as a legend label. matplotlib leaves out of a legend every
    artist whose label starts with "_": a tenant "_internal" had no entry in the TTFT and
    attainment plots (its line drawn, unnamed), a device "_gpu0" none in the memory plot. A
    zero-width space before such a name keeps its entry, and reads the same."""
    return "\u200b" + name if name.startswith("_") else name


def _seconds_text(value: float, _position: object = None) -> str:
    return f"{value * 1e3:g} ms" if value < 1 else f"{value:g} s"


def _log_seconds(ax: Any) -> None:
    """Label a log x axis of times as "20 ms" or "5 s", at 1, 2 and 5 a decade over up to two
    decades and once a decade over more: matplotlib's own labels are math text, which
    `_pyplot` turns off (they read ``$\\mathdefault{10^{-2}}$``). Call it once the data is drawn."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    low, high = ax.get_xlim()
    decades = math.log10(high / low) if 0 < low < high else 0.0
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades <= 2 else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(_seconds_text))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, quantiles: list[float] | None, label: str, **style: Any) -> None:
    if not quantiles:
        return
    ax.plot(quantiles, [q / 100 for q in range(101)], label=label, **style)


def plot_ttft_cdf(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    dist = report["distributions"]["ttft_s"]
    # One time scale for both panels: the same calls, read side by side.
    fig, (by_tier, by_tenant) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True, sharey=True)
    for tier in sorted(dist["tier"], key=lambda tier: (list(TIER_COLORS).index(tier) if tier in TIER_COLORS else len(TIER_COLORS), tier)):
        _cdf(by_tier, dist["tier"][tier], tier, color=TIER_COLORS.get(tier))
    # Tenants in colours the tiers do not use: blue on the left is a tier, never a tenant.
    from matplotlib.colors import to_hex

    taken = {to_hex(c) for c in TIER_COLORS.values()}
    colors = [c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] if to_hex(c) not in taken]
    for i, t in enumerate(report["tenants"]):
        color = colors[i % len(colors)]
        _cdf(by_tenant, dist["tenant"].get(t["tenant"]), _label(f"{t['tenant']} ({t['tier']})"), color=color)
        target = t["sla"]["objectives"].get("ttft_p99", {}).get("target")
        if target is not None:
            by_tenant.axvline(target, color=color, linestyle="--", linewidth=1)
    targets = any("ttft_p99" in t["sla"]["objectives"] for t in report["tenants"])
    for ax, title in ((by_tier, "TTFT by tier"), (by_tenant, "TTFT by tenant" + (" (dashed: TTFT p99 objective)" if targets else ""))):
        _log_seconds(ax)
        ax.set_xlabel("time to first token")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(0.99, color="grey", linewidth=0.8, linestyle=":", label="p99")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    by_tier.set_ylabel("share of calls")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(report: dict[str, Any]) -> dict[str, Any] | None:
    timeline = report.get("timeline")
    return timeline if timeline and len(timeline.get("t", [])) >= 2 else None


def _empty(ax: Any, text: str = "no timeline in this report") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def plot_throughput(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.8))
    tl = _timeline(report)
    if tl is None:
        _empty(ax)
    else:
        t, tokens = tl["t"], tl["completion_tokens"]
        rates = [(tokens[i] - tokens[i - 1]) / (t[i] - t[i - 1]) if t[i] > t[i - 1] else 0.0 for i in range(1, len(t))]
        # A call's tokens count when it ends (the timeline's counts): a bin where calls only ran reads 0.
        ax.stairs(rates, t, color="tab:purple", label="tokens/s of the calls that ended")
        if report["throughput_tok_s"] is not None:  # None: a run of no duration
            ax.axhline(report["throughput_tok_s"], color="grey", linestyle="--", linewidth=1, label=f"run mean {throughput_text(report)}")
        ax.legend(fontsize=8)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput over time")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_queue_depth(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (sessions, calls) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    tl = _timeline(report)
    if tl is None:
        _empty(sessions)
    else:
        t = tl["t"]
        for tier, values in tl["queued_sessions"].items():
            if any(values):
                sessions.plot(t, values, label=f"{tier}", color=TIER_COLORS.get(tier))
        sessions.plot(t, tl["running_sessions"], label="running (all tiers)", color="black", linewidth=0.8, linestyle=":")
        for tier, values in tl["queued_calls"].items():
            if any(values):
                calls.plot(t, values, label=f"{tier} queued", color=TIER_COLORS.get(tier))
        calls.plot(t, tl["in_flight"], label="in flight", color="black", linewidth=0.8)
        calls.plot(t, tl["window"], label="window", color="grey", linestyle="--", linewidth=1.2, zorder=3)  # seen where in flight fills it
        for ax in (sessions, calls):
            ax.legend(fontsize=8, loc="best")
    sessions.set_title("Sessions waiting for admission, per tier")
    sessions.set_ylabel("sessions")
    calls.set_title("Model calls waiting for the in-flight window, per tier")
    calls.set_ylabel("calls")
    calls.set_xlabel("time since start (s)")
    for ax in (sessions, calls):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (mem, frag) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    tl = _timeline(report)
    totals = {d["name"]: d["total_bytes"] for d in report["memory"].get("devices", [])}
    if tl is None:
        _empty(mem)
    else:
        t = tl["t"]
        for device, values in tl["memory_allocated_bytes"].items():
            line = mem.plot(t, [v / 1e9 for v in values], label=_label(f"{device} allocated"))[0]
            if device in totals:
                mem.axhline(totals[device] / 1e9, color=line.get_color(), linestyle="--", linewidth=0.8, label=_label(f"{device} total"))
        for device, values in tl["fragmentation"].items():
            frag.plot(t, [100 * v for v in values], label=_label(device))
        mem.legend(fontsize=8, loc="best")
        frag.legend(fontsize=8, loc="best")
    mem.set_title("Memory reserved by sessions, per device")
    mem.set_ylabel("GB")
    frag.set_title("Fragmentation per device: (free - largest free) / free")
    frag.set_ylabel("%")
    frag.set_ylim(0, 100)
    frag.set_xlabel("time since start (s)")
    for ax in (mem, frag):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sla_attainment(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (bars, over_time) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 1.3]})
    tenants = [t for t in report["tenants"] if t["sla"]["objectives"]]
    measured = [[o for o in OBJECTIVES if (t["sla"]["objectives"].get(o) or {}).get("attainment") is not None] for t in tenants]
    colors = dict(zip(OBJECTIVES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))  # one colour an objective, in every report
    width = 0.8 / max(1, max(map(len, measured), default=1))
    labelled: set[str] = set()
    for i, (t, mine) in enumerate(zip(tenants, measured)):
        for k, objective in enumerate(mine):  # centred under the tenant's name, whatever it measures
            label = None if objective in labelled else objective_text(objective)
            labelled.add(objective)
            x = i + (k - (len(mine) - 1) / 2) * width
            bars.bar(x, 100 * t["sla"]["objectives"][objective]["attainment"], width=width, color=colors[objective], label=label)
    bars.set_xticks(range(len(tenants)), [f"{t['tenant']}\n({t['tier']})" for t in tenants], fontsize=8)
    bars.set_ylim(0, 130)  # room above the bars for the legend
    bars.set_yticks(range(0, 101, 20))
    bars.set_ylabel("attainment (% of events within target)")
    bars.set_title("SLA attainment per tenant, whole run")
    if tenants:
        bars.axhline(99, color="grey", linestyle=":", linewidth=0.8, label="99 %")
        bars.legend(fontsize=8, loc="upper center", ncol=4)
    else:
        _empty(bars, "no tenant has an SLA")
    tl = _timeline(report)
    if tl is None:
        _empty(over_time)
    elif not tenants:
        _empty(over_time, "no tenant has an SLA")
    else:
        for t in tenants:
            values = tl["attainment"].get(t["tenant"])
            if values is None:  # a report edited by hand, or merged: nothing to draw for this tenant
                continue
            over_time.plot(tl["t"], [None if v is None else 100 * v for v in values], label=_label(t["tenant"]))
        over_time.set_ylim(0, 105)
        if over_time.get_legend_handles_labels()[0]:
            over_time.legend(fontsize=8, loc="best")
    over_time.set_title(f"Rolling attainment (worst objective, {tl['window_s'] if tl else '-'} s window)")
    over_time.set_xlabel("time since start (s)")
    over_time.set_ylabel("%")
    for ax in (bars, over_time):
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(columns: list[str] | tuple[str, ...], rows: list[list[Any]]) -> str:
    """An HTML table; a row whose verdict is MISSED (the SLA table's) is marked as the terminal marks it."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        ("<tr class='bad'>" if any(str(v).startswith("MISSED") for v in row) else "<tr>")
        + "".join(f"<td>{html.escape(str(v))}</td>" for v in row)
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict[str, Any]) -> str:
    sla = report["sla"]
    by_reason = [[REASON_TEXT.get(r, r), count_text(n)] for r, n in sla["breaches"]["by_reason"].items()]
    feasibility = sla.get("feasibility") or {}
    flagged = "".join(f"<li class='bad'>{html.escape(u['message'])}</li>" for u in feasibility.get("unreachable") or [])
    note = f"<li>{html.escape(feasibility['note'])}</li>" if feasibility.get("note") else ""
    floors = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in (feasibility.get("unloaded_ttft_s") or {}).items())
    feasibility_html = (
        f"<p>Unloaded TTFT ({html.escape(str(feasibility.get('method')))}): {html.escape(floors) or '-'}</p><ul>{flagged}{note}</ul>"
        if feasibility
        else "<p>not checked</p>"
    )
    images = "".join(f"<figure><img src='{name}' alt='{name}'></figure>" for name in PLOTS)
    title, simulated = "fleetsched run report", ""
    if is_simulated(report):  # modelled figures, which must not read as measured ones
        profile = report["sim"].get("profile")
        title = "fleetsched simulated run report"
        simulated = (
            "<p class='sim'>Simulated by <code>fleetsched simulate</code> in virtual time, on the sim engine model"
            f"{f' (profile {html.escape(str(profile))})' if profile else ''}: the figures are modelled, not measured.</p>"
        )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }} th:first-child, th:nth-child(2), td:first-child, td:nth-child(2) {{ text-align: left; }}
img {{ max-width: 100%; }} .bad {{ color: #b00; }} .sim {{ background: #fff4d6; padding: 0.5em; }}
</style></head><body>
<h1>{html.escape(run_title(report))}</h1>{simulated}
<p>{sum(report['sessions'].values()):,} sessions ({html.escape(', '.join(f'{k} {v:,}' for k, v in report['sessions'].items()))}),
{report['calls']:,} calls, {report.get('refused_calls', 0):,} refused, {report['completion_tokens']:,} tokens generated,
{throughput_text(report)}. Schema {html.escape(report['schema'])}.</p>
<h2>Tenants</h2>{_table(TENANT_COLUMNS, tenant_rows(report))}
<h2>SLA</h2>{_table(SLA_COLUMNS, sla_rows(report))}
<h3>Breaches by reason ({sla['breaches']['total']:,})</h3>{_table(["reason", "breaches"], by_reason)}
<h3>Feasibility at start</h3>{feasibility_html}
<h2>Plots</h2>{images}
</body></html>
"""


def render(report: dict[str, Any], out: Path) -> list[Path]:
    """Write every plot and ``index.html`` into `out` (created); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    writers = (plot_ttft_cdf, plot_throughput, plot_queue_depth, plot_memory, plot_sla_attainment)
    paths = []
    for name, write in zip(PLOTS, writers):
        write(report, out / name)
        paths.append(out / name)
    index = out / "index.html"
    # UTF-8, as the page says (<meta charset="utf-8">), whatever the locale's encoding: an ASCII
    # or cp1252 one failed the page of a tenant "ünï 日本" ("cannot plot its figures"), or wrote
    # its name in another encoding than the page declares.
    index.write_text(render_html(report), encoding="utf-8")
    return [*paths, index]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched report", description=__doc__.splitlines()[0])
    parser.add_argument("report", metavar="RUN.json", help="a report written by fleetsched run/simulate --report")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the plots and index.html")
    args = parser.parse_args(argv)
    try:
        report = load_report(args.report)
    except ReportSchemaError as exc:
        print(f"fleetsched report: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, or no permission
        print(f"fleetsched report: --out {out}: cannot make that directory ({exc.strerror})", file=sys.stderr)
        return 2
    try:
        paths = render(report, out)
    except OSError as exc:  # a directory that exists but cannot be written (no permission, /proc)
        name = Path(exc.filename).name if exc.filename else "into it"
        print(f"fleetsched report: --out {out}: cannot write {name} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except (ValueError, OverflowError) as exc:  # figures the schema takes but no axis spans (times near 1e308)
        print(f"fleetsched report: {args.report}: cannot plot its figures ({exc})", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
