"""Kernels without a GPU: the .cu files are found (checkout and installed layout) and compile for sm_80
and sm_90 through nvcc and NVRTC, a broken kernel is reported at its .cu line, the NumPy twins equal the
AdamW formula (float64, each operation rounded as the kernel stores it) bit for bit, pack/unpack round-trip and
pack_bf16 gathers exact values; the launchers hand the kernels what their signatures take."""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from hpengine.device import kernels
from hpengine.params.buffers import Layout, ParamSpec, Range
from hpengine.optim import AdamW
from hpengine.optim.adamw import decay_mask
from hpengine.device.precision import round_bf16_

NVCC = kernels.find_nvcc()
NVRTC = kernels.find_nvrtc()
BROKEN = 'extern "C" __global__ void broken_f32(float* p) {\n    p[0] = 1.0f;\n    p[1] = undefined_name;\n}\n'


# ---------------------------------------------------------------- sources and compilation

@pytest.mark.parametrize("name", kernels.KERNELS)
def test_source_found_and_prefixed_with_its_path(name):
    path = kernels.source_path(name)
    assert path.is_file() and path.suffix == ".cu"
    src = kernels.load_source(name)
    assert src.splitlines()[0] == f'#line 1 "{path}"'
    assert 'extern "C" __global__' in src


def test_missing_kernel_names_what_and_how_to_fix():
    with pytest.raises(kernels.KernelError, match=r"nosuch\.cu not found.*pip install"):
        kernels.source_path("nosuch")


def test_kernels_dir_override(tmp_path, monkeypatch):
    (tmp_path / "adamw.cu").write_text("// empty\n")
    monkeypatch.setenv("HPENGINE_KERNELS", str(tmp_path))
    assert kernels.source_path("adamw") == tmp_path / "adamw.cu"


