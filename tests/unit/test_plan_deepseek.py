"""The deepseek-v3 and kimi-k2 presets planned as [model] tables of kind deepseek: `hpengine plan --model NAME`
proposes layouts, prints the parameter counts (with and without MTP, activated, the latent cache per token) and
writes a config that loads back as the preset; the planner's FLOPs per token of a tiny deepseek model with MTP,
counted by hand, equal planner/sizes.MLAShape's formula less its element-wise norm weights."""
from __future__ import annotations

import re

import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.planner.model import flops_per_microbatch, stage_facts
from hpengine.planner.presets import PRESETS, model_config
from hpengine.planner.sizes import MLAShape

# a small cluster of large devices keeps the search short: 32 devices, batch 32, one sequence a micro-batch
SMALL = ["--nodes", "4", "--gpus-per-node", "8", "--global-batch", "32", "--max-micro-batch", "1", "--top", "3"]
# (preset, --mem-gb, the header's figures): 683B with the MTP module's 11.6B, 671B without, 36.63B activated;
# decoding keeps 61 layers x (kv_lora 512 + rope 64) = 35,136 elements a token
WANT = {"deepseek-v3": ("640", ["deepseek 683B parameters", "671B without the 1 multi-token prediction module(s)",
                                "36.63B activated per token", "decoding caches 35,136 elements per token"]),
        "kimi-k2": ("960", ["deepseek 1.03T parameters", "31.69B activated per token",
                            "decoding caches 35,136 elements per token"])}


@pytest.mark.parametrize("name", list(WANT))
def test_plan_proposes_layouts_and_prints_the_counts(name, tmp_path, capsys):
    mem, lines = WANT[name]
    out = tmp_path / "plan.toml"
    assert main(["plan", "--model", name, "--mem-gb", mem, *SMALL, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    for line in lines:
        assert line in flat, line
    rows = [ln for ln in text.splitlines() if re.match(r"^\s*\d+\s+\d+\s+\d+", ln)]
    assert len(rows) == 3
    written = load_config(str(out))
    assert written.model == model_config(name) and written.train.global_batch == 32
    assert resolve(written, 32).world == 32


def test_presets_are_deepseek_configs_counted_by_mla_shape():
    for name, depth in (("deepseek-v3", 1), ("kimi-k2", 0)):
        m = model_config(name)
        assert PRESETS[name].model["kind"] == m.kind == "deepseek"
        assert MLAShape.of(m).mtp_depth == m.mtp.depth == depth


# vocabulary 32, width 8, 3 layers (the first dense), 2 heads; q_lora 4, kv_lora 6, nope 4, rope 2, v 3; dense SwiGLU
# 12; 4 experts of 4, top 2, one shared of 4; one MTP module; 8 tokens a sequence
TINY = ["model.kind=deepseek", "model.vocab_size=32", "model.d_model=8", "model.n_layers=3", "model.n_heads=2",
        "model.seq_len=8", "model.ffn_hidden=12", "model.mla.q_lora_rank=4", "model.mla.kv_lora_rank=6",
        "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=2", "model.mla.v_head_dim=3",
        "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=4", "model.moe.shared_hidden=4",
        "model.moe.dense_layers=1", "model.moe.router=sigmoid", "model.moe.n_groups=2", "model.moe.topk_groups=1",
        "model.mtp.depth=1", "train.global_batch=2"]


def test_flops_per_token_by_hand_equal_mla_shape():
    # matmul weights a token meets: attention q_a 8x4 = 32, q_b 4 x 2(4+2) = 48, kv_a 8 x (6+2) = 64,
    # kv_b 6 x 2(4+3) = 84, o 2*3 x 8 = 48: 276; dense MLP 3 x 8 x 12 = 288; a routed layer's router 8 x 4 = 32 and
    # (top 2 + 1 shared) x 3 x 8 x 4 = 288; the head 8 x 32 = 256; the MTP module's projection 16 x 8 = 128, its
    # routed block 276 + 320 and the head again 256
    main_model = (276 + 288) + 2 * (276 + 32 + 288) + 256
    mtp = 128 + 276 + 32 + 288 + 256
    # attention forward per layer and token: 2 T H (nope + rope + v) = 2 x 8 x 2 x 9 = 288, x 3 for training, over
    # the 3 layers and the MTP block
    hand = 6 * (main_model + mtp) + 3 * 288 * 4
    assert hand == 21408
    cfg = load_config(None, TINY)
    lay = resolve(cfg, 1)
    st = stage_facts(cfg, lay)[0]
    tokens = lay.rows * cfg.model.seq_len
    assert flops_per_microbatch(cfg.model, st, lay) == hand * tokens
    # MLAShape counts the norm weights too: per layer two of d_model, q_lora's and kv_lora's (8 + 8 + 4 + 6), the
    # final norm (8); the module's two input norms, its block's four and its final norm (8 + 8 + 26 + 8)
    norms = 3 * 26 + 8 + 50
    assert MLAShape.of(cfg.model).flops_per_token(8) == hand + 6 * norms
