"""Communicators by name: a product of mesh axes holds exactly the ranks that differ only along those axes,
and an axis folded inside others splits that product into consecutive blocks (its complement: the same place
in every block). Checked against the coordinates every rank reports, at any world size."""
import itertools

import pytest
from mpi4py import MPI

from hpengine.dist.topology import Mesh, TopologyError

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()


def _layouts():
    """Every (dp, sharding, tp, pp) whose product is the world, and each fold degree of dp*sharding."""
    out = []
    for dp, sh, tp in itertools.product(range(1, N + 1), repeat=3):
        if N % (dp * sh * tp) == 0:
            out.append({"dp": dp, "sharding": sh, "tp": tp, "pp": N // (dp * sh * tp)})
    return out[:6]          # a modest number of collectives per test


def _members(comm):
    """World ranks of a communicator, as every member sees them."""
    return sorted(comm.allgather(WORLD.Get_rank()))


@pytest.mark.parametrize("axes", [("dp", "sharding"), ("tp", "pp"), ("dp", "pp", "tp")])
def test_product_of_axes_holds_the_ranks_differing_only_along_them(axes):
    for degrees in _layouts():
        mesh = Mesh(WORLD, degrees)
        g = mesh.group(*axes)
        want = sorted(r for r in range(N) if all(mesh.coords_of(r)[a] == mesh.coords[a]
                                                   for a in mesh.coords if a not in axes))
        assert _members(g) == want
        assert g.Get_size() == len(want)
        name = "*".join(a for a in mesh.order if a in axes)
        assert mesh.comms[name] is g and mesh.group(*reversed(axes)) is g     # made once, by name


def test_fold_splits_the_product_into_blocks_and_their_complement():
    for degrees in _layouts():
        mesh = Mesh(WORLD, degrees)
        size = degrees["dp"] * degrees["sharding"]
        for e in [d for d in range(1, size + 1) if size % d == 0][:2]:
            mesh = Mesh(WORLD, degrees)
            ep, edp = mesh.fold("ep", e, ("dp", "sharding"))
            assert ep.Get_size() == e and edp.Get_size() == size // e
            prod = mesh.group("dp", "sharding")
            # consecutive blocks of e ranks of the product, in its rank order (innermost axis fastest)
            order = prod.allgather(WORLD.Get_rank())
            me = prod.Get_rank()
            assert _members(ep) == sorted(order[me // e * e: me // e * e + e])
            assert _members(edp) == sorted(order[me % e::e])


def test_bad_group_and_fold_are_one_clear_error():
    mesh = Mesh(WORLD, {"dp": N, "sharding": 1, "tp": 1, "pp": 1})
    with pytest.raises(TopologyError, match="distinct axes"):
        mesh.group("dp", "ep")
    if N > 1:
        with pytest.raises(TopologyError, match=r"valid degrees: \[1"):
            mesh.fold("ep", N + 1, ("dp", "sharding"))
        mesh.fold("ep", N, ("dp", "sharding"))
        with pytest.raises(TopologyError, match="folded with degree"):
            mesh.fold("ep", 1, ("dp", "sharding"))


@pytest.mark.skipif(N != 4, reason="the layouts below are for 4 ranks")
def test_groups_needlessly_split_across_nodes():
    """Which tp/cp groups span nodes that could each hold them, for pretend node names per rank."""
    mesh = Mesh(WORLD, {"tp": 2, "cp": 1, "dp": 2, "sharding": 1, "pp": 1})
    block, cyclic = ["a", "a", "b", "b"], ["a", "b", "a", "b"]
    assert mesh.needlessly_split(block) == {} and mesh.groups_across_nodes("tp", block) == []
    assert mesh.groups_across_nodes("dp", block) == [[0, 2], [1, 3]]
    assert mesh.needlessly_split(cyclic) == {"tp": [[0, 1], [2, 3]]}
    assert mesh.needlessly_split(["a", "a", "a", "b"]) == {}      # 3 + 1 ranks: no node holds whole pairs
    mesh = Mesh(WORLD, {"tp": 2, "cp": 2, "dp": 1, "sharding": 1, "pp": 1})
    assert mesh.needlessly_split(block) == {}                     # tp inside the node, cp must cross
    assert mesh.groups_across_nodes("cp", block) == [[0, 2], [1, 3]]
    assert mesh.needlessly_split(["a"] * 4) == {}
    assert mesh.needlessly_split(cyclic) == {"tp": [[0, 1], [2, 3]]}
