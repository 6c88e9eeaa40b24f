"""bfloat16 activation caches in 2 bytes (strategies/bf16_storage.py, amp.bf16_storage = "packed") against the
float32 emulation: the bits against ml_dtypes and the round trip against precision.round_bf16_ bit for bit on
special values; views of one array packed once and rebuilt as views of one array; the conversion kernels'
bodies compiled by nvcc, and run on the host against their NumPy twin; on NumPy a packed run trains bit for
bit like the float32 one (gpt and llama kinds, recompute off, full and selective) with its cache peak lower
by exactly half the packed float32 bytes, which the planner predicts, and its compute copy of the parameters
bfloat16 bits in half the bytes; the config rules."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest
from cuda_bodies import compile_body
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.device import bf16_bits, kernels
from hpengine.device.precision import round_bf16_
from hpengine.layout.cache import Recompute, cache_arrays, cache_nbytes
from hpengine.layout.resolve import LayoutError, resolve
from hpengine.models import build_model
from hpengine.planner.model import for_rank
from hpengine.run.build import build
from hpengine.strategies.bf16_storage import Packed, PackedView, pack_cache, unpack_cache

BF16 = ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16", "model.dtype=float32"]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16", "train.global_batch=8",
        "optim.lr=3e-3", "optim.warmup_steps=2", "runtime.backend=numpy"]
KINDS = {"gpt": ["model.kind=gpt"], "llama": ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=48"]}
KINDS["llama_flash"] = KINDS["llama"] + ["model.attention=flash"]
KINDS["gpt_flash"] = KINDS["gpt"] + ["model.attention=flash"]       # qkv, the output and dqkv as bits in flight
RC = "strategy.recompute."
RECOMPUTE = {"off": [], "full": [RC + "enable=true"], "selective": [RC + "enable=true", RC + "granularity=selective"]}
# inf, NaNs (quiet, signalling, payload only in the low half), +-0, the smallest and a tie-carrying subnormal,
# ties to even both ways, the largest finite float32 (rounds to inf, as ml_dtypes) and bf16's largest finite
SPECIAL = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0x80000000, 0,
                    0x00000001, 0x00008000, 0x00018000, 0x807F8000, 0x3F808000, 0x3F818000, 0xBF808000,
                    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF], dtype=np.uint32)


def values():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([u, SPECIAL]).view(np.float32)


def test_round_trip_equals_round_bf16_and_ml_dtypes():
    x = values()
    p = pack_cache(np, (x,), set())[0]
    assert isinstance(p, Packed) and p.bits.dtype == np.uint16 and p.nbytes == 2 * x.size
    with np.errstate(invalid="ignore", over="ignore"):
        want_bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(p.bits[~nan], want_bits[~nan])
    back = unpack_cache(np, (p,))[0]
    assert back.dtype == np.float32 and back.shape == x.shape
    rounded = round_bf16_(np, x.copy())
    np.testing.assert_array_equal(back[~nan].view(np.uint32), rounded[~nan].view(np.uint32))
    assert np.isnan(back[nan]).all() and np.isnan(rounded[nan]).all()    # the NaN payload is not kept alike
    assert np.isinf(back[x.view(np.uint32) == 0x7F7FFFFF]).all()          # overflow to inf, as the rounding


def test_views_share_one_packed_root():
    rng = np.random.default_rng(1)
    qkv = round_bf16_(np, rng.normal(size=(2, 8, 12)).astype(np.float32))
    other = round_bf16_(np, rng.normal(size=(16, 4)).astype(np.float32))
    param, ids = np.ones((4, 4), np.float32), np.arange(6)
    cache = ((qkv[..., :4], qkv[..., 4:8], qkv[..., 8:]), (qkv.reshape(-1, 12), (2, 8)), [qkv.transpose(2, 0, 1)],
             Recompute(other), other[::-1], np.float32(3.0), param[1:], ids, None)
    p = pack_cache(np, cache, {id(param)})
    assert all(isinstance(a, PackedView) and a.base is p[0][0].base for a in p[0] + (p[1][0], p[2][0]))
    assert isinstance(p[3], Recompute) and isinstance(p[3].x, Packed)
    assert p[5] is cache[5] and p[6] is cache[6] and p[7] is ids and p[8] is None and p[1][1] == (2, 8)
    # qkv once, other once, other[::-1] (no element grid of its own root) on its own; the rest kept
    f32 = qkv.nbytes + other.nbytes
    assert cache_nbytes(p, {id(param)}) == cache_nbytes(cache, {id(param)}) - f32 + f32 // 2 + other.nbytes // 2
    u = unpack_cache(np, p)
    for got, want in zip(cache_arrays(u), cache_arrays(cache)):
        assert got.shape == want.shape and np.array_equal(got, want)
    q, k, v = u[0]
    q[0, 0, 0], k[0, 0, 0], v[1, 7, 3] = 7.0, 5.0, 3.0       # one float32 array under the views, writable
    assert (u[1][0][0, 0], u[1][0][0, 4], u[2][0][11, 1, 7]) == (7.0, 5.0, 3.0) and not np.shares_memory(q, qkv)


@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
def test_unpacking_body_compiles(tmp_path):
    log = compile_body(tmp_path, "round_trip", "const float* xs, float* ys",
                       "    float x = xs[i];\n    unsigned short b;\n    {\n        unsigned short y;\n"
                       + bf16_bits.TO_BF16_BODY + "        b = y;\n    }\n    float y;\n"
                       + bf16_bits.FROM_BF16_BODY + "    ys[i] = y;\n")
    assert re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log) == [("0", "0")], log


@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
def test_rounding_body_compiles(tmp_path):
    compile_body(tmp_path, "round_in_place", "float* xs",
                 "    float x = xs[i];\n    float& y = xs[i];\n" + bf16_bits.ROUND_BF16_BODY)


HOST_SHIM = """#include <cstring>
static inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float x; std::memcpy(&x, &u, 4); return x; }
extern "C" void to_bf16(const float* xs, unsigned short* ys, long n) {
    for (long i = 0; i < n; ++i) { float x = xs[i]; unsigned short y; @TO@ ys[i] = y; }
}
extern "C" void from_bf16(const unsigned short* bs, float* ys, long n) {
    for (long i = 0; i < n; ++i) { unsigned short b = bs[i]; float y; @FROM@ ys[i] = y; }
}
extern "C" void round_bf16(const float* xs, float* ys, long n) {
    for (long i = 0; i < n; ++i) { float x = xs[i]; float y; @ROUND@ ys[i] = y; }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
def test_numpy_twin_equals_the_kernel_bodies_run_on_the_host(tmp_path):
    """The CUDA bodies themselves, compiled for the CPU with the two intrinsics they use as bit copies,
    against the NumPy conversions and rounding: every bit, NaNs included."""
    src, lib = tmp_path / "bodies.cpp", tmp_path / "bodies.so"
    src.write_text(HOST_SHIM.replace("@TO@", "{" + bf16_bits.TO_BF16_BODY + "}")
                   .replace("@FROM@", "{" + bf16_bits.FROM_BF16_BODY + "}")
                   .replace("@ROUND@", "{" + bf16_bits.ROUND_BF16_BODY + "}"))
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    so = ctypes.CDLL(str(lib))
    x = values()
    bits, back = np.empty(x.size, np.uint16), np.empty(x.size, np.float32)
    so.to_bf16(x.ctypes.data_as(ctypes.c_void_p), bits.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    so.from_bf16(bits.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    np.testing.assert_array_equal(bf16_bits.to_bf16_bits(np, x), bits)
    np.testing.assert_array_equal(bf16_bits.from_bf16_bits(np, bits).view(np.uint32), back.view(np.uint32))
    rounded = np.empty(x.size, np.float32)
    so.round_bf16(x.ctypes.data_as(ctypes.c_void_p), rounded.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    np.testing.assert_array_equal(round_bf16_(np, x.copy()).view(np.uint32), rounded.view(np.uint32))


def engine(corpus, *extra):
    return build(load_config(None, [*TINY, f"data.path={corpus}", *BF16, *extra]), MPI.COMM_SELF)


def train(eng, steps=3):
    return [eng.train_step(s)["loss"] for s in range(steps)], eng.named_params()


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_run_equals_float32_storage(small_corpus, kind, recompute):
    f32 = engine(small_corpus, *KINDS[kind], *RECOMPUTE[recompute], "strategy.amp.bf16_storage=float32")
    packed = engine(small_corpus, *KINDS[kind], *RECOMPUTE[recompute], "strategy.amp.bf16_storage=packed")
    assert not f32.precision.packed and packed.precision.packed
    # the compute copy: bfloat16 bits in half the bytes, the bits of the float32 storage's values
    assert packed.sync.params.data.dtype == np.uint16 and f32.sync.params.data.dtype == np.float32
    assert 2 * packed.memory()["param_bytes"] == f32.memory()["param_bytes"] == 4 * f32.layout.total
    np.testing.assert_array_equal(packed.sync.params.data, f32.sync.params.data.view(np.uint32) >> 16)
    (la, pa), (lb, pb) = train(f32), train(packed)
    assert la == lb
    assert all(pa[n].dtype == pb[n].dtype == np.float32 and np.array_equal(pa[n], pb[n]) for n in pa)
    np.testing.assert_array_equal(packed.sync.params.data, f32.sync.params.data.view(np.uint32) >> 16)
    assert packed.cache_peak < f32.cache_peak
    if kind == "gpt":
        # every array a gpt layer caches is float32 (xhat and rstd, the linears' inputs, qkv, the scaled q,
        # the output and the probabilities, GELU's), and the peak holds every layer's cache: packing takes
        # half of the layers' cached bytes off (the embedding keeps its own, the head all but its linear's
        # input and the final norm's normalised input: that norm writes both as bfloat16 bits, 2 bytes an element
        # off)
        c = f32.cfg.model
        cb = build_model(c, 1).cache_bytes(8, 1, 4, "bfloat16", 8)
        layer = {"off": cb["layer"], "full": cb["input"], "selective": cb["layer"] - cb["scores"]}[recompute]
        assert cb["bits_head"] == 2 * 8 * c.seq_len * c.d_model
        assert packed.cache_peak == f32.cache_peak - c.n_layers * layer // 2 - 2 * cb["bits_head"]
    cfg = packed.cfg
    pred = for_rank(cfg, 1, packed.mesh.coords)["memory"]
    assert (packed.cache_peak, packed.memory()["param_bytes"]) == (pred["activations"], pred["params"])


@pytest.mark.parametrize("extra", [KINDS["llama"] + ["model.qk_norm=true", "model.attention=flash"],
                                   KINDS["llama"] + ["model.n_layers=3", "model.moe.num_experts=4", "model.moe.top_k=2",
                                                     "model.moe.expert_hidden=12", "model.moe.dense_layers=1"]],
                         ids=["llama_qk_flash", "moe"])
def test_planner_predicts_the_packed_peak(small_corpus, extra):
    """Statistics kept in float32 whatever the dtype (rstd, lse) and the experts' caches are packed too."""
    eng = engine(small_corpus, *extra, "strategy.amp.bf16_storage=packed")
    eng.train_step(0)
    assert eng.cache_peak == for_rank(eng.cfg, 1, eng.mesh.coords)["memory"]["activations"]


def test_storage_follows_the_backend_and_rules(small_corpus):
    cfg = lambda *x: load_config(None, [*TINY, f"data.path={small_corpus}", *x])      # noqa: E731
    assert resolve(cfg(*BF16), 1).bf16_storage == "float32"                   # auto on NumPy
    auto = resolve(cfg(*BF16, "runtime.backend=auto"), 1)
    assert auto.bf16_storage == "auto" and auto.packs_activations(True) and not auto.packs_activations(False)
    assert auto.on_device(True).bf16_storage == "packed" and auto.on_device(False).bf16_storage == "float32"
    assert resolve(cfg(*BF16, "runtime.backend=cupy"), 1).bf16_storage == "packed"
    assert resolve(cfg("strategy.amp.enable=true", "model.dtype=float32"), 1).bf16_storage == ""
    assert not engine(small_corpus).precision.packed
    with pytest.raises(LayoutError, match="bf16_storage = 'packed' applies to dtype = 'bfloat16' only"):
        resolve(cfg("strategy.amp.enable=true", "model.dtype=float32", "strategy.amp.bf16_storage=packed"), 1)


@pytest.mark.parametrize("which", ["q", "k", "v", "qkv"])
def test_grouped_attention_takes_bits_inputs(which):
    # the projections' outputs stored as bfloat16 bits (packed) give the attention the float32 storage's values
    from hpengine.nn import Numerics
    from hpengine.nn.gqa import gqa_attention_forward
    rng = np.random.default_rng(3)
    B, H, K, T, hd = 2, 4, 2, 16, 8
    q, k, v = (round_bf16_(np, rng.normal(size=(B, n, T, hd)).astype(np.float32)) for n in (H, K, K))
    want, _ = gqa_attention_forward(np, q.copy(), k.copy(), v.copy(), num=Numerics(bf16=True))
    args = [bf16_bits.to_bf16_bits(np, t) if name in which else t.copy() for name, t in zip("qkv", (q, k, v))]
    got, _ = gqa_attention_forward(np, *args, num=Numerics(bf16=True, bits=True))
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(bf16_bits.from_bf16_bits(np, got), want)