def _compilers():
    return [pytest.param("nvcc", marks=pytest.mark.skipif(NVCC is None, reason="nvcc not installed")),
            pytest.param("nvrtc", marks=pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found"))]


def declared_entries(src: str) -> set[str]:
    """The extern "C" entry names a .cu file declares: written out, or made by a macro NAME(S, ...) (ENTRIES,
    ENTRIES_BF16) from its <op>_##S or <op>_##S##<tail> definitions, once per NAME(SUFFIX, ...) line."""
    head = r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?'
    names = set(re.findall(head + r"(?!__launch_bounds__)(\w+)\(", src))
    for macro, body in re.findall(r"^#define (\w+)\(S\b[^)]*\)((?:.*\\\n)*.*)", src, re.MULTILINE):
        ops = re.findall(head + r"(\w+)##S((?:##\w+)?)\(", body)
        names |= {op + suffix + tail.lstrip("#") for op, tail in ops
                  for suffix in re.findall(rf"^{macro}\((\w+)", src, re.MULTILINE)}
    return names


def test_declared_entries_reads_both_forms():
    src = ('extern "C" __global__ void plain_f32(float* p) {}\n#define ENTRIES(S, T) \\\n'
           'extern "C" __global__ void __launch_bounds__(256) op_##S(T* p) {}\n'
           '#define ENTRIES_BF16(S, T) \\\nextern "C" __global__ void op_##S##_bf16(T* p) {} \\\n'
           'extern "C" __global__ void op_##S##_bf16i(T* p) {} \\\n'
           'extern "C" __global__ void op_##S##_bf16x(T* p) {} \\\n'
           'extern "C" __global__ void op_##S##_bf16o(T* p) {}\n'
           'ENTRIES(f32, float)\nENTRIES(f64, double)\nENTRIES_BF16(f32, float)\n')
    assert declared_entries(src) == {"plain_f32", "op_f32", "op_f64", "op_f32_bf16", "op_f32_bf16i", "op_f32_bf16x",
                                     "op_f32_bf16o"}
    assert {"adamw_f32", "adamw_f64"} <= declared_entries(kernels.load_source("adamw"))
    assert {"pack_f32", "unpack_f64"} <= declared_entries(kernels.load_source("pack"))
    fused = declared_entries(kernels.load_source("fused"))
    assert {"rope_fwd_f32", "rmsnorm_bwd_f64", "causal_softmax_f32_bf16", "swiglu_bwd_f32_bf16", "rope_fwd_f32_bf16",
            "rope_fwd_f32_bf16i", "swiglu_recompute_f32_bf16i", "rmsnorm_fwd_f32_bf16x", "layernorm_fwd_f32_bf16x",
            "rmsnorm_bwd_f32_bf16i", "layernorm_bwd_f32_bf16i", "colsum_prod_part_f32_bf16i", "softmax_bwd_f32_bf16o",
            "grouped_softmax_bwd_f32_bf16o", "colsum_part_f32_bf16i"} <= fused
    assert not {"rope_bwd_f32_bf16i", "gelu_fwd_f64_bf16", "swiglu_recompute_f32", "rmsnorm_fwd_f64_bf16x",
                "colsum_finish_f32_bf16i"} & fused


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiler", _compilers())
@pytest.mark.parametrize("name", kernels.KERNELS)
def test_kernel_compiles_for_every_arch(name, compiler):
    """compile_check raises on a failed compile (test_broken_kernel_...); what it returns must show every
    declared entry compiled (nvcc: ptxas -v names each entry function per arch) with no local memory, no
    spills and no warnings."""
    logs = kernels.compile_check(name, compiler=compiler)
    assert set(logs) == set(kernels.ARCHS)
    entries = declared_entries(kernels.load_source(name))
    for arch, log in logs.items():
        assert [line for line in log.splitlines() if "warning" in line.lower()] == [], log
        if compiler == "nvcc":
            compiled = set(re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log))
            assert compiled == {(e, arch) for e in entries}, log
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(frames) == (len(entries) if compiler == "nvcc" else 0), log
        assert all(f == ("0", "0", "0") for f in frames), log    # no local memory, no spills


@pytest.mark.parametrize("compiler", _compilers())
def test_broken_kernel_reports_log_and_cu_line(tmp_path, compiler):
    bad = tmp_path / "broken.cu"
    bad.write_text(BROKEN)
    with pytest.raises(kernels.KernelError) as e:
        kernels.compile_check("broken", archs=("sm_90",), path=bad, compiler=compiler)
    msg = str(e.value)
    assert f"{bad}(3)" in msg and "undefined_name" in msg and "sm_90" in msg


def test_unknown_compiler_is_refused():
    with pytest.raises(kernels.KernelError, match="valid values"):
        kernels.compile_check("adamw", compiler="clang")


# ---------------------------------------------------------------- AdamW twin

def _rounded(dtype):
    """x -> x rounded to dtype and held in float64. Every +, -, *, /, sqrt of float32 values done in
    float64 and then rounded to float32 gives the correctly rounded float32 result (53 >= 2 * 24 + 2:
    the double rounding is innocuous, Figueroa 1995), subnormals included; for float64 it is the identity."""
    return lambda x: np.asarray(x, np.float64).astype(dtype).astype(np.float64)


def _oracle_step(p, g, m, v, decay, t, lr, betas, eps, wd, coef, dtype):
    """One AdamW step from its formula, element-wise over whole arrays in float64, each operation's result
    rounded to dtype as the kernel stores it (kernels/adamw.cu's header: coefficients computed in double and
    rounded once; m = m b1 + g c1; v = v b2 + (g g) c2; p = (decay ? p keep : p) - (m / (sqrt(v) + eps'))
    step, with step = lr sqrt(1 - b2^t) / (1 - b1^t) and eps' = eps sqrt(1 - b2^t)). Returns new p, m, v
    (float64 arrays holding dtype values)."""
    r = _rounded(dtype)
    b1, b2 = betas
    sb2 = math.sqrt(1.0 - b2 ** t)
    B1, C1, B2, C2 = (float(r(x)) for x in (b1, (1.0 - b1) * coef, b2, (1.0 - b2) * coef * coef))
    STEP, EPS, KEEP = (float(r(x)) for x in (lr * sb2 / (1.0 - b1 ** t), eps * sb2, 1.0 - lr * wd))
    m = r(r(m * B1) + r(g * C1))
    v = r(r(v * B2) + r(r(g * g) * C2))
    u = r(r(m / r(r(np.sqrt(v)) + EPS)) * STEP)
    p = r(np.where(decay, r(p * KEEP), p) - u)
    return p, m, v


SIZES = [40_000, 7, 30_001, 65_536, 3, 12_345, 1]     # tensors t0..t6; the even ones take weight decay


def _layout():
    """Tensors with and without decay; sizes that put decay runs across twin chunk boundaries."""
    return Layout([ParamSpec(f"t{i}", (n,), decay=(i % 2 == 0)) for i, n in enumerate(SIZES)])


def _decay_of(r: Range):
    """Whether each element of r takes decay, from SIZES alone (tensors laid end to end, nothing past them)."""
    flags = np.repeat([i % 2 == 0 for i in range(len(SIZES))], SIZES)
    return np.concatenate([flags, np.zeros(max(0, r.stop - flags.size), bool)])[r.start:r.stop]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [Range(0, 155_893), Range(13, 150_000), Range(40_003, 40_010)])
