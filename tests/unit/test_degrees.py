"""A layout is made of small validated parts: the degrees (with the mesh order and the folded ep axis), the
pipeline plan, the amp policy and the batch split; the layout's flat names read through to them."""
import pytest

from hpengine.config.load import load_config
from hpengine.layout.degrees import Degrees, TopologyError
from hpengine.layout.resolve import READ_THROUGH, resolve


def test_degrees_validate_and_describe_the_mesh():
    d = Degrees(tp=2, cp=2, sh=1, dp=4, pp=1, ep=2, order=("tp", "cp", "sharding", "dp", "pp"))
    assert d.world == 16 and d.replicas == 4 and d.by_axis == {"tp": 2, "cp": 2, "sharding": 1, "dp": 4, "pp": 1}
    assert d.folds == {"ep": (2, ("dp",), ("cp",))} and d.grad_axes == ("cp", "dp")
    assert d.replica({"dp": 3, "sharding": 0}) == 3
    assert Degrees(dp=4).folds == {} and Degrees(dp=4).grad_axes == ("dp",)
    with pytest.raises(TopologyError, match="degree tp = 0: must be a whole number >= 1"):
        Degrees(tp=0)
    with pytest.raises(TopologyError, match=r"mesh.order = \['dp', 'tp', 'cp'\]: must be a permutation"):
        Degrees(order=("dp", "tp"))          # an order without cp gets it right after tp, as a config does


def test_the_layout_reads_each_name_through_to_its_part():
    cfg = load_config(None, ["model.n_layers=4", "train.global_batch=16", "strategy.pipeline.enable=true",
                             "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=4",
                             "strategy.data_parallel.enable=true", "strategy.gradient_merge.enable=true",
                             "strategy.gradient_merge.k_steps=2"])
    res = resolve(cfg, 4)
    assert (res.degrees.pp, res.degrees.dp, res.pipeline.m, res.batch.share, res.batch.k) == (2, 2, 4, 8, 2)
    for part, names in READ_THROUGH.items():
        for name in names:
            assert getattr(res, name) == getattr(getattr(res, part), name), name
    assert res.rows == 1                  # 8 sequences a replica, 2 passes of 4 micro-batches
