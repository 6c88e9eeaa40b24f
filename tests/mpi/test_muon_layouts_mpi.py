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
SH2 = [S + "sharding.enable=true", S + "sharding.degree=2"]
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
    # a model's Newton-Schulz work also goes to sharding ranks that hold none of it
    "sh2_two_models": (2, SH2 + [S + "sharding.stage=2"], ["train.models=2"]),
    "sh2_dp2_stage3": (4, SH2 + [S + "sharding.stage=3", S + "data_parallel.enable=true",
                                 S + "data_parallel.degree=2"], []),
    "sh4_two_models_stage1": (4, [S + "sharding.enable=true", S + "sharding.degree=4"], ["train.models=2"]),
    "sh2_dp2_moe": (4, SH2 + [S + "sharding.stage=2", S + "data_parallel.enable=true",
                              S + "data_parallel.degree=2"], MOE),
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
    _assert_divided(world, eng, 0.6 if n == 2 else 0.3)


def _balance_layouts(n: int) -> dict:
    sh = [S + "sharding.enable=true", f"{S}sharding.degree={n}"]
    return {"dp": DP, **{f"sharding_stage{k}": sh + [f"{S}sharding.stage={k}"] for k in (1, 2, 3)},
            "sharding2_dp2": SH2 + [S + "data_parallel.enable=true", S + "data_parallel.degree=2"]}


@pytest.mark.parametrize("name", list(_balance_layouts(4)))
def test_four_owners_balance_the_newton_schulz_work(corpus, world, name):
    """The tiny GPT (2 layers: 8 matrices, works 4 x 16384, 2 x 12288, 2 x 4096) over 4 ranks of dp, sharding or
    both: the Newton-Schulz owners are chosen among every rank of the data-replica group, not within a sharding
    owner's range, so the busiest does 7/24 of the work (at most 0.3; the storage partition alone gives 0.5)."""
    need(world.Get_size() == 4, "4 owners need 4 ranks")
    _, _, eng = run(config(corpus, "optim.name=muon", *_balance_layouts(4)[name]), world, steps=2)
    _assert_divided(world, eng, 0.3)
    line = eng.describe()[0]
    assert "work imbalance 1.167" in line and "bytes imbalance" in line, line


def _assert_divided(world, eng, share: float) -> None:
    """Each matrix orthogonalised once a step on one rank (2 steps), the busiest rank at most `share` of it, as
    the ranks' own counters of the work they ran say."""
    whole = eng.sync.whole
    total = sum(sum(work) for _, _, work, _ in whole.loads)
    done = world.allgather(whole.work_done)
    assert sum(done) == 2 * total
    assert max(done) <= 2 * total * share, done
    assert "work imbalance" in eng.describe()[0]
