"""Every strategy and degree the world allows trains exactly like one process (float64, 5 steps,
parameters and losses, rtol 1e-10) — docs/architecture.md, "the equivalence contract"."""
import pytest

from helpers import LLAMA, assert_same, assert_same_params, config, need, reference, run

MODELS = {"gpt": [], "llama": LLAMA}


def test_data_parallel(corpus, world):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    cfg = config(corpus, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}",
                 "strategy.data_parallel.bucket_mb=0.001")
    losses, params, eng = run(cfg, world)
    assert len(eng.sync.buckets) > 1          # several buckets really in flight
    ref_l, ref_p, _ = reference(corpus)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("partition", ["tensor", "flat"])
def test_sharding(corpus, world, stage, partition, kind):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    cfg = config(corpus, *MODELS[kind], "strategy.sharding.enable=true", f"strategy.sharding.degree={n}",
                 f"strategy.sharding.stage={stage}", f"strategy.sharding.partition={partition}",
                 "model.tie_head=true")
    losses, params, eng = run(cfg, world)
    ref_l, ref_p, _ = reference(corpus, *MODELS[kind], "model.tie_head=true")
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("stage", [1, 3])
def test_dp_times_sharding(corpus, world, stage):
    n = world.Get_size()
    need(n >= 4 and n % 2 == 0, "dp 2 x sharding needs >= 4 ranks")
    cfg = config(corpus, "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2",
                 "strategy.sharding.enable=true", "strategy.sharding.degree=-1",
                 f"strategy.sharding.stage={stage}")
    losses, params, eng = run(cfg, world)
    assert eng.mesh.degrees["dp"] == 2 and eng.mesh.degrees["sharding"] == n // 2
    ref_l, ref_p, _ = reference(corpus)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("kind", list(MODELS))
def test_two_models_one_partition(corpus, world, kind):
    """Seed claim 6: two models share one partition and one set of collectives; each trains as alone."""
    n = world.Get_size()
    extra = ["train.models=2", "train.model_seeds=[7, 11]", "train.model_lrs=[0.01, 0.003]", *MODELS[kind]]
    strat = (["strategy.sharding.enable=true", f"strategy.sharding.degree={n}", "strategy.sharding.stage=2"]
             if n > 1 else [])
    losses, params, eng = run(config(corpus, *extra, *strat), world)
    for i, (seed, lr) in enumerate([(7, 0.01), (11, 0.003)]):
        ref_l, ref_p, _ = reference(corpus, *MODELS[kind], f"train.seed={seed}", f"optim.lr={lr}")
        assert_same(losses[:, i], ref_l[:, 0])
        mine = {k[len(f"m{i}."):]: v for k, v in params.items() if k.startswith(f"m{i}.")}
        assert_same_params(mine, ref_p)
