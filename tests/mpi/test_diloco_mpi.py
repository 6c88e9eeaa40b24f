"""DiLoCo against independent references: one inner step with outer lr 1 and no momentum is data parallel (the
one-process run, with the linear inner optimizer SGD); islands of any inner layout are islands of one process
each; and the outer step (Nesterov momentum, int8/int4 exchange with error feedback and the owners' re-quantised
mean) against a NumPy model of its equations fed by one-process engines that each run one island's rows.
"""
from itertools import combinations

import numpy as np
import pytest
from mpi4py import MPI

from helpers import (assert_resumes_like, assert_same, assert_same_params, config, need, reference, run,
                     saved_after)
from hpengine.dist.comm import waitall
from hpengine.dist.link import SlowLink
from hpengine.engine.rows import RowReader
from hpengine.run.build import build
from hpengine.checkpoint.shards import CheckpointError
from hpengine.run.train import restore

WORLD = MPI.COMM_WORLD
DILOCO = ["strategy.diloco.enable=true", "strategy.diloco.replicas=2"]


def island_losses(losses, eng, comm):
    """{island: its losses per step} from every rank's run (each rank reports its own island's)."""
    isl = eng.mesh.coords.get("replica", 0) if eng.mesh.islands > 1 else comm.Get_rank()
    return {i: np.asarray(ls) for i, ls in comm.allgather((isl, losses[:, 0]))}


def test_one_inner_step_is_data_parallel(corpus):
    """H = 1, outer lr 1, no momentum: the outer parameters are the islands' mean, which for SGD (an update linear
    in the gradient) is the step on the mean gradient: every rank an island of one rank equals one process."""
    n = WORLD.Get_size()
    need(n >= 2, "needs 2 ranks for 2 islands")
    same = ["optim.name=sgd", "optim.lr=0.5", "optim.clip_grad_norm=0"]
    losses, params, eng = run(config(corpus, *same, "strategy.diloco.enable=true", "strategy.diloco.inner_steps=1",
                                     "strategy.diloco.outer_lr=1", "strategy.diloco.outer_momentum=0"), WORLD)
    ref_l, ref_p, _ = reference(corpus, *same)
    assert eng.mesh.islands == n
    assert_same_params(params, ref_p)
    # the step's loss is the island's: the mean over islands is the one-process loss
    assert_same(np.mean([v for v in island_losses(losses, eng, WORLD).values()], axis=0), ref_l[:, 0])


TP2 = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]
SH2_3 = ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=3"]
PP2 = ["strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2"]


@pytest.mark.parametrize("inner,fragments", [(TP2, 1), (SH2_3, 1), (PP2, 1), (TP2, 2), (SH2_3, 3), (PP2, 2)],
                         ids=["tp2", "sharding2-stage3", "pp2", "tp2-fragments2", "sharding2-stage3-fragments3",
                              "pp2-fragments2"])
def test_inner_layouts_equal_islands_of_one_process(corpus, inner, fragments):
    """2 islands x (tp 2 | sharding 2 stage 3 | pp 2), in one fragment or streaming (fragments: groups of whole
    tensors in the model's order, so the same whatever the layout), equal 2 islands of one process each (run on
    two ranks), mid-period (each island's losses) and after the outer steps (the parameters: each island's own,
    which under streaming differ where a fragment has trained since it met)."""
    need(WORLD.Get_size() == 4, "2 islands of 2 ranks")
    knobs = DILOCO + [f"strategy.diloco.inner_steps={max(2, fragments)}", f"strategy.diloco.fragments={fragments}",
                      "optim.clip_grad_norm=0.5"]
    losses, params, eng = run(config(corpus, *knobs, *inner), WORLD, steps=4)
    assert len(eng.outer.fragments) == fragments
    assert_islands_of_one_process(corpus, knobs, losses, params, eng)


