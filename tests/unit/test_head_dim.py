"""model.head_dim (llama kind): heads of their own width, independent of d_model / n_heads (Qwen3). The tensors
it declares, whole and per tp rank; the planner's parameter count and attention FLOPs; the engine's counted
caches equal the planner's prediction (standard and flash attention, selective recompute, q/k norms, MoE, amp);
0 is d_model / n_heads, the model as before."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.layout.stage import build_stage
from hpengine.models import build_model
from hpengine.planner.model import for_rank
from hpengine.planner.stages import stages
from hpengine.run.build import build

B, T, V, C, L, H, K, HD = 2, 8, 40, 16, 3, 4, 2, 6      # heads 6 wide at d_model 16 (not 16 / 4)
BASE = ["model.kind=llama", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
        f"model.n_layers={L}", f"model.n_heads={H}", f"model.n_kv_heads={K}", "model.ffn_hidden=24"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.dense_layers=1",
       "model.moe.aux_loss=0.05"]


def cfg_of(*extra, head_dim=HD):
    return load_config(None, [*BASE, f"model.head_dim={head_dim}", *extra])


def test_the_attention_tensors_follow_head_dim():
    m = build_model(cfg_of().model)
    shapes = {s.name: s.global_shape for s in m.specs("h.1")}
    assert (shapes["h.1.attn.q.w"], shapes["h.1.attn.k.w"], shapes["h.1.attn.v.w"], shapes["h.1.attn.o.w"]) == \
        ((C, H * HD), (C, K * HD), (C, K * HD), (H * HD, C))
    assert m.hd == HD and m.rope(np, np.float64)[0][0].shape == (T, HD // 2)
    qk = {s.name: s.global_shape for s in build_model(cfg_of("model.qk_norm=true").model).specs("h.0")}
    assert qk["h.0.attn.q_norm.w"] == qk["h.0.attn.k_norm.w"] == (HD,)


def test_zero_is_d_model_over_n_heads():
    same, plain = build_model(cfg_of(head_dim=C // H).model), build_model(load_config(None, BASE).model)
    assert plain.hd == C // H
    assert [(s.name, s.global_shape) for s in same.all_specs()] == [(s.name, s.global_shape) for s in plain.all_specs()]
    assert same.cache_bytes(B, 1, 8, False, B) == plain.cache_bytes(B, 1, 8, False, B)


def test_tensor_parallel_splits_whole_heads():
    cfg = cfg_of("train.global_batch=4", "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2")
    st = build_stage(cfg.model, resolve(cfg, 2), 0, 1)
    assert (st.layout.shapes["h.0.attn.q.w"], st.layout.shapes["h.0.attn.k.w"], st.layout.shapes["h.0.attn.o.w"]) == \
        ((C, H // 2 * HD), (C, K // 2 * HD), (H // 2 * HD, C))


def test_planner_counts_parameters_and_attention_flops():
    mc, plain = cfg_of().model, load_config(None, BASE).model
    per_layer = (2 * H * HD + 2 * K * HD) * C - (2 * H + 2 * K) * (C // H) * C
    assert stages(mc, 1, 1, 1)[0].psi - stages(plain, 1, 1, 1)[0].psi == L * per_layer
    assert stages(mc, 1, 1, 1)[0].psi == sum(int(np.prod(s.global_shape)) for s in build_model(mc).all_specs())
    assert build_model(mc).attention_flops(B * T, 1) == 4 * B * T * T * H * HD
    assert build_model(mc, 2).attention_flops(B * T, 2) == 4 * B * T * T * H * HD // 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("hd") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(3000) * 7 % V).astype(np.uint8)
    return path


@pytest.mark.parametrize("extra", [[], ["model.attention=flash"], ["model.qk_norm=true"],
                                   ["strategy.recompute.enable=true", "strategy.recompute.granularity=selective"],
                                   MOE, ["model.dtype=float32", "strategy.amp.enable=true"]],
                         ids=["standard", "flash", "qk_norm", "selective", "moe", "amp"])
def test_counted_bytes_equal_the_planner(corpus, extra):
    cfg = cfg_of("model.dtype=float64", f"train.global_batch={B}", "runtime.backend=numpy", f"data.path={corpus}",
                 *extra)
    eng = build(cfg, MPI.COMM_SELF)
    eng.train_step(0)
    got, want = eng.memory(), for_rank(cfg, 1, eng.mesh.coords)["memory"]
    assert (got["param_bytes"], got["grad_bytes"], got["optim_bytes"]) == \
        (want["params"], want["grads"], want["optimizer"])
    assert want["activations"] == got["activation_peak_bytes"]
