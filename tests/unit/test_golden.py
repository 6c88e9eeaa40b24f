"""Golden losses: the first 5 training losses of a tiny float64 GPT, stored in golden_losses.json.

This is a CHANGE DETECTOR, not a correctness check: golden_losses.json was written by hpengine itself
(a self-generated snapshot), so it says only that the numbers have not moved since it was generated,
never that they are right. Correctness is checked against independent oracles elsewhere: the model's
forward/backward and the AdamW + clipping step against a NumPy implementation written from the
equations (test_oracle.py), gradients against finite differences (test_model.py), the schedule and
the clip coefficient against hand-computed values (test_train.py).

Any change to initialisation, sampling, layers, loss normalisation, AdamW, clipping or the schedule
moves these numbers. If a change is intended, regenerate, review the diff and commit it:

    HPENGINE_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_golden.py
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from hpengine.config.load import load_config
from hpengine.data import build_corpus
from hpengine.run.train import train

GOLDEN = Path(__file__).with_name("golden_losses.json")
REGEN = os.environ.get("HPENGINE_REGEN_GOLDEN") == "1"
RTOL = 1e-10

# Fixed here (not the stdlib, which changes with the Python version).
TEXT = b"""\
Message passing is the oldest way to make many computers work on one problem. Every process owns its
memory; nothing is shared unless a message carries it. A rank that needs a value from a neighbour asks
for it, and the neighbour answers when it reaches the matching call. The discipline is strict, but it
scales: the same program runs on two laptops or on ten thousand nodes of a supercomputer.

Training a neural network by message passing follows the same rule. Each replica computes gradients
on its share of the batch, then the replicas agree on the average before anyone takes a step. When the
model is too large for one device, the tensors themselves are cut: a matrix may be split by columns on
one group of ranks and by rows on another, and the partial products are summed across the group.

A pipeline cuts the network by depth instead. The first stage embeds the tokens and hands activations
to the second, which hands them to the third; gradients travel the other way. Micro-batches keep every
stage busy, and a schedule decides in which order forward and backward passes take turns. The bubble at
the start and at the end of each step is the price of the pipeline, and more micro-batches shrink it.

Sharding the optimizer state removes the copies that data parallelism makes. Each rank keeps the Adam
moments for one contiguous slice of the parameters, updates that slice alone, and then shares the new
values. Balanced slices matter: the slowest owner sets the pace of the whole job.

0123456789 !"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ The quick brown fox jumps over the lazy dog.
"""

# Every key that touches the numbers is pinned, so a change of a default cannot move the golden run.
OVERRIDES = [
    "model.kind='gpt'", "model.vocab_size=256", "model.seq_len=8", "model.d_model=16",
    "model.n_layers=2", "model.n_heads=2", "model.ffn_mult=4", "model.tie_head=false",
    "model.dtype='float64'", "model.init_std=0.02",
    "data.val_fraction=0.1",
    "train.steps=5", "train.global_batch=4", "train.seed=1234", "train.eval_every=0",
    "optim.lr=0.01", "optim.betas=[0.9, 0.95]", "optim.eps=1e-8", "optim.weight_decay=0.1",
    "optim.warmup_steps=2", "optim.schedule='cosine'", "optim.min_lr_ratio=0.1",
    "optim.clip_grad_norm=1.0",
    "runtime.backend='numpy'",
]


def run_golden(tmp_path) -> list[float]:
    srcs = []                   # one document per paragraph: the validation split takes whole documents
    for i, paragraph in enumerate(TEXT.split(b"\n\n")):
        srcs.append(tmp_path / f"golden{i}.txt")
        srcs[-1].write_bytes(paragraph)
    data = tmp_path / "golden.h5"
    build_corpus(srcs, data, 256)
    out = tmp_path / "run"
    cfg = load_config(None, OVERRIDES + [f"data.path={data}", f"train.out_dir={out}"])
    summary = train(cfg)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(1, 6))
    losses = [r["loss"] for r in rows]
    assert summary["first_loss"] == losses[0] and summary["final_loss"] == losses[-1]
    return losses


def test_golden_losses(tmp_path):
    losses = run_golden(tmp_path)
    # sanity anchor: a near-uniform prediction over 256 bytes costs ln(256) nats per token
    assert abs(losses[0] - math.log(256)) < 0.3
    assert all(math.isfinite(v) for v in losses)
    if REGEN:
        GOLDEN.write_text(json.dumps({"overrides": OVERRIDES, "losses": losses}, indent=1) + "\n")
        pytest.skip(f"regenerated {GOLDEN.name}: review the diff and commit it")
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES, "the golden config changed: regenerate (see module doc)"
    assert len(golden["losses"]) == 5
    for step, (got, want) in enumerate(zip(losses, golden["losses"])):
        assert got == pytest.approx(want, rel=RTOL, abs=0), f"step {step}: loss {got!r} != golden {want!r}"
    # the run learns something even in 5 steps: the golden numbers are not a constant
    assert losses[-1] < losses[0]