def assert_islands_of_one_process(corpus, knobs, losses, params, eng):
    """The 4-rank run (losses, params, eng: 2 islands of 2 ranks, 4 steps) against 2 islands of one process each
    with `knobs`, run on ranks 0 and 1: each island's losses, and each island's own parameters (mid-period under
    streaming, where a fragment has trained since it met)."""
    pair = WORLD.Split(WORLD.Get_rank() // 2, WORLD.Get_rank())
    try:
        ref_l, ref_p, ref = run(config(corpus, *knobs), pair, steps=4)
        want = island_losses(ref_l, ref, pair)
        refs = WORLD.allgather((pair.Get_rank(), ref_p) if WORLD.Get_rank() < 2 else None)
    finally:
        pair.Free()
    got = island_losses(losses, eng, WORLD)
    for i in (0, 1):
        assert_same(got[i], want[i])
    island = eng.mesh.coords["replica"]
    assert_same_params(params, next(p for r in refs if r is not None for i, p in [r] if i == island))


FLAT = ["strategy.sharding.partition=flat"]


@pytest.mark.parametrize("inner", [SH2_3 + ["strategy.diloco.fragments=2"], PP2 + ["strategy.diloco.fragments=2"],
                                   TP2, TP2 + ["strategy.diloco.fragments=2"], SH2_3 + FLAT,
                                   SH2_3 + FLAT + ["strategy.diloco.fragments=2"]],
                         ids=["sharding2-stage3-fragments2", "pp2-fragments2", "tp2", "tp2-fragments2",
                              "sharding2-stage3-flat", "sharding2-stage3-flat-fragments2"])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantised_islands_follow_tensors_not_ranks(corpus, inner, quantize):
    """int8/int4 blocks are each whole tensor's, wherever its values are held: 2 islands x (sharding 2 by tensors |
    pp 2 | tp 2, a column slice strided in the tensor | sharding 2 cutting tensors at any element), in one or two
    fragments of whole tensors, equal 2 islands of one process each (scales, codes and the owners' re-quantised
    means alike)."""
    need(WORLD.Get_size() == 4, "2 islands of 2 ranks")
    knobs = DILOCO + ["strategy.diloco.inner_steps=2", f"strategy.diloco.quantize={quantize}"]
    frag = [k for k in inner if "fragments" in k]
    losses, params, eng = run(config(corpus, *knobs, *inner), WORLD, steps=4)
    assert_islands_of_one_process(corpus, [*knobs, *frag], losses, params, eng)


# ---- an independent model of the outer step ---------------------------------------------------------------

BLOCK = 256         # values per quantisation block


def np_quantize(v, levels):
    """Blocks of BLOCK values (zero-padded), a float32 scale max|x| / levels each, round half to even: the values a
    payload stands for."""
    n = v.size
    x = np.zeros(-(-n // BLOCK) * BLOCK)
    x[:n] = v
    x = x.reshape(-1, BLOCK)
    scale = (np.abs(x).max(axis=1) / levels).astype(np.float32).astype(np.float64)
    q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)[:, None]), -levels, levels)
    return (q * scale[:, None]).reshape(-1)[:n]


def np_quantize_tensors(v, lo, tensors, levels):
    """np_quantize of each tensor's piece of v (v: the flat values from element lo; tensors: (start, stop) of every
    tensor in the flat buffer), the blocks starting where each tensor (or v) starts."""
    out = np.empty_like(v)
    for a, b in tensors:
        s, e = max(a, lo) - lo, min(b, lo + v.size) - lo
        if s < e:
            out[s:e] = np_quantize(v[s:e], levels)
    return out


def np_exchange(deltas, resid, sl, tensors, quantize):
    """The islands' mean pseudo-gradient over slice sl as the exchange delivers it: plain, their mean; int8/int4,
    each island's v = delta + residual rounded per block (its residual keeps what the rounding lost), the rounded
    values summed in island order over M, and that mean rounded per block again (its owner's re-quantisation)."""
    M = len(deltas)
    if quantize == "none":
        return sum(deltas[1:], deltas[0]) / M
    levels = {"int8": 127, "int4": 7}[quantize]
    total = None
    for i in range(M):
        v = deltas[i] + resid[i][sl]
        q = np_quantize_tensors(v, sl.start, tensors, levels)
        resid[i][sl] = v - q
        total = q if total is None else total + q
    return np_quantize_tensors(total / M, sl.start, tensors, levels)


def tensor_bounds(eng):
    """(start, stop) of every tensor in a one-process engine's flat buffer."""
    return sorted((r.start, r.stop) for r in eng.layout.ranges.values())


def fragment_slices_of(eng, tensors):
    """Each fragment's slice of the flat buffer of an engine whose ranks own whole stages (dp inside the islands):
    the engine's own, checked here to be F contiguous groups of whole tensors (tensors: their (start, stop) in flat
    order) in model order whose largest is as small as any such cut into F groups allows (every cut tried)."""
    frags = eng.outer.fragments
    F, bounds = len(frags), [(p[0][0], p[-1][1]) for p in eng.outer.fragments]
    assert bounds[0][0] == 0 and bounds[-1][1] == tensors[-1][1]
    assert all(bounds[f][1] == bounds[f + 1][0] for f in range(F - 1))
    for (lo, hi), pieces in zip(bounds, frags):
        assert pieces == [(a, b) for a, b in tensors if lo <= a < hi]     # whole tensors, each its own slice
    sizes = [b - a for a, b in tensors]
    best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
               for cuts in combinations(range(1, len(sizes)), F - 1))
    assert max(hi - lo for lo, hi in bounds) == best
    return [slice(lo, hi) for lo, hi in bounds]


