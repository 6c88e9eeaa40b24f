"""NumPy emulators of the flash attention entries of hpengine/_kernels/attention.cu (SIMT: math in the entry's
type A, bfloat16 storage read and stored round-to-nearest-even) and attention_mma.cu (tensor cores: operands
rounded to bfloat16 as they are loaded, P and dS before their products, float32 sums, P rounded per key tile of
BN after the running max), for the CuPy stand-in. Each reads the launch as the kernel does: the (B, heads, T, hd)
views the strides describe, H, KH, T, hd and scale, the document ids seg (null: one document a row; a query sees
a key iff causal and of its document; with ids, only the tiles the kernel walks add to a sum, 0 x NaN included),
and the grid for which (batch row, head) and rows it covers."""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
from emulated_fused import at, inside

from hpengine.device import kernels

_SIMT = kernels.source_path("attention").read_text()
_MMA = kernels.source_path("attention_mma").read_text()


def _define(src, name):
    return int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))


HD_MAX, WARPS, PAD = _define(_SIMT, "HD_MAX"), _define(_MMA, "WARPS"), _define(_MMA, "PAD")
_A = {"float": np.dtype(np.float32), "double": np.dtype(np.float64)}


class Family(NamedTuple):
    rows: int           # query (fwd, dq) or key (dkdv) rows of one block
    threads: int        # blockDim.x
    hd_max: int
    math: np.dtype
    bn: int             # keys per forward tile (P's rounding depends on the running max of the tiles)
    mma: bool           # operands, P and dS rounded to bfloat16 before the products
    shared: dict        # op -> hd -> the bytes of dynamic shared memory the entry uses
    tiles: dict         # op -> the tile a block walks: keys (fwd, dq) or queries (dkdv)


def _families() -> dict:
    fams = {}
    for m in re.finditer(r"^ENTRIES\((\w+), [\w ]+, (\w+), (\d+), (\d+), (\d+)\)", _SIMT, re.M):
        suf, a, rows, tpr, kt = m.group(1), _A[m.group(2)], *map(int, m.group(3, 4, 5))
        qk = (lambda hd, kt=kt, a=a: 2 * kt * hd * a.itemsize)
        # no rounding of P: its key tiling changes only the order of the sums, so one tile of every key
        fams[suf] = ("flash_", Family(rows, rows * tpr, HD_MAX, a, 1 << 30, False, {
            "fwd": qk, "bwd_dq": qk, "bwd_dkdv": lambda hd, kt=kt, a=a: 2 * kt * (hd + 1) * a.itemsize},
            {"fwd": kt, "bwd_dq": kt, "bwd_dkdv": kt}))
    for m in re.finditer(r"^MMA_ENTRIES\((\w+), [\w ]+, (\d+), (\d+), (\d+), (\d+)\)", _MMA, re.M):
        suf, (hd_b, bn, bnq, qt) = m.group(1), map(int, m.group(2, 3, 4, 5))
        ld, kr = hd_b + PAD, 16 * WARPS
        fams[suf] = ("flash_mma_", Family(kr, 32 * WARPS, hd_b, _A["float"], bn, True, {
            "fwd": lambda hd, v=4 * bn * ld: v, "bwd_dq": lambda hd, v=4 * bnq * ld: v,
            "bwd_dkdv": lambda hd, v=4 * (kr + qt) * ld + 8 * qt: v}, {"fwd": bn, "bwd_dq": bnq, "bwd_dkdv": qt}))
    return fams


def _bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)


