"""The llama kind with routed experts against Hugging Face's MixtralForCausalLM, both ways.

Export: a tiny float64 MoE run (4 experts, top 2, renormalised; every layer routed) trains 2 steps,
`hpengine ckpt export --format hf` writes a MixtralForCausalLM folder (per-expert w1 / w3 / w2 tensors, as
transformers' save_pretrained writes them), and transformers loads it with nothing missing or unexpected:
its logits equal hpengine's forward to 1e-5 (stock: the router softmax, RMSNorm statistics and rotary angles
in float32) and to 1e-10 with modeling_mixtral's float32 (and the router's .float()) read as float64; greedy decoding gives the same
tokens. Import: a randomly initialised (and perturbed) MixtralForCausalLM saved with save_pretrained starts
a run through checkpoint.init_from = "hf:DIR" with transformers' logits. A config Mixtral cannot express (a
shared expert, dense first layers, a sigmoid router) is refused in one line.

Needs the `hf` extra (torch, transformers >= 5) and safetensors; skipped without them.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from hf_oracle import exact as oracle_exact, hpengine_logits, logits_of as oracle_logits, sets  # noqa: E402
from hpengine.apps.generate import generate  # noqa: E402
from hpengine.cli.commands import main  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import restore  # noqa: E402

T, V, C, L, H, E, K, F = 16, 256, 16, 2, 4, 4, 2, 12
MODEL = [f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
         f"model.vocab_size={V}", "model.kind='llama'", "model.n_kv_heads=2", "model.rope_theta=500.0",
         "model.dtype='float64'", "runtime.backend='numpy'", "train.global_batch=4", f"model.moe.num_experts={E}",
         f"model.moe.top_k={K}", f"model.moe.expert_hidden={F}", "model.moe.aux_loss=0.01"]


def exact(fn):
    return oracle_exact(torch, fn, modeling_mixtral)


def logits_of(model, ids):
    return oracle_logits(torch, model, ids)


def test_export_loads_as_mixtral_with_the_same_logits_and_tokens(tmp_path, small_corpus):
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *sets([*MODEL, "train.steps=2", "checkpoint.every=2", "optim.lr=1e-2",
                                 "train.log_every=1000", f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    load = lambda: AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64, attn_implementation="eager",  # noqa: E731
                                                        experts_implementation="eager", output_loading_info=True)
    model, info = load()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert type(model).__name__ == "MixtralForCausalLM"
    eng_cfg = load_config(None, [*MODEL, f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'x'}",
                                 f"checkpoint.init_from=hf:{hf}"])
    eng = build(eng_cfg)
    restore(eng, eng_cfg, None)
    P = eng.named_params()
    ids = np.random.default_rng(0).integers(0, V, (2, T))
    want = hpengine_logits(P, eng_cfg.model, ids)
    np.testing.assert_allclose(logits_of(model.eval(), ids), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exact(lambda: logits_of(load()[0].eval(), ids)), want, rtol=1e-10, atol=1e-10)
    assert np.abs(want).max() > 1e-3
    ours = generate(run, "def ", 8, greedy=True, out=io.StringIO(), note=lambda *_: None)["tokens"]
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 4:].tolist()
    assert ours == theirs


@pytest.mark.parametrize("head_dim", [None, 8], ids=["heads_of_hidden_over_heads", "head_dim_8"])
def test_import_of_a_saved_mixtral_gives_its_logits(tmp_path, small_corpus, head_dim):
    """head_dim None: hidden_size / num_attention_heads = 4; 8: the run sets model.head_dim = 8."""
    torch.manual_seed(0)
    conf = MixtralConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K, max_position_embeddings=T,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                         tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager",
                         head_dim=head_dim)
    model = MixtralForCausalLM(conf).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    cfg = load_config(None, [*MODEL, f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'run'}",
                             f"checkpoint.init_from=hf:{folder}", *([f"model.head_dim={head_dim}"] if head_dim else [])])
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    assert eng.named_params()["h.0.attn.q.w"].shape == (C, H * (head_dim or C // H))
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    want = hpengine_logits(eng.named_params(), cfg.model, ids)
    np.testing.assert_allclose(want, logits_of(model, ids), rtol=1e-5, atol=1e-5)
    again = exact(lambda: logits_of(MixtralForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                                       attn_implementation="eager",
                                                                       experts_implementation="eager").eval(), ids))
    np.testing.assert_allclose(want, again, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("extra,why", [(["model.moe.shared_hidden=8"], "model.moe.shared_hidden = 0"),
                                       (["model.moe.dense_layers=1"], "model.moe.dense_layers = 0"),
                                       (["model.moe.router='sigmoid'"], "model.moe.router = 'softmax'")])
def test_what_mixtral_cannot_hold_is_refused(tmp_path, small_corpus, capsys, extra, why):
    run = tmp_path / "run"
    assert main(["train", *sets([*MODEL, *extra, "train.steps=1", "train.log_every=1000", f"data.path={small_corpus}",
                                 f"train.out_dir={run}"])]) == 0
    capsys.readouterr()
    assert main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) != 0
    err = capsys.readouterr().err.strip()
    assert why in err and "a MixtralForCausalLM needs" in err and "\n" not in err
