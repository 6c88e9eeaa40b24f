"""Muon: the Newton-Schulz iteration against the SVD, a whole optimizer step against a NumPy oracle written here
from torch.optim.Muon's equations (on torch's (out, in) orientation, expert by expert), AdamW's tensors bit for bit
as plain AdamW updates them, a trained step that is visibly orthogonalised, and the config's refusals."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.device.precision import round_bf16_
from hpengine.layout.resolve import LayoutError, check, resolve
from hpengine.models import build_model
from hpengine.optim import make_optimizer, optimizer_kind
from hpengine.optim.muon import newton_schulz
from hpengine.params.buffers import Layout, Range
from hpengine.run.build import build

TINY = ["model.kind=llama", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=24", "train.global_batch=4", "runtime.backend=numpy",
        "model.dtype=float64", "train.log_every=1000"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.dense_layers=1"]
MUON = ["optim.name=muon", "optim.weight_decay=0.1", "optim.betas=[0.9, 0.95]", "optim.eps=1e-8"]
QUINTIC = (3.4445, -4.775, 2.0315)


def _cfg(*extra, corpus=None):
    return load_config(None, [*TINY, *MUON, *extra] + ([f"data.path={corpus}"] if corpus else []))


# ---- the iteration ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_the_cubic_iteration_converges_to_the_polar_factor(shape):
    rng = np.random.default_rng(0)
    g = rng.standard_normal(shape) + 3 * np.eye(*shape)        # well conditioned: 60 steps converge fully
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    np.testing.assert_allclose(newton_schulz(np, g, (1.5, -0.5, 0.0), 60), u @ vt, rtol=0, atol=1e-12)


def test_the_quintic_iteration_puts_singular_values_near_one():
    rng = np.random.default_rng(1)
    for shape in [(32, 64), (64, 32), (48, 48), (3, 16, 24)]:
        s = np.linalg.svd(newton_schulz(np, rng.standard_normal(shape), QUINTIC, 5), compute_uv=False)
        # these coefficients trade convergence for slope at 0: they settle in about [0.68, 1.13], not at 1
        assert s.min() > 0.65 and s.max() < 1.2, (shape, s.min(), s.max())


def test_a_stack_is_orthogonalised_matrix_by_matrix():
    g = np.random.default_rng(2).standard_normal((3, 5, 7))
    got = newton_schulz(np, g, QUINTIC, 5)
    for e in range(3):
        np.testing.assert_allclose(got[e], newton_schulz(np, g[e], QUINTIC, 5), rtol=0, atol=1e-14)


# ---- a whole step against the equations -------------------------------------------------------

MUON_NAMES = ("attn.q.w", "attn.k.w", "attn.v.w", "attn.o.w", "mlp.gate.w", "mlp.up.w", "mlp.down.w",
              "moe.experts.gate.w", "moe.experts.up.w", "moe.experts.down.w")


def _oracle_ns(g, steps=5):
    """torch's _zeropower_via_newtonschulz without the bfloat16 cast, on one (out, in) matrix."""
    a, b, c = QUINTIC
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(np.linalg.norm(x), 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if g.shape[0] > g.shape[1] else x


class Oracle:
    """torch.optim.Muon on each block's matrices, torch.optim.AdamW on the rest."""

    def __init__(self, specs, lr, wd, betas, eps, mu=0.95, nesterov=True, rule="match_rms_adamw"):
        self.specs, self.lr, self.wd, self.betas, self.eps, self.mu = specs, lr, wd, betas, eps, mu
        self.nesterov, self.rule = nesterov, rule
        self.state, self.t = {}, 0

    def step(self, params, grads):
        self.t += 1
        b1, b2 = self.betas
        for s in self.specs:
            p, g = params[s.name], grads[s.name]
            if s.name.endswith(MUON_NAMES):
                buf = self.state.setdefault(s.name, np.zeros_like(g))
                buf += (1 - self.mu) * (g - buf)
                upd = buf - (buf - g) * (1 - self.mu) if self.nesterov else buf
                for e in range(p.shape[0]) if p.ndim == 3 else [None]:
                    w, u = (p, upd) if e is None else (p[e], upd[e])
                    wt, ut = w.T, u.T                       # torch's (out, in) weight and gradient
                    o = _oracle_ns(ut)
                    A, B = wt.shape
                    wt *= 1 - self.lr * self.wd
                    ratio = {"match_rms_adamw": 0.2 * math.sqrt(max(A, B)), "original": math.sqrt(max(1, A / B)),
                             "none": 1.0}[self.rule]
                    wt -= self.lr * ratio * o
            else:
                m, v = self.state.setdefault(s.name, (np.zeros_like(g), np.zeros_like(g)))
                m[...] = b1 * m + (1 - b1) * g
                v[...] = b2 * v + (1 - b2) * g * g
                if s.decay:
                    p *= 1 - self.lr * self.wd
                mh, vh = m / (1 - b1 ** self.t), v / (1 - b2 ** self.t)
                p -= self.lr * mh / (np.sqrt(vh) + self.eps)


def _layout(*extra):
    cfg = _cfg(*extra)
    return cfg, Layout(build_model(cfg.model).all_specs())


def _random_grads(layout, rng):
    return {n: rng.standard_normal(layout.shapes[n]) * 0.1 for n in layout.names}


@pytest.mark.parametrize("nesterov, rule", [(True, "match_rms_adamw"), (False, "original"), (True, "none")])
def test_a_muon_step_follows_the_equations_on_every_tensor(nesterov, rule):
    cfg, lay = _layout(*MOE, f"optim.muon_nesterov={str(nesterov).lower()}", f"optim.muon_lr_adjust={rule}")
    assert any(len(lay.shapes[n]) == 3 for n in lay.names)       # routed experts' stacks are in it
    rng = np.random.default_rng(3)
    flat = rng.standard_normal(lay.total) * 0.02
    opt = make_optimizer(cfg.optim, np, lay, Range(0, lay.total), np.float64)
    oracle = Oracle(lay.specs, 0.01, 0.1, (0.9, 0.95), 1e-8, nesterov=nesterov, rule=rule)
    mine = {n: flat[lay.ranges[n].slice].reshape(lay.shapes[n]) for n in lay.names}
    ref = {n: v.copy() for n, v in mine.items()}
    for _ in range(3):
        grads = _random_grads(lay, rng)
        opt.step(flat, np.concatenate([grads[n].reshape(-1) for n in lay.names]), 0.01)
        oracle.step(ref, grads)
    for n in lay.names:
        np.testing.assert_allclose(mine[n], ref[n], rtol=0, atol=1e-12, err_msg=n)


def test_the_adamw_tensors_are_plain_adamws_bit_for_bit():
    cfg, lay = _layout(*MOE)
    rng = np.random.default_rng(4)
    p0 = rng.standard_normal(lay.total) * 0.02
    pm, pa = p0.copy(), p0.copy()
    muon = make_optimizer(cfg.optim, np, lay, Range(0, lay.total), np.float64)
    adamw = make_optimizer(_cfg(*MOE, "optim.name=adamw").optim, np, lay, Range(0, lay.total), np.float64)
    for _ in range(3):
        g = rng.standard_normal(lay.total) * 0.1
        muon.step(pm, g, 0.01, grad_coef=0.7)
        adamw.step(pa, g, 0.01, grad_coef=0.7)
    rest = [n for n in lay.names if not n.endswith(MUON_NAMES)]
    assert any(n.endswith("router.w") for n in rest) and any(n.endswith("norm.w") for n in rest)
    for n in rest:
        sl, v = lay.ranges[n].slice, muon.state_at(lay.ranges[n].start)["muon_v"]
        assert np.array_equal(pm[sl], pa[sl]), n
        assert np.array_equal(muon.m[sl], adamw.m[sl]), n
        assert np.array_equal(muon.v[v:v + sl.stop - sl.start], adamw.v[sl]), n
    for n in lay.names:
        sl = lay.ranges[n].slice
        assert n.endswith(MUON_NAMES) != np.array_equal(pm[sl], pa[sl]), n


def test_muon_keeps_one_value_per_matrix_element_and_two_per_adamw_element():
    cfg, lay = _layout(*MOE)
    muon = make_optimizer(cfg.optim, np, lay, Range(0, lay.total), np.float64)
    matrices = [n for n in lay.names if n.endswith(MUON_NAMES)]
    adam = sum(lay.ranges[n].size for n in lay.names if n not in matrices)
    assert matrices and adam and muon.m.size == lay.total and muon.v.size == adam
    assert muon.nbytes() == 8 * (lay.total + adam)
    assert optimizer_kind("muon").values_of(lay.by_name[matrices[0]]) == 1
    v = 0
    for n in lay.names:        # a matrix's state is its momentum alone; AdamW's moments sit in the order of the range
        a = lay.ranges[n].start
        assert muon.state_at(a) == ({"muon_m": a} if n in matrices else {"muon_m": a, "muon_v": v}), n
        v += 0 if n in matrices else lay.ranges[n].size


def test_a_range_that_cuts_a_tensor_is_refused():
    cfg, lay = _layout()
    r = lay.ranges[lay.names[1]]
    with pytest.raises(ValueError, match="is cut by the owned range"):
        make_optimizer(cfg.optim, np, lay, Range(r.start + 1, r.stop), np.float64)


# ---- a trained step is orthogonalised ---------------------------------------------------------

def test_a_trained_step_is_orthogonalised_and_not_adamws(small_corpus):
    plain = ["optim.warmup_steps=0", "optim.schedule=constant", "optim.clip_grad_norm=0", "optim.weight_decay=0",
             "optim.lr=0.01"]
    updates = {}
    for name in ("muon", "adamw"):
        eng = build(_cfg(*plain, f"optim.name={name}", corpus=small_corpus))
        before = {n: np.array(v) for n, v in eng.named_params().items()}
        eng.train_step(0)
        updates[name] = {n: before[n] - v for n, v in eng.named_params().items()}
    mats = [n for n in updates["muon"] if n.endswith(MUON_NAMES)]
    assert len(mats) == 2 * 7
    for n in mats:
        u, a = updates["muon"][n], updates["adamw"][n]
        # at initialisation some gradients (attention's output projection) have directions ~1e-3 of their norm,
        # which five quintic steps do not lift (torch's neither): the upper half of the spectrum is the test
        k = min(u.shape) // 2
        scale = 0.01 * 0.2 * math.sqrt(max(u.shape))
        s = np.linalg.svd(u, compute_uv=False)[:k] / scale
        assert s.min() > 0.6 and s.max() < 1.25, (n, s)
        sa = np.linalg.svd(a, compute_uv=False)[:k] / scale
        assert sa.min() < 0.6 or sa.max() > 1.25, (n, sa)
        assert not np.allclose(u, a, rtol=0.1, atol=0), n


# ---- what the config refuses ------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("optim.muon_qk_clip=-0.5", "optim.muon_qk_clip = -0.5: must be >= 0"),
    ("optim.muon_lr_adjust='sqrt'", 'optim.muon_lr_adjust = "sqrt": must be one of "match_rms_adamw", "original", '
                                    '"none"'),
    ("optim.muon_ns_coefficients=[1.0, 2.0]", "optim.muon_ns_coefficients = [1.0, 2.0]: must be a list of "
                                              "exactly three numbers"),
    ("optim.muon_momentum=1.0", "optim.muon_momentum = 1.0: must be >= 0 and < 1"),
    ("optim.muon_ns_steps=0", "optim.muon_ns_steps = 0: must be >= 1 and < 100"),
])
def test_bad_muon_keys_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert str(e.value) == message


