"""Packed documents (data.document_mask = true) under context parallelism: cp 2 and cp 4, ring and all-gather,
gpt and llama, cp 2 with data parallel, tensor parallel, a pipeline, gradient merge and recompute train
exactly like one process (float64, 5 steps, rtol 1e-10), each document split head-tail over the cp ranks; the
leak test through the engine's forward at cp 2 (changing every token of one document changes no logit of
another, bit for bit, and the logits are one process's) and the start-up line on the cp ranks' work."""
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run
from hpengine.config.load import load_config
from hpengine.data.batch import Batch
from hpengine.nn.context_split import document_split, document_work, split_work
from hpengine.run.build import build
from hpengine.run.runlog import cp_balance_line
from test_packed_mpi import MASK, reference, short_docs  # noqa: F401 - the fixture, used by name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_packed import logits  # noqa: E402 - the engine's forward to the logits, beside the unit packing tests

S = "strategy."
MODELS = {"gpt": ["model.n_heads=4"], "llama": LLAMA}
SEQ16 = ["model.seq_len=16"]        # cp 4 cuts a row into 8 chunks of two tokens


def cp(degree, comm, *more):
    return [S + "context_parallel.enable=true", f"{S}context_parallel.degree={degree}",
            f"{S}context_parallel.comm={comm}", *more]


LAYOUTS = {   # name -> (world size, model overrides, layout overrides)
    "cp2_ring": (2, [], cp(2, "ring")),
    "cp2_allgather": (2, [], cp(2, "allgather")),
    "cp4_ring": (4, SEQ16, cp(4, "ring")),
    "cp4_allgather": (4, SEQ16, cp(4, "allgather")),
    "cp2_dp2": (4, [], cp(2, "ring", S + "data_parallel.enable=true", S + "data_parallel.degree=2")),
    "cp2_tp2": (4, [], cp(2, "ring", S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2")),
    "cp2_tp2_sp": (4, [], cp(2, "allgather", S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2",
                             S + "tensor_parallel.sequence_parallel=true")),
    "cp2_pp2": (4, ["model.n_layers=4"], cp(2, "ring", S + "pipeline.enable=true", S + "pipeline.degree=2",
                                           S + "pipeline.schedule=1f1b", S + "pipeline.micro_batches=4")),
    "cp2_merge_recompute": (2, [], cp(2, "allgather", S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2",
                                      S + "recompute.enable=true")),
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(short_docs, world, layout, kind):
    size, model, strategy = LAYOUTS[layout]
    need(world.Get_size() == size, f"{layout} takes {size} ranks")
    losses, params, _ = run(config(short_docs, *MASK, *MODELS[kind], *model, *strategy), world)
    ref_l, ref_p, _ = reference(short_docs, *MODELS[kind], *model)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


# ------------------------------------------------------------------------------------- the leak test
B, T, V = 2, 16, 64          # V: the file's vocabulary
ROWS = [[5, 7, 4], [9, 2, 5]]        # documents per packed row


def make(path, kind, comm, *extra):
    cfg = load_config(None, [*MODELS[kind], f"model.seq_len={T}", "model.d_model=16",
                             "model.n_layers=2", "model.dtype=float64", "model.init_std=0.3",
                             f"train.global_batch={B}", "runtime.backend=numpy", f"data.path={path}", *MASK, *extra])
    eng = build(cfg, comm)
    eng.sync.params.data += np.random.default_rng(3).normal(0.0, 0.1, eng.sync.params.data.size)
    return eng


def packed(tokens):
    seg, pos = np.zeros((B, T), dtype=np.int64), np.zeros((B, T), dtype=np.int64)
    for r, lens in enumerate(ROWS):
        at = 0
        for d, n in enumerate(lens):
            seg[r, at:at + n], pos[r, at:at + n] = d, np.arange(n)
            at += n
    mask = np.ones((B, T), dtype=np.int64)
    mask[:, :-1] = seg[:, 1:] == seg[:, :-1]
    return Batch(tokens, np.roll(tokens, -1, axis=1), pos, seg, mask)




@pytest.mark.parametrize("how", ["ring", "allgather"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_no_document_leaks_under_cp2(short_docs, world, kind, how):
    need(world.Get_size() == 2, "cp 2 takes 2 ranks")
    rank = world.Get_rank()
    eng = make(short_docs, kind, world, *cp(2, how))
    tokens = np.random.default_rng(1).integers(0, V, (B, T))
    changed = tokens.copy()
    changed[0, 5:12] = (changed[0, 5:12] + 1 + np.arange(7)) % V       # every token of row 0's second document
    mine = document_split(packed(tokens).segments, 2)[:, rank * T // 2:(rank + 1) * T // 2]    # (B, T / 2) columns
    a = logits(eng, packed(tokens).split_sequence(2, rank))
    b = logits(eng, packed(changed).split_sequence(2, rank))
    keep = np.ones((B, T), dtype=bool)
    keep[0, 5:12] = False
    keep = np.take_along_axis(keep, mine, axis=1)
    assert np.array_equal(a[keep], b[keep])                            # bit for bit
    moved = world.allreduce(int(not np.array_equal(a[~keep], b[~keep])))
    assert moved > 0                                                   # the changed document's logits moved
    whole = logits(make(short_docs, kind, MPI.COMM_SELF), packed(tokens))
    np.testing.assert_allclose(a, np.take_along_axis(whole, mine[..., None], axis=1), rtol=1e-10, atol=1e-12)


def test_start_up_reports_the_cp_balance(short_docs, world):
    """The start-up line's per-rank work, of the per-document split and of the head-tail split of every row,
    each adds up to every visible query-key pair of the first batch, and each is the one its split's own
    ranks hold (the Batch's split of the first batch, summed over each rank's part)."""
    need(world.Get_size() == 2, "cp 2 takes 2 ranks")
    eng = build(config(short_docs, *MASK, *cp(2, "ring")), world)
    line = cp_balance_line(eng, eng.cfg)
    whole = eng.data.batch("train", 0, eng.slots[0].seed, eng.cfg.train.global_batch, tokens=False)
    ours, rows = ([int(w) for w in part.split("]")[0].split(", ")] for part in line.split("per rank [")[1:])
    held = [int((whole.split_sequence(2, r).positions + 1).sum()) for r in range(2)]
    assert ours == held == split_work(whole.segments, whole.positions, 2).tolist()
    assert rows == document_work(whole.positions, 2).tolist()
    assert sum(ours) == sum(rows) == int((whole.positions + 1).sum())
    assert f"busiest / mean = {max(ours) / np.mean(ours):.3f}" in line
    assert f"would give {max(rows) / np.mean(rows):.3f}" in line
