"""The CuPy path of the layers' element-wise and row-wise work: one launch of kernels/fused.cu each, in
place of a chain of CuPy calls that each launch a kernel and make a pass over memory. The NumPy code
beside each call site in hpengine/nn is the twin: same formulas, used on the CPU and for float16.
"""
from __future__ import annotations

import numpy as np

from hpengine.device import backend, kernels

# `ENABLED` switches the fused path off (benchmarks/gpu_profile.py compares both).
ENABLED = True
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
# Under bfloat16 amp the outputs that only feed bf16 GEMMs can come out as bfloat16 bits (uint16, rounded as
# device/bf16_bits.py's TO_BF16_BODY) from the same launch: `bits=True` on gelu_forward, layernorm_forward,
# rmsnorm_forward, rope_forward, rope_backward, swiglu_forward and swiglu_backward, and causal_softmax_bits
# (the _f32_bf16 entries); these take float32 arrays only. A GEMM's output in bits is read as it is (the
# _f32_bf16i entries): rope_forward's x, gelu's x (and its cache s), swiglu's g and u (and s), and
# gelu_recompute and swiglu_recompute take bits; their outputs are then bits too, but gelu_backward's dx
# (float32).
# The softmax backwards read p as bits when it is uint16. The norms' caches can be bits too: `cache_bits=True`
# on layernorm_forward and rmsnorm_forward writes y and xhat as bits (the _f32_bf16x entries), which their
# backward_dx and colsum_'s b2 read as they are (_f32_bf16i); softmax_backward_bits and
# grouped_softmax_backward_bits write the softmax gradient as bits into a new array (_f32_bf16o). Math is float32
# throughout; dtypes that fit no entry are a ValueError.
BITS = np.dtype(np.uint16)


def usable(xp, *arrays) -> bool:
    """True when the fused kernels take these arrays: CuPy, one dtype, float32 or float64."""
    return (ENABLED and xp.__name__ == "cupy" and arrays[0].dtype in _SUFFIX
            and all(a.dtype == arrays[0].dtype for a in arrays))


def bits_usable(xp, *arrays) -> bool:
    """True when these arrays are bfloat16 bits (uint16) an _f32_bf16i entry takes: CuPy, every one uint16."""
    return ENABLED and xp.__name__ == "cupy" and all(a.dtype == BITS for a in arrays)


# entry name tails after the math's suffix: outputs as bits; inputs (and the outputs) as bits; a norm's output
# and its cache as bits; a separate bits output of a gradient otherwise made in place
BF16, BF16I, BF16X, BF16O = "_bf16", "_bf16i", "_bf16x", "_bf16o"


def _fn(entry: str, dtype, tail: str = ""):
    return kernels.function("fused", f"{entry}_{_SUFFIX[np.dtype(dtype)]}{tail}")


def _float32(what: str, *arrays) -> None:
    # the _bf16 entries exist for float32 math only
    bad = [a.dtype for a in arrays if a.dtype != np.float32]
    if bad:
        raise ValueError(f"{what}: bfloat16 bits come from float32 arrays only, not {bad[0]}")


def _bits_in(what: str, bits: dict, f32: dict | None = None) -> bool:
    """True when the arrays `bits` (name -> array) are bfloat16 bits (uint16) and `f32` float32: an _f32_bf16i
    entry's operands; False when none of them is uint16; a ValueError naming the dtypes for any other mix."""
    f32 = f32 or {}
    named = {**bits, **f32}
    held = [a.dtype == BITS for a in named.values()]
    if not any(held):
        return False
    if all(held[:len(bits)]) and all(a.dtype == np.float32 for a in f32.values()):
        return True
    got = ", ".join(f"{k} {a.dtype}" for k, a in named.items())
    want = ", ".join(bits) + " uint16" + (", " + ", ".join(f32) + " float32" if f32 else "")
    raise ValueError(f"{what}: no kernel entry takes {got} (bfloat16 bits: {want}; else one float dtype)")


