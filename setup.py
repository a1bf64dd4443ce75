"""Builds fleetsched, compiling the modules of `fleetsched/_native.py`'s COMPILED with mypyc.

pyproject.toml holds the project's metadata; this file adds only those compiled modules. Where
compiling is off (``FLEETSCHED_COMPILE=0``) or fails (mypyc's type check, or no C compiler), the
build says so and installs the sources as they are: fleetsched then runs them as plain Python.
"""

import os
import sys

from setuptools import setup

# Read as a file, not as `fleetsched._native`: the package's __init__ imports its dependencies,
# which the build's environment lacks.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleetsched"))
from _native import COMPILED, GROUP  # noqa: E402


def compiled_modules() -> list:
    if os.environ.get("FLEETSCHED_COMPILE") == "0":
        return []
    sources = [name.replace(".", "/") + ".py" for name in COMPILED]
    try:
        from mypyc.build import mypycify

        # Types from the dependencies (absent here) read as Any; the other modules are read
        # for their types, not checked.
        modules = mypycify(
            ["--ignore-missing-imports", "--follow-imports=silent", *sources],
            opt_level="3",
            group_name=GROUP,
        )
    except (Exception, SystemExit) as error:  # mypyc is missing, or its type check failed
        print(f"fleetsched: not compiling {', '.join(sources)}: {error!r}", file=sys.stderr)
        return []
    for module in modules:
        module.optional = True  # a failed C build installs the sources as they are
    return modules


setup(ext_modules=compiled_modules())