def island_engine(corpus, knobs, i, M, G):
    """A one-process engine that trains island i's rows of every global batch, its loss its rows' mean."""
    e = build(config(corpus, *knobs), MPI.COMM_SELF)
    share = G // M
    e.rows = RowReader(e.data, e.be, G, e.cfg.model.seq_len, share, i * share, True, e.mesh.comms["tp"])
    e.share, e.islands = share, M
    return e


def islands_and_their_engines(corpus, steps, G, knobs, H, mu, lr, quantize, fragments, M=2):
    """The run of M islands of world / M ranks (dp inside) with these outer settings (and knobs): (each island's
    losses, parameters, engine), and the one-process engine of each island with its flat parameters, for the
    test's NumPy model to drive."""
    n = WORLD.Get_size()
    need(n % M == 0, f"{M} islands of equal size")
    outer = [f"strategy.diloco.inner_steps={H}", f"strategy.diloco.outer_momentum={mu}",
             f"strategy.diloco.outer_lr={lr}", f"strategy.diloco.quantize={quantize}",
             f"strategy.diloco.fragments={fragments}", *knobs]
    inner = ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n // M}"]
    losses, params, eng = run(config(corpus, "strategy.diloco.enable=true", f"strategy.diloco.replicas={M}",
                                     *outer, *inner), WORLD, steps=steps)
    isl = [island_engine(corpus, [], i, M, G) for i in range(M)]
    return island_losses(losses, eng, WORLD), params, eng, isl, [e.sync.params.data for e in isl]


@pytest.mark.parametrize("quantize,fragments,M", [("none", 1, 2), ("int8", 1, 2), ("int4", 1, 2), ("int8", 3, 2),
                                                  ("int8", 1, 4), ("int4", 3, 4)])
