"""`hpengine eval` on N ranks reports the figures of one process (computed on COMM_SELF in the same test)
to rtol 1e-12, under the default layout (data parallel over every rank) and others; bad input stops
every rank with the same error."""
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, need, run
from hpengine.checkpoint.shards import CheckpointError
from hpengine.apps.evaluate import evaluate
from hpengine.run.train import save_state

N = MPI.COMM_WORLD.Get_size()


def on(name, deg):
    return [f"strategy.{name}.enable=true", f"strategy.{name}.degree={deg}"]


LAYOUTS = {  # world size -> extra --set layouts ([] = the default: data parallel over every rank)
    2: [[], on("tensor_parallel", 2), on("sharding", 2) + ["strategy.sharding.stage=3"],
        on("pipeline", 2) + ["strategy.pipeline.micro_batches=2"],
        on("tensor_parallel", 2) + ["strategy.tensor_parallel.sequence_parallel=true"], on("context_parallel", 2)],
    4: [[], on("pipeline", 2) + on("tensor_parallel", 2),
        on("sharding", 2) + ["strategy.sharding.stage=3"] + on("pipeline", 2)
        + ["strategy.pipeline.micro_batches=2"], on("context_parallel", 2) + on("data_parallel", 2)],
    8: [[], on("data_parallel", 2) + on("pipeline", 2) + on("tensor_parallel", 2)
        + ["strategy.pipeline.micro_batches=2"]],
}


@pytest.fixture(scope="module")
def ckpt(corpus, world):
    need(N > 1, "eval across ranks needs more than one")
    d = tempfile.mkdtemp(prefix="hpengine-eval-") if world.Get_rank() == 0 else None
    d = world.bcast(d, root=0)
    _, _, eng = run(config(corpus, *on("data_parallel", N)), world, steps=1)
    save_state(eng, d, 1, keep=1)
    world.Barrier()
    yield d
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("i", range(6))
@pytest.mark.parametrize("batch", [1, 3])
def test_eval_on_n_ranks_equals_one_process(ckpt, corpus, world, i, batch):
    need(N > 1 and i < len(LAYOUTS.get(N, [])), f"no layout {i} at world {N}")
    overrides = ["runtime.backend=numpy", *LAYOUTS[N][i]]
    got = evaluate(ckpt, corpus, overrides=overrides, batch=batch, world=world)
    want = evaluate(ckpt, corpus, overrides=["runtime.backend=numpy"], batch=batch, world=MPI.COMM_SELF)
    assert got["world"] == N and want["world"] == 1
    assert got["tokens"] == want["tokens"] and got["bytes"] == want["bytes"]
    for k in ("loss", "perplexity", "bits_per_byte"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=0), k
    assert len({repr(x) for x in world.allgather(got["loss"])}) == 1      # the same figure on every rank


def test_no_checkpoint_stops_every_rank(corpus, world):
    need(N > 1, "eval across ranks needs more than one")
    with pytest.raises(CheckpointError, match="checkpoint.every"):
        evaluate("/nonexistent/run", corpus, world=world)


def test_two_models_on_n_ranks_equal_one_process(corpus, world):
    need(N in LAYOUTS, f"no layout at world {N}")
    d = tempfile.mkdtemp(prefix="hpengine-eval2-") if world.Get_rank() == 0 else None
    d = world.bcast(d, root=0)
    try:
        _, _, eng = run(config(corpus, *on("data_parallel", N), "train.models=2", "train.model_seeds=[1, 5]"),
                        world, steps=1)
        save_state(eng, d, 1, keep=1)
        world.Barrier()
        got = evaluate(d, corpus, overrides=["runtime.backend=numpy", *LAYOUTS[N][1]], batch=2, world=world)
        want = evaluate(d, corpus, overrides=["runtime.backend=numpy"], batch=2, world=MPI.COMM_SELF)
        assert len(got["models"]) == 2 and got["models"][0]["loss"] != got["models"][1]["loss"]
        for g, w in zip(got["models"], want["models"]):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-12, abs=0)
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(d, ignore_errors=True)


def test_sequence_parallel_eval_of_an_odd_last_window(ckpt, world, tmp_path_factory):
    """A file whose last window holds an odd number of targets, under tp 2 with sequence parallelism
    asked for: the same figures as one process (evaluation keeps no activations, so it runs plain tp)."""
    need(N == 2, "tp 2 over 2 ranks")
    from hpengine.data import TokenFile, build_corpus
    path = None
    if world.Get_rank() == 0:
        d = tmp_path_factory.mktemp("odd")
        for extra in range(8):
            src = d / f"t{extra}.txt"
            src.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 40 + b"x" * extra)
            path = build_corpus([str(src)], str(d / f"odd{extra}.h5"))["path"]
            with TokenFile(path) as tf:
                if ((tf.n_tokens - 1) % 8) % 2:
                    break
    path = world.bcast(str(path), root=0)
    sp = ["runtime.backend=numpy", *on("tensor_parallel", 2), "strategy.tensor_parallel.sequence_parallel=true"]
    got = evaluate(ckpt, path, overrides=sp, batch=2, world=world)
    want = evaluate(ckpt, path, overrides=["runtime.backend=numpy"], batch=2, world=MPI.COMM_SELF)
    assert got["tokens"] == want["tokens"] and got["tokens"] % 8 % 2 == 1
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def short_docs(world):
    """Documents of 2..9 byte tokens, eos 0 ending each, in the checkpoint's bytes tokenizer; rank 0 writes it."""
    from hpengine.data.format import BYTES, sha256_text, write_token_file
    path = None
    if world.Get_rank() == 0:
        d = tempfile.mkdtemp(prefix="hpengine-evaldocs-")
        lengths = np.random.default_rng(3).integers(2, 10, size=120)
        ends = np.cumsum(lengths)
        toks = np.random.default_rng(4).integers(1, 256, int(ends[-1])).astype(np.uint8)
        toks[ends - 1] = 0
        toks.tofile(os.path.join(d, "t.raw"))
        path = os.path.join(d, "docs.h5")
        write_token_file(path, os.path.join(d, "t.raw"), np.uint8, np.concatenate([[0], ends]),
                         {"vocab_size": 256, "eos_id": 0, "tokenizer": BYTES, "tokenizer_sha256": sha256_text(BYTES)})
    path = world.bcast(path, root=0)
    yield path
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@pytest.mark.parametrize("i", range(6))
def test_document_masked_eval_on_n_ranks_equals_one_process(ckpt, short_docs, world, i):
    """Packed documents (data.document_mask = true) on every layout: pipeline stages, tp ranks and replicas
    see the windows' documents, and the figures are one process's."""
    need(N > 1 and i < len(LAYOUTS.get(N, [])), f"no layout {i} at world {N}")
    mask = ["runtime.backend=numpy", "data.document_mask=true"]
    got = evaluate(ckpt, short_docs, overrides=[*mask, *LAYOUTS[N][i]], batch=3, world=world)
    want = evaluate(ckpt, short_docs, overrides=mask, batch=3, world=MPI.COMM_SELF)
    plain = evaluate(ckpt, short_docs, overrides=["runtime.backend=numpy"], batch=3, world=MPI.COMM_SELF)
    assert got["tokens"] == want["tokens"] == plain["tokens"] - 119 and got["bytes"] == want["bytes"]
    for k in ("loss", "perplexity", "bits_per_byte"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=0), k
    assert want["loss"] != pytest.approx(plain["loss"], rel=1e-6)
