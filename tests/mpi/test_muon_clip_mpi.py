"""MuonClip trains exactly like the one-process MuonClip run (float64, 5 steps, rtol 1e-10 on losses, gradient norms
and every parameter) under data parallel, sharding stages 1-3, the pipeline, tensor parallel and context parallel
(ring and all-gather), and on packed documents: the largest logits are the max over every rank's rows,
micro-batches and queries, and every rank holding a layer's weights scales them alike. tau is set low enough that
the first step clips every head, so a missed reduction or a scale on one holder shows."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run, same_as_one_process
from hpengine.optim.qk_clip import QKClip
from test_packed_mpi import MASK, short_docs  # noqa: F401 - the fixture, used by name

TAU = 0.002
CLIP = ["optim.name=muon", f"optim.muon_qk_clip={TAU}"]
MODELS = {"gpt": CLIP, "llama": [*LLAMA, *CLIP]}
S = "strategy."


def cp2(comm):
    return [S + "context_parallel.enable=true", S + "context_parallel.degree=2", f"{S}context_parallel.comm={comm}",
            S + "data_parallel.enable=true", S + "data_parallel.degree=-1"]


@pytest.fixture
def maxima(monkeypatch):
    """Every step's maxima as the clip reads them (reduced over every rank), by id of the clip."""
    seen, apply = {}, QKClip.apply

    def spy(self, p, copy=None):
        seen.setdefault(id(self), []).append(self.max_all(self.logits.table(self.to_host)))
        apply(self, p, copy)
    monkeypatch.setattr(QKClip, "apply", spy)
    return seen


def same_clip_as_one_process(maxima, path, world, model, extra):
    """The run over world equals the one-process run, and so do every step's maxima reduced over every rank; on the
    first step every head is above tau, so the clip acted."""
    losses, params, eng = run(config(path, *model, *extra), world)
    ref_l, ref_p, ref = run(config(path, *model), MPI.COMM_SELF)
    assert_same(losses, ref_l)
    assert_same(np.array(eng.grad_norms), np.array(ref.grad_norms))
    assert_same_params(params, ref_p)
    want = np.array(maxima[id(ref.post)])
    assert_same(np.array(maxima[id(eng.post)]), want)
    assert want.shape[0] == 5 and (want[0] > TAU).all()



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


@pytest.mark.parametrize("comm", ["ring", "allgather"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_context_parallel(maxima, corpus, world, kind, comm):
    """Each cp rank measures its queries over every visible key in the drivers' block forward; the max over the
    ranks is one process's."""
    n = world.Get_size()
    need(n in (2, 4), "cp 2 (x dp 2) needs 2 or 4 ranks")
    same_clip_as_one_process(maxima, corpus, world, MODELS[kind], cp2(comm))


PACKED = {"gpt_dp": ("gpt", [S + "data_parallel.enable=true", S + "data_parallel.degree=-1"]),
          "llama_cp_ring": ("llama", cp2("ring")),
          "gpt_cp_allgather": ("gpt", cp2("allgather"))}


@pytest.mark.parametrize("layout", list(PACKED))
def test_packed_documents(maxima, short_docs, world, layout):  # noqa: F811 - the imported fixture
    """data.document_mask: only pairs within a document count, on one process and split over ranks alike."""
    n = world.Get_size()
    kind, extra = PACKED[layout]
    need(n in (2, 4), "dp 2 / cp 2 (x dp 2) needs 2 or 4 ranks")
    same_clip_as_one_process(maxima, short_docs, world, [*MASK, *MODELS[kind]], extra)