def test_adamw_twin_and_optimizer_equal_the_formula_bitwise(dtype, r):
    """optim.AdamW.step and kernels.adamw_numpy (the twin, in CHUNK-long pieces) against _oracle_step (whole
    arrays, no chunks): p, m and v equal bit for bit after each of four steps. The two long ranges cross two
    chunk boundaries and end in an odd tail; gradients span 10^-40 (float32 subnormals) to 10^2."""
    assert r.size < kernels.CHUNK or (r.size // kernels.CHUNK >= 2 and r.size % kernels.CHUNK % 2 == 1)
    layout = _layout()
    rng = np.random.default_rng(0)
    opt = AdamW(np, layout, r, dtype, (0.9, 0.95), 1e-8, 0.1)
    p0 = rng.standard_normal(r.size).astype(dtype)
    p_opt, p_twin = p0.copy(), p0.copy()
    m, v = np.zeros(r.size, dtype), np.zeros(r.size, dtype)
    p_ref, m_ref, v_ref = p0.astype(np.float64), np.zeros(r.size), np.zeros(r.size)
    decay = _decay_of(r)
    mask = decay_mask(layout, r, np, np.uint8)
    for t, (lr, coef) in enumerate([(1e-3, 1.0), (3e-3, 0.37), (2e-3, 1 / 1024), (0.0, 2.0)], start=1):
        g = (rng.standard_normal(r.size) * 10.0 ** rng.integers(-40, 3, r.size)).astype(dtype)
        opt.step(p_opt, g, lr, coef)
        kernels.adamw_numpy(p_twin, g, m, v, mask, kernels.adamw_coefs(t, lr, (0.9, 0.95), 1e-8, 0.1, coef))
        p_ref, m_ref, v_ref = _oracle_step(p_ref, g.astype(np.float64), m_ref, v_ref, decay, t, lr, (0.9, 0.95),
                                           1e-8, 0.1, coef, dtype)
        want = [x.astype(dtype) for x in (p_ref, m_ref, v_ref)]
        for got, ref in [(p_opt, want[0]), (p_twin, want[0]), (opt.m, want[1]), (opt.v, want[2]), (m, want[1]),
                         (v, want[2])]:
            bits = f"u{got.itemsize}"
            bad = np.flatnonzero(got.view(bits) != ref.view(bits))
            assert got.dtype == dtype and bad.size == 0, (t, bad[:5], got[bad[:5]], ref[bad[:5]])


def test_adamw_twin_matches_textbook_adamw():
    """float64, the textbook algebra (bias corrections applied to m and v), over two chunk boundaries and an
    odd tail: equal to rounding."""
    rng = np.random.default_rng(1)
    n, lr, b1, b2, eps, wd, coef = 2 * kernels.CHUNK + 4321, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5
    p, mask = rng.standard_normal(n), rng.integers(0, 2, n).astype(np.uint8)
    m, v, ref, mr, vr = np.zeros(n), np.zeros(n), p.copy(), np.zeros(n), np.zeros(n)
    for t in range(1, 4):
        g = rng.standard_normal(n)
        kernels.adamw_numpy(p, g, m, v, mask, kernels.adamw_coefs(t, lr, (b1, b2), eps, wd, coef))
        gs = g * coef
        mr, vr = b1 * mr + (1 - b1) * gs, b2 * vr + (1 - b2) * gs * gs
        ref = ref * np.where(mask, 1 - lr * wd, 1.0) - lr * (mr / (1 - b1 ** t)) / (np.sqrt(vr / (1 - b2 ** t)) + eps)
    np.testing.assert_allclose(p, ref, rtol=1e-12, atol=1e-14)


def test_adamw_twin_half_copy_and_zero_decay():
    rng = np.random.default_rng(2)
    n = 70_000
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    p2, half = p.copy(), np.empty(n, np.float16)
    c = kernels.adamw_coefs(1, 1e-3, (0.9, 0.95), 1e-8, 0.0, 1.0)
    assert c.keep == 1.0
    kernels.adamw_numpy(p, g, np.zeros(n, np.float32), np.zeros(n, np.float32), np.ones(n, np.uint8), c, half)
    kernels.adamw(p2, g, np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.uint8), c)
    assert p.tobytes() == p2.tobytes()          # keep == 1: the mask cannot matter
    assert half.tobytes() == p.astype(np.float16).tobytes()