def _out(xp, like, bits: bool):
    return xp.empty(like.shape, dtype=BITS) if bits else xp.empty_like(like)


def _row_threads(n_cols: int) -> int:
    # about four elements per thread, 32 .. 1024 threads
    return int(min(1024, max(32, 1 << max(0, (n_cols - 1).bit_length() - 2))))


def _rows(entry, dtype, n_rows, n_cols, args, tail=""):
    _fn(entry, dtype, tail)((max(1, min(int(n_rows), 1 << 20)),), (_row_threads(n_cols),), args)


def _points(entry, dtype, n, args, tail=""):
    _fn(entry, dtype, tail)((kernels.blocks_for(n),), (kernels.THREADS,), args)


def gelu_forward(xp, x, bits=False):
    """-> y = gelu(x) and the cache s, contiguous, of x's shape; y as bfloat16 bits with bits=True. x as bits
    (uint16): y and s as bits, y from the value s holds (gelu_recompute's y), whatever `bits` says."""
    x = xp.ascontiguousarray(x)
    if _bits_in("gelu_forward", {"x": x}):
        y, s = xp.empty_like(x), xp.empty_like(x)
        _points("gelu_fwd", np.float32, x.size, (x, y, s, np.int64(x.size)), BF16I)
        return y, s
    if bits:
        _float32("gelu_forward", x)
    y, s = _out(xp, x, bits), xp.empty_like(x)
    _points("gelu_fwd", x.dtype, x.size, (x, y, s, np.int64(x.size)), BF16 if bits else "")
    return y, s


def gelu_backward(xp, x, s, dy):
    """-> dx, contiguous, of dy's shape; x and s may be bits (uint16, gelu_forward's from bits), dy then float32
    and dx bits (only GEMMs and a bias gradient read it)."""
    x, s, dy = xp.ascontiguousarray(x), xp.ascontiguousarray(s), xp.ascontiguousarray(dy)
    tail = BF16I if _bits_in("gelu_backward", {"x": x, "s": s}, {"dy": dy}) else ""
    dx = xp.empty(dy.shape, dtype=BITS) if tail else xp.empty_like(dy)
    _points("gelu_bwd", dy.dtype, dy.size, (x, s, dy, dx, np.int64(dy.size)), tail)
    return dx


def gelu_recompute(xp, x, s):
    """-> y = x s as bits (uint16), contiguous, from gelu_forward's bits x and s: its y again, bit for bit."""
    x, s = xp.ascontiguousarray(x), xp.ascontiguousarray(s)
    if not _bits_in("gelu_recompute", {"x": x, "s": s}):
        raise ValueError(f"gelu_recompute: bfloat16 bits (uint16) only, not x {x.dtype}, s {s.dtype}")
    y = xp.empty_like(x)
    _points("gelu_recompute", np.float32, x.size, (x, s, y, np.int64(x.size)), BF16I)
    return y


def causal_softmax_(p, q0: int):
    """In place on scores p (..., n_q, n_cols) of queries q0 .. q0 + n_q - 1."""
    n_q, n_cols = p.shape[-2:]
    n_rows = p.size // n_cols
    _rows("causal_softmax", p.dtype, n_rows, n_cols, (p, np.int64(n_rows), np.int32(n_cols), np.int32(n_q),
                                                      np.int32(q0)))


def causal_softmax_bits(xp, z, q0: int):
    """The bfloat16 bits (uint16, z's shape) of the causal softmax of float32 scores z (..., n_q, n_cols),
    contiguous, of queries q0 .. q0 + n_q - 1: causal_softmax_'s float32 values, rounded; z is left as it is."""
    _float32("causal_softmax_bits", z)
    if not z.flags.c_contiguous:
        raise ValueError("causal_softmax_bits: z must be contiguous")
    n_q, n_cols = z.shape[-2:]
    n_rows = z.size // n_cols
    p = xp.empty(z.shape, dtype=BITS)
    _rows("causal_softmax", z.dtype, n_rows, n_cols, (z, p, np.int64(n_rows), np.int32(n_cols), np.int32(n_q),
                                                      np.int32(q0)), BF16)
    return p


