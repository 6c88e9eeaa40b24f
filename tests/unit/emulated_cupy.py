"""A NumPy stand-in for CuPy, so the engine's CuPy code paths run on a CPU: `runtime.backend = "cupy"` with this
module in place of cupy trains through every branch that asks `xp.__name__ == "cupy"`, every RawKernel launch,
every ElementwiseKernel and every cuBLAS call, and the tests hold each against what the real ones require.
This file is the module itself (streams, events, the device, the pool, ElementwiseKernels, install); the arrays
are emulated_arrays.py's, the RawKernel launches emulated_rawkernel.py's, cuBLAS emulated_cublas.py's.

- Device arrays are `DevArray`, a NumPy array that exports `__cuda_array_interface__` (so backend.on_host says
  device) and has CuPy's `.data.ptr`, `.get()` and `.set()`. Mixing one with a host (NumPy) array in a ufunc or
  a module function raises CuPy's TypeError; it does not catch `np.asarray` of a device array.
- cuBLAS (gemmStridedBatchedEx, s/dgemmStridedBatched) runs from the raw pointers, column-major, on the live
  device allocation each pointer falls in; an operand outside every allocation, or reaching past one, fails.
- A RawKernel launch is checked against its entry's C signature, read from the .cu source with its macros
  expanded: pointers are device arrays of the C type, contiguous (or a 4-d view followed by its three element
  strides; rope's input a 4-d view read through the four strides that end its list), outputs not overlapping
  inputs, scalars NumPy scalars of the C type exactly; blocks of 1..1024 threads, grid in range, dynamic shared
  memory within the 48 KiB a launch gets without opting in. Then it runs: AdamW and pack/unpack through their
  NumPy twins, the fused.cu, attention.cu and attention_mma.cu entries through emulators of their C code
  (emulated_fused.py, emulated_flash.py), which take the launch's arguments and grid as the kernel does; an
  entry without an emulator is an error. `empty` and `empty_like` fill floating-point arrays with NaN, so
  output a launch leaves unwritten shows.
- The bf16 ElementwiseKernels run their NumPy twins (device/bf16_bits.py); any other body is refused.
"""
from __future__ import annotations

import sys
import time
import types

import numpy as np
from emulated_arrays import _LIVE, LAUNCHES, MOVED, DevArray, _function, _plain, _poisoned, _refuse_host  # noqa: F401
from emulated_arrays import READS
from emulated_cublas import make_cublas
from emulated_rawkernel import EMULATED, SHARED_DEFAULT, _Module, check_launch, signatures  # noqa: F401

from hpengine.device import bf16_bits, kernels
from hpengine.device.precision import round_bf16_


class _Stream:
    def __init__(self, non_blocking=False, null=False):
        self.ptr = 0 if null else id(self)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.done, self.at = True, time.perf_counter()

    def record(self, stream=None):
        self.at = time.perf_counter()           # work is done when launched: the host clock is the device's

    def synchronize(self):
        pass


class _Device:
    def __init__(self, device=0):
        self.id = int(device or 0)
        self.attributes = {"MultiProcessorCount": 132}
        self.compute_capability = "90"

    def use(self):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Pool:
    def used_bytes(self) -> int:
        return sum(end - start for start, (end, ref) in list(_LIVE.items()) if ref() is not None)

    total_bytes = used_bytes

    def free_all_blocks(self):
        pass


def _elementwise(in_params, out_params, body, name):
    twins = {bf16_bits.TO_BF16_BODY: lambda x: bf16_bits.bf16_bits_numpy(x),
             bf16_bits.FROM_BF16_BODY: lambda b: bf16_bits.from_bf16_bits(np, b),
             bf16_bits.ROUND_BF16_BODY: lambda x: round_bf16_(np, np.array(x, dtype=np.float32, copy=True))}
    if body not in twins:
        raise NotImplementedError(f"the CuPy stand-in has no twin for ElementwiseKernel {name}")

    def run(x, y):
        _refuse_host(name, (x, y))
        LAUNCHES[f"ew:{name}"] += 1
        MOVED[f"ew:{name}"] += x.nbytes + y.nbytes
        y.view(np.ndarray)[...] = twins[body](x.view(np.ndarray))
        return y
    return run


