"""Whole-model gradient checks (float64, one process) through the public model API.

Forward and backward are chained exactly as Engine.forward_backward chains them; the analytic
gradient in the flat buffer is compared with finite differences of the loss, coordinate by coordinate,
for a sample that touches every tensor of the layout.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.buffers import FlatBuffer, Layout
from hpengine.config import load_config
from hpengine.init import init_flat
from hpengine.models import LocalTP, build_model

B, T, V = 4, 8, 32
FD_H = 5e-4      # 5-point stencil: truncation ~h^4, round-off ~eps/h, both far below the tolerance
FD_TOL = 1e-6
PER_TENSOR = 2   # coordinates sampled per tensor (29 tensors in the 2-layer GPT -> 58 coordinates)


def make(kind: str, tied: bool, seed: int = 7):
    cfg = load_config(None, [f"model.kind='{kind}'", f"model.vocab_size={V}", f"model.seq_len={T}",
                             "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
                             "model.ffn_mult=2", f"model.tie_head={str(tied).lower()}",
                             "model.dtype='float64'", "model.init_std=0.3"])
    model = build_model(cfg.model)
    specs = [s for b in model.block_names() for s in model.specs(b)]
    layout = Layout(specs)
    params = FlatBuffer(layout, np, np.float64)
    init_flat(params, seed)
    # Ones/zeros inits (layernorm, biases) would make the check blind to some transposition and
    # broadcasting mistakes: move every parameter off its special value.
    params.data += np.random.default_rng(seed).normal(0.0, 0.1, layout.total)
    return model, layout, params


def batch(seed: int = 0, rows: int = B):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(rows, T))
    y = rng.integers(0, V, size=(rows, T))
    return x, y


def forward_backward(model, params, x, y, norm, grads=None) -> float:
    """Engine.forward_backward with LocalTP: one pass, gradients accumulated (+=) into `grads`."""
    xp, tp = np, LocalTP()
    h, c_emb = model.embed_forward(xp, params, x, tp)
    caches = []
    for i in range(model.n_layers):
        h, c = model.layer_forward(xp, params, i, h, tp)
        caches.append(c)
    loss, c_head = model.head_forward(xp, params, h, y, norm, tp)
    if grads is None:
        return float(loss)
    dh = model.head_backward(xp, c_head, grads, tp, params)
    for i in reversed(range(model.n_layers)):
        dh = model.layer_backward(xp, dh, caches[i], params, grads, i, tp)
    model.embed_backward(xp, dh, c_emb, grads, tp)
    return float(loss)


def sample_coordinates(layout, rng):
    """PER_TENSOR distinct flat indices inside every tensor (fewer only for smaller tensors)."""
    picks = []
    for name in layout.names:
        r = layout.ranges[name]
        k = min(PER_TENSOR, r.size)
        picks += [(name, int(i)) for i in r.start + rng.choice(r.size, size=k, replace=False)]
    return picks


def numeric_derivative(f, data, i):
    old = data[i]
    vals = []
    for step in (-2, -1, 1, 2):
        data[i] = old + step * FD_H
        vals.append(f())
    data[i] = old
    fm2, fm1, fp1, fp2 = vals
    return (fm2 - 8 * fm1 + 8 * fp1 - fp2) / (12 * FD_H)


EXPECTED_TENSORS = {
    ("gpt", False): 2 + 2 * 12 + 3,
    ("gpt", True): 2 + 2 * 12 + 2,
    ("mlp", False): 1 + 2 * 6 + 3,
    ("mlp", True): 1 + 2 * 6 + 2,
}


@pytest.mark.parametrize("kind,tied", [("gpt", False), ("gpt", True), ("mlp", False), ("mlp", True)])
@pytest.mark.parametrize("norm_rows", [B, 11.5], ids=["norm=B*T", "norm=11.5*T"])
def test_whole_model_gradient_matches_finite_differences(kind, tied, norm_rows):
    model, layout, params = make(kind, tied)
    assert len(layout.names) == EXPECTED_TENSORS[(kind, tied)]
    assert ("lm_head.w" in layout.names) is not tied
    x, y = batch()
    norm = float(norm_rows * T)
    grads = FlatBuffer(layout, np, np.float64)
    loss = forward_backward(model, params, x, y, norm, grads)
    # loss is the sum of per-token NLLs over norm; at this init it is a few nats per token
    assert np.isfinite(loss) and 0.5 < loss * norm / (B * T) < 20
    # every tensor receives some gradient (a dropped backward would leave a tensor at exactly zero)
    for name in layout.names:
        assert np.abs(grads[name]).max() > 1e-6, f"{name}: gradient is all zero"

    f = lambda: forward_backward(model, params, x, y, norm)  # noqa: E731
    scale = np.abs(grads.data).max()
    worst, report = 0.0, []
    for name, i in sample_coordinates(layout, np.random.default_rng(1)):
        a = grads.data[i]
        n = numeric_derivative(f, params.data, i)
        # relative error; near-zero entries (e.g. the key bias, whose exact gradient is 0 since softmax
        # ignores a per-row shift) are judged against a floor set by the round-off of the stencil
        err = abs(a - n) / max(abs(a), abs(n), 1e-5 * scale)
        worst = max(worst, err)
        if err >= FD_TOL:
            report.append(f"{name}[{i - layout.ranges[name].start}]: analytic {a:.10e} numeric {n:.10e}")
    assert not report, f"relative error {worst:.2e} >= {FD_TOL}:\n" + "\n".join(report)
    # the sample really covered every tensor, and the check could fail: a wrong scale would show
    assert {n for n, _ in sample_coordinates(layout, np.random.default_rng(1))} == set(layout.names)


@pytest.mark.parametrize("kind,tied", [("gpt", False), ("gpt", True), ("mlp", False)])
def test_split_batch_with_global_norm_accumulates_the_same_gradient(kind, tied):
    model, layout, params = make(kind, tied)
    x, y = batch(3)
    norm = float(B * T)   # the global token count, whatever the pass size
    whole = FlatBuffer(layout, np, np.float64)
    loss_whole = forward_backward(model, params, x, y, norm, whole)
    split = FlatBuffer(layout, np, np.float64)
    loss_split = sum(forward_backward(model, params, x[r], y[r], norm, split)
                     for r in (slice(0, 2), slice(2, 4)))
    assert loss_split == pytest.approx(loss_whole, rel=1e-12, abs=0)
    np.testing.assert_allclose(split.data, whole.data, rtol=1e-12, atol=1e-15 * np.abs(whole.data).max())
    # each half alone is a different (partial) gradient: the comparison above is not vacuous
    half = FlatBuffer(layout, np, np.float64)
    forward_backward(model, params, x[:2], y[:2], norm, half)
    assert not np.allclose(half.data, whole.data, rtol=1e-3)


def test_forward_leaves_parameters_untouched_and_is_deterministic():
    model, layout, params = make("gpt", False)
    before = params.data.copy()
    x, y = batch(5)
    grads = FlatBuffer(layout, np, np.float64)
    l1 = forward_backward(model, params, x, y, float(B * T), grads)
    l2 = forward_backward(model, params, x, y, float(B * T))
    np.testing.assert_array_equal(params.data, before)
    assert l1 == l2
