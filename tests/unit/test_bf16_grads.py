"""bfloat16 gradients (amp.grad_dtype = "bfloat16") in 2 bytes: with packed storage the gradients at rest are
bfloat16 bits, and a run trains bit for bit like the float32-storage run of the same values (the oracle), gpt
and llama, with gradient merge (several passes a step accumulating into the bits) and a tied head (a block
writing another block's gradients); its gradient bytes halve, as the planner predicts. The float32 storage's
roundings are there: the stored gradients are bfloat16 values after each block's backward and the reduced
gradient after the tied sum; and without bfloat16 gradients nothing is rounded."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.planner.model import for_rank
from hpengine.run.build import build

BF16 = ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16", "model.dtype=float32"]
GRADS = ["strategy.amp.grad_dtype=bfloat16"]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16", "train.global_batch=8",
        "optim.lr=3e-3", "optim.warmup_steps=2", "runtime.backend=numpy"]
KINDS = {"gpt": ["model.kind=gpt"], "llama": ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=48"]}
MERGE = ["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"]
TIED = ["model.tie_head=true"]


def is_bf16(a) -> bool:
    a = np.asarray(a, dtype=np.float32)
    return bool(np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a))


def engine(corpus, *extra):
    return build(load_config(None, [*TINY, f"data.path={corpus}", *BF16, *extra]), MPI.COMM_SELF)


def train(eng, steps=3):
    return [eng.train_step(s)["loss"] for s in range(steps)], eng.named_params()


@pytest.mark.parametrize("extra", [[], MERGE, TIED, MERGE + TIED], ids=["plain", "merge", "tied", "merge_tied"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_grads_equal_float32_storage(small_corpus, kind, extra):
    f32 = engine(small_corpus, *KINDS[kind], *GRADS, *extra, "strategy.amp.bf16_storage=float32")
    packed = engine(small_corpus, *KINDS[kind], *GRADS, *extra, "strategy.amp.bf16_storage=packed")
    assert packed.sync.grads.data.dtype == np.uint16 and f32.sync.grads.data.dtype == np.float32
    assert 2 * packed.memory()["grad_bytes"] == f32.memory()["grad_bytes"] == 4 * f32.layout.total
    (la, pa), (lb, pb) = train(f32), train(packed)
    assert la == lb
    assert all(pa[n].dtype == pb[n].dtype == np.float32 and np.array_equal(pa[n], pb[n]) for n in pa)
    # the last step's accumulated gradients at rest: the float32 storage's values are what the bits hold
    np.testing.assert_array_equal(packed.sync.grads.data, f32.sync.grads.data.view(np.uint32) >> 16)
    assert not packed.sync.scratch and packed.sync.transient == packed.sync.update_grad
    pred = for_rank(packed.cfg, 1, packed.mesh.coords)["memory"]
    assert (packed.memory()["grad_bytes"], packed.memory()["param_bytes"]) == (pred["grads"], pred["params"])
    assert for_rank(f32.cfg, 1, f32.mesh.coords)["memory"]["grads"] == f32.memory()["grad_bytes"]


def test_float32_storage_rounds_each_stage_and_only_under_bf16_grads(small_corpus):
    """After a pass of a tied-head model the stored gradients are bfloat16 values (the head wrote wte, the
    embedding's; both rounded), and so is the reduced one; with float32 gradients they are not."""
    for grads, want in ((GRADS, True), ([], False)):
        eng = engine(small_corpus, *KINDS["llama"], *TIED, *grads, "strategy.amp.bf16_storage=float32")
        eng.sync.begin_step()
        b = eng.rows.read("train", 0, eng.slots[0].seed)
        eng.forward_backward(eng.slots[0], b, float(b.tokens.size))
        stored = np.array(eng.sync.grads.data)
        assert np.abs(stored).max() > 0 and is_bf16(stored) == want
        assert is_bf16(eng._reduced_grads()) == want


def test_a_scratch_stays_open_while_a_call_holds_it(small_corpus):
    """Two grads_for of one block before their grads_done (a split backward's B of the next micro-batch before
    the W of this one): the first grads_done stores the bits and rounds the scratch it keeps; the second frees
    it. A block reading another's tensors holds that block's scratch too."""
    eng = engine(small_corpus, *KINDS["gpt"], *GRADS, *TIED, "strategy.amp.bf16_storage=packed")
    sync = eng.sync
    head = next(b for b, ds in sync.deps.items() if ds)
    dep = sync.deps[head][0]
    name = eng.stage.block_specs[dep][0].name
    sync.begin_step()
    a = sync.grads_for(head)
    a[name][...] = 1.0 + 2.0 ** -12          # not a bfloat16 value: rounds to 1
    b = sync.grads_for(dep)
    assert b is sync.scratch[dep] and sync.opens[dep] == 2
    sync.grads_done(head)
    assert sync.opens == {dep: 1} and np.all(b[name] == 1.0)
    assert np.all(sync.grads[name] == np.uint16(0x3F80))      # the bits of 1.0
    b[name][...] += 2.0 ** -7                                # 1 + 2^-7: a bfloat16 value
    sync.grads_done(dep)
    assert not sync.scratch and sync.transient == 0
    assert np.all(sync.grads[name] == np.uint16(0x3F81))
