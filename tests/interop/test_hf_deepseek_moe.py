"""hpengine's MoE block against transformers' DeepseekV3MoE on the same weights: sigmoid router with the score
correction bias, group-limited selection (8 experts in 4 groups, the 2 best groups open), top 2 renormalised,
routed scaling 2.5 and one shared expert. In float64 (modeling_deepseek_v3's float32 router read as float64)
the outputs agree to 1e-12, and the groups change the routing of some token.

Needs the `hf` extra (torch, transformers >= 5); skipped without them.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

from hf_oracle import exact  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import LOCAL, build_model  # noqa: E402
from hpengine.nn.moe import router_forward  # noqa: E402

B, T, C, E, K, F, G, TG, SCALE = 2, 8, 16, 8, 2, 6, 4, 2, 2.5


def engine_moe():
    mcfg = load_config(None, ["model.kind=llama", f"model.d_model={C}", "model.n_heads=4", "model.n_layers=2",
                              f"model.seq_len={T}", "model.dtype=float64", f"model.moe.num_experts={E}",
                              f"model.moe.top_k={K}", f"model.moe.expert_hidden={F}", f"model.moe.shared_hidden={F}",
                              "model.moe.router=sigmoid", f"model.moe.n_groups={G}", f"model.moe.topk_groups={TG}",
                              f"model.moe.routed_scaling={SCALE}", "model.moe.bias_update_rate=0.001"]).model
    return build_model(mcfg).moe


def weights(r):
    p = "h.1.moe."
    return {p + "router.w": r.standard_normal((C, E)) / 2, p + "experts.gate.w": r.standard_normal((E, C, F)) / 4,
            p + "experts.up.w": r.standard_normal((E, C, F)) / 4, p + "experts.down.w": r.standard_normal((E, F, C)) / 3,
            p + "shared.gate.w": r.standard_normal((C, F)) / 4, p + "shared.up.w": r.standard_normal((C, F)) / 4,
            p + "shared.down.w": r.standard_normal((F, C)) / 3}


def hf_moe(P, bias):
    cfg = DeepseekV3Config(hidden_size=C, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
                           n_group=G, topk_group=TG, norm_topk_prob=True, routed_scaling_factor=SCALE,
                           n_shared_experts=1, hidden_act="silu", experts_implementation="eager")
    moe = modeling_deepseek_v3.DeepseekV3MoE(cfg).double()
    t, p = (lambda a: torch.from_numpy(np.ascontiguousarray(a))), "h.1.moe."
    with torch.no_grad():
        moe.gate.weight.copy_(t(P[p + "router.w"].T))
        moe.gate.e_score_correction_bias.copy_(t(bias))
        gate_up = np.concatenate([P[p + "experts.gate.w"], P[p + "experts.up.w"]], axis=2)     # (E, C, 2F)
        moe.experts.gate_up_proj.copy_(t(gate_up.transpose(0, 2, 1)))
        moe.experts.down_proj.copy_(t(P[p + "experts.down.w"].transpose(0, 2, 1)))
        for name in ("gate", "up", "down"):
            getattr(moe.shared_experts, f"{name}_proj").weight.copy_(t(P[p + f"shared.{name}.w"].T))
    return moe


def test_moe_block_equals_deepseek_v3_moe():
    r = np.random.default_rng(7)
    P, bias, h = weights(r), r.uniform(-0.05, 0.05, E), r.standard_normal((B, T, C))
    ours = engine_moe()
    ours.set_bias(np, np.stack([np.zeros(E), bias]))
    y = ours.forward(np, P, "h.1", h, LOCAL)[0]
    moe = hf_moe(P, bias)
    with torch.no_grad():
        want = exact(torch, lambda: moe(torch.from_numpy(h)), modeling_deepseek_v3).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    # the groups matter here: without them some token routes elsewhere
    x2, w = h.reshape(-1, C), P["h.1.moe.router.w"]
    grouped = router_forward(np, x2, w, K, T, 1, "sigmoid", True, bias, None, G, TG)[0]
    assert (grouped != router_forward(np, x2, w, K, T, 1, "sigmoid", True, bias)[0]).any()
