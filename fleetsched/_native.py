"""The modules that setup.py compiles with mypyc, and the guard that keeps a stale build from running.

Compiled, the simulator's engine and KV cache and the scheduler's fair queue take a simulated
hour about a tenth faster (`fleetsched bench sim-fidelity`'s speed says which ran: ``compiled``).
The sources stay the truth: where nothing was compiled, Python imports them as usual.

An editable install (``make setup``) puts the compiled files next to their sources, and Python
prefers them. After a source changes (an edit, a checkout), that would run the old code:
`use_sources_if_stale()` then has every one of them imported from its source instead (they were
compiled together: all or none), and warns. ``FLEETSCHED_COMPILE=0`` has them imported from
their sources always (and, at install, compiles nothing).

This file imports nothing from fleetsched: setup.py reads `COMPILED` from it before anything is
installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

#: Pure-Python modules with no awaits, on the path of every simulated model call.
COMPILED = (
    "fleetsched.backends.sim._engine",
    "fleetsched.backends.sim._kv_cache",
    "fleetsched.policies.fair_queue",
)

#: setup.py compiles them as one group: the group's library holds the code of every one of them,
#: and each one's own compiled file only loads it.
GROUP = "fleetsched._native_lib"
LIBRARY = f"{GROUP}__mypyc"  # the library's module, as mypyc names it

#: A source newer than its compiled file by more than this has changed since the build; less is
#: the order in which an installer unpacked them.
_SLACK_S = 10.0

_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the fleetsched package


def source_of(name: str) -> Path:
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py")


def compiled_file_of(name: str) -> Path | None:
    """The compiled file that Python would import for module `name`, if there is one."""
    source = source_of(name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = source.with_name(source.stem + suffix)
        if path.exists():
            return path
    return None


def stale() -> list[str]:
    """The compiled modules whose source changed after they were compiled."""
    changed = []
    for name in COMPILED:
        compiled = compiled_file_of(name)
        if compiled is not None and source_of(name).stat().st_mtime > compiled.stat().st_mtime + _SLACK_S:
            changed.append(name)
    return changed


def library_missing() -> bool:
    """Whether modules of `COMPILED` were compiled but the library that holds their code was not
    installed: setup.py builds each optional, and the library's C build can fail where theirs do not."""
    return compiled_file_of(LIBRARY) is None and any(compiled_file_of(name) is not None for name in COMPILED)


def running_compiled() -> bool:
    """Whether the modules of `COMPILED` run compiled in this process."""
    import fleetsched.backends.sim._engine as engine

    return not engine.__file__.endswith(".py")


class _FromSources(importlib.abc.MetaPathFinder):
    """Finds the modules of `COMPILED` as their sources, whatever lies beside them."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name in COMPILED:
            return importlib.util.spec_from_file_location(name, source_of(name))
        return None


def use_sources_if_stale() -> None:
    """Import the modules of `COMPILED` from their sources if any changed since the build, if
    their library is missing, or if ``FLEETSCHED_COMPILE=0``. Called once, by
    ``fleetsched/__init__.py``, before any is imported."""
    changed = stale()
    missing = library_missing()
    if missing:  # importing one of them would fail: No module named 'fleetsched._native_lib__mypyc'
        warnings.warn(
            f"fleetsched's compiled modules were installed without {LIBRARY} (its C build failed): running "
            "every compiled module from its source (slower). Reinstall where a C compiler builds it, or "
            "with FLEETSCHED_COMPILE=0 to install the sources alone",
            RuntimeWarning,
            stacklevel=2,
        )
    if changed:
        warnings.warn(
            f"{', '.join(changed)} changed after it was compiled: running every compiled module from its "
            "source (slower). Rebuild with `make setup`, or `pip install -e .`",
            RuntimeWarning,
            stacklevel=2,
        )
    if changed or missing or os.environ.get("FLEETSCHED_COMPILE") == "0":
        sys.meta_path.insert(0, _FromSources())
