"""DiLoCo's int8/int4 formats without MPI: the islands' payloads cut into chunks, each owner's mean re-quantised and
every chunk decoded, against a rounding written out here (blocks of 256 from each segment, float32 scales, round
half to even), for island counts with more islands than blocks and segments that end mid-block."""
import numpy as np
import pytest

from hpengine.strategies import quantize

BLOCK = 256


def rounded(v, segments, levels):
    """Each segment of v in blocks of BLOCK from its start (zero-padded), scale max|x| / levels as float32."""
    out, at = np.empty_like(v), 0
    for n in segments:
        k = -(-n // BLOCK) * BLOCK
        x = np.zeros(k)
        x[:n] = v[at:at + n]
        x = x.reshape(-1, BLOCK)
        scale = (np.abs(x).max(axis=1) / levels).astype(np.float32).astype(np.float64)
        q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)[:, None]), -levels, levels)
        out[at:at + n] = (q * scale[:, None]).reshape(-1)[:n]
        at += n
    return out


@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("M,segments", [(1, [300]), (2, [1000, 7, 513]), (3, [256, 256, 256, 1]), (5, [100, 300]),
                                        (4, [0, 2000])])
def test_chunked_mean_is_the_mean_rounded_twice(fmt, levels, M, segments):
    rng = np.random.default_rng(M)
    vs = [rng.standard_normal(sum(segments)) * 10.0 ** rng.integers(-3, 3, sum(segments)) for _ in range(M)]
    wire = quantize.Wire(quantize.plan_of(segments), M, fmt)
    sent = [quantize.encode(np, v, wire) for v in vs]
    counts = sent[0][2]
    blocks = sum(-(-n // BLOCK) for n in segments)
    cuts = [(blocks * j // M, blocks * (j + 1) // M) for j in range(M)]
    assert counts == [(b - a) * (BLOCK if fmt == "int8" else BLOCK // 2) + 4 * (b - a) for a, b in cuts]
    assert max(counts) - min(counts) <= BLOCK + 4
    displs = np.cumsum([0] + counts)
    # the alltoallv: owner j receives chunk j of every island's payload, in island order
    chunks = []
    for j in range(M):
        received = np.concatenate([p[displs[j]:displs[j + 1]] for p, _, _ in sent])
        chunks.append(quantize.mean_chunk(np, received, wire, j, np.float64))
    assert [c.size for c in chunks] == counts
    got = quantize.decode(np, np.concatenate(chunks), wire, np.float64)
    first = [rounded(v, segments, levels) for v in vs]
    for (_, seen, _), want in zip(sent, first):
        assert np.array_equal(seen, want)
    total = first[0].copy()
    for q in first[1:]:
        total = total + q
    assert np.array_equal(got, rounded(total / M, segments, levels))
