"""DeepSeek-V3 routing (sigmoid scores, group-limited selection, routed scaling, aux-loss-free biases) trains
exactly like one process (float64, rtol 1e-10: losses, gradient norms, the biases after every step, every
parameter) under dp 2, dp 2 x ep 2, dp 4 x ep 4 and dp 2 x ep 2 x pp 2; the groups really change the run."""
import numpy as np
import pytest
from helpers import LLAMA, assert_same, assert_same_params, config, need
from mpi4py import MPI
from test_moe_mpi import MOE, on, pp

from hpengine.run.build import build

STEPS = 3
GROUPS = ["model.moe.num_experts=8", "model.moe.router=sigmoid", "model.moe.n_groups=4", "model.moe.topk_groups=2",
          "model.moe.routed_scaling=2.5", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {   # name -> (world size, overrides)
    "dp2": (2, on("data_parallel", 2)),
    "dp2_ep2": (2, on("data_parallel", 2) + on("expert_parallel", 2)),
    "dp4_ep4": (4, on("data_parallel", 4) + on("expert_parallel", 4)),
    "dp2_ep2_pp2": (4, on("data_parallel", 2) + on("expert_parallel", 2) + pp(2, "1f1b")),
}
_REF = {}


def routed_run(cfg, comm, steps):
    """Per step (loss, grad norm, the biases), and the engine."""
    eng = build(cfg, comm)
    out = []
    for s in range(steps):
        m = eng.train_step(s)
        out.append((m["loss"], m["grad_norm"], np.array(eng.router_bias.bias)))
    return out, eng


def reference(corpus, *extra):
    if extra not in _REF:
        steps, eng = routed_run(config(corpus, *LLAMA, *MOE, *GROUPS, *extra), MPI.COMM_SELF, STEPS)
        _REF[extra] = steps, eng.named_params()
    return _REF[extra]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grouped_routing_equals_one_process(corpus, world, name):
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    got, eng = routed_run(config(corpus, *LLAMA, *MOE, *GROUPS, *extra), world, STEPS)
    want, params = reference(corpus)
    for (l, g, b), (rl, rg, rb) in zip(got, want, strict=True):
        assert_same([l, g], [rl, rg])
        assert_same(b, rb)
    assert_same_params(eng.named_params(), params)
    assert (got[-1][2] != got[0][2]).any()                  # the biases move
    # every group open is DeepSeek's routing without groups: another run
    ungrouped = reference(corpus, "model.moe.topk_groups=4")[0]
    assert abs(ungrouped[-1][0] - want[-1][0]) > 1e-6 * abs(want[-1][0])