def softmax_backward_(ds, p, rs, q0: int):
    """In place: ds = (ds - rs) * p, with rs (..., T, 1) holding one value per query of the whole sequence; p
    may be bfloat16 bits (uint16), ds and rs then float32."""
    bits = p.dtype == BITS
    if bits:
        _float32("softmax_backward_", ds, rs)
    n_q, n_cols = ds.shape[-2:]
    _points("softmax_bwd", ds.dtype, ds.size, (ds, p, rs, np.int64(ds.size), np.int32(n_cols), np.int32(n_q),
                                               np.int32(q0), np.int32(rs.shape[-2])), BF16 if bits else "")


def grouped_softmax_backward_(ds, p, rs):
    """In place: ds = (ds - rs) * p, with ds, p (..., n_cols) contiguous and rs (..., 1) one value per row; p may
    be bfloat16 bits (uint16), ds and rs then float32."""
    if not (ds.flags.c_contiguous and p.flags.c_contiguous):
        raise ValueError("grouped_softmax_backward_: ds and p must be contiguous")
    bits = p.dtype == BITS
    if bits:
        _float32("grouped_softmax_backward_", ds, rs)
    rs = rs if rs.flags.c_contiguous else rs.copy()
    _points("grouped_softmax_bwd", ds.dtype, ds.size, (ds, p, rs, np.int64(ds.size), np.int32(ds.shape[-1])),
            BF16 if bits else "")


def _bits_out_of_place(what, ds, p, rs):
    # the _bf16o entries' operands: ds and rs float32, p bits, ds and p contiguous; -> the new bits output
    if not _bits_in(what, {"p": p}, {"ds": ds, "rs": rs}):
        raise ValueError(f"{what}: no kernel entry takes p {p.dtype} (bfloat16 bits: p uint16, ds, rs float32)")
    if not (ds.flags.c_contiguous and p.flags.c_contiguous and p.shape == ds.shape):
        raise ValueError(f"{what}: ds and p must be contiguous and of one shape, not {ds.shape} and {p.shape}")
    return backend.cupy_module().empty(ds.shape, dtype=BITS)


def softmax_backward_bits(ds, p, rs, q0: int):
    """-> (ds - rs) * p as bfloat16 bits (uint16), a new contiguous array of ds's shape: softmax_backward_'s
    float32 values, rounded, with ds (dP, float32) left as it is; p bits, rs float32 as there."""
    out = _bits_out_of_place("softmax_backward_bits", ds, p, rs)
    n_q, n_cols = ds.shape[-2:]
    _points("softmax_bwd", np.float32, ds.size, (ds, p, rs, out, np.int64(ds.size), np.int32(n_cols),
                                                 np.int32(n_q), np.int32(q0), np.int32(rs.shape[-2])), BF16O)
    return out


def grouped_softmax_backward_bits(ds, p, rs):
    """-> (ds - rs) * p as bfloat16 bits (uint16), a new contiguous array of ds's shape: grouped_softmax_backward_'s
    float32 values, rounded, with ds (dP, float32) left as it is; p bits, rs float32 as there."""
    out = _bits_out_of_place("grouped_softmax_backward_bits", ds, p, rs)
    rs = rs if rs.flags.c_contiguous else rs.copy()
    _points("grouped_softmax_bwd", np.float32, ds.size, (ds, p, rs, out, np.int64(ds.size),
                                                         np.int32(ds.shape[-1])), BF16O)
    return out


def _norm_out_tail(what, bits, cache_bits, *arrays):
    # the forward entry for bits / cache_bits: bits -> _bf16 (y), both -> _bf16x (y and xhat); float32 only
    if cache_bits and not bits:
        raise ValueError(f"{what}: cache_bits=True needs bits=True (the cache in bits, y in float32: no entry)")
    if bits:
        _float32(what, *arrays)
    return BF16X if cache_bits else BF16 if bits else ""


