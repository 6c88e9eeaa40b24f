"""Every combination of the seven switches, with parallel degrees that fit the world, for the GPT and the
Llama model kinds, trains like one process: float64 to rtol 1e-10 without amp; with amp (float16 or, in
every other case, bfloat16 compute) within AMP_RTOL of the float32 one-process run. Every other case with
tensor parallelism turns sequence parallelism on. At -n 8 a sample of 3-axis meshes runs."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from helpers import assert_same, assert_same_params, config, run

N = MPI.COMM_WORLD.Get_size()
AXES = {"dp": "data_parallel", "sharding": "sharding", "pp": "pipeline", "tp": "tensor_parallel"}
BASE = ["model.n_heads=4", "model.n_layers=4", "train.global_batch=16"]
# grouped-query (2 query heads per key/value head) with 4 key/value heads, so tp up to 4 splits them
KINDS = {"gpt": [], "llama": ["model.kind=llama", "model.d_model=32", "model.n_heads=8", "model.n_kv_heads=4",
                              "model.ffn_hidden=48"]}
STEPS = 3
# amp tolerance against the float32 one-process run (float16 has an 11-bit significand, ~5e-4 relative):
# losses to 1e-2 relative; the parameter update of the whole model (after - before, all tensors) to 5%.
AMP_LOSS_RTOL, AMP_UPDATE_RTOL = 1e-2, 5e-2


def factorizations(n, k):
    """Ordered k-tuples of degrees >= 2 whose product is n."""
    if k == 0:
        return [()] if n == 1 else []
    return [(d,) + rest for d in range(2, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def meshes(n):
    out = []
    for k in range(len(AXES) + 1):
        for axes in itertools.combinations(AXES, k):
            out += [dict(zip(axes, degs)) for degs in factorizations(n, k)]
    return out


def combos(n):
    """(mesh, recompute, gradient_merge, amp) for every mesh; the toggles all 8 ways (a sample at n=8)."""
    cases = [(mesh, rc, gm, amp) for mesh in meshes(n) for rc, gm, amp in itertools.product([0, 1], repeat=3)]
    if n >= 8:
        cases = [c for i, c in enumerate(cases) if len(c[0]) >= 3 and i % 3 == 0]
    return cases


def bf16(i):
    """Which amp cases run bfloat16: every other pair of cases, so both dtypes meet every mesh."""
    return (i // 2) % 2 == 1


def overrides(mesh, rc, gm, amp, i):
    o = []
    for axis, deg in mesh.items():
        o += [f"strategy.{AXES[axis]}.enable=true", f"strategy.{AXES[axis]}.degree={deg}"]
    if "sharding" in mesh:
        o.append(f"strategy.sharding.stage={1 + i % 3}")
    if "pp" in mesh:
        p = mesh["pp"]
        sched = ["fthenb", "1f1b", "interleaved"][i % 3] if 2 * p <= 4 else ["fthenb", "1f1b"][i % 2]
        o += ["strategy.pipeline.micro_batches=2" if sched != "interleaved" else f"strategy.pipeline.micro_batches={p}",
              f"strategy.pipeline.schedule={sched}"]
        if sched == "interleaved":
            o.append("strategy.pipeline.virtual_stages=2")
    if "tp" in mesh and i % 2:      # sequence parallelism in every other tp case
        o.append("strategy.tensor_parallel.sequence_parallel=true")
    if rc:
        o += ["strategy.recompute.enable=true", "strategy.recompute.every=2"]
    if gm:
        o += ["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"]
    if amp:             # float16 and bfloat16 (emulated, precision.py) take turns
        o += ["strategy.amp.enable=true", "model.dtype=float32"] + (["strategy.amp.dtype=bfloat16"] if bf16(i) else [])
    return o


_REF = {}


def reference(corpus, kind, dtype, steps=STEPS):
    """The one-process run in dtype; "bfloat16" is the one-process bfloat16 amp run."""
    if (kind, dtype, steps) not in _REF:
        prec = ([f"model.dtype={dtype}"] if dtype != "bfloat16" else
                ["model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16"])
        _REF[kind, dtype, steps] = run(config(corpus, *BASE, *KINDS[kind], *prec), MPI.COMM_SELF, steps)
    return _REF[kind, dtype, steps]


CASES = combos(N)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[" ".join(f"{a}{d}" for a, d in c[0].items()) + f" rc{c[1]} gm{c[2]} amp{c[3]}"
                              for c in CASES])
def test_combination(corpus, world, case, kind):
    mesh, rc, gm, amp = CASES[case]
    losses, params, eng = run(config(corpus, *BASE, *KINDS[kind], *overrides(mesh, rc, gm, amp, case)), world, STEPS)
    ref_dtype = "bfloat16" if amp and bf16(case) else "float32" if amp else "float64"
    ref_l, ref_p, ref_eng = reference(corpus, kind, ref_dtype)
    if amp:
        # float16 against the float32 run; bfloat16 against the one-process bfloat16 run, whose only
        # differences are float32 sums in another order, now and then rounding to the other bf16 neighbour
        np.testing.assert_allclose(losses, ref_l, rtol=AMP_LOSS_RTOL)
        # Adam normalises each gradient element, so tiny float16 differences in near-zero gradients move
        # single weights by up to ~lr: compare the whole update, not element by element
        init = reference(corpus, kind, ref_dtype, steps=0)[1]
        flat = lambda d: np.concatenate([np.ravel(d[n]) for n in sorted(ref_p)])  # noqa: E731
        upd_err = np.linalg.norm(flat(params) - flat(ref_p)) / np.linalg.norm(flat(ref_p) - flat(init))
        assert upd_err < AMP_UPDATE_RTOL, f"amp update differs from {ref_dtype} by {upd_err:.3%}"
        np.testing.assert_allclose(eng.grad_norms, ref_eng.grad_norms, rtol=AMP_LOSS_RTOL)
    else:
        assert_same(losses, ref_l)
        # global-norm clipping counts every parameter once, whatever the layout
        assert_same(eng.grad_norms, ref_eng.grad_norms)
        assert_same_params(params, ref_p)
