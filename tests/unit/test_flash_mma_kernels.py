"""kernels/attention_mma.cu (flash attention on tensor cores) without a GPU: it compiles for sm_80 and sm_90
(nvcc: every entry's PTX runs bf16 mma.sync, ptxas reports no spills; NVRTC as CuPy compiles it); its
fragment index macros, evaluated in Python, are the PTX ISA's m16n8k16 layouts and chain one product's
accumulators into the next product's A operand; nn/flash_cuda.py sends bf16 amp to these entries with
arguments that match their C signatures."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from launch_args import check_args

from hpengine.device import kernels
from hpengine.nn import flash_cuda

PATH = kernels.source_path("attention_mma")
SRC = PATH.read_text()
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _entries():
    """{suffix: (S, HD, BN, BNQ, QT)} from the MMA_ENTRIES(...) lines of the .cu."""
    return {m.group(1): (m.group(2), *map(int, m.group(3, 4, 5, 6))) for m in
            re.finditer(r"^MMA_ENTRIES\((\w+), ([\w ]+), (\d+), (\d+), (\d+), (\d+)\)", SRC, re.M)}


def _names():
    ops = re.findall(r"void __launch_bounds__\([^)]*\) (flash_mma_\w+_)##SUF\(", SRC)
    assert ops == ["flash_mma_fwd_", "flash_mma_bwd_dq_", "flash_mma_bwd_dkdv_"]
    return {op + suffix for op in ops for suffix in _entries()}


def _macro(name):
    """The #define name(args) body of the .cu as a Python function (the bodies are integer expressions
    that mean the same in C and Python)."""
    m = re.search(rf"^#define {name}\(([\w, ]*)\) (.*)$", SRC, re.M)
    return eval(f"lambda {m.group(1)}: {m.group(2)}")      # noqa: S307 - our own source


A_ROW, A_COL, B_K, B_N, C_ROW, C_COL, PA_TILE, PA_ELEM = (_macro(n) for n in (
    "A_ROW", "A_COL", "B_K", "B_N", "C_ROW", "C_COL", "PA_TILE", "PA_ELEM"))


# ---------------------------------------------------------------- compilation

def _ptx(arch):
    nvcc = kernels.find_nvcc()
    r = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-o", "-", str(PATH)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(600)
@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
def test_compiles_for_every_arch_to_bf16_mma_without_spills():
    logs = kernels.compile_check("attention_mma", compiler="nvcc")
    assert set(logs) == {"sm_80", "sm_90"}
    names = _names()
    assert len(names) == 12
    for arch, log in logs.items():
        assert [line for line in log.splitlines() if "warning" in line.lower()] == [], log
        assert set(re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log)) == {(n, arch) for n in names}
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(frames) == len(names) and all(f == ("0", "0", "0") for f in frames), log
    bodies = re.split(r"^\.visible \.entry ", _ptx("sm_80"), flags=re.M)[1:]    # inline PTX: alike at sm_90
    assert {b.split("(", 1)[0] for b in bodies} == names
    for body in bodies:                            # every entry runs bf16 mma.sync
        assert MMA in body, body.split("(", 1)[0]


@pytest.mark.timeout(600)
@pytest.mark.skipif(kernels.find_nvrtc() is None, reason="libnvrtc not found")
def test_compiles_with_nvrtc():
    for arch, log in kernels.compile_check("attention_mma", compiler="nvrtc").items():
        assert [line for line in log.splitlines() if "warning" in line.lower()] == [], (arch, log)


# ---------------------------------------------------------------- fragment layouts

LANES = range(32)


def _isa_a(lane, i):
    """PTX ISA, m16n8k16 .bf16 multiplicand A, element a_i (registers hold a_0..a_7 low to high, two each)."""
    g, t = lane >> 2, lane % 4
    row = g if 0 <= i < 2 or 4 <= i < 6 else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def _isa_b(lane, i):
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def _isa_c(lane, i):
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def test_fragment_macros_are_the_isa_layouts_and_cover_each_element_once():
    a = [(A_ROW(lane, r), A_COL(lane, r) + h) for lane in LANES for r in range(4) for h in range(2)]
    assert a == [_isa_a(lane, i) for lane in LANES for i in range(8)]
    assert sorted(a) == [(r, c) for r in range(16) for c in range(16)]
    b = [(B_K(lane, r) + h, B_N(lane)) for lane in LANES for r in range(2) for h in range(2)]
    assert b == [_isa_b(lane, i) for lane in LANES for i in range(4)]
    assert sorted(b) == [(k, n) for k in range(16) for n in range(8)]
    c = [(C_ROW(lane, e), C_COL(lane, e)) for lane in LANES for e in range(4)]
    assert c == [_isa_c(lane, i) for lane in LANES for i in range(4)]
    assert sorted(c) == [(r, n) for r in range(16) for n in range(8)]


def test_accumulators_become_the_next_a_operand_in_the_same_lane():
    """A register r of 16 columns packs C tile PA_TILE(r) (of the two 8-column tiles), elements PA_ELEM(r)
    and PA_ELEM(r) + 1: each must be the A element that register holds, in the lane that holds it."""
    for lane in LANES:
        for r in range(4):
            for h in range(2):
                e = PA_ELEM(r) + h
                assert (C_ROW(lane, e), 8 * PA_TILE(r) + C_COL(lane, e)) == _isa_a(lane, 2 * r + h)


def _mma(a_regs, b_regs, acc):
    """The hardware's product read through the ISA's tables: registers (lane, element) -> matrices."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in LANES:
        for i in range(8):
            A[_isa_a(lane, i)] = a_regs[lane][i]
        for i in range(4):
            B[_isa_b(lane, i)] = b_regs[lane][i]
    D = A @ B
    for lane in LANES:
        for i in range(4):
            acc[lane][i] += D[_isa_c(lane, i)]


