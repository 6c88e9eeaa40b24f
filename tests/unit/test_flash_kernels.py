"""kernels/attention.cu without a GPU: it compiles for sm_80 and sm_90 (nvcc, without spills; NVRTC as
CuPy compiles it), and nn/flash_cuda.py's launches (grid, block, shared memory, arguments) match the
kernels' C signatures and tile constants; its bfloat16 rounding equals round-to-nearest-even."""
from __future__ import annotations

import re

import numpy as np
import pytest
from launch_args import check_args

from hpengine.device import kernels
from hpengine.nn import flash, flash_cuda

SRC = kernels.source_path("attention").read_text()


def _entries():
    """{suffix: (S, A, ROWS, TPR, KT)} from the ENTRIES(...) lines of the .cu."""
    out = {}
    for m in re.finditer(r"^ENTRIES\((\w+), ([\w ]+), (\w+), (\d+), (\d+), (\d+)\)", SRC, re.M):
        out[m.group(1)] = (m.group(2), m.group(3), *map(int, m.group(4, 5, 6)))
    return out


def _signature(entry):
    """[C type] of entry flash_<op>_<suffix>, read from the ENTRIES macro with S and A substituted."""
    op, suf = entry[len("flash_"):].rsplit("_", 1)
    S, A = _entries()[suf][:2]
    params = re.search(rf"flash_{op}_##SUF\((.*?)\)\s*\{{", SRC, re.S).group(1).replace("\\", " ")
    params = re.sub(r"\bS\b", S, re.sub(r"\bA\b", A, params))
    out = []
    for decl in params.split(","):
        words = decl.replace("const ", "").replace("*", " * ").split()[:-1]
        out.append(" ".join(w for w in words if w != "*") + ("*" if "*" in words else ""))
    return out


# ---------------------------------------------------------------- compilation

@pytest.mark.timeout(600)
@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
def test_compiles_for_every_arch_without_spills():
    """compile_check raises when nvcc fails; its ptxas -v log must name every ENTRIES(...) instance of each
    flash_<op>_##SUF entry for each arch, without warnings."""
    logs = kernels.compile_check("attention", compiler="nvcc")
    assert set(logs) == set(kernels.ARCHS) == {"sm_80", "sm_90"}
    ops = re.findall(r"void (?:__launch_bounds__\([^)]*\) )?(flash_\w+_)##SUF\(", SRC)
    assert len(ops) == 3
    for arch, log in logs.items():
        assert [line for line in log.splitlines() if "warning" in line.lower()] == [], log
        compiled = set(re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log))
        assert compiled == {(op + suffix, arch) for op in ops for suffix in _entries()}, log
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(frames) == 3 * len(_entries()), arch           # every entry of every storage type
        assert all(f == ("0", "0", "0") for f in frames), log


@pytest.mark.timeout(600)
@pytest.mark.skipif(kernels.find_nvrtc() is None, reason="libnvrtc not found")
def test_compiles_with_nvrtc():
    """compile_check raises when NVRTC fails (as CuPy would); a successful compile must not warn either."""
    log = kernels.compile_check("attention", archs=("sm_80",), compiler="nvrtc")["sm_80"]
    assert [line for line in log.splitlines() if "warning" in line.lower()] == [], log


# ---------------------------------------------------------------- launch plan

def test_tile_constants_match_the_source():
    assert {s: e[2:] for s, e in _entries().items()} == flash_cuda.TILES
    assert f"#define HD_MAX {flash_cuda.HD_MAX}" in SRC
    for rows, tpr, kt in flash_cuda.TILES.values():
        assert (rows * tpr) % 32 == 0 and 32 % tpr == 0 and flash_cuda.HD_MAX % tpr == 0 and kt >= 1


@pytest.fixture
def launches(monkeypatch):
    calls = []

    def function(name, entry, path=None):
        assert name == "attention"
        return lambda grid, block, args, shared_mem=0: calls.append((entry, grid, block, args, shared_mem))
    monkeypatch.setattr(kernels, "function", function)
    return calls


