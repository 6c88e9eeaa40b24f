"""runtime.collectives = "nccl" without a GPU: the NumPy stand-in (nccl_standin.py) for CuPy's NCCL binding
checks that each communicator's twin got rank 0's unique id, that device-buffer collectives go to NCCL and
host buffers, other reductions and control messages to MPI, with MPI's results, counts and bytes; that sends
and receives go to NCCL on the channels opened for them (one stream per channel and direction) and to MPI
otherwise; that opening many channels does not deadlock and a bad list fails on every rank; and that a rank
without NCCL makes every rank fall back with one line. It checks the routing, not NCCL itself."""
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI
from nccl_standin import Device, Module, Stream, host

from helpers import need
from hpengine.dist import comm as comm_mod
from hpengine.dist.comm import Comm
from hpengine.dist.nccl import choose
from hpengine.dist.tracer import Tracer

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()


@pytest.fixture
def pair():
    """(a Comm with the stand-in twin, a plain MPI Comm over the same ranks, the stand-in module)."""
    mod = Module()
    a, b = WORLD.Dup(), WORLD.Dup()
    yield Comm(a, "dp", nccl=Device(mod)), Comm(b, "dp"), mod
    mod.free()
    a.Free()
    b.Free()


def test_every_twin_has_the_id_rank_0_made(pair):
    need(N > 1, "a twin needs two ranks")
    comm, _, mod = pair
    made = comm.c.bcast(mod.made[-1] if R == 0 else None, root=0)
    assert comm.twin.uid == made
    assert comm.twin.comm.members == list(range(N))      # the stand-in found its ranks through that id


def _each(comm, kind):
    """Every array call of Comm once, on device arrays (kind=np.asarray) or host ones (kind=host);
    returns the results."""
    x = kind(np.arange(6.0) * (R + 1))
    out = {"allreduce": comm.allreduce_(x.copy())}
    y = kind(np.arange(6.0) + R)
    comm_mod.waitall([comm.iallreduce_(y)])
    out["iallreduce"] = y
    out["max"] = comm.allreduce_(kind(np.array([float(R), -float(R)])), op=MPI.MAX)
    send = kind(np.arange(3.0 * N) * (R + 1))
    out["reduce_scatter"] = comm.reduce_scatter(send, kind(np.zeros(3)))
    even = kind(np.zeros(2 * N))
    even[2 * R:2 * R + 2] = R + 1
    out["allgather"] = comm.allgatherv_(even, [2] * N, [2 * r for r in range(N)])
    counts = [r + 1 for r in range(N)]
    displs = [sum(counts[:r]) for r in range(N)]
    uneven = kind(np.zeros(sum(counts)))
    uneven[displs[R]:displs[R] + counts[R]] = 10 + R
    req = comm.iallgatherv_(uneven, counts, displs)
    comm_mod.waitall([req])
    out["allgatherv"] = uneven
    out["bcast"] = comm.bcast_(kind(np.full(4, float(R))), root=N - 1)
    nxt, prv = (R + 1) % N, (R - 1) % N
    got, got2 = kind(np.zeros(3)), kind(np.zeros(2))
    reqs = [comm.irecv(got, prv, 1), comm.irecv(got2, prv, 2), comm.isend(kind(np.full(3, R + 0.5)), nxt, 1),
            comm.isend(kind(np.full(2, -R - 0.5)), nxt, 2)]
    comm_mod.waitall(reqs)
    out["ring"], out["ring2"] = got, got2
    return {k: np.asarray(v).copy() for k, v in out.items()}


def _expected():
    """The closed forms of _each's results on this rank."""
    tri = N * (N + 1) / 2
    counts = [r + 1 for r in range(N)]
    return {"allreduce": np.arange(6.0) * tri, "iallreduce": N * np.arange(6.0) + N * (N - 1) / 2,
            "max": np.array([N - 1.0, 0.0]), "reduce_scatter": np.arange(3.0 * R, 3.0 * R + 3) * tri,
            "allgather": np.repeat(np.arange(1.0, N + 1), 2),
            "allgatherv": np.concatenate([np.full(c, 10.0 + r) for r, c in enumerate(counts)]),
            "bcast": np.full(4, N - 1.0), "ring": np.full(3, (R - 1) % N + 0.5),
            "ring2": np.full(2, -((R - 1) % N) - 0.5)}


def test_device_buffers_go_to_nccl_with_mpis_results_and_counts(pair):
    need(N > 1, "a twin needs two ranks")
    comm, plain, mod = pair
    got, ref = _each(comm, np.asarray), _each(plain, np.asarray)
    for k, want in _expected().items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)
        np.testing.assert_array_equal(ref[k], want, err_msg=k)
    assert dict(comm.stats) == dict(plain.stats)         # the same op names and bytes, whoever carried them
    p2p = ("send", "recv")                               # no channel opened: MPI's, matched by tag
    assert dict(comm.nccl_stats) == {k: v for k, v in comm.stats.items() if k not in p2p}
    assert mod.calls == {"ncclAllReduce": 3, "ncclReduceScatter": 1, "ncclAllGather": 1, "ncclBroadcast": 1 + N}
    # the five blocking calls (allreduce_ twice, reduce_scatter, allgatherv_, bcast_) order the compute stream
    # after them; the two non-blocking ones leave that to their requests' Wait
    assert comm.twin.dev.joined == 5


