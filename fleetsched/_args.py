"""Argument types for the command line: a bad value is argparse's usage error naming the option
(exit code 2), not a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T", int, float)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def tcp_port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free one)."""
    return _checked(text, int, lambda v: 0 <= v <= 65535, "a port from 0 to 65535")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _checked(text, float, lambda v: 0 < v < math.inf, "a number > 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _checked(text, float, lambda v: 0 <= v < math.inf, "a number >= 0")


def unit_float(text: str) -> float:
    """A number from 0 to 1."""
    return _checked(text, float, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A number from `low` to `high`: for options whose values outside a range break the run
    (a hang, an overflow) rather than mean something."""
    return lambda text: _checked(text, float, lambda v: low <= v <= high, f"a number from {low:g} to {high:g}")


def _checked(text: str, kind: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):  # nan fails every comparison, so it is refused too
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def url_problem(url: str) -> str | None:
    """Why `url` is not a server root, http://host:port or https://host:port (what
    backend.urls and the benches' --url take); None when it is one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "is not http://host:port or https://host:port"
    try:
        parts.port  # reading it checks it: a number from 0 to 65535, or none at all
    except ValueError:
        return "has no valid port (a number from 0 to 65535)"
    return None


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def http_url(text: str) -> str:
    """A server root (`url_problem`): checked here so that a typo is a usage error, not a
    settings ValidationError traceback mid-run."""
    if url_problem(text) is not None:
        raise argparse.ArgumentTypeError(f"expected http://host:port or https://host:port, got {text!r}")
    return text


def writable_file(text: str) -> str:
    """A file path that can be written: checked before a run, not after it (the results would
    be lost)."""
    if not text.strip():  # Path("") is the current directory
        raise argparse.ArgumentTypeError("expected a file name, got an empty one")
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no directory {str(parent)!r} to write it in")
    if not os.access(parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permission denied)")
    return text



def applies_only(parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, object], applies: bool, where: str) -> None:
    """Refuse the options `defaults` names (by `dest`) when given where they do not apply
    (`applies` false: `where` says when they do), and set those not given to their defaults.

    Their arguments default to None, so that an option given is told from one left out: an
    option ignored without a word (``--seconds`` on a simulated run) lets a user believe it did
    what it says."""
    for dest, default in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif not applies:
            parser.error(f"--{dest.replace('_', '-')} applies only {where}")
