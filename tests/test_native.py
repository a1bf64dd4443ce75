"""The modules that setup.py compiles with mypyc (`fleetsched._native`): compiled, they compute
what their sources compute, and a source changed since the build runs instead of the old build.

Each test needs the compiled build (``make setup`` makes it). Without it they are skipped, unless
FLEETSCHED_REQUIRE_COMPILED=1 (CI sets it): then they fail, so that a build that quietly fell back
to the sources cannot pass for a compiled one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fleetsched
from fleetsched._native import COMPILED, LIBRARY, compiled_file_of, running_compiled, source_of

PACKAGE = Path(fleetsched.__file__).parent


@pytest.fixture(autouse=True)
def compiled_build() -> None:
    if running_compiled():
        return
    if os.environ.get("FLEETSCHED_COMPILE") == "0":
        message = "FLEETSCHED_COMPILE=0 runs the sources"
    else:
        message = "the modules of fleetsched._native.COMPILED are not compiled (run `make setup`)"
    if os.environ.get("FLEETSCHED_REQUIRE_COMPILED") == "1":
        pytest.fail(f"FLEETSCHED_REQUIRE_COMPILED=1 but {message}", pytrace=False)
    pytest.skip(message)


def python(code: str, *, path: Path | None = None, compile_: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETSCHED_COMPILE"}
    if compile_ is not None:
        env["FLEETSCHED_COMPILE"] = compile_
    if path is not None:  # fleetsched from there (``-c`` puts the working directory first)
        env["PYTHONPATH"] = str(path)
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        env=env, cwd=path, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


SIMULATE = """
import json
from fleetsched._native import running_compiled
from fleetsched.bench.sim_fidelity import speed_settings
from fleetsched.simulate import simulate
settings = speed_settings(90)
report, _ = simulate(settings, 240.0)
del report["wall_s"]
print(json.dumps({"compiled": running_compiled(), "report": report}))
"""


def test_compiled_and_sources_simulate_alike():
    compiled = json.loads(python(SIMULATE).stdout)
    sources = json.loads(python(SIMULATE, compile_="0").stdout)
    assert (compiled["compiled"], sources["compiled"]) == (True, False)
    assert compiled["report"]["calls"] > 500
    assert compiled["report"] == sources["report"]


def test_a_source_changed_after_the_build_runs_instead(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "fleetsched", ignore=shutil.ignore_patterns("__pycache__"))  # keeps mtimes
    probe = "import fleetsched, fleetsched._native as n; print(n.running_compiled())"
    fresh = python(probe, path=tmp_path)
    assert fresh.stdout.strip() == "True" and "changed after" not in fresh.stderr

    changed = tmp_path / "fleetsched" / "backends" / "sim" / "_kv_cache.py"
    built = os.stat(compiled_file_of("fleetsched.backends.sim._kv_cache")).st_mtime
    os.utime(changed, (built + 60, built + 60))
    stale = python(probe, path=tmp_path)
    assert stale.stdout.strip() == "False"
    assert "fleetsched.backends.sim._kv_cache changed after it was compiled" in stale.stderr
    assert "make setup" in stale.stderr


def test_a_build_without_the_library_runs_the_sources(tmp_path):
    # setup.py builds each compiled module optional: where the C build of the library that holds
    # their code failed and their own small ones did not (a compiler warning under mypyc's -Werror,
    # the compiler out of memory), the install holds modules that load a library it lacks.
    shutil.copytree(PACKAGE, tmp_path / "fleetsched", ignore=shutil.ignore_patterns("__pycache__"))  # keeps mtimes
    (tmp_path / "fleetsched" / compiled_file_of(LIBRARY).name).unlink()
    partial = python("import fleetsched, fleetsched._native as n; print(n.running_compiled())", path=tmp_path)
    assert partial.stdout.strip() == "False"
    assert f"installed without {LIBRARY} (its C build failed)" in partial.stderr


def test_compile_0_runs_every_source():
    probe = f"import importlib, json, fleetsched; print(json.dumps([importlib.import_module(m).__file__ for m in {list(COMPILED)!r}]))"
    files = json.loads(python(probe, compile_="0").stdout)
    assert files == [str(source_of(name)) for name in COMPILED]
