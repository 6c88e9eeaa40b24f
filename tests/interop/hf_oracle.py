"""What the interop tests share: hpengine's own logits of a model held as named arrays, and the torch view that
lets a transformers modeling module compute in float64 (so only rounding separates the two sides)."""
from __future__ import annotations

import numpy as np

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
