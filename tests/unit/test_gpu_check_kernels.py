"""benchmarks/gpu_check_kernels.py's figures without a device: the documents part's ids (rising along a row, the
mean length asked), the muon part's matrices (the llama's Muon parameters by the formula of gpu_check_options.py)
and its FLOP count against matrix products counted by hand, and the rows of a failed or missing part."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the gpu_check modules import each other by name

import gpu_check_kernels as gk  # noqa: E402
import gpu_check_options as opts  # noqa: E402


def test_document_ids_rise_and_have_the_mean_length():
    B, _, T, _, mean = opts.DOC_SHAPE
    ids = gk.document_ids(np, 64, T, mean)
    assert ids.shape == (64, T) and (ids[:, 0] == 0).all() and (np.diff(ids, axis=1) >= 0).all()
    assert (np.diff(ids, axis=1) <= 1).all()                      # ids count documents: no gaps
    # a boundary follows a token with probability 1 / mean (geometric lengths): about T / mean of them a row
    # (the mean of the whole documents would be biased low: the cut last one is the likelier to be long)
    starts = ids[:, -1].mean()
    assert abs(starts - (T - 1) / mean) < 0.15 * T / mean, starts


def test_muon_matrices_are_the_llamas_and_their_flops():
    m = opts.MODELS["llama"]
    d, L, H, KV, F = (m[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"))
    shapes = gk.llama_matrices(m)
    hd = d // H
    assert len(shapes) == 7 * L
    assert sum(np.prod(s) for s in shapes) == L * (d * hd * (2 * H + 2 * KV) + 3 * d * F)
    # one step on a (2, 3) matrix: X X^T (2x3 @ 3x2), A A (2x2 @ 2x2), B X (2x2 @ 2x3), 2 FLOPs a multiply-add
    assert gk.ns_flops([(1, 3, 2)], steps=1) == 2 * (2 * 3 * 2 + 2 * 2 * 2 + 2 * 2 * 3)


def test_rows_of_a_missing_or_failed_part():
    shape = opts.SMOKE_DOC_SHAPE
    assert [r.status for r in gk.rows_documents(shape, None, False)] == ["FAIL"]
    bad = {"variants": {"float32": {"error": "boom"}, "bf16": {"not_available": "x"}}, "documents": 3}
    assert [r.status for r in gk.rows_documents(shape, bad, False)] == ["SKIP", "FAIL"]
    far = {"variants": {"float32": {"documents": {"fwd_bwd_ms": 1.0, "fwd_ms": 0.5}, "agreement": 1e-2,
                                    "causal": {"fwd_bwd_ms": 2.0, "fwd_ms": 1.0}, "speedup": 2.0}}, "documents": 3}
    assert gk.rows_documents(shape, far, True)[1].status == "FAIL"          # judged even in the smoke run
    assert [r.status for r in gk.rows_muon({"error": "timed out"}, False)] == ["FAIL"]
