"""bf16 amp for the deepseek kind (standard and flash attention): MLA's matrices are GEMM weights, handed to the
layers as bfloat16 bits under packed storage, and a packed run trains bit for bit like float32 storage, with the
planner's peak; against the float32 run, losses within bfloat16's unit roundoff and the whole update within 5 %."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from test_bf16_storage import TINY, engine, train

from hpengine.config.load import load_config
from hpengine.models import build_model
from hpengine.planner.model import for_rank
from hpengine.run.build import build
from hpengine.strategies.bf16_storage import UnpackedParams

DS = ["model.kind=deepseek", "model.ffn_hidden=48", "model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=16",
      "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6"]
KINDS = {"deepseek": DS, "deepseek_flash": DS + ["model.attention=flash"],
         "deepseek_plain_q": [s for s in DS if "q_lora" not in s]}
MLA = ("q.w", "q_a.w", "q_b.w", "kv_a.w", "kv_b.w", "o.w")


def test_mla_matrices_are_gemm_weights(small_corpus):
    for kind in ("deepseek", "deepseek_plain_q"):
        m = build_model(load_config(None, [*KINDS[kind], f"data.path={small_corpus}"]).model, 1)
        names = [sp.name for sp in m.all_specs()]
        mats = [n for n in names if ".attn." in n and n.rsplit(".attn.", 1)[1] in MLA]
        assert len(mats) == m.L * (5 if kind == "deepseek" else 4)
        assert all(m.gemm_weight(n) for n in mats)
        assert not any(m.gemm_weight(n) for n in names if n.endswith("norm.w"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_deepseek_equals_float32_storage(small_corpus, kind):
    f32 = engine(small_corpus, *KINDS[kind], "strategy.amp.bf16_storage=float32")
    packed = engine(small_corpus, *KINDS[kind], "strategy.amp.bf16_storage=packed")
    assert packed.precision.packed and packed.sync.params.data.dtype == np.uint16
    # the layers get MLA's matrices as the bits themselves, the norms' weights as float32 values
    slot = packed.slots[0]
    specs = packed.stage.block_specs[slot.prefix + "h.0"]
    P = packed.precision.layer_params(np, packed.sync.params, slot.model.gemm_weight, specs)
    assert isinstance(P, UnpackedParams)
    assert P["h.0.attn.kv_b.w"].dtype == np.uint16 and P["h.0.attn.o.w"].dtype == np.uint16
    assert P["h.0.attn.kv_a_norm.w"].dtype == np.float32
    (la, pa), (lb, pb) = train(f32), train(packed)
    assert la == lb
    assert all(np.array_equal(pa[n], pb[n]) for n in pa)
    pred = for_rank(packed.cfg, 1, packed.mesh.coords)["memory"]
    assert (packed.cache_peak, packed.memory()["param_bytes"]) == (pred["activations"], pred["params"])


def _update_flat(d, names):
    return np.concatenate([np.ravel(d[n]) for n in names])


# bfloat16 keeps 8 significant bits: unit roundoff 2^-8 (3.9e-3). The loss is a mean over every token of a batch,
# each term from GEMMs with rounded operands and float32 sums, so its relative error stays well inside one unit
# roundoff (measured ~1e-4 over five steps); the update is compared for the whole model at the 5 % that
# tests/mpi/test_combinations.py uses for amp, since Adam normalises near-zero gradients element by element.
@pytest.mark.parametrize("kind", ["deepseek", "deepseek_flash"])
def test_bf16_amp_trains_like_float32(small_corpus, kind):
    f32 = build(load_config(None, [*TINY, f"data.path={small_corpus}", *KINDS[kind]]), MPI.COMM_SELF)
    bf16 = engine(small_corpus, *KINDS[kind])
    assert f32.cfg.model.dtype == "float32" and not f32.res.amp and bf16.res.amp
    p0 = f32.named_params()
    (lf, pf), (lb, pb) = train(f32, 5), train(bf16, 5)
    lf, lb = np.array(lf), np.array(lb)
    assert np.all(np.abs(lb - lf) <= 2 ** -8 * np.abs(lf)), np.abs(lb - lf) / lf
    assert not np.array_equal(lb, lf)                   # bfloat16 products did run
    names = sorted(pf)
    upd = _update_flat(pf, names) - _update_flat(p0, names)
    assert np.linalg.norm(_update_flat(pb, names) - _update_flat(pf, names)) < 0.05 * np.linalg.norm(upd)
