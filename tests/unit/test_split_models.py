"""Every model kind's backward split into B (input gradient now) and W (the queued weight-gradient work,
nn/deferred.py) gives, bit for bit, the fused backward's input gradients and parameter gradients, whatever
else runs between B and W; and what the queued work holds (the W stash) is the size the model's cache_bytes
declares, which the planner reads."""
import numpy as np
import pytest

from hpengine.config.load import ModelConfig, MoEConfig
from hpengine.layout.cache import cache_nbytes
from hpengine.models import build_model
from hpengine.models.context import LOCAL
from hpengine.nn import run_all
from hpengine.params.buffers import FlatBuffer, Layout
from hpengine.params.init import init_flat

B, T, C = 2, 8, 16
CASES = {"gpt": {}, "gpt_tied_flash": {"tie_head": True, "attention": "flash"},
         "llama": {"n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24}, "llama_flash_tied": {
             "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24, "attention": "flash", "tie_head": True},
         "llama_qk_norm": {"n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24, "qk_norm": True},
         # heads 6 wide at d_model 16: q (16, 24), k and v (16, 12), o (24, 16)
         "llama_head_dim": {"n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24, "head_dim": 6, "qk_norm": True},
         "llama_head_dim_moe": {"n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 24, "head_dim": 6, "moe": MoEConfig(
             num_experts=4, top_k=2, expert_hidden=12, dense_layers=1)},
         "mlp": {}}


def model(case):
    kind = case.split("_")[0]
    mc = ModelConfig(**{"kind": kind, "vocab_size": 50, "seq_len": T, "d_model": C, "n_layers": 2, "n_heads": 2,
                        "dtype": "float64", **CASES[case]})
    m = build_model(mc)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 7)
    P.data[:] += np.random.default_rng(3).standard_normal(P.data.size) * 0.1    # norms away from 1 and 0
    return m, P, lay


def passes(m, P, n_mb):
    """Forward caches of n_mb micro-batches through embed, every layer and the head."""
    rng = np.random.default_rng(11)
    out = []
    for _ in range(n_mb):
        idx, y = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))
        h, ce = m.embed_forward(np, P, idx, LOCAL)
        cls = []
        for i in range(m.n_layers):
            h, c = m.layer_forward(np, P, i, h, LOCAL)
            cls.append(c)
        _, ch = m.head_forward(np, P, h, y, float(B * T), LOCAL)
        out.append((ce, cls, ch))
    return out


def backward(m, P, G, caches, defer):
    """One micro-batch's backward through every block; returns the embedding's input gradient."""
    ce, cls, ch = caches
    d = m.head_backward(np, ch, G, LOCAL, P, 1.0, defer)
    for i in reversed(range(m.n_layers)):
        d = m.layer_backward(np, d, cls[i], P, G, i, LOCAL, defer)
    dx = d.copy()
    m.embed_backward(np, d, ce, G, LOCAL, defer)
    return dx


@pytest.mark.parametrize("case", list(CASES))
def test_split_equals_fused_bit_for_bit(case):
    m, P, lay = model(case)
    fused, split = FlatBuffer(lay, np, np.float64), FlatBuffer(lay, np, np.float64)
    caches = passes(m, P, 3)
    dx_fused = [backward(m, P, fused, c, None) for c in caches]
    # the zb1p order of a late stage: B0 B1, then W0, B2, W1, W2: another micro-batch's B between a B and its W
    queues = [[] for _ in caches]
    dx_split = [backward(m, P, split, caches[0], queues[0]), backward(m, P, split, caches[1], queues[1])]
    run_all(queues[0])
    dx_split.append(backward(m, P, split, caches[2], queues[2]))
    run_all(queues[1])
    run_all(queues[2])
    for a, b in zip(dx_fused, dx_split):
        assert np.array_equal(a, b)
    assert np.array_equal(fused.data, split.data)
    assert np.abs(fused.data).min() >= 0 and np.count_nonzero(fused.data) > 0.9 * fused.data.size


@pytest.mark.parametrize("case", list(CASES))
def test_w_stash_is_the_declared_size(case):
    m, P, lay = model(case)
    G = FlatBuffer(lay, np, np.float64)
    (ce, cls, ch), = passes(m, P, 1)
    roots = {id(P.data), id(G.data)}
    declared = m.cache_bytes(B, 1, 8, "", B)
    queues = [[], [], []]
    d = m.head_backward(np, ch, G, LOCAL, P, 1.0, queues[0])
    d = m.layer_backward(np, d, cls[-1], P, G, m.n_layers - 1, LOCAL, queues[1])
    for i in reversed(range(m.n_layers - 1)):
        d = m.layer_backward(np, d, cls[i], P, G, i, LOCAL, [])
    m.embed_backward(np, d, ce, G, LOCAL, queues[2])
    last = f"w_layer.{m.n_layers - 1}"        # a routed (MoE) layer declares its own
    for q, key in zip(queues, ("w_head", last if last in declared else "w_layer", "w_embed")):
        assert cache_nbytes([w.held for w in q], roots) == declared[key], key
    matrices = [sp.name for sp in lay.specs if len(sp.global_shape) == 2]
    experts = [sp.name for sp in lay.specs if ".moe." in sp.name]      # routed experts and router run whole in B
    assert not any(G[n].any() for n in matrices if n not in experts)   # B wrote no other matrix's gradient ...
    for q in queues:
        run_all(q)
    assert all(G[n].any() for n in matrices if not n.startswith("h.0"))    # ... W did (h.0's queue was dropped)
