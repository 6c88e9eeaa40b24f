"""The configuration: the dataclass tree (tree.py) loaded from TOML, ``--set`` overrides, validation,
TOML output.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from hpengine.config.toml_out import emit_table, toml_value
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


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _table_item(tp):
    """The dataclass of an array-of-tables field (list[DataSource] -> DataSource), else None."""
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and _is_section(args[0]) else None


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


def _key(f) -> str:
    """A field's TOML key: its name, or the `key` of its metadata where the name stands in for a Python
    keyword (checkpoint.async is the field `async_`)."""
    return f.metadata.get("key", f.name)


def _by_key(cls) -> dict:
    """TOML key -> field name, in declaration order."""
    return {_key(f): f.name for f in dataclasses.fields(cls)}


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
        tp = _hints(cls)[names[part]]
        if not _is_section(tp):
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
        raise ConfigError(f"{prefix[:-1]} = {_show(d)}: expected a table [{prefix[:-1]}]")
    names = _by_key(cls)
    hints = _hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown(prefix + key, list(names)))
        name = names[key]
        tp, item = hints[name], _table_item(hints[name])
        if _is_section(tp):
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
        raise ConfigError(f"{key} = {_show(value)}: expected an array of tables [[{key}]] with keys {keys}")
    for i, v in enumerate(value):
        if not isinstance(v, dict):
            raise ConfigError(f"{key}[{i}] = {_show(v)}: expected a table with keys {keys}")
    return [_build(cls, v, f"{key}[{i}].") for i, v in enumerate(value)]


def _unknown(dotted: str, names: list[str]) -> str:
    section, _, key = dotted.rpartition(".")
    where = f"[{section}]" if section else "the top level"
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{dotted}'{hint}; valid keys in {where}: {', '.join(names)}"


# ---- validation -----------------------------------------------------------------------------------

# No MPI here:
# :func:`validate` runs before any communicator exists, and every error names the dotted key.
def ensure_valid(cfg: Config) -> None:
    """validate(cfg) unless it passed validate with these very values (a loaded config is checked once, a
    config changed since is checked again)."""
    if cfg.valid_as is None or cfg.valid_as != repr(dataclasses.asdict(cfg)):
        validate(cfg)


def validate(cfg: Config) -> None:
    """Check types (ints widen to float in float fields, in place) and values; raise on the first error."""
    cfg.valid_as = None
    _check(cfg)
    cfg.valid_as = repr(dataclasses.asdict(cfg))


def _check(cfg: Config) -> None:
    _validate_section(cfg, Config, "")
    _validate_model(cfg.model)
    t = cfg.train
    for key in ("model_seeds", "model_lrs"):
        got = getattr(t, key)
        if got and len(got) != t.models:
            raise ConfigError(f"train.{key} has {len(got)} entries but train.models = {t.models}: "
                              f"give one per model or leave it empty")
    if any(lr < 0 for lr in t.model_lrs):
        raise ConfigError(f"train.model_lrs = {t.model_lrs}: every learning rate must be >= 0")
    rt = cfg.runtime
    if rt.collectives == "nccl" and rt.backend == "numpy":
        raise ConfigError("runtime.collectives = 'nccl' needs device buffers but runtime.backend = 'numpy': use "
                          "collectives = 'mpi', or backend = 'cupy' / 'auto' (NCCL where a GPU is found, else MPI)")
    d = cfg.data
    if d.path and d.sources:
        raise ConfigError(f"data.path = {_show(d.path)} and data.sources ({len(d.sources)} files) are both set: "
                          "set data.path for one file, or leave it empty and blend files with [[data.sources]]")


def _validate_model(m: ModelConfig) -> None:
    defaults = ModelConfig()
    for key in kind_keys(m.kind):
        if getattr(m, key) != getattr(defaults, key):
            raise _kind_error(key, m.kind)
    off = set(kind_keys(m.kind))      # what a kind has is what its keys say: attention, head_dim, moe
    if "attention" not in off and not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}: "
                          "d_model must be a multiple of n_heads" + (
                              ", or set model.head_dim to the width of a head" if "head_dim" not in off else ""))
    if "moe" not in off:
        _validate_moe(m)
    if "head_dim" in off:             # grouped-query heads and the rotary embedding's pairs
        return
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads}: "
                          f"n_kv_heads must divide n_heads (1 = multi-query, {m.n_heads} = multi-head)")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim = {m.head_dim} is odd: the rotary embedding rotates pairs, so the head "
                          "dimension must be even (0 = d_model / n_heads)")
    hd = head_width(m)
    if hd % 2:
        raise ConfigError(f"model.d_model / model.n_heads = {m.d_model} / {m.n_heads} = {hd} is odd: the rotary "
                          "embedding rotates pairs, so the head dimension must be even (or set an even "
                          "model.head_dim)")


def _validate_moe(m: ModelConfig) -> None:
    e = m.moe
    if not e.num_experts:
        if e != MoEConfig():
            raise ConfigError("model.moe keys are set but model.moe.num_experts = 0 (a dense model): set "
                              "num_experts to the routed experts per layer, or remove the [model.moe] keys")
        return
    if e.top_k > e.num_experts:
        raise ConfigError(f"model.moe.top_k = {e.top_k} is more than model.moe.num_experts = {e.num_experts}: "
                          f"use 1..{e.num_experts}")
    if e.dense_layers >= m.n_layers:
        raise ConfigError(f"model.moe.dense_layers = {e.dense_layers} leaves no MoE layer in model.n_layers = "
                          f"{m.n_layers}: use 0..{m.n_layers - 1}")


def _validate_section(obj: Any, cls, prefix: str) -> None:
    if not isinstance(obj, cls):
        raise ConfigError(f"{prefix[:-1] or 'config'} = {_show(obj)}: expected a {cls.__name__}")
    for f in dataclasses.fields(cls):
        tp, key = _hints(cls)[f.name], prefix + _key(f)
        raw = getattr(obj, f.name)
        if _is_section(tp):
            _validate_section(raw, tp, key + ".")
            continue
        item = _table_item(tp)
        if item is not None:
            if not isinstance(raw, list):
                raise ConfigError(f"{key} = {_show(raw)}: expected a list of {item.__name__} tables")
            for i, x in enumerate(raw):
                _validate_section(x, item, f"{key}[{i}].")
            continue
        ok, value = _match(raw, tp)
        if not ok:
            raise ConfigError(f"{key} = {_show(raw)}: expected {_type_name(tp)}, got {type(raw).__name__}")
        setattr(obj, f.name, value)
        _check_value(key, value, f.metadata)


def _match(value: Any, tp) -> tuple[bool, Any]:
    """(does `value` fit annotation `tp`, value converted) — bool is not an int, int widens to float."""
    if tp is bool or tp is str:
        return isinstance(value, tp), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        try:
            return True, float(value)
        except OverflowError:
            return False, value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_match(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin in (typing.Union, types.UnionType):
        for alt in args:
            ok, out = _match(value, alt)
            if ok:
                return True, out
        return False, value
    raise TypeError(f"unsupported config annotation {tp!r}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return tp.__name__


def _check_value(key: str, value: Any, meta) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {_show(value)}: must be a finite number")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {_show(value)}: must be one of {', '.join(map(_show, choices))}")
    check = meta.get("check")
    if check is not None and not check[0](value):
        raise ConfigError(f"{key} = {_show(value)}: {check[1]}")


def _show(value: Any) -> str:
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)


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
        tp, v = _hints(cls)[f.name], d[f.name]
        if _is_section(tp):
            v = _keyed(v, tp)
        elif _table_item(tp) is not None:
            v = [_keyed(x, _table_item(tp)) for x in v]
        out[_key(f)] = v
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
