"""Expert parallel folded across data parallel x sharding (ep need not divide dp): the sharding ranks of a group
hold different experts, each keeps its expert block whole (summed over ep-dp) and shards the rest. The llama kind
with routed experts trains exactly like one process (float64, rtol 1e-10, 5 steps: losses, MoE figures, gradient
norms, every parameter) at dp 2 x sharding 2 x ep 4, sharding 4 x ep 4 at stages 1-3, sharding 2 x ep 2, and with
tp 2; bfloat16 amp within its tolerance; a checkpoint saved under sharding 4 x ep 4 (stages 1, 3) loads under one
process and back."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_resumes_like, assert_same, assert_same_params, config, need, run
from hpengine.run.train import save_state

STEPS = 5
S = "strategy."
MOE = ["model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12",
       "model.moe.shared_hidden=8", "model.moe.dense_layers=1", "model.moe.aux_loss=0.01", "model.moe.z_loss=0.001",
       "train.global_batch=8"]


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


def sharding(degree, stage, *more):
    return on("sharding", degree, f"{S}sharding.stage={stage}", *more)


LAYOUTS = {   # name -> (world size, overrides); every one has ep not dividing dp
    "dp2_sh2_ep4_stage2": (4, on("data_parallel", 2) + sharding(2, 2) + on("expert_parallel", 4)),
    "dp2_sh2_ep4_stage3_merge": (4, on("data_parallel", 2) + sharding(2, 3) + on("expert_parallel", 4)
                                 + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
    "sh4_ep4_stage1": (4, sharding(4, 1) + on("expert_parallel", 4)),
    "sh4_ep4_stage2_flat": (4, sharding(4, 2, S + "sharding.partition=flat") + on("expert_parallel", 4)),
    "sh4_ep4_stage3": (4, sharding(4, 3) + on("expert_parallel", 4)),
    "sh4_ep2_stage3": (4, sharding(4, 3) + on("expert_parallel", 2)),
    "sh2_ep2_stage3": (2, sharding(2, 3) + on("expert_parallel", 2)),
    "sh2_ep2_stage1": (2, sharding(2, 1) + on("expert_parallel", 2)),
    "tp2_sh2_ep2_stage3": (4, on("tensor_parallel", 2) + sharding(2, 3) + on("expert_parallel", 2)),
    "tp2_sp_sh2_ep2_stage2": (4, on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")
                              + sharding(2, 2) + on("expert_parallel", 2)),
}
_REF = {}


def reference(corpus):
    if "ref" not in _REF:
        losses, params, eng = run(config(corpus, *LLAMA, *MOE), MPI.COMM_SELF, STEPS)
        _REF["ref"] = losses, params, eng, eng.train_step(STEPS)
    return _REF["ref"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ep_across_sharding_equals_one_process(corpus, world, name):
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    losses, params, eng = run(config(corpus, *LLAMA, *MOE, *extra), world, STEPS)
    res, lay = eng.res, eng.stage.layout
    assert res.experts_whole and res.dp % res.ep and res.sh > 1
    ups = [sh for nm, sh in lay.shapes.items() if nm.endswith("moe.experts.up.w")]
    assert ups and all(sh[0] == 4 // res.ep for sh in ups)          # E / ep experts on this rank
    # the ep group is this rank's block of ep consecutive data replicas (sharding fastest)
    replica = res.replica(eng.mesh.coords)
    assert lay.ep_rank == replica % res.ep == eng.mesh.comms["ep"].rank
    assert eng.mesh.comms["ep-dp"].size == res.dp * res.sh // res.ep
    ref_l, ref_p, ref_eng, want = reference(corpus)
    assert_same(losses, ref_l)
    assert_same(eng.grad_norms, ref_eng.grad_norms)
    assert_same_params(params, ref_p)
    got = eng.train_step(STEPS)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max"):
        assert got[key] == pytest.approx(want[key], rel=1e-10), key
    assert eng.mesh.comms["ep"].stats["alltoallv"][1] > 0


def test_bfloat16_amp_across_sharding(corpus, world):
    """bfloat16 amp (float32 masters of the owned parts) at sharding 4 x ep 4 stage 2 within amp's tolerance."""
    need(world.Get_size() == 4, "sharding 4 x ep 4 at -n 4")
    amp = ("model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16")
    losses, _, eng = run(config(corpus, *LLAMA, *MOE, *sharding(4, 2), *on("expert_parallel", 4), *amp), world, 3)
    ref, _, _ = run(config(corpus, *LLAMA, *MOE, *amp), MPI.COMM_SELF, 3)
    assert eng.res.experts_whole and eng.master is not None
    np.testing.assert_allclose(losses, ref, rtol=1e-2)


@pytest.mark.parametrize("direction,stage", [("from_ep", 3), ("from_ep", 1), ("to_ep", 3)])
def test_checkpoint_between_sharding4_ep4_and_one_process(corpus, world, root, direction, stage):
    """Saved under sharding 4 x ep 4, loaded under one process (and the other way): every expert block comes back
    where the other layout keeps it, and training goes on exactly like the run straight through."""
    need(world.Get_size() == 4, "sharding 4 x ep 4 at -n 4")
    lay = (*sharding(4, stage), *on("expert_parallel", 4))
    if direction == "from_ep":
        _, _, eng = run(config(corpus, *LLAMA, *MOE, *lay), world, 2)
        save_state(eng, root, 2, keep=1)
    elif world.Get_rank() == 0:
        _, _, eng = run(config(corpus, *LLAMA, *MOE), MPI.COMM_SELF, 2)
        save_state(eng, root, 2, keep=1)
    world.Barrier()
    straight = run(config(corpus, *LLAMA, *MOE), MPI.COMM_SELF, 4)
    comm, on_ = (MPI.COMM_SELF, ()) if direction == "from_ep" else (world, lay)
    assert_resumes_like(config(corpus, *LLAMA, *MOE, *on_), comm, root, straight)
    world.Barrier()
