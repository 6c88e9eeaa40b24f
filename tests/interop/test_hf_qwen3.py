"""The llama kind with q/k norms (model.qk_norm) against Hugging Face's Qwen3MoeForCausalLM (routed experts, the
first layer dense) and Qwen3ForCausalLM (dense), both ways; each with heads hidden_size / heads wide and with
model.head_dim set to another width (as real Qwen3 checkpoints: head_dim 128 at every hidden size).

Export: a tiny float64 run trains 2 steps, `hpengine ckpt export --format hf` writes the folder (per-expert
gate_proj / up_proj / down_proj tensors, as transformers' save_pretrained writes them), and transformers loads it
with nothing missing or unexpected: its logits equal hpengine's forward to 1e-5 as shipped (the router softmax,
RMSNorm statistics and rotary angles in float32) and to 1e-10 with modeling_qwen3(_moe)'s float32 read as
float64; greedy decoding gives the same tokens. Import: a randomly initialised (and perturbed, so no norm weight
is 1) model saved with save_pretrained starts a run through checkpoint.init_from = "hf:DIR" with transformers'
logits. What the classes cannot hold is refused in one line: a shared expert or a sigmoid router on export;
on import a dense-layer pattern other than the first layers, a run without q/k norms, a head width other than
the run's, and a Qwen2-MoE folder (its shared expert's sigmoid gate).

Needs the `hf` extra (torch, transformers >= 5) and safetensors; skipped without them.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("safetensors")

from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from hf_oracle import exact as oracle_exact, hpengine_logits, logits_of as oracle_logits, sets  # noqa: E402
from hpengine.apps.generate import generate
from hpengine.checkpoint.shards import CheckpointError
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import restore

T, V, C, L, H, KV, E, K, F, FD = 16, 256, 16, 3, 4, 2, 4, 2, 12, 24
BASE = [f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
        f"model.vocab_size={V}", "model.kind='llama'", f"model.n_kv_heads={KV}", "model.rope_theta=500.0",
        f"model.ffn_hidden={FD}", "model.qk_norm=true", "model.dtype='float64'", "runtime.backend='numpy'",
        "train.global_batch=4"]
MOE = [f"model.moe.num_experts={E}", f"model.moe.top_k={K}", f"model.moe.expert_hidden={F}",
       "model.moe.dense_layers=1", "model.moe.norm_topk=false", "model.moe.aux_loss=0.01"]
HD = 8           # head_dim != hidden_size / heads = 4, as real Qwen3 checkpoints have (128 at every width)
CASES = {"moe": ("Qwen3MoeForCausalLM", BASE + MOE), "dense": ("Qwen3ForCausalLM", BASE),
         "moe_head_dim": ("Qwen3MoeForCausalLM", BASE + MOE + [f"model.head_dim={HD}"]),
         "dense_head_dim": ("Qwen3ForCausalLM", BASE + [f"model.head_dim={HD}"])}


def head_dim_of(case):
    return HD if case.endswith("_head_dim") else C // H


def exact(fn):
    return oracle_exact(torch, fn, modeling_qwen3, modeling_qwen3_moe)


def logits_of(model, ids):
    return oracle_logits(torch, model, ids)


def engine_from(folder, model, tmp_path, corpus):
    cfg = load_config(None, [*model, f"data.path={corpus}", f"train.out_dir={tmp_path / 'from-hf'}",
                             f"checkpoint.init_from=hf:{folder}"])
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    return cfg, eng


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_the_same_logits_and_tokens(tmp_path, small_corpus, case):
    arch, model = CASES[case]
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *sets([*model, "train.steps=2", "checkpoint.every=2", "optim.lr=1e-2",
                                 "train.log_every=1000", f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    assert json.loads((hf / "config.json").read_text())["architectures"] == [arch]
    load = lambda: AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager", output_loading_info=True)
    hf_model, info = load()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert type(hf_model).__name__ == arch
    c = hf_model.config
    assert (c.head_dim, hf_model.model.layers[0].self_attn.q_proj.weight.shape) == \
        (head_dim_of(case), (H * head_dim_of(case), C))
    if case.startswith("moe"):       # the first layer dense, top 2 of 4 experts, gates not renormalised
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (E, K, F, False)
        assert type(hf_model.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
        assert type(hf_model.model.layers[1].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    cfg, eng = engine_from(hf, model, tmp_path, small_corpus)
    ids = np.random.default_rng(0).integers(0, V, (2, T))
    want = hpengine_logits(eng.named_params(), cfg.model, ids)
    np.testing.assert_allclose(logits_of(hf_model.eval(), ids), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exact(lambda: logits_of(load()[0].eval(), ids)), want, rtol=1e-10, atol=1e-10)
    assert np.abs(want).max() > 1e-3
    ours = generate(run, "def ", 8, greedy=True, out=io.StringIO(), note=lambda *_: None)["tokens"]
    with torch.no_grad():      # both stop at the end-of-document token (the folder's eos_token_id), if it comes
        theirs = hf_model.generate(torch.tensor([list(b"def ")]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    assert ours == theirs and len(ours) >= 3


def saved(case, folder, **over):
    """A randomly initialised, perturbed float64 model of `case` saved by transformers into folder."""
    torch.manual_seed(0)
    common = {"vocab_size": V, "hidden_size": C, "intermediate_size": FD, "num_hidden_layers": L, "num_attention_heads": H,
                  "num_key_value_heads": KV, "head_dim": head_dim_of(case), "max_position_embeddings": T, "rms_norm_eps": 1e-5,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "tie_word_embeddings": False,
                  "attn_implementation": "eager"}
    if case.startswith("moe"):
        conf = Qwen3MoeConfig(**{**common, "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": F,
                                 "mlp_only_layers": [0], "norm_topk_prob": False, "experts_implementation": "eager",
                                 **over})
        model = Qwen3MoeForCausalLM(conf)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, **over))
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_of_a_saved_model_gives_its_logits(tmp_path, small_corpus, case):
    _arch, model = CASES[case]
    folder = tmp_path / "hf"
    hf_model = saved(case, folder)
    cfg, eng = engine_from(folder, model, tmp_path, small_corpus)
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    want = hpengine_logits(eng.named_params(), cfg.model, ids)
    np.testing.assert_allclose(want, logits_of(hf_model, ids), rtol=1e-5, atol=1e-5)
    cls = Qwen3MoeForCausalLM if case.startswith("moe") else Qwen3ForCausalLM
    again = exact(lambda: logits_of(cls.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager").eval(), ids))
    np.testing.assert_allclose(want, again, rtol=1e-10, atol=1e-10)
    P = eng.named_params()
    assert not np.allclose(P["h.1.attn.q_norm.w"], 1.0) and P["h.1.attn.q_norm.w"].shape == (head_dim_of(case),)
    assert P["h.1.attn.o.w"].shape == (H * head_dim_of(case), C)


@pytest.mark.parametrize("extra,why", [(["model.moe.shared_hidden=8"], "model.moe.shared_hidden = 0"),
                                       (["model.moe.router='sigmoid'"], "model.moe.router = 'softmax'")])
def test_what_qwen3_moe_cannot_hold_is_refused_on_export(tmp_path, small_corpus, capsys, extra, why):
    run = tmp_path / "run"
    assert main(["train", *sets([*BASE, *MOE, *extra, "train.steps=1", "train.log_every=1000",
                                 f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    capsys.readouterr()
    assert main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) != 0
    err = capsys.readouterr().err.strip()
    assert why in err and "a Qwen3MoeForCausalLM needs" in err and "\n" not in err


@pytest.mark.parametrize("case,over,model,why", [
    ("moe", {"mlp_only_layers": [1]}, BASE + MOE, "keeps the dense MLP in layers [1]"),
    ("moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, BASE + MOE, "keeps the dense MLP in layers [0, 2]"),
    ("moe", {"mlp_only_layers": [0, 1]}, BASE + MOE, ("dense layers (mlp_only_layers, decoder_sparse_step) 2 but "
                                                     "model.moe.dense_layers = 1")),
    ("moe", {}, [*BASE, *MOE, "model.qk_norm=false"], "normalises each head's q and k"),
    ("dense", {}, [*BASE, "model.qk_norm=false"], "set model.qk_norm = true"),
    ("dense", {}, BASE + MOE, "is a dense Qwen3ForCausalLM, but model.moe.num_experts = 4"),
    ("dense_head_dim", {}, BASE, f"has head_dim {HD} but the run's heads are {C // H} wide"),
    ("moe", {}, BASE + MOE + [f"model.head_dim={HD}"], f"set model.head_dim = {C // H}"),
])
def test_what_the_run_cannot_hold_is_refused_on_import(tmp_path, small_corpus, case, over, model, why):
    folder = tmp_path / "hf"
    saved(case, folder, **over)
    with pytest.raises(CheckpointError) as err:
        engine_from(folder, model, tmp_path, small_corpus)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_a_qwen2_moe_folder_is_refused_in_one_line(tmp_path, small_corpus):
    """Qwen2-MoE scales its shared expert by sigmoid(shared_expert_gate(x)), which hpengine's shared expert lacks."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": C}))
    with pytest.raises(CheckpointError) as err:
        engine_from(folder, BASE + MOE + ["model.moe.shared_hidden=8"], tmp_path, small_corpus)
    msg = str(err.value)
    assert "Qwen2MoeForCausalLM" in msg and "shared_expert_gate" in msg and "\n" not in msg
