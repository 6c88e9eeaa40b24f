"""Whole-model gradient checks (float64, one process) through the engine itself.

The engine is built on one process (build(cfg, MPI.COMM_SELF)); parameters are written into its flat
buffer, and Engine.forward_backward runs the pass whose gradient lands in eng.sync.grads. The analytic
gradient is compared with finite differences of the engine's own loss, coordinate by coordinate, for a
sample that touches every tensor of the layout.
"""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.data.batch import Batch
from hpengine.run.build import build

B, T, V = 4, 8, 32
FD_H = 5e-4      # 5-point stencil: truncation ~h^4, round-off ~eps/h, both far below the tolerance
FD_TOL = 1e-6
PER_TENSOR = 2   # coordinates sampled per tensor (29 tensors in the 2-layer GPT -> 58 coordinates)


@pytest.fixture(scope="module")
def corpus32(tmp_path_factory):
    """A token file the V = 32 models accept (build needs data; the passes below bring their own rows)."""
    path = tmp_path_factory.mktemp("model") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(2000) % V).astype(np.uint8)
    return path


# the llama kind: 4 query heads in 2 groups (head_dim 4, rotary pairs), SwiGLU width 24; llama_head_dim: the
# same with heads 6 wide (model.head_dim), so q is (16, 24), k and v (16, 12), o (24, 16)
KIND_KEYS = {"gpt": ["model.n_heads=2", "model.ffn_mult=2"], "mlp": ["model.n_heads=2", "model.ffn_mult=2"],
             "llama": ["model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.rope_theta=100"]}
KIND_KEYS["llama_head_dim"] = KIND_KEYS["llama"] + ["model.head_dim=6"]


def make(corpus, kind: str, tied: bool, seed: int = 7):
    cfg = load_config(None, [f"model.kind='{kind.split('_')[0]}'", f"model.vocab_size={V}", f"model.seq_len={T}",
                             "model.d_model=16", "model.n_layers=2", *KIND_KEYS[kind],
                             f"model.tie_head={str(tied).lower()}",
                             "model.dtype='float64'", "model.init_std=0.3", f"train.seed={seed}",
                             f"train.global_batch={B}", "runtime.backend='numpy'", f"data.path={corpus}"])
    eng = build(cfg, MPI.COMM_SELF)
    # Ones/zeros inits (layernorm, biases) would make the check blind to some transposition and
    # broadcasting mistakes: move every parameter off its special value.
    eng.sync.params.data += np.random.default_rng(seed).normal(0.0, 0.1, eng.layout.total)
    return eng


def batch(seed: int = 0, rows: int = B):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(rows, T))
    y = rng.integers(0, V, size=(rows, T))
    return x, y


def loss_of(eng, x, y, norm) -> float:
    """The engine's loss share of one forward pass (no gradient)."""
    return float(eng.forward_backward(eng.slots[0], Batch(x, y), norm, grad=False))


def gradient(eng, passes, norm) -> tuple[float, np.ndarray]:
    """Zero the gradients, run forward_backward over each (x, y) in `passes` (they accumulate, as the
    passes of one optimizer step do); returns (summed loss, copy of the flat gradient)."""
    eng.sync.begin_step()
    loss = 0.0
    for j, (x, y) in enumerate(passes):
        loss += float(eng.forward_backward(eng.slots[0], Batch(x, y), norm, last_pass=j == len(passes) - 1))
    return loss, np.array(eng.sync.grads.data)


def tensor(eng, flat, name):
    return flat[eng.layout.ranges[name].slice]


def sample_coordinates(layout, rng):
    """PER_TENSOR distinct flat indices inside every tensor (fewer only for smaller tensors)."""
    picks = []
    for name, r in layout.ranges.items():
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
    ("llama", False): 1 + 2 * 9 + 2,     # wte; 2 norms, q, k, v, o, gate, up, down per layer; norm, lm_head
    ("llama", True): 1 + 2 * 9 + 1,
    ("llama_head_dim", False): 1 + 2 * 9 + 2,
}