def test_emulated_warp_runs_s_then_p_v_through_the_kernel_indexing():
    """One warp's S = Q K^T then O = S V (16 rows, 16 keys, 8 columns) with the kernel's loaders written
    through its macros: frag_a from row-major Q, frag_b_nk from row-major K ([n][k]), acc_a from S,
    frag_b_kn from row-major V ([k][n]); the result equals NumPy's."""
    r = np.random.default_rng(0)
    Q, K, V = r.standard_normal((16, 16)), r.standard_normal((16, 16)), r.standard_normal((16, 8))
    qa = [[Q[A_ROW(ln, i // 2), A_COL(ln, i // 2) + i % 2] for i in range(8)] for ln in LANES]
    s = [[[0.0] * 4 for _ in LANES] for _ in range(2)]           # two 8-key tiles
    for n in range(2):
        kb = [[K[8 * n + B_N(ln), B_K(ln, i // 2) + i % 2] for i in range(4)] for ln in LANES]
        _mma(qa, kb, s[n])
    pa = [[s[PA_TILE(i // 2)][ln][PA_ELEM(i // 2) + i % 2] for i in range(8)] for ln in LANES]
    vb = [[V[B_K(ln, i // 2) + i % 2, B_N(ln)] for i in range(4)] for ln in LANES]
    o = [[0.0] * 4 for _ in LANES]
    _mma(pa, vb, o)
    got = np.zeros((16, 8))
    for ln in LANES:
        for e in range(4):
            got[C_ROW(ln, e), C_COL(ln, e)] = o[ln][e]
    np.testing.assert_allclose(got, (Q @ K.T) @ V, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- launches

def test_tile_constants_match_the_source():
    got = {e[1]: e[2:] for e in _entries().values()}
    assert got == flash_cuda.MMA_TILES and set(got) == {64, 128}
    assert f"#define WARPS {flash_cuda.MMA_WARPS}" in SRC and f"#define PAD {flash_cuda.MMA_PAD} " in SRC
    for suffix, (S, hd_bound, bn, bnq, qt) in _entries().items():
        assert S == {"f32": "float", "bf16": "unsigned short"}[suffix.split("_")[0]]
        assert bn % 16 == 0 and bnq % 16 == 0 and qt % 16 == 0 and (16 * flash_cuda.MMA_WARPS) % qt == 0


@pytest.fixture
def launches(monkeypatch):
    calls = []

    def function(name, entry, path=None):
        assert name == ("attention_mma" if entry.startswith("flash_mma_") else "attention")
        return lambda grid, block, args, shared_mem=0: calls.append((entry, grid, block, args, shared_mem))
    monkeypatch.setattr(kernels, "function", function)
    return calls


def _signature(entry):
    op, suf = re.match(r"flash_mma_(fwd|bwd_dq|bwd_dkdv)_(\w+)$", entry).groups()
    S = _entries()[suf][0]
    params = re.search(rf"flash_mma_{op}_##SUF\((.*?)\)\s*\{{", SRC, re.S).group(1).replace("\\", " ")
    params = re.sub(r"\bS\b", S, params)
    out = []
    for decl in params.split(","):
        words = decl.replace("const ", "").replace("*", " * ").split()[:-1]
        out.append(" ".join(w for w in words if w != "*") + ("*" if "*" in words else ""))
    return out


def _check(call, B, heads, T, hd):
    entry, grid, block, args, shared = call
    check_args(entry, args, _signature(entry), same_dtype=True)
    bound = int(entry.rsplit("hd", 1)[1])
    bn, bnq, qt = flash_cuda.MMA_TILES[bound]
    ld, rows = bound + flash_cuda.MMA_PAD, 16 * flash_cuda.MMA_WARPS
    assert bound == (64 if hd <= 64 else 128)
    assert block == (32 * flash_cuda.MMA_WARPS,) and grid == (-(-T // rows), B * heads)
    # the layout the kernel header states: bf16 tiles of ld per row, float32 lse and D of the query tile
    want = {"fwd": 2 * bn * ld * 2, "bwd_dq": 2 * bnq * ld * 2, "bwd_dkdv": 2 * (rows + qt) * ld * 2 + 2 * qt * 4}
    assert shared == want[entry[len("flash_mma_"):].rsplit("_", 2)[0]] <= 48 * 1024
    return args


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("hd", [8, 64, 65, 128])
def test_bf16_amp_launches_the_tensor_core_entries(launches, dtype, hd):
    B, T, H = 2, 37, 3
    qkv = np.zeros((B, T, 3 * H * hd), dtype)
    q, k, v = (qkv.reshape(B, T, H, 3, hd)[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    y = np.zeros((B, T, H * hd), dtype)
    o = y.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    mma = flash_cuda.use_mma(dtype, True)       # as nn/flash.py asks under bf16 amp
    lse = flash_cuda.forward(np, q, k, v, o, 0.25, mma=mma)
    dqkv = np.zeros_like(qkv)
    dq, dk, dv = (dqkv.reshape(B, T, H, 3, hd)[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    flash_cuda.backward(np, q, k, v, o, o, lse, dq, dk, dv, 0.25, mma=mma)
    sfx = f"{flash_cuda.suffix(dtype)}_hd{64 if hd <= 64 else 128}"
    assert [c[0] for c in launches] == [f"flash_mma_{op}_{sfx}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    fwd, dq_call, dkdv = launches
    args = _check(fwd, B, H, T, hd)
    assert all(np.shares_memory(args[i], qkv) for i in (0, 4, 8)) and np.shares_memory(args[12], y)
    assert args[16] is lse and lse.dtype == np.float32 and args[17:21] == (H, H, T, hd) and args[21] == 0.25
    args = _check(dq_call, B, H, T, hd)
    assert args[20] is lse and np.shares_memory(args[22], dqkv)
    args = _check(dkdv, B, H, T, hd)
    assert args[17] is dq_call[3][21] and np.shares_memory(args[18], dqkv) and np.shares_memory(args[22], dqkv)


@pytest.mark.parametrize("H,K", [(4, 2), (4, 1)])
def test_mma_launches_use_key_value_heads(launches, H, K):
    B, T, hd = 1, 70, 16
    q, k = np.zeros((B, H, T, hd), np.float32), np.zeros((B, K, T, hd), np.float32)
    v = np.zeros((B, T, K * hd), np.float32).reshape(B, T, K, hd).transpose(0, 2, 1, 3)
    o = np.zeros((B, T, H * hd), np.float32).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    lse = flash_cuda.forward(np, q, k, v, o, 1.0, mma=True)
    flash_cuda.backward(np, q, k, v, o, o, lse, np.zeros_like(q), np.zeros_like(k), np.zeros_like(k), 1.0, mma=True)
    fwd, dq_call, dkdv = launches
    assert _check(fwd, B, H, T, hd)[17:19] == (H, K)
    _check(dq_call, B, H, T, hd)
    assert _check(dkdv, B, K, T, hd)[26:28] == (H, K)


def test_dispatch_follows_bf16_amp_and_refuses_float64(launches):
    z = np.zeros((1, 2, 4, 8), np.float32)
    flash_cuda.forward(np, z, z, z, z.copy(), 1.0)
    flash_cuda.forward(np, z, z, z, z.copy(), 1.0, mma=False)
    d = z.astype(np.float64)
    assert not flash_cuda.use_mma(d.dtype, True)
    flash_cuda.forward(np, d, d, d, d.copy(), 1.0, mma=flash_cuda.use_mma(d.dtype, True))   # float64: its own kernel
    assert [c[0] for c in launches] == ["flash_fwd_f32", "flash_fwd_f32", "flash_fwd_f64"]
    with pytest.raises(ValueError, match="tensor-core kernels take float32 or bfloat16 bits"):
        flash_cuda.forward(np, d, d, d, d.copy(), 1.0, mma=True)
    with pytest.raises(ValueError, match="head_dim <= 128"):
        big = np.zeros((1, 1, 4, 130), np.float32)
        flash_cuda.forward(np, big, big, big, big, 1.0, mma=True)
    assert len(launches) == 3