def _norm_in_tail(what, dy2, xhat, rstd, w):
    # the backward entry: xhat as bits (a cache_bits forward's) with dy, rstd and w float32 -> _bf16i
    return BF16I if _bits_in(what, {"xhat": xhat}, {"dy": dy2, "rstd": rstd, "w": w}) else ""


def layernorm_forward(xp, x2, w, b, eps, bits=False, cache_bits=False):
    """x2 (N, C) -> y, xhat (N, C), rstd (N, 1); y as bfloat16 bits with bits=True, and xhat too with
    cache_bits=True (y from the float32 xhat, rounded once; rstd float32)."""
    x2, w, b = xp.ascontiguousarray(x2), xp.ascontiguousarray(w), xp.ascontiguousarray(b)
    tail = _norm_out_tail("layernorm_forward", bits, cache_bits, x2, w, b)
    n, c = x2.shape
    y, xhat, rstd = _out(xp, x2, bits), _out(xp, x2, cache_bits), xp.empty((n, 1), dtype=x2.dtype)
    _rows("layernorm_fwd", x2.dtype, n, c, (x2, w, b, y, xhat, rstd, np.int64(n), np.int32(c), x2.dtype.type(eps)),
          tail)
    return y, xhat, rstd


def layernorm_backward_dx(xp, dy2, xhat, rstd, w):
    """-> dx (N, C) of layer norm from dy2 (N, C) and the forward's xhat and rstd; xhat may be bits (uint16, a
    cache_bits forward's), dy2, rstd, w and dx then float32."""
    dy2, xhat, rstd, w = (xp.ascontiguousarray(a) for a in (dy2, xhat, rstd, w))
    tail = _norm_in_tail("layernorm_backward_dx", dy2, xhat, rstd, w)
    n, c = dy2.shape
    dx = xp.empty_like(dy2)
    _rows("layernorm_bwd", dy2.dtype, n, c, (dy2, xhat, rstd, w, dx, np.int64(n), np.int32(c)), tail)
    return dx


def rmsnorm_forward(xp, x2, w, eps, bits=False, cache_bits=False):
    """x2 (N, C) -> y, xhat (N, C), rstd (N, 1); y as bfloat16 bits with bits=True, and xhat too with
    cache_bits=True (y from the float32 xhat, rounded once; rstd float32)."""
    x2, w = xp.ascontiguousarray(x2), xp.ascontiguousarray(w)
    tail = _norm_out_tail("rmsnorm_forward", bits, cache_bits, x2, w)
    n, c = x2.shape
    y, xhat, rstd = _out(xp, x2, bits), _out(xp, x2, cache_bits), xp.empty((n, 1), dtype=x2.dtype)
    _rows("rmsnorm_fwd", x2.dtype, n, c, (x2, w, y, xhat, rstd, np.int64(n), np.int32(c), x2.dtype.type(eps)), tail)
    return y, xhat, rstd


def rmsnorm_backward_dx(xp, dy2, xhat, rstd, w):
    """-> dx (N, C) of RMS norm from dy2 (N, C) and the forward's xhat and rstd; xhat may be bits (uint16, a
    cache_bits forward's), dy2, rstd, w and dx then float32."""
    dy2, xhat, rstd, w = (xp.ascontiguousarray(a) for a in (dy2, xhat, rstd, w))
    tail = _norm_in_tail("rmsnorm_backward_dx", dy2, xhat, rstd, w)
    n, c = dy2.shape
    dx = xp.empty_like(dy2)
    _rows("rmsnorm_bwd", dy2.dtype, n, c, (dy2, xhat, rstd, w, dx, np.int64(n), np.int32(c)), tail)
    return dx


