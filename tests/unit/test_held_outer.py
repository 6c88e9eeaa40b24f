"""DiLoCo's outer state in a rank's held state (engine/held.py), on one rank as an island whose replica communicator
is COMM_SELF: an engine built afresh and given another's buddy copy continues its outer loop bit for bit (under
overlap too, an exchange on the wire at the copy), taking copies changes nothing, and the planner's outer state
bytes are what the outer state holds."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.dist.buddy import pack, unpack
from hpengine.dist.comm import Comm
from hpengine.dist.topology import REPLICA
from hpengine.engine import outer_state
from hpengine.planner import diloco as plan_diloco
from hpengine.planner.memory import buddy_bytes
from hpengine.run.build import build
from hpengine.strategies.diloco import Outer

TINY = ["model.kind=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
        "train.global_batch=4", "model.dtype=float64", "optim.lr=3e-3", "runtime.backend=numpy"]
DILOCO = ["strategy.diloco.enable=true", "strategy.diloco.outer_momentum=0.9", "strategy.diloco.quantize=int8"]
STEPS, AT = 6, 3


def engine(corpus, keys):
    """A one-rank engine made one island of a DiLoCo run (its replica communicator COMM_SELF)."""
    cfg = load_config(None, [*TINY, f"data.path={corpus}", *DILOCO, *keys])
    eng = build(cfg, MPI.COMM_SELF)
    eng.mesh.comms[REPLICA] = Comm(MPI.COMM_SELF.Dup(), REPLICA)
    eng.islands = 2         # _outer makes the outer state for more than one island only
    eng.outer = eng._outer(cfg.strategy.diloco, eng.sync.owned_parts)
    eng.islands = 1
    return eng


def through_buddy(eng):
    """held_state as a buddy holds it: packed into bytes and read back."""
    arrays, facts = eng.held_state()
    return unpack(*pack(arrays)), facts


def finish(eng, start):
    losses = [eng.train_step(s)["loss"] for s in range(start, STEPS)]
    eng.outer.settle()      # overlap: the exchange on the wire into `pending` (one fragment: all of it)
    return losses, eng.sync.owned_params().copy(), {k: a.copy() for k, a in outer_state.arrays(eng.outer).items()}


@pytest.mark.parametrize("keys", [["strategy.diloco.inner_steps=3"],
                                  ["strategy.diloco.inner_steps=2", "strategy.diloco.overlap=true"]],
                         ids=["H3", "H2-overlap"])
def test_an_engine_given_a_held_copy_continues_the_outer_loop_bit_for_bit(small_corpus, keys):
    ref = engine(small_corpus, keys)
    want = finish(ref, 0)
    eng = engine(small_corpus, keys)
    head = []
    for s in range(AT):
        head.append(eng.train_step(s)["loss"])
        held = through_buddy(eng)           # every step, as spare mode does (under overlap: exchanges settled)
    if "strategy.diloco.overlap=true" in keys:      # started after step 2, on the wire at the copy, lands after 4
        assert held[1]["outer"] == {"steps": 0, "settled": {0: 1}}
    else:       # one outer step done: momentum and residual set
        assert held[1]["outer"]["steps"] == 1 and np.abs(held[0]["outer.outer_momentum"]).max() > 0
    assert np.abs(held[0]["outer.outer_residual"]).max() > 0
    fresh = engine(small_corpus, keys)
    fresh.restore_held(*held)
    got = finish(fresh, AT)
    assert head + got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        np.testing.assert_array_equal(got[2][k], want[2][k], err_msg=k)
    assert fresh.outer.steps == ref.outer.steps


@pytest.mark.parametrize("keys", [[], ["strategy.diloco.outer_momentum=0"], ["strategy.diloco.quantize=none"],
                                  ["strategy.diloco.overlap=true", "strategy.diloco.quantize=int4"]])
def test_the_planned_outer_state_bytes_are_what_it_holds(keys):
    dl = load_config(None, [*DILOCO, "strategy.diloco.inner_steps=4", *keys]).strategy.diloco
    n = 1000
    outer = Outer(dl, Comm(MPI.COMM_SELF.Dup(), REPLICA), np, np.ones(n), [[(0, n)]])
    assert plan_diloco.state_bytes(dl, n, 8) == sum(a.nbytes for a in outer_state.arrays(outer).values())
    spare = load_config(None, ["resilience.on_failure='spare'", "resilience.spares=1", "checkpoint.async=false"])
    assert buddy_bytes(spare.resilience, {"params": 1, "optimizer": 2, "outer": 3, "grads": 100}) == 4 * 6
