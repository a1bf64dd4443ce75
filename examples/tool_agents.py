"""A fleet of tool-using agents with a calculator, a search-like and a code-run-like tool.

    python examples/tool_agents.py                  # 40 agents on the embedded sim engine
    python examples/tool_agents.py --sessions 200 --backend vllm-server --url http://127.0.0.1:8000

Each agent runs fleetsched's tool-calling loop. The model makes every call for real; since a
small or simulated model cannot be trusted to pick tools, each agent follows a script of tool
calls (a real model's own tool calls are used when no script is given).
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import sys

import anyio
from pydantic import ValidationError
from rich.console import Console

from fleetsched import Scheduler, Settings
from fleetsched.agents.loop import Tool, run_tool_loop
from fleetsched.report import build_report, tenant_table
from fleetsched.settings import first_error

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers and + - * / are allowed")


async def calculator(expression: str) -> str:
    return str(_evaluate(ast.parse(expression, mode="eval").body))


async def search(query: str) -> dict:
    await anyio.sleep(random.uniform(0.2, 1.0))  # a remote search API
    return {"query": query, "hits": [f"{query}: result {i}" for i in range(3)]}


async def run_code(source: str) -> str:
    await anyio.sleep(random.uniform(1.0, 3.0))  # a sandboxed interpreter
    return f"ran {len(source.splitlines())} line(s): exit 0"


TOOLS = [
    Tool("calculator", calculator, "evaluate arithmetic", {"type": "object", "properties": {"expression": {"type": "string"}}}),
    Tool("search", search, "search the web", {"type": "object", "properties": {"query": {"type": "string"}}}, timeout_s=10),
    Tool("run_code", run_code, "run Python in a sandbox", {"type": "object", "properties": {"source": {"type": "string"}}}, timeout_s=30),
]

SCRIPTS = [
    [[{"name": "search", "arguments": {"query": "GPU prices"}}], [{"name": "calculator", "arguments": {"expression": "8 * 2.5"}}]],
    [[{"name": "run_code", "arguments": {"source": "print(1)\nprint(2)"}}, {"name": "search", "arguments": {"query": "pandas"}}]],
    [[{"name": "calculator", "arguments": {"expression": "(3 + 4) * 6"}}]],
]


def make_agent(script):
    async def agent(ctx):
        messages = [{"role": "system", "content": "Use the tools, then answer."}, {"role": "user", "content": "Help me plan."}]
        result = await run_tool_loop(ctx, messages, TOOLS, script=script, max_tokens=64)
        return result.stopped

    return agent


async def main(sessions: int, backend: str, url: str | None) -> dict:
    backend_settings = {"kind": backend, "max_in_flight": 32}
    if url:
        backend_settings["urls"] = [url]
    settings = Settings(
        backend=backend_settings,
        scheduler={"max_sessions": 16},
        tenants={"assistants": {"tier": "standard"}, "analysts": {"tier": "batch"}},
    )
    async with Scheduler(settings) as scheduler:
        start = anyio.current_time()
        handles = [
            await scheduler.submit(make_agent(SCRIPTS[i % len(SCRIPTS)]), tenant=("assistants", "analysts")[i % 2])
            for i in range(sessions)
        ]
        for handle in handles:
            await handle.ended()
    report = build_report(scheduler, duration_s=anyio.current_time() - start, backend=backend)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # piped: not squeezed to 80 columns
    console.print(tenant_table(report))
    answered = sum(h.result == "answer" for h in handles)
    print(f"{answered} of {sessions} agents answered")
    failed = [h for h in handles if h.error is not None]
    if failed:  # say why once (an unreachable server fails them all alike)
        print(f"{len(failed)} failed; the first: {failed[0].error}", file=sys.stderr)
    return report


def _sessions(text: str) -> int:
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of sessions >= 1, got {text!r}")
    return int(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=_sessions, default=40)
    parser.add_argument("--backend", default="sim", choices=["sim", "instant", "vllm-server"])
    parser.add_argument("--url", help="vLLM server URL for --backend vllm-server")
    args = parser.parse_args()
    if args.url and args.backend != "vllm-server":
        parser.error("--url applies only with --backend vllm-server")
    try:
        report = anyio.run(main, args.sessions, args.backend, args.url)
    except ValidationError as exc:  # a malformed --url
        parser.error(f"--url: {first_error(exc)[1]}")
    sys.exit(1 if sum(t["sessions_failed"] for t in report["tenants"]) else 0)
