"""bfloat16 mixed precision, emulated on float32 storage: the rounding against ml_dtypes bit for bit, and a
bf16 run against float32 — the compute copy, activations and caches hold bf16 values, the masters do not, no
loss scaling by default, the loss close to float32's, and a bit-exact resume."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.engine.engine import Recompute
from hpengine.device.precision import round_bf16_
from hpengine.run.build import build
from hpengine.run.train import save_state

BF16 = ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16", "model.dtype=float32"]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16", "train.global_batch=8",
        "optim.lr=3e-3", "optim.warmup_steps=2", "runtime.backend=numpy", "train.steps=40"]
KINDS = {"gpt": ["model.kind=gpt"], "llama": ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=48"]}


def is_bf16(a) -> bool:
    a = np.asarray(a, dtype=np.float32)
    return bool(np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a, equal_nan=True))


def test_rounding_equals_ml_dtypes_bit_for_bit():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0x00008000,
                        0x00018000, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x80000000, 0],
                       dtype=np.uint32)       # inf, NaNs, ties to even both ways, overflow to inf, subnormals
    a = np.concatenate([bits, special]).view(np.float32)
    with np.errstate(invalid="ignore"):
        want = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = round_bf16_(np, a.copy())
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    m = a[:4096].reshape(64, 64).copy()
    view = m[:, ::3]                      # a strided view rounds in place, the rest untouched
    before = m[:, 1::3].copy()
    round_bf16_(np, view)
    assert np.array_equal(m[:, 1::3].view(np.uint32), before.view(np.uint32)) and is_bf16(m[:, ::3][~np.isnan(m[:, ::3])])
    with pytest.raises(TypeError, match="float32"):
        round_bf16_(np, np.zeros(3))


def engine(corpus, *extra):
    return build(load_config(None, [*TINY, f"data.path={corpus}", *extra]), MPI.COMM_SELF)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_run_stores_bf16_and_tracks_float32(small_corpus, kind):
    f32, bf = engine(small_corpus, *KINDS[kind], "model.dtype=float32"), engine(small_corpus, *KINDS[kind], *BF16)
    assert bf.scaler is None and bf.master is not None and bf.be.dtype == np.float32
    assert all(is_bf16(v) for v in bf.named_params().values())      # the initial compute copy too
    la, lb = [], []
    for s in range(40):
        la.append(f32.train_step(s)["loss"])
        m = bf.train_step(s)
        lb.append(m["loss"])
        assert "loss_scale" not in m
    assert abs(np.mean(lb[-5:]) / np.mean(la[-5:]) - 1) < 0.02          # within 2 % of float32
    assert lb[-1] < 0.8 * lb[0]                                          # and it trained
    params = bf.named_params()
    assert all(is_bf16(v) for v in params.values())
    assert not is_bf16(bf.master)                                       # the masters keep float32 precision
    # a forward pass: every block output and every saved activation (head excepted) is a bf16 value
    b = bf.rows.read("train", 0, bf.slots[0].seed).row_slice(0, 2)
    slot = bf.slots[0]
    chunk = slot.chunks[0]
    _, caches = bf.chunk_forward(slot, chunk, b.tokens, b, 1.0)
    arrays = []

    def walk(o):
        if isinstance(o, (tuple, list)):
            for v in o:
                walk(v)
        elif isinstance(o, Recompute):
            walk(o.x)
        elif getattr(o, "dtype", None) == np.float32:
            arrays.append(o)
    walk(caches[:-1])
    assert len(arrays) > 10 and all(is_bf16(a) for a in arrays)
    bf.chunk_backward(slot, chunk, None, caches)


def test_loss_scaling_and_bf16_gradients(small_corpus):
    eng = engine(small_corpus, *BF16, "strategy.amp.loss_scaling=dynamic", "strategy.amp.init_scale=1024")
    assert "loss_scale" in eng.train_step(0)
    eng = engine(small_corpus, *BF16, "strategy.amp.grad_dtype=bfloat16")
    eng.sync.begin_step()
    b = eng.rows.read("train", 0, eng.slots[0].seed)
    eng.forward_backward(eng.slots[0], b, float(b.tokens.size))
    g = eng._reduced_grads()
    assert np.abs(g).max() > 0 and is_bf16(g)
    f16 = engine(small_corpus, "strategy.amp.enable=true", "model.dtype=float32")
    assert f16.scaler is not None                                       # float16 scales by default


def test_bf16_resume_is_bit_exact(small_corpus, tmp_path):
    a = engine(small_corpus, *BF16, "model.kind=llama", "model.n_kv_heads=2")
    want = [a.train_step(s)["loss"] for s in range(4)]
    b = engine(small_corpus, *BF16, "model.kind=llama", "model.n_kv_heads=2")
    got = [b.train_step(s)["loss"] for s in range(2)]
    save_state(b, tmp_path, 2, keep=1)
    from hpengine.checkpoint import shards as checkpoint
    c = engine(small_corpus, *BF16, "model.kind=llama", "model.n_kv_heads=2")
    c.load(checkpoint.Reader(tmp_path))
    got += [c.train_step(s)["loss"] for s in range(2, 4)]
    assert got == want
    pa, pc = a.named_params(), c.named_params()
    assert all(np.array_equal(pa[n], pc[n]) for n in pa)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_masters_start_from_the_unrounded_initial_values(small_corpus, dtype):
    """Under amp the float32 masters start bit for bit at the initial parameters of a run without amp (the
    exact values, before the compute copy is rounded to bfloat16 or held in float16)."""
    f32 = engine(small_corpus, *KINDS["llama"], "model.dtype=float32")
    amp = engine(small_corpus, *KINDS["llama"], "strategy.amp.enable=true", f"strategy.amp.dtype={dtype}",
                 "model.dtype=float32")
    want = np.asarray(f32.sync.owned_params())
    assert amp.master.dtype == np.float32 and amp.master.shape == want.shape
    assert np.array_equal(amp.master.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(np.asarray(amp.sync.owned_params(), dtype=np.float32), want)     # rounded