def _check(call, B, heads, T, hd):
    entry, grid, block, args, shared = call
    check_args(entry, args, _signature(entry), same_dtype=False)
    rows, tpr, kt = flash_cuda.TILES[entry.rsplit("_", 1)[1]]
    item = 8 if entry.endswith("f64") else 4
    assert block == (rows * tpr,) and grid == (-(-T // rows), B * heads)
    assert shared == (2 * kt * (hd + 1) if "dkdv" in entry else 2 * kt * hd) * item
    assert flash_cuda.launch_plan("bwd_dkdv", np.float32, 1, 1, 1, 1, flash_cuda.HD_MAX).shared_mem <= 48 * 1024
    return args


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_gpt_launches_read_and_write_in_place(launches, dtype):
    B, T, H, hd = 2, 37, 3, 8
    qkv = np.zeros((B, T, 3 * H * hd), dtype)
    q, k, v = (qkv.reshape(B, T, H, 3, hd)[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    y = np.zeros((B, T, H * hd), dtype)
    o = y.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    lse = flash_cuda.forward(np, q, k, v, o, 0.25)
    dqkv = np.zeros_like(qkv)
    dq, dk, dv = (dqkv.reshape(B, T, H, 3, hd)[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    flash_cuda.backward(np, q, k, v, o, o, lse, dq, dk, dv, 0.25)
    sfx = flash_cuda.suffix(dtype)
    assert [c[0] for c in launches] == [f"flash_{op}_{sfx}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    fwd, dq_call, dkdv = launches
    args = _check(fwd, B, H, T, hd)
    assert all(np.shares_memory(args[i], qkv) for i in (0, 4, 8)) and np.shares_memory(args[12], y)
    assert args[16] is lse and lse.shape == (B, H, T) and args[17:21] == (H, H, T, hd)
    args = _check(dq_call, B, H, T, hd)
    assert args[20] is lse and np.shares_memory(args[22], dqkv)
    args = _check(dkdv, B, H, T, hd)                           # one block per key block and key/value head
    assert args[17] is dq_call[3][21] and np.shares_memory(args[18], dqkv) and np.shares_memory(args[22], dqkv)


@pytest.mark.parametrize("H,K", [(4, 2), (4, 1), (2, 2)])
def test_gqa_launches_use_key_value_heads(launches, H, K):
    B, T, hd = 1, 70, 16
    q, k = np.zeros((B, H, T, hd), np.float32), np.zeros((B, K, T, hd), np.float32)
    v = np.zeros((B, T, K * hd), np.float32).reshape(B, T, K, hd).transpose(0, 2, 1, 3)
    o = np.zeros((B, T, H * hd), np.float32).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    lse = flash_cuda.forward(np, q, k, v, o, 1.0)
    dk, dv = np.zeros_like(k), np.zeros_like(k)
    flash_cuda.backward(np, q, k, v, o, o, lse, np.zeros_like(q), dk, dv, 1.0)
    fwd, dq_call, dkdv = launches
    assert _check(fwd, B, H, T, hd)[17:19] == (H, K)
    _check(dq_call, B, H, T, hd)
    assert _check(dkdv, B, K, T, hd)[26:28] == (H, K)


def test_launcher_refuses_what_the_kernels_cannot_take(launches):
    z = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="head_dim <= 128"):
        big = np.zeros((1, 1, 4, 130), np.float32)
        flash_cuda.forward(np, big, big, big, big, 1.0)
    with pytest.raises(ValueError, match="float32, float64 or bfloat16"):
        h = z.astype(np.float16)
        flash_cuda.forward(np, h, h, h, h, 1.0)
    with pytest.raises(ValueError, match="groups"):
        flash_cuda.forward(np, np.zeros((1, 3, 4, 8), np.float32), z, z, z, 1.0)
    with pytest.raises(ValueError, match="contiguous last axis"):
        flash_cuda.forward(np, z, z, z, np.zeros((1, 2, 8, 4), np.float32).swapaxes(2, 3), 1.0)
    assert not launches


def test_flash_layers_stay_off_the_kernels_for_numpy(launches):
    qkv = np.random.default_rng(0).standard_normal((1, 5, 12))
    flash.flash_attention_forward(np, qkv, 2)
    assert not launches and not flash._use_cuda(np, qkv)


# ---------------------------------------------------------------- bfloat16 rounding

def _rne_oracle(x):
    """Nearest bfloat16 of each float32 by comparing the two neighbours in float64; ties to even."""
    out = []
    for v in x.astype(np.float32):
        if np.isnan(v):
            out.append(0x7FC0)
            continue
        u = int(np.float32(v).view(np.uint32))
        lo, hi = u >> 16, (u >> 16) + 1
        if np.isinf(v):
            out.append(lo)
            continue
        # the value a bit pattern stands for; the step past the largest finite one counts as 2^128
        f = lambda b: 2.0 ** 128 * (-1 if b & 0x8000 else 1) if b & 0x7FFF == 0x7F80 else \
            float(np.uint32(b << 16).view(np.float32))                # noqa: E731
        dlo, dhi = abs(float(v) - f(lo)), abs(float(v) - f(hi))
        out.append(lo if dlo < dhi or (dlo == dhi and lo % 2 == 0) else hi)
    return np.array(out, np.uint32).astype(np.uint16)


def test_bf16_rounds_to_nearest_even():
    r = np.random.default_rng(1)
    x = np.concatenate([r.standard_normal(2000).astype(np.float32) * 10.0 ** r.integers(-30, 30, 2000),
                        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0, -0.0, np.inf, -np.inf, np.nan,
                                  3.3895e38, -3.3895e38, 1e-40], np.float32)]).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = flash_cuda.to_bf16(np, x)
        want = _rne_oracle(x)
    assert bits.dtype == np.uint16 and (bits == want).all()
    assert bits[2000] == 0x3F80 and bits[2001] == 0x3F82            # ties: 1 + 2^-8 -> 1, 1 + 3 2^-8 -> 1 + 2^-6
    back = flash_cuda.from_bf16(np, bits)
    finite = np.isfinite(x) & (np.abs(x) < 3e38) & (np.abs(x) > 1.2e-38)     # normal numbers
    assert np.all(np.abs(back[finite] - x[finite]) <= np.abs(x[finite]) * 2.0 ** -8)
