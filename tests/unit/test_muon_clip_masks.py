"""MuonClip's largest logits where the causal mask is not the whole story: packed documents (a pair across a document
boundary never counts, whichever core attends) and context parallelism's block forward and ring and all-gather
drivers (each rank's queries over every visible key block; the max over the cp ranks is one process's), each
against scores formed and masked by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

import hpengine.models.llama as llama
from hpengine.config.load import load_config
from hpengine.models.context import LocalAttn
from hpengine.nn.context_split import head_tail_positions
from hpengine.nn.logit_max import causal_max_logits, fused_max_logits
from hpengine.nn.ring_attention import block_forward
from hpengine.run.build import build
from hpengine.strategies.context_parallel import CONTEXT_ATTENTION
from test_muon_clip import GPT, LLAMA
from test_packed import token_file
from test_ring_attention import data, on_ranks  # tests/unit/test_ring_attention.py


def hand_max(q, k, qp, kp, scale, qs=None, ks=None):
    """Each head's largest scale q . k over the pairs a query sees (key position <= its own, same document)."""
    g = q.shape[1] // k.shape[1]
    s = np.einsum("bhtd,bhsd->bhts", q, np.repeat(k, g, axis=1)) * scale
    hidden = np.asarray(kp)[None, None, None, :] > np.asarray(qp)[None, None, :, None]
    if qs is not None:
        hidden = hidden | (np.asarray(qs)[:, None, :, None] != np.asarray(ks)[:, None, None, :])
    return np.where(hidden, -np.inf, s).max(axis=(0, 2, 3))


# ---- packed documents ----------------------------------------------------------------------------

def test_a_pair_across_a_document_boundary_never_counts():
    # one row, documents [0, 0, 1], head width 1: the largest causal score is q2 k1 = 2 x 10 = 20, but key 1 lies
    # in document 0 and query 2 in document 1; the largest visible one is q1 k1 = 1 x 10 = 10
    q = np.array([[[[1.0], [1.0], [2.0]]]])            # (B, H, T, hd)
    k = np.array([[[[1.0], [10.0], [0.5]]]])
    assert causal_max_logits(np, q, k)[0] == 20.0
    assert causal_max_logits(np, q, k, np.array([[0, 0, 1]]))[0] == 10.0
    assert causal_max_logits(np, q, k, np.array([[0, 1, 1]]))[0] == 20.0       # same document: it counts


def test_documents_mask_every_row_and_group_head_by_hand():
    rng = np.random.default_rng(1)
    B, H, K, T, hd = 3, 4, 2, 300, 2          # T over the 128-row tiles: a document crosses a tile edge
    q, k = rng.standard_normal((B, H, T, hd)), rng.standard_normal((B, K, T, hd))
    seg = np.sort(rng.integers(0, 9, (B, T)), axis=1)
    want = hand_max(q, k, np.arange(T), np.arange(T), 1.0, seg, seg)
    np.testing.assert_array_equal(causal_max_logits(np, q, k, seg), want)
    assert (want < hand_max(q, k, np.arange(T), np.arange(T), 1.0)).any()     # the mask hid a larger score


def test_the_fused_layout_masks_documents_too():
    rng = np.random.default_rng(2)
    B, T, H, hd = 2, 9, 3, 4
    qkv = rng.standard_normal((B, T, H * 3 * hd))
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 2]])
    v = qkv.reshape(B, T, H, 3, hd).transpose(0, 2, 1, 3, 4)
    want = hand_max(v[..., 0, :], v[..., 1, :], np.arange(T), np.arange(T), 1 / math.sqrt(hd), seg, seg)
    np.testing.assert_allclose(fused_max_logits(np, qkv, H, seg), want, rtol=1e-15)


