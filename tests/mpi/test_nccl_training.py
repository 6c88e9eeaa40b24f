"""Training with runtime.collectives = "nccl" through the NumPy stand-in (nccl_standin.py) equals training
with "mpi" (float64, 1e-10: losses and every parameter) for data parallel, sharding stage 3 (uneven
all-gathers), tensor parallel, pipelines (1F1B, interleaved, ZB-V) and the context-parallel ring: the device
buffers' collectives went to the stand-in, the sends and receives stayed on MPI. Where NCCL is missing on a rank,
every rank says so in one line and trains as with MPI. This checks the routing, not NCCL itself."""
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


LAYOUTS = {   # name -> (overrides, the NCCL calls that must have carried something)
    "dp": (on("data_parallel"), {"ncclAllReduce"}),
    "sharding3": (on("sharding", f"{S}sharding.stage=3"), {"ncclBroadcast"}),
    "tp": (["model.n_heads=4", *on("tensor_parallel")], {"ncclAllReduce"}),
    "pp_1f1b": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.micro_batches=4")], {"ncclAllReduce"}),
    "pp_interleaved": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.schedule=interleaved",
                                                 f"{S}pipeline.virtual_stages=2", f"{S}pipeline.micro_batches=4")],
                       {"ncclAllReduce"}),
    "pp_zbv": (["model.n_layers=4", *on("pipeline", f"{S}pipeline.schedule=zbv", f"{S}pipeline.micro_batches=4")],
               {"ncclAllReduce"}),
    "cp_ring": (on("context_parallel"), {"ncclAllReduce"}),
}


def train(cfg, device=None):
    """(losses, parameters, engine) after STEPS steps, the NCCL adapter `device` standing in for the GPU's."""
    eng = build(cfg, WORLD, nccl_device=device)
    losses = [eng.train_step(s)["loss"] for s in range(STEPS)]
    return np.array(losses), eng.named_params(), eng


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nccl_trains_like_mpi(corpus, layout):
    need(N == 2, "the layouts here are written for 2 ranks")
    extra, must = LAYOUTS[layout]
    want_l, want_p, ref = train(config(corpus, *extra))
    mod = Module()
    try:
        got_l, got_p, eng = train(config(corpus, *extra, "runtime.collectives=nccl"), Device(mod))
        assert_same(got_l, want_l)
        assert_same_params(got_p, want_p)
        assert must <= set(mod.calls), (layout, dict(mod.calls))
        carried = {op for c in eng.mesh.comms.values() if c is not None for op in c.nccl_stats}
        assert carried and not carried & {"send", "recv"} and all(c.twin is not None for c in eng.mesh.comms.values() if c is not None and c.size > 1)
        for name, c in eng.mesh.comms.items():      # the same traffic as MPI's, whoever carried it
            if c is not None:
                assert dict(c.stats) == dict(ref.mesh.comms[name].stats), name
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
