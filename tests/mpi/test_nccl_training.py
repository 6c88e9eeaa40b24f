"""Training with runtime.collectives = "nccl" through the NumPy stand-in (nccl_standin.py) equals training
with "mpi" (float64, 1e-10: losses and every parameter) for data parallel, sharding stage 3 (uneven
all-gathers), tensor parallel, pipelines (1F1B, interleaved, ZB-V; tp x pp with scatter/gather at 4 ranks) and
the context-parallel ring: the device buffers' collectives and the pipeline's and the ring's sends and
receives went to the stand-in (which matches a channel's messages by issue order alone, so a wrong channel
would deliver another micro-batch's data), with MPI's counts and bytes. Where NCCL is missing on a rank, every
rank says so in one line and trains as with MPI. This checks the routing, not NCCL itself."""
import logging

import numpy as np
import pytest
from mpi4py import MPI
from nccl_standin import Device, Module

from helpers import assert_same, assert_same_params, config, need
from hpengine.run.build import build

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
S = "strategy."
STEPS = 3


def on(switch, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={N}", *more]


P2P = {"ncclSend", "ncclRecv"}
BF16 = ["model.dtype=float32", f"{S}amp.enable=true", f"{S}amp.dtype=bfloat16", f"{S}amp.bf16_storage=packed"]
LAYOUTS = {   # name -> (overrides, the NCCL calls that must have carried something, ranks it is written for)
    "dp": (on("data_parallel"), {"ncclAllReduce"}, 2),
    "sharding3": (on("sharding", f"{S}sharding.stage=3"), {"ncclBroadcast"}, 2),
    "tp": (["model.n_heads=4", *on("tensor_parallel")], {"ncclAllReduce"}, 2),
    "pp_1f1b": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.micro_batches=4")], {"ncclAllReduce", *P2P}, 2),
    "pp_interleaved": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.schedule=interleaved",
                                                 f"{S}pipeline.virtual_stages=2", f"{S}pipeline.micro_batches=4")],
                       {"ncclAllReduce", *P2P}, 2),
    "pp_zbv": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.schedule=zbv", f"{S}pipeline.micro_batches=4")],
               {"ncclAllReduce", *P2P}, 2),
    "tp_pp_scatter": (["model.n_heads=4", f"{S}tensor_parallel.enable=true", f"{S}tensor_parallel.degree=2",
                       f"{S}pipeline.enable=true", f"{S}pipeline.degree=2", f"{S}pipeline.micro_batches=2"],
                      {"ncclAllReduce", "ncclAllGather", *P2P}, 4),
    "cp_ring": (on("context_parallel"), {"ncclAllReduce", *P2P}, 2),
    # bfloat16 bits (uint16) only move: NCCL carries them as 16-bit values, the parameters' gathers included
    "sharding3_bf16_packed": (on("sharding", f"{S}sharding.stage=3", *BF16), {"ncclBroadcast"}, 2),
    "pp_zbv_bf16_packed": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.schedule=zbv",
                                                    f"{S}pipeline.micro_batches=4", *BF16)], P2P, 2),
}
POS_BYTES = 8 * (8 // 2)    # a ring's position message: seq_len / cp int64 positions, host memory (MPI's)


def train(cfg, device=None):
    """(losses, parameters, engine) after STEPS steps, the NCCL adapter `device` standing in for the GPU's."""
    eng = build(cfg, WORLD, nccl_device=device)
    losses = [eng.train_step(s)["loss"] for s in range(STEPS)]
    return np.array(losses), eng.named_params(), eng


def _check_p2p(layout, comms):
    """Every pipeline send and receive went to NCCL; in the ring all but the position messages."""
    for name, c in comms.items():
        nccl = {op: c.nccl_stats.get(op, [0, 0]) for op in ("send", "recv")}
        mpi = {op: [n - nccl[op][0], b - nccl[op][1]] for op, (n, b) in c.stats.items() if op in nccl}
        if name == "pp" and c.size > 1:
            assert c.stats["send"][0] and not any(n for n, _ in mpi.values()), (layout, dict(c.stats))
        elif name == "cp" and c.size > 1:
            assert all(n and b == n * POS_BYTES for n, b in mpi.values()), (layout, mpi)
            assert nccl["send"][0] and nccl["recv"] == nccl["send"], layout
        else:
            assert not any(n for n, _ in mpi.values()) and nccl["send"][0] == nccl["recv"][0] == 0, (layout, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nccl_trains_like_mpi(corpus, layout):
    extra, must, ranks = LAYOUTS[layout]
    need(N == ranks, f"the layout is written for {ranks} ranks")
    want_l, want_p, ref = train(config(corpus, *extra))
    mod = Module()
    try:
        got_l, got_p, eng = train(config(corpus, *extra, "runtime.collectives=nccl"), Device(mod))
        assert_same(got_l, want_l)
        assert_same_params(got_p, want_p)
        assert must <= set(mod.calls), (layout, dict(mod.calls))
        comms = {name: c for name, c in eng.mesh.comms.items() if c is not None}
        assert all(c.twin is not None for c in comms.values() if c.size > 1)
        for name, c in comms.items():      # the same traffic as MPI's, whoever carried it
            assert dict(c.stats) == dict(ref.mesh.comms[name].stats), name
        _check_p2p(layout, comms)
        if layout.startswith("sharding") and layout.endswith("packed"):    # every all-gather of the bits: NCCL
            gathers = [(c.stats["allgather"], c.nccl_stats["allgather"]) for c in comms.values() if "allgather" in c.stats]
            assert gathers and all(a == b for a, b in gathers), gathers
        assert (mod.calls["ncclSend"], mod.calls["ncclRecv"]) == \
            tuple(sum(c.nccl_stats.get(op, [0])[0] for c in comms.values()) for op in ("send", "recv"))
    finally:
        eng.mesh.free()
        ref.mesh.free()
        mod.free()


def test_without_nccl_on_one_rank_every_rank_warns_once_and_trains_with_mpi(corpus):
    need(N > 1, "the fall-back is agreed between ranks")
    extra = on("data_parallel")
    want_l, want_p, ref = train(config(corpus, *extra))
    mod, lines = Module(), []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "collectives" in record.getMessage():
                lines.append(record.getMessage())
    logger, h = logging.getLogger("hpengine"), Keep()
    logger.addHandler(h)
    fail = "CuPy found no NCCL library (libnccl.so.2)" if WORLD.Get_rank() == N - 1 else None
    try:
        got_l, got_p, eng = train(config(corpus, *extra, "runtime.collectives=nccl"), Device(mod, fail=fail))
    finally:
        logger.removeHandler(h)
    try:
        assert len(lines) == 1 and f"rank {N - 1}" in lines[0] and "libnccl" in lines[0], lines
        assert_same(got_l, want_l)
        assert_same_params(got_p, want_p)
        assert not mod.calls and all(c.twin is None for c in eng.mesh.comms.values() if c is not None)
    finally:
        eng.mesh.free()
        ref.mesh.free()
        mod.free()
