"""On a device: each CUDA kernel against its NumPy twin at small sizes, one Check per kernel file. AdamW and
pack/unpack must agree bit for bit (aligned and misaligned views, subnormal values, amp's compute copies); the
fused layer kernels and flash attention within float32's and float64's rounding (the twins in float64 for
flash attention). The full parity suite is tests/gpu; this is its quick subset for an installation.
"""
from __future__ import annotations

import numpy as np

from hpengine.device import kernels
from hpengine.doctor.checks import FAILED, OK, Check, reason
from hpengine.nn import (attention_backward, attention_forward, cross_entropy_backward, cross_entropy_forward, flash,
                         gelu_backward, gelu_forward, layernorm_backward, layernorm_forward)

TOL = {np.dtype(np.float64): 1e-11, np.dtype(np.float32): 3e-5}
FLASH_TOL = {np.dtype(np.float64): 1e-11, np.dtype(np.float32): 2e-5}
ADAMW_SIZES = ((5, 0), (65_537, 1), (1_000_003, 3))       # (elements, offset past an aligned allocation)


class Mismatch(AssertionError):
    pass


def on_device(cp, a, offset: int = 0):
    """A device copy of host array a starting `offset` elements past a fresh allocation (every alignment)."""
    out = cp.empty(a.size + offset, dtype=a.dtype)[offset:]
    out.set(np.ascontiguousarray(a).ravel())
    return out.reshape(a.shape)


def same_bits(cp, dev, host, what: str) -> None:
    got, want = cp.asnumpy(dev), np.ascontiguousarray(host)
    if got.tobytes() != want.tobytes():
        bad = int(np.count_nonzero(got.view(np.uint8) != want.view(np.uint8)))
        raise Mismatch(f"{what}: {bad} bytes differ from the NumPy twin's")


def close(cp, dev, host, tol: float, what: str) -> float:
    """Largest |device - host| relative to max(1, max |host|); Mismatch above tol."""
    got, want = cp.asnumpy(dev).astype(np.float64), np.asarray(host, np.float64)
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape}, the twin's {want.shape}")
    err = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())) if want.size else 0.0
    if not err <= tol:
        raise Mismatch(f"{what}: differs from the NumPy twin by {err:.1e} (tolerance {tol:.0e})")
    return err


def adamw_inputs(rng, n, dtype):
    tiny = np.finfo(dtype).smallest_subnormal
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 2, n)).astype(dtype)
    g[::97] = 0.0
    g[1::89] = tiny * rng.integers(1, 100, g[1::89].size)         # subnormal gradients
    p = rng.standard_normal(n).astype(dtype)
    m = (rng.standard_normal(n) * 1e-3).astype(dtype)
    m[::53] = tiny * 3                                             # subnormal moments (no flush to zero)
    v = (rng.random(n) * 1e-4).astype(dtype)
    mask = rng.integers(0, 3, n).astype(np.uint8)                  # any nonzero byte means decay
    return p, g, m, v, mask


def adamw(cp) -> str:
    for dtype in (np.float32, np.float64):
        for n, off in ADAMW_SIZES:
            rng = np.random.default_rng(n)
            p, g, m, v, mask = adamw_inputs(rng, n, dtype)
            dp, dg, dm, dv, dmask = (on_device(cp, a, off) for a in (p, g, m, v, mask))
            for t, (lr, coef) in enumerate([(1e-3, 1.0), (3e-3, 0.31)], start=1):
                c = kernels.adamw_coefs(t, lr, (0.9, 0.95), 1e-8, 0.1, coef)
                kernels.adamw_numpy(p, g, m, v, mask, c)
                kernels.adamw(dp, dg, dm, dv, dmask, c)
                for name, d, h in (("p", dp, p), ("m", dm, m), ("v", dv, v)):
                    same_bits(cp, d, h, f"adamw {np.dtype(dtype)} n {n} offset {off} step {t}: {name}")
    for copy in (np.float16, np.float32, np.uint16):             # amp's compute copy in the same pass
        rng = np.random.default_rng(7)
        p, g, m, v, mask = adamw_inputs(rng, 4099, np.float32)
        p *= 10.0 ** rng.integers(-30, 30, p.size) if copy != np.float16 else 1e3
        dp, dg, dm, dv, dmask = (on_device(cp, a, 2) for a in (p, g, m, v, mask))
        host, dev = np.empty(p.size, copy), on_device(cp, np.zeros(p.size, copy), 2)
        c = kernels.adamw_coefs(1, 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.5)
        kernels.adamw_numpy(p, g, m, v, mask, c, host)
        kernels.adamw(dp, dg, dm, dv, dmask, c, dev)
        same_bits(cp, dp, p, f"adamw with a {np.dtype(copy)} copy: p")
        same_bits(cp, dev, host, f"adamw with a {np.dtype(copy)} copy: the copy")
    return "bit for bit: float32, float64 (misaligned views, subnormals), compute copies float16, bf16, bf16 bits"


