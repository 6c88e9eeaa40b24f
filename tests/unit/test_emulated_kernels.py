"""The CuPy stand-in's kernel emulators (emulated_fused.py, emulated_flash.py) on small random inputs, launched as
the engine launches them, against independent NumPy: closed forms (GELU, SiLU gating, layer and RMS norm, a
masked softmax, log-softmax, rotations, column sums), central finite differences for the norms' backward, and
plain (B, H, T, T) causal attention with its backward for the flash entries, with bfloat16 operand rounding
(precision.round_bf16_) for the tensor-core ones. Every entry of the three .cu files has an emulator."""
from __future__ import annotations

import math

import emulated_cupy
import emulated_flash
import numpy as np
import pytest

from hpengine.device import kernels
from hpengine.device.precision import round_bf16_
from hpengine.nn import Numerics, flash, flash_cuda, fused

F64 = {"rtol": 1e-12, "atol": 1e-13}
RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def rng(monkeypatch):
    monkeypatch.setitem(globals(), "RNG", np.random.default_rng(7))     # each test's inputs, whatever ran before


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


def _dev(device, a):
    return device.asarray(np.ascontiguousarray(a))


def _host(a):
    return np.asarray(a.get())


def test_every_entry_has_an_emulator_and_an_unknown_one_is_an_error(device):
    for name in ("fused", "attention", "attention_mma"):
        entries = set(emulated_cupy.signatures(kernels.source_path(name).read_text()))
        assert entries and entries <= set(emulated_cupy.EMULATED), sorted(entries - set(emulated_cupy.EMULATED))
    fn = device.RawModule(code='extern "C" __global__ void nothing_f32(float* x, int n) { }').get_function(
        "nothing_f32")
    with pytest.raises(NotImplementedError, match="nothing_f32"):
        fn((1,), (32,), (device.zeros(4, dtype=np.float32), np.int32(4)))


def test_an_output_that_overlaps_an_input_is_refused(device):
    x = device.zeros(8, dtype=np.float64)
    with pytest.raises(AssertionError, match="overlaps"):
        kernels.function("fused", "gelu_fwd_f64")((1,), (256,), (x, x, device.zeros(8), np.int64(8)))


# ---------------------------------------------------------------- point-wise

