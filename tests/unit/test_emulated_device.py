"""The engine's CuPy code paths, run on the CPU through a NumPy stand-in for CuPy (emulated_cupy.py), against the
NumPy backend. With the layers' fused kernels off, training on the stand-in device equals training on NumPy
(float64 1e-10; bf16 amp over packed storage within float32 sums' order), so the strided cuBLAS calls, the bf16
GEMMs' arguments, the packed caches and the AdamW launch do on "CuPy" what NumPy does. With the fused and flash
kernels on, as on a GPU, their emulated C code trains like NumPy too: float64 at 1e-10, float32 and bf16 amp on
the tensor-core flash entries within float32 sums' order. With every kernel on, a step of each model kind,
float32 and bf16 amp, standard and flash attention, makes only launches that fit their entries' C signatures and
the launch limits, and no host array reaches a kernel or cuBLAS."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import emulated_cupy
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.device.precision import round_bf16_
from hpengine.nn import flash, fused
from hpengine.run.build import build

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16", "train.global_batch=8",
        "optim.lr=3e-3", "optim.warmup_steps=2", "optim.clip_grad_norm=0.5"]
KINDS = {"gpt": ["model.kind=gpt"], "llama": ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=48"]}
BF16 = ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16", "model.dtype=float32",
        "strategy.amp.bf16_storage=packed"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss=0.01"]
STEPS = 3
HD = 8      # TINY's head size (d_model / n_heads)


def train(corpus, backend, *extra, steps=STEPS):
    eng = build(load_config(None, [*TINY, f"data.path={corpus}", f"runtime.backend={backend}", *extra]),
                MPI.COMM_SELF)
    assert eng.be.name == backend
    losses = [eng.train_step(s)["loss"] for s in range(steps)]
    return np.array(losses), eng.named_params()


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


@pytest.fixture
def unfused(monkeypatch):
    monkeypatch.setattr(fused, "ENABLED", False)
    monkeypatch.setattr(flash, "CUDA", False)


def _same(got, want, rtol, atol):
    (gl, gp), (wl, wp) = got, want
    np.testing.assert_allclose(gl, wl, rtol=rtol, atol=atol)
    assert gp.keys() == wp.keys()
    for k in wp:
        np.testing.assert_allclose(np.asarray(gp[k]), wp[k], rtol=rtol, atol=atol, err_msg=k)


def _masters(eng) -> dict:
    """The float32 master weights by tensor, on the host (one rank: its owned range is every parameter)."""
    m, lay = eng.be.to_host(eng.master), eng.layout
    return {n: np.array(m[lay.ranges[n].slice]).reshape(lay.shapes[n]) for n in lay.names}


def train_amp(corpus, backend, *extra, eng=None):
    """A bf16 amp run of STEPS steps: (losses, the float32 masters after, the masters before). The compute copy
    it ends with must be the masters rounded to bfloat16, exactly."""
    eng = eng or build(load_config(None, [*TINY, f"data.path={corpus}", f"runtime.backend={backend}", *extra]),
                       MPI.COMM_SELF)
    start = _masters(eng)
    losses = np.array([eng.train_step(s)["loss"] for s in range(STEPS)])
    masters = _masters(eng)
    for n, p in eng.named_params().items():
        assert np.array_equal(p, round_bf16_(np, masters[n].copy())), n
    return losses, masters, start


def _same_amp(got, want):
    """Two bf16 amp runs alike within float32 sums' order. The losses: float32 means over bfloat16 logits, within
    half a bf16 ulp (2^-9 relative). The weights, judged tensor by tensor on their float32 masters: another
    float32 sum order (here a GEMM in the other orientation, which OpenBLAS's Haswell kernels sum differently
    and its SkylakeX ones alike) turns some bf16 roundings of activations the other way, and Adam's first step
    is lr * sign(g), so an element whose gradient is within that rounding of zero steps the other way: element
    by element no bound short of the run's whole reach (2 lr a step) holds. Each tensor's two runs must differ
    by under 5% of how far training moved it (measured: 1.2% at most on Haswell's kernels, none on SkylakeX's),
    where a gradient computed wrongly leaves them about as far apart as training moved them. gpt's key biases
    are left out: their gradient is zero in exact arithmetic (a query's scores all gain q.b_k, which softmax
    ignores), so each run steps them by lr on its own rounding noise."""
    (gl, gm, g0), (wl, wm, w0) = got, want
    np.testing.assert_allclose(gl, wl, rtol=2 ** -9)
    assert gm.keys() == wm.keys()
    for n in wm:
        assert np.array_equal(g0[n], w0[n]), n       # the same start
        keep = (np.arange(wm[n].size) // HD % 3 != 1) if n.endswith(".attn.qkv.b") else slice(None)  # [h][q,k,v][d]
        apart = np.linalg.norm((gm[n] - wm[n])[keep])
        moved = np.linalg.norm((wm[n] - w0[n])[keep])
        assert apart <= 0.05 * moved, (n, apart / moved)


@pytest.mark.parametrize("kind", list(KINDS))
def test_float64_on_the_stand_in_device_trains_like_numpy(small_corpus, device, unfused, kind):
    extra = [*KINDS[kind], "model.dtype=float64"]
    want = train(small_corpus, "numpy", *extra)
    got = train(small_corpus, "cupy", *extra)
    _same(got, want, 1e-10, 1e-12)
    assert set(device.launches) == {"adamw_f64"}


def test_moe_on_the_stand_in_device_trains_like_numpy(small_corpus, device, unfused):
    extra = [*KINDS["llama"], *MOE, "model.dtype=float64"]
    _same(train(small_corpus, "cupy", *extra), train(small_corpus, "numpy", *extra), 1e-10, 1e-12)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_packed_on_the_stand_in_device_trains_like_numpy(small_corpus, device, unfused, kind):
    want = train_amp(small_corpus, "numpy", *KINDS[kind], *BF16)
    got = train_amp(small_corpus, "cupy", *KINDS[kind], *BF16)
    _same_amp(got, want)
    assert {g[0] for g in device.gemms} == {"gemmStridedBatchedEx"}
    assert set(device.launches) == {"adamw_f32_bf16bits", "pack_bf16_f32"}   # the layers' kernels off: storage's only


LAUNCH_CASES = {
    # under bf16 amp (packed on the device) what only GEMMs read comes out of the _f32_bf16 entries as bits
    "gpt_f32_standard": ([*KINDS["gpt"], "model.dtype=float32"],
                         {"gelu_fwd_f32", "gelu_bwd_f32", "causal_softmax_f32", "layernorm_fwd_f32", "xent_fwd_f32",
                          "adamw_f32"}),
    "gpt_f32_flash": ([*KINDS["gpt"], "model.dtype=float32", "model.attention=flash"],
                      {"flash_fwd_f32", "flash_bwd_dq_f32", "flash_bwd_dkdv_f32"}),
    "llama_bf16_flash": ([*KINDS["llama"], *BF16, "model.attention=flash"],
                         {"flash_mma_fwd_bf16_hd64", "flash_mma_bwd_dkdv_bf16_hd64", "rmsnorm_fwd_f32_bf16x", "rope_fwd_f32_bf16i",
                          "rope_bwd_f32_bf16", "swiglu_fwd_f32_bf16i", "swiglu_bwd_f32_bf16i", "adamw_f32_bf16bits"}),
    "llama_bf16_standard": ([*KINDS["llama"], *BF16], {"rope_fwd_f32_bf16i", "rope_bwd_f32_bf16", "causal_softmax_f32_bf16",
                                                       "grouped_softmax_bwd_f32_bf16o", "swiglu_recompute_f32_bf16i",
                                                       "rmsnorm_bwd_f32_bf16i", "colsum_prod_part_f32_bf16i"}),
    "gpt_bf16_standard": ([*KINDS["gpt"], *BF16], {"causal_softmax_f32_bf16", "softmax_bwd_f32_bf16o",
                                                   "layernorm_fwd_f32_bf16x", "gelu_fwd_f32_bf16i", "gelu_bwd_f32_bf16i",
                                                   "gelu_recompute_f32_bf16i", "adamw_f32_bf16bits"}),
    "llama_moe_bf16": ([*KINDS["llama"], *BF16, *MOE], {"swiglu_fwd_f32", "grouped_softmax_bwd_f32_bf16o"}),
    "gpt_recompute_selective": ([*KINDS["gpt"], *BF16, "strategy.recompute.enable=true",
                                 "strategy.recompute.granularity=selective"], {"gelu_fwd_f32_bf16i", "layernorm_bwd_f32_bf16i"}),
}


@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_every_launch_fits_its_kernel(small_corpus, device, case):
    extra, must = LAUNCH_CASES[case]
    losses, _ = train(small_corpus, "cupy", *extra, steps=1)      # the stand-in checks each launch as it goes
    assert np.isfinite(losses).all()
    assert must <= set(device.launches), sorted(set(device.launches))
    assert device.gemms


def test_host_arrays_do_not_mix_with_device_arrays(device):
    a = device.zeros(4, dtype=np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(4, np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        device.exp(np.ones(4))
    assert isinstance(device.asarray(np.ones(4)) + a, emulated_cupy.DevArray)


def test_a_launch_against_its_signature_is_checked(device):
    from hpengine.device import kernels
    fn = kernels.function("fused", "gelu_fwd_f32")
    x, y, s = (device.zeros(8, dtype=np.float32) for _ in range(3))
    fn((1,), (256,), (x, y, s, np.int64(8)))
    with pytest.raises(AssertionError, match="not a device array"):
        fn((1,), (256,), (x, np.zeros(8, np.float32), s, np.int64(8)))
    with pytest.raises(AssertionError, match="argument 3"):
        fn((1,), (256,), (x, y, s, 8))
    with pytest.raises(AssertionError, match="3 arguments for 4"):
        fn((1,), (256,), (x, y, s))
    with pytest.raises(AssertionError, match="shared memory"):
        fn((1,), (256,), (x, y, s, np.int64(8)), shared_mem=64 << 10)


def test_cublas_outside_an_allocation_is_refused(device):
    from hpengine.device import backend
    cublas = backend.cublas_module()
    a, b, c = (device.zeros((4, 4), dtype=np.float32) for _ in range(3))
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    cublas.sgemmStridedBatched(7, 0, 0, 4, 4, 4, one.ctypes.data, a.data.ptr, 4, 16, b.data.ptr, 4, 16,
                               zero.ctypes.data, c.data.ptr, 4, 16, 1)
    with pytest.raises(AssertionError, match="outside its allocation"):
        cublas.sgemmStridedBatched(7, 0, 0, 4, 4, 4, one.ctypes.data, a.data.ptr, 4, 16, b.data.ptr, 4, 16,
                                   zero.ctypes.data, c.data.ptr, 4, 16, 2)
    with pytest.raises(AssertionError, match="no device allocation"):
        cublas.sgemmStridedBatched(7, 0, 0, 4, 4, 4, one.ctypes.data, one.ctypes.data, 4, 16, b.data.ptr, 4, 16,
                                   zero.ctypes.data, c.data.ptr, 4, 16, 1)


def test_held_bits_go_to_the_gemm_as_they_are(device):
    from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
    from hpengine.nn import Numerics
    rng = np.random.default_rng(0)
    x = device.asarray(rng.normal(size=(6, 5)).astype(np.float32))
    bits = to_bf16_bits(device, device.asarray(rng.normal(size=(7, 5)).astype(np.float32)))
    w = from_bf16_bits(device, bits)
    num = Numerics(bf16=True)
    want = num.matmul(device, x, w.T).get()          # w converted back to bits by a kernel
    before = device.counts["ew:hpengine_to_bf16"]
    num.hold_bits(w, bits)
    try:
        got = num.matmul(device, x, w.T).get()       # the bits themselves, transposed
        part = num.matmul(device, x, w[2:5].T).get()
    finally:
        num.release_bits(w)
    assert not num.held
    assert device.counts["ew:hpengine_to_bf16"] - before == 2  # x only, twice
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(part, want[:, 2:5])
    with pytest.raises(ValueError, match="one shape"):
        num.hold_bits(w, bits[:3])


def _conversions(corpus, monkeypatch, mode: str, together: bool = False, kind: str = "llama") -> tuple:
    """(to_bf16, from_bf16, pack_bf16) launches of the second bf16 step: "none" converts every weight for each
    GEMM, "hold" unpacks the weights and the GEMMs read their bits (Numerics.hold_bits), "bits" (the engine's way)
    hands the linears' weights to the GEMMs as bits, unconverted. together=False: every other tensor of a block
    converted on its own (the engine converts them together, one pack_bf16 a block access); also the losses and
    parameters."""
    from hpengine.models.llama import Llama
    from hpengine.nn import Numerics
    from hpengine.strategies.bf16_storage import UnpackedParams
    if mode != "bits":
        monkeypatch.setattr(Llama, "gemm_weight", lambda self, name: False)
    if mode == "none":
        monkeypatch.setattr(Numerics, "hold_bits", lambda self, values, bits: None)
    if not together:
        init = UnpackedParams.__init__
        monkeypatch.setattr(UnpackedParams, "__init__",
                            lambda self, xp, buf, gw=None, _=(), num=None: init(self, xp, buf, gw, (), num))
    mod = emulated_cupy.install(monkeypatch)
    eng = build(load_config(None, [*TINY, f"data.path={corpus}", "runtime.backend=cupy", *KINDS[kind], *BF16]),
                MPI.COMM_SELF)
    losses = [eng.train_step(0)["loss"]]
    mod.counts.clear()
    losses.append(eng.train_step(1)["loss"])
    out = (mod.counts["ew:hpengine_to_bf16"], mod.counts["ew:hpengine_from_bf16"], mod.counts["raw:pack_bf16_f32"],
           losses, eng.named_params())
    monkeypatch.undo()
    return out


def test_packed_weights_reach_the_gemms_unconverted(small_corpus, monkeypatch):
    # each of the llama's 7 weight matrices per layer and the head's enters two GEMMs a step (forward, and the
    # input gradient's) in two passes (a forward's parameters and a backward's): converted to bits for each GEMM,
    # or unpacked once a pass with the GEMMs reading the bits, or neither
    L = 2
    n = 2 * (7 * L + 1)
    none, hold, bits = (_conversions(small_corpus, monkeypatch, m) for m in ("none", "hold", "bits"))
    assert none[0] - hold[0] == n and none[1] == hold[1]
    assert hold[0] == bits[0] and hold[1] - bits[1] == n


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_blocks_other_tensors_unpack_in_one_launch(small_corpus, monkeypatch, kind):
    """The norms' weights, biases and embeddings a block access reads in float32: one pack_bf16 launch per block
    access holding two or more of them, where one from_bf16 each was; the same values, so the same training bit
    for bit. gpt (2 layers): each layer's forward reads 8 (two norms' weights and biases, four biases), its
    backward the norms' 2 weights; the embedding's forward 2 tables, the head's forward its norm's weight and
    bias, its backward the weight: 7 block accesses, 25 tensors. llama: each layer's 2 norm weights in forward
    and backward; the embedding's table and the head's norm weight stay one conversion each."""
    each = _conversions(small_corpus, monkeypatch, "bits", False, kind)
    one = _conversions(small_corpus, monkeypatch, "bits", True, kind)
    accesses, tensors = {"gpt": (7, 2 * (8 + 2) + 2 + 2 + 1), "llama": (4, 2 * (2 + 2))}[kind]
    assert each[2] == 0 and one[2] == accesses and one[0] == each[0]
    assert each[1] - one[1] == tensors
    assert one[3] == each[3] and all(np.array_equal(one[4][n], each[4][n]) for n in each[4])


def test_the_launch_count_script_runs(capsys, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import emulated_launches
    cfg = Path(__file__).resolve().parents[2] / "configs" / "default.toml"
    assert emulated_launches.main([str(cfg), "--set", "model.n_layers=1", "--set", "model.d_model=32",
                                   "--set", "train.global_batch=2", "--top", "3"], monkeypatch) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"launches per step: (\d+) \((.*)\)", out).group(1))
    parts = re.search(r"launches per step: \d+ \((.*)\)", out).group(1)
    assert total > 0 and total == sum(int(p.split()[1]) for p in parts.split(", "))
    # the host waits for the device twice a step: the loss and the gradient norm, each a float()
    assert "host reads of device arrays per step: 2 (float 2)" in out, out


# the real GPU path (fused kernels and flash kernels on) against NumPy, and the entries it must launch
POINTS = {"gpt": {"gelu_fwd", "gelu_bwd", "layernorm_fwd", "layernorm_bwd", "colsum_part", "colsum_prod_part",
                  "colsum_finish", "xent_fwd", "xent_bwd"},
          "llama": {"rmsnorm_fwd", "rmsnorm_bwd", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd",
                    "colsum_prod_part", "colsum_finish", "xent_fwd", "xent_bwd"}}
STANDARD = {"gpt": {"causal_softmax", "softmax_bwd"}, "llama": {"causal_softmax", "grouped_softmax_bwd"}}
FLASH = {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"}
# under bf16 amp, packed, these write bfloat16 bits (_f32_bf16; _f32_bf16x: the cache too; _f32_bf16o: into a new
# array) or read bits too (_f32_bf16i); flash attention takes bits (its bf16 storage entries), and under it gpt's
# qkv bias gradient sums the bits of dqkv
BITS = {"gelu_fwd": "f32_bf16i", "gelu_bwd": "f32_bf16i", "layernorm_fwd": "f32_bf16x", "rmsnorm_fwd": "f32_bf16x",
        "layernorm_bwd": "f32_bf16i", "rmsnorm_bwd": "f32_bf16i", "colsum_prod_part": "f32_bf16i",
        "swiglu_fwd": "f32_bf16i", "swiglu_bwd": "f32_bf16i", "rope_fwd": "f32_bf16i", "rope_bwd": "f32_bf16",
        "causal_softmax": "f32_bf16",
        "softmax_bwd": "f32_bf16o", "grouped_softmax_bwd": "f32_bf16o"}


def _entries(names, suffix):
    return {f"{n}_{suffix}" for n in names}


FUSED_F64 = {"gpt_standard": ([*KINDS["gpt"]], POINTS["gpt"] | STANDARD["gpt"]),
             "gpt_flash": ([*KINDS["gpt"], "model.attention=flash"], POINTS["gpt"] | FLASH),
             "llama_flash": ([*KINDS["llama"], "model.attention=flash"], POINTS["llama"] | FLASH),
             "llama_moe": ([*KINDS["llama"], *MOE], POINTS["llama"] | STANDARD["llama"])}


@pytest.mark.parametrize("case", list(FUSED_F64))
def test_float64_with_the_kernels_on_trains_like_numpy(small_corpus, device, case):
    extra, must = FUSED_F64[case]
    want = train(small_corpus, "numpy", *extra, "model.dtype=float64")
    got = train(small_corpus, "cupy", *extra, "model.dtype=float64")
    _same(got, want, 1e-10, 1e-12)
    assert _entries(must, "f64") | {"adamw_f64"} <= set(device.launches), sorted(set(device.launches))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("attention", ["standard", "flash"])
def test_float32_with_the_kernels_on_trains_like_numpy(small_corpus, device, kind, attention):
    extra = [*KINDS[kind], "model.dtype=float32", f"model.attention={attention}"]
    want = train(small_corpus, "numpy", *extra)
    got = train(small_corpus, "cupy", *extra)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    # Adam divides each update by the gradient's size: a weight with a tiny gradient moves by lr whatever
    # the last bits of that gradient, so the weights get an absolute tolerance well below lr = 3e-3
    _same(got, want, 1e-4, 2e-5)
    must = POINTS[kind] | (FLASH if attention == "flash" else STANDARD[kind])
    assert _entries(must, "f32") <= set(device.launches), sorted(set(device.launches))


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_flash_with_the_kernels_on_trains_like_numpy(small_corpus, device, kind):
    extra = [*KINDS[kind], *BF16, "model.attention=flash"]
    want = train_amp(small_corpus, "numpy", *extra)
    got = train_amp(small_corpus, "cupy", *extra)
    _same_amp(got, want)
    must = ({f"flash_mma_{op}_bf16_hd64" for op in ("fwd", "bwd_dq", "bwd_dkdv")} | _entries(POINTS[kind] - set(BITS), "f32")
            | {f"{op}_{BITS[op]}" for op in POINTS[kind] & set(BITS)} | ({"colsum_part_f32_bf16i"} if kind == "gpt" else set()))
    assert must <= set(device.launches), sorted(set(device.launches))
    assert not FLASH & {e.rsplit("_", 1)[0] for e in device.launches}


def test_bf16_packed_gradients_on_the_stand_in_device(small_corpus, device, unfused):
    """amp.grad_dtype = "bfloat16" over packed storage (a tied head and two passes a step: scratches opened
    across blocks and accumulated into the bits): the gradients at rest are device bits in half the bytes, and
    training follows NumPy's packed run within float32 sums' order."""
    extra = [*KINDS["gpt"], *BF16, "strategy.amp.grad_dtype=bfloat16", "model.tie_head=true",
             "strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"]
    want = train_amp(small_corpus, "numpy", *extra)
    eng = build(load_config(None, [*TINY, f"data.path={small_corpus}", "runtime.backend=cupy", *extra]), MPI.COMM_SELF)
    _same_amp(train_amp(small_corpus, "cupy", eng=eng), want)
    g = eng.sync.grads.data
    assert isinstance(g, device.ndarray) and g.dtype == np.uint16 and eng.memory()["grad_bytes"] == 2 * g.size
    assert not eng.sync.scratch


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_saved_on_the_device_resumes_on_numpy(small_corpus, device, tmp_path, background):
    """Saved after 2 steps on the stand-in device (synchronously, or by the background writer from pinned host
    snapshots), loaded by a NumPy engine, 2 more steps: the straight 4-step NumPy run (float64, 1e-10)."""
    import logging

    from hpengine.checkpoint import background as bg
    from hpengine.run.train import restore, save_state
    extra = [*KINDS["llama"], "model.dtype=float64"]
    want = train(small_corpus, "numpy", *extra, steps=4)
    cfg = lambda be: load_config(None, [*TINY, f"data.path={small_corpus}", f"runtime.backend={be}", *extra])  # noqa: E731
    eng = build(cfg("cupy"), MPI.COMM_SELF)
    saver = bg.Saver(eng.world, eng.tracer, logging.getLogger("hpengine")) if background else None
    if saver is not None:
        eng.fence_updates(saver.fence)
    for s in range(2):
        eng.train_step(s)
    save_state(eng, tmp_path, 2, keep=1, saver=saver)
    eng.train_step(2)                                   # the next update runs while (or after) the writer works
    if saver is not None:
        saver.wait()
    resumed = build(cfg("numpy"), MPI.COMM_SELF)
    assert restore(resumed, cfg("numpy"), tmp_path) == 2
    got = np.array([resumed.train_step(s)["loss"] for s in (2, 3)]), resumed.named_params()
    _same(got, (want[0][2:], want[1]), 1e-10, 1e-12)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_bf16_product_is_one_cublas_call(small_corpus, device, monkeypatch, kind):
    # operands that arrive as bits (a layer's output, a weight's compute copy, the values) batch over every head in
    # one strided-batched call, as the contiguous conversions did
    from hpengine.nn import bf16_gemm
    real, calls = bf16_gemm._launch, []
    monkeypatch.setattr(bf16_gemm, "_launch", lambda xp, c, *a: calls.append(len(c)) or real(xp, c, *a))
    train(small_corpus, "cupy", *KINDS[kind], *BF16, steps=1)
    assert calls and set(calls) == {1}