def _rope(entry, xp, x, cos, sin, out, n_t, n_h, tail=""):
    # one thread per rotated pair of out; x is read in its own strides, passed in elements (of x's dtype, bits
    # too); float32 math for bits
    if any(st % x.itemsize for st in x.strides):
        x = xp.ascontiguousarray(x)
    cos, sin = xp.ascontiguousarray(cos), xp.ascontiguousarray(sin)
    if cos.shape != sin.shape or cos.shape[0] < n_t or 2 * cos.shape[1] != out.shape[-1]:
        raise ValueError(f"{entry}: tables {cos.shape}, {sin.shape} do not fit {n_t} positions of {out.shape}")
    n = out.size // 2
    strides = tuple(np.int64(st // x.itemsize) for st in x.strides)
    _points(entry, np.float32 if x.dtype == BITS else x.dtype, n,
            (x, cos, sin, out, np.int64(n), np.int32(n_t), np.int32(n_h), np.int32(out.shape[-1] // 2)) + strides, tail)
    return out


def _rope_tail(what, x, cos, sin, bits):
    # the entry for x and the tables: bits in (float32 tables), bits out (float32 all), or one float dtype
    if _bits_in(what, {"x": x}, {"cos": cos, "sin": sin}):
        return BF16I
    if bits:
        _float32(what, x, cos, sin)
    return BF16 if bits else ""


def rope_forward(xp, x, cos, sin, bits=False):
    """x (B, T, H, hd) in any strides, cos and sin (T, hd/2) -> a new contiguous (B, H, T, hd); as bfloat16 bits
    with bits=True or when x is bits (uint16, the tables then float32)."""
    B, T, H, hd = x.shape
    tail = _rope_tail("rope_forward", x, cos, sin, bits)
    out = xp.empty((B, H, T, hd), dtype=BITS if tail else x.dtype)
    return _rope("rope_fwd", xp, x, cos, sin, out, T, H, tail)


def rope_backward(xp, dy, cos, sin, bits=False):
    """dy (B, H, T, hd) in any strides -> a new contiguous (B, T, H, hd), rotated back; as bfloat16 bits with
    bits=True (dy, cos and sin float32)."""
    B, H, T, hd = dy.shape
    if dy.dtype == BITS:
        raise ValueError("rope_backward: no kernel entry reads dy as bfloat16 bits (uint16), only float32 or float64")
    if bits:
        _float32("rope_backward", dy, cos, sin)
    out = xp.empty((B, T, H, hd), dtype=BITS if bits else dy.dtype)
    return _rope("rope_bwd", xp, dy, cos, sin, out, T, H, BF16 if bits else "")


def swiglu_forward(xp, g, u, bits=False):
    """-> a = g sigmoid(g) u and s = sigmoid(g), contiguous, of g's shape; a as bfloat16 bits with bits=True.
    g and u as bits (uint16): a and s as bits, a from the value s holds (swiglu_recompute's a), whatever `bits`
    says."""
    g, u = xp.ascontiguousarray(g), xp.ascontiguousarray(u)
    if _bits_in("swiglu_forward", {"g": g, "u": u}):
        a, s = xp.empty_like(g), xp.empty_like(g)
        _points("swiglu_fwd", np.float32, g.size, (g, u, a, s, np.int64(g.size)), BF16I)
        return a, s
    if bits:
        _float32("swiglu_forward", g, u)
    a, s = _out(xp, g, bits), xp.empty_like(g)
    _points("swiglu_fwd", g.dtype, g.size, (g, u, a, s, np.int64(g.size)), BF16 if bits else "")
    return a, s


def swiglu_backward(xp, g, u, s, da, bits=False):
    """-> (dg, du), contiguous, of g's shape; as bfloat16 bits with bits=True, or when g, u and s are bits
    (uint16, swiglu_forward's from bits; da then float32)."""
    g, u, s, da = (xp.ascontiguousarray(a) for a in (g, u, s, da))
    if _bits_in("swiglu_backward", {"g": g, "u": u, "s": s}, {"da": da}):
        dg, du = xp.empty_like(g), xp.empty_like(g)
        _points("swiglu_bwd", np.float32, g.size, (g, u, s, da, dg, du, np.int64(g.size)), BF16I)
        return dg, du
    if bits:
        _float32("swiglu_backward", g, u, s, da)
    dg, du = _out(xp, g, bits), _out(xp, g, bits)
    _points("swiglu_bwd", g.dtype, g.size, (g, u, s, da, dg, du, np.int64(g.size)), BF16 if bits else "")
    return dg, du


def swiglu_recompute(xp, g, u, s):
    """-> a = (g s) u as bits (uint16), contiguous, from swiglu_forward's bits g, u and s: its a again, bit for
    bit."""
    g, u, s = (xp.ascontiguousarray(a) for a in (g, u, s))
    if not _bits_in("swiglu_recompute", {"g": g, "u": u, "s": s}):
        raise ValueError(f"swiglu_recompute: bfloat16 bits (uint16) only, not g {g.dtype}, u {u.dtype}, s {s.dtype}")
    a = xp.empty_like(g)
    _points("swiglu_recompute", np.float32, g.size, (g, u, s, a, np.int64(g.size)), BF16I)
    return a


def colsum_(xp, a2, out, b2=None):
    """out += the column sums of a2 (N, C), or of a2 * b2, in a fixed order (no atomics); out contiguous. b2 may be
    bfloat16 bits (uint16: a cache_bits norm's xhat), a2 and out then float32; or, without b2, a2 (a bfloat16
    output gradient), out then float32. The bits' sums are the float32 entry's on their values, bit for bit."""
    if not out.flags.c_contiguous:
        raise ValueError("colsum_: out must be contiguous")
    if a2.dtype == BITS and b2 is not None:
        raise ValueError("colsum_: no kernel entry reads a2 as bfloat16 bits (uint16) with a b2")
    a2 = xp.ascontiguousarray(a2)
    n, c = a2.shape
    chunks = int(max(1, min(256, -(-n // 64))))
    sums = out.dtype if a2.dtype == BITS else a2.dtype       # the dtype the sums are made in
    part = xp.empty((chunks, c), dtype=sums)
    grid, block = (-(-c // 32), chunks), (32, 8)
    if b2 is None:
        tail = BF16I if _bits_in("colsum_", {"a2": a2}, {"out": out}) else ""
        _fn("colsum_part", sums, tail)(grid, block, (a2, part, np.int64(n), np.int32(c)))
    else:
        b2 = xp.ascontiguousarray(b2)
        tail = BF16I if _bits_in("colsum_", {"b2": b2}, {"a2": a2, "out": out}) else ""
        _fn("colsum_prod_part", a2.dtype, tail)(grid, block, (a2, b2, part, np.int64(n), np.int32(c)))
    _points("colsum_finish", sums, c, (part, out, np.int32(chunks), np.int32(c), np.int32(1)))


def _targets(xp, targets):
    return xp.ascontiguousarray(targets.reshape(-1), dtype=xp.int64)


def cross_entropy_forward(xp, logits, targets):
    """logits (..., V) -> softmax p (same shape) and the per-token loss nll (rows,)."""
    logits = xp.ascontiguousarray(logits)
    v = logits.shape[-1]
    n = logits.size // v
    p, nll = xp.empty_like(logits), xp.empty(n, dtype=logits.dtype)
    _rows("xent_fwd", logits.dtype, n, v, (logits, _targets(xp, targets), p, nll, np.int64(n), np.int32(v)))
    return p, nll


def cross_entropy_backward(xp, p, targets, scale: float):
    """(p - onehot(targets)) * scale."""
    d = xp.empty_like(p)
    _points("xent_bwd", p.dtype, p.size, (p, _targets(xp, targets), d, np.int64(p.size), np.int32(p.shape[-1]),
                                          p.dtype.type(scale)))
    return d
