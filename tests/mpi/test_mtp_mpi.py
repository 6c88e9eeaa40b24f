"""Multi-token prediction (model.mtp, depth 1) trains exactly like one process (float64, rtol 1e-10, 5 steps:
losses with the MTP loss in them, the mtp_loss metric, gradient norms, every parameter) under data parallel,
sharding stage 3, tp 2 with sequence parallelism, pp 2 under 1f1b (untied and tied head) and zbv, cp 2,
recompute, gradient merge and ep 2 on an MoE llama; with packed documents (data.document_mask) under dp, cp
and zbv; at 4 ranks tp 2 + sp x zbv and cp 2 x sharding 2. With loss_weight 0 one process trains bit for bit
as without MTP."""
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, TINY, assert_same, assert_same_params, need
from hpengine.config.load import load_config
from hpengine.run.build import build

WORLD = MPI.COMM_WORLD
STEPS = 5
S = "strategy."
MTP = ["model.mtp.depth=1", "model.mtp.loss_weight=0.5"]
MASK = ["data.document_mask=true", "data.val_fraction=0.2"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12", "model.moe.aux_loss=0.01"]


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


def pp(schedule):
    return ["model.n_layers=4"] + on("pipeline", 2, f"{S}pipeline.schedule={schedule}", f"{S}pipeline.micro_batches=4")


LAYOUTS = {     # name -> overrides at -n 2 (model.* ones go to the one-process run as well)
    "dp2": on("data_parallel", 2),
    "sh2_stage3": on("sharding", 2, S + "sharding.stage=3"),
    "tp2_sp": on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true"),
    "pp2_1f1b": pp("1f1b"),
    "pp2_1f1b_tied": pp("1f1b") + ["model.tie_head=true"],
    "pp2_zbv": pp("zbv"),
    "cp2": on("context_parallel", 2),
    "dp2_recompute": on("data_parallel", 2) + [S + "recompute.enable=true"],
    "dp2_merge": on("data_parallel", 2) + [S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"],
    "dp2_ep2_moe": on("data_parallel", 2) + on("expert_parallel", 2) + MOE,
}
WIDE = {       # at -n 4
    "tp2_sp_pp2_zbv": on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true") + pp("zbv"),
    "cp2_sh2_stage2": on("context_parallel", 2) + on("sharding", 2, S + "sharding.stage=2"),
}
DOC_LAYOUTS = {"dp2": LAYOUTS["dp2"], "cp2": LAYOUTS["cp2"], "pp2_zbv": LAYOUTS["pp2_zbv"]}


def run(path, comm, *extra):
    """STEPS steps; (losses, mtp losses, gradient norms) per step and the whole parameters."""
    cfg = load_config(None, TINY + LLAMA + [f"data.path={path}", *extra])
    eng = build(cfg, comm)
    ms = [eng.train_step(s) for s in range(STEPS)]
    out = np.array([[m["loss"], m.get("mtp_loss", np.nan), m["grad_norm"]] for m in ms])
    return out, eng.named_params()


_REF = {}


def reference(path, *extra):
    if (path, extra) not in _REF:
        _REF[(path, extra)] = run(path, MPI.COMM_SELF, *extra)
    return _REF[(path, extra)]


def assert_like_one_process(path, name, layout, *more, n=2):
    need(WORLD.Get_size() == n, f"{name} runs at -n {n}")
    got, params = run(path, WORLD, *MTP, *more, *layout)
    want, ref_p = reference(path, *MTP, *more, *(o for o in layout if o.startswith("model.")))
    assert np.isfinite(got).all() and (got[:, 1] > 0).all()
    assert_same(got, want)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_equals_one_process(corpus, name):
    assert_like_one_process(corpus, name, LAYOUTS[name])


@pytest.mark.parametrize("name", list(WIDE))
def test_mtp_equals_one_process_at_four_ranks(corpus, name):
    assert_like_one_process(corpus, name, WIDE[name], n=4)


@pytest.fixture(scope="module")
def short_docs():
    """Documents of 2..9 tokens (vocab 64), written by rank 0 where every rank sees it."""
    from hpengine.data.format import sha256_text, write_token_file
    path = None
    if WORLD.Get_rank() == 0:
        d = tempfile.mkdtemp(prefix="hpengine-mtp-")
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


@pytest.mark.parametrize("name", list(DOC_LAYOUTS))
def test_mtp_with_packed_documents_equals_one_process(short_docs, name):
    assert_like_one_process(short_docs, name, DOC_LAYOUTS[name], *MASK)


def test_weight_zero_trains_as_without_mtp(corpus):
    """loss_weight 0: the same losses and parameters bit for bit (clipping off: the global norm's sum of squares
    runs over the MTP tensors' zero gradients too, which can move its last bit), the MTP tensors' gradients zero."""
    need(WORLD.Get_size() == 1, "one process")
    off = ["optim.clip_grad_norm=0"]
    base, p0 = run(corpus, MPI.COMM_SELF, *off)
    zero, p1 = run(corpus, MPI.COMM_SELF, *off, "model.mtp.depth=1", "model.mtp.loss_weight=0")
    assert np.array_equal(base[:, 0], zero[:, 0]) and (zero[:, 1] > 0).all()
    np.testing.assert_allclose(base[:, 2], zero[:, 2], rtol=1e-14)
    assert all(np.array_equal(p0[n], p1[n]) for n in p0)
    cfg = load_config(None, TINY + LLAMA + [f"data.path={corpus}", *off, "model.mtp.depth=1", "model.mtp.loss_weight=0"])
    eng = build(cfg, MPI.COMM_SELF)
    eng._passes(0)
    g = eng.sync.grads_for("head")
    mtp = [s.name for s in eng.layout.specs if s.name.startswith("mtp.")]
    assert mtp and all(not np.any(g[n]) for n in mtp)
    assert np.any(g["norm.w"])
