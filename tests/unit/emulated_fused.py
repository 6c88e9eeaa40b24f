"""NumPy emulators of the entries of hpengine/_kernels/fused.cu, for the CuPy stand-in (emulated_cupy.py). Each
takes a launch as the kernel does (its device pointers and scalars, and the launch where the work split depends
on it), computes what the C code computes in the entry's type, and writes the kernel's outputs only; a read or
write past an array, or a launch outside the .cu's launch assumptions, fails an assertion naming the entry. The
_f32_bf16, _f32_bf16i, _f32_bf16x and _f32_bf16o entries run their _f32 emulator on float32 temporaries and the
float32 values of bits inputs, and store the bfloat16 bits."""
from __future__ import annotations

import functools
import re

import numpy as np

from hpengine.device import kernels
from hpengine.device.bf16_bits import bf16_bits_numpy, from_bf16_bits

_SRC = kernels.source_path("fused").read_text()
GELU_K, GELU_A = (float(re.search(rf"^#define {n} (\S+)$", _SRC, re.M).group(1)) for n in ("GELU_K", "GELU_A"))


def mem(a, n, what: str) -> np.ndarray:
    """The first n elements of the contiguous device array a, as a writable flat view."""
    n = int(n)
    assert 0 <= n <= a.size, f"{what}: {n} elements of an array of {a.size}"
    return a.view(np.ndarray).reshape(-1)[:n]


def inside(a, idx, what: str) -> None:
    """Flat indices idx fall in the device array a."""
    assert idx.size == 0 or (idx.min() >= 0 and idx.max() < a.size), \
        f"{what}: elements {idx.min()} .. {idx.max()} of an array of {a.size}"


def at(a, idx, what: str) -> np.ndarray:
    """The contiguous device array a's elements at flat indices idx (a copy)."""
    inside(a, idx, what)
    return a.view(np.ndarray).reshape(-1)[idx]


def _table(a, n_rows, n_cols, what):
    return mem(a, int(n_rows) * int(n_cols), what).reshape(int(n_rows), int(n_cols))


def _row_block(entry, launch):
    # block_reduce shuffles over full warps and keeps MAX_WARPS partial values
    x = launch.block[0]
    assert x % 32 == 0 and x <= 1024 and tuple(launch.block[1:]) in ((), (1,), (1, 1)), f"{entry}: block {launch.block}"


# ---------------------------------------------------------------- point-wise

def gelu_fwd(entry, args, launch):
    x, y, s, n = args
    t = x.dtype.type
    xi = mem(x, n, entry)
    u = xi * xi
    u *= t(-2.0 * GELU_A * GELU_K)
    u -= t(2.0 * GELU_K)
    u *= xi
    with np.errstate(over="ignore"):          # exp overflows to inf for large negative x: s = 0, as on the device
        si = t(1) / (np.exp(u) + t(1))
    mem(s, n, entry)[...] = si
    mem(y, n, entry)[...] = xi * si


def gelu_bwd(entry, args, launch):
    x, s, dy, dx, n = args
    t = x.dtype.type
    xi, si = mem(x, n, entry), mem(s, n, entry)
    d = xi * xi
    d *= t(6.0 * GELU_A * GELU_K)
    d += t(2.0 * GELU_K)
    d *= xi
    d *= t(1) - si
    d += t(1)
    d *= si
    mem(dx, n, entry)[...] = d * mem(dy, n, entry)


