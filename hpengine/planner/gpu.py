"""The planner's GPU compute time: each GEMM of a micro-batch at the rate its shape reaches, the
element-wise passes at the device memory's bandwidth, and a launch cost per GEMM. Used by
planner/model.py: compute_s when the cluster gives any of gemm_half_dim, mem_bw_gbs, launch_us (all 0 by
default: one sustained FLOP/s for every GEMM, the CPU model); fit_gemm fits the model to measurements.
"""
from __future__ import annotations

import collections
import functools
import math

from hpengine.config.load import head_width, model_from_key, model_key
from hpengine.layout.stage import owner
from hpengine.models import build_model
from hpengine.planner import recompute as rc
from hpengine.planner.stages import memoised

# element-wise traffic per cached byte: forward writes it and the next operation reads it, backward reads
# it and writes and reads its gradient (layernorm, softmax, GELU, residual adds, each unfused)
ELEMENTWISE_PASSES = 4


def enabled(cluster) -> bool:
    """Whether the cluster asks for the shape-dependent GPU model (else one sustained rate)."""
    return bool(cluster.gemm_half_dim or cluster.mem_bw_gbs or cluster.launch_us)


# A GEMM of (M x K) by (K x N), `batch` times (attention: one per sequence and head), takes
#
#     gemm_s = max(batch · 2MKN / (peak · eff(d)),  batch · item · (MK + KN + MN) / mem_bw) + launch
#     eff(d) = eff_max · d / (d + d_half),     d = 3 / (1/M + 1/K + 1/N)
#
# a roofline whose compute roof rises with the size. d is the harmonic mean of the three dimensions: n
# for an n x n x n GEMM, near the smallest when one is small, and 3/2 of the GEMM's arithmetic intensity
# 2MKN / (MK + KN + MN) in FLOPs per element moved. eff(d) is the share of the datasheet peak reached:
# eff_max (cluster.gemm_eff_max) for the largest GEMMs, half of it at d = d_half (cluster.gemm_half_dim),
# where the tiles of the GEMM no longer fill every multiprocessor in whole waves and the operands' loads
# are no longer hidden behind the tensor cores' work. Measured (shape, seconds) pairs fit it by a straight
# line, 1/eff = 1/eff_max + (d_half/eff_max) · 1/d (fit_gemm; calibrate_gpu.py measures them).
def harmonic_dim(m: float, k: float, n: float) -> float:
    return 3.0 / (1.0 / m + 1.0 / k + 1.0 / n)


def efficiency(d: float, half: float, eff_max: float = 1.0) -> float:
    """Share of the peak a GEMM of harmonic dimension d sustains (eff_max when half is 0)."""
    return eff_max * d / (d + half) if half else eff_max


def gemm_s(m: int, k: int, n: int, peak: float, item: int, half: float = 0.0, eff_max: float = 1.0,
           mem_bw: float = 0.0, launch: float = 0.0, batch: int = 1) -> float:
    """Seconds of `batch` GEMMs (M x K) @ (K x N) in one call: peak FLOP/s, item bytes per element,
    mem_bw bytes/s (0: no memory roof), launch seconds per call."""
    t = batch * 2.0 * m * k * n / (peak * efficiency(harmonic_dim(m, k, n), half, eff_max))
    if mem_bw:
        t = max(t, batch * item * (m * k + k * n + m * n) / mem_bw)
    return t + launch


# Backward multiplies twice by every forward GEMM's operands (the input's gradient and the weight's), of
# the same three dimensions, so a layer's GEMM runs 3 times a micro-batch (4 when the layer is recomputed).
def gemms(mcfg, st, lay) -> list[tuple]:
    """(calls, M, K, N, batch) of one micro-batch through the stage on one tp rank: every weight matrix a
    block multiplies by (its own 2-D tensors and the tensors it reads, per tp rank) times the tokens, and
    each layer's two attention GEMMs per sequence and local head, Q K^T (T x hd x T) and P V (T x T x hd)
    (packed documents: StageFacts.attention of those calls, the share of the work their mask leaves);
    3 calls each (forward, two in backward), one more for a fully recomputed layer, and one more Q K^T for
    a selectively recomputed layer that drops its probabilities."""
    tp, tokens, T = lay.tp, lay.rows * mcfg.seq_len // lay.cp, mcfg.seq_len
    Tq = T // lay.cp                     # context parallel: this rank's queries over every key
    # a stage belongs to one model at one tp: its weights memoised on it (model_key is slow to build)
    model, weights = memoised(st, ("model weights",), lambda: _model_weights(model_key(mcfg), tp))
    again, sel = rc.full(st, lay), rc.selective(st, lay)
    drops = bool(model.cache_bytes(lay.rows, tp, 1, lay.amp, lay.share, cp=lay.cp)["scores"])
    att = model.attention_flops(tokens, tp)
    out = collections.Counter()          # identical layers: one entry, their calls added up
    for b in st.kinds:
        if b.kind == "embed":                # a lookup, no GEMM
            continue
        calls = 3 + (b.name in again)
        for kk, nn in weights[b.name]:
            out[tokens, kk, nn, 1] += calls
        if b.kind == "layer" and att:
            hd, heads = head_width(mcfg), mcfg.n_heads // tp
            share = 1 if st.attention == 1.0 else st.attention     # packed documents: the tiles' work left
            out[Tq, hd, T, lay.rows * heads] += (calls + (drops and b.name in sel)) * share
            out[Tq, T, hd, lay.rows * heads] += calls * share
    return [(c, *shape) for shape, c in out.items()]


