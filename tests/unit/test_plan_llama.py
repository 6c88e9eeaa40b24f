"""The planner on Llama models: the presets' parameter counts against Meta's published totals, the
FLOPs of a step against a hand-written closed form (grouped-query attention saves the key/value
projections only), the presets as valid configs of their kind, and `hpengine plan --model llama3-*`."""
from __future__ import annotations

import pytest

from hpengine.cli.commands import main
from hpengine.config.load import ModelConfig, kind_keys, load_config, validate
from hpengine.planner.search import with_preset
from hpengine.planner.model import flops_per_microbatch
from hpengine.planner.stages import stages
from hpengine.planner.presets import ALIASES, PRESETS
from hpengine.layout.resolve import resolve

# parameters of the released checkpoints (the Hugging Face safetensors totals)
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.2-1b": 1_235_814_400}


def preset(name: str):
    return with_preset(load_config(None), name)


# ---- presets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_is_published(name):
    assert stages(preset(name).model, 1, 1, 1)[0].psi == PUBLISHED[name]


def test_tensor_parallel_splits_all_but_the_norms():
    """Llama 3 8B on tp 8: every matrix splits eight ways (128256 is a multiple of 8), the 65 RMSNorm
    weights (two per layer and the final one, 4096 each) are replicated."""
    norms = (2 * 32 + 1) * 4096
    assert stages(preset("llama3-8b").model, 8, 1, 1)[0].psi == (PUBLISHED["llama3-8b"] - norms) // 8 + norms


@pytest.mark.parametrize("name", list(PRESETS) + list(ALIASES))
def test_every_preset_is_a_valid_config_of_its_kind(name):
    """Whatever kind the config had, a preset leaves the keys of other kinds at their defaults."""
    for base in ([], ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=512"],
                 ["model.kind=gpt", "model.ffn_mult=2"]):
        cfg = with_preset(load_config(None, base), name)
        validate(cfg)
        for key in kind_keys(cfg.model.kind):
            assert getattr(cfg.model, key) == getattr(ModelConfig(), key)


def test_gpt_presets_keep_their_shape():
    for name in ("gpt2-124m", "1.3b", "7b", "13b", "175b"):
        m = preset(name).model
        assert (m.kind, m.vocab_size, m.ffn_mult, m.tie_head, m.dtype) == ("gpt", 50257, 4, True, "float32")
    m, cfg = preset("7b").model, preset("7b")
    assert (m.seq_len, m.d_model, m.n_layers, m.n_heads, cfg.train.global_batch) == (2048, 4096, 32, 32, 1024)


def test_llama_presets_carry_their_keys():
    cfg = preset("llama3-70b")
    m = cfg.model
    assert (m.kind, m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden,
            m.rope_theta, m.norm_eps, m.tie_head) == ("llama", 128256, 8192, 8192, 80, 64, 8, 28672, 5e5, 1e-5, False)
    assert cfg.train.global_batch * m.seq_len == 4 * 2**20             # 4M tokens a step
    assert preset("llama3.2-1b").model.tie_head and not preset("llama3-8b").model.tie_head


# ---- FLOPs ------------------------------------------------------------------------------------------

D, H, HD, F, V, L, T, ROWS = 32, 4, 8, 48, 64, 2, 16, 2


def llama(kv: int, *extra):
    return load_config(None, ["model.kind=llama", f"model.d_model={D}", f"model.n_heads={H}", f"model.n_kv_heads={kv}",
                              f"model.ffn_hidden={F}", f"model.vocab_size={V}", f"model.n_layers={L}",
                              f"model.seq_len={T}", f"train.global_batch={ROWS}", *extra])


def step_flops(cfg, tp: int = 1) -> float:
    lay = resolve(cfg, tp)
    return flops_per_microbatch(cfg.model, stages(cfg.model, tp, 1, 1)[0], lay)


def closed_form(kv: int) -> int:
    """6 x tokens x matmul weights (q, k, v, o and the three SwiGLU matrices per layer, the head), plus
    the scores and the values-weighted sum over the full T x T, forward 4 x tokens x T x H x hd a layer,
    three times that forward and backward."""
    tokens = ROWS * T
    layer = D * H * HD + 2 * D * kv * HD + H * HD * D + 3 * D * F
    return 6 * tokens * (L * layer + D * V) + 3 * L * (4 * tokens * T * H * HD)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_flops_closed_form(kv, tied):
    assert step_flops(llama(kv, f"model.tie_head={str(tied).lower()}")) == closed_form(kv)


def test_flops_closed_form_with_head_dim():
    """Heads 12 wide at d_model 32 (model.head_dim): the projections and the attention follow H x hd."""
    tokens, hd = ROWS * T, 12
    layer = D * H * hd + 2 * D * 2 * hd + H * hd * D + 3 * D * F
    want = 6 * tokens * (L * layer + D * V) + 3 * L * (4 * tokens * T * H * hd)
    assert step_flops(llama(2, f"model.head_dim={hd}")) == want


def test_grouped_query_attention_saves_key_value_projections_only():
    tokens = ROWS * T
    for kv in (1, 2):
        assert step_flops(llama(H)) - step_flops(llama(kv)) == 6 * tokens * 2 * D * (H - kv) * HD * L
    assert step_flops(llama(0)) == step_flops(llama(H))               # 0 = as many as the query heads


def test_flops_split_by_tensor_parallel_and_recompute_adds_a_forward():
    assert step_flops(llama(2, "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"),
                      2) == closed_form(2) / 2
    tokens = ROWS * T
    layer = D * H * HD + 2 * D * 2 * HD + H * HD * D + 3 * D * F
    again = L * (2 * tokens * layer + 4 * tokens * T * H * HD)
    assert step_flops(llama(2, "strategy.recompute.enable=true")) == closed_form(2) + again


# ---- command line -----------------------------------------------------------------------------------

def test_cli_plans_llama3_8b_on_64_devices(capsys):
    assert main(["plan", "--model", "llama3-8b", "--nodes", "8", "--gpus-per-node", "8", "--mem-gb", "80",
                 "--max-micro-batch", "1", "--top", "5", "--wide"]) == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert text.startswith("cluster: ") and "8 x 8 devices of 80 GB" in flat
    assert "hpengine plan: llama 8.03B parameters (d_model 4096, 32 layers, seq 8192" in flat
    assert "global batch 512, on 64 devices" in flat
    head = next(ln for ln in text.splitlines() if ln.lstrip().startswith("#"))
    rows = [ln for ln in text.splitlines() if ln[:3].strip().isdigit()]
    assert len(rows) == 5 and "total GB" in head
    for row in rows:
        lay, mem = row.split("|")[:2]
        tp, cp, pp, dp, ep, sh = map(int, lay.split()[1:7])
        assert ep == 1                                          # a dense model has no experts to split
        assert tp * cp * pp * dp * sh == 64 and 8 % tp == 0          # tp within a node, dividing the 8 kv heads
        assert 0 < float(mem.split()[-1]) <= 80


def test_cli_llama3_70b_does_not_fit_one_node(capsys):
    """16 bytes a parameter under amp (16-bit weights and gradients, float32 master and Adam moments)
    make 1.13 TB of model states, more than 8 x 80 GB, whatever the layout."""
    assert main(["plan", "--model", "llama3-70b", "--nodes", "1", "--gpus-per-node", "8", "--mem-gb", "80",
                 "--max-micro-batch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no layout fits: the smallest needs" in err
    smallest = float(err.split("needs ")[1].split(" GB")[0])
    assert smallest >= 16 * PUBLISHED["llama3-70b"] / 8 / 1e9 > 80
