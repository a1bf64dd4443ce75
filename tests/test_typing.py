"""The public API as a user's type checker sees it: the package says it is typed, and an agent's
result, and ``ctx.openai``, keep their types through the scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.resources import files
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_CODE = """
from typing import assert_type

import anyio
import openai

import fleetsched
from fleetsched import Scheduler, SessionContext, SessionHandle


async def ask(ctx: SessionContext) -> str:
    assert_type(ctx.openai, openai.AsyncOpenAI)
    completion = await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}])
    return completion.choices[0].message.content or ""


async def search(ctx: fleetsched.SessionContext) -> int:
    async with ctx.tool("search"):
        await anyio.sleep(1)
    return 1


async def main() -> None:
    async with Scheduler(fleetsched.load_settings("fleetsched.toml")) as scheduler:
        handle = await scheduler.submit(ask, tenant="acme")
        assert_type(handle, SessionHandle[str])
        assert_type(await handle, str)
        assert_type(await scheduler.run(search, tenant="acme"), int)
"""

# The user's own code is checked strictly; fleetsched is read for its types (as an installed
# package is), and the libraries the user code does not ask about are skipped: read whole, they
# would take most of the check's time.
CONFIG = """
[mypy]
strict = True
follow_imports = silent
[mypy-pydantic.*,pydantic_settings.*,httpx.*,anyio.*,trio.*,rich.*,matplotlib.*,uvicorn.*,redis.*,prometheus_client.*,tenacity.*,numpy.*]
follow_imports = skip
"""


def test_the_package_is_marked_typed_and_installs_the_mark():
    """Without ``py.typed`` (PEP 561) mypy skipped the installed package: "module is installed,
    but missing library stubs or py.typed marker", and every name of it read as Any."""
    assert files("fleetsched").joinpath("py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["fleetsched"]


def test_user_code_keeps_its_types_through_the_scheduler(tmp_path):
    """``await handle``, ``await scheduler.run(...)`` and ``ctx.openai`` were Any to mypy: an
    agent's result lost its type, and SDK calls went unchecked."""
    pytest.importorskip("mypy.api")
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "mypy.ini").write_text(CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache", "user.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
