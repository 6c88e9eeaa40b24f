"""The configuration: one dataclass tree loaded from TOML, ``--set`` overrides, validation, TOML output.

Each TOML section maps 1:1 to a dataclass below; every field has a default and a one-line doc
(``metadata["doc"]``, which :func:`describe` turns into the README's config reference). No MPI here:
:func:`validate` runs before any communicator exists, and every error names the dotted key.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import operator
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .toml_out import emit_table, toml_value

MESH_AXES = ("tp", "sharding", "dp", "pp")


class ConfigError(Exception):
    """A config that cannot run; the one-line message names the key, the value and what is valid."""


# ---- field helpers: a check is (predicate, what a valid value is) ---------------------------------

def _f(default: Any, doc: str, *, choices: tuple | None = None, check: tuple | None = None,
       kinds: tuple | None = None):
    meta: dict[str, Any] = {"doc": doc}
    if kinds is not None:        # a [model] key that applies only to these model kinds
        meta["kinds"] = kinds
    if choices is not None:
        meta["choices"] = choices
    if check is not None:
        meta["check"] = check
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _must(*bounds):
    """A check from (op, limit) pairs: ``_must(">", 0, "<", 1)`` -> "must be > 0 and < 1"."""
    pairs = list(zip(bounds[::2], bounds[1::2]))
    return (lambda v: all(_OPS[op](v, lim) for op, lim in pairs),
            "must be " + " and ".join(f"{op} {lim}" for op, lim in pairs))


_POS = _must(">=", 1)
_DEGREE = (lambda v: v == -1 or v >= 1, "must be -1 (the ranks left over) or >= 1")
_BETAS = (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
          "must be a list of exactly two numbers, each >= 0 and < 1")
_SPLIT = (lambda v: v in ("uniform", "params") if isinstance(v, str) else len(v) > 0 and min(v) >= 1,
          'must be "uniform", "params" or a non-empty list of blocks per stage, each >= 1')
_ORDER = (lambda v: sorted(v) == sorted(MESH_AXES), 'must be a permutation of ["tp", "sharding", "dp", "pp"]')
_DEGREE_DOC = "ranks on this axis; -1 = the ranks left over"


# ---- the tree -------------------------------------------------------------------------------------

_LLAMA, _NOT_LLAMA = ("llama",), ("gpt", "mlp")


@dataclass
class ModelConfig:
    """The network and its numerics."""
    kind: str = _f("gpt", "model family: a GPT-2 style decoder, a Llama-family decoder (RMSNorm, SwiGLU, rotary "
                   "embedding, grouped-query attention) or a plain MLP", choices=("gpt", "llama", "mlp"))
    vocab_size: int = _f(256, "token vocabulary size (256 = raw bytes)", check=_POS)
    seq_len: int = _f(128, "tokens per training sequence (context length)", check=_POS)
    d_model: int = _f(256, "hidden width", check=_POS)
    n_layers: int = _f(4, "number of blocks (the units pipeline stages are cut from)", check=_POS)
    n_heads: int = _f(4, "attention (query) heads (gpt, llama); d_model must be a multiple of it", check=_POS)
    n_kv_heads: int = _f(0, "llama: key/value heads, grouped-query attention; must divide n_heads; 0 = n_heads "
                         "(multi-head), 1 = multi-query", check=_must(">=", 0), kinds=_LLAMA)
    ffn_mult: int = _f(4, "gpt, mlp: feed-forward width as a multiple of d_model", check=_POS, kinds=_NOT_LLAMA)
    ffn_hidden: int = _f(0, "llama: SwiGLU hidden width; 0 = Llama's rule, 8/3 x d_model rounded up to "
                         "ffn_multiple_of", check=_must(">=", 0), kinds=_LLAMA)
    ffn_multiple_of: int = _f(256, "llama: the multiple Llama's rule rounds the SwiGLU width up to", check=_POS,
                              kinds=_LLAMA)
    rope_theta: float = _f(10000.0, "llama: rotary embedding base (angle of pair i at position t: "
                           "t x rope_theta^(-2i/head_dim))", check=_must(">", 0), kinds=_LLAMA)
    norm_eps: float = _f(1e-5, "llama: RMSNorm epsilon", check=_must(">", 0), kinds=_LLAMA)
    tie_head: bool = _f(False, "share the output head's weights with the token embedding")
    dtype: str = _f("float32", "parameter and compute dtype (float64 for exactness checks)",
                    choices=("float32", "float64"))
    init_std: float = _f(0.02, "standard deviation of the normal weight initialisation", check=_must(">", 0))


def kind_keys(kind: str) -> list[str]:
    """The [model] keys that do not apply to model.kind = `kind`."""
    return [f.name for f in dataclasses.fields(ModelConfig) if kind not in f.metadata.get("kinds", (kind,))]


def _kind_error(key: str, kind: str) -> ConfigError:
    kinds = next(f.metadata["kinds"] for f in dataclasses.fields(ModelConfig) if f.name == key)
    return ConfigError(f"model.{key} applies to model.kind = {' or '.join(map(repr, kinds))}, not {kind!r}: "
                       f"remove it, or set model.kind to {' or '.join(map(repr, kinds))}")


def ffn_width(m: "ModelConfig") -> int:
    """The SwiGLU hidden width of a llama config: ffn_hidden, or Llama's rule (int(8/3 x d_model) rounded up
    to ffn_multiple_of)."""
    if m.ffn_hidden:
        return m.ffn_hidden
    return -(-int(2 * 4 * m.d_model / 3) // m.ffn_multiple_of) * m.ffn_multiple_of


@dataclass
class DataSource:
    """One token file of a blend, a `[[data.sources]]` table."""
    path: str = _f("", "HDF5 token file", check=(bool, "must name a token file"))
    weight: float = _f(1.0, "share of each batch's rows drawn from this file, relative to the other weights",
                       check=_must(">", 0))


@dataclass
class DataConfig:
    """Where tokens come from."""
    path: str = _f("", 'HDF5 token file; "" = built-in corpus (or the data.sources blend)')
    val_path: str = _f("", 'HDF5 token file that is the whole validation split (all of the training files then '
                       'train); "" = split each training file by data.val_fraction')
    val_fraction: float = _f(0.05, "share of each training file held out for validation: its last documents, "
                             "from the first document boundary at or after (1 - val_fraction) x its tokens "
                             "(a file without document boundaries is split at that token)",
                             check=_must(">", 0, "<", 1))
    sources: list[DataSource] = _f([], "token files blended by weight, as `[[data.sources]]` tables (path, weight); "
                                   "each batch row picks its file by weight; data.path must then be empty")


@dataclass
class TrainConfig:
    """The training loop."""
    steps: int = _f(300, "optimizer steps to run", check=_POS)
    global_batch: int = _f(8, "sequences per optimizer step, fixed by (seed, step) whatever the layout",
                           check=_POS)
    seed: int = _f(1234, "seed for initialisation and batch sampling")
    eval_every: int = _f(100, "evaluate every N steps; 0 = never", check=_must(">=", 0))
    eval_batches: int = _f(4, "validation batches per evaluation", check=_POS)
    log_every: int = _f(10, "log a metrics line every N steps", check=_POS)
    out_dir: str = _f("runs/default", "run folder (refused if it already holds results)")
    models: int = _f(1, "train this many models in one job, sharing one partition and one set of "
                        "collectives (seed claim 6)", check=_POS)
    model_seeds: list[int] = _f([], "per-model seeds (init and data); empty = seed, seed+1, ...")
    model_lrs: list[float] = _f([], "per-model peak learning rates; empty = optim.lr for every model")


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule and gradient clipping."""
    lr: float = _f(3e-3, "peak learning rate", check=_must(">=", 0))
    betas: list[float] = _f([0.9, 0.95], "Adam (beta1, beta2)", check=_BETAS)
    eps: float = _f(1e-8, "Adam epsilon", check=_must(">", 0))
    weight_decay: float = _f(0.1, "decoupled (AdamW) weight decay of decayed tensors", check=_must(">=", 0))
    warmup_steps: int = _f(30, "linear warm-up steps: step i < warmup_steps runs at lr x (i+1) / warmup_steps",
                           check=_must(">=", 0))
    schedule: str = _f("cosine", "learning-rate decay after warm-up",
                       choices=("cosine", "linear", "constant"))
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr",
                             check=_must(">=", 0, "<=", 1))
    clip_grad_norm: float = _f(1.0, "clip the global gradient norm to this; 0 = off", check=_must(">=", 0))


