"""benchmarks/bench_gemm_limit.py's recorder sees every GEMM of a step: the FLOPs it records equal the closed
form of the GPT's products (linear layers 6 x tokens x weights; attention's q k^T, p v and their four
backward products over the two causal blocks), and the replay's operands have the recorded layouts."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gemm_limit as bgl  # noqa: E402
from bench_core import warm_engine  # noqa: E402

B, T, D, L, H, V = 2, 16, 32, 2, 2, 256


def test_recorded_flops_are_the_closed_form_of_the_step():
    cfg, eng, toks, step = warm_engine([f"train.global_batch={B}", f"model.seq_len={T}", f"model.d_model={D}",
                                        f"model.n_layers={L}", f"model.n_heads={H}"], 0.0)
    assert toks == B * T and cfg.model.vocab_size == V and not cfg.model.tie_head
    rec = bgl.Recorder()
    with bgl.recording(rec, eng):
        eng.train_step(step)
    weights = L * 12 * D * D + D * V                      # qkv 3d², proj d², fc 4d², fc2 4d² per layer; the head
    hd = D // H
    blocks = (T // 2) * (T // 2) + (T // 2) * T           # query rows x keys of the two causal blocks
    want = 6 * toks * weights + L * 12 * B * H * hd * blocks
    assert rec.flops() == want
    plan = bgl.replay_plan(np, rec.calls)
    assert len(plan) == len(rec.calls)
    for (a, b, out, acc), (la, lb, lo, racc) in zip(plan, rec.calls):
        assert (a.shape, a.strides, b.shape, b.strides, acc) == (la[0], la[1], lb[0], lb[1], racc)
        assert (out is None) == (lo is None)
    assert bgl.replay(np, plan) > 0