def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _fd(f, x, dy, h=1e-6):
    """sum(dy * f(x)) differentiated in x by central differences, one element at a time."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = ((f(x + e) - f(x - e)) * dy).sum() / (2 * h)
    return g


def test_gelu_and_swiglu_against_their_closed_forms(device):
    x, g, u, dy = (RNG.standard_normal((3, 37)) * 2 for _ in range(4))
    y, s = fused.gelu_forward(device, _dev(device, x))
    np.testing.assert_allclose(_host(y), _gelu(x), **F64)
    dx = fused.gelu_backward(device, _dev(device, x), s, _dev(device, dy))
    np.testing.assert_allclose(_host(dx), _fd(_gelu, x, dy), rtol=1e-7, atol=1e-8)
    a, s = fused.swiglu_forward(device, _dev(device, g), _dev(device, u))
    sig = 1 / (1 + np.exp(-g))
    np.testing.assert_allclose(_host(a), g * sig * u, **F64)
    dg, du = fused.swiglu_backward(device, _dev(device, g), _dev(device, u), s, _dev(device, dy))
    np.testing.assert_allclose(_host(du), g * sig * dy, **F64)
    np.testing.assert_allclose(_host(dg), (sig + g * sig * (1 - sig)) * u * dy, **F64)
    for dt in (np.float32,):                             # the float32 entries compute in float32
        y32, _ = fused.gelu_forward(device, _dev(device, x.astype(dt)))
        assert y32.dtype == dt
        np.testing.assert_allclose(_host(y32), _gelu(x), rtol=1e-5, atol=1e-6)


def test_a_launch_short_of_its_array_leaves_the_rest_unwritten(device):
    x = _dev(device, RNG.standard_normal(16))
    y, s = device.empty_like(x), device.empty_like(x)
    kernels.function("fused", "gelu_fwd_f64")((1,), (256,), (x, y, s, np.int64(15)))
    assert np.isfinite(_host(y)[:15]).all() and np.isnan(_host(y)[15])
    with pytest.raises(AssertionError, match="17 elements of an array of 16"):
        kernels.function("fused", "gelu_fwd_f64")((1,), (256,), (x, y, s, np.int64(17)))


def test_softmax_gradients_read_their_rows_rs(device):
    B, H, T, q0, n_q = 2, 3, 9, 4, 3
    ds, p = RNG.standard_normal((2, B, H, n_q, T))
    rs = RNG.standard_normal((B, H, T, 1))
    want = (ds - rs[:, :, q0:q0 + n_q]) * p
    d = _dev(device, ds)
    fused.softmax_backward_(d, _dev(device, p), _dev(device, rs), q0)
    np.testing.assert_allclose(_host(d), want, **F64)
    d = _dev(device, ds)
    fused.grouped_softmax_backward_(d, _dev(device, p), _dev(device, rs[:, :, :n_q]))
    np.testing.assert_allclose(_host(d), (ds - rs[:, :, :n_q]) * p, **F64)
    with pytest.raises(AssertionError, match="queries 7 .. 9 of rows of 9"):
        fused.softmax_backward_(d, _dev(device, p), _dev(device, rs), 7)


def test_cross_entropy_against_log_softmax(device):
    z = RNG.standard_normal((2, 5, 11)) * 3
    t = RNG.integers(0, 11, (2, 5))
    p, nll = fused.cross_entropy_forward(device, _dev(device, z), _dev(device, t))
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(_host(p), np.exp(logp), **F64)
    np.testing.assert_allclose(_host(nll), -np.take_along_axis(logp, t[..., None], -1).reshape(-1), **F64)
    d = fused.cross_entropy_backward(device, p, _dev(device, t), 0.25)
    np.testing.assert_allclose(_host(d), (np.exp(logp) - np.eye(11)[t]) * 0.25, **F64)
    with pytest.raises(AssertionError, match="a target outside 0 .. 10"):
        fused.cross_entropy_forward(device, _dev(device, z), _dev(device, t + 11))


# ---------------------------------------------------------------- rows

@pytest.mark.parametrize("q0", [0, 5])
def test_causal_softmax_against_a_masked_softmax(device, q0):
    n_q, n_cols = 4, 9
    s = RNG.standard_normal((2, 3, n_q, n_cols))
    mask = np.arange(n_cols) <= q0 + np.arange(n_q)[:, None]
    e = np.where(mask, np.exp(s - np.where(mask, s, -np.inf).max(-1, keepdims=True)), 0)
    p = _dev(device, s)
    fused.causal_softmax_(p, q0)
    np.testing.assert_allclose(_host(p), e / e.sum(-1, keepdims=True), **F64)
    if q0:
        with pytest.raises(AssertionError, match="keys of rows of 9"):
            fused.causal_softmax_(_dev(device, s), q0 + 1)


def _layernorm(x, w, b, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def _rmsnorm(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_norms_against_their_formulas_and_finite_differences(device):
    x, dy = RNG.standard_normal((2, 5, 12)) + 0.3
    w, b = RNG.standard_normal((2, 12))
    y, xhat, rstd = fused.layernorm_forward(device, _dev(device, x), _dev(device, w), _dev(device, b), 1e-5)
    np.testing.assert_allclose(_host(y), _layernorm(x, w, b), **F64)
    np.testing.assert_allclose(_host(rstd)[:, 0], 1 / np.sqrt(x.var(-1) + 1e-5), **F64)
    dx = fused.layernorm_backward_dx(device, _dev(device, dy), xhat, rstd, _dev(device, w))
    np.testing.assert_allclose(_host(dx), _fd(lambda v: _layernorm(v, w, b), x, dy), rtol=1e-6, atol=1e-7)
    y, xhat, rstd = fused.rmsnorm_forward(device, _dev(device, x), _dev(device, w), 1e-5)
    np.testing.assert_allclose(_host(y), _rmsnorm(x, w), **F64)
    dx = fused.rmsnorm_backward_dx(device, _dev(device, dy), xhat, rstd, _dev(device, w))
    np.testing.assert_allclose(_host(dx), _fd(lambda v: _rmsnorm(v, w), x, dy), rtol=1e-6, atol=1e-7)


def test_a_row_entry_wants_whole_warps(device):
    x = _dev(device, RNG.standard_normal((2, 8)))
    fn = kernels.function("fused", "rmsnorm_fwd_f64")
    out = [device.empty((2, 8)), device.empty((2, 8)), device.empty((2, 1))]
    with pytest.raises(AssertionError, match="block"):
        fn((2,), (48,), (x, _dev(device, np.ones(8)), *out, np.int64(2), np.int32(8), np.float64(1e-5)))


def test_rope_rotates_strided_input_and_back(device):
    B, T, H, hd = 2, 5, 3, 8
    big = RNG.standard_normal((B, T, 2 * H, hd))
    x = big[:, :, 1::2]                                  # a strided (B, T, H, hd) view
    ang = RNG.standard_normal((T + 1, hd // 2))
    cos, sin = np.cos(ang), np.sin(ang)
    z = (x[..., :hd // 2] + 1j * x[..., hd // 2:]) * np.exp(1j * ang[:T])[None, :, None]
    want = np.concatenate([z.real, z.imag], -1).transpose(0, 2, 1, 3)
    cd, sd = _dev(device, cos[:T]), _dev(device, sin[:T])
    y = fused.rope_forward(device, _dev(device, big)[:, :, 1::2], cd, sd)
    np.testing.assert_allclose(_host(y), want, **F64)
    back = fused.rope_backward(device, y, cd, sd)
    np.testing.assert_allclose(_host(back), x, **F64)
    with pytest.raises(AssertionError, match="reach past"):
        fused._rope("rope_fwd", device, _dev(device, x), _dev(device, cos), _dev(device, sin),
                    device.empty((B, H, T + 1, hd)), T + 1, H)


@pytest.mark.parametrize("n, chunks, grid_x", [(37, 3, 1), (37, 5, 2), (4, 6, 1)])
def test_column_sums_over_the_grid_chunks(device, n, chunks, grid_x):
    a, b = RNG.standard_normal((2, n, 40))
    base = RNG.standard_normal(40)
    for prod, want in ((False, a.sum(0)), (True, (a * b).sum(0))):
        part = device.empty((chunks, 40))
        entry, ins = ("colsum_prod_part_f64", (a, b)) if prod else ("colsum_part_f64", (a,))
        kernels.function("fused", entry)((grid_x, chunks), (32, 8), (*(_dev(device, v) for v in ins), part,
                                                                       np.int64(n), np.int32(40)))
        got = _host(part)
        cols = min(40, 32 * grid_x)                      # the columns the grid covers
        assert np.isnan(got[:, cols:]).all()
        np.testing.assert_allclose(got[:, :cols].sum(0), want[:cols], **F64)
        if cols < 40:
            continue
        out = _dev(device, base)
        kernels.function("fused", "colsum_finish_f64")((1,), (256,), (part, out, np.int32(chunks), np.int32(40),
                                                                       np.int32(1)))
        np.testing.assert_allclose(_host(out), base + want, **F64)
        fused.colsum_(device, _dev(device, a), out, _dev(device, b) if prod else None)
        np.testing.assert_allclose(_host(out), base + 2 * want, **F64)


# ---------------------------------------------------------------- flash attention

def _attention(q, k, v, scale, dout, rnd=lambda x: x):
    """Plain causal grouped-query attention (B, H, T, hd) and its backward, products of rnd(operands)."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
    T = q.shape[2]
    qs = rnd(q * scale)
    s = np.where(np.tril(np.ones((T, T), bool)), rnd(qs) @ rnd(k).swapaxes(-1, -2), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l_ = e.sum(-1, keepdims=True)
    p = e / l_
    o = (rnd(e) @ rnd(v)) / l_                         # P rounded before the division, as the kernel's rows
    dp = rnd(dout) @ rnd(v).swapaxes(-1, -2)
    ds = p * (dp - (dout * o).sum(-1, keepdims=True))   # D = rowsum(dO * O), FlashAttention-2's
    B, H = q.shape[:2]
    fold = lambda a: a.reshape(B, H // g, g, T, -1).sum(2)  # noqa: E731
    return (o, (m + np.log(l_))[..., 0], (rnd(ds) @ rnd(k)) * scale, fold(rnd(ds).swapaxes(-1, -2) @ qs),
            fold(rnd(p).swapaxes(-1, -2) @ rnd(dout)))


def _flash(device, q, k, v, dout, scale, mma, storage=None):
    cast = (lambda a: _dev(device, flash_cuda.to_bf16(np, a.astype(np.float32)))) if storage == "bf16" else \
        (lambda a: _dev(device, a))
    dq, dk, dv = (device.empty(a.shape, dtype=np.uint16 if storage == "bf16" else a.dtype) for a in (q, k, v))
    qd, kd, vd, dod = (cast(a) for a in (q, k, v, dout))
    o = device.empty(qd.shape, dtype=qd.dtype)
    lse = flash_cuda.forward(device, qd, kd, vd, o, scale, mma=mma)
    flash_cuda.backward(device, qd, kd, vd, o, dod, lse, dq, dk, dv, scale, mma=mma)
    back = (lambda a: flash_cuda.from_bf16(np, _host(a))) if storage == "bf16" else _host
    return back(o), _host(lse), back(dq), back(dk), back(dv)


def _inputs(B, H, K, T, hd, dtype=np.float64):
    return [RNG.standard_normal(s).astype(dtype) for s in ((B, H, T, hd), (B, K, T, hd), (B, K, T, hd),
                                                           (B, H, T, hd))]


@pytest.mark.parametrize("H, K, T, hd", [(4, 2, 37, 8), (2, 2, 20, 24)])
def test_flash_f64_and_f32_against_plain_attention(device, H, K, T, hd):
    q, k, v, dout = _inputs(2, H, K, T, hd)
    scale = 1 / math.sqrt(hd)
    want = _attention(q, k, v, scale, dout)
    for got in (_flash(device, q, k, v, dout, scale, False),):
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12, err_msg=name)
    got = _flash(device, *(a.astype(np.float32) for a in (q, k, v, dout)), np.float32(scale), False)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
    assert {"flash_fwd_f64", "flash_bwd_dq_f64", "flash_bwd_dkdv_f64", "flash_fwd_f32"} <= set(device.launches)


def _bf16(a):
    return round_bf16_(np, np.array(a, dtype=np.float32))


def test_flash_bf16_storage_against_plain_attention(device):
    q, k, v, dout = (_bf16(a) for a in _inputs(1, 4, 2, 21, 16))
    want = _attention(*(a.astype(np.float64) for a in (q, k, v)), 0.25, dout.astype(np.float64))
    got = _flash(device, q, k, v, dout, np.float32(0.25), False, storage="bf16")
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        # the stores round to bfloat16: 2^-8 of the largest value
        np.testing.assert_allclose(g, w, rtol=0, atol=np.abs(w).max() * 2 ** -8 + 1e-6, err_msg=name)
        if name != "lse":
            np.testing.assert_array_equal(_bf16(g), g)
    assert {"flash_fwd_bf16", "flash_bwd_dq_bf16", "flash_bwd_dkdv_bf16"} <= set(device.launches)


@pytest.mark.parametrize("hd, storage", [(16, None), (96, None), (16, "bf16")])
def test_flash_mma_against_attention_of_bf16_operands(device, hd, storage):
    """Tensor-core entries: operands, P and dS rounded to bfloat16, float32 sums; T within one key tile, so P
    is rounded after the row max, as the oracle does. The float32 sums' order moves a few P or dS across a
    bfloat16 rounding boundary (one bfloat16 step of one term): the median error is of float32 order, every one
    within 2^-7 of the largest; the oracle without the rounding lies well off."""
    T = 40
    q, k, v, dout = (a.astype(np.float32) for a in _inputs(2, 4, 2, T, hd))
    scale = np.float32(1 / math.sqrt(hd))
    assert T <= emulated_flash._families()[f"{storage or 'f32'}_hd{64 if hd <= 64 else 128}"][1].bn
    if storage:
        q, k, v, dout = (_bf16(a) for a in (q, k, v, dout))
    f64 = [a.astype(np.float64) for a in (q, k, v, dout)]
    want = _attention(*f64[:3], float(scale), f64[3], rnd=lambda a: _bf16(a).astype(np.float64))
    plain = _attention(*f64[:3], float(scale), f64[3])
    got = _flash(device, q, k, v, dout, scale, True, storage=storage)      # as bf16 amp asks (nn/flash.py)
    for name, g, w, p in zip(("o", "lse", "dq", "dk", "dv"), got, want, plain):
        big = np.abs(w).max()
        err = np.abs(g - w)
        assert err.max() <= big * 2 ** -7, (name, err.max(), big)
        tight = np.median(err)
        assert tight <= big * (2 ** -8 if storage and name != "lse" else 1e-6), (name, tight, big)
        if name != "lse" and not storage:
            assert np.median(np.abs(p - w)) > 30 * tight, name
    suffix = f"{storage or 'f32'}_hd{64 if hd <= 64 else 128}"
    assert {f"flash_mma_{op}_{suffix}" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(device.launches)


def test_flash_launch_outside_the_kernel_contract_is_refused(device):
    q, k, v, _ = (_dev(device, a.astype(np.float32)) for a in _inputs(1, 2, 2, 8, 8))
    launch = flash_cuda.launch_plan("fwd", np.float32, 1, 2, 2, 8, 8)
    lse = device.empty((1, 2, 8), dtype=np.float32)
    o = device.empty(q.shape, dtype=np.float32)
    args = [*flash_cuda._strided(device, q, "q"), *flash_cuda._strided(device, k, "k"),
            *flash_cuda._strided(device, v, "v"), *flash_cuda._out(o, "o"), lse,
            np.int32(2), np.int32(2), np.int32(8), np.int32(8), np.float32(0.35), flash_cuda.NULL]
    fn = kernels.function("attention", launch.entry)
    with pytest.raises(AssertionError, match="shared memory"):
        fn(launch.grid, launch.block, tuple(args), shared_mem=launch.shared_mem - 4)
    with pytest.raises(AssertionError, match="outside"):
        fn((launch.grid[0], 3), launch.block, tuple(args), shared_mem=launch.shared_mem)
    args[-4] = np.int32(9)                               # T past the views' 8 rows
    with pytest.raises(AssertionError, match="outside"):
        fn(launch.grid, launch.block, tuple(args), shared_mem=launch.shared_mem)


def test_flash_mma_over_several_key_tiles_follows_the_numpy_twin(device):
    """T past one key tile: P is rounded after the running max of the tiles so far, as nn/flash.py's twin
    does with its key blocks of 64 (grouped rows, key/value heads shared by two query heads)."""
    B, H, K, T, hd = 1, 4, 2, 130, 16
    q, k, v, dout = (a.astype(np.float32) for a in _inputs(B, H, K, T, hd))
    q *= np.float32(1 / math.sqrt(hd))
    dy = dout.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    num = Numerics(bf16=True)
    y, cache = flash.flash_gqa_forward(np, q, k, v, num=num)     # key blocks of flash.BK = 64, the kernel's BN
    want = (y, cache[4], *flash.flash_gqa_backward(np, dy, cache, num))
    yd, cache = flash.flash_gqa_forward(device, *(_dev(device, a) for a in (q, k, v)), num=num)
    got = (yd, cache[4], *flash.flash_gqa_backward(device, _dev(device, dy), cache, num))
    assert {f"flash_mma_{op}_f32_hd64" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(device.launches)
    for name, g, w in zip(("y", "lse", "dq", "dk", "dv"), got, want):
        g, big = _host(g), np.abs(w).max()
        err = np.abs(g - w)
        tight = np.quantile(err, 0.9)          # rounding P after the whole row's max moves 10% of y by 7e-5
        assert err.max() <= big * 2 ** -7 and tight <= big * 1e-6, (name, err.max(), tight, big)
