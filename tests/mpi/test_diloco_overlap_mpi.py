"""DiLoCo's overlapped outer exchange (strategy.diloco.overlap) against a NumPy model of Streaming DiLoCo's delayed
rule fed by one-process engines that each run one island's rows, and its checkpoint taken while exchanges are on
the wire resuming exactly.
"""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import assert_resumes_like, assert_same, assert_same_params, config, need, run, saved_after
from test_diloco_mpi import DILOCO, fragment_slices_of, islands_and_their_engines, np_exchange, tensor_bounds

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("quantize,fragments,mix", [("none", 1, 0.5), ("int8", 3, 0.25), ("none", 3, 0.0),
                                                    ("int4", 1, 0.5)])
def test_overlap_against_numpy_model(corpus, quantize, fragments, mix):
    """H = 3, Nesterov 0.9, outer lr 0.7, eight steps, 2 islands of world / 2 ranks (dp): fragment f's
    pseudo-gradient taken after step s (s + 1 + f H / F a multiple of H) lands after step s + H / F: the outer
    step from the islands' mean at s, then island = mix x island + (1 - mix) x outer; written out here in NumPy
    (int8/int4: both phases of the exchange on the wire, the second started halfway, when H / F > 1)."""
    H, mu, lr, M, G, steps = 3, 0.9, 0.7, 2, 8, 8
    tau = H // fragments
    got, params, eng, isl, P = islands_and_their_engines(
        corpus, steps, G, ["strategy.diloco.overlap=true", f"strategy.diloco.overlap_mix={mix}"], H, mu, lr,
        quantize, fragments)
    outer = P[0].copy()
    tensors = tensor_bounds(isl[0])
    frag = fragment_slices_of(eng, tensors)
    buf, resid = np.zeros_like(outer), [np.zeros_like(outer) for _ in range(M)]
    flying = {}                 # step it lands after -> [(slice, mean pseudo-gradient)]
    want = {i: [] for i in range(M)}
    for s in range(steps):
        for i, e in enumerate(isl):
            want[i].append(e.train_step(s)["loss"])
        for sl, g in flying.pop(s, []):
            buf[sl] = mu * buf[sl] + g
            outer[sl] = outer[sl] - lr * (g + mu * buf[sl])
            for i in range(M):
                P[i][sl] = mix * P[i][sl] + (1 - mix) * outer[sl]
        for f in range(fragments):
            if (s + 1 + f * H // fragments) % H:
                continue
            sl = frag[f]
            g = np_exchange([outer[sl] - P[i][sl] for i in range(M)], resid, sl, tensors, quantize)
            flying.setdefault(s + tau, []).append((sl, g))
    assert flying, "an exchange still on the wire at the end: the run must not have waited for it"
    for i in range(M):
        assert_same(got[i], np.array(want[i]))
    assert_same_params(params, isl[eng.mesh.coords["replica"]].named_params())     # this rank's island


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_overlap_resumes_with_exchanges_on_the_wire(corpus, root, quantize):
    """A checkpoint after step 4 (period 3, overlap: the exchange started after step 3 lands after step 6) holds the
    exchange's mean; resuming from it (dp 2 inside each island at 4 ranks, whatever the world) continues exactly."""
    n = WORLD.Get_size()
    need(n % 2 == 0, "2 islands of equal size")
    knobs = DILOCO + ["strategy.diloco.inner_steps=3", f"strategy.diloco.quantize={quantize}",
                      "strategy.diloco.overlap=true"]
    a = ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n // 2}"]
    straight = run(config(corpus, *knobs, *a), WORLD, steps=8)
    saved_after(config(corpus, *knobs, *a), WORLD, root, 4)
    assert_resumes_like(config(corpus, *knobs, *a), WORLD, root, straight, at=4, steps=4)