@pytest.mark.parametrize("kind,tied", [("gpt", False), ("gpt", True), ("mlp", False), ("mlp", True),
                                       ("llama", False), ("llama", True), ("llama_head_dim", False)])
@pytest.mark.parametrize("norm_rows", [B, 11.5], ids=["norm=B*T", "norm=11.5*T"])
def test_whole_model_gradient_matches_finite_differences(corpus32, kind, tied, norm_rows):
    eng = make(corpus32, kind, tied)
    layout = eng.layout
    assert len(layout.ranges) == EXPECTED_TENSORS[(kind, tied)]
    assert ("lm_head.w" in layout.ranges) is not tied
    if kind == "llama_head_dim":
        assert layout.shapes["h.0.attn.q.w"] == (16, 24) and layout.shapes["h.1.attn.o.w"] == (24, 16)
    x, y = batch()
    norm = float(norm_rows * T)
    loss, grads = gradient(eng, [(x, y)], norm)
    # loss is the sum of per-token NLLs over norm; at this init it is a few nats per token
    assert np.isfinite(loss) and 0.5 < loss * norm / (B * T) < 20
    # every tensor receives some gradient (a dropped backward would leave a tensor at exactly zero)
    for name in layout.ranges:
        assert np.abs(tensor(eng, grads, name)).max() > 1e-6, f"{name}: gradient is all zero"

    f = lambda: loss_of(eng, x, y, norm)  # noqa: E731
    scale = np.abs(grads).max()
    worst, report = 0.0, []
    for name, i in sample_coordinates(layout, np.random.default_rng(1)):
        a = grads[i]
        n = numeric_derivative(f, eng.sync.params.data, i)
        # relative error; near-zero entries (e.g. the key bias, whose exact gradient is 0 since softmax
        # ignores a per-row shift) are judged against a floor set by the round-off of the stencil
        err = abs(a - n) / max(abs(a), abs(n), 1e-5 * scale)
        worst = max(worst, err)
        if err >= FD_TOL:
            report.append(f"{name}[{i - layout.ranges[name].start}]: analytic {a:.10e} numeric {n:.10e}")
    assert not report, f"relative error {worst:.2e} >= {FD_TOL}:\n" + "\n".join(report)
    # the sample really covered every tensor, and the check could fail: a wrong scale would show
    assert {n for n, _ in sample_coordinates(layout, np.random.default_rng(1))} == set(layout.ranges)


@pytest.mark.parametrize("kind,tied", [("gpt", False), ("gpt", True), ("mlp", False), ("llama", False)])
def test_split_batch_with_global_norm_accumulates_the_same_gradient(corpus32, kind, tied):
    eng = make(corpus32, kind, tied)
    x, y = batch(3)
    norm = float(B * T)   # the global token count, whatever the pass size
    loss_whole, whole = gradient(eng, [(x, y)], norm)
    loss_split, split = gradient(eng, [(x[r], y[r]) for r in (slice(0, 2), slice(2, 4))], norm)
    assert loss_split == pytest.approx(loss_whole, rel=1e-12, abs=0)
    np.testing.assert_allclose(split, whole, rtol=1e-12, atol=1e-15 * np.abs(whole).max())
    # each half alone is a different (partial) gradient: the comparison above is not vacuous
    _, half = gradient(eng, [(x[:2], y[:2])], norm)
    assert not np.allclose(half, whole, rtol=1e-3)


def test_forward_leaves_parameters_untouched_and_is_deterministic(corpus32):
    eng = make(corpus32, "gpt", False)
    before = np.array(eng.sync.params.data)
    x, y = batch(5)
    l1, g1 = gradient(eng, [(x, y)], float(B * T))
    l2 = loss_of(eng, x, y, float(B * T))
    np.testing.assert_array_equal(eng.sync.params.data, before)
    assert l1 == l2
    # begin_step zeroes the gradient: a second step's gradient equals the first, not twice it
    _, g2 = gradient(eng, [(x, y)], float(B * T))
    np.testing.assert_array_equal(g2, g1)