def test_adamw_twin_bf16_copy():
    """The bfloat16 compute copy written in the update's pass equals rounding the updated weights after it
    (precision.round_bf16_, itself ml_dtypes bit for bit), the weights unchanged by writing it."""
    rng = np.random.default_rng(3)
    n = 70_000
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    p2, copy = p.copy(), np.full(n, np.nan, np.float32)
    c = kernels.adamw_coefs(3, 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    kernels.adamw_numpy(p, g, np.zeros(n, np.float32), np.zeros(n, np.float32), mask, c, copy)
    kernels.adamw_numpy(p2, g, np.zeros(n, np.float32), np.zeros(n, np.float32), mask, c)
    assert p.tobytes() == p2.tobytes()
    assert copy.tobytes() == round_bf16_(np, p2.copy()).tobytes()
    assert not np.array_equal(copy, p)


def test_adamw_twin_bf16_bits_copy():
    """The compute copy as bfloat16 bits (uint16) equals ml_dtypes' bfloat16 of the updated weights, across
    exponents, the weights unchanged by writing it."""
    rng = np.random.default_rng(4)
    n = 70_000
    p = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    g, p2, bits = rng.standard_normal(n).astype(np.float32), p.copy(), np.zeros(n, np.uint16)
    c = kernels.adamw_coefs(2, 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    kernels.adamw_numpy(p, g, np.zeros(n, np.float32), np.zeros(n, np.float32), mask, c, bits)
    kernels.adamw_numpy(p2, g, np.zeros(n, np.float32), np.zeros(n, np.float32), mask, c)
    assert p.tobytes() == p2.tobytes()
    assert bits.tobytes() == p2.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes()


def test_mask_runs_and_chunk_plan():
    mask = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], np.uint8)
    assert kernels.mask_runs(mask) == [(1, 3), (5, 6), (7, 10)]
    assert kernels.mask_runs(np.zeros(4, bool)) == [] and kernels.mask_runs(np.ones(3, bool)) == [(0, 3)]
    assert kernels.chunk_plan(10, 4, [(1, 3), (5, 6), (7, 10)]) == \
        [(0, 4, [(1, 3)]), (4, 8, [(1, 2), (3, 4)]), (8, 10, [(0, 2)])]


