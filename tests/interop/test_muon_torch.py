"""hpengine's Muon against torch.optim.Muon (its bfloat16 cast of the Newton-Schulz input lifted, so both run in
float64) for the blocks' matrices and torch.optim.AdamW for the other tensors: a tiny llama (dense, and with routed
experts, each expert a torch parameter of its own) trains 5 steps from hpengine's initial weights; torch steps on the
gradients hpengine's backward computed (checked against Hugging Face's in test_hf_llama) and every parameter agrees
to 1e-9 after every step.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.optim, "Muon"):
    pytest.skip("this torch has no torch.optim.Muon (2.9+)", allow_module_level=True)

from hpengine.config.load import load_config  # noqa: E402
from hpengine.optim.muon import is_muon_matrix  # noqa: E402
from hpengine.run.build import build  # noqa: E402

LR, WD, BETAS, EPS = 0.01, 0.1, (0.9, 0.95), 1e-8
TINY = ["model.kind=llama", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=24", "train.global_batch=4", "runtime.backend=numpy",
        "model.dtype=float64", "train.log_every=1000", "optim.name=muon", f"optim.lr={LR}",
        f"optim.weight_decay={WD}", "optim.warmup_steps=0", "optim.schedule=constant", "optim.clip_grad_norm=0"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.dense_layers=1"]


def _pieces(name, arr, muon):
    """(key, hpengine index, transposed) of each torch parameter a tensor becomes: a Muon matrix as torch's
    (out, in) weight, one per routed expert; anything else as it is."""
    if not muon:
        return [(name, (), False)]
    if arr.ndim == 2:
        return [(name, (), True)]
    return [(f"{name}[{e}]", (e,), True) for e in range(arr.shape[0])]


@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe"])
def test_five_steps_match_torch_muon_and_adamw(small_corpus, monkeypatch, extra):
    eng = build(load_config(None, [*TINY, *extra, f"data.path={small_corpus}"]))
    specs = eng.layout.by_name
    grads = []
    opt, step = eng.opts[0], eng.opts[0].step

    def recording(p, g, lr, grad_coef=1.0, copy=None):
        assert lr == LR and grad_coef == 1.0
        grads.append(np.array(g))
        step(p, g, lr, grad_coef, copy)
    opt.step = recording

    start = eng.named_params()
    params, where = {}, {}
    for name, arr in start.items():
        for key, idx, t in _pieces(name, arr, is_muon_matrix(specs[name])):
            x = arr[idx].T if t else arr[idx]
            params[key] = torch.tensor(np.ascontiguousarray(x), dtype=torch.float64, requires_grad=True)
            where[key] = (name, idx, t)
    muon = [k for k in params if is_muon_matrix(specs[where[k][0]])]
    assert muon and (not extra or any("experts" in k for k in muon))
    decayed = lambda keys, d: [params[k] for k in keys if specs[where[k][0]].decay == d]  # noqa: E731
    rest = [k for k in params if k not in muon]
    groups = [g for g in ({"params": decayed(rest, True)}, {"params": decayed(rest, False), "weight_decay": 0.0})
              if g["params"]]
    adamw = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    tm = torch.optim.Muon([params[k] for k in muon], lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                          adjust_lr_fn="match_rms_adamw")
    assert all(specs[where[k][0]].decay for k in muon)
    # torch casts the iteration's input to bfloat16; the oracle runs it in the parameters' float64
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.clone())

    for s in range(5):
        eng.train_step(s)
        flat = grads[-1]
        for key, (name, idx, t) in where.items():
            g = flat[eng.layout.ranges[name].slice].reshape(eng.layout.shapes[name])[idx]
            params[key].grad = torch.tensor(np.ascontiguousarray(g.T if t else g), dtype=torch.float64)
        tm.step()
        adamw.step()
        got = eng.named_params()
        for key, (name, idx, t) in where.items():
            want = params[key].detach().numpy()
            np.testing.assert_allclose(got[name][idx], want.T if t else want, rtol=0, atol=1e-9,
                                       err_msg=f"step {s + 1}: {key}")
    moved = max(float(np.abs(got[n] - start[n]).max()) for n in start)
    assert moved > 1e-3                 # the comparison is of a trajectory, not of parameters that barely moved
