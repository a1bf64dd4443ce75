"""The ``fleetsched`` command line.

    fleetsched run CONFIG [--backend sim] [--report FILE.json] [--metrics-port PORT] [--no-live]
    fleetsched bench NAME [--json] ...
    fleetsched simulate CONFIG --duration 2h [--find-max-sessions]
    fleetsched calibrate --url URL --out profile.toml
    fleetsched report RUN.json --out DIR
    fleetsched serve --config CONFIG

A bad config exits with code 2 and a message naming the key and the reason; Ctrl-C with 130,
SIGTERM with 143, each after a clean stop and one line.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m fleetsched.cli`: run as `python -m fleetsched` runs it, with
    # the imports below (a second and more) under its Ctrl-C handling
    from fleetsched.__main__ import main as _command

    raise SystemExit(_command())

import argparse
import json
import os
import signal
import sys
import warnings
from typing import Any

import anyio
from rich.console import Console

from . import bench
from ._args import applies_only, positive_float, tcp_port, url_host, writable_file
from .errors import BackendUnavailable, ConfigError
from .gc_tuning import SERVING, gc_thresholds
from .report import drop_stdout, nothing_done, table_console
from .settings import Settings, load_settings


def _load(path: str, backend: str | None) -> Settings:
    settings = load_settings(path)
    if backend is not None:
        try:
            # Only what the config set: a default dumped and read back would count as set (a
            # backend.model "set" so is named in every call, not asked of the server).
            section = settings.backend.model_validate({**settings.backend.model_dump(exclude_unset=True), "kind": backend})
        except ValueError as exc:
            raise ConfigError("--backend", str(exc).splitlines()[-1].strip()) from None
        settings = settings.model_copy(update={"backend": section})
        try:  # model_copy skips the checks across sections, which the new backend may fail
            settings._workload_tenants_declared()
        except ValueError as exc:
            raise ConfigError("--backend", str(exc)) from None
    if not settings.workload.agents and settings.workload.trace is None:
        raise ConfigError("workload.agents", "the config describes no agents to run (nor a workload.trace)")
    from .agents.workload import session_count

    # A bad trace is a config error, found before the run; so is one of no sessions (an empty
    # file ran nothing and exited 0, where `simulate` refused it).
    if not session_count(settings.workload, settings):
        raise ConfigError("workload", "the config describes no sessions to run (agents or a trace)")
    return settings


async def _run(settings: Settings, args: argparse.Namespace, console: Console) -> dict | None:
    """Run the workload and print its tables; the report, or None when the run could not start
    or its report could not be written."""
    from .agents.workload import run_workload, session_count
    from .display import live_view
    from .observability.feasibility import check_feasibility
    from .observability.sla import SlaTracker
    from .observability.timeline import Timeline
    from .report import build_report, failed_sessions, save_json, sla_table, tenant_table
    from .scheduler import Scheduler

    total = session_count(settings.workload)
    tracker = SlaTracker(settings.tenants, window_s=args.sla_window)
    async with Scheduler(settings) as scheduler:
        feasibility = await check_feasibility(settings, scheduler.backend, scheduler.model)
        for flagged in feasibility["unreachable"]:
            print(f"fleetsched: warning: {flagged['message']}", file=sys.stderr, flush=True)
        if feasibility["note"]:
            print(f"fleetsched: note: {feasibility['note']}", file=sys.stderr, flush=True)
        start = anyio.current_time()
        timeline = Timeline(scheduler, tracker, interval_s=args.sample_interval)
        async with anyio.create_task_group() as tg:
            if args.metrics_port is not None:
                from .observability.metrics import registry_for, serve_metrics

                host = url_host(args.metrics_host)  # IPv6 in brackets
                try:
                    port = await tg.start(serve_metrics, registry_for(scheduler, tracker), args.metrics_host, args.metrics_port)
                except OSError as exc:  # the port is taken, the host is not ours, ...
                    print(f"fleetsched run: cannot serve metrics on {host}:{args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
                    return None
                print(f"fleetsched: metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
            tg.start_soon(timeline.run)
            if not args.no_live:
                tg.start_soon(lambda: live_view(scheduler, total, console, tracker=tracker))
            await run_workload(scheduler, settings.workload)
            tg.cancel_scope.cancel()
        timeline.sample()
        duration = anyio.current_time() - start
    report = build_report(
        scheduler, duration_s=duration, backend=settings.backend.kind, start=start, timeline=timeline.as_dict(), feasibility=feasibility
    )
    # Saved before anything is printed: a reader of stdout that stops early (`| head`) cannot
    # lose it. (Not written, it is printed, then the tables.)
    saved = not args.report or save_json(json.dumps(report, indent=2) + "\n", args.report, "fleetsched run")
    console.print(tenant_table(report))
    console.print(sla_table(report))
    failed = failed_sessions(report)
    if failed:
        print(f"fleetsched run: {failed}", file=sys.stderr)
    if not saved:
        return None
    if args.report:
        console.print(f"report written to {args.report}", markup=False)
    return report


#: Whether SIGTERM stopped the command (`_terminate`), not Ctrl-C.
_terminated = False


def main(argv: list[str] | None = None) -> int:
    """The ``fleetsched`` command: its exit status (130 when stopped by Ctrl-C, 143 by SIGTERM,
    as shells count them)."""
    global _terminated
    _terminated = False
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (a caller's own thread): signals are not ours to take
        previous = None
    try:
        return _stopped_or(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM (`kill`, `timeout`, a service manager, `docker stop`) stops the command as Ctrl-C
    does. Its default killed the process where it stood, with no word: the live dashboard left
    half drawn and the terminal's cursor hidden, nothing closed; as a container's first process
    it was not stopped at all (the kernel ignores a default signal there) until killed. It hands
    the signal to SIGINT's handler of the moment (the event loop's cancels the run, as it does
    on Ctrl-C; Python's own raises KeyboardInterrupt)."""
    global _terminated
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # SIGINT ignored (a shell's background job): SIGTERM still ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _terminated = True
    handler(signal.SIGINT, frame)