# ---------------------------------------------------------------- pack / unpack twins

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pack_unpack_round_trip(dtype):
    rng = np.random.default_rng(3)
    src = rng.standard_normal(1000).astype(dtype)
    offs, sizes = [5, 100, 999, 300, 0], [10, 0, 1, 250, 3]
    so, ss = kernels.strided_segments(600, rows=4, cols=7, ld=50)    # a 4 x 7 block of a 50-wide matrix
    offs, sizes = offs + list(so), sizes + list(ss)
    buf = kernels.pack(np.full(sum(sizes) + 2, -1, dtype), src, offs, sizes)
    assert buf[:sum(sizes)].tobytes() == np.concatenate([src[o:o + n] for o, n in zip(offs, sizes)]).tobytes()
    assert (buf[sum(sizes):] == -1).all()
    block = buf[sum(sizes) - 28:sum(sizes)].reshape(4, 7)
    assert block.tobytes() == src[600:800].reshape(4, 50)[:, :7].copy().tobytes()
    dst = np.zeros_like(src)
    kernels.unpack(buf, dst, offs, sizes)
    covered = np.zeros(src.size, bool)
    for o, n in zip(offs, sizes):
        covered[o:o + n] = True
    assert dst[covered].tobytes() == src[covered].tobytes() and (dst[~covered] == 0).all()


