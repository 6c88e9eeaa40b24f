"""TOML text from plain values and nested dicts: the writer behind config.to_toml (tomllib only reads).
Sub-dicts become [tables], lists of dicts [[arrays of tables]], dataclass instances inline tables."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any


def emit_table(lines: list[str], path: list[str], table: dict) -> None:
    subs = {k: v for k, v in table.items() if isinstance(v, dict)}
    arrays = {k: v for k, v in table.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)}
    scalars = {k: v for k, v in table.items() if k not in subs and k not in arrays}
    if path and (scalars or not subs):  # [strategy] itself holds only sub-tables: no header
        lines += ["", f"[{'.'.join(map(toml_key, path))}]"]
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in scalars.items()]
    for k, items in arrays.items():       # [[data.sources]]: one header per entry
        for x in items:
            lines += ["", f"[[{'.'.join(map(toml_key, path + [k]))}]]"]
            lines += [f"{toml_key(k2)} = {toml_value(v)}" for k2, v in x.items()]
    for k, v in subs.items():
        emit_table(lines, path + [k], v)


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_str(key)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)  # repr keeps 1.0 a float
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):         # an inline table
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as a TOML value")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_str(s: str) -> str:
    def esc(ch: str) -> str:  # TOML forbids raw control characters (and DEL) in basic strings
        if ch in _ESCAPES:
            return _ESCAPES[ch]
        return f"\\u{ord(ch):04X}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch
    return '"' + "".join(map(esc, s)) + '"'
