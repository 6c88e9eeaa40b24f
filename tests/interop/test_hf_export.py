"""`hpengine ckpt export --format hf` loaded by transformers: AutoModelForCausalLM.from_pretrained on the
exported folder gives hpengine's logits.

Tiny float64 GPT and llama models train 2 steps on a small local corpus (one process, numpy), save a
checkpoint, export it; transformers loads the folder in float64 (nothing missing, unexpected or
mismatched) and its logits on random ids match hpengine's forward (model blocks with LOCAL) to 1e-10.
HF's llama keeps RMSNorm statistics, the softmax and the rotary angles in float32: stock HF is compared
to 1e-5, and exactly with modeling_llama's float32 read as float64 (as tests/interop/test_hf_llama.py).
A run on a trained BPE tokenizer also exports its tokenizer: AutoTokenizer encodes as the run did.

Needs the `hf` extra (torch, transformers >= 5) and safetensors; skipped without them.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from hf_oracle import Float64Torch  # noqa: E402
from hpengine.checkpoint.shards import Reader  # noqa: E402
from hpengine.cli.commands import main  # noqa: E402
from hpengine.config.load import from_dict  # noqa: E402
from hpengine.models import LOCAL, build_model  # noqa: E402
from hpengine.nn import layernorm_forward, rmsnorm_forward  # noqa: E402

TINY = ["model.seq_len=16", "model.d_model=16", "model.n_layers=2", "model.n_heads=4", "train.global_batch=4",
        "runtime.backend='numpy'", "model.dtype='float64'", "train.log_every=1000", "train.steps=2",
        "checkpoint.every=2", "optim.lr=1e-2"]
CASES = {"gpt": ["model.kind='gpt'"], "gpt_tied": ["model.kind='gpt'", "model.tie_head=true"],
         "llama": ["model.kind='llama'", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.rope_theta=500.0"],
         "llama_tied": ["model.kind='llama'", "model.n_kv_heads=1", "model.tie_head=true"],
         "llama_head_dim": ["model.kind='llama'", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.head_dim=6"]}


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """A token file on a trained byte-level BPE of 300 ids (its tokenizer.json saved beside it)."""
    from hpengine.data import build_corpus
    from tests.conftest import corpus_text
    root = tmp_path_factory.mktemp("bpe")
    (root / "src").mkdir()
    for i in range(3):
        (root / "src" / f"{i}.txt").write_bytes(corpus_text(100, seed=3 + i))
    out = root / "bpe.h5"
    info = build_corpus([root / "src"], out, 300, train_tokenizer=True)
    return out, info


def train_and_export(root, corpus, case, vocab):
    run, hf = root / case, root / f"{case}-hf"
    args = ["train"]
    for item in [*TINY, *CASES[case], f"model.vocab_size={vocab}", f"data.path={corpus}", f"train.out_dir={run}"]:
        args += ["--set", item]
    assert main(args) == 0
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0
    return run, hf


def hpengine_logits(run, ids):
    r = Reader(run / "checkpoints")
    P = {n: r.read("param", n, tuple(slice(0, k) for k in s)) for n, s in r.manifest["shapes"].items()}
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    r.close()
    model, xp, tp = build_model(cfg.model), np, LOCAL
    x, _ = model.embed_forward(xp, P, ids, tp)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(xp, P, i, x, tp)
    if cfg.model.kind == "gpt":
        h, _ = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"])
    else:
        h, _ = rmsnorm_forward(xp, x, P["norm.w"], cfg.model.norm_eps)
    w = P["wte"].T if cfg.model.tie_head else P["lm_head.w"]
    return h @ w, cfg


def hf_logits(folder, ids):
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy(), model


@pytest.mark.parametrize("case", list(CASES))
def test_hf_export_same_logits(tmp_path, small_corpus, case, monkeypatch):
    run, hf = train_and_export(tmp_path, small_corpus, case, 256)
    ids = np.random.default_rng(0).integers(0, 256, (2, 16))
    want, cfg = hpengine_logits(run, ids)
    stock, model = hf_logits(hf, ids)
    assert model.config.tie_word_embeddings == cfg.model.tie_head
    if cfg.model.tie_head:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if cfg.model.kind == "gpt":
        assert type(model).__name__ == "GPT2LMHeadModel"
        np.testing.assert_allclose(stock, want, rtol=1e-10, atol=1e-10)
    else:
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.head_dim == (cfg.model.head_dim or 16 // 4)
        np.testing.assert_allclose(stock, want, rtol=1e-5, atol=1e-5)
        with monkeypatch.context() as m:
            m.setattr(modeling_llama, "torch", Float64Torch(torch))
            exact, _ = hf_logits(hf, ids)
        np.testing.assert_allclose(exact, want, rtol=1e-10, atol=1e-10)
    assert np.abs(want).max() > 1e-3


def test_hf_export_with_the_runs_tokenizer(tmp_path, bpe_corpus):
    corpus, info = bpe_corpus
    run, hf = train_and_export(tmp_path, corpus, "llama", 300)
    assert (hf / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    conf = json.loads((hf / "config.json").read_text())
    assert conf["eos_token_id"] == info["eos_id"] == conf["bos_token_id"]
    tok = AutoTokenizer.from_pretrained(hf)
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(run / "tokenizer.json"))
    text = "the quick brown fox jumps over the lazy dog."
    assert tok(text)["input_ids"] == ref.encode(text).ids
    assert tok.eos_token_id == info["eos_id"]
    ids = np.array([ref.encode(text).ids[:16]])
    want, _ = hpengine_logits(run, ids)
    stock, _ = hf_logits(hf, ids)
    np.testing.assert_allclose(stock, want, rtol=1e-5, atol=1e-5)


def test_the_readme_snippet_generates_without_a_warning(tmp_path, small_corpus):
    """The README's `model.generate(ids, max_new_tokens=N, do_sample=False)` on an export: its
    generation_config.json sets no max_length to clash with max_new_tokens and gives the pad id."""
    import logging
    import warnings
    _, hf = train_and_export(tmp_path, small_corpus, "gpt", 256)
    gen = json.loads((hf / "generation_config.json").read_text())
    assert "max_length" not in gen and gen["pad_token_id"] == gen["eos_token_id"] == 0
    model = AutoModelForCausalLM.from_pretrained(hf)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_log = logging.getLogger("transformers")
    hf_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = model.generate(torch.tensor([list("the ".encode())]), max_new_tokens=8, do_sample=False)
    finally:
        hf_log.removeHandler(handler)
    said = [r.getMessage() for r in records] + [str(w.message) for w in caught]
    assert not [m for m in said if "max_length" in m or "pad_token_id" in m], said
    assert 4 < out.shape[1] <= 4 + 8


def _child_env(tmp_path) -> dict:
    """One thread per rank, a private corpus cache, nothing of an MPI launcher that may have started pytest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    return {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HPENGINE_CACHE": str(tmp_path / "cache")}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_hf_export_after_tensor_parallel_training_generates_the_same(tmp_path, small_corpus, kind, capsys):
    """A run trained under tensor_parallel.degree=2 (2 ranks), exported: same logits and greedy tokens."""
    bindir = Path(sys.executable).parent
    mpiexec, script = bindir / "mpiexec", bindir / "hpengine"
    if not (mpiexec.exists() and script.exists()):
        pytest.skip("needs mpiexec and the hpengine script beside the interpreter")
    run, hf = tmp_path / "run", tmp_path / "hf"
    sets = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2", f"model.kind='{kind}'",
            "model.seq_len=48", "model.d_model=16", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=256",
            "model.dtype='float64'", "runtime.backend='numpy'", "train.global_batch=4", "train.steps=3",
            "train.log_every=1000", "optim.lr=1e-2", f"data.path={small_corpus}", f"train.out_dir={run}"]
    if kind == "llama":
        sets += ["model.n_kv_heads=2", "model.ffn_hidden=24", "model.rope_theta=500.0"]
    cmd = [str(mpiexec), "-n", "2", str(script), "train"] + [a for s in sets for a in ("--set", s)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(tmp_path), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert main(["ckpt", "export", str(run / "checkpoints"), str(hf), "--format", "hf"]) == 0

    ids = np.random.default_rng(1).integers(0, 256, (2, 48))
    want, cfg = hpengine_logits(run, ids)
    assert cfg.strategy.tensor_parallel.degree == 2
    stock, model = hf_logits(hf, ids)
    np.testing.assert_allclose(stock, want, rtol=1e-5, atol=1e-5)

    prompt = "the quick brown "
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", "32"]) == 0
    printed = capsys.readouterr().out
    from hpengine.apps.generate import generate
    got = generate(run, prompt, max_new=32, greedy=True, out=io.StringIO(), note=lambda s: None)["tokens"]
    shown = bytes(t for t in got if t != 0).decode("utf-8", errors="replace") + "\n"
    assert printed == shown                     # the CLI printed the ids' text
    if "\ufffd" not in printed:
        assert [t for t in got if t != 0] == list(printed[:-1].encode("utf-8"))
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt.encode("utf-8"))]), max_new_tokens=32, do_sample=False,
                             eos_token_id=0, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == got
    assert len(got) == 32 and len(set(got)) > 4       # a real continuation, not an early eos
