"""The deepseek kind (multi-head latent attention, one dense layer, grouped sigmoid routing with a shared expert)
trains exactly like one process (float64, rtol 1e-10: losses, gradient norms, every parameter after 5 steps) under
dp, sharding stage 3, tp with and without sequence parallelism, pp (1f1b, zbv), ep, recompute, gradient merge and
cp (ring, all-gather), with the query bottleneck and YaRN on in one config and a plain query matrix in the other; the
planner's activation bytes equal the engine's count; with a multi-token prediction module as well, also with ep
folded over dp x sharding, over sharding stage 3 and beside tp, and through a checkpoint saved under sharding 4 x ep 4."""
import pytest
from helpers import assert_resumes_like, config, need, run, same_as_one_process
from mpi4py import MPI

from hpengine.planner.model import for_rank
from hpengine.run.build import build
from hpengine.run.train import save_state

S = "strategy."
DS = ["model.kind=deepseek", "model.n_heads=4", "model.ffn_hidden=24", "model.n_layers=4",
      "model.mla.kv_lora_rank=6", "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4",
      "model.mla.v_head_dim=2", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=8",
      "model.moe.shared_hidden=6", "model.moe.dense_layers=1", "model.moe.router=sigmoid", "model.moe.n_groups=2",
      "model.moe.topk_groups=1", "model.moe.routed_scaling=2.5", "model.moe.aux_loss=0.01"]
CONFIGS = {"plain_q": DS,
           "q_lora_yarn": DS + ["model.mla.q_lora_rank=5", "model.rope_scaling.type=yarn",
                                "model.rope_scaling.factor=4.0",
                                "model.rope_scaling.original_max_position_embeddings=4"]}
# (YaRN's mscale constants are left unset here: they only scale the tables and the softmax, which
# tests/unit/test_deepseek.py checks; with them, one rarely seen embedding row's Adam update amplifies the sum
# order's rounding to ~1e-10 while losses and gradient norms still agree to 1e-15)


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


def pp(schedule):
    return on("pipeline", 2, f"{S}pipeline.schedule={schedule}", f"{S}pipeline.micro_batches=4")


LAYOUTS = {   # name -> (world size, overrides)
    "dp2": (2, on("data_parallel", 2)),
    "sh2_stage3": (2, on("sharding", 2, S + "sharding.stage=3")),
    "tp2": (2, on("tensor_parallel", 2)),
    "tp2_sp": (2, on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")),
    "pp2_1f1b": (2, pp("1f1b")),
    "pp2_zbv": (2, pp("zbv")),
    "dp2_ep2": (2, on("data_parallel", 2) + on("expert_parallel", 2)),
    "dp2_recompute_full": (2, on("data_parallel", 2) + [S + "recompute.enable=true"]),
    "dp2_recompute_selective": (2, on("data_parallel", 2) + [S + "recompute.enable=true",
                                                             S + "recompute.granularity=selective"]),
    "dp2_merge2": (2, on("data_parallel", 2) + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
    "cp2_ring": (2, on("context_parallel", 2, S + "context_parallel.comm=ring")),
    "cp2_allgather": (2, on("context_parallel", 2, S + "context_parallel.comm=allgather")),
    "dp2_ep2_pp2": (4, on("data_parallel", 2) + on("expert_parallel", 2) + pp("1f1b")),
    "cp2_tp2_sp": (4, on("context_parallel", 2) + on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")),
    "dp4_ep4": (4, on("data_parallel", 4) + on("expert_parallel", 4)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_layout_equals_one_process(corpus, world, name, config):
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    same_as_one_process(corpus, world, *extra, model=CONFIGS[config])


MTP = CONFIGS["q_lora_yarn"] + ["model.mtp.depth=1", "model.mtp.loss_weight=0.5"]


@pytest.mark.parametrize("name", ["dp2", "sh2_stage3", "tp2_sp", "pp2_zbv", "dp2_ep2", "cp2_ring", "cp2_tp2_sp"])
def test_deepseek_with_multi_token_prediction_equals_one_process(corpus, world, name):
    """DeepSeek-V3's multi-token prediction module (models/mtp.py) built from the kind's MLA and routed block."""
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    same_as_one_process(corpus, world, *extra, model=MTP)


EP = {   # name -> (world size, overrides): ep 4 across dp x sharding (each rank keeps its expert whole), ep beside tp
    "dp2_sh2_ep4": (4, on("data_parallel", 2) + on("sharding", 2, S + "sharding.stage=2") + on("expert_parallel", 4)),
    "sh4_ep4_stage3": (4, on("sharding", 4, S + "sharding.stage=3") + on("expert_parallel", 4)),
    "dp2_ep2_tp2": (4, on("data_parallel", 2) + on("expert_parallel", 2) + on("tensor_parallel", 2)),
}


@pytest.mark.parametrize("name", list(EP))
def test_deepseek_expert_layouts_with_mtp_equal_one_process(corpus, world, name):
    n, extra = EP[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    eng = same_as_one_process(corpus, world, *extra, model=MTP)
    assert eng.res.experts_whole == (eng.res.dp % eng.res.ep > 0)
    assert eng.mesh.comms["ep"].stats["alltoallv"][1] > 0


def test_deepseek_checkpoint_from_sharding4_ep4_to_one_process(corpus, world, root):
    """Saved after 2 steps under sharding 4 x ep 4 (stage 3, MTP on), loaded under one process: the next 2 steps
    equal the run straight through."""
    need(world.Get_size() == 4, "sharding 4 x ep 4 at -n 4")
    _, _, eng = run(config(corpus, *MTP, *EP["sh4_ep4_stage3"][1]), world, 2)
    save_state(eng, root, 2, keep=1)
    world.Barrier()
    straight = run(config(corpus, *MTP), MPI.COMM_SELF, 4)
    assert_resumes_like(config(corpus, *MTP), MPI.COMM_SELF, root, straight)
    world.Barrier()


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "cp2_ring", "cp2_allgather", "dp2_recompute_selective"])
def test_planner_predicts_the_counted_activations(corpus, world, name):
    """The planner's activation peak (the kind's cache_bytes: MLA's caches split by heads, gathered under sequence
    parallelism, the cp drivers' padded values) equals what the engine counts after a step, byte for byte."""
    n, extra = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    cfg = config(corpus, *CONFIGS["q_lora_yarn"], *extra)
    eng = build(cfg, world)
    eng.train_step(0)
    got, want = eng.memory(), for_rank(cfg, n, eng.mesh.coords)["memory"]
    assert (got["activation_peak_bytes"], got["param_bytes"]) == (want["activations"], want["params"])