def test_pack_bf16_gathers_the_exact_values_of_bits():
    """bfloat16 bits of every kind (normal, subnormal, zero of both signs, inf, NaN) gathered into a float32
    message: ml_dtypes' float32 of each (an independent oracle), the message's tail untouched; a float32 source
    or a float64 message is refused."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 2**16, 500, dtype=np.uint16)
    src[:6] = [0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC1]
    offs, sizes = [0, 40, 499, 100], [6, 30, 1, 0]
    buf = kernels.pack_bf16(np.full(sum(sizes) + 2, -1.0, np.float32), src, offs, sizes)
    want = np.concatenate([src[o:o + n] for o, n in zip(offs, sizes)]).view(ml_dtypes.bfloat16).astype(np.float32)
    assert buf[:sum(sizes)].tobytes() == want.tobytes() and (buf[sum(sizes):] == -1).all()
    with pytest.raises(ValueError, match="a 1-D float32 message and a 1-D uint16 buffer"):
        kernels.pack_bf16(np.zeros(4, np.float32), src.astype(np.float32), [0], [2])
    with pytest.raises(ValueError, match="a 1-D float32 message"):
        kernels.pack_bf16(np.zeros(4), src, [0], [2])


def test_pack_checks_its_segments():
    src, buf = np.zeros(10), np.zeros(4)
    with pytest.raises(ValueError, match="outside"):
        kernels.pack_numpy(buf, src, [8], [3])
    with pytest.raises(ValueError, match="message has 4"):
        kernels.pack_numpy(buf, src, [0, 5], [3, 3])
    with pytest.raises(ValueError, match="one dtype"):
        kernels.pack_numpy(np.zeros(4, np.float32), src, [0], [2])
    assert list(kernels.segment_starts([3, 0, 2])) == [0, 3, 3]


# ---------------------------------------------------------------- launch contract (no GPU needed)

C_TYPES = {"float*": np.float32, "double*": np.float64, "unsigned char*": np.uint8, "unsigned short*": np.float16,
           "long long*": np.int64, "float": np.float32, "double": np.float64, "long long": np.int64, "int": np.int32}


def _signature(name, entry):
    """[(C type, pointer?)] of an extern "C" entry, read from its .cu file."""
    src = kernels.source_path(name).read_text()
    m = re.search(rf"__global__ void {entry}\((.*?)\)", src, re.S)
    if m is not None:
        params = m.group(1)
    else:                                      # an ENTRIES(S, T) instance: <op>_##S over element type T
        op, suffix = entry.rsplit("_", 1)
        elem = re.search(rf"ENTRIES\({suffix}, (\w+)\)", src).group(1)
        params = re.search(rf"__global__ void {op}_##S\((.*?)\)", src, re.S).group(1)
        params = re.sub(r"\bT\b", elem, params.replace("\\", " "))
    out = []
    for decl in params.split(","):
        words = decl.replace("const ", "").replace("__restrict__", "").replace("*", " * ").split()[:-1]
        ctype = " ".join(w for w in words if w != "*") + ("*" if "*" in words else "")
        out.append(ctype)
    return out


class _FakeCupy:
    """Just enough of cupy for the launchers to run on NumPy arrays and record their launches."""
    asarray = staticmethod(np.asarray)

    class cuda:
        class Device:
            id = 0
            attributes = {"MultiProcessorCount": 132}

            def __init__(self, *_):
                pass


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels.backend, "cupy_module", lambda: _FakeCupy)
    monkeypatch.setattr(kernels, "function", lambda name, entry, path=None:
                        lambda grid, block, args: calls.append((name, entry, grid, block, args)))
    monkeypatch.setattr(kernels, "_TABLES", {})
    monkeypatch.setattr(kernels, "_SMS", {})
    return calls


def _check_launch(call, rows=False, strided=()):
    """Arguments match the entry's C signature (pointers contiguous but those at `strided`); blocks of
    THREADS, or for a row entry (one block per row) a multiple of 32 up to 1024."""
    name, entry, grid, block, args = call
    sig = _signature(name, entry)
    assert len(args) == len(sig), (entry, sig)
    for k, (ctype, a) in enumerate(zip(sig, args)):
        want = np.dtype(C_TYPES[ctype])
        if ctype.endswith("*"):
            assert isinstance(a, np.ndarray) and (a.flags.c_contiguous or k in strided), (entry, k)
            assert a.dtype.itemsize == want.itemsize, (entry, ctype)
        else:                                  # RawKernel scalars must carry exactly the C type
            assert isinstance(a, np.generic) and a.dtype == want, (entry, ctype, type(a))
    if rows:
        assert len(block) == 1 and block[0] % 32 == 0 and 32 <= block[0] <= 1024
    else:
        assert block == (kernels.THREADS,)
    assert all(isinstance(x, int) and 1 <= x for x in grid)
    assert len(grid) == 1 or grid[1] <= 65535


@pytest.mark.parametrize("dtype,copy", [(np.float32, None), (np.float32, np.float16), (np.float32, np.float32),
                                        (np.float32, np.uint16), (np.float64, None)])
def test_adamw_launch_matches_kernel_signature(launches, dtype, copy):
    n = 1001
    arrs = [np.zeros(n, dtype) for _ in range(4)]
    h = np.zeros(n, copy) if copy else None
    kernels.adamw_cupy(*arrs, np.zeros(n, np.uint8), kernels.adamw_coefs(1, 1e-3, (0.9, 0.95), 1e-8, 0.1), h)
    (call,) = launches
    want = {None: "adamw_f32", np.float16: "adamw_f32_half", np.float32: "adamw_f32_bf16",
            np.uint16: "adamw_f32_bf16bits"}[copy]
    assert call[1] == (want if dtype == np.float32 else "adamw_f64")
    _check_launch(call)
    assert call[4][5 + (copy is not None)] == n


def test_adamw_launch_refuses_mismatched_arrays(launches):
    c = kernels.adamw_coefs(1, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    z = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="m must be contiguous with 8"):
        kernels.adamw_cupy(z, z, np.zeros(7, np.float32), z, np.zeros(8, np.uint8), c)
    with pytest.raises(ValueError, match="mask is bytes"):
        kernels.adamw_cupy(z, z, z, z, np.zeros(8, np.float32), c)
    with pytest.raises(ValueError, match="no kernel for p.dtype = float16"):
        h = np.zeros(8, np.float16)
        kernels.adamw_cupy(h, h, h, h, np.zeros(8, np.uint8), c)
    assert not launches


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pack_launch_matches_kernel_signature(launches, dtype):
    src, buf = np.zeros(5000, dtype), np.zeros(300, dtype)
    offs, sizes = kernels.strided_segments(100, rows=20, cols=10, ld=200)
    kernels._launch_copy("pack", buf, src, offs, sizes)
    kernels._launch_copy("unpack", buf, src, offs, sizes)
    assert [c[1] for c in launches] == [f"pack_{'f32' if dtype == np.float32 else 'f64'}",
                                        f"unpack_{'f32' if dtype == np.float32 else 'f64'}"]
    for call in launches:
        _check_launch(call)
        table = call[4][2:5]
        assert [list(t) for t in table] == [list(offs), list(kernels.segment_starts(sizes)), list(sizes)]
        assert call[4][5] == 20 and call[2][1] == 20


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_norm_rope_gating_launches_match_kernel_signatures(launches, dtype):
    from hpengine.nn import fused
    rng = np.random.default_rng(4)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)
    n, c, B, T, H, hd = 37, 7, 2, 7, 3, 6
    fused.rmsnorm_forward(np, r(n, c), r(c), 1e-5)
    fused.rmsnorm_backward_dx(np, r(n, c), r(n, c), r(n, 1), r(c))
    proj = r(B, T, 2 * H * hd)
    x = proj[:, :, H * hd:].reshape(B, T, H, hd)                 # the second half of a projection: strided
    dy = r(B, T, H, hd).transpose(0, 2, 1, 3)
    fused.rope_forward(np, x, r(T, hd // 2), r(T, hd // 2))
    fused.rope_backward(np, dy, r(T + 2, hd // 2)[:T], r(T, hd // 2))
    fused.swiglu_forward(np, r(5, 9), r(5, 9))
    fused.swiglu_backward(np, r(5, 9), r(5, 9), r(5, 9), r(5, 9))
    fused.grouped_softmax_backward_(r(2, 3, 9, 7), r(2, 3, 9, 7), r(2, 3, 9, 2)[..., :1])
    ops = ["rmsnorm_fwd", "rmsnorm_bwd", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd", "grouped_softmax_bwd"]
    assert [call[1] for call in launches] == [f"{op}_{'f32' if dtype == np.float32 else 'f64'}" for op in ops]
    for call in launches:
        _check_launch(call, rows=call[1].startswith("rmsnorm"), strided=(0,) if call[1].startswith("rope") else ())
    rf, rb, pf, pb, sf, sb, gs = (call[4] for call in launches)
    assert rf[5:] == (n, c, dtype(1e-5)) and rb[5:] == (n, c) and rf[4].shape == (n, 1)
    # rope reads its input in place through element strides and writes whole pairs of a new array
    assert np.shares_memory(pf[0], proj) and pf[8:] == tuple(st // x.itemsize for st in x.strides)
    assert pb[0] is dy and pb[8:] == tuple(st // dy.itemsize for st in dy.strides)
    assert pf[3].shape == (B, H, T, hd) and pb[3].shape == (B, T, H, hd)
    assert pf[4:8] == pb[4:8] == (B * T * H * hd // 2, T, H, hd // 2)
    assert sf[4] == sb[6] == 45 and gs[3:] == (2 * 3 * 9 * 7, 7)


def test_rope_launch_refuses_tables_that_do_not_fit(launches):
    from hpengine.nn import fused
    x = np.zeros((1, 5, 2, 6))
    with pytest.raises(ValueError, match="do not fit 5 positions"):
        fused.rope_forward(np, x, np.zeros((5, 2)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="do not fit 5 positions"):
        fused.rope_forward(np, x, np.zeros((4, 3)), np.zeros((4, 3)))
    assert not launches