def rnd(x):
    """bf16() of attention_mma.cu as float32 values: nearest even; inf stays inf, a NaN a NaN."""
    u = _bits(x)
    special = (u & 0x7F800000) == 0x7F800000
    r = np.where(special, (u >> 16) | np.where(u & 0x7FFFFF, np.uint64(0x40), np.uint64(0)), (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return (r.astype(np.uint32) << 16).view(np.float32)


def store(view, idx, values):
    """st() into view[idx]: bfloat16 bits round to nearest even and a NaN becomes 0x7fc0; else a plain store."""
    v = view.view(np.ndarray)
    if v.dtype == np.uint16:
        u = _bits(values)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        values = np.where((u & 0x7FFFFFFF) > 0x7F800000, np.uint16(0x7FC0), r)
    v[idx] = values


def _load(entry, view, b, h, T, hd, what):
    """ld() of the (batch row b[n], head h[n]) slices of a (B, heads, T, hd) view: (n, T, hd) in the math type."""
    assert view.ndim == 4, f"{entry}: {what} is a {view.shape} array, not a (B, heads, T, hd) view"
    assert b.max() < view.shape[0] and h.max() < view.shape[1] and T <= view.shape[2] and hd <= view.shape[3], \
        f"{entry}: {what} rows of batch rows <= {b.max()}, heads <= {h.max()}, T {T}, hd {hd} outside {view.shape}"
    a = view.view(np.ndarray)[b[:, None], h[:, None], np.arange(T)[None, :], :hd]
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a


def _causal(n_rows, T, keys_are_rows=False):
    i, j = np.arange(n_rows)[:, None], np.arange(T)[None, :]
    return i <= j if keys_are_rows else j <= i


def _seen(entry, seg, b, n_rows, T, keys_are_rows=False):
    """(n, n_rows, T): causal and, with document ids, of the same document (rows: queries, or keys for dkdv)."""
    causal = _causal(n_rows, T, keys_are_rows)[None]
    if isinstance(seg, np.uint64):
        assert seg == 0, f"{entry}: seg {seg} is neither a null pointer nor an array"
        return causal
    ids = seg.view(np.ndarray)
    assert ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == T and b.max() < ids.shape[0], \
        f"{entry}: seg {ids.shape} {ids.dtype}, not (B, {T}) int32"
    assert (np.diff(ids, axis=1) >= 0).all(), f"{entry}: document ids fall along a row"
    rows = ids[b]
    return causal & (rows[:, :n_rows, None] == rows[:, None, :T])


def _launch(entry, fam, op, launch, H, KH, T, hd, kv_blocks):
    assert 1 <= KH <= H and 1 <= hd <= fam.hd_max and T >= 1, f"{entry}: H {H}, KH {KH}, T {T}, hd {hd}"
    assert tuple(launch.block) in ((fam.threads,), (fam.threads, 1), (fam.threads, 1, 1)), \
        f"{entry}: block {launch.block}, not ({fam.threads},)"
    need = fam.shared[op](hd)
    assert launch.shared_mem >= need, f"{entry}: {launch.shared_mem} bytes of shared memory, it uses {need}"
    gx, gy = (tuple(launch.grid) + (1,))[:2]
    blocks = np.arange(gy)
    per = KH if kv_blocks else H
    return min(T, gx * fam.rows), blocks // per, blocks % per


def _ids(seg, b):
    return None if isinstance(seg, np.uint64) else seg.view(np.ndarray)[b]


def _walked(fam, op, ids, n_rows, T):
    """(n, n_rows, T) with document ids (n, T), else None: the (row, column) pairs whose tile the entry visits, rows
    queries and columns keys (fwd, dq) or rows keys and columns queries (dkdv). A block of fam.rows rows walks the
    tiles from doc_start of its first query to the diagonal (fwd, dq), or from the diagonal to doc_end of its last
    key (dkdv); on tensor cores each warp of 16 rows also skips the tiles it shares no document with."""
    if ids is None:
        return None
    tile, blk = fam.tiles[op], fam.rows
    r, t0 = np.arange(n_rows), np.arange(T) // tile * tile
    start, tend = r // blk * blk, np.minimum(t0 + tile, T)
    w16, out = r // 16 * 16, np.zeros((len(ids), n_rows, T), bool)
    for n, row in enumerate(ids):
        if op != "bwd_dkdv":
            lo = np.searchsorted(row, row[start], "left") // tile * tile
            w = (t0[None] < np.minimum(start + blk, T)[:, None]) & (t0[None] >= lo[:, None])
            if fam.mma:     # the warp's queries w16.. against the key tile: causal, then a document in common
                w &= (t0[None] <= w16[:, None] + 15) & (row[t0][None] <= row[np.minimum(w16 + 16, T) - 1][:, None]) \
                    & (row[w16][:, None] <= row[tend - 1][None])
        else:
            hi = np.searchsorted(row, row[np.minimum(start + blk, T) - 1], "right")
            w = (t0[None] >= (start - start % tile)[:, None]) & (t0[None] < hi[:, None])
            if fam.mma:     # the warp's keys w16.. against the query tile
                w &= (t0[None] + tile - 1 >= w16[:, None]) & (row[w16][:, None] <= row[tend - 1][None]) \
                    & (row[t0][None] <= row[np.minimum(w16 + 16, T) - 1][:, None])
        out[n] = w
    return out


def _wmm(a, x, w):
    """a @ x as a kernel sums it over the (row, column) pairs w it walks, 0 x NaN included: (n, rows, cols) @ (n,
    cols, hd); every pair when w is None."""
    if w is None:
        return a @ x
    bad = ~np.isfinite(x)
    out = np.where(w, a, 0) @ np.where(bad, 0, x)
    out[(w.astype(np.float64) @ bad.astype(np.float64)) > 0] = np.nan
    return out


def _ints(rest):
    return [int(a) for a in rest[:4]] + [rest[4], rest[5]]


def flash(entry, fam, op):
    def fwd(args, launch):
        (q, k, v, o), (lse, *rest) = args[0:16:4], args[16:]
        H, KH, T, hd, scale, seg = _ints(rest)
        nc, b, h = _launch(entry, fam, op, launch, H, KH, T, hd, False)
        r = rnd if fam.mma else (lambda x: x)
        kh = h // (H // KH)
        Q = r(_load(entry, q, b, h, nc, hd, "q") * scale)
        K, V = r(_load(entry, k, b, kh, T, hd, "k")), r(_load(entry, v, b, kh, T, hd, "v"))
        S = np.where(_seen(entry, seg, b, nc, T), Q @ K.swapaxes(1, 2), -np.inf).astype(fam.math)
        W = _walked(fam, op, _ids(seg, b), nc, T)
        m = np.full((len(b), nc, 1), -np.inf, fam.math)
        l, acc = np.zeros_like(m), np.zeros_like(Q)
        for k0 in range(0, T, fam.bn):              # a tile wholly past a row's diagonal leaves it as it is
            s = S[:, :, k0:k0 + fam.bn]
            mn = np.maximum(m, s.max(axis=2, keepdims=True))
            sh = np.where(np.isneginf(mn), fam.math.type(0), mn)    # a row whose document has not begun yet
            alpha = np.exp(m - sh)
            l *= alpha
            acc *= alpha
            m = mn
            p = np.exp(s - sh)
            l += p.sum(axis=2, keepdims=True)
            acc += _wmm(r(p), V[:, k0:k0 + fam.bn], None if W is None else W[:, :, k0:k0 + fam.bn])
        rows = np.arange(nc)
        store(o, (b[:, None], h[:, None], rows[None, :], slice(0, hd)), acc * (fam.math.type(1) / l))
        lidx = (b * H + h)[:, None] * T + rows[None, :]
        inside(lse, lidx, entry)
        lse.view(np.ndarray).reshape(-1)[lidx] = (m + np.log(l))[..., 0]

    def dq(args, launch):
        (q, k, v, o, do), (lse, dd, dqa, *_s), rest = args[0:20:4], args[20:24], args[26:]
        H, KH, T, hd, scale, seg = _ints(rest)
        nc, b, h = _launch(entry, fam, op, launch, H, KH, T, hd, False)
        r = rnd if fam.mma else (lambda x: x)
        kh = h // (H // KH)
        dO = _load(entry, do, b, h, nc, hd, "dO")
        D = (dO * _load(entry, o, b, h, nc, hd, "o")).sum(axis=2)
        lidx = (b * H + h)[:, None] * T + np.arange(nc)[None, :]
        inside(dd, lidx, entry)
        dd.view(np.ndarray).reshape(-1)[lidx] = D
        Q = r(_load(entry, q, b, h, nc, hd, "q") * scale)
        K, V = r(_load(entry, k, b, kh, T, hd, "k")), r(_load(entry, v, b, kh, T, hd, "v"))
        P = np.where(_seen(entry, seg, b, nc, T), np.exp(Q @ K.swapaxes(1, 2) - at(lse, lidx, entry)[..., None]), 0)
        dS = P * (r(dO) @ V.swapaxes(1, 2) - D[..., None])
        W = _walked(fam, op, _ids(seg, b), nc, T)
        store(dqa, (b[:, None], h[:, None], np.arange(nc)[None, :], slice(0, hd)), _wmm(r(dS), K, W) * scale)

    def dkdv(args, launch):
        (q, k, v, do), (lse, dd, dk), dv, rest = args[0:16:4], args[16:19], args[22], args[26:]
        H, KH, T, hd, scale, seg = _ints(rest)
        nc, b, kh = _launch(entry, fam, op, launch, H, KH, T, hd, True)
        seen = _seen(entry, seg, b, nc, T, True)
        W = _walked(fam, op, _ids(seg, b), nc, T)
        r = rnd if fam.mma else (lambda x: x)
        K, V = r(_load(entry, k, b, kh, nc, hd, "k")), r(_load(entry, v, b, kh, nc, hd, "v"))
        dka, dva = np.zeros_like(K), np.zeros_like(V)
        g = H // KH
        for hh in range(g):
            h = kh * g + hh
            lidx = (b * H + h)[:, None] * T + np.arange(T)[None, :]
            Q = r(_load(entry, q, b, h, T, hd, "q") * scale)
            dO = r(_load(entry, do, b, h, T, hd, "dO"))
            P = np.where(seen, np.exp(K @ Q.swapaxes(1, 2) - at(lse, lidx, entry)[:, None]), 0)
            dS = P * (V @ dO.swapaxes(1, 2) - at(dd, lidx, entry)[:, None])
            dva += _wmm(r(P), dO, W)
            dka += _wmm(r(dS), Q, W)
        idx = (b[:, None], kh[:, None], np.arange(nc)[None, :], slice(0, hd))
        store(dk, idx, dka)
        store(dv, idx, dva)

    return {"fwd": fwd, "bwd_dq": dq, "bwd_dkdv": dkdv}[op]


EMULATED = {f"{pre}{op}_{suf}": flash(f"{pre}{op}_{suf}", fam, op)
            for suf, (pre, fam) in _families().items() for op in ("fwd", "bwd_dq", "bwd_dkdv")}
