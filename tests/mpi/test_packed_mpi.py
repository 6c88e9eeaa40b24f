"""Packed documents (data.document_mask = true) train exactly like one process (float64, 5 steps, losses and
parameters, rtol 1e-10) under data parallel, sharding stage 3, tensor parallel with and without sequence
parallelism, pipelines under 1f1b and zbv and a pp 4 whose middle stages read the rows' documents themselves,
expert parallel, gradient merge and recompute, on a file of many short documents so most rows cross several
boundaries."""
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run

WORLD = MPI.COMM_WORLD
S = "strategy."
MODELS = {"gpt": ["model.n_heads=4"], "llama": LLAMA}
MASK = ["data.document_mask=true", "data.val_fraction=0.2"]


@pytest.fixture(scope="module")
def short_docs():
    """Documents of 2..9 tokens (vocab 64), written by rank 0 where every rank sees it."""
    from hpengine.data.format import sha256_text, write_token_file
    path = None
    if WORLD.Get_rank() == 0:
        d = tempfile.mkdtemp(prefix="hpengine-packed-")
        lengths = np.random.default_rng(7).integers(2, 10, size=300)
        n = int(lengths.sum())
        raw = os.path.join(d, "t.raw")
        (np.random.default_rng(8).integers(0, 64, n)).astype(np.uint16).tofile(raw)
        path = os.path.join(d, "docs.h5")
        write_token_file(path, raw, np.uint16, np.concatenate([[0], np.cumsum(lengths)]),
                         {"vocab_size": 64, "eos_id": -1, "tokenizer": "bytes", "tokenizer_sha256": sha256_text("bytes")})
    path = WORLD.bcast(path, root=0)
    yield path
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


_REF = {}


def reference(path, *extra):
    key = (path, extra)
    if key not in _REF:
        _REF[key] = run(config(path, *MASK, *extra), MPI.COMM_SELF)
    return _REF[key]


LAYOUTS = {
    "dp": [S + "data_parallel.enable=true", S + "data_parallel.degree=2"],
    "sharding3": [S + "sharding.enable=true", S + "sharding.degree=2", S + "sharding.stage=3"],
    "tp_sp": [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2",
              S + "tensor_parallel.sequence_parallel=true"],
    "tp": [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2"],
    "pp_1f1b": ["model.n_layers=4", S + "pipeline.enable=true", S + "pipeline.degree=2",
                S + "pipeline.schedule=1f1b", S + "pipeline.micro_batches=4"],
    "pp_zbv": ["model.n_layers=4", S + "pipeline.enable=true", S + "pipeline.degree=2",
               S + "pipeline.schedule=zbv", S + "pipeline.micro_batches=4"],
}
LOCAL = {"merge": [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"],
         "recompute": [S + "recompute.enable=true"],
         "selective": [S + "recompute.enable=true", S + "recompute.granularity=selective"]}
SAME_MODEL = {"pp_1f1b": ["model.n_layers=4"], "pp_zbv": ["model.n_layers=4"]}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(short_docs, world, layout, kind):
    need(world.Get_size() == 2, "these layouts take 2 ranks")
    losses, params, _ = run(config(short_docs, *MASK, *MODELS[kind], *LAYOUTS[layout]), world)
    ref_l, ref_p, _ = reference(short_docs, *MODELS[kind], *SAME_MODEL.get(layout, []))
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("switch", list(LOCAL))
def test_switches_equal_plain(short_docs, world, switch, kind):
    losses, params, _ = run(config(short_docs, *MASK, *MODELS[kind], *LOCAL[switch]), MPI.COMM_SELF)
    ref_l, ref_p, _ = reference(short_docs, *MODELS[kind])
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


def test_mask_changes_training(short_docs, world):
    """The mask is on: the same run without it trains otherwise."""
    losses, _, eng = reference(short_docs)
    assert eng.data.document_mask
    plain, _, _ = run(config(short_docs, "data.val_fraction=0.2"), MPI.COMM_SELF)
    assert not np.allclose(losses, plain)


def test_middle_pipeline_stages_read_the_documents_themselves(short_docs, world):
    """pp 4: the two middle stages read no tokens, only the rows' documents, and train as one process does."""
    need(world.Get_size() == 4, "pp 4 takes 4 ranks")
    deep = ["model.n_layers=4", S + "pipeline.enable=true", S + "pipeline.degree=4", S + "pipeline.schedule=1f1b",
            S + "pipeline.micro_batches=4"]
    for kind in MODELS:
        losses, params, _ = run(config(short_docs, *MASK, *MODELS[kind], *deep), world)
        ref_l, ref_p, _ = reference(short_docs, *MODELS[kind], "model.n_layers=4")
        assert_same(losses, ref_l)
        assert_same_params(params, ref_p)


def test_expert_parallel_moe(short_docs, world):
    """ep 2 on a dropless MoE llama: the experts' tokens travel with their documents' masks."""
    need(world.Get_size() == 2, "ep 2 takes 2 ranks")
    moe = [*LLAMA, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12",
           "model.moe.dense_layers=1", "model.moe.capacity_factor=0"]
    ep = [S + "data_parallel.enable=true", S + "data_parallel.degree=2", S + "expert_parallel.enable=true",
          S + "expert_parallel.degree=2"]
    losses, params, _ = run(config(short_docs, *MASK, *moe, *ep), world)
    ref_l, ref_p, _ = reference(short_docs, *moe)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)
