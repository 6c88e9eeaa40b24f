"""The planner's branch and bound (planner/prune.py, planner/bound.py): the same ranked layouts and figures as the
exhaustive search where both run, floors that never exceed what a layout of their family predicts."""
from __future__ import annotations

import pytest

from hpengine.config.load import load_config
from hpengine.planner import bound, prune
from hpengine.planner.calibrate import GB
from hpengine.planner.model import predict_layout
from hpengine.planner.search import Cluster, PlanError, load_cluster, searched, with_preset

from pathlib import Path

A100 = str(Path(__file__).resolve().parents[2] / "clusters" / "a100_80gb_dgx.toml")

# (preset or [model] overrides, cluster, max micro-batch): dense GPT and Llama, a mixture of experts, context
# parallel (a long sequence), the shape-dependent GPU model and the CPU one
CASES = [
    ("gpt2-124m", Cluster(nodes=1, gpus_per_node=4, mem_gb=16), 2),
    ("1.3b", Cluster(nodes=2, gpus_per_node=4, mem_gb=24), 2),
    ("llama3.2-1b", Cluster(nodes=1, gpus_per_node=8, mem_gb=24), 1),
    ("small-moe", Cluster(nodes=1, gpus_per_node=8, mem_gb=16), 2),
    ("7b-a100", None, 1),
    ("long-seq", Cluster(nodes=1, gpus_per_node=8, mem_gb=40), 1),
]


def _case(name, cluster):
    if name == "7b-a100":
        return with_preset(load_config(None), "7b"), load_cluster(A100, nodes=2)
    if name == "small-moe":         # a Mixtral-like llama with 8 experts, top 2: ep degrees 2, 4, 8 in the search
        return load_config(None, ["model.kind=llama", "model.vocab_size=32000", "model.seq_len=2048",
                                  "model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=4",
                                  "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_hidden=2048",
                                  "train.global_batch=64"]), cluster
    if name == "long-seq":
        cfg = with_preset(load_config(None), "gpt2-124m")
        cfg.model.seq_len = 8192
        cfg.train.global_batch = 64
        return cfg, cluster
    return with_preset(load_config(None), name), cluster


@pytest.mark.parametrize("name,cluster,rows", CASES, ids=[c[0] for c in CASES])
def test_pruned_search_ranks_as_the_exhaustive_one(name, cluster, rows):
    cfg, cluster = _case(name, cluster)
    every, n, _ = searched(cfg, cluster, rows)                 # top None: every layout evaluated
    top = 10
    fit, evaluated, pruned = searched(cfg, cluster, rows, top)
    assert evaluated + pruned == n and pruned > 0
    assert [r["layout"] for r in fit[:top]] == [r["layout"] for r in every[:top]]
    if name == "small-moe":
        assert any(r["layout"].ep > 1 for r in every)
    for a, b in zip(fit[:top], every[:top]):
        assert a["time"] == b["time"] and a["memory"] == b["memory"] and a["tokens_per_s"] == b["tokens_per_s"]


def test_cp_one_search_for_the_reason_line():
    """`where` limits the prefixes; the cp = 1 best equals the exhaustive search's best among cp = 1 layouts."""
    cfg, cluster = _case("long-seq", Cluster(nodes=1, gpus_per_node=8, mem_gb=40))
    every, _, _ = searched(cfg, cluster, 1)
    flat = searched(cfg, cluster, 1, 1, where=lambda tp, cp, pp: cp == 1)[0]
    assert flat[0]["layout"] == next(r["layout"] for r in every if r["layout"].cp == 1)


def test_nothing_fits_names_the_same_smallest_layout():
    cfg = with_preset(load_config(None), "13b")
    cluster = Cluster(nodes=1, gpus_per_node=4, mem_gb=16)
    msgs = []
    for top in (None, 10):
        with pytest.raises(PlanError, match="no layout fits") as e:
            searched(cfg, cluster, 2, top)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("name,cluster,rows", CASES[:5], ids=[c[0] for c in CASES[:5]])
def test_floors_never_exceed_a_layout_of_their_family(name, cluster, rows):
    cfg, cluster = _case(name, cluster)
    checked = 0
    for i, fam in enumerate(prune.families(cfg, cluster, rows)):
        if i % 7:
            continue
        ids = (0, 1, fam.rep.pp - 1)
        quick = bound.quick_floor(cfg, fam.rep, cluster, ids, fam.stages)
        exact = bound.family_floor(cfg, fam.rep, cluster, ids, fam.stages)
        assert quick[0] <= exact[0] * (1 + 1e-12) and quick[1] <= exact[1]
        for _, lay in fam.leaves():
            r = predict_layout(cfg, lay, cluster, ids)
            assert exact[0] <= r["time"]["step"] * (1 + 1e-12) + prune.SLACK / 10
            assert exact[1] <= r["memory"]["total"]
            assert bound.leaf_memory_floor(cfg, lay, cluster, ids, fam.stages) <= r["memory"]["total"]
            checked += 1
    assert checked > 20


def test_floor_link_is_never_better_than_the_layout_link():
    """Under a mesh order that puts dp inside pp, the pp link depends on the split: the floor takes the best."""
    cfg = with_preset(load_config(None, ["mesh.order=[\"tp\", \"cp\", \"dp\", \"pp\", \"sharding\"]"]), "1.3b")
    cluster = Cluster(nodes=2, gpus_per_node=4, mem_gb=24)
    for fam in prune.families(cfg, cluster, 1):
        for _, lay in fam.leaves():
            for axis in ("tp", "cp", "pp"):
                a, b = bound.floor_link(lay, axis, cluster)
                la, lb = bound.pm.link(lay, axis, cluster)
                assert a <= la and b >= lb
    assert GB > 0
