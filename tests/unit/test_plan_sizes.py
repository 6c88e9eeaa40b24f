"""The closed-form sizes of MLA / routed-expert decoders (planner/sizes.py): a tiny shape counted by hand, the
deepseek-v3 and kimi-k2 presets (planner/presets.py, [model] tables of kind deepseek) against their published
totals and activated counts."""
from __future__ import annotations

from hpengine.planner.presets import model_config
from hpengine.planner.sizes import MLAShape

# vocabulary 10, width 4, 3 layers (the first dense), 2 heads; q_lora 3, kv_lora 2, nope 2, rope 1, v 3; dense
# MLP 5; 4 experts of 2, top 2, one shared; one MTP module
TINY = MLAShape(vocab=10, d_model=4, n_layers=3, dense_layers=1, n_heads=2, q_lora_rank=3, kv_lora_rank=2, qk_nope=2,
                qk_rope=1, v_head=3, ffn_hidden=5, expert_hidden=2, experts=4, shared=1, top_k=2, n_groups=2,
                topk_groups=1, mtp_depth=1)


def test_tiny_shape_by_hand():
    # attention: q_a 4x3 = 12, its norm 3, q_b 3 x 2(2+1) = 18, kv_a 4 x (2+1) = 12, its norm 2,
    # kv_b 2 x 2(2+3) = 20, o 2*3 x 4 = 24
    assert TINY.attention() == 12 + 3 + 18 + 12 + 2 + 20 + 24 == 91
    # dense layer: norms 8 + 91 + 3*4*5 = 159; routed: 8 + 91 + router 16 + (4 + 1) experts of 3*4*2 = 24
    assert TINY.layer(False) == 159 and TINY.layer(True) == 8 + 91 + 16 + 5 * 24 == 235
    # embedding 40 + 159 + 2 * 235 + final norm 4 + head 40
    assert TINY.params() == 713
    # a token: no embedding lookup; routed layers with 2 + 1 experts: 8 + 91 + 16 + 72 = 187
    assert TINY.layer(True, active=True) == 187 and TINY.activated() == 159 + 2 * 187 + 4 + 40 == 577
    # MTP: norms 8, projection 8 x 4 = 32, a routed layer 235, final norm 4; stored with embedding and head
    assert TINY.mtp_params() == 279 and TINY.mtp_params(stored=True) == 279 + 80
    # attention forward per token at T = 8: 2 * 8 * 2 heads * (2 + 1 + 3) = 192; training 6 * 577 + 3 * 3 * 192,
    # and the MTP module's 6 * (8 + 32 + 187 + 4 + 40) + 3 * 192
    assert TINY.attention_flops(8) == 192
    assert TINY.flops_per_token(8, mtp=False) == 3462 + 1728 == 5190
    assert TINY.flops_per_token(8) == 5190 + 6 * 271 + 576
    # decoding keeps kv_lora + rope = 3 per token and layer
    assert TINY.latent_cache(5) == 45


def test_without_q_compression():
    plain = MLAShape(**{**TINY.__dict__, "q_lora_rank": 0})
    assert plain.attention() == 91 - (12 + 3 + 18) + 4 * 2 * 3          # q: 4 x 2(2+1) = 24


# Published: DeepSeek-V3 "671B total, 37B activated" (rounded to whole billions: the count is 36.63B, 1.01 %
# below), 685B on Hugging Face with the MTP module (its "14B" is 685 - 671; the module counts 13.46B). Kimi K2
# "32B activated", "1T" on its model card and 1.04T in its report: the released config's shapes give 1.0264T.
def test_deepseek_v3_counts():
    s = MLAShape.of(model_config("deepseek-v3"))
    assert s.params() == 671_026_404_352            # = transformers' DeepseekV3ForCausalLM (tests/interop)
    assert abs(s.params() / 671e9 - 1) < 0.001
    assert abs((s.params() + s.mtp_params(stored=True)) / 685e9 - 1) < 0.001
    assert abs(s.activated() / 37e9 - 1) < 0.011 and round(s.activated() / 1e9) == 37


def test_kimi_k2_counts():
    s = MLAShape.of(model_config("kimi-k2"))
    assert s.params() == 1_026_408_209_408 and s.mtp_params() == 0
    assert abs(s.params() / 1.04e12 - 1) < 0.015
    assert abs(s.activated() / 32e9 - 1) < 0.01
