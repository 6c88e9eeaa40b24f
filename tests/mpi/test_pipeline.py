"""Pipeline parallel trains exactly like one process: every schedule at pp = world size, pipeline with
data parallel and with sharding stages 1-3, and a tied head split across the first and last stage."""
import pytest

from helpers import LLAMA, assert_same, assert_same_params, config, need, reference, run

LAYERS = ["model.n_layers=8"]   # enough blocks for 4 stages x 2 virtual stages
MODELS = {"gpt": [], "llama": LLAMA}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("schedule,v", [("fthenb", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_schedules(corpus, world, schedule, v, kind):
    n = world.Get_size()
    need(n in (2, 4), "pp = world size over 8 blocks x 2 virtual stages needs 2 or 4 ranks")
    cfg = config(corpus, *LAYERS, *MODELS[kind], "strategy.pipeline.enable=true", f"strategy.pipeline.degree={n}",
                 f"strategy.pipeline.schedule={schedule}", f"strategy.pipeline.virtual_stages={v}",
                 "strategy.pipeline.micro_batches=4", "train.global_batch=8")
    losses, params, eng = run(cfg, world)
    ref_l, ref_p, ref = reference(corpus, *LAYERS, *MODELS[kind])
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)
    if schedule == "1f1b":
        assert eng.pipe.peak_live <= n


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pipeline_with_sharding(corpus, world, stage):
    n = world.Get_size()
    need(n == 4, "pp 2 x sharding 2 needs 4 ranks")
    cfg = config(corpus, *LAYERS, "strategy.pipeline.enable=true", "strategy.pipeline.degree=2",
                 "strategy.pipeline.micro_batches=2", "strategy.sharding.enable=true",
                 "strategy.sharding.degree=2", f"strategy.sharding.stage={stage}")
    losses, params, eng = run(cfg, world)
    ref_l, ref_p, _ = reference(corpus, *LAYERS)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("kind", list(MODELS))
def test_pipeline_with_data_parallel_and_tied_head(corpus, world, kind):
    n = world.Get_size()
    need(n in (2, 4), "pp 2 (x dp 2) needs 2 or 4 ranks")
    cfg = config(corpus, *LAYERS, *MODELS[kind], "model.tie_head=true", "strategy.pipeline.enable=true",
                 "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2",
                 "strategy.pipeline.schedule=1f1b", "strategy.data_parallel.enable=true",
                 "strategy.data_parallel.degree=-1")
    losses, params, eng = run(cfg, world)
    ref_l, ref_p, _ = reference(corpus, *LAYERS, *MODELS[kind], "model.tie_head=true")
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


# (overrides, which world sizes it fits); each rank's expected reads follow from its stage and tp rank
READS = {
    "pp_fthenb": (["strategy.pipeline.enable=true", "strategy.pipeline.degree=-1", "strategy.pipeline.micro_batches=2"],
                  lambda n: n in (2, 4)),
    "pp_zbv": (["strategy.pipeline.enable=true", "strategy.pipeline.degree=-1", "strategy.pipeline.schedule=zbv",
                "strategy.pipeline.micro_batches=8"], lambda n: n in (2, 4)),
    "tp2_pp2": (["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                 "strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2"],
                lambda n: n == 4),
}


@pytest.mark.parametrize("layout", list(READS))
def test_rows_are_read_by_the_edge_stages_once_per_tp_group(corpus, world, layout):
    """Only the stages holding the first or the last chunk read rows, tp rank 0 of each group alone, and the
    training is still the one-process run's."""
    extra, fits = READS[layout]
    need(fits(world.Get_size()), f"{layout} does not fit {world.Get_size()} ranks")
    steps = 5           # reference() trains 5
    losses, params, eng = run(config(corpus, *LAYERS, *extra), world, steps=steps)
    pipe, tp = eng.pipe, eng.mesh.comms["tp"]
    edge = pipe.stage in (pipe.place.stage_of(0), pipe.place.stage_of(pipe.V - 1))
    want = steps * eng.res.share if edge and tp.rank == 0 else 0
    assert eng.data.rows_read == want, (eng.mesh.prefix(), eng.data.rows_read, want)
    assert sum(world.allgather(eng.data.rows_read)) == steps * eng.res.share * len(
        {pipe.place.stage_of(0), pipe.place.stage_of(pipe.V - 1)})
    if layout == "pp_zbv":          # the V shape puts both ends on stage 0: every other stage reads nothing
        assert edge == (pipe.stage == 0)
    ref_l, ref_p, _ = reference(corpus, *LAYERS)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)
