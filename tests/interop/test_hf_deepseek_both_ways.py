"""The deepseek kind against Hugging Face's DeepseekV3ForCausalLM, both ways, on a model with a dense first layer,
then routed layers (sigmoid scores with trained selection biases, 4 groups of which 2 are searched, routed scaling
2.5, a shared expert), MLA with and without the query bottleneck, YaRN on and off.

Export: a tiny float64 run trains 3 steps (the router biases move), `hpengine ckpt export --format hf` writes a
folder that transformers loads with nothing missing (an MTP run's layer n_layers is reported unexpected: transformers
builds no MTP module); its logits equal hpengine's forward of the checkpoint to 1e-5 as shipped (its RMSNorm
statistics, router and rotary angles in float32) and to 1e-10 with modeling_deepseek_v3's float32 read as float64;
greedy decoding gives the same tokens; starting a run from the folder restores every tensor (the MTP modules') and
the router biases exactly. A float32 run's export loaded in float32 gives its float32 logits to 1e-5. Import: a perturbed DeepseekV3ForCausalLM saved with save_pretrained (selection biases
set) starts a run with its biases and its logits.

Needs the `hf` extra (torch, transformers >= 5 with DeepseekV3) and safetensors; skipped without them.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, modeling_rope_utils  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

from hf_oracle import exact as oracle_exact, logits_of, sets  # noqa: E402
from hpengine.apps.generate import generate  # noqa: E402
from hpengine.checkpoint.export import read_params  # noqa: E402
from hpengine.cli.commands import main  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import LOCAL, build_model  # noqa: E402
from hpengine.models.moe_bias import saved_bias  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import restore  # noqa: E402

T, V, C, L, H, E, K, FE, FD, G, TG = 16, 256, 16, 3, 2, 8, 2, 6, 20, 4, 2
YARN = {"factor": 2.0, "original_max_position_embeddings": 8, "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 0.9,
        "mscale_all_dim": 1.2}


def model_keys(q_lora_rank, yarn, mtp=0):
    return [f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
            f"model.vocab_size={V}", "model.kind='deepseek'", f"model.ffn_hidden={FD}", "model.rope_theta=500.0",
            "model.norm_eps=1e-6", "model.dtype='float64'", "runtime.backend='numpy'", "train.global_batch=4",
            f"model.mla.q_lora_rank={q_lora_rank}", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=4",
            "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6", f"model.moe.num_experts={E}",
            f"model.moe.top_k={K}", f"model.moe.expert_hidden={FE}", f"model.moe.shared_hidden={FE}",
            "model.moe.dense_layers=1", "model.moe.router='sigmoid'", f"model.moe.n_groups={G}",
            f"model.moe.topk_groups={TG}", "model.moe.routed_scaling=2.5", "model.moe.bias_update_rate=0.01",
            f"model.mtp.depth={mtp}"] + \
        ([f"model.rope_scaling.{k}={v}" for k, v in YARN.items()] + ["model.rope_scaling.type='yarn'"] if yarn else [])


def exact(fn):
    return oracle_exact(torch, fn, modeling_deepseek_v3, modeling_rope_utils)


def hpengine_logits(P, mcfg, bias, ids):
    """Logits (B, T, V) of the deepseek model with parameters P and router biases (n_layers, E) on one rank."""
    model = build_model(mcfg)
    model.moe.set_bias(np, bias)
    x, _ = model.embed_forward(np, P, ids, LOCAL)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(np, P, i, x, LOCAL)
    return model.head_logits(np, P, x)


def load(folder, **kw):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                experts_implementation="eager", **kw)


@pytest.mark.parametrize("q_lora_rank, yarn, mtp", [(6, True, 1), (0, False, 0)],
                         ids=["q_lora-yarn-mtp", "plain_q-rope"])
def test_export_loads_as_deepseek_v3_with_the_same_logits_and_tokens(tmp_path, small_corpus, q_lora_rank, yarn, mtp):
    run, hf = tmp_path / "run", tmp_path / "hf"
    keys = model_keys(q_lora_rank, yarn, mtp)
    assert main(["train", *sets([*keys, "train.steps=3", "checkpoint.every=3", "optim.lr=1e-2",
                                 "train.log_every=1000", f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    model, info = load(hf, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info.get(k) for k in ("missing_keys", "mismatched_keys", "error_msgs")), info
    # an MTP layer is decoder layer L in the file; transformers builds none and reports its tensors unexpected
    assert all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"])
    assert bool(info["unexpected_keys"]) == bool(mtp)
    r, P = read_params(run / "checkpoints")
    bias = saved_bias(r.manifest["state"])
    assert bias[1:].any() and not bias[0].any()        # trained selection biases in the routed layers
    mcfg = load_config(None, keys).model
    ids = np.random.default_rng(0).integers(0, V, (2, T))
    want = hpengine_logits({n: a for n, a in P.items() if not n.startswith("mtp.")}, mcfg, bias, ids)
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(logits_of(torch, model.eval(), ids), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exact(lambda: logits_of(torch, load(hf).eval(), ids)), want, rtol=1e-10, atol=1e-10)
    ours = generate(run, "def ", 8, greedy=True, out=io.StringIO(), note=lambda *_: None)["tokens"]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([list(b"def ")]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8)[0, 4:].tolist()
    assert ours == theirs
    # hpengine's own round trip: every tensor (the MTP module's too) and the router biases, exactly
    cfg = load_config(None, [*keys, f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'again'}",
                             f"checkpoint.init_from=hf:{hf}"])
    eng = build(cfg)
    restore(eng, cfg, None)
    got = eng.named_params()
    assert sorted(got) == sorted(P) and any(n.startswith("mtp.") for n in P) == bool(mtp)
    assert all(np.array_equal(got[n], P[n]) for n in P)
    assert np.array_equal(eng.router_bias.bias[0], bias)


def saved_deepseek(folder, q_lora_rank, yarn):
    rope = {"rope_type": "yarn", "rope_theta": 500.0, **YARN} if yarn else {"rope_type": "default", "rope_theta": 500.0}
    conf = DeepseekV3Config(vocab_size=V, hidden_size=C, intermediate_size=FD, moe_intermediate_size=FE,
                            num_hidden_layers=L, first_k_dense_replace=1, num_attention_heads=H, num_key_value_heads=H,
                            n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K, n_group=G, topk_group=TG,
                            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=q_lora_rank or None,
                            kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6,
                            max_position_embeddings=T, rope_parameters=rope, num_nextn_predict_layers=1,
                            tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(conf).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers[1:]:     # a buffer, zero at init: biases that move the selection
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(E, dtype=torch.float64))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("q_lora_rank, yarn", [(5, True), (0, False)], ids=["q_lora-yarn", "plain_q-rope"])
def test_import_of_a_saved_deepseek_v3_gives_its_logits(tmp_path, small_corpus, q_lora_rank, yarn):
    folder = tmp_path / "hf"
    model = saved_deepseek(folder, q_lora_rank, yarn)
    # the folder says num_nextn_predict_layers = 1 but holds no MTP layer (transformers writes none): a run
    # with model.mtp.depth = 0 starts from it, as transformers loads it
    cfg = load_config(None, [*model_keys(q_lora_rank, yarn), f"data.path={small_corpus}",
                             f"train.out_dir={tmp_path / 'run'}", f"checkpoint.init_from=hf:{folder}"])
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    bias = eng.router_bias.bias[0]
    for i, layer in enumerate(model.model.layers):
        want = layer.mlp.gate.e_score_correction_bias.numpy() if i else np.zeros(E)
        assert np.array_equal(bias[i], want), i
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    ours = hpengine_logits(eng.named_params(), cfg.model, bias, ids)
    np.testing.assert_allclose(ours, logits_of(torch, model, ids), rtol=1e-5, atol=1e-5)
    again = exact(lambda: logits_of(torch, DeepseekV3ForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval(), ids))
    np.testing.assert_allclose(ours, again, rtol=1e-10, atol=1e-10)


def test_float32_export_gives_float32_logits(tmp_path, small_corpus):
    """A float32 run's export loaded in float32: transformers' logits equal hpengine's float32 forward to 1e-5
    (each side rounds its own float32 sums in its own order; on O(1) logits that leaves differences near 1e-7)."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    keys = [*model_keys(6, True), "model.dtype='float32'"]
    assert main(["train", *sets([*keys, "train.steps=3", "checkpoint.every=3", "optim.lr=1e-2",
                                 "train.log_every=1000", f"data.path={small_corpus}", f"train.out_dir={run}"])]) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    r, P = read_params(run / "checkpoints")
    assert P["wte"].dtype == np.float32
    ids = np.random.default_rng(3).integers(0, V, (2, T))
    want = hpengine_logits(P, load_config(None, keys).model, saved_bias(r.manifest["state"]), ids)
    assert want.dtype == np.float32
    np.testing.assert_allclose(logits_of(torch, model, ids), want, rtol=1e-5, atol=1e-5)
