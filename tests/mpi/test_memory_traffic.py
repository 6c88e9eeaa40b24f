"""Counted model-state bytes equal the ZeRO formulas (up to the partition's measured imbalance), and
counted traffic equals what each strategy must send."""
import numpy as np
import pytest

from helpers import config, need, run


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_matches_zero_formula(corpus, world, stage):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    cfg = config(corpus, "model.dtype=float32", "strategy.sharding.enable=true",
                 f"strategy.sharding.degree={n}", f"strategy.sharding.stage={stage}")
    _, _, eng = run(cfg, world, steps=1)
    psi, own = eng.layout.total, eng.sync.owned.size
    mem = eng.memory()
    # float32 + AdamW: 4 (params) + 4 (grads) + 8 (m, v) bytes per element, the sharded parts per owner
    want = {1: (4 * psi, 4 * psi, 8 * own), 2: (4 * psi, 4 * own, 8 * own), 3: (4 * own, 4 * own, 8 * own)}[stage]
    assert (mem["param_bytes"], mem["grad_bytes"], mem["optim_bytes"]) == want
    # the share is Ψ/N up to the measured imbalance, and the largest share is exactly imbalance · Ψ/N
    assert own <= eng.sync.imbalance * psi / n + 1e-9
    largest = world.allreduce(own, op=max_op())
    assert largest == pytest.approx(eng.sync.imbalance * psi / n)


def max_op():
    from mpi4py import MPI
    return MPI.MAX


def test_data_parallel_traffic(corpus, world):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    cfg = config(corpus, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}")
    _, _, eng = run(cfg, world, steps=2)
    calls, nbytes = eng.mesh.comms["dp"].stats["allreduce"]
    per_step_loss = 8 * len(eng.slots)            # the float64 loss vector, once per step
    assert nbytes == 2 * (eng.layout.total * 8 + per_step_loss)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharding_traffic(corpus, world, stage):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    cfg = config(corpus, "strategy.sharding.enable=true", f"strategy.sharding.degree={n}",
                 f"strategy.sharding.stage={stage}")
    _, _, eng = run(cfg, world, steps=1)
    st = eng.mesh.comms["sharding"].stats
    psi_bytes = eng.layout.total * 8
    assert st["reduce"][1] == psi_bytes               # every gradient element reduced once, to its owner
    assert st["allgather"][1] == psi_bytes            # updated parameters shared once
    assert np.isclose(eng.sync.imbalance, max(r.size for r in eng.sync.ranges) * n / eng.layout.total)
