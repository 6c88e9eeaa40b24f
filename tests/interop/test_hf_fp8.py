"""`checkpoint.init_from = "hf:DIR"` from an fp8 folder written by torch: a LlamaForCausalLM (widths multiples of
128) whose linear weights are cast to torch.float8_e4m3fn per 128 x 128 block (scale = amax / 448), saved with
safetensors.torch beside their float32 `weight_scale_inv`. hpengine's import equals transformers' own
dequantisation (Fp8Dequantize, what from_pretrained applies on a machine without a GPU) rounded to float32 exactly,
and the model built from it gives transformers' logits (1e-10, float64 with modeling_llama's float32 read as float64).

Needs the `hf` extra (torch, transformers >= 5, safetensors); skipped without them. from_pretrained itself needs
accelerate for an fp8 folder; Fp8Dequantize is the function it calls.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from hf_oracle import exact, hpengine_logits, logits_of  # noqa: E402
from hpengine.checkpoint.hf_import import HFReader  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import build_model, hf_llama  # noqa: E402

V, C, F, L, H, T = 256, 256, 384, 2, 2, 8
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantise(w):
    """(float8 e4m3 tensor, float32 scales) of an (out, in) matrix whose sides are multiples of 128."""
    R, Cn = w.shape
    blocks = w.reshape(R // 128, 128, Cn // 128, 128)
    s = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(R, Cn)
    return q, s.to(torch.float32)


def test_fp8_import_equals_transformers_dequantisation(tmp_path):
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                       num_key_value_heads=1, max_position_embeddings=T, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
                       attn_implementation="eager")
    sd = {k: v.float() for k, v in LlamaForCausalLM(conf).state_dict().items()}
    tensors, dequant = {}, Fp8Dequantize(None)
    for k, v in sd.items():
        v = v + 0.1 * torch.randn_like(v)                      # no norm weight is 1
        if k.endswith("_proj.weight"):
            q, s = quantise(v)
            tensors[k], tensors[k + "_scale_inv"] = q, s
            sd[k] = dequant._dequantize_one(q, s, torch.float32)     # its product is float32 whatever it returns
        else:
            tensors[k] = sd[k] = v
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hc = {**conf.to_dict(), "architectures": ["LlamaForCausalLM"], "quantization_config": QUANT}
    (tmp_path / "config.json").write_text(json.dumps(hc))

    mcfg = load_config(None, ["model.kind='llama'", f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
                              "model.n_kv_heads=1", f"model.ffn_hidden={F}", f"model.seq_len={T}", "model.dtype=float64",
                              "model.rope_theta=500.0", "model.norm_eps=1e-5"]).model
    shapes = {sp.name: sp.global_shape for sp in build_model(mcfg).all_specs()}
    r = HFReader(tmp_path, mcfg, shapes)
    P = {n: r.read("param", n, tuple(slice(0, d) for d in s)) for n, s in shapes.items()}
    # hpengine's float64 product is exact (4 x 24 significant bits); transformers' is that rounded to float32, which
    # is also what a float32 run holds
    for n, (h, fn) in hf_llama.from_hf_map(mcfg).items():
        assert np.array_equal(P[n].astype(np.float32), fn(sd[h].numpy())), n
        np.testing.assert_allclose(P[n], fn(sd[h].numpy()), rtol=2.0 ** -24, atol=0)
    P = {n: a.astype(np.float32).astype(np.float64) for n, a in P.items()}
    assert not np.array_equal(P["h.0.attn.k.w"], tensors["model.layers.0.self_attn.k_proj.weight"].float().numpy().T)

    def hf_logits():                                           # built inside exact(): its rotary inv_freq too
        model = LlamaForCausalLM(conf).to(torch.float64).eval()
        model.load_state_dict({k: v.to(torch.float64) for k, v in sd.items()})
        return logits_of(torch, model, ids)

    ids = np.random.default_rng(0).integers(0, V, (2, T))
    want = exact(torch, hf_logits, modeling_llama)
    np.testing.assert_allclose(hpengine_logits(P, mcfg, ids), want, rtol=1e-10, atol=1e-10)
