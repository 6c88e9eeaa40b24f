"""The llama kind with routed experts trains exactly like one process (float64, rtol 1e-10: losses with the
balancing losses, the aux and z figures, gradient norms, every parameter) under data parallel, sharding
stages 1-3, pipelines (1f1b, interleaved, zb1p, zbv), full and selective recompute, gradient merge and flash
attention, with the experts replicated like every other weight, and under tensor parallelism (with and without
sequence parallelism) with every expert's width split over tp; bfloat16 amp within the amp tolerance of
test_combinations.py. With expert parallelism (experts split over ep ranks inside data parallel, rows moved
by all-to-all) the same, at dp 2 x ep 2, dp 4 x ep 2 and 4, pp 2 x dp 2 x ep 2, and with the experts sharded
over the sharding ranks (dp 2 x ep 2 x sharding 2 at stages 1-3, dp 4 x ep 4 x sharding 2 at stage 3); a
checkpoint saved under ep (sharded or not) loads under one process and back."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_resumes_like, assert_same, assert_same_params, config, need, run
from hpengine.run.train import save_state

STEPS = 3
S = "strategy."
MOE = ["model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12",
       "model.moe.shared_hidden=8", "model.moe.dense_layers=1", "model.moe.aux_loss=0.01", "model.moe.z_loss=0.001",
       "train.global_batch=8"]


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


def pp(degree, schedule, m=4, *more):
    return on("pipeline", degree, f"{S}pipeline.schedule={schedule}", f"{S}pipeline.micro_batches={m}", *more)


LAYOUTS = {   # name -> (world size, overrides)
    "dp2": (2, on("data_parallel", 2)),
    "sh2_stage3": (2, on("sharding", 2, S + "sharding.stage=3")),
    "pp2_1f1b_recompute": (2, pp(2, "1f1b") + [S + "recompute.enable=true"]),
    "pp2_zbv_selective": (2, pp(2, "zbv") + [S + "recompute.enable=true", S + "recompute.granularity=selective"]),
    "pp2_zb1p_merge_flash": (2, pp(2, "zb1p") + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2",
                                                "model.attention=flash"]),
    "dp2_sh2_stage2": (4, on("data_parallel", 2) + on("sharding", 2, S + "sharding.stage=2")),
    "pp2_interleaved_sh2_stage1": (4, pp(2, "interleaved", 2, S + "pipeline.virtual_stages=2")
                                   + on("sharding", 2, S + "sharding.stage=1")),
    "pp4_zbv": (4, pp(4, "zbv", 8, "model.n_layers=8")),
    # experts split over tp like the dense MLP (every width / tp), with and without sequence parallelism
    "tp2": (2, on("tensor_parallel", 2)),
    "tp2_sp_recompute": (2, on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true",
                               S + "recompute.enable=true")),
    "tp2_sp_pp2_zb1p_selective": (4, on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")
                                  + pp(2, "zb1p") + [S + "recompute.enable=true", S + "recompute.granularity=selective"]),
    "tp2_sh2_stage3": (4, on("tensor_parallel", 2) + on("sharding", 2, S + "sharding.stage=3")),
}
_REF = {}


def reference(corpus, *extra):
    """The one-process run, and the metrics of one more step (taken now: a cached engine's communicators are
    freed after the test that built it)."""
    if extra not in _REF:
        losses, params, eng = run(config(corpus, *LLAMA, *MOE, *extra), MPI.COMM_SELF, STEPS)
        _REF[extra] = losses, params, eng, eng.train_step(STEPS)
    return _REF[extra]


def assert_like_one_process(losses, params, eng, ref) -> dict:
    """STEPS steps of eng equal the one-process run (losses, gradient norms, parameters); one more step's
    metrics, the MoE figures among them, too. Returns those metrics."""
    ref_l, ref_p, ref_eng, want = ref
    assert_same(losses, ref_l)
    assert_same(eng.grad_norms, ref_eng.grad_norms)
    assert_same_params(params, ref_p)
    got = eng.train_step(STEPS)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max"):
        assert got[key] == pytest.approx(want[key], rel=1e-10), key
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_equals_one_process(corpus, world, name):
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    model = tuple(o for o in extra if o.startswith("model."))
    losses, params, eng = run(config(corpus, *LLAMA, *MOE, *extra), world, STEPS)
    ref = reference(corpus, *model)
    got = assert_like_one_process(losses, params, eng, ref)
    assert got["moe_load_imbalance"] == ref[3]["moe_load_imbalance"]
    assert len(got["moe_load_imbalance"]) == len(eng.moe.layers)
    assert min(got["moe_load_imbalance"]) >= 1.0


def test_moe_bfloat16(corpus, world):
    need(world.Get_size() == 2, "dp 2 at -n 2")
    amp = ("model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16")
    losses, _, _ = run(config(corpus, *LLAMA, *MOE, *on("data_parallel", 2), *amp), world, STEPS)
    ref_l = reference(corpus, *amp)[0]
    np.testing.assert_allclose(losses, ref_l, rtol=1e-2)


EP = ("strategy.expert_parallel.enable=true",)
EP_LAYOUTS = {   # name -> (world size, overrides): experts split over ep ranks inside the data-parallel ones
    "dp2_ep2": (2, on("data_parallel", 2) + on("expert_parallel", 2)),
    "dp4_ep2_recompute": (4, on("data_parallel", 4) + on("expert_parallel", 2) + [S + "recompute.enable=true"]),
    "dp4_ep4": (4, on("data_parallel", 4) + on("expert_parallel", 4)),
    "pp2_zb1p_dp2_ep2": (4, pp(2, "zb1p") + on("data_parallel", 2) + on("expert_parallel", 2)),
    "dp2_ep2_sh2_stage1_merge": (4, on("data_parallel", 2) + on("expert_parallel", 2) + on("sharding", 2)
                                 + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
    "dp2_ep2_sh2_stage2": (4, on("data_parallel", 2) + on("expert_parallel", 2)
                           + on("sharding", 2, S + "sharding.stage=2", S + "sharding.partition=flat")),
    "dp2_ep2_sh2_stage3": (4, on("data_parallel", 2) + on("expert_parallel", 2) + on("sharding", 2, S + "sharding.stage=3")),
    "dp4_ep4_sh2_stage3": (8, on("data_parallel", 4) + on("expert_parallel", 4) + on("sharding", 2, S + "sharding.stage=3")),
    "tp2_sp_dp2_ep2": (4, on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")
                       + on("data_parallel", 2) + on("expert_parallel", 2)),
    "tp2_dp2_ep2_sh2_stage2": (8, on("tensor_parallel", 2) + on("data_parallel", 2) + on("expert_parallel", 2)
                               + on("sharding", 2, S + "sharding.stage=2")),
}


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_expert_parallel_equals_one_process(corpus, world, name):
    n, extra = EP_LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    losses, params, eng = run(config(corpus, *LLAMA, *MOE, *extra), world, STEPS)
    ups = [sh for name, sh in eng.stage.layout.shapes.items() if name.endswith("moe.experts.up.w")]
    assert eng.res.ep > 1 and ups and all(sh[0] == 4 // eng.res.ep for sh in ups)     # E / ep experts here
    assert_like_one_process(losses, params, eng, reference(corpus))
    assert eng.mesh.comms["ep"].stats["alltoallv"][1] > 0


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("direction", ["from_ep", "to_ep"])
def test_expert_parallel_checkpoint_loads_under_other_layouts(corpus, world, root, direction, sharded):
    """Saved under ep = world size (or dp 2 x ep 2 x sharding 2 at stage 3), loaded under one process (and the
    other way): every expert block comes back where the other layout keeps it, and training goes on exactly as
    the one-process run straight through."""
    n = world.Get_size()
    need(n in (2, 4) and (n == 4 or not sharded), "ep over 2 or 4 ranks; sharded at -n 4")
    ep = (*on("data_parallel", n), *on("expert_parallel", n))
    if sharded:
        ep = (*on("data_parallel", 2), *on("expert_parallel", 2), *on("sharding", 2, S + "sharding.stage=3"))
    if direction == "from_ep":
        _, _, eng = run(config(corpus, *LLAMA, *MOE, *ep), world, 2)
        save_state(eng, root, 2, keep=1)
    elif world.Get_rank() == 0:
        _, _, eng = run(config(corpus, *LLAMA, *MOE), MPI.COMM_SELF, 2)
        save_state(eng, root, 2, keep=1)
    world.Barrier()
    straight = run(config(corpus, *LLAMA, *MOE), MPI.COMM_SELF, 4)
    comm, lay = (MPI.COMM_SELF, ()) if direction == "from_ep" else (world, ep)
    assert_resumes_like(config(corpus, *LLAMA, *MOE, *lay), comm, root, straight)
    world.Barrier()
