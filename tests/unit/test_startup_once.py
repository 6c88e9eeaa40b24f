"""A job's start-up checks its config once and predicts its memory once: a loaded config is not validated again
by the layout or the planner, the memory check and the logged prediction read one planner evaluation, and a
config changed after loading is checked again."""
import pytest
from mpi4py import MPI

from hpengine.config import rules as config_rules
from hpengine.config.load import ConfigError, load_config
from hpengine.layout.resolve import resolve
from hpengine.planner import search
from hpengine.run.build import build_job

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16", "train.global_batch=4"]


def _count(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_one_validation_and_one_prediction_per_start(monkeypatch, small_corpus):
    checks = _count(monkeypatch, config_rules, "_check")
    cfg = load_config(None, [*TINY, f"data.path={small_corpus}"])
    assert len(checks) == 1
    evaluations = _count(monkeypatch, search, "predict_layout")
    eng, prediction = build_job(cfg, MPI.COMM_SELF)
    assert len(checks) == 1 and len(evaluations) == 1
    assert prediction["memory"]["total"] > 0 and eng.train_step(0)["loss"] > 0
    eng.data.close()


def test_a_config_changed_after_loading_is_checked_again():
    cfg = load_config(None, TINY)
    resolve(cfg, 1)
    cfg.model.n_heads = 5           # 32 is not a multiple of 5
    with pytest.raises(ConfigError, match="model.d_model = 32 is not divisible by model.n_heads = 5"):
        resolve(cfg, 1)
