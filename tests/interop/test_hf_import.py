"""`checkpoint.init_from = "hf:DIR"` on folders written by transformers: a randomly initialised (and then
randomly perturbed, so no LayerNorm/RMSNorm weight is 1 and no bias 0) GPT2LMHeadModel or LlamaForCausalLM,
tied and untied (and a llama with head_dim 8, not hidden_size / heads = 4), float64, saved with save_pretrained; hpengine loads the folder into a one-process engine
and its forward (model blocks with LOCAL, as tests/interop/test_hf_export.py) gives transformers' logits:
GPT-2 to 1e-10; stock HF llama (float32 RMSNorm statistics, softmax and rotary angles) to 1e-5, and to
1e-10 with modeling_llama's float32 read as float64 (as tests/interop/test_hf_llama.py). The GPT-2 folder
has n_positions 32 > model.seq_len 16: hpengine takes the first 16 position embeddings.

Needs the `hf` extra (torch, transformers >= 5) and safetensors; skipped without them.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("safetensors")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from hf_oracle import Float64Torch, hpengine_logits  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import restore

T, V, C, L, H = 16, 256, 16, 2, 4
CASES = ["gpt", "gpt_tied", "llama", "llama_tied", "llama_head_dim"]     # head_dim 8 != hidden 16 / 4 heads


def hf_model(case: str):
    tied = case.endswith("_tied")
    torch.manual_seed(0)
    if case.startswith("gpt"):
        conf = GPT2Config(vocab_size=V, n_positions=2 * T, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                          attn_implementation="eager")
        model = GPT2LMHeadModel(conf)
        extra = ["model.kind='gpt'"]
    else:
        hd = 8 if case.endswith("_head_dim") else None
        conf = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=24, num_hidden_layers=L,
                           num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=T,
                           rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                           tie_word_embeddings=tied, attn_implementation="eager", head_dim=hd)
        model = LlamaForCausalLM(conf)
        extra = ["model.kind='llama'", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.rope_theta=500.0",
                 "model.norm_eps=1e-5", *([f"model.head_dim={hd}"] if hd else [])]
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model, [*extra, f"model.tie_head={str(tied).lower()}"]


@pytest.mark.parametrize("case", CASES)
def test_hf_import_same_logits(tmp_path, small_corpus, case, monkeypatch):
    model, extra = hf_model(case)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    cfg = load_config(None, [f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}",
                             f"model.n_heads={H}", f"model.vocab_size={V}", "model.dtype='float64'",
                             "runtime.backend='numpy'", "train.global_batch=4", f"data.path={small_corpus}",
                             f"train.out_dir={tmp_path / 'run'}", f"checkpoint.init_from=hf:{folder}", *extra])
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    P = eng.named_params()

    ids = np.random.default_rng(0).integers(0, V, (2, T))
    want = hpengine_logits(P, cfg.model, ids)
    with torch.no_grad():
        stock = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(want).max() > 1e-3
    if cfg.model.kind == "gpt":
        np.testing.assert_allclose(want, stock, rtol=1e-10, atol=1e-10)
        return
    np.testing.assert_allclose(want, stock, rtol=1e-5, atol=1e-5)
    with monkeypatch.context() as m:
        m.setattr(modeling_llama, "torch", Float64Torch(torch))     # rotary inv_freq too, made at load time
        again = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
        with torch.no_grad():
            exact = again(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(want, exact, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_hf_import_under_tp2_pp2_equals_one_process(tmp_path, small_corpus, case):
    """The transformers-saved folder loaded by 4 ranks (tp 2 x pp 2, learning rate 0, one step) holds the
    one-process import's parameters exactly, and with them its logits (the test above)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hpengine.checkpoint.export import read_params
    bindir = Path(sys.executable).parent
    mpiexec, script = bindir / "mpiexec", bindir / "hpengine"
    if not (mpiexec.exists() and script.exists()):
        pytest.skip("needs mpiexec and the hpengine script beside the interpreter")
    model, extra = hf_model(case)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    sets = [f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
            f"model.vocab_size={V}", "model.dtype='float64'", "runtime.backend='numpy'", "train.global_batch=4",
            f"data.path={small_corpus}", f"checkpoint.init_from=hf:{folder}", *extra]
    one = load_config(None, [*sets, f"train.out_dir={tmp_path / 'one'}"])
    eng = build(one)
    assert restore(eng, one, None) == 0
    want = eng.named_params()
    run = tmp_path / "run"
    par = sets + ["optim.lr=0", "train.steps=1", "train.eval_every=0", f"train.out_dir={run}",
                  "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                  "strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPENGINE_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([str(mpiexec), "-n", "4", str(script), "train"] + [a for s in par for a in ("--set", s)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    reader, got = read_params(step)
    assert reader.manifest["layout"]["tp"] == 2 and reader.manifest["layout"]["pp"] == 2
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