def softmax_bwd(entry, args, launch):
    ds, p, rs, n, n_cols, n_q, q0, rs_len = (int(a) if isinstance(a, np.integer) else a for a in args)
    assert 0 <= q0 and q0 + n_q <= rs_len, f"{entry}: queries {q0} .. {q0 + n_q - 1} of rows of {rs_len}"
    r = np.arange(n) // n_cols
    d = mem(ds, n, entry)
    d[...] = (d - at(rs, (r // n_q) * rs_len + q0 + r % n_q, entry)) * mem(p, n, entry)


def grouped_softmax_bwd(entry, args, launch):
    ds, p, rs, n, n_cols = args
    n, n_cols = int(n), int(n_cols)
    d = mem(ds, n, entry)
    d[...] = (d - at(rs, np.arange(n) // n_cols, entry)) * mem(p, n, entry)


def rope(entry, args, launch):
    """Also the _bf16i entry's: x a strided view of bits, whose elements are read as the values they hold."""
    x, cs, sn, y, n, n_t, n_h, n_k, *strides = args
    n, n_t, n_h, n_k = int(n), int(n_t), int(n_h), int(n_k)
    fwd = entry.startswith("rope_fwd")
    assert x.ndim == 4 and tuple(strides) == tuple(st // x.itemsize for st in x.strides), \
        f"{entry}: input strides {strides} are not those of its {x.shape} view {x.strides}"
    i = np.arange(n)
    r, k = i // n_k, i % n_k
    q = r // n_t if fwd else r // n_h
    t = r % n_t if fwd else q % n_t
    h = q % n_h if fwd else r % n_h
    b = q // n_h if fwd else q // n_t
    ax1, ax2 = (t, h) if fwd else (h, t)
    if n:
        assert (b.max() < x.shape[0] and ax1.max() < x.shape[1] and ax2.max() < x.shape[2]
                and 2 * n_k <= x.shape[3]), f"{entry}: pairs of {n} reach past the {x.shape} input"
    xv = x.view(np.ndarray)
    x1, x2 = xv[b, ax1, ax2, k], xv[b, ax1, ax2, k + n_k]
    if x.dtype == np.uint16:
        x1, x2 = from_bf16_bits(np, x1), from_bf16_bits(np, x2)
    c, s = at(cs, t * n_k + k, entry), at(sn, t * n_k + k, entry)
    lo = r * 2 * n_k + k
    inside(y, lo + n_k, entry)
    out = mem(y, y.size, entry)
    out[lo] = x1 * c - x2 * s if fwd else x1 * c + x2 * s
    out[lo + n_k] = x2 * c + x1 * s if fwd else x2 * c - x1 * s


def swiglu_fwd(entry, args, launch):
    g, u, a, s, n = args
    t = g.dtype.type
    gi = mem(g, n, entry)
    si = t(1) / (np.exp(-gi) + t(1))
    mem(s, n, entry)[...] = si
    mem(a, n, entry)[...] = gi * si * mem(u, n, entry)


def swiglu_bwd(entry, args, launch):
    g, u, s, da, dg, du, n = args
    t = g.dtype.type
    gi, si, dai = mem(g, n, entry), mem(s, n, entry), mem(da, n, entry)
    mem(du, n, entry)[...] = gi * si * dai
    d = t(1) - si
    d *= gi
    d += t(1)
    d *= si
    d *= mem(u, n, entry)
    mem(dg, n, entry)[...] = d * dai


def gelu_recompute(entry, args, launch):
    x, s, y, n = args
    mem(y, n, entry)[...] = mem(x, n, entry) * mem(s, n, entry)


def swiglu_recompute(entry, args, launch):
    g, u, s, a, n = args
    out = mem(a, n, entry)
    out[...] = mem(g, n, entry) * mem(s, n, entry)
    out *= mem(u, n, entry)


def _targets(entry, target, n_rows, n_cols):
    tg = mem(target, n_rows, entry)
    assert n_rows == 0 or (tg.min() >= 0 and tg.max() < n_cols), f"{entry}: a target outside 0 .. {n_cols - 1}"
    return tg


def xent_bwd(entry, args, launch):
    p, target, d, n, n_cols, scale = args
    n, n_cols = int(n), int(n_cols)
    i = np.arange(n)
    r, j = i // n_cols, i % n_cols
    tg = _targets(entry, target, -(-n // n_cols), n_cols)
    mem(d, n, entry)[...] = mem(p, n, entry) * scale - np.where(j == tg[r], scale, p.dtype.type(0))


# ---------------------------------------------------------------- one block per row

def causal_softmax(entry, args, launch):
    p, n_rows, n_cols, n_q, q0 = (int(a) if isinstance(a, np.integer) else a for a in args)
    _row_block(entry, launch)
    rows = _table(p, n_rows, n_cols, entry)
    seen = q0 + np.arange(n_rows) % n_q + 1
    assert n_rows == 0 or (seen.min() >= 1 and seen.max() <= n_cols), \
        f"{entry}: rows see {seen.min()} .. {seen.max()} keys of rows of {n_cols}"
    mask = np.arange(n_cols) < seen[:, None]
    z = np.where(mask, rows, -np.inf).astype(p.dtype)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    inv = p.dtype.type(1) / e.sum(axis=1, keepdims=True)
    rows[...] = np.where(mask, e * inv, p.dtype.type(0))


def layernorm_fwd(entry, args, launch):
    x, w, b, y, xhat, rstd, n_rows, n_cols, eps = args
    _row_block(entry, launch)
    n_rows, n_cols = int(n_rows), int(n_cols)
    xr = _table(x, n_rows, n_cols, entry)
    mean = xr.sum(axis=1, keepdims=True) / x.dtype.type(n_cols)
    d = xr - mean
    rs = x.dtype.type(1) / np.sqrt((d * d).sum(axis=1, keepdims=True) / x.dtype.type(n_cols) + eps)
    h = d * rs
    _table(xhat, n_rows, n_cols, entry)[...] = h
    _table(y, n_rows, n_cols, entry)[...] = h * mem(w, n_cols, entry) + mem(b, n_cols, entry)
    mem(rstd, n_rows, entry)[...] = rs[:, 0]


def _norm_bwd(entry, args, launch):
    """The common arguments of layernorm_bwd and rmsnorm_bwd: (dy, xhat, w, rstd (rows, 1), dx) as row tables, and
    n_cols."""
    dy, xhat, rstd, w, dx, n_rows, n_cols = args
    _row_block(entry, launch)
    n_rows, n_cols = int(n_rows), int(n_cols)
    rows = (_table(a, n_rows, n_cols, entry) for a in (dy, xhat))
    return (*rows, mem(w, n_cols, entry), mem(rstd, n_rows, entry)[:, None], _table(dx, n_rows, n_cols, entry), n_cols)


def layernorm_bwd(entry, args, launch):
    dr, hr, wv, rs, dx, n_cols = _norm_bwd(entry, args, launch)
    g = dr * wv
    n = dr.dtype.type(n_cols)
    mg = g.sum(axis=1, keepdims=True) / n * rs
    mgx = (g * hr).sum(axis=1, keepdims=True) / n * rs
    dx[...] = dr * wv * rs - mg - hr * mgx


def rmsnorm_fwd(entry, args, launch):
    x, w, y, xhat, rstd, n_rows, n_cols, eps = args
    _row_block(entry, launch)
    n_rows, n_cols = int(n_rows), int(n_cols)
    t = x.dtype.type
    xr = _table(x, n_rows, n_cols, entry)
    rs = t(1) / np.sqrt((xr * xr).sum(axis=1, keepdims=True) * t(1.0 / n_cols) + eps)
    h = xr * rs
    _table(xhat, n_rows, n_cols, entry)[...] = h
    _table(y, n_rows, n_cols, entry)[...] = h * mem(w, n_cols, entry)
    mem(rstd, n_rows, entry)[...] = rs[:, 0]


def rmsnorm_bwd(entry, args, launch):
    dr, hr, wv, rs, dx, n_cols = _norm_bwd(entry, args, launch)
    m = (dr * wv * hr).sum(axis=1, keepdims=True) * dr.dtype.type(1.0 / n_cols)
    dx[...] = (dr * wv - hr * m) * rs


def xent_fwd(entry, args, launch):
    z, target, p, nll, n_rows, n_cols = args
    _row_block(entry, launch)
    n_rows, n_cols = int(n_rows), int(n_cols)
    zr = _table(z, n_rows, n_cols, entry)
    tg = _targets(entry, target, n_rows, n_cols)
    m = zr.max(axis=1, keepdims=True)
    e = np.exp(zr - m)
    s = e.sum(axis=1, keepdims=True)
    _table(p, n_rows, n_cols, entry)[...] = e * (z.dtype.type(1) / s)
    mem(nll, n_rows, entry)[...] = (np.log(s) - (zr[np.arange(n_rows), tg][:, None] - m))[:, 0]


# ---------------------------------------------------------------- column sums

def colsum_part(entry, args, launch):
    """part[chunk] = the column sums of the chunk's rows: gridDim.y chunks of ceil(n_rows / gridDim.y) rows,
    columns below gridDim.x * 32."""
    a, b, part, n_rows, n_cols = args if len(args) == 5 else (args[0], None, *args[1:])
    n_rows, n_cols = int(n_rows), int(n_cols)
    assert tuple(launch.block) in ((32, 8), (32, 8, 1)), f"{entry}: block {launch.block}, not (32, 8)"
    gx, gy = (tuple(launch.grid) + (1,))[:2]
    vals = _table(a, n_rows, n_cols, entry)
    if b is not None:
        vals = vals * _table(b, n_rows, n_cols, entry)
    cols = min(n_cols, 32 * gx)
    per = -(-n_rows // gy)
    out = _table(part, gy, n_cols, entry)
    for y in range(gy):
        out[y, :cols] = vals[y * per:min(y * per + per, n_rows), :cols].sum(axis=0)


def colsum_finish(entry, args, launch):
    part, out, n_parts, n_cols, accumulate = (int(a) if isinstance(a, np.integer) else a for a in args)
    s = _table(part, n_parts, n_cols, entry).sum(axis=0)
    o = mem(out, n_cols, entry)
    o[...] = o + s if accumulate else s


_OPS = {"gelu_fwd": gelu_fwd, "gelu_bwd": gelu_bwd, "causal_softmax": causal_softmax, "softmax_bwd": softmax_bwd,
        "layernorm_fwd": layernorm_fwd, "layernorm_bwd": layernorm_bwd, "grouped_softmax_bwd": grouped_softmax_bwd,
        "rmsnorm_fwd": rmsnorm_fwd, "rmsnorm_bwd": rmsnorm_bwd, "rope_fwd": rope, "rope_bwd": rope,
        "swiglu_fwd": swiglu_fwd, "swiglu_bwd": swiglu_bwd, "xent_fwd": xent_fwd, "xent_bwd": xent_bwd,
        "colsum_part": colsum_part, "colsum_prod_part": colsum_part, "colsum_finish": colsum_finish}
EMULATED = {f"{op}_{s}": functools.partial(fn, f"{op}_{s}") for op, fn in _OPS.items() for s in ("f32", "f64")}


# ---------------------------------------------------------------- bfloat16 bits (the _f32_bf16 entries)

def _bits_out(fn, outs, count):
    """fn (an _f32 emulator) with its arguments at positions outs as bfloat16 bits: it computes those into float32
    temporaries, whose first count(args) elements are then stored as their bits (TO_BF16_BODY's rounding)."""
    def run(entry, args, launch):
        temps = {}
        for k in outs:
            assert args[k].dtype == np.uint16, f"{entry} argument {k}: dtype {args[k].dtype}, not bits"
            temps[k] = np.empty(args[k].size, np.float32)
        fn(entry, [temps.get(k, a) for k, a in enumerate(args)], launch)
        n = count(args)
        for k, t in temps.items():
            mem(args[k], n, entry)[...] = bf16_bits_numpy(t[:n])
    return run


def _values(entry, args, ks):
    """args with the bfloat16 bits at positions ks replaced by the float32 values they hold, exactly."""
    for k in ks:
        assert args[k].dtype == np.uint16, f"{entry} argument {k}: dtype {args[k].dtype}, not bits"
    return [from_bf16_bits(np, a.view(np.ndarray)) if j in ks else a for j, a in enumerate(args)]


def _bits_in(fn, ks):
    """fn (an _f32 emulator) with its arguments at positions ks read as bfloat16 bits."""
    def run(entry, args, launch):
        fn(entry, _values(entry, args, ks), launch)
    return run


def _forward_bits_in(fwd, recompute, ins, out, cache):
    """A forward _bf16i entry: fwd (the _f32 emulator) on the values of the bits inputs at positions ins for the
    cache (position cache), stored as bits; then the output (position out) as recompute's bits from the inputs and
    the value the cache's bits hold, as the kernel computes it."""
    def run(entry, args, launch):
        n = _points(args)
        vals = _values(entry, args, ins)
        temps = {k: np.empty(args[k].size, np.float32) for k in (out, cache)}
        for k in temps:
            assert args[k].dtype == np.uint16, f"{entry} argument {k}: dtype {args[k].dtype}, not bits"
        fwd(entry, [temps.get(k, a) for k, a in enumerate(vals)], launch)
        mem(args[cache], n, entry)[...] = bf16_bits_numpy(temps[cache][:n])
        s = from_bf16_bits(np, mem(args[cache], n, entry))
        recompute(entry, [vals[k] for k in ins] + [s, temps[out], np.int64(n)], launch)
        mem(args[out], n, entry)[...] = bf16_bits_numpy(temps[out][:n])
    return run


def causal_softmax_bits(entry, args, launch):
    """causal_softmax_f32 on a float32 copy of the scores z (left as they are), its rows stored as bits in p."""
    z, p, n_rows, n_cols, n_q, q0 = args
    n = int(n_rows) * int(n_cols)
    assert p.dtype == np.uint16, f"{entry} argument 1: dtype {p.dtype}, not bits"
    rows = mem(z, n, entry).copy()
    causal_softmax(entry, (rows, n_rows, n_cols, n_q, q0), launch)
    mem(p, n, entry)[...] = bf16_bits_numpy(rows)


def _separate_out(fn, ins, out):
    """A softmax gradient's _bf16o entry: fn (the in-place _f32 emulator on argument 0, ds) on a float32 copy of
    ds (left as it is) and the values of the bits at positions ins, its result stored as bits in the argument at
    position out, which fn's own argument list lacks."""
    def run(entry, args, launch):
        assert args[out].dtype == np.uint16, f"{entry} argument {out}: dtype {args[out].dtype}, not bits"
        n = int(args[out + 1])                  # n follows out
        vals = _values(entry, args, ins)
        d = mem(args[0], n, entry).copy()
        fn(entry, [d] + [a for k, a in enumerate(vals) if k not in (0, out)], launch)
        mem(args[out], n, entry)[...] = bf16_bits_numpy(d)
    return run


def _points(args):
    return int(args[-1])                        # n, the last argument


def _rows(args):
    return int(args[-3]) * int(args[-2])        # n_rows * n_cols, before eps


def _pairs(args):
    return 2 * int(args[4])                     # rope: both elements of n pairs


_BITS = {"gelu_fwd": _bits_out(gelu_fwd, (1,), _points), "swiglu_fwd": _bits_out(swiglu_fwd, (2,), _points),
         "swiglu_bwd": _bits_out(swiglu_bwd, (4, 5), _points),
         "layernorm_fwd": _bits_out(layernorm_fwd, (3,), _rows), "rmsnorm_fwd": _bits_out(rmsnorm_fwd, (2,), _rows),
         "causal_softmax": causal_softmax_bits, "softmax_bwd": _bits_in(softmax_bwd, (1,)),
         "grouped_softmax_bwd": _bits_in(grouped_softmax_bwd, (1,)),
         "rope_fwd": _bits_out(rope, (3,), _pairs), "rope_bwd": _bits_out(rope, (3,), _pairs)}
_BITS_IN = {"rope_fwd": _bits_out(rope, (3,), _pairs),        # rope reads the strided bits itself
            "gelu_fwd": _forward_bits_in(gelu_fwd, gelu_recompute, (0,), 1, 2),
            "gelu_bwd": _bits_out(_bits_in(gelu_bwd, (0, 1)), (3,), _points),
            "gelu_recompute": _bits_out(_bits_in(gelu_recompute, (0, 1)), (2,), _points),
            "swiglu_fwd": _forward_bits_in(swiglu_fwd, swiglu_recompute, (0, 1), 2, 3),
            "swiglu_bwd": _bits_out(_bits_in(swiglu_bwd, (0, 1, 2)), (4, 5), _points),
            "swiglu_recompute": _bits_out(_bits_in(swiglu_recompute, (0, 1, 2)), (3,), _points),
            "layernorm_bwd": _bits_in(layernorm_bwd, (1,)), "rmsnorm_bwd": _bits_in(rmsnorm_bwd, (1,)),
            "colsum_prod_part": _bits_in(colsum_part, (1,)), "colsum_part": _bits_in(colsum_part, (0,))}
_BITS_X = {"layernorm_fwd": _bits_out(layernorm_fwd, (3, 4), _rows), "rmsnorm_fwd": _bits_out(rmsnorm_fwd, (2, 3), _rows)}
_BITS_O = {"softmax_bwd": _separate_out(softmax_bwd, (1,), 3),
           "grouped_softmax_bwd": _separate_out(grouped_softmax_bwd, (1,), 3)}
EMULATED.update({f"{op}_f32_bf16": functools.partial(fn, f"{op}_f32_bf16") for op, fn in _BITS.items()})
for _tail, _ops in (("_bf16i", _BITS_IN), ("_bf16x", _BITS_X), ("_bf16o", _BITS_O)):
    EMULATED.update({f"{op}_f32{_tail}": functools.partial(fn, f"{op}_f32{_tail}") for op, fn in _ops.items()})