def test_host_buffers_other_ops_and_control_messages_stay_on_mpi(pair):
    need(N > 1, "a twin needs two ranks")
    comm, plain, mod = pair
    got = _each(comm, host)
    for k, want in _expected().items():
        np.testing.assert_array_equal(got[k], want, err_msg=k)
    assert not mod.calls and not comm.nccl_stats and comm.stats["allreduce"][0] == 3
    assert comm.allreduce_obj(1) == N and comm.bcast_obj(R, root=0) == 0 and comm.allgather_obj(R) == list(range(N))
    flags = np.array([R == 0, True])
    comm.allreduce_(flags, op=MPI.LAND)                   # a reduction NCCL lacks
    z = np.full(2, 1 + 1j * R)
    comm.allreduce_(z)                                    # a dtype NCCL lacks
    assert list(flags) == [N == 1, True] and z[1] == N + 1j * N * (N - 1) / 2
    assert not mod.calls and not comm.nccl_stats


def test_the_trace_names_the_nccl_call(pair):
    need(N > 1, "a twin needs two ranks")
    comm, _, _ = pair
    tr = Tracer(record=True)
    comm.set_tracer(tr)
    comm.allreduce_(np.ones(3))
    comm.allreduce_(host(np.ones(3)))
    comm.bcast_(np.ones(2), root=0)
    comm.set_tracer(None)
    assert [e[1] for e in tr.events] == ["ncclAllReduce", "Allreduce", "ncclBroadcast"]
    assert [e[4] for e in tr.events] == [24, 24, 16]


def _ring(comm, kind, keys=("a", "b")):
    """Each rank sends 2 messages on key a and one on b to the next rank (receives posted first, as the
    context-parallel ring does) -> what arrived from the previous rank."""
    nxt, prv = (R + 1) % N, (R - 1) % N
    got = [kind(np.zeros(3)), kind(np.zeros(3)), kind(np.zeros(2))]
    reqs = [comm.irecv(got[0], prv, 1, channel=keys[0]), comm.irecv(got[1], prv, 2, channel=keys[0]),
            comm.irecv(got[2], prv, 3, channel=keys[1])]
    reqs += [comm.isend(kind(np.full(3, R + 0.5)), nxt, 1, channel=keys[0]),
             comm.isend(kind(np.full(3, R + 0.25)), nxt, 2, channel=keys[0]),
             comm.isend(kind(np.full(2, -R - 0.5)), nxt, 3, channel=keys[1])]
    comm_mod.waitall(reqs)
    return [np.asarray(g).copy() for g in got]


def _ring_expected():
    p = (R - 1) % N
    return [np.full(3, p + 0.5), np.full(3, p + 0.25), np.full(2, -p - 0.5)]


def _ring_channels():
    return [(r, (r + 1) % N, k) for r in range(N) for k in ("a", "b")]


def test_a_channels_sends_and_receives_go_to_nccl_with_mpis_results_and_counts(pair):
    need(N > 1, "a channel needs two ranks")
    comm, plain, mod = pair
    comm.open_channels(_ring_channels())
    plain.open_channels(_ring_channels())                 # no twin: nothing to open, MPI carries them
    nxt, prv = (R + 1) % N, (R - 1) % N
    assert set(comm.channels) == {(R, nxt, "a"), (R, nxt, "b"), (prv, R, "a"), (prv, R, "b")} and not plain.channels
    tr = Tracer(record=True)
    comm.set_tracer(tr)
    got, ref = _ring(comm, np.asarray), _ring(plain, np.asarray)
    comm.set_tracer(None)
    for g, r, want in zip(got, ref, _ring_expected()):
        np.testing.assert_array_equal(g, want)
        np.testing.assert_array_equal(r, want)
    assert dict(comm.stats) == dict(plain.stats) == {"send": [3, 64], "recv": [3, 64]}
    assert dict(comm.nccl_stats) == dict(comm.stats)
    assert mod.calls == {"ncclSend": 3, "ncclRecv": 3}
    assert [e[1] for e in tr.events] == ["ncclRecv"] * 3 + ["ncclSend"] * 3
    dev = comm.twin.dev
    # a stream per channel, each carrying one direction; the receives' Wait ordered the compute stream
    assert sorted(tuple(s.carried) for s in dev.streams) == [("recv",), ("recv",), ("send",), ("send",)]
    assert [ch.stream for ch in comm.channels.values()] == dev.streams and dev.joined == 3


