"""MoE routing with a capacity and aux-loss-free router biases trains exactly like one process (float64, rtol
1e-10: losses, gradient norms, parameters, the dropped share and the biases after every step) under dp 2, dp 2 x
ep 2, pp 2, dp 4 x ep 4 and dp 2 x ep 2 with gradient merge; drops really happen and the biases really move. A
checkpoint saved under dp 2 x ep 2 carries the biases into one process, which goes on exactly; an amp step
skipped for overflow leaves the biases alone."""
import numpy as np
import pytest
from helpers import LLAMA, assert_same, assert_same_params, config, need
from mpi4py import MPI
from test_moe_mpi import MOE, on, pp

from hpengine.run.build import build
from hpengine.run.train import restore, save_state

STEPS = 3
S = "strategy."
ROUTING = ["model.moe.capacity_factor=1.0", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {   # name -> (world size, overrides)
    "dp2": (2, on("data_parallel", 2)),
    "dp2_ep2": (2, on("data_parallel", 2) + on("expert_parallel", 2)),
    "pp2_1f1b": (2, pp(2, "1f1b")),
    "dp4_ep4": (4, on("data_parallel", 4) + on("expert_parallel", 4)),
    "dp2_ep2_merge_pp2": (4, on("data_parallel", 2) + on("expert_parallel", 2) + pp(2, "zb1p", 2)
                          + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
}
_REF = {}


def routed_run(cfg, comm, steps, start=0, eng=None):
    """steps steps from `start`: per step (loss, grad norm, dropped share, the biases), and the engine."""
    eng = eng or build(cfg, comm)
    out = []
    for s in range(start, start + steps):
        m = eng.train_step(s)
        out.append((m["loss"], m["grad_norm"], m["moe_dropped"], np.array(eng.router_bias.bias)))
    return out, eng


def reference(corpus):
    if "ref" not in _REF:
        steps, eng = routed_run(config(corpus, *LLAMA, *MOE, *ROUTING), MPI.COMM_SELF, STEPS)
        _REF["ref"] = steps, eng.named_params()
    return _REF["ref"]


def assert_steps_same(got, want):
    for (l, g, d, b), (rl, rg, rd, rb) in zip(got, want, strict=True):
        assert_same([l, g, d], [rl, rg, rd])
        assert_same(b, rb)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_capacity_and_biases_equal_one_process(corpus, world, name):
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    got, eng = routed_run(config(corpus, *LLAMA, *MOE, *ROUTING, *extra), world, STEPS)
    want, params = reference(corpus)
    assert_steps_same(got, want)
    assert_same_params(eng.named_params(), params)
    assert all(d > 0 for _, _, d, _ in got)                 # the capacity drops assignments
    assert np.abs(got[-1][3]).sum() > 0 and (got[-1][3] != got[0][3]).any()     # the biases move


def test_biases_travel_in_a_checkpoint(corpus, world, root):
    """Saved under dp 2 x ep 2 after 2 steps, loaded under one process: 2 more steps as the straight run."""
    need(world.Get_size() == 2, "dp 2 x ep 2 at -n 2")
    ep = (*on("data_parallel", 2), *on("expert_parallel", 2))
    _, eng = routed_run(config(corpus, *LLAMA, *MOE, *ROUTING, *ep), world, 2)
    save_state(eng, root, 2, keep=1)
    world.Barrier()
    straight, ref = routed_run(config(corpus, *LLAMA, *MOE, *ROUTING), MPI.COMM_SELF, 4)
    cfg = config(corpus, *LLAMA, *MOE, *ROUTING)
    eng = build(cfg, MPI.COMM_SELF)
    assert restore(eng, cfg, root) == 2
    assert_same(np.array(eng.router_bias.bias), straight[1][3])
    got, eng = routed_run(cfg, MPI.COMM_SELF, 2, start=2, eng=eng)
    assert_steps_same(got, straight[2:])
    assert_same_params(eng.named_params(), ref.named_params())
    world.Barrier()


def test_skipped_step_leaves_the_biases(corpus, world):
    """float16 amp from a loss scale that overflows: the first step is skipped on every rank and the biases stay
    zero; the next one moves them."""
    n = world.Get_size()
    amp = ["model.dtype=float32", S + "amp.enable=true", S + "amp.init_scale=1e8", S + "amp.backoff=1e-5"]
    eng = build(config(corpus, *LLAMA, *MOE, *ROUTING, *amp, *(on("data_parallel", n) if n > 1 else [])), world)
    assert eng.train_step(0).get("skipped")
    assert not np.array(eng.router_bias.bias).any()
    m = eng.train_step(1)
    assert not m.get("skipped") and np.array(eng.router_bias.bias).any()
