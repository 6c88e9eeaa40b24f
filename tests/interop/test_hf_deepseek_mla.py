"""Multi-head latent attention (hpengine/nn/mla.py) against Hugging Face's DeepseekV3Attention on the same weights,
with and without the low-rank query, default rope and YaRN, packed documents with restarting positions: float64
outputs agree to 1e-10 (modeling_deepseek_v3's and modeling_rope_utils' float32 read as float64). YaRN's inverse
frequencies and attention factor against _compute_yarn_parameters, as shipped (float32) and in float64.

Needs the `hf` extra (torch, transformers >= 5 with DeepseekV3); skipped without them.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from transformers import DeepseekV3Config, modeling_rope_utils  # noqa: E402

from hf_oracle import exact  # noqa: E402
from hpengine.nn.mla import MLADims, mla_forward  # noqa: E402
from hpengine.nn.rope import YaRN, rope_tables  # noqa: E402

B, T, C, H, THETA = 2, 7, 10, 3, 300.0
YARN = {"rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": 4, "beta_fast": 4.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.3}


def config(q_lora_rank, yarn):
    rope = {"rope_theta": THETA, **(YARN if yarn else {"rope_type": "default"})}
    return DeepseekV3Config(hidden_size=C, num_attention_heads=H, num_key_value_heads=H,
                            q_lora_rank=q_lora_rank or None, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=8,
                            v_head_dim=5, rms_norm_eps=1e-6, max_position_embeddings=32, rope_parameters=rope,
                            attention_bias=False, attn_implementation="eager")


def ours(yarn) -> YaRN | None:
    return YaRN(**{k: v for k, v in YARN.items() if k != "rope_type"}) if yarn else None


def hf_weights(att, W):
    """Our (in, out) weights into the HF module (its `weight` is (out, in))."""
    names = {"q.w": "q_proj", "q_a.w": "q_a_proj", "q_a_norm.w": "q_a_layernorm", "q_b.w": "q_b_proj",
             "kv_a.w": "kv_a_proj_with_mqa", "kv_a_norm.w": "kv_a_layernorm", "kv_b.w": "kv_b_proj", "o.w": "o_proj"}
    with torch.no_grad():
        for n, a in W.items():
            getattr(att, names[n]).weight.copy_(torch.from_numpy(a.T.copy() if a.ndim == 2 else a))


@pytest.mark.parametrize("q_lora_rank", [5, 0])
@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_mla_equals_deepseek_v3_attention(q_lora_rank, yarn, documents):
    cfg = config(q_lora_rank, yarn)
    y_ = ours(yarn)
    d = MLADims(n_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=8,
                v_head_dim=5, eps=1e-6, mscale=y_.softmax_mscale() if yarn else 1.0)
    r = np.random.default_rng(7)
    W = {n: r.standard_normal(s) * (1.0 if n.endswith("norm.w") else 0.7) for n, s in d.weight_shapes(C).items()}
    x = r.standard_normal((B, T, C))
    if documents:
        seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]])
        pos = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    else:
        seg, pos = None, np.broadcast_to(np.arange(T), (B, T))
    allowed = (pos[:, :, None] >= 0) & (np.arange(T)[None, :, None] >= np.arange(T)[None, None, :])
    if seg is not None:
        allowed &= seg[:, :, None] == seg[:, None, :]
    mask = torch.from_numpy(np.where(allowed, 0.0, -np.inf)[:, None])

    def hf():
        att = deepseek.DeepseekV3Attention(cfg, 0).double()
        hf_weights(att, W)
        rot = deepseek.DeepseekV3RotaryEmbedding(cfg)
        xt = torch.from_numpy(x)
        with torch.no_grad():
            cos_sin = rot(xt, torch.from_numpy(np.ascontiguousarray(pos)))
            return att(xt, cos_sin, mask)[0].numpy(), cos_sin[0].numpy()

    want, hf_cos = exact(torch, hf, deepseek, modeling_rope_utils)
    cos, sin = rope_tables(np, 32, 8, THETA, np.float64, yarn=y_)
    np.testing.assert_allclose(np.concatenate([cos[pos]] * 2, axis=-1), hf_cos, rtol=1e-13, atol=1e-14)
    got, _ = mla_forward(np, x, W, d, cos[pos], sin[pos], segments=seg)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_yarn_parameters_equal_hugging_face():
    cfg = config(0, True)
    y_ = ours(True)
    inv32, af = modeling_rope_utils._compute_yarn_parameters(cfg)          # as shipped: float32
    np.testing.assert_allclose(y_.inv_freq(8, THETA), inv32.numpy(), rtol=1e-6)
    inv64, af64 = exact(torch, lambda: modeling_rope_utils._compute_yarn_parameters(cfg), modeling_rope_utils)
    assert inv64.dtype == torch.float64
    np.testing.assert_allclose(y_.inv_freq(8, THETA), inv64.numpy(), rtol=1e-14)
    assert y_.attention_factor() == pytest.approx(af, rel=1e-15) == pytest.approx(af64, rel=1e-15)
    att = deepseek.DeepseekV3Attention(cfg, 0)
    assert MLADims(H, 0, 6, 4, 8, 5, mscale=y_.softmax_mscale()).scale == pytest.approx(att.scaling, rel=1e-15)
    assert y_.softmax_mscale() != 1.0 and af != 1.0