def test_the_local_attention_part_measures_within_its_documents():
    """What a model's forward hands: ctx.attn for a packed micro-batch measures over its segments; a call without
    `logits` measures nothing (the core alone runs)."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 2, 6, 2)), rng.standard_normal((1, 1, 6, 2)), rng.standard_normal((1, 1, 6, 2))
    seg = np.array([[0, 0, 1, 1, 1, 2]])
    got, calls = [], []
    core = lambda xp, *a: calls.append(a) or ("y", "cache")      # noqa: E731
    part = LocalAttn().for_documents(seg)
    assert part.grouped_forward(np, core, q, k, v, scale=0.5, logits=got.append) == ("y", "cache")
    np.testing.assert_allclose(got[0], hand_max(q, k, range(6), range(6), 0.5, seg, seg), rtol=1e-15)
    assert LocalAttn().segments is None and len(calls) == 1
    part.grouped_forward(np, core, q, k, v)
    assert len(got) == 1 and len(calls) == 2


# ---- context parallelism's drivers ----------------------------------------------------------------

@pytest.mark.parametrize("documents", [False, True])
def test_the_block_forward_max_is_the_max_of_its_visible_scores(documents):
    # queries at head-tail positions against a key block of two runs, one partly after every query: GQA groups of
    # 2, the tile-skip and the document mask all in play; o and lse are the plain call's, bit for bit
    B, H, K, hd = 2, 4, 2, 3
    q, k, v, _ = data(B, H, K, 8, hd, seed=4)
    qp, kp = np.array([0, 1, 2, 9, 10, 11, 12, 13]), np.array([3, 4, 5, 6, 14, 15, 16, 17])
    qs = ks = None
    if documents:
        qs = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
        ks = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])
    o, lse, m = block_forward(np, q, k, v, qp, kp, 0.7, qs, ks, logit_max=True)
    np.testing.assert_allclose(m, hand_max(q, k, qp, kp, 0.7, qs, ks), rtol=1e-15)
    o0, lse0 = block_forward(np, q, k, v, qp, kp, 0.7, qs, ks)
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(lse, lse0)
    _, _, none = block_forward(np, q, k, v, qp, kp + 100, 0.7, logit_max=True)      # every key after every query
    assert np.isneginf(none).all()


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_each_cp_rank_measures_its_queries_over_every_visible_key(how, documents):
    B, H, K, T, hd, cp = 2, 4, 2, 16, 3, 2
    q, k, v, _ = data(B, H, K, T, hd, seed=5)
    q[0, :, 12], k[0, :, 4] = 3.0, 3.0     # every head's largest causal score: query 12 (document 2) on key 4 (0)
    seg = np.array([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5]) if documents else None
    pos = [head_tail_positions(T, cp, r) for r in range(cp)]
    fwd = CONTEXT_ATTENTION[how][0]

    def rank(comm):
        p = pos[comm.rank]
        s = None if seg is None else np.ascontiguousarray(seg[:, p])
        out, _, m = fwd(np, comm, q[:, :, p], k[:, :, p], v[:, :, p], p, p, None, s, s, logit_max=True)
        plain, _ = fwd(np, comm, q[:, :, p], k[:, :, p], v[:, :, p], p, p, None, s, s)
        np.testing.assert_array_equal(out, plain)          # measuring changes nothing
        return m

    got, _ = on_ranks(cp, rank)
    sc = 1 / math.sqrt(hd)
    for r, p in enumerate(pos):        # rank r: its own queries against every key of the row
        want = hand_max(q[:, :, p], k, p, np.arange(T), sc, None if seg is None else seg[:, p], seg)
        np.testing.assert_allclose(got[r], want, rtol=1e-15)
    whole = hand_max(q, k, np.arange(T), np.arange(T), sc, seg, seg)
    np.testing.assert_allclose(np.maximum(*got), whole, rtol=1e-15)      # the max over cp: one process's
    if documents:
        assert (whole < 27 * sc).all()


# ---- the engine ----------------------------------------------------------------------------------

DOCS = ["data.document_mask=true", "model.vocab_size=64", "model.init_std=0.5"]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """Documents of 2..6 tokens: most rows of 8 cross a boundary or two."""
    lengths = np.random.default_rng(7).integers(2, 7, size=200).tolist()
    return token_file(tmp_path_factory.mktemp("clipdocs") / "docs.h5", lengths, 64)


def _gpt_layer0(eng, params, batch):
    """Layer 0's per-head largest logit over batch's visible pairs (causal, same document), from the equations."""
    x = params["wte"][batch.tokens] + params["wpe"][batch.positions]
    h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eng.cfg.model.norm_eps)
    h = h * params["h.0.ln1.w"] + params["h.0.ln1.b"]
    qkv = (h @ params["h.0.attn.qkv.w"] + params["h.0.attn.qkv.b"]).reshape(*h.shape[:2], 2, 3, 8)
    q, k = qkv[:, :, :, 0].transpose(0, 2, 1, 3), qkv[:, :, :, 1].transpose(0, 2, 1, 3)
    T = np.arange(8)
    return (hand_max(q, k, T, T, 1 / math.sqrt(8), batch.segments, batch.segments),
            hand_max(q, k, T, T, 1 / math.sqrt(8)))


@pytest.mark.parametrize("attention", ["standard", "flash"])
def test_packed_rows_clip_on_their_visible_pairs(docs, attention):
    cfg = load_config(None, [*GPT, *DOCS, f"data.path={docs}", f"model.attention={attention}",
                             "optim.muon_qk_clip=1e6"])
    eng = build(cfg)
    init = eng.named_params()
    batch = eng.rows.read("train", 0, eng.slots[0].seed)
    assert batch.segments is not None and (batch.segments[:, 1:] != batch.segments[:, :1]).any()
    eng.train_step(0)
    want, causal = _gpt_layer0(eng, init, batch)
    np.testing.assert_allclose(eng.post.logits.table(np.asarray)[0], want, rtol=1e-13)
    assert (want < causal).any()        # a larger causal score lay across a boundary: the mask decided


def test_grouped_queries_under_documents_measure_what_their_core_reads(docs, monkeypatch):
    """llama: the table's layer maxima are those of the q and k its grouped core was handed, masked by hand."""
    seen = []
    real = llama.gqa_attention_forward

    def spy(xp, q, k, v, *a, **kw):
        seen.append((q, k, kw.get("segments")))
        return real(xp, q, k, v, *a, **kw)
    monkeypatch.setattr(llama, "gqa_attention_forward", spy)
    eng = build(load_config(None, [*GPT, *LLAMA, *DOCS, f"data.path={docs}", "optim.muon_qk_clip=1e6"]))
    eng.train_step(0)
    assert len(seen) == 2 and seen[0][2] is not None
    table = eng.post.logits.table(np.asarray)
    for i, (q, k, seg) in enumerate(seen):
        T = np.arange(q.shape[2])
        np.testing.assert_allclose(table[i], hand_max(q, k, T, T, 1.0, seg, seg), rtol=1e-13)