def test_outer_step_against_numpy_model(corpus, quantize, fragments, M):
    """H = 3, outer momentum 0.9, Nesterov, outer lr 0.7, six steps: M islands of world / M ranks (dp) against the
    outer step written out here in NumPy (PyTorch SGD semantics; the int8/int4 rounding with error feedback, then the
    owner's rounding of the mean; streaming: fragment f, the f-th of F groups of whole tensors in model order, meets
    after step s when s + f H / F is a multiple of H), fed by M one-process engines, each running one island's rows. The replica
    communicator moves exactly the format's bytes: the payload out in chunks, the averaged chunks back."""
    H, mu, lr, G, steps = 3, 0.9, 0.7, 8, 6
    got, params, eng, isl, P = islands_and_their_engines(corpus, steps, G, [], H, mu, lr, quantize, fragments, M)
    outer = P[0].copy()
    size, tensors = outer.size, tensor_bounds(isl[0])
    frag = fragment_slices_of(eng, tensors)
    buf, resid = np.zeros_like(outer), [np.zeros_like(outer) for _ in range(M)]
    want, sent = {i: [] for i in range(M)}, []
    for s in range(steps):
        for i, e in enumerate(isl):
            want[i].append(e.train_step(s)["loss"])
        for f in range(fragments):
            if (s + 1 + f * H // fragments) % H:
                continue
            sl = frag[f]
            g = np_exchange([outer[sl] - P[i][sl] for i in range(M)], resid, sl, tensors, quantize)
            buf[sl] = mu * buf[sl] + g
            outer[sl] = outer[sl] - lr * (g + mu * buf[sl])
            for i in range(M):
                P[i][sl] = outer[sl]
            sent.append([min(b, sl.stop) - max(a, sl.start) for a, b in tensors if max(a, sl.start) < min(b, sl.stop)])
    for i in range(M):
        assert_same(got[i], np.array(want[i]))
    assert_same_params(params, isl[eng.mesh.coords["replica"]].named_params())     # this rank's island

    # the bytes on the replica communicator: each exchange of a fragment's owned part (the whole stage under dp)
    assert eng.sync.owned_params().size == size
    blocks = [sum(-(-k // BLOCK) for k in pieces) for pieces in sent]       # each tensor's piece from a block start
    stats = eng.mesh.comms["replica"].stats
    if quantize == "none":
        assert dict(stats) == {"allreduce": [len(sent), 8 * sum(map(sum, sent))]}
    else:
        payload = sum(b * BLOCK // {"int8": 1, "int4": 2}[quantize] + 4 * b for b in blocks)
        assert dict(stats) == {"alltoallv": [len(sent), payload], "allgather": [len(sent), payload]}


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_resume_mid_period_under_another_inner_layout(corpus, root, quantize):
    """A checkpoint at step 4 of a period of 3 (outer parameters, momentum, residuals, each island's parameters and
    AdamW state) resumed by 2 islands trains steps 5 and 6 as the straight run does: under another inner layout
    (sharding stage 2 for dp, at 4 ranks); int8 too, since its blocks of 128 start at each tensor and sharding
    (by tensors) gives each rank whole tensors."""
    n = WORLD.Get_size()
    need(n % 2 == 0, "2 islands of equal size")
    knobs = DILOCO + ["strategy.diloco.inner_steps=3", f"strategy.diloco.quantize={quantize}"]
    a = ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n // 2}"]
    b = ["strategy.sharding.enable=true", f"strategy.sharding.degree={n // 2}", "strategy.sharding.stage=2"]
    straight = run(config(corpus, *knobs, *a), WORLD, steps=6)
    saved_after(config(corpus, *knobs, *a), WORLD, root, 4)
    assert_resumes_like(config(corpus, *knobs, *b), WORLD, root, straight, at=4, steps=2)


def test_a_checkpoint_of_islands_is_refused_without_them(corpus, root):
    """Each island's optimizer state is its own: a run without DiLoCo does not resume such a checkpoint; one line
    says how to go on (with islands, or from the outer parameters)."""
    n = WORLD.Get_size()
    need(n % 2 == 0, "2 islands of equal size")
    dp = ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n // 2}"]
    path = saved_after(config(corpus, *DILOCO, "strategy.diloco.inner_steps=1", *dp), WORLD, root, 1)
    plain = build(config(corpus, "strategy.data_parallel.enable=true"), WORLD)
    with pytest.raises(CheckpointError, match=r"written by 2 DiLoCo islands: resume it with strategy.diloco.enable "
                                              r"= true, or start a run from its outer parameters"):
        restore(plain, plain.cfg, path)


def test_replica_link_takes_the_simulated_time(corpus):
    """runtime.replica_link: a call on the replica communicator lasts at least latency + bytes / bandwidth."""
    need(WORLD.Get_size() > 1, "islands")
    islands = ["strategy.diloco.enable=true", "strategy.diloco.replicas=-1"]      # one rank each
    eng = build(config(corpus, *islands, "runtime.replica_link=8Mbit/s,20ms"), WORLD)
    rep, a = eng.mesh.comms["replica"], np.ones(10000)
    t0 = MPI.Wtime()
    rep.allreduce_(a)
    took = MPI.Wtime() - t0
    assert took >= 0.02 + 80000 / 1e6 and rep.waited_s > 0
    assert_same(a, np.full(10000, float(WORLD.Get_size())))
    assert not isinstance(build(config(corpus, *islands), WORLD).mesh.comms["replica"], SlowLink)   # off: none


def test_link_on_dp_queues_and_holds_nonblocking_sums(corpus):
    """runtime.link_axis = "dp": data parallel's gradient communicator is the slow link; two non-blocking sums sent
    together take their turns (latency + both messages' bytes / bandwidth) before their wait returns, and training
    over the link gives the same bits as without it."""
    n = WORLD.Get_size()
    need(n > 1, "a data-parallel communicator")
    dp_on = ["strategy.data_parallel.enable=true"]
    eng = build(config(corpus, *dp_on, "runtime.replica_link=8Mbit/s,20ms", "runtime.link_axis=dp"), WORLD)
    dp = eng.mesh.comms["dp"]
    assert isinstance(dp, SlowLink) and not isinstance(eng.mesh.comms["tp"], SlowLink)
    a, b = np.ones(10000), np.ones(10000)
    t0 = MPI.Wtime()
    waitall([dp.iallreduce_(a), dp.iallreduce_(b)])
    assert MPI.Wtime() - t0 >= 0.02 + 2 * 80000 / 1e6
    assert_same(a + b, np.full(10000, 2.0 * n))
    eng.mesh.free()
    slow_l, slow_p, _ = run(config(corpus, *dp_on, "runtime.replica_link=1Gbit/s,1ms", "runtime.link_axis=dp"),
                            WORLD, steps=2)
    plain_l, plain_p, _ = run(config(corpus, *dp_on), WORLD, steps=2)
    assert np.array_equal(slow_l, plain_l) and all(np.array_equal(slow_p[k], plain_p[k]) for k in plain_p)