def test_a_send_keeps_its_array_until_done(pair):
    need(N > 1, "a channel needs two ranks")
    comm, _, _ = pair
    comm.open_channels([(r, (r + 1) % N, 0) for r in range(N)])
    got = np.zeros(4)
    rreq = comm.irecv(got, (R - 1) % N, 9, channel=0)
    sreq = comm.isend(np.full(4, float(R)), (R + 1) % N, 9, channel=0)
    assert sreq.arrays is not None and isinstance(comm.channels[R, (R + 1) % N, 0].stream, Stream)
    comm_mod.waitall([rreq, sreq])
    assert sreq.arrays is None and sreq.Test() and rreq.Test()
    np.testing.assert_array_equal(got, np.full(4, float((R - 1) % N)))


def test_host_arrays_and_sends_without_a_channel_stay_on_mpi(pair):
    need(N > 1, "a channel needs two ranks")
    comm, _, mod = pair
    comm.open_channels(_ring_channels())
    for kind, keys in ((host, ("a", "b")), (np.asarray, (None, None)), (np.asarray, ("c", "d"))):
        for g, want in zip(_ring(comm, kind, keys), _ring_expected()):
            np.testing.assert_array_equal(g, want)
    z = np.zeros(2, dtype=complex)                        # a dtype NCCL lacks, on an open channel
    comm_mod.waitall([comm.irecv(z, (R - 1) % N, 4, channel="a"),
                      comm.isend(np.full(2, 1j * R), (R + 1) % N, 4, channel="a")])
    assert z[0] == 1j * ((R - 1) % N)
    assert not mod.calls and not comm.nccl_stats and comm.stats["send"] == [10, 3 * 64 + 32]


def test_opening_channels_between_every_pair_does_not_deadlock(pair):
    need(N > 1, "a channel needs two ranks")
    comm, _, mod = pair
    every = [(s, d, k) for s in range(N) for d in range(N) for k in (0, 1)]
    rng = np.random.default_rng(R)                       # the same channels, listed in another order per rank
    comm.open_channels([every[i] for i in rng.permutation(len(every))])
    mine = {c for c in every if c[0] != c[1] and R in c[:2]}
    assert set(comm.channels) == mine and len(mod.comms) == len(mine) + 1      # + the twin
    comm.open_channels(every[:4] + [(0, N - 1, 2)])      # again: only the new channel is built
    assert len(mod.comms) == len(mine) + 1 + (R in (0, N - 1))
    got = {c: np.zeros(1) for c in comm.channels if c[1] == R}
    reqs = [comm.irecv(buf, c[0], 0, channel=c[2]) for c, buf in got.items()]
    reqs += [comm.isend(np.full(1, 100.0 * R + d + 10 * k), d, 0, channel=k) for s, d, k in comm.channels if s == R]
    comm_mod.waitall(reqs)
    assert all(buf[0] == 100.0 * s + R + 10 * k for (s, _, k), buf in got.items())
    assert (mod.calls["ncclRecv"], mod.calls["ncclSend"]) == (len(got), len(comm.channels) - len(got))


def test_a_bad_channel_list_fails_on_every_rank(pair):
    need(N > 1, "a channel needs two ranks")
    comm, _, _ = pair
    wanted = _ring_channels() + ([(0, N - 1, "extra")] if R == N - 1 else [])
    with pytest.raises(ValueError, match=f"rank {N - 1} asked for other channels than rank 0"):
        comm.open_channels(wanted)
    with pytest.raises(ValueError, match=rf"channel \(0, {N}, 'x'\) names a rank outside 0..{N - 1}"):
        comm.open_channels([(0, N, "x")])
    assert not comm.channels


def _warnings(fn):
    """fn()'s result and the hpengine logger's warning lines while it ran."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())
    logger, h = logging.getLogger("hpengine"), Keep()
    logger.addHandler(h)
    try:
        return fn(), lines
    finally:
        logger.removeHandler(h)


@pytest.mark.parametrize("failing", ["last", "all"])
def test_nccl_missing_somewhere_makes_every_rank_use_mpi_with_one_line(failing):
    mod = Module()
    fail = "CuPy found no NCCL library" if failing == "all" or R == N - 1 else None
    try:
        got, lines = _warnings(lambda: choose("nccl", None, WORLD, Device(mod, fail=fail)))
    finally:
        mod.free()
    assert got is None and len(lines) == 1
    first = 0 if failing == "all" else N - 1
    assert f"NCCL is not usable on rank {first}" in lines[0] and "CuPy found no NCCL library" in lines[0]
    assert "MPI carries every call" in lines[0]


def test_nccl_usable_everywhere_is_chosen_silently():
    mod = Module()
    dev = Device(mod)
    try:
        got, lines = _warnings(lambda: choose("nccl", None, WORLD, dev))
        assert got is dev and not lines
        assert choose("mpi", None, WORLD, dev) is None
    finally:
        mod.free()


def test_ranks_sharing_a_device_use_mpi_with_one_line():
    need(N > 1, "sharing needs two ranks")
    mod = Module()
    try:
        got, lines = _warnings(lambda: choose("nccl", SimpleNamespace(device=0), WORLD, Device(mod)))
    finally:
        mod.free()
    assert got is None and len(lines) == 1
    assert "NCCL is not usable on rank 1" in lines[0] and "shares CUDA device 0" in lines[0] and "rank 0" in lines[0]