def _stopped_or(argv: list[str] | None) -> int:
    """The command's exit status, or that of its stop by Ctrl-C or SIGTERM, with one line."""
    try:
        return _main(argv)
    except BrokenPipeError:  # `... --json | head`: the reader has all it wanted
        # Python would report the pipe again as it flushes stdout at exit: point it at nothing.
        drop_stdout()
        return 0
    except KeyboardInterrupt:  # the run stopped where it was: say so, without a traceback
        _quiet_unstarted_tasks()
    except BaseExceptionGroup as group:  # trio (simulate --loop trio) raises it in its task groups
        if group.split(KeyboardInterrupt)[1] is not None:
            raise
        _quiet_unstarted_tasks()
    if _terminated:
        print("fleetsched: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    print("fleetsched: interrupted", file=sys.stderr)
    return 130


def _quiet_unstarted_tasks() -> None:
    """Ctrl-C stops the run wherever it is; on trio that can be inside `start_soon`, after a
    task's coroutine was made and before it started. Its "never awaited" warning, given when the
    interrupt's traceback is dropped or at exit, would only be noise after "interrupted"."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched", description="Run fleets of LLM agents on shared inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the workload a config describes")
    run.add_argument("config", help="TOML settings file (tenants, backend, workload)")
    run.add_argument("--backend", choices=["sim", "instant", "vllm-server", "vllm-engine"], help="override backend.kind")
    run.add_argument("--report", type=writable_file, metavar="FILE.json", help="write the run's figures as JSON")
    run.add_argument("--no-live", action="store_true", help="no live view, only the final table")
    run.add_argument("--metrics-port", type=tcp_port, metavar="PORT", help="serve Prometheus metrics on PORT (0: any free port, printed on stderr)")
    run.add_argument("--metrics-host", help="with --metrics-port: the address it listens on (default 127.0.0.1)")
    run.add_argument("--sla-window", type=positive_float, default=60.0, metavar="S", help="rolling window of the live SLA attainment (default 60 s)")
    run.add_argument("--sample-interval", type=positive_float, default=0.5, metavar="S", help="timeline sampling period in the report (default 0.5 s)")

    bench_cmd = commands.add_parser("bench", help="run a benchmark", add_help=False)
    # Its own -h: `bench NAME --help` is the benchmark's (in `rest`), `bench --help` lists them.
    bench_cmd.add_argument("-h", "--help", action="store_true", help="list the benchmarks")
    bench_cmd.add_argument("name", nargs="?", help=", ".join(f"{k}: {v}" for k, v in bench.BENCHMARKS.items()))
    bench_cmd.add_argument("rest", nargs=argparse.REMAINDER)

    # Commands implemented in their own modules, each with main(argv) -> int.
    delegated = {
        "simulate": ("fleetsched.simulate", "run a config on the sim backend in virtual time; capacity planning"),
        "calibrate": ("fleetsched.calibrate", "fit a sim profile to a real vLLM server"),
        "report": ("fleetsched.observability.render", "render a run's JSON report as plots and an HTML page"),
        "serve": ("fleetsched.gateway.server", "serve the OpenAI-compatible multi-tenant QoS gateway"),
    }
    for name, (_, text) in delegated.items():
        commands.add_parser(name, help=text, add_help=False).add_argument("rest", nargs=argparse.REMAINDER)

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in delegated:
        import importlib

        return importlib.import_module(delegated[argv[0]][0]).main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "run":  # an address without a port served nothing, without a word
        applies_only(run, args, {"metrics_host": "127.0.0.1"}, args.metrics_port is not None, "with --metrics-port")
    console = table_console()
    if args.command == "bench":
        if not args.name:
            for name, text in bench.BENCHMARKS.items():
                console.print(f"{name:14} {text}")
            return 0
        if args.help:  # `bench --help NAME` is the benchmark's help; it ran the benchmark, -h ignored
            return bench.run(args.name, ["--help"])
        return bench.run(args.name, args.rest)
    try:
        settings = _load(args.config, args.backend)
    except ConfigError as exc:
        print(f"fleetsched: config error: {exc}", file=sys.stderr)
        return 2
    with gc_thresholds(SERVING):
        try:
            report = anyio.run(_run, settings, args, console)
            # Tables that could not be written (a full disk under `> run.log`) fail the run as
            # a report that could not be written does.
            if report is None or nothing_done(report) or console.write_error is not None:
                return 1
        except ConfigError as exc:  # found as the scheduler starts: a KV cache smaller than a session's budget
            print(f"fleetsched: config error: {exc}", file=sys.stderr)
            return 2
        except BackendUnavailable as exc:
            # The advice of the backend's kind: the in-process engine has no server to start.
            remedy = "start the server, fix backend.urls" if settings.backend.kind == "vllm-server" else "fix what it says"
            print(
                f"fleetsched run: the {settings.backend.kind} backend cannot be reached: {exc} "
                f"({remedy}, or run on the embedded engine: --backend sim)",
                file=sys.stderr,
            )
            return 1
    return 0

