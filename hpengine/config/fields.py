"""How the config's dataclass tree is read by reflection: each field's type and TOML key, which fields are
sections or arrays of tables, and a value as TOML shows it (for messages and the reference page).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from hpengine.config.toml_out import toml_value


@functools.cache
def type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def table_item(tp):
    """The dataclass of an array-of-tables field (list[DataSource] -> DataSource), else None."""
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and is_section(args[0]) else None


def toml_key(f) -> str:
    """A field's TOML key: its name, or the `key` of its metadata where the name stands in for a Python
    keyword (checkpoint.async is the field `async_`)."""
    return f.metadata.get("key", f.name)


def show(value: Any) -> str:
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)
