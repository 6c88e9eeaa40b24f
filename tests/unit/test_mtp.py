"""Multi-token prediction (model.mtp) on the llama kind: the targets each depth counts (Batch.with_ahead, by hand
and against the document offsets' counts), the whole model's gradient against float64 central differences at depth
1 and 2 (dense, MoE, packed documents), and the loss against an independent NumPy oracle written from the
DeepSeek-V3 equations (nothing from hpengine.nn or hpengine.models)."""
from dataclasses import replace

import numpy as np
import pytest

from hpengine.config.load import ConfigError, load_config, ModelConfig, MoEConfig, MTPConfig
from hpengine.data.batch import Batch
from hpengine.data.documents import counted_ahead, counted_targets, window_documents
from hpengine.models import build_model
from hpengine.models.context import LOCAL, Ahead, with_documents
from hpengine.params.buffers import FlatBuffer, Layout
from hpengine.params.init import init_flat

B, T, V, C, H, K = 2, 8, 40, 16, 4, 2


def test_ahead_targets_by_hand():
    y = np.array([[11, 12, 13, 14, 15, 16]])
    b = Batch(targets=y, loss_mask=np.array([[1, 1, 0, 1, 1, 1]])).with_ahead(2)
    # depth 1 at i: y[i + 1], counted while loss_mask[i], loss_mask[i + 1] are 1
    assert b.ahead[0, :, 0].tolist() == [12, -1, -1, 15, 16, -1]
    assert b.ahead[0, :, 1].tolist() == [-1, -1, -1, 16, -1, -1]
    assert Batch(targets=y).with_ahead(1).ahead[0, :, 0].tolist() == [12, 13, 14, 15, 16, -1]
    assert Batch(targets=y).with_ahead(0).ahead is None


def test_counted_ahead_is_the_ahead_masks_summed():
    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 7, 60))])
    starts = rng.integers(0, offsets[-1] - T - 1, 16)
    seg, pos, mask = window_documents(offsets, starts, T)
    b = Batch(targets=np.zeros((16, T), np.int64), segments=seg, positions=pos, loss_mask=mask).with_ahead(3)
    assert counted_ahead(offsets, starts, T, 0) == counted_targets(offsets, starts, T) == mask.sum()
    for k in (1, 2, 3):
        assert counted_ahead(offsets, starts, T, k) == (b.ahead[..., k - 1] >= 0).sum()


def model(depth, moe=None, tied=False):
    mc = ModelConfig(kind="llama", vocab_size=V, seq_len=T, d_model=C, n_layers=2, n_heads=H, n_kv_heads=K,
                     ffn_hidden=24, dtype="float64", norm_eps=1e-3, rope_theta=37.0, tie_head=tied,
                     moe=MoEConfig(**(moe or {})), mtp=MTPConfig(depth=depth, loss_weight=0.7))
    m = build_model(mc)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 5)
    P.data[:] += np.random.default_rng(2).standard_normal(P.data.size) * 0.2     # norms off their ones
    return m, P, lay


def rows(depth, docs=False, seed=0):
    """A Batch of B windows of T + 1 random tokens (packed documents with docs) with its MTP targets, and the
    windows."""
    rng = np.random.default_rng(seed)
    win = rng.integers(0, V, (B, T + 1))
    extra = {}
    if docs:
        offsets = np.array([0, 3, 4, 9, 12, 30])
        extra = dict(zip(("segments", "positions", "loss_mask"), window_documents(offsets, np.array([0, 8]), T)))
    return Batch(win[:, :-1], win[:, 1:], **extra).with_ahead(depth), win, extra