class Cuda(types.SimpleNamespace):
    pass


def make_module() -> types.ModuleType:
    """A fresh stand-in `cupy` module (its launches and cuBLAS calls recorded on it)."""
    mod = types.ModuleType("cupy")
    mod.__name__ = "cupy"
    mod.launches, mod.gemms = [], []
    mod.ndarray = DevArray
    null = _Stream(null=True)
    mod.cuda = Cuda(
        Device=_Device, Stream=_Stream, Event=_Event, get_current_stream=lambda: null,
        get_elapsed_time=lambda e0, e1: (e1.at - e0.at) * 1e3,
        alloc_pinned_memory=lambda n: bytearray(n),
        device=types.SimpleNamespace(get_cublas_handle=lambda: 7),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: (64 << 30, 80 << 30),
                                      getDeviceProperties=lambda d: {"name": b"CuPy stand-in", "major": 9,
                                                                     "minor": 0, "multiProcessorCount": 132,
                                                                     "totalGlobalMem": 80 << 30}))
    pool = _Pool()
    mod.get_default_memory_pool = lambda: pool
    mod.ElementwiseKernel = _elementwise
    mod.RawModule = lambda code=None, **kw: _Module(mod, code)
    mod.asnumpy = lambda a: np.array(_plain(a), copy=True)
    mod.get_array_module = lambda *a: mod
    mod.empty, mod.empty_like = (_function(n, _poisoned(getattr(np, n))) for n in ("empty", "empty_like"))
    rng = np.random.default_rng(0)
    mod.random = types.SimpleNamespace(           # CuPy's take a dtype, as NumPy's Generator does
        standard_normal=_function("standard_normal", lambda size=None, dtype=np.float64:
                                  rng.standard_normal(size, dtype=dtype)),
        random=_function("random", lambda size=None, dtype=np.float64: rng.random(size, dtype=dtype)))
    mod.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
        as_strided=_function("as_strided", np.lib.stride_tricks.as_strided)))

    def attr(name):
        v = getattr(np, name)
        if isinstance(v, type) or not callable(v):
            return v
        f = _function(name, v)
        setattr(mod, name, f)
        return f
    mod.__getattr__ = attr
    return mod


def make_cupyx() -> types.ModuleType:
    mod = types.ModuleType("cupyx")

    def scatter_add(a, indices, values):
        _refuse_host("scatter_add", (a, indices, values))
        LAUNCHES["ufunc:add.at"] += 1
        np.add.at(a.view(np.ndarray), _plain(indices), _plain(values))
    mod.scatter_add = scatter_add
    mod.empty_pinned = lambda shape, dtype=np.float64: np.empty(shape, dtype)
    return mod


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in in place of cupy, cupyx and cuBLAS for one test; returns the cupy stand-in."""
    from hpengine.device import backend
    from hpengine.nn import gemm
    mod = make_module()
    cublas = make_cublas(mod)
    LAUNCHES.clear()
    MOVED.clear()
    READS.clear()
    mod.counts, mod.moved, mod.reads = LAUNCHES, MOVED, READS
    monkeypatch.setattr(backend, "cupy_module", lambda: mod)
    monkeypatch.setattr(backend, "cublas_module", lambda: cublas)
    monkeypatch.setitem(sys.modules, "cupyx", make_cupyx())
    for name in ("_MODULES", "_FUNCS", "_TABLES", "_SMS"):
        monkeypatch.setattr(kernels, name, {})
    monkeypatch.setattr(bf16_bits, "_KERNELS", {})
    gemm._probe.cache_clear()
    return mod
