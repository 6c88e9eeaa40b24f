"""Muon trains exactly like the one-process Muon run (float64, 5 steps, rtol 1e-10 on losses, gradient norms and
every parameter) where matrices are split or replicated: tensor parallel (with and without sequence parallel; the
routed experts too), expert parallel, context parallel, the pipeline's interleaved and zero-bubble schedules, data
parallel with gradient merge, recompute or two models in one partition; and data parallel divides the
Newton-Schulz work among its replicas instead of repeating it."""
import numpy as np
import pytest

from helpers import LLAMA, assert_same, assert_same_params, config, need, reference, run

S = "strategy."
MUON = [*LLAMA, "optim.name=muon"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.dense_layers=1"]
DP = [S + "data_parallel.enable=true", S + "data_parallel.degree=-1"]
TP2 = [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2"]
SP = [S + "tensor_parallel.sequence_parallel=true"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2", S + "pipeline.micro_batches=4"]
DEEP = ["model.n_layers=4", "train.global_batch=16"]      # two chunks a stage, four micro-batches
LAYOUTS = {     # name -> (world size, layout overrides, model overrides the reference shares)
    "tp2": (2, TP2, []),
    "tp2_sp": (2, TP2 + SP, []),
    "tp2_sp_moe": (2, TP2 + SP, MOE),
    "ep2_moe": (2, DP + [S + "expert_parallel.enable=true", S + "expert_parallel.degree=2"], MOE),
    "cp2": (2, [S + "context_parallel.enable=true", S + "context_parallel.degree=2"], []),
    "pp2_interleaved": (2, PP2 + [S + "pipeline.schedule=interleaved", S + "pipeline.virtual_stages=2"], DEEP),
    "pp2_zb1p": (2, PP2 + [S + "pipeline.schedule=zb1p"], DEEP),
    "pp2_zbv": (2, PP2 + [S + "pipeline.schedule=zbv"], DEEP + ["model.tie_head=true"]),
    "dp2_merge": (2, DP + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"], []),
    "dp2_recompute": (2, DP + [S + "recompute.enable=true", S + "recompute.every=1"], []),
    "dp2_two_models": (2, DP, ["train.models=2"]),
    "tp2_dp2": (4, TP2 + SP + DP, []),
    "tp2_sh2_stage2": (4, TP2 + [S + "sharding.enable=true", S + "sharding.degree=2", S + "sharding.stage=2"], []),
    "ep2_dp4_moe": (4, DP + [S + "expert_parallel.enable=true", S + "expert_parallel.degree=2"], MOE),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_is_exact(corpus, world, name):
    n, layout, model = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} needs {n} ranks")
    losses, params, eng = run(config(corpus, *MUON, *model, *layout), world)
    ref_l, ref_p, ref = reference(corpus, *MUON, *model)
    assert_same(losses, ref_l)
    assert_same(np.array(eng.grad_norms), np.array(ref.grad_norms))
    assert_same_params(params, ref_p)
    assert all(bool(np.isfinite(o.m).all()) for o in eng.opts if o is not None)


@pytest.mark.parametrize("model", [[], MOE])
def test_data_parallel_divides_the_newton_schulz_work(corpus, world, model):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    _, _, eng = run(config(corpus, *MUON, *model, *DP), world, steps=2)
    whole = eng.sync.whole
    total = sum(sum(work) for _, work, _ in whole.loads)
    done = world.allgather(whole.work_done)
    assert sum(done) == 2 * total                   # each matrix orthogonalised once a step, on one rank
    assert max(done) <= 2 * total * (0.6 if n == 2 else 0.3)
    assert "work imbalance" in eng.describe()[0]
