"""Validation of a config: types (ints widen to floats in place), values, the rules between keys and of each model
kind; `ensure_valid` skips a config that passed with these very values, so a job's start-up checks it once. No
MPI here: it runs before any communicator exists, and every error names the dotted key.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from hpengine.config.fields import is_section, show, table_item, toml_key, type_hints
from hpengine.config.tree import (
    Config,
    ConfigError,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    _kind_error,
    head_width,
    kind_keys,
)


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
    _validate_qk_clip(cfg)
    _validate_resilience(cfg)
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
    dl = cfg.strategy.diloco
    if dl.enable and dl.fragments > dl.inner_steps:
        raise ConfigError(f"strategy.diloco.fragments = {dl.fragments} is more than inner_steps = {dl.inner_steps}: "
                          f"each fragment needs its own step of the period; use 1..{dl.inner_steps}")
    d = cfg.data
    if d.path and d.sources:
        raise ConfigError(f"data.path = {show(d.path)} and data.sources ({len(d.sources)} files) are both set: "
                          "set data.path for one file, or leave it empty and blend files with [[data.sources]]")


def _validate_resilience(cfg: Config) -> None:
    """Spares only serve on_failure = "spare"; what a recovery cannot carry yet is refused up front."""
    r = cfg.resilience
    if r.on_failure == "abort":
        if r.spares:
            raise ConfigError(f"resilience.spares = {r.spares} needs resilience.on_failure = 'spare' (with 'abort' "
                              "a dead rank ends the job and spares would only idle); or set spares = 0")
        return
    st = cfg.strategy
    shrink = r.on_failure == "shrink"
    for bad, why in ((r.on_failure == "spare" and r.spares < 1, f"resilience.spares >= 1 (got {r.spares})"),
                     (shrink and st.diloco.enable, "strategy.diloco.enable = false: the islands' outer state is not "
                      "re-partitioned"),
                     (shrink and st.expert_parallel.enable, "strategy.expert_parallel.enable = false: the expert "
                      "blocks are folded inside data_parallel x sharding"),
                     (shrink and st.sharding.enable and cfg.optim.name != "adamw", f"optim.name = 'adamw' under "
                      f"sharding (got {cfg.optim.name!r}): the owned shards are re-partitioned element by element"),
                     (not r.buddy, "resilience.buddy = true: the dead rank's state comes from its buddy copy"),
                     (cfg.checkpoint.async_, "checkpoint.async = false: a recovery cannot carry a save in flight"),
                     (cfg.runtime.collectives != "mpi", "runtime.collectives = 'mpi': NCCL has no failure "
                      "notification")):
        if bad:
            raise ConfigError(f"resilience.on_failure = {r.on_failure!r} needs {why}")


def _validate_qk_clip(cfg: Config) -> None:
    """MuonClip scales Muon's attention weights: it needs Muon, per-head q and k weights a norm does not undo, and
    one model (its figures are the first model's)."""
    if cfg.optim.muon_qk_clip == 0:
        return
    for bad, why in ((cfg.optim.name != "muon", f"optim.name = 'muon' (got {cfg.optim.name!r}): MuonClip is Muon's"),
                     (cfg.model.qk_norm, "model.qk_norm = false: the q/k norms would undo a "
                      "per-head scale of the q and k weights, and their weights are shared by every head"),
                     (cfg.train.models > 1, f"train.models = 1 (got {cfg.train.models})"),
                     ("mla" not in kind_keys(cfg.model.kind), f"per-head q and k weights (model.kind = "
                      f"{cfg.model.kind!r} has multi-head latent attention, whose keys share one latent and rotary "
                      "key: MuonClip is not built for it)")):
        if bad:
            raise ConfigError(f"optim.muon_qk_clip = {cfg.optim.muon_qk_clip} needs {why}; or set it to 0")


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
    if "mla" not in off:
        _validate_mla(m)
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


def _validate_mla(m: ModelConfig) -> None:
    if m.mla.qk_rope_head_dim % 2:
        raise ConfigError(f"model.mla.qk_rope_head_dim = {m.mla.qk_rope_head_dim} is odd: the rotary embedding "
                          "rotates pairs, so it must be even")
    r = m.rope_scaling
    if r.type == "none" and r != RopeScalingConfig():
        raise ConfigError("model.rope_scaling keys are set but model.rope_scaling.type = 'none': set type = 'yarn', "
                          "or remove the [model.rope_scaling] keys")


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
    if e.num_experts % e.n_groups:
        raise ConfigError(f"model.moe.n_groups = {e.n_groups} does not divide model.moe.num_experts = "
                          f"{e.num_experts}: use a divisor of {e.num_experts}")
    if e.topk_groups > e.n_groups:
        raise ConfigError(f"model.moe.topk_groups = {e.topk_groups} is more than model.moe.n_groups = "
                          f"{e.n_groups}: use 1..{e.n_groups}")
    reach = e.topk_groups * (e.num_experts // e.n_groups)
    if e.top_k > reach:
        raise ConfigError(f"model.moe.top_k = {e.top_k} is more than the {reach} experts of model.moe.topk_groups "
                          f"= {e.topk_groups} groups of {e.num_experts // e.n_groups}: use top_k 1..{reach}, or "
                          "more groups per token")
    if e.dense_layers >= m.n_layers:
        raise ConfigError(f"model.moe.dense_layers = {e.dense_layers} leaves no MoE layer in model.n_layers = "
                          f"{m.n_layers}: use 0..{m.n_layers - 1}")


def _validate_section(obj: Any, cls, prefix: str) -> None:
    if not isinstance(obj, cls):
        raise ConfigError(f"{prefix[:-1] or 'config'} = {show(obj)}: expected a {cls.__name__}")
    for f in dataclasses.fields(cls):
        tp, key = type_hints(cls)[f.name], prefix + toml_key(f)
        raw = getattr(obj, f.name)
        if is_section(tp):
            _validate_section(raw, tp, key + ".")
            continue
        item = table_item(tp)
        if item is not None:
            if not isinstance(raw, list):
                raise ConfigError(f"{key} = {show(raw)}: expected a list of {item.__name__} tables")
            for i, x in enumerate(raw):
                _validate_section(x, item, f"{key}[{i}].")
            continue
        ok, value = _match(raw, tp)
        if not ok:
            raise ConfigError(f"{key} = {show(raw)}: expected {_type_name(tp)}, got {type(raw).__name__}")
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
        raise ConfigError(f"{key} = {show(value)}: must be a finite number")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {show(value)}: must be one of {', '.join(map(show, choices))}")
    check = meta.get("check")
    if check is not None and not check[0](value):
        raise ConfigError(f"{key} = {show(value)}: {check[1]}")