def loss_and_grad(m, P, lay, batch, depth, grad=True):
    norm = float(batch.loss_mask.sum() if batch.loss_mask is not None else batch.targets.size)
    norms = tuple(float(max(1, (batch.ahead[..., k] >= 0).sum())) for k in range(depth))
    ctx = replace(with_documents(LOCAL, batch), ahead=Ahead(batch.ahead, norms))
    h, ce = m.embed_forward(np, P, batch.tokens, ctx)
    caches, extra = [], 0.0
    for i in range(m.n_layers):
        h, c = m.layer_forward(np, P, i, h, ctx, loss=(norm, 1.0))
        st = m.layer_stats(i, c)
        extra += st.share if st is not None else 0.0
        caches.append(c)
    loss, ch = m.head_forward(np, P, h, batch.targets, norm, ctx)
    if not grad:
        return float(loss) + extra, None
    G = FlatBuffer(lay, np, np.float64)
    d = m.head_backward(np, ch, G, ctx, P)
    for i in reversed(range(m.n_layers)):
        d = m.layer_backward(np, d, caches[i], P, G, i, ctx)
    m.embed_backward(np, d, ce, G, ctx)
    return float(loss) + extra, G


MOE = dict(num_experts=4, top_k=2, expert_hidden=12, aux_loss=0.05, z_loss=0.01)


@pytest.mark.parametrize("depth,moe,docs,tied", [(1, None, False, False), (2, None, False, True), (2, None, True, False),
                                                  (1, MOE, False, False)])
def test_whole_model_gradient_against_finite_differences(depth, moe, docs, tied):
    m, P, lay = model(depth, moe, tied)
    batch = rows(depth, docs)[0]
    rng = np.random.default_rng(1)
    _, G = loss_and_grad(m, P, lay, batch, depth)
    names = [n for n in lay.ranges if n.startswith("mtp.")] + ["wte", "h.0.attn.q.w", "h.1.attn_norm.w", "norm.w"]
    names += [] if tied else ["lm_head.w"]
    eps = 1e-6
    for name in names:
        flat = P[name].reshape(-1)
        assert np.abs(G[name]).max() > 0, name
        for j in rng.choice(flat.size, size=min(flat.size, 3), replace=False):
            old = flat[j]
            flat[j] = old + eps
            lp, _ = loss_and_grad(m, P, lay, batch, depth, grad=False)
            flat[j] = old - eps
            lm, _ = loss_and_grad(m, P, lay, batch, depth, grad=False)
            flat[j] = old
            num, ana = (lp - lm) / (2 * eps), G[name].reshape(-1)[j]
            assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)) + 1e-9, (name, j, num, ana)


