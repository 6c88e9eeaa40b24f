"""Context parallel's layout without MPI: the degree on the mesh axis cp (after tp unless mesh.order moves it),
the one-line refusals (seq_len not divisible by 2 cp, the mlp kind, MoE models), the sums over dp x cp, the
description, the planner's refusal and eval's folding of cp into data parallel."""
import pytest

from hpengine.apps.evaluate import _context_as_data_parallel
from hpengine.config.load import load_config, mesh_order
from hpengine.layout.reduction import reductions
from hpengine.layout.resolve import LayoutError, describe, resolve
from hpengine.layout.stage import build_stage
from hpengine.planner.model import predict_layout

BASE = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
        "train.global_batch=8"]


def cp(degree, *more):
    return ["strategy.context_parallel.enable=true", f"strategy.context_parallel.degree={degree}", *more]


def cfg(*extra):
    return load_config(None, BASE + list(extra))


def test_degree_order_and_groups():
    res = resolve(cfg(*cp(2), "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"), 4)
    assert (res.cp, res.dp, res.cp_comm, res.world) == (2, 2, "ring", 4)
    assert res.order == ("tp", "cp", "sharding", "dp", "pp") and res.degrees.cp == 2
    assert res.grad_axes == ("cp", "dp") and res.grad_group == "cp*dp"
    assert res.replicas == 2 and res.share == 4          # the cp ranks of a replica take the same rows
    alone = resolve(cfg(*cp(-1, "strategy.context_parallel.comm=allgather")), 4)
    assert (alone.cp, alone.cp_comm, alone.grad_group) == (4, "allgather", "cp")
    assert resolve(cfg(), 1).grad_group == "dp" and resolve(cfg(), 1).cp == 1


def test_an_order_without_cp_puts_it_after_tp():
    assert mesh_order(["dp", "tp", "sharding", "pp"]) == ("dp", "tp", "cp", "sharding", "pp")
    res = resolve(cfg(*cp(2), "mesh.order=['pp', 'cp', 'dp', 'sharding', 'tp']"), 2)
    assert res.order == ("pp", "cp", "dp", "sharding", "tp")
    assert resolve(cfg("mesh.order=['dp', 'tp', 'sharding', 'pp']"), 1).order == ("dp", "tp", "cp", "sharding", "pp")


@pytest.mark.parametrize("extra, words", [
    (["model.seq_len=12", *cp(4)], "seq_len 12 is not divisible by 8"),
    (["model.kind=mlp", *cp(2)], "needs a model with attention"),
    (["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.moe.num_experts=4",
      "model.moe.capacity_factor=1.0", *cp(2)],
     "strategy.context_parallel with model.moe.capacity_factor = 1.0: an expert's capacity is filled in token order"),
])
def test_refusals_are_one_line(extra, words):
    with pytest.raises(LayoutError) as e:
        resolve(cfg(*extra), 4 if "degree=4" in " ".join(extra) else 2)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_sequence_parallel_counts_the_cp_part():
    with pytest.raises(LayoutError, match=r"seq_len / context_parallel.degree = 6\) divisible by tensor_parallel"):
        resolve(cfg("model.seq_len=12", *cp(2), "strategy.tensor_parallel.enable=true",
                    "strategy.tensor_parallel.degree=4", "strategy.tensor_parallel.sequence_parallel=true",
                    "model.n_heads=4"), 8)


def test_description_names_cp_only_when_on():
    c = cfg(*cp(2))
    text = describe(c, resolve(c, 2))
    assert text.startswith("world 2: pp 1 x dp 1 x sharding 1 x cp 2 x tp 1")
    assert "context parallel: degree 2, ring; 4 tokens of each sequence per rank in 2 head-tail chunks" in text
    assert " cp " not in describe(cfg(), resolve(cfg(), 1)) and "context parallel" not in describe(cfg(), resolve(cfg(), 1))


def test_every_gradient_is_summed_over_cp():
    c = cfg(*cp(2))
    res = resolve(c, 2)
    stage = build_stage(c.model, res, 0, 0)
    assert all("cp" in r.sum_over and r.counted for r in reductions(stage, 0, False, True))
    assert not any("cp" in r.sum_over for r in reductions(stage, 0, False))


def test_planner_models_context_parallel():
    c = cfg(*cp(2))
    one, two = predict_layout(cfg(), resolve(cfg(), 1), None), predict_layout(c, resolve(c, 2), None)
    assert 0 < two["memory"]["activations"] < one["memory"]["activations"]
    assert set(two["stages"][0]["traffic"]["cp"]) == {"send", "recv", "allreduce"}


@pytest.mark.parametrize("strategy, want", [
    ({"context_parallel": {"enable": True, "degree": 2}}, {"enable": True, "degree": 2}),
    ({"context_parallel": {"enable": True, "degree": 2}, "data_parallel": {"enable": True, "degree": 2}},
     {"enable": True, "degree": 4}),
    ({"context_parallel": {"enable": True, "degree": -1}, "data_parallel": {"enable": True, "degree": 2}},
     {"enable": True, "degree": -1}),
])
def test_eval_runs_cp_ranks_as_data_parallel_replicas(strategy, want):
    _context_as_data_parallel(strategy)
    assert strategy["data_parallel"] == want and not strategy["context_parallel"]["enable"]
