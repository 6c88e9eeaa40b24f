"""Shared pieces of the MPI tests: tiny configs, running N steps, the one-process reference."""
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
        "model.dtype=float64", "train.global_batch=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "train.steps=5", "optim.clip_grad_norm=1.0"]


# the Llama kind on the same tiny shape: 4 query heads in 2 groups (head_dim 4), SwiGLU width 24
LLAMA = ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24"]


def config(corpus, *extra):
    return load_config(None, TINY + [f"data.path={corpus}", *extra])


def run(cfg, comm, steps=5):
    """Train `steps` steps; returns (losses per step [per model], {name: whole tensor}, engine)."""
    eng = build(cfg, comm)
    losses, eng.grad_norms = [], []
    for s in range(steps):
        m = eng.train_step(s)
        losses.append([pm["loss"] for pm in m["models"]] if "models" in m else [m["loss"]])
        eng.grad_norms.append([pm["grad_norm"] for pm in m["models"]] if "models" in m else [m["grad_norm"]])
    return np.array(losses), eng.named_params(), eng


def assert_same_params(got: dict, want: dict, rtol=1e-10, atol=1e-13):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def reference(corpus, *extra):
    """The same run on one process (every rank computes it on COMM_SELF)."""
    return run(config(corpus, *extra), MPI.COMM_SELF)


def need(cond: bool, why: str):
    """Skip on every rank together (the condition depends only on the world size)."""
    if not cond:
        pytest.skip(why)


def assert_same(got, want, rtol=1e-10):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-13)


def saved_after(cfg, comm, root, steps: int):
    """An engine of cfg over comm trained `steps` steps and its checkpoint saved in root; the checkpoint's path."""
    eng = build(cfg, comm)
    for s in range(steps):
        eng.train_step(s)
    return save_state(eng, root, steps, keep=2)


def assert_resumes_like(cfg, comm, root, straight, at=2, steps=2):
    """An engine of cfg over comm, restored from the checkpoint at step `at` in root, trains `steps` more steps
    exactly as the straight run (run()'s losses and parameters over at + steps steps)."""
    eng = build(cfg, comm)
    assert restore(eng, cfg, root) == at
    losses = [eng.train_step(s)["loss"] for s in range(at, at + steps)]
    assert_same(losses, straight[0][at:, 0])
    assert_same_params(eng.named_params(), straight[1])


def same_as_one_process(corpus, world, *extra, model=(), ref_extra=()):
    """Train cfg(model + extra) on world and the one-process run (model + ref_extra): the same losses, gradient
    norms and parameters to 1e-10. Returns the distributed run's engine."""
    losses, params, eng = run(config(corpus, *model, *extra), world)
    ref_l, ref_p, ref = reference(corpus, *model, *ref_extra)
    assert_same(losses, ref_l)
    assert_same(np.array(eng.grad_norms), np.array(ref.grad_norms))
    assert_same_params(params, ref_p)
    return eng
