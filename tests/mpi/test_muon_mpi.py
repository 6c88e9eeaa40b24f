"""Muon trains exactly like the one-process Muon run (float64, 5 steps, rtol 1e-10 on losses, gradient norms and
every parameter) under every layout whose owners hold whole tensors: data parallel, sharding stages 1-3 (tensor
partition), the pipeline; a checkpoint written under sharding or tp 2 loads under another layout and continues exactly."""
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run, same_as_one_process
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

MUON = [*LLAMA, "optim.name=muon"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.dense_layers=1"]
MODELS = {"dense": MUON, "moe": MUON + MOE}




@pytest.mark.parametrize("kind", list(MODELS))
def test_data_parallel(corpus, world, kind):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    same_as_one_process(corpus, world, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}",
                         model=MODELS[kind])


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding(corpus, world, stage, kind):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    eng = same_as_one_process(corpus, world, "strategy.sharding.enable=true", f"strategy.sharding.degree={n}",
                               f"strategy.sharding.stage={stage}", "model.tie_head=true", model=MODELS[kind],
                               ref_extra=["model.tie_head=true"])
    assert eng.sync.owned.size < eng.layout.total        # each rank updates its own tensors only


@pytest.mark.parametrize("schedule", ["1f1b", "fthenb"])
def test_pipeline(corpus, world, schedule):
    n = world.Get_size()
    need(n in (2, 4), "pp 2 (x dp 2) needs 2 or 4 ranks")
    same_as_one_process(corpus, world, "model.tie_head=true", "strategy.pipeline.enable=true",
                         "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2",
                         f"strategy.pipeline.schedule={schedule}", "strategy.data_parallel.enable=true",
                         "strategy.data_parallel.degree=-1", model=MUON, ref_extra=["model.tie_head=true"])


def _layouts(n: int) -> dict:
    return {"one": [],
            "sharded": ["strategy.sharding.enable=true", f"strategy.sharding.degree={n}", "strategy.sharding.stage=2"],
            "tp 2": ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                     "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=-1"]}


@pytest.mark.parametrize("direction", [("sharded", "one"), ("one", "sharded"), ("tp 2", "one"), ("one", "tp 2"),
                                       ("tp 2", "sharded")])
def test_a_checkpoint_changes_layout_and_continues_exactly(corpus, world, root, direction):
    """The momentum buffers (and AdamW's moments of the other tensors) are saved by layout box and load under
    another layout: the run goes on exactly as the one-process run does."""
    n = world.Get_size()
    need(n > 1 and n % 2 == 0, "a sharded or tp 2 checkpoint needs an even number of ranks >= 2")
    a, b = (_layouts(n)[d] for d in direction)
    comm_a = MPI.COMM_SELF if not a and world.Get_rank() == 0 else (world if a else None)
    if comm_a is not None:
        _, _, eng_a = run(config(corpus, *MUON, *a), comm_a, steps=2)
        save_state(eng_a, root, 2, keep=2)
    world.Barrier()
    cfg_b = config(corpus, *MUON, *b)
    eng_b = build(cfg_b, world if b else MPI.COMM_SELF)
    assert restore(eng_b, cfg_b, root) == 2
    losses = [eng_b.train_step(s)["loss"] for s in range(2, 4)]
    ref_l, ref_p, _ = run(config(corpus, *MUON), MPI.COMM_SELF, steps=4)
    assert_same(losses, ref_l[2:, 0])
    assert_same_params(eng_b.named_params(), ref_p)
