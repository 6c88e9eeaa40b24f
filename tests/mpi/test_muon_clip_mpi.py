"""MuonClip trains exactly like the one-process MuonClip run (float64, 5 steps, rtol 1e-10 on losses, gradient norms
and every parameter) under data parallel, sharding stages 1-3, the pipeline and tensor parallel: the largest logits
are the max over every rank's rows and micro-batches, and every rank holding a layer's weights scales them alike.
tau is set low enough that the first step clips every head, so a missed reduction or a scale on one holder shows."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, config, need, run, same_as_one_process

CLIP = ["optim.name=muon", "optim.muon_qk_clip=0.002"]
MODELS = {"gpt": CLIP, "llama": [*LLAMA, *CLIP]}




@pytest.mark.parametrize("kind", list(MODELS))
def test_data_parallel(corpus, world, kind):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    same_as_one_process(corpus, world, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}",
                         model=MODELS[kind])
    _, _, first = run(config(corpus, *MODELS[kind]), MPI.COMM_SELF, steps=1)
    assert (first.post.logits.table(np.asarray) > 0.002).all()      # the first step clipped every head


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding(corpus, world, stage):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    same_as_one_process(corpus, world, "strategy.sharding.enable=true", f"strategy.sharding.degree={n}",
                         f"strategy.sharding.stage={stage}", "model.tie_head=true", model=MODELS["llama"],
                         ref_extra=["model.tie_head=true"])


@pytest.mark.parametrize("kind", list(MODELS))
def test_pipeline_with_gradient_merge(corpus, world, kind):
    n = world.Get_size()
    need(n in (2, 4), "pp 2 (x dp 2) needs 2 or 4 ranks")
    same_as_one_process(corpus, world, "model.tie_head=true", "strategy.pipeline.enable=true",
                         "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2",
                         "strategy.pipeline.schedule=1f1b", "strategy.data_parallel.enable=true",
                         "strategy.data_parallel.degree=-1", "strategy.gradient_merge.enable=true",
                         "strategy.gradient_merge.k_steps=2", model=MODELS[kind],
                         ref_extra=["model.tie_head=true"])


@pytest.mark.parametrize("kind", list(MODELS))
def test_tensor_parallel(corpus, world, kind):
    """tp ranks hold other heads: each fills its heads' rows of the table and scales its own q/k columns."""
    n = world.Get_size()
    need(n in (2, 4), "tp 2 (x dp 2) needs 2 or 4 ranks")
    same_as_one_process(corpus, world, "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                         "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=-1", model=MODELS[kind])