@dataclass
class DataParallelConfig:
    """Replicas of the model; gradients averaged across them (communicator `dp`)."""
    enable: bool = _f(False, "turn data parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    bucket_mb: float = _f(4.0, "gradient all-reduce bucket size in MiB", check=_must(">", 0))


@dataclass
class ShardingConfig:
    """Optimizer state (stage 1), + gradients (2), + parameters (3) split across ranks (`sharding`)."""
    enable: bool = _f(False, "turn sharding on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    stage: int = _f(1, "1 = optimizer state, 2 = + gradients, 3 = + parameters", choices=(1, 2, 3))
    partition: str = _f("tensor", "whole tensors balanced by element count, or equal element ranges",
                        choices=("tensor", "flat"))


@dataclass
class PipelineConfig:
    """Consecutive blocks on consecutive ranks; micro-batches flow through a schedule (`pp`)."""
    enable: bool = _f(False, "turn pipeline parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)
    micro_batches: int = _f(1, "micro-batches each pass is split into", check=_POS)
    schedule: str = _f("1f1b", "order of forward/backward micro-steps",
                       choices=("fthenb", "1f1b", "interleaved"))
    virtual_stages: int = _f(1, "model chunks per rank (interleaved schedule)", check=_POS)
    split: str | list[int] = _f("uniform", 'blocks per stage: "uniform", "params" (balance parameter '
                                "counts) or a list of block counts", check=_SPLIT)


@dataclass
class TensorParallelConfig:
    """Each matrix split across ranks, Megatron column/row style (`tp`)."""
    enable: bool = _f(False, "turn tensor parallelism on")
    degree: int = _f(-1, _DEGREE_DOC, check=_DEGREE)


@dataclass
class RecomputeConfig:
    """Drop block activations in forward, rebuild them in backward (memory for compute)."""
    enable: bool = _f(False, "turn activation recomputation on")
    every: int = _f(1, "recompute every N-th block", check=_POS)


@dataclass
class GradientMergeConfig:
    """Accumulate k micro-steps before one optimizer step."""
    enable: bool = _f(False, "turn gradient merge on")
    k_steps: int = _f(1, "sequential passes per optimizer step", check=_POS)


@dataclass
class AmpConfig:
    """Low-precision compute, float32 master weights, dynamic loss scaling."""
    enable: bool = _f(False, "turn mixed precision on")
    dtype: str = _f("float16", "compute dtype", choices=("float16", "bfloat16"))
    init_scale: float = _f(65536.0, "initial loss scale", check=_must(">", 0))
    growth_interval: int = _f(1000, "overflow-free steps before the scale grows", check=_POS)
    backoff: float = _f(0.5, "scale multiplier after an overflow", check=_must(">", 0, "<", 1))
    growth_factor: float = _f(2.0, "scale multiplier after growth_interval clean steps", check=_must(">", 1))


@dataclass
class StrategyConfig:
    """The switchable strategies; any subset may be enabled."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    gradient_merge: GradientMergeConfig = field(default_factory=GradientMergeConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)


@dataclass
class CheckpointConfig:
    """Checkpoint cadence and retention."""
    dir: str = _f("", 'checkpoint folder; "" = `<out_dir>/checkpoints`')
    every: int = _f(0, "save every N steps; 0 = never", check=_must(">=", 0))
    keep: int = _f(3, "most recent checkpoints kept", check=_POS)
    at_end: bool = _f(True, "save a checkpoint after the last step (unless `every` already saved it), so every "
                            "run leaves a model for `hpengine eval` and `--resume`")
    init_from: str = _f("", "start from the parameters of an exported checkpoint file (hpengine ckpt export), "
                            'or "hf:DIR" for a local Hugging Face model folder (config.json and safetensors '
                            "weights of a GPT2LMHeadModel -> gpt or LlamaForCausalLM -> llama, shaped as "
                            "[model]); optimizer state starts fresh")


@dataclass
class RuntimeConfig:
    """Array backend and MPI transport."""
    backend: str = _f("auto", "array backend; auto = cupy when a GPU is visible, else numpy",
                      choices=("auto", "numpy", "cupy"))
    cuda_aware_mpi: bool | str = _f("auto", 'hand device buffers straight to MPI: "auto" (when the MPI library '
                                    'says it can), true, or false (stage through pinned host memory)',
                                    check=(lambda v: v in (True, False, "auto"), 'must be "auto", true or false'))
    share_devices: bool = _f(False, "allow more ranks on a node than GPUs (ranks share devices; logged as a "
                                    "warning)")
    watchdog_s: float = _f(0.0, "abort the job when a step takes longer than this (seconds); 0 = off",
                           check=_must(">=", 0))
    trace: bool = _f(False, "record a timeline (compute per micro-batch, every MPI call with its bytes); "
                     "trace.json in the run folder, for Perfetto and `hpengine plot`")
    trace_max_events: int = _f(200000, "most timeline events kept per rank (the latest; bounds the trace's "
                               "memory)", check=_POS)


@dataclass
class MeshConfig:
    """How ranks are laid out on the mesh axes."""
    order: list[str] = _f(list(MESH_AXES), "mesh axes, innermost (neighbouring ranks) first; "
                          "a permutation of tp, sharding, dp, pp", check=_ORDER)


@dataclass
class Config:
    """A whole training job."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)


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
    return cfg


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


def _apply_override(raw: dict, item: str) -> None:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-3")
    key, _, text = item.partition("=")
    key, text = key.strip(), text.strip()
    parts = key.split(".")
    cls, node = Config, raw
    for i, part in enumerate(parts):
        dotted, last = ".".join(parts[: i + 1]), i == len(parts) - 1
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise ConfigError(f"--set {item}: {_unknown(dotted, names)}")
        tp = _hints(cls)[part]
        if not _is_section(tp):
            if not last:
                raise ConfigError(f"--set {item}: '{dotted}' is a value, not a section")
            node[part] = _parse_value(text, tp)
            return
        if last:
            keys = ", ".join(f.name for f in dataclasses.fields(tp))
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
    names = [f.name for f in dataclasses.fields(cls)]
    hints = _hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown(prefix + key, names))
        tp, item = hints[key], _table_item(hints[key])
        if _is_section(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        elif item is not None:
            kwargs[key] = _build_tables(item, value, prefix + key)
        else:
            kwargs[key] = copy.deepcopy(value)
    return cls(**kwargs)


def _build_tables(cls, value: Any, key: str) -> list:
    """An array of tables ([[key]] in TOML, or a list of inline tables {k = v, ...})."""
    keys = ", ".join(f.name for f in dataclasses.fields(cls))
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

def validate(cfg: Config) -> None:
    """Check types (ints widen to float in float fields, in place) and values; raise on the first error."""
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
    d = cfg.data
    if d.path and d.sources:
        raise ConfigError(f"data.path = {_show(d.path)} and data.sources ({len(d.sources)} files) are both set: "
                          "set data.path for one file, or leave it empty and blend files with [[data.sources]]")


def _validate_model(m: ModelConfig) -> None:
    defaults = ModelConfig()
    for key in kind_keys(m.kind):
        if getattr(m, key) != getattr(defaults, key):
            raise _kind_error(key, m.kind)
    if m.kind in ("gpt", "llama") and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}: "
                          "d_model must be a multiple of n_heads")
    if m.kind != "llama":
        return
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads}: "
                          f"n_kv_heads must divide n_heads (1 = multi-query, {m.n_heads} = multi-head)")
    hd = m.d_model // m.n_heads
    if hd % 2:
        raise ConfigError(f"model.d_model / model.n_heads = {m.d_model} / {m.n_heads} = {hd} is odd: the rotary "
                          "embedding rotates pairs, so the head dimension must be even")


