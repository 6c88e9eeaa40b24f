"""bfloat16 gradients in 2 bytes across ranks (amp.grad_dtype = "bfloat16" with packed storage: the gradients at
rest are bfloat16 bits, summed through float32 wire copies) train bit for bit like the float32 storage of the
same values: data parallel (with gradient merge), sharding stages 1, 2 and 3, a pipeline with a tied head (the
tied copies' allreduce), a zero-bubble pipeline (a split backward's W accumulating into what B was handed; under
ZB-V with the tied head and the embedding on one rank), tensor parallelism with sequence parallelism (the
replicated tensors' sum over tp) and MoE experts split over ep. The gradient bytes halve and equal the
planner's. The float32 storage's sums are rounded: the tied tensor after the tied allreduce and the owned
gradient the sync reduced are bfloat16 values. A checkpoint of a packed-gradient run resumes under float32."""
import ml_dtypes
import numpy as np
import pytest

from helpers import LLAMA, config, need, run
from hpengine.planner.model import for_rank
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

S = "strategy."
BF16 = ["model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16", S + "amp.grad_dtype=bfloat16"]
DP = [S + "data_parallel.enable=true"]
MERGE = [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]
SH = [S + "sharding.enable=true", S + "sharding.degree=2"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2"]
ZB = LLAMA + PP2 + ["model.n_layers=4", "train.global_batch=16", S + "pipeline.micro_batches=4"]
MOE = LLAMA + ["model.n_layers=3", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12",
               "model.moe.dense_layers=1", S + "expert_parallel.enable=true", S + "expert_parallel.degree=2"]
LAYOUTS = {     # name -> (world size, overrides)
    "dp2_merge_gpt": (2, DP + MERGE),
    "sh2_stage1_tied_gpt": (2, SH + [S + "sharding.stage=1", "model.tie_head=true"]),
    "sh2_stage2_merge_llama": (2, LLAMA + SH + MERGE + [S + "sharding.stage=2"]),
    "sh2_stage3_tied_llama": (2, LLAMA + SH + [S + "sharding.stage=3", "model.tie_head=true"]),
    "pp2_1f1b_tied_gpt": (2, PP2 + [S + "pipeline.micro_batches=2", "model.tie_head=true"]),
    "pp2_zb1p_llama": (2, ZB + [S + "pipeline.schedule=zb1p"]),
    "pp2_zbv_tied_llama": (2, ZB + [S + "pipeline.schedule=zbv", "model.tie_head=true"]),
    "tp2_sp_llama": (2, LLAMA + [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2",
                                 S + "tensor_parallel.sequence_parallel=true"]),
    "dp2_ep2_moe": (2, MOE + DP),
    "dp4_ep2_moe": (4, MOE + DP),
    "dp2_ep2_sh2_stage2_moe": (4, MOE + DP + [S + "data_parallel.degree=2", S + "sharding.enable=true",
                                              S + "sharding.degree=2", S + "sharding.stage=2"]),
    # ep across sharding ranks: each rank's expert block whole, summed over ep-dp on the float32 wire
    "sh2_ep2_stage1_moe": (2, MOE + SH + [S + "sharding.stage=1"]),
    "sh4_ep4_stage2_moe": (4, MOE + [S + "sharding.enable=true", S + "sharding.degree=4", S + "sharding.stage=2",
                                     S + "expert_parallel.degree=4"]),
    "cp2_llama": (2, LLAMA + [S + "context_parallel.enable=true", S + "context_parallel.degree=2"]),
    "pp2_zbv_tied_sh2_stage2": (4, ZB + SH + [S + "pipeline.schedule=zbv", "model.tie_head=true", S + "sharding.stage=2"]),
    "pp2_tied_dp2": (4, PP2 + DP + [S + "data_parallel.degree=2", S + "pipeline.micro_batches=2",
                                              "model.tie_head=true"]),
}


def is_bf16(a) -> bool:
    a = np.asarray(a, dtype=np.float32)
    return bool(np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a))


def grads_config(corpus, name, mode):
    return config(corpus, "runtime.backend=numpy", *BF16, *LAYOUTS[name][1], S + f"amp.bf16_storage={mode}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_grads_equal_float32_storage(corpus, world, name):
    need(world.Get_size() == LAYOUTS[name][0], f"{name} runs at -n {LAYOUTS[name][0]}")
    out = {mode: run(grads_config(corpus, name, mode), world, steps=2) for mode in ("float32", "packed")}
    (la, pa, ea), (lb, pb, eb) = out["float32"], out["packed"]
    assert eb.sync.storage.encoded and not ea.sync.storage.encoded and ea.sync.storage.rounds
    assert np.array_equal(la, lb), name
    assert all(pa[n].dtype == pb[n].dtype == np.float32 and np.array_equal(pa[n], pb[n]) for n in pa), name
    assert 2 * eb.memory()["grad_bytes"] == ea.memory()["grad_bytes"], name
    # every scratch and wire freed: what is left is the float32 owned gradient of the update
    assert not eb.sync.scratch and eb.sync.transient == eb.sync.update_grad > 0, name
    pred = for_rank(eb.cfg, world.Get_size(), eb.mesh.coords)["memory"]
    assert (eb.memory()["grad_bytes"], eb.memory()["param_bytes"]) == (pred["grads"], pred["params"]), name


@pytest.mark.parametrize("name", ["dp2_merge_gpt", "sh2_stage1_tied_gpt", "sh2_stage2_merge_llama",
                                  "pp2_1f1b_tied_gpt", "dp2_ep2_moe"])
def test_float32_storage_rounds_after_each_sum(corpus, world, name):
    """One step's passes, then the reduction as the engine runs it, checked at each stage: a sum of bfloat16
    values is rarely one, so these hold only because the sync rounds them."""
    need(world.Get_size() == LAYOUTS[name][0], f"{name} runs at -n {LAYOUTS[name][0]}")
    eng = build(grads_config(corpus, name, "float32"), world)
    eng._passes(0)
    for r in eng.tied:
        g = eng.sync.grads_for(r.block)[r.tensor]
        eng.mesh.comms["tied"].allreduce_(g)
        eng.sync.grads_done(r.block)
        assert np.abs(g).max() > 0 and is_bf16(g), name
    eng.sync.flush_deferred()
    g = eng.sync.reduce_grads()
    assert np.abs(g).max() > 0 and is_bf16(g), name


@pytest.mark.parametrize("name", ["sh2_stage2_merge_llama", "pp2_1f1b_tied_gpt"])
def test_packed_grads_checkpoint_resumes_under_float32(corpus, world, root, name):
    """Saved after 2 steps with packed gradients, loaded under float32 storage, 2 more: the straight run."""
    need(world.Get_size() == LAYOUTS[name][0], f"{name} runs at -n {LAYOUTS[name][0]}")
    want_losses, want_params, _ = run(grads_config(corpus, name, "float32"), world, steps=4)
    _, _, eng = run(grads_config(corpus, name, "packed"), world, steps=2)
    save_state(eng, root, 2, keep=2)
    world.Barrier()
    cfg = grads_config(corpus, name, "float32")
    resumed = build(cfg, world)
    assert restore(resumed, cfg, root) == 2
    losses = [resumed.train_step(s)["loss"] for s in (2, 3)]
    assert losses == list(want_losses[2:, 0]), name
    got = resumed.named_params()
    assert all(np.array_equal(got[n], want_params[n]) for n in want_params), name
