"""runtime.tensorboard: hpengine's own event-file writer, read back by TensorBoard's EventAccumulator (an
independent reader), holds exactly the scalars of metrics.jsonl; CRC-32C against RFC 3720's vectors."""
from __future__ import annotations

import json
import struct

import pytest

from hpengine.run import tensorboard as tb
from hpengine.config.load import load_config
from hpengine.run.train import train

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.steps=6", "train.eval_every=3",
        "runtime.peak_tflops=0.002"]


def run(small_corpus, out, *extra):
    return train(load_config(None, TINY + [f"data.path={small_corpus}", f"train.out_dir={out}", *extra]))


def test_crc32c_matches_rfc3720_vectors():
    assert tb.crc32c(b"123456789") == 0xE3069283
    assert tb.crc32c(bytes(32)) == 0x8A9136AA
    assert tb.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert tb.crc32c(bytes(range(32))) == 0x46DD794E


def test_records_are_framed_with_masked_crcs(tmp_path):
    w = tb.EventWriter(tmp_path)
    w.scalars(3, {"a": 1.5, "b": None})
    w.close()
    data, i, n = w.path.read_bytes(), 0, 0
    while i < len(data):
        (length,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == tb.masked_crc32c(data[i:i + 8])
        body = data[i + 12:i + 12 + length]
        assert struct.unpack_from("<I", data, i + 12 + length)[0] == tb.masked_crc32c(body)
        i, n = i + 16 + length, n + 1
    assert n == 2 and b"brain.Event:2" in data
    assert b"\x0a\x01a" in data and b"\x0a\x01b" not in data          # tag "a" kept, the None-valued "b" left out


def scalars_read_back(logdir) -> dict:
    """{tag: [(step, value)]} through TensorBoard's own reader."""
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(logdir), size_guidance={ea_mod.SCALARS: 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def expected(out, field, model=None) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[field]) for r in rows if r.get("model") == model and r.get(field) is not None]


def test_scalars_equal_metrics_jsonl(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(small_corpus, out, "runtime.tensorboard=true")
    got = scalars_read_back(out / "tensorboard")
    fields = {"train/loss": "loss", "val/loss": "val_loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
              "perf/tokens_per_s": "tokens_per_s", "perf/mfu": "mfu"}
    assert set(got) == set(fields)
    for tag, field in fields.items():
        want = expected(out, field)
        assert [s for s, _ in got[tag]] == [s for s, _ in want], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want], rel=1e-6), tag
    assert len(got["val/loss"]) == 2 and len(got["train/loss"]) == 6


def test_amp_adds_the_loss_scale_and_several_models_get_their_own_tags(tmp_path, small_corpus):
    out = tmp_path / "run"
    run(small_corpus, out, "runtime.tensorboard=true", "strategy.amp.enable=true", "train.models=2")
    got = scalars_read_back(out / "tensorboard")
    assert [v for _, v in got["train/loss_scale"]] == [v for _, v in expected(out, "loss_scale", 0)]
    for i in (0, 1):
        assert [v for _, v in got[f"model{i}/train/loss"]] == pytest.approx(
            [v for _, v in expected(out, "loss", i)], rel=1e-6)
    assert "train/loss" not in got


def test_off_by_default_and_only_rank_0_writes(tmp_path, small_corpus):
    run(small_corpus, tmp_path / "run")
    assert not (tmp_path / "run" / "tensorboard").exists()
    cfg = load_config(None, ["runtime.tensorboard=true"])
    assert tb.open_writer(cfg, tmp_path / "r1", rank=1) is None and not (tmp_path / "r1").exists()



def test_diloco_and_recovery_fields_have_their_tags():
    # one metrics.jsonl line of a DiLoCo run's outer step, after a survived death (the writer is tested above)
    line = {"step": 8, "loss": 2.5, "outer_step": 4, "outer_drift": 0.25, "outer_grad_norm": 0.125,
            "replica_bytes": 4096, "recovery_s": 0.5, "dead_ranks": [1]}
    assert tb.scalars_of([line]) == {"train/loss": 2.5, "diloco/outer_step": 4, "diloco/drift": 0.25,
                                     "diloco/pseudo_grad_norm": 0.125, "diloco/replica_bytes": 4096,
                                     "resilience/recovery_s": 0.5}
