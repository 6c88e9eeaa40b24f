"""The deepseek kind's Hugging Face folders without torch: `hpengine ckpt export --format hf` of a tiny MoE run with
multi-token prediction and trained router biases, and checkpoint.init_from = "hf:DIR" of it, restore every parameter
(the MTP modules' included) and the router biases exactly; what such a folder or run cannot be is refused in one
line (a changed MTP copy, a nonzero MTP router bias, a config.json that differs from [model], another model_type, a
softmax router on export). Against transformers: tests/interop/test_hf_deepseek_both_ways.py."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

from hpengine.checkpoint import CheckpointError  # noqa: E402
from hpengine.checkpoint.export import read_params  # noqa: E402
from hpengine.cli.commands import main  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models.moe_bias import saved_bias  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import restore  # noqa: E402

L = 2
MODEL = ["model.kind='deepseek'", "model.seq_len=16", "model.d_model=16", f"model.n_layers={L}", "model.n_heads=2",
         "model.vocab_size=256", "model.ffn_hidden=20", "model.dtype='float64'", "runtime.backend='numpy'",
         "train.global_batch=2", "model.mla.q_lora_rank=6", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=4",
         "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=4", "model.moe.num_experts=4", "model.moe.top_k=2",
         "model.moe.expert_hidden=6", "model.moe.shared_hidden=6", "model.moe.dense_layers=1",
         "model.moe.router='sigmoid'", "model.moe.bias_update_rate=0.01", "model.mtp.depth=1"]
MTP_EMBED = f"model.layers.{L}.embed_tokens.weight"
MTP_BIAS = f"model.layers.{L}.mlp.gate.e_score_correction_bias"


def sets(items):
    return [a for it in items for a in ("--set", it)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, small_corpus):
    """(run folder, hf export folder) of a 3-step run (router biases moved by 3 updates)."""
    root = tmp_path_factory.mktemp("ds")
    run, hf = root / "run", root / "hf"
    assert main(["train", *sets([*MODEL, "train.steps=3", "checkpoint.every=3", "optim.lr=1e-2", "train.log_every=1000",
                                 f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    return run, hf


def start_from(folder, tmp_path, corpus, *extra):
    cfg = load_config(None, [*MODEL, *extra, f"data.path={corpus}", f"train.out_dir={tmp_path / 'again'}",
                             f"checkpoint.init_from=hf:{folder}"])
    eng = build(cfg)
    restore(eng, cfg, None)
    return eng


def edited(src, dst, tensors=None, config=None):
    """A copy of export folder src at dst with some tensors and config.json fields replaced."""
    shutil.copytree(src, dst)
    if tensors:
        st = load_file(str(dst / "model.safetensors"))
        save_file({**st, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        hc = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**hc, **config}))
    return dst


def test_export_then_import_restores_parameters_and_router_biases(exported, tmp_path, small_corpus):
    run, hf = exported
    r, P = read_params(run / "checkpoints")
    bias = saved_bias(r.manifest["state"])
    assert bias is not None and bias[1].any() and not bias[0].any()          # layer 0 dense; layer 1's trained
    hc = json.loads((hf / "config.json").read_text())
    assert hc["architectures"] == ["DeepseekV3ForCausalLM"] and hc["num_nextn_predict_layers"] == 1
    st = load_file(str(hf / "model.safetensors"))
    assert np.array_equal(st["model.layers.1.mlp.gate.e_score_correction_bias"], bias[1])
    assert np.array_equal(st[MTP_EMBED], P["wte"]) and not st[MTP_BIAS].any()
    eng = start_from(hf, tmp_path, small_corpus)
    got = eng.named_params()
    assert sorted(got) == sorted(P) and any(n.startswith("mtp.0.moe.") for n in P)
    for n in P:
        assert np.array_equal(got[n], P[n]), n
    assert np.array_equal(eng.router_bias.bias[0], bias)


def test_a_folder_with_mtp_layers_starts_a_run_without_them(exported, tmp_path, small_corpus):
    eng = start_from(exported[1], tmp_path, small_corpus, "model.mtp.depth=0")
    assert not any(n.startswith("mtp.") for n in eng.named_params())


def test_kimi_k2_model_type_is_read(exported, tmp_path, small_corpus):
    folder = edited(exported[1], tmp_path / "kimi", config={"model_type": "kimi_k2"})
    assert start_from(folder, tmp_path, small_corpus).router_bias.bias[0].any()


def refused(folder, tmp_path, corpus, *extra) -> str:
    with pytest.raises(CheckpointError) as exc:
        start_from(folder, tmp_path, corpus, *extra)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_a_changed_mtp_copy_is_refused(exported, tmp_path, small_corpus):
    st = load_file(str(exported[1] / "model.safetensors"))
    folder = edited(exported[1], tmp_path / "bad", {MTP_EMBED: st[MTP_EMBED] + 1e-3})
    msg = refused(folder, tmp_path, small_corpus)
    assert f"tensor {MTP_EMBED} differs from model.embed_tokens.weight (hpengine wte)" in msg


def test_a_nonzero_mtp_router_bias_is_refused(exported, tmp_path, small_corpus):
    folder = edited(exported[1], tmp_path / "bias", {MTP_BIAS: np.full(4, 0.5)})
    msg = refused(folder, tmp_path, small_corpus)
    assert MTP_BIAS in msg and "set model.mtp.depth = 0" in msg
    start_from(folder, tmp_path, small_corpus, "model.mtp.depth=0")             # without the MTP modules it loads


@pytest.mark.parametrize("extra, config, message", [
    (["model.mla.kv_lora_rank=6"], {}, "has kv_lora_rank = 8 but model.mla.kv_lora_rank = 6"),
    (["model.moe.n_groups=2", "model.moe.topk_groups=1"], {}, "has n_group = 1 but model.moe.n_groups = 2"),
    (["model.moe.shared_hidden=0"], {}, "has n_shared_experts x moe_intermediate_size = 6 but model.moe.shared_hidden = 0"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=8"], {},
     "has rope_parameters.rope_type = 'none' but model.rope_scaling.type = 'yarn'"),
    ([], {"num_nextn_predict_layers": 0}, "has num_nextn_predict_layers = 0 but model.mtp.depth = 1"),
    ([], {"model_type": "qwen2"}, "has model_type 'qwen2'; a DeepseekV3ForCausalLM folder is 'deepseek_v3'"),
    ([], {"scoring_func": "softmax"}, "has scoring_func 'softmax'; hpengine's deepseek kind runs only 'sigmoid'"),
])
def test_config_mismatch_is_one_line(exported, tmp_path, small_corpus, extra, config, message):
    folder = edited(exported[1], tmp_path / "cfg", config=config) if config else exported[1]
    assert message in refused(folder, tmp_path, small_corpus, *extra)


def test_export_refusals_name_the_key_and_each_kind_once(tmp_path, small_corpus, capsys):
    mlp = ["model.kind='mlp'", "model.seq_len=16", "model.d_model=16", "model.n_layers=1", "runtime.backend='numpy'",
           "train.global_batch=2"]
    for kind, keys, want in (("deepseek", [*MODEL, "model.moe.router='softmax'", "model.moe.bias_update_rate=0"],
                              "needs model.moe.router = 'sigmoid'"),
                             ("mlp", mlp, "supported kinds: gpt, llama, deepseek (use")):
        run = tmp_path / kind
        assert main(["train", *sets([*keys, "train.steps=1", "train.log_every=1000", f"data.path={small_corpus}",
                                     f"train.out_dir={run}"])]) == 0
        capsys.readouterr()
        assert main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / f"{kind}-hf"), "--format", "hf"]) != 0
        err = capsys.readouterr().err.strip()
        assert want in err and "\n" not in err, err
