"""A whole model's training loss and gradient on one rank, and the central finite-difference check of it, for
the tests that hold a model variant's hand-written backward against float64 differences."""
from __future__ import annotations

import numpy as np

from hpengine.models.context import LOCAL
from hpengine.params.buffers import FlatBuffer


def loss_and_grad(m, P, lay, idx, y, grad=True):
    """The training loss (cross-entropy plus every MoE layer's weighted balancing share) of token ids idx and
    targets y, (B, T) each, and its gradient (None with grad=False)."""
    norm = float(idx.size)
    h, ce = m.embed_forward(np, P, idx, LOCAL)
    caches, extra = [], 0.0
    for i in range(m.n_layers):
        h, c = m.layer_forward(np, P, i, h, LOCAL, loss=(norm, 1.0))
        st = m.layer_stats(i, c)
        extra += st.share if st is not None else 0.0
        caches.append(c)
    loss, ch = m.head_forward(np, P, h, y, norm, LOCAL)
    if not grad:
        return float(loss) + extra, None
    G = FlatBuffer(lay, np, np.float64)
    d = m.head_backward(np, ch, G, LOCAL, P)
    for i in reversed(range(m.n_layers)):
        d = m.layer_backward(np, d, caches[i], P, G, i, LOCAL)
    m.embed_backward(np, d, ce, G, LOCAL)
    return float(loss) + extra, G


def assert_gradient_matches_differences(m, P, lay, idx, y, names, rng, picks=4, eps=1e-6, nonzero=True):
    """For `picks` random entries of every tensor in `names`, the analytic gradient equals the central
    difference of the loss (relative 1e-6); with nonzero, every named tensor's gradient is not all zero."""
    _, G = loss_and_grad(m, P, lay, idx, y)
    for name in names:
        flat = P[name].reshape(-1)
        for j in rng.choice(flat.size, size=min(flat.size, picks), replace=False):
            old = flat[j]
            flat[j] = old + eps
            lp, _ = loss_and_grad(m, P, lay, idx, y, grad=False)
            flat[j] = old - eps
            lm, _ = loss_and_grad(m, P, lay, idx, y, grad=False)
            flat[j] = old
            num, ana = (lp - lm) / (2 * eps), G[name].reshape(-1)[j]
            assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)) + 1e-9, (name, j, num, ana)
        if nonzero:
            assert np.abs(G[name]).max() > 0, name