def test_a_partition_that_cuts_tensors_is_refused_in_one_line():
    cfg = _cfg("strategy.sharding.enable=true", "strategy.sharding.partition=flat")
    with pytest.raises(LayoutError) as e:
        check(cfg, resolve(cfg, 2))
    assert str(e.value) == ("optim.name = 'muon' updates whole tensors on their owner; strategy.sharding.partition "
                            "= 'flat' cuts them: use partition = 'tensor'")


@pytest.mark.parametrize("extra", [[], ["strategy.data_parallel.enable=true"], ["strategy.sharding.enable=true"],
                                   ["strategy.pipeline.enable=true"], ["strategy.tensor_parallel.enable=true"],
                                   ["strategy.data_parallel.enable=true", "strategy.expert_parallel.enable=true",
                                    *MOE], ["strategy.context_parallel.enable=true"]])
def test_layouts_pass(extra):
    cfg = _cfg(*extra)
    world = 1 if not extra else 2
    check(cfg, resolve(cfg, world))


@pytest.mark.parametrize("amp", [[], ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16"],
                                 ["strategy.amp.enable=true", "strategy.amp.dtype=float16"]],
                         ids=["float32", "bf16 amp", "fp16 amp"])
def test_float32_and_amp_runs_train_and_write_the_compute_copy(small_corpus, amp):
    eng = build(_cfg("model.dtype=float32", *amp, corpus=small_corpus))
    losses = [eng.train_step(s)["loss"] for s in range(3)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert eng.opts[0].m.dtype == np.float32
    if amp:
        held, master = np.array(eng.sync.owned_params()), eng.master.copy()
        want = round_bf16_(np, master) if held.dtype == np.float32 else master.astype(held.dtype)
        np.testing.assert_array_equal(held, want)