def _validate_section(obj: Any, cls, prefix: str) -> None:
    if not isinstance(obj, cls):
        raise ConfigError(f"{prefix[:-1] or 'config'} = {_show(obj)}: expected a {cls.__name__}")
    for f in dataclasses.fields(cls):
        tp, key = _hints(cls)[f.name], prefix + f.name
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
    d = dataclasses.asdict(cfg)
    for key in kind_keys(cfg.model.kind):
        del d["model"][key]
    return d


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; :func:`load_config` reads it back to an equal Config."""
    lines = ["# hpengine resolved configuration"]
    emit_table(lines, [], to_dict(cfg))
    return "\n".join(lines) + "\n"


def describe() -> str:
    """A markdown config reference: one table per section with key, default and doc."""
    lines = ["## Configuration reference", "",
             "Every key is optional; `--set section.key=value` overrides any of them."]
    for path, cls in _sections(Config, []):
        header = f"[[{'.'.join(path)}]]" if _is_array(path) else f"[{'.'.join(path)}]"
        lines += ["", f"### `{header}`", "", cls.__doc__.strip().splitlines()[0], "",
                  "| key | default | doc |", "|---|---|---|"]
        defaults = cls()
        for f in dataclasses.fields(cls):
            doc = f.metadata["doc"]
            if "choices" in f.metadata:
                doc += "; one of " + ", ".join(f"`{_show(c)}`" for c in f.metadata["choices"])
            doc = doc.replace("|", "\\|")
            lines.append(f"| `{f.name}` | `{_show(getattr(defaults, f.name))}` | {doc} |")
    return "\n".join(lines) + "\n"


def _is_array(path: list[str]) -> bool:
    cls = functools.reduce(lambda c, part: _hints(c)[part], path[:-1], Config)
    return _table_item(_hints(cls)[path[-1]]) is not None


def _sections(cls, path: list[str]) -> list[tuple[list[str], type]]:
    """(path, dataclass) for every section that holds values, in file order; an array of tables
    ([[data.sources]]) follows the section that holds it."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _table_item(tp) is not None:
            out.append((path + [f.name], _table_item(tp)))
        elif _is_section(tp):
            sub = path + [f.name]
            holds_values = any(not _is_section(t) for t in _hints(tp).values())
            out += ([(sub, tp)] if holds_values else []) + _sections(tp, sub)
    return out


# ---- queries --------------------------------------------------------------------------------------

def enabled_strategies(cfg: Config) -> list[str]:
    """Names of the strategy tables with ``enable = true``, in declaration order."""
    return [f.name for f in dataclasses.fields(StrategyConfig) if getattr(cfg.strategy, f.name).enable]
