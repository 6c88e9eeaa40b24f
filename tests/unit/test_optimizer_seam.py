"""The optimizer seam: a checkpoint stores the state tensors its optimizer declares and names that optimizer; a
manifest from before it did loads as AdamW's; another optimizer's state is refused in one line; the engine and
the checkpoint code name no optimizer."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from hpengine.checkpoint import seal
from hpengine.checkpoint.guard import CheckpointError
from hpengine.checkpoint.shards import Reader
from hpengine.config import tree
from hpengine.config.load import load_config
from hpengine.optim import optimizer_kind
from hpengine.layout.resolve import resolve
from hpengine.optim.base import KINDS, RANGES, OptimizerKind
from hpengine.planner.memory import precision
from hpengine.run.build import build
from hpengine.run.train import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000", "model.dtype='float64'"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("seam") / "run"
    cfg = load_config(None, [*TINY, f"data.path={small_corpus}", f"train.out_dir={out}", "train.steps=2",
                             "checkpoint.every=2"])
    train(cfg)
    return cfg, out / "checkpoints" / "step_00000002"


def _rewritten(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint src whose manifest `change` edited, sealed again as a writer would."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "manifest.json":
            (dst / f.name).write_bytes(f.read_bytes())
    m = json.loads((src / "manifest.json").read_text())
    m = {k: v for k, v in m.items() if k not in (seal.SUM_KEY, seal.MAC_KEY)}
    (dst / "manifest.json").write_text(json.dumps(seal.seal(change(m))))
    return dst


def _state(eng) -> list[np.ndarray]:
    return [np.array(a) for o in eng.opts if o is not None for a in o.state().values()]


def test_a_checkpoint_names_its_optimizer_and_holds_what_it_declares(saved):
    _, ckpt = saved
    r = Reader(ckpt)
    assert r.manifest["optimizer"] == {"name": "adamw", "state": ["adam_m", "adam_v"]}
    assert r.kinds == ("param", "adam_m", "adam_v")
    assert {p["kind"] for p in r.manifest["pieces"]} == set(r.kinds)
    r.close()


def test_a_manifest_without_an_optimizer_loads_as_adamw(saved, tmp_path):
    cfg, ckpt = saved
    legacy = _rewritten(ckpt, tmp_path / "legacy", lambda m: {k: v for k, v in m.items() if k != "optimizer"})
    a, b = build(cfg), build(cfg)
    a.load(Reader(ckpt))
    b.load(Reader(legacy))
    assert a.opt_steps == b.opt_steps == 2
    moments = _state(b)
    assert moments and all(np.any(m != 0) for m in moments)       # the moments were read, not left at zero
    for x, y in zip(_state(a), moments):
        assert np.array_equal(x, y)


def test_another_optimizers_state_is_refused_naming_it(saved, tmp_path):
    cfg, ckpt = saved

    def other(m):
        rename = {"adam_m": "mom", "adam_v": "var"}
        pieces = [{**p, "kind": rename.get(p["kind"], p["kind"])} for p in m["pieces"]]
        return {**m, "optimizer": {"name": "other", "state": ["mom", "var"]}, "pieces": pieces}

    foreign = _rewritten(ckpt, tmp_path / "foreign", other)
    with pytest.raises(CheckpointError, match=r"holds the state of optimizer 'other' \(mom, var\), not 'adam_m'"):
        build(cfg).load(Reader(foreign))


def test_resuming_adamw_state_under_muon_is_refused_pointing_at_init_from(saved):
    cfg, ckpt = saved
    muon = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon"))
    with pytest.raises(CheckpointError) as e:
        build(muon).load(Reader(ckpt))
    assert str(e.value) == (f"checkpoint '{ckpt}' holds the state of optimizer 'adamw' (adam_m, adam_v), not 'muon_m': "
                            f"resume with optim.name = 'adamw', or start from its parameters alone (hpengine ckpt "
                            f"export {ckpt} FILE --params-only, then checkpoint.init_from = FILE)")
    eng = build(muon)
    eng.load(Reader(ckpt), params_only=True)        # what checkpoint.init_from does: the weights, fresh state
    assert eng.opt_steps == 0 and all(not np.any(a) for a in _state(eng))


@pytest.mark.parametrize("bad", [{"name": "adamw"}, {"name": "adamw", "state": ["param"]},
                                 {"name": 3, "state": []}, ["adam_m"]])
def test_a_malformed_optimizer_record_is_refused(saved, tmp_path, bad):
    _, ckpt = saved
    broken = _rewritten(ckpt, tmp_path / "broken", lambda m: {**m, "optimizer": bad})
    with pytest.raises(CheckpointError, match="is malformed: 'optimizer' is"):
        Reader(broken)


def test_the_config_offers_the_optimizers_there_are():
    choices = next(f for f in tree.OptimConfig.__dataclass_fields__.values() if f.name == "name").metadata
    assert tuple(choices["choices"]) == tuple(KINDS)
    with pytest.raises(ValueError, match=r"optim.name = 'lion' is not an optimizer hpengine has; valid: adamw, muon, sgd$"):
        optimizer_kind("lion")


def test_the_engine_and_the_checkpoint_name_no_optimizer():
    names = re.compile("|".join(KINDS) + r"|adam|moments?\b", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for room in ("engine", "checkpoint") for p in sorted((ROOT / "hpengine" / room).glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if names.search(line)]
    assert not found, "\n".join(found)


def test_the_planner_counts_the_state_the_optimizer_declares(monkeypatch):
    """K, the optimizer's bytes per parameter element, is what the kind declares: AdamW's two moments (8 bytes
    in float32, 16 in float64, 4 + 8 with amp's float32 master), and one state tensor's 4 for a kind with one."""
    cfg = load_config(None, [])
    assert resolve(cfg, 1).optimizer == "adamw"
    assert precision(cfg.model, "", optimizer="adamw")[2] == 8
    assert precision(load_config(None, ["model.dtype=float64"]).model, "", optimizer="adamw")[2] == 16
    assert precision(cfg.model, "float16", optimizer="adamw")[2] == 12
    monkeypatch.setitem(KINDS, "one", OptimizerKind("one", ("momentum",), RANGES, None))
    assert precision(cfg.model, "", optimizer="one")[2] == 4 and precision(cfg.model, "bfloat16", optimizer="one")[2] == 8
