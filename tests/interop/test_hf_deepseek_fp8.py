"""`checkpoint.init_from = "hf:DIR"` from an fp8 DeepSeek-V3 folder this test quantises itself: a DeepseekV3ForCausalLM
(widths over 128, so matrices span several blocks and edge blocks are smaller) saved with save_pretrained, every
attention and MLP matrix but the router cast to ml_dtypes.float8_e4m3fn per 128 x 128 block (scale = amax / 448,
stored as float32 weight_scale_inv), config.json given DeepSeek's quantization_config. Every imported weight equals
the test's own dequantisation (the e4m3 value times its block's scale, exact in float64), the router biases arrive,
and the model gives transformers' logits on the dequantised weights (1e-10, float64 with modeling_deepseek_v3's
float32 read as float64).

Needs the `hf` extra (torch, transformers >= 5 with DeepseekV3), safetensors and ml_dtypes; skipped without them.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
safetensors_torch = pytest.importorskip("safetensors.torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, modeling_rope_utils  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

from hf_oracle import exact, logits_of  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import LOCAL, build_model, hf_deepseek  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import restore  # noqa: E402

T, V, C, L, H, E, K, FE, FD = 8, 256, 144, 2, 2, 4, 2, 40, 160
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantise(w):
    """(e4m3 array, float32 scales, the float64 dequantisation) of an (out, in) matrix in 128 x 128 blocks."""
    R, Cn = w.shape
    nr, nc = -(-R // 128), -(-Cn // 128)
    s = np.array([[np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() / 448.0 for j in range(nc)]
                  for i in range(nr)], dtype=np.float32)
    full = np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[:R, :Cn]
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return q, s, q.astype(np.float64) * full


def quantised(name, a) -> bool:
    """DeepSeek's fp8 tensors: the attention's and MLPs' matrices (not the router, norms, embedding or head)."""
    return a.ndim == 2 and (".self_attn." in name or ".mlp." in name) and "layernorm" not in name \
        and not name.endswith("mlp.gate.weight")


def test_fp8_deepseek_import_equals_its_dequantisation(tmp_path, small_corpus):
    conf = DeepseekV3Config(vocab_size=V, hidden_size=C, intermediate_size=FD, moe_intermediate_size=FE,
                            num_hidden_layers=L, first_k_dense_replace=1, num_attention_heads=H, num_key_value_heads=H,
                            n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K, n_group=2, topk_group=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=136,
                            qk_nope_head_dim=64, qk_rope_head_dim=8, v_head_dim=72, rms_norm_eps=1e-6,
                            max_position_embeddings=T, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                            num_nextn_predict_layers=0, tie_word_embeddings=False, attn_implementation="eager",
                            experts_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(conf).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(E, dtype=torch.float64))
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    model.save_pretrained(plain)
    saved = {k: v.numpy() for k, v in safetensors_torch.load_file(str(plain / "model.safetensors")).items()}
    tensors, dequantised, blocks = {}, {}, 0
    for k, a in saved.items():
        if quantised(k, a):
            q, s, d = quantise(a)
            tensors[k] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[k + "_scale_inv"], dequantised[k] = torch.from_numpy(s), d
            blocks = max(blocks, s.size)
        else:
            tensors[k], dequantised[k] = torch.from_numpy(a), a
    assert blocks >= 4 and any(a.shape[0] % 128 for k, a in saved.items() if quantised(k, a))   # edge blocks
    fp8.mkdir()
    safetensors_torch.save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    hc = json.loads((plain / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**hc, "quantization_config": QUANT}))
    # transformers' side: the same folder with the dequantised weights in float64
    safetensors_torch.save_file({k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in dequantised.items()},
                                str(plain / "model.safetensors"), metadata={"format": "pt"})

    cfg = load_config(None, [
        "model.kind='deepseek'", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
        f"model.n_layers={L}", f"model.n_heads={H}", f"model.ffn_hidden={FD}", "model.rope_theta=500.0",
        "model.norm_eps=1e-6", "model.dtype='float64'", "runtime.backend='numpy'", "train.global_batch=2",
        "model.mla.q_lora_rank=0", "model.mla.kv_lora_rank=136", "model.mla.qk_nope_head_dim=64",
        "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=72", f"model.moe.num_experts={E}", f"model.moe.top_k={K}",
        f"model.moe.expert_hidden={FE}", f"model.moe.shared_hidden={FE}", "model.moe.dense_layers=1",
        "model.moe.router='sigmoid'", "model.moe.n_groups=2", "model.moe.topk_groups=1", "model.moe.routed_scaling=2.5",
        f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'run'}", f"checkpoint.init_from=hf:{fp8}"])
    eng = build(cfg)
    restore(eng, cfg, None)
    P = eng.named_params()
    for n, (hf, fn) in hf_deepseek.from_hf_map(cfg.model).items():
        want = fn([dequantised[h] for h in hf]) if isinstance(hf, tuple) else fn(dequantised[hf])
        assert np.array_equal(P[n], want), n
    assert not np.array_equal(P["h.0.attn.kv_b.w"], saved["model.layers.0.self_attn.kv_b_proj.weight"].T)
    bias = eng.router_bias.bias[0]
    assert np.array_equal(bias[1], saved["model.layers.1.mlp.gate.e_score_correction_bias"]) and not bias[0].any()

    m = build_model(cfg.model)
    m.moe.set_bias(np, bias)
    ids = np.random.default_rng(2).integers(0, V, (2, T))
    x, _ = m.embed_forward(np, P, ids, LOCAL)
    for i in range(L):
        x, _ = m.layer_forward(np, P, i, x, LOCAL)
    ours = m.head_logits(np, P, x)
    want = exact(torch, lambda: logits_of(torch, DeepseekV3ForCausalLM.from_pretrained(
        plain, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval(), ids),
        modeling_deepseek_v3, modeling_rope_utils)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-10)
