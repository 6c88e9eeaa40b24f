"""Buddy copies on one rank (COMM_SELF): the last 2 generations are kept, each a copy that later changes of the live
arrays leave alone, and a new generation reuses the buffers of the one it replaces."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpengine.dist.buddy import KEEP, Buddies, pack, shift_of, unpack


def test_pack_round_trip_into_a_given_buffer():
    arrays = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.array([1, 2], np.int32)}
    meta, data = pack(arrays)
    out = np.zeros(data.size, np.uint8)
    meta2, data2 = pack(arrays, out)
    assert data2 is out and meta2 == meta
    for k, v in unpack(meta, data2).items():
        np.testing.assert_array_equal(v, arrays[k])


def test_generations_are_copies_and_reuse_the_replaced_buffers():
    b = Buddies(MPI.COMM_SELF.Dup(), 1)
    live = np.zeros(4)
    seen = []
    for step in range(4):
        live[:] = step
        b.commit(step, {"p": live}, {"opt_steps": step})
        seen.append(b.gens[step][0][1])
    assert sorted(b.gens) == [2, 3] and KEEP == 2 and b.latest() == 3
    assert seen[2] is seen[0] and seen[3] is seen[1]       # the replaced generation's buffer, refilled
    for step in (2, 3):
        arrays, facts = b.own(step)
        np.testing.assert_array_equal(arrays["p"], step)
        assert facts == {"opt_steps": step}


def test_shift_crosses_nodes_where_it_can():
    assert shift_of(["a", "a", "b", "b"]) == 2
    assert shift_of(["a", "a", "a"]) == 1