# --- the oracle ---------------------------------------------------------------------------------------------
def rms(x, w, eps=1e-3):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate(x, pos, theta=37.0):
    hd = x.shape[-1]
    ang = pos[:, None] / theta ** (np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def block(P, p, x, seg, pos):
    """One llama block (HF LlamaDecoderLayer) on (B, T, C), attention causal within each row's documents."""
    hd, out = C // H, np.zeros((B, T, H, C // H))
    h = rms(x, P[p + "attn_norm.w"])
    q, k, v = (h @ P[p + f"attn.{n}.w"] for n in "qkv")
    for b in range(B):
        allowed = (np.arange(T)[:, None] >= np.arange(T)[None, :]) & (seg[b][:, None] == seg[b][None, :])
        for j in range(H):
            g = j // (H // K)
            qj = rotate(q[b, :, j * hd:(j + 1) * hd], pos[b])
            kj = rotate(k[b, :, g * hd:(g + 1) * hd], pos[b])
            s = np.where(allowed, qj @ kj.T / np.sqrt(hd), -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, j] = (e / e.sum(-1, keepdims=True)) @ v[b, :, g * hd:(g + 1) * hd]
    x = x + out.reshape(B, T, C) @ P[p + "attn.o.w"]
    h = rms(x, P[p + "mlp_norm.w"])
    g, u = h @ P[p + "mlp.gate.w"], h @ P[p + "mlp.up.w"]
    return x + (g / (1 + np.exp(-g)) * u) @ P[p + "mlp.down.w"]


def ce(P, h, tgt, keep):
    logits = h @ P["lm_head.w"]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return -(np.take_along_axis(logp, tgt[..., None], -1)[..., 0] * keep).sum() / max(1, keep.sum())


def oracle_loss(P, win, depth, weight, doc):
    """Main cross-entropy + weight / depth x sum over depths k of CE(token i + k + 1 | position i), each over the
    positions whose token i + k + 1 is in the window and in i's document, divided by their count."""
    seg = doc[:, :T] if doc is not None else np.zeros((B, T), int)
    pos = np.array([[np.sum(seg[b, :i] == seg[b, i]) for i in range(T)] for b in range(B)])
    docs = doc if doc is not None else np.zeros((B, T + 1), int)
    x = P["wte"][win[:, :T]]
    for i in range(2):
        x = block(P, f"h.{i}.", x, seg, pos)
    loss = ce(P, rms(x, P["norm.w"]), win[:, 1:], docs[:, 1:] == docs[:, :T])
    h, total = x, 0.0
    for k in range(1, depth + 1):
        p = f"mtp.{k - 1}."
        nxt = np.zeros((B, T), int)
        nxt[:, :T + 1 - k] = win[:, k:]                       # t_{i+k}, 0 past the window
        u = np.concatenate([rms(P["wte"][nxt], P[p + "enorm.w"]), rms(h, P[p + "hnorm.w"])], -1) @ P[p + "eh_proj.w"]
        h = block(P, p, u, seg, pos)
        tgt, keep = np.zeros((B, T), int), np.zeros((B, T), bool)
        tgt[:, :T - k] = win[:, k + 1:]
        keep[:, :T - k] = docs[:, k + 1:] == docs[:, :T - k]
        total += ce(P, rms(h, P[p + "norm.w"]), tgt, keep)
    return loss + weight / depth * total


@pytest.mark.parametrize("depth,docs", [(1, False), (2, False), (3, True)])
def test_loss_equals_the_oracle(depth, docs):
    m, P, lay = model(depth)
    batch, win, extra = rows(depth, docs, seed=4)
    doc = None
    if docs:        # each window token's document, the targets' included
        t = np.array([0, 8])[:, None] + np.arange(T + 1)
        doc = np.searchsorted(np.array([0, 3, 4, 9, 12, 30]), t, side="right")
    got, _ = loss_and_grad(m, P, lay, batch, depth, grad=False)
    assert got == pytest.approx(oracle_loss(P, win, depth, 0.7, doc), rel=1e-12)


def test_config_refuses_mtp_outside_the_llama_family():
    with pytest.raises(ConfigError, match="model.mtp"):
        load_config(None, ["model.kind=gpt", "model.mtp.depth=1"])
    with pytest.raises(ConfigError, match="model.mtp.depth"):
        load_config(None, ["model.kind=llama", "model.mtp.depth=-1"])


@pytest.mark.parametrize("tied", [False, True])
def test_planner_counts_the_modules(tied):
    """The planner's last stage multiplies by each module's projection and block matrices and by the shared head
    once more, runs one attention pass more per module, and holds the modules' parameters."""
    from hpengine.planner.stages import stages
    mc = dict(kind="llama", vocab_size=V, seq_len=T, d_model=C, n_layers=2, n_heads=H, n_kv_heads=K, ffn_hidden=24,
              tie_head=tied)
    hd = C // H
    block = C * H * hd + 2 * C * K * hd + H * hd * C + 3 * C * 24
    base = stages(ModelConfig(**mc), 1, 2, 1)[-1]
    for depth in (1, 2):
        st = stages(ModelConfig(**mc, mtp=MTPConfig(depth=depth)), 1, 2, 1)[-1]
        assert st.matmul - base.matmul == depth * (2 * C * C + block + V * C)
        assert st.layers - base.layers == depth
        assert sum(map(sum, (s for _, s in st.blocks))) - sum(map(sum, (s for _, s in base.blocks))) == \
            depth * (2 * C * C + 3 * C + block + 2 * C) + (0 if tied else V * C)    # untied: wte copied here