@functools.lru_cache(maxsize=256)
def _model_weights(mkey, tp: int) -> tuple:
    """(the model, {block: [(rows, cols) per tp rank of each weight matrix it multiplies by]})."""
    model = build_model(model_from_key(mkey), tp)
    shapes = {}
    for b in model.blocks():
        own = [sp.local_shape(0, tp) for sp in model.specs(b.name) if len(sp.global_shape) == 2]
        shapes[b.name] = own + [next(sp.local_shape(0, tp) for sp in model.specs(owner(model, t)) if sp.name == t)
                                for t in b.reads]
    return model, shapes


def gemm_flops(shapes) -> float:
    return sum(c * 2.0 * m * k * n * b for c, m, k, n, b in shapes)


def matmul_s(mcfg, st, lay, cluster, peak: float, item: int) -> float:
    """Seconds of the stage's GEMMs for one micro-batch at their shapes' rates."""
    bw = cluster.mem_bw_gbs * 1e9
    return sum(c * gemm_s(m, k, n, peak, item, cluster.gemm_half_dim, cluster.gemm_eff_max, bw,
                          cluster.launch_us * 1e-6, b) for c, m, k, n, b in gemms(mcfg, st, lay))


def elementwise_s(cached: float, cluster) -> float:
    """Seconds of the element-wise passes over `cached` bytes at the memory bandwidth (0 without one)."""
    return ELEMENTWISE_PASSES * cached / (cluster.mem_bw_gbs * 1e9) if cluster.mem_bw_gbs else 0.0


def compute_s(mcfg, st, lay, cluster, peak: float, item: int, cached: float) -> float:
    return matmul_s(mcfg, st, lay, cluster, peak, item) + elementwise_s(cached, cluster)


# ---- fitting measurements (calibrate_gpu.py) ----------------------------------------------------------

def fit_gemm(samples, peak: float, launch_s: float = 0.0) -> tuple:
    """(gemm_half_dim, gemm_eff_max) from measured ((M, K, N), seconds) of compute-bound GEMMs: the least-
    squares line 1/eff = a + b/d through their efficiencies (less the launch cost), eff_max = 1/a and
    d_half = b/a. Needs two or more distinct d."""
    pts = []
    for (m, k, n), secs in samples:
        eff = 2.0 * m * k * n / max(secs - launch_s, 1e-12) / peak
        pts.append((1.0 / harmonic_dim(m, k, n), 1.0 / eff))
    if len({x for x, _ in pts}) < 2:
        raise ValueError("fit_gemm: needs GEMMs of at least two different sizes")
    mx, my = (sum(p[i] for p in pts) / len(pts) for i in (0, 1))
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    if a <= 0:
        raise ValueError(f"fit_gemm: the measured rates rise without bound (intercept {a:.3g}); time larger GEMMs")
    return max(b / a, 0.0), min(1.0 / a, 1.0)


def fit_line(samples) -> tuple:
    """(intercept, slope) of seconds against size, least squares over (size, seconds) pairs."""
    xs, ys = [float(x) for x, _ in samples], [float(y) for _, y in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


def fit_bandwidth(samples) -> float:
    """Bytes/s from (bytes moved, seconds) of large element-wise kernels: the inverse slope."""
    slope = fit_line(samples)[1]
    if not slope > 0 or not math.isfinite(slope):
        raise ValueError("fit_bandwidth: the times do not grow with the bytes")
    return 1.0 / slope
