"""Sim profiles: TOML files of `SimSettings` values, shipped under ``profiles/`` or anywhere on disk.

A profile file has a ``[profile]`` table (``description``, ``source``, ``assumptions``: text for
people) and a ``[sim]`` table of `SimSettings` fields, and may carry a ``[fit]`` table with the
measurements it was fitted to and the fit's errors. Select one with ``backend.sim.profile =
"hermes3-70b-4xa100"`` (a shipped name) or a path to a ``.toml`` file; fields set next to
``profile`` override the profile's.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).with_name("profiles")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    path: Path
    sim: dict[str, Any]
    """`SimSettings` fields."""
    info: dict[str, Any]
    """The ``[profile]`` table: description, source, assumptions."""
    fit: dict[str, Any]
    """The ``[fit]`` table, empty when the profile was not fitted."""


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with fleetsched."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name: str) -> Profile:
    """The profile `name` (a shipped name, or a path to a TOML file).

    Raises ValueError naming the shipped profiles when there is no such profile, and naming the
    file when it is not UTF-8 TOML or has no ``[sim]`` table.
    """
    path = Path(name)
    if path.suffix != ".toml" or not path.is_file():
        path = PROFILE_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"no sim profile {name!r}: give a TOML file or one of {', '.join(shipped_profiles())}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"sim profile {path} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"sim profile {path} is not TOML: {exc}") from None
    sim = data.get("sim")
    if not isinstance(sim, dict):
        raise ValueError(f"sim profile {path}: no [sim] table of SimSettings fields")
    unknown = sorted(set(data) - {"profile", "sim", "fit"})
    if unknown:  # a typo's table ([simm]) was left unread without a word
        raise ValueError(f"sim profile {path}: unknown table [{unknown[0]}]; a profile has [profile], [sim] and [fit]")
    if "profile" in sim:  # it was dropped: the profile then ran on the defaults
        raise ValueError(f"sim profile {path}: [sim] names a profile ({sim['profile']!r:.80}); a profile's values are its own")
    return Profile(path.stem, path, sim, data.get("profile", {}), data.get("fit", {}))


#: What a TOML basic string must escape: the quote, the backslash and control characters (a
#: tab may stand as it is, but need not), each by its short escape where TOML has one.
_ESCAPED = re.compile(r'["\\\x00-\x1f\x7f]')
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + _ESCAPED.sub(lambda m: _SHORT_ESCAPES.get(m.group(), f"\\u{ord(m.group()):04x}"), value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_profile(info: dict[str, Any], sim: dict[str, Any], fit: dict[str, Any] | None = None) -> str:
    """A profile file's text (the inverse of `load_profile`); values: numbers, strings, lists, dicts."""
    lines = []
    for table, values in (("profile", info), ("sim", sim), ("fit", fit or {})):
        if not values:
            continue
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)
