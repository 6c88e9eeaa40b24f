"""The declared model interface: every kind implements each protocol of models/interface.py with its exact
parameters; its declared capabilities agree with the model it builds; and nothing outside models/ switches on
a model kind's name, probes a model with getattr or tests the type of a context part."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from hpengine.config.load import load_config
from hpengine.models import KINDS, build_model, capabilities
from hpengine.models.interface import Decoding, Model, Numerics, PlannerFacts

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"gpt": [], "mlp": ["model.kind=mlp"],
           "llama": ["model.kind=llama", "model.d_model=48", "model.n_heads=4", "model.n_kv_heads=2"],
           "llama_head_dim": ["model.kind=llama", "model.d_model=48", "model.n_heads=4", "model.head_dim=16"],
           "moe": ["model.kind=llama", "model.d_model=32", "model.n_heads=4", "model.moe.num_experts=4",
                   "model.moe.top_k=2", "model.moe.capacity_factor=1.25"]}


def _protocol_methods(proto) -> dict:
    return {n: f for n, f in vars(proto).items() if callable(f) and not n.startswith("_")}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("proto", [Numerics, PlannerFacts, Decoding])
def test_every_kind_implements_each_protocol_with_its_parameters(kind, proto):
    cls = KINDS[kind].model
    for name, declared in _protocol_methods(proto).items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {proto.__name__}.{name}"
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} differs from {proto.__name__}.{name}{want}"
    model = cls(load_config(None, [f"model.kind={kind}"]).model)
    assert isinstance(model, proto) and isinstance(model, Model)
    assert isinstance(model.n_layers, int) and hasattr(model, "moe")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_declared_capabilities_agree_with_the_model_built(name):
    mcfg = load_config(None, CONFIGS[name]).model
    caps, model = capabilities(mcfg), build_model(mcfg)
    specs = {s.name: s.global_shape for s in model.all_specs()}
    assert caps.attention == (model.attention_flops(1024, 1) > 0)
    assert caps.experts == (model.moe.E if model.moe is not None else 0)
    if caps.attention:      # the query projection's width over the heads, from the parameter shapes
        q = next(shape for n, shape in specs.items() if re.search(r"\.(q|qkv)\.w$", n))
        width = q[-1] // (3 if q[-1] == 3 * mcfg.d_model and mcfg.kind == "gpt" else 1)
        assert caps.qk_width == caps.v_width == width // mcfg.n_heads
    else:
        assert caps.qk_width == caps.v_width == 0
    if caps.experts:
        assert (caps.top_k, caps.capacity_factor) == (2, 1.25)


# what outside models/ may not do: name a model kind, probe a model, test a context part's type
FORBIDDEN = re.compile(r"""(\bkind\s*(==|!=)\s*["'](gpt|llama|mlp)["'])|(kind\s+(not\s+)?in\s+\(["'](gpt|llama|mlp))"""
                       r"""|(getattr\([^,]*\bmodel\b)|(getattr\(\w+, ["']moe["'])|(type\(ctx\.)""")


def test_no_kind_switch_model_probe_or_context_type_test_outside_models():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "hpengine").rglob("*.py")) if "models" not in p.relative_to(ROOT).parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert not found, "\n".join(found)
