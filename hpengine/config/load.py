"""Loading a config: the dataclass tree (tree.py) from TOML and ``--set`` overrides (unknown keys named with the
nearest valid one), validated by rules.py; and back out as dicts and TOML.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import tomllib
import typing
from pathlib import Path
from typing import Any

from hpengine.config.fields import is_section, show, table_item, toml_key, type_hints
from hpengine.config.toml_out import emit_table
from hpengine.config.rules import ensure_valid, validate  # noqa: F401 - part of the config API
from hpengine.config.tree import (  # noqa: F401 - the tree, re-exported
    MESH_AXES,
    AmpConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    ContextParallelConfig,
    DataConfig,
    DataParallelConfig,
    DataSource,
    ExpertParallelConfig,
    GradientMergeConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    OptimConfig,
    PipelineConfig,
    RecomputeConfig,
    RuntimeConfig,
    ShardingConfig,
    StrategyConfig,
    TensorParallelConfig,
    TrainConfig,
    _kind_error,
    ffn_width,
    head_width,
    kind_keys,
    mesh_order,
    model_from_key,
    model_key,
)


# ---- loading --------------------------------------------------------------------------------------

# Each TOML section maps 1:1 to a dataclass of tree.py; every field has a default and a one-line doc
# (``metadata["doc"]``, which reference.py turns into docs/configuration.md).
def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read TOML at `path` (None = all defaults), apply ``key=value`` overrides, validate."""
    raw = {} if path is None else _read_toml(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    try:
        cfg = from_dict(raw)
    except ConfigError as e:  # overrides were checked key by key already: the file is at fault
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
    validate(cfg)
    cfg.given = frozenset(k for k, _ in _flat(raw))
    return cfg


def _flat(d: dict, prefix: str = ""):
    """(dotted key, value) of nested TOML tables (an array of tables, such as data.sources, is one key)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _by_key(cls) -> dict:
    """TOML key -> field name, in declaration order."""
    return {toml_key(f): f.name for f in dataclasses.fields(cls)}


def _apply_override(raw: dict, item: str) -> None:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-3")
    key, _, text = item.partition("=")
    key, text = key.strip(), text.strip()
    parts = key.split(".")
    cls, node = Config, raw
    for i, part in enumerate(parts):
        dotted, last = ".".join(parts[: i + 1]), i == len(parts) - 1
        names = _by_key(cls)
        if part not in names:
            raise ConfigError(f"--set {item}: {_unknown(dotted, list(names))}")
        tp = type_hints(cls)[names[part]]
        if not is_section(tp):
            if not last:
                raise ConfigError(f"--set {item}: '{dotted}' is a value, not a section")
            node[part] = _parse_value(text, tp)
            return
        if last:
            keys = ", ".join(_by_key(tp))
            raise ConfigError(f"--set {item}: '{dotted}' is a section; set one of its keys: {keys}")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item}: '{dotted}' in the config file is not a table")
        cls = tp


def _parse_value(text: str, tp) -> Any:
    """A TOML value if `text` is one (``1e-3``, ``true``, ``['dp', 'tp']``), else the plain string."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"v"}:  # text smuggled in more lines/keys: not a single value
        return text
    value = parsed["v"]
    return text if tp is str and not isinstance(value, str) else value


def from_dict(d: dict) -> Config:
    """Build a Config from nested dicts (as TOML gives them); unknown keys anywhere are errors, and so is a
    [model] key of another model kind."""
    cfg = _build(Config, d, "")
    given = d.get("model", {})
    kinds = dict(dataclasses.fields(ModelConfig)[0].metadata)["choices"]
    for key in kind_keys(cfg.model.kind) if cfg.model.kind in kinds else ():     # else validate names the kind
        if key in given:
            raise _kind_error(key, cfg.model.kind)
    return cfg


def _build(cls, d: Any, prefix: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix[:-1]} = {show(d)}: expected a table [{prefix[:-1]}]")
    names = _by_key(cls)
    hints = type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown(prefix + key, list(names)))
        name = names[key]
        tp, item = hints[name], table_item(hints[name])
        if is_section(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{key}.")
        elif item is not None:
            kwargs[name] = _build_tables(item, value, prefix + key)
        else:
            kwargs[name] = copy.deepcopy(value)
    return cls(**kwargs)


def _build_tables(cls, value: Any, key: str) -> list:
    """An array of tables ([[key]] in TOML, or a list of inline tables {k = v, ...})."""
    keys = ", ".join(_by_key(cls))
    if not isinstance(value, list):
        raise ConfigError(f"{key} = {show(value)}: expected an array of tables [[{key}]] with keys {keys}")
    for i, v in enumerate(value):
        if not isinstance(v, dict):
            raise ConfigError(f"{key}[{i}] = {show(v)}: expected a table with keys {keys}")
    return [_build(cls, v, f"{key}[{i}].") for i, v in enumerate(value)]


def _unknown(dotted: str, names: list[str]) -> str:
    section, _, key = dotted.rpartition(".")
    where = f"[{section}]" if section else "the top level"
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{dotted}'{hint}; valid keys in {where}: {', '.join(names)}"


# ---- output ---------------------------------------------------------------------------------------

def to_dict(cfg: Config) -> dict:
    """Nested plain dicts, one per section (a deep copy), without the [model] keys of other model kinds
    (from_dict refuses those)."""
    d = _keyed(dataclasses.asdict(cfg), Config)
    for key in kind_keys(cfg.model.kind):
        del d["model"][key]
    return d


def _keyed(d: dict, cls) -> dict:
    """asdict's field names turned into TOML keys (checkpoint.async_ -> async)."""
    out = {}
    for f in dataclasses.fields(cls):
        tp, v = type_hints(cls)[f.name], d[f.name]
        if is_section(tp):
            v = _keyed(v, tp)
        elif table_item(tp) is not None:
            v = [_keyed(x, table_item(tp)) for x in v]
        out[toml_key(f)] = v
    return out


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; :func:`load_config` reads it back to an equal Config."""
    lines = ["# hpengine resolved configuration"]
    emit_table(lines, [], to_dict(cfg))
    return "\n".join(lines) + "\n"


# ---- queries --------------------------------------------------------------------------------------

def given_keys(cfg: Config) -> tuple[list[str], int]:
    """(`key = value` for each key the user set to other than its default, in the order of config.toml;
    how many more they set to the default). The keys set are those of the config file and --set, as
    load_config recorded them; for a Config built in code, every key. Defaults are those of the model kind."""
    base = {**dict(_flat(to_dict(from_dict({"model": {"kind": cfg.model.kind}})))), "model.kind": Config().model.kind}
    given = [(k, v) for k, v in _flat(to_dict(cfg)) if cfg.given is None or k in cfg.given]
    return [f"{k} = {v!r}" for k, v in given if base.get(k) != v], sum(base.get(k) == v for k, v in given)


def enabled_strategies(cfg: Config) -> list[str]:
    """Names of the strategy tables with ``enable = true``, in declaration order."""
    return [f.name for f in dataclasses.fields(StrategyConfig) if getattr(cfg.strategy, f.name).enable]