def pack(cp) -> str:
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        src = rng.standard_normal(10_007).astype(dtype)
        offsets, sizes = kernels.strided_segments(5, 40, 37, 211)
        buf = np.empty(int(sizes.sum()), dtype)
        dsrc, dbuf = on_device(cp, src, 1), cp.zeros(buf.size, dtype=dtype)
        kernels.pack_numpy(buf, src, offsets, sizes)
        kernels.pack(dbuf, dsrc, offsets, sizes)
        same_bits(cp, dbuf, buf, f"pack {np.dtype(dtype)}")
        dst, ddst = np.zeros_like(src), cp.zeros(src.size, dtype=dtype)
        kernels.unpack_numpy(buf, dst, offsets, sizes)
        kernels.unpack(dbuf, ddst, offsets, sizes)
        same_bits(cp, ddst, dst, f"unpack {np.dtype(dtype)}")
    bits = rng.integers(0, 1 << 16, 4099, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80                       # finite values only: NaN payloads aside
    offsets, sizes = [3, 100, 2000], [50, 1000, 2099]
    buf, dbuf = np.empty(sum(sizes), np.float32), cp.zeros(sum(sizes), dtype=np.float32)
    kernels.pack_bf16_numpy(buf, bits, offsets, sizes)
    kernels.pack_bf16(dbuf, on_device(cp, bits), offsets, sizes)
    same_bits(cp, dbuf, buf, "pack_bf16")
    return "bit for bit: pack, unpack (float32, float64, strided segments), pack_bf16"


def fused(cp) -> str:
    """The layers' kernels (kernels/fused.cu) against the layers' NumPy code."""
    worst = 0.0
    for dtype in (np.float64, np.float32):
        tol, dt = TOL[np.dtype(dtype)], np.dtype(dtype).name
        rng = np.random.default_rng(1)

        def pair(shape, scale=1.0):
            a = (rng.standard_normal(shape) * scale).astype(dtype)
            return a, cp.asarray(a)
        x, xd = pair((2, 7, 768), 3.0)
        y, c = gelu_forward(np, x)
        yd, cd = gelu_forward(cp, xd)
        dy, dyd = pair(x.shape)
        worst = max(worst, close(cp, yd, y, tol, f"gelu forward {dt}"),
                    close(cp, gelu_backward(cp, dyd, cd), gelu_backward(np, dy, c), tol, f"gelu backward {dt}"))
        C = 1500
        x, xd = pair((3, 5, C), 2.0)
        w, wd = pair((C,))
        b, bd = pair((C,))
        y, c = layernorm_forward(np, x + 1.5, w, b)
        yd, cd = layernorm_forward(cp, xd + 1.5, wd, bd)
        dy, dyd = pair(x.shape)
        dw, db, dwd, dbd = np.zeros(C, dtype), np.zeros(C, dtype), cp.zeros(C, dtype), cp.zeros(C, dtype)
        worst = max(worst, close(cp, yd, y, tol, f"layernorm forward {dt}"),
                    close(cp, layernorm_backward(cp, dyd, cd, wd, dwd, dbd), layernorm_backward(np, dy, c, w, dw, db),
                          tol, f"layernorm backward {dt}"), close(cp, dwd, dw, tol, f"layernorm weight gradient {dt}"))
        qkv, qkvd = pair((2, 33, 3 * 2 * 8))
        y, c = attention_forward(np, qkv, 2)
        yd, cd = attention_forward(cp, qkvd, 2)
        dy, dyd = pair(y.shape)
        worst = max(worst, close(cp, yd, y, tol, f"causal softmax attention forward {dt}"),
                    close(cp, attention_backward(cp, dyd, cd), attention_backward(np, dy, c), tol,
                          f"causal softmax attention backward {dt}"))
        z, zd = pair((2, 9, 256), 4.0)
        t = rng.integers(0, 256, (2, 9))
        loss, c = cross_entropy_forward(np, z, t, 18)
        lossd, cd = cross_entropy_forward(cp, zd, cp.asarray(t), 18)
        worst = max(worst, close(cp, lossd, loss, tol, f"cross-entropy {dt}"),
                    close(cp, cross_entropy_backward(cp, cd, 3.0), cross_entropy_backward(np, c, 3.0), tol,
                          f"cross-entropy backward {dt}"))
    return (f"GELU, layernorm, causal softmax, cross-entropy (forward and backward, float64 and float32): largest "
            f"difference {worst:.0e} (tolerance {TOL[np.dtype(np.float32)]:.0e} in float32)")


def flash_attention(cp) -> str:
    """kernels/attention.cu against flash.py's blocked code run in float64 on the host."""
    worst = 0.0
    B, H, T, hd = 2, 3, 37, 16
    for dtype in (np.float64, np.float32):
        tol = FLASH_TOL[np.dtype(dtype)]
        rng = np.random.default_rng(1)
        qkv = (rng.standard_normal((B, T, 3 * H * hd)) * 1.5).astype(dtype)
        dy = rng.standard_normal((B, T, H * hd)).astype(dtype)
        y, c = flash.flash_attention_forward(np, qkv.astype(np.float64), H, 7, 5)
        dq = flash.flash_attention_backward(np, dy.astype(np.float64), c)
        yd, cd = flash.flash_attention_forward(cp, cp.asarray(qkv), H)
        what = f"flash attention {np.dtype(dtype).name}"
        worst = max(worst, close(cp, yd, y, tol, f"{what} forward"), close(cp, cd[2], c[2], tol, f"{what} lse"),
                    close(cp, flash.flash_attention_backward(cp, cp.asarray(dy), cd), dq, tol, f"{what} backward"))
    return (f"forward, log-sum-exp and backward (B {B}, H {H}, T {T}, hd {hd}; float64 and float32): largest "
            f"difference {worst:.0e} (tolerance {FLASH_TOL[np.dtype(np.float32)]:.0e} in float32)")


CASES = (("adamw", adamw), ("pack", pack), ("fused", fused), ("attention", flash_attention))


def run(cp):
    """One Check per kernel file: 'parity: <file>.cu'."""
    for name, case in CASES:
        label = f"parity: {name}.cu"
        try:
            detail = case(cp)
            cp.cuda.Device().synchronize()
            yield Check(label, OK, detail)
        except Mismatch as e:
            yield Check(label, FAILED, str(e))
        except Exception as e:  # noqa: BLE001 - a kernel that does not build or launch
            yield Check(label, FAILED, reason(e))

