"""What the interop tests share: hpengine's own logits of a model held as named arrays, and the torch view that
lets a transformers modeling module compute in float64 (so only rounding separates the two sides)."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.models import LOCAL, build_model
from hpengine.nn import layernorm_forward, rmsnorm_forward


def hpengine_logits(P, mcfg, ids):
    """Logits (B, T, V) of token ids (B, T) through the whole model on one rank, P: name -> array."""
    model = build_model(mcfg)
    x, _ = model.embed_forward(np, P, ids, LOCAL)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(np, P, i, x, LOCAL)
    if mcfg.kind == "gpt":
        h, _ = layernorm_forward(np, x, P["ln_f.w"], P["ln_f.b"])
    else:
        h, _ = rmsnorm_forward(np, x, P["norm.w"], mcfg.norm_eps)
    return h @ (P["wte"].T if mcfg.tie_head else P["lm_head.w"])


class Float64Torch:
    """A modeling module's view of `torch` with its float32 upcasts (torch.float32, torch.float) read as
    float64; set as the module's `torch` attribute while a test runs."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        t = self._torch
        return t.float64 if name in ("float32", "float") else getattr(t, name)


def exact(torch, fn, *modules):
    """fn() with the modeling modules' float32 read as float64 (their rotary inv_freq is made at load time too)
    and `Tensor.float()` a float64 upcast (an MoE router's `router_logits.float()`): every other difference
    between the two sides is rounding."""
    with pytest.MonkeyPatch.context() as m:
        for mod in modules:
            m.setattr(mod, "torch", Float64Torch(torch))
        m.setattr(torch.Tensor, "float", lambda self, *a, **k: self.to(torch.float64))
        return fn()


def logits_of(torch, model, ids):
    """transformers' logits of token ids (B, T) as a NumPy array."""
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def sets(items):
    """--set arguments for the command line from KEY=VALUE items."""
    return [a for it in items for a in ("--set", it)]
