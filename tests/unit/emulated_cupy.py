"""A NumPy stand-in for CuPy, so the engine's CuPy code paths run on a CPU: `runtime.backend = "cupy"` with this
module in place of cupy trains through every branch that asks `xp.__name__ == "cupy"`, every RawKernel launch,
every ElementwiseKernel and every cuBLAS call, and the tests hold each against what the real ones require.

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

import collections
import ctypes
import re
import sys
import time
import types
import weakref
from typing import NamedTuple

import emulated_flash
import emulated_fused
import numpy as np

from hpengine.device import bf16_bits, kernels
from hpengine.device.precision import round_bf16_

SHARED_DEFAULT = 48 << 10
# what the device would have launched, by kind: "raw:<entry>", "ew:<ElementwiseKernel>", "cublas:<call>",
# "ufunc:<name>" (a ufunc call, reduction or scatter), "fn:<name>" (a function that writes a new array),
# "copy" (setitem, copy, astype, fancy indexing); CuPy launches about one kernel for each
LAUNCHES: collections.Counter = collections.Counter()
MOVED: collections.Counter = collections.Counter()      # bytes each ElementwiseKernel read and wrote
NO_KERNEL = {"empty", "empty_like"}
_LIVE: dict = {}                 # start address -> (end address, weakref of the owning buffer)


class Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def copy_from_device_async(self, src, nbytes: int, stream=None):
        """cudaMemcpyAsync device to device, as CuPy's MemoryPointer has it."""
        LAUNCHES["memcpy"] += 1
        ctypes.memmove(self.ptr, src.ptr, nbytes)


def _plain(x):
    if isinstance(x, DevArray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _host(x) -> bool:
    return isinstance(x, np.ndarray) and not isinstance(x, DevArray)


def _refuse_host(what, args, kwargs=None) -> None:
    for a in list(args) + list((kwargs or {}).values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        if any(_host(v) for v in items):
            raise TypeError(f"Unsupported type {np.ndarray} in cupy {what} (a NumPy array mixed with CuPy arrays)")


def _register(a: np.ndarray) -> None:
    """Note the allocation a lives in: the array at the end of its chain of bases (through as_strided's
    DummyArray, which keeps .base) that owns its memory."""
    root, b = None, a
    while b is not None:
        if isinstance(b, np.ndarray) and b.flags.owndata:
            root = b
        b = getattr(b, "base", None)
    if root is None:
        return
    start = root.__array_interface__["data"][0]
    if start in _LIVE and _LIVE[start][1]() is root:
        return
    _LIVE[start] = (start + root.nbytes, weakref.ref(root))
    weakref.finalize(root, _LIVE.pop, start, None)


def _wrap(r):
    if isinstance(r, DevArray):
        return r
    if isinstance(r, np.ndarray):
        return r.view(DevArray) if _in_device_memory(r) else _own(r)
    if isinstance(r, np.generic):               # CuPy's reductions give 0-d arrays
        return _wrap(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _in_device_memory(r: np.ndarray) -> bool:
    """Whether r views memory that belongs to a device array (the result of a view-making function)."""
    b = r.base
    while b is not None:                # through as_strided's DummyArray too (it keeps .base)
        if isinstance(b, DevArray):
            return True
        b = getattr(b, "base", None)
    return False


def _own(r: np.ndarray):
    """A new device array holding r's values that is the root of its storage, as a fresh CuPy array is (its
    base is no array), so code that walks .base to the storage owner finds a device array."""
    d = np.ndarray.__new__(DevArray, r.shape, r.dtype)
    d.view(np.ndarray)[...] = r
    return d


class DevArray(np.ndarray):
    """A device array of the stand-in (host memory that the tests treat as device memory)."""

    def __array_finalize__(self, obj):
        _register(self)                 # every allocation a device array lives in, for the cuBLAS checks

    @property
    def data(self):
        return Ptr(self.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "strides": self.strides, "version": 3,
                "data": (self.__array_interface__["data"][0], False)}

    def __getitem__(self, key):
        r = super().__getitem__(key)
        if isinstance(r, DevArray) and not _in_device_memory(r) and r.base is not None:
            LAUNCHES["copy"] += 1
            return _own(r.view(np.ndarray))     # NumPy's fancy indexing: a subclass view of a host temporary
        return r

    def __setitem__(self, key, value):
        _refuse_host("setitem", (value,))
        LAUNCHES["copy"] += 1
        super().__setitem__(key, value)

    def copy(self, order="C"):
        LAUNCHES["copy"] += 1
        return super().copy(order)

    def astype(self, dtype, *args, **kw):
        r = super().astype(dtype, *args, **kw)
        if r is not self:
            LAUNCHES["copy"] += 1
        return r

    def fill(self, value):
        LAUNCHES["copy"] += 1
        super().fill(value)

    def get(self, stream=None, out=None):
        if out is not None:
            out[...] = self.view(np.ndarray)
            return out
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, arr, stream=None):
        if isinstance(arr, DevArray):
            raise TypeError("set() takes a host array")
        self.view(np.ndarray)[...] = arr

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        _refuse_host(ufunc.__name__, inputs, {"out": kw.get("out", ())})
        outs = kw.get("out")
        if outs:
            kw["out"] = tuple(_plain(o) for o in outs)
        r = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kw)
        LAUNCHES[f"ufunc:{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")] += 1
        if outs:
            return outs[0] if len(outs) == 1 else outs
        return _wrap(r)

    def __array_function__(self, func, types_, args, kwargs):
        _refuse_host(func.__name__, args, kwargs)
        return _counted(func.__name__, _wrap(func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})))


# --------------------------------------------------------------------------------- the cupy module

HOST_IN = {"asarray", "array", "asanyarray"}        # the calls that move host arrays to the device


def _counted(name, r):
    """r, counted as a launch when it is a new array a kernel wrote (not a view, not an empty allocation)."""
    first = r[0] if isinstance(r, (tuple, list)) and r else r
    if isinstance(first, DevArray) and first.base is None and name not in NO_KERNEL:
        LAUNCHES[f"fn:{name}"] += 1
    return r


def _function(name, fn):
    def call(*args, **kw):
        if name not in HOST_IN:
            _refuse_host(name, args, kw)
        return _counted(name, _wrap(fn(*_plain(args), **{k: _plain(v) for k, v in kw.items()})))
    call.__name__ = name
    return call


def _poisoned(make):
    """np.empty or np.empty_like whose floating-point result holds NaN (bfloat16 bits a NaN's): a kernel or
    launcher that leaves part of an output unwritten shows up in the values, not only when the memory's old
    contents happen to differ."""
    def run(*args, **kw):
        a = make(*args, **kw)
        if a.dtype.kind == "f":
            a.fill(np.nan)
        elif a.dtype == np.uint16:
            a.fill(0x7FC0)
        return a
    return run


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


# --------------------------------------------------------------------------------- RawKernel launches

C_DTYPES = {"float": np.float32, "double": np.float64, "unsigned short": np.uint16, "__half": np.float16,
            "half": np.float16, "unsigned char": np.uint8, "long long": np.int64, "int": np.int32}


def _expand(src: str) -> str:
    """The source with its function-like macros expanded once (what the ENTRIES lines instantiate)."""
    lines = [re.sub(r"\s*//.*?(\\?)$", r" \1", ln) for ln in src.splitlines()]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    macros = {m.group(1): ([p.strip() for p in m.group(2).split(",")], m.group(3))
              for m in re.finditer(r"^#define (\w+)\(([^)]*)\)(.*)$", text, re.M)}
    out = []
    for ln in text.splitlines():
        if ln.startswith("#define"):
            continue
        m = re.match(r"^(\w+)\((.*)\)\s*;?\s*$", ln)
        if m and m.group(1) in macros:
            params, body = macros[m.group(1)]
            args = [a.strip() for a in m.group(2).split(",")]
            for p, a in zip(params, args):
                body = re.sub(rf"\b{p}\b", a, body)
            ln = re.sub(r"\s*##\s*", "", body)
        out.append(ln)
    return "\n".join(out)


def signatures(src: str) -> dict:
    """entry -> [(C type, is pointer, is const)] of every extern "C" __global__ entry of a .cu source."""
    sigs = {}
    for m in re.finditer(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)',
                         _expand(src)):
        params = []
        for decl in m.group(2).split(","):
            const = "const" in decl.split()
            words = decl.replace("*", " * ").replace("const", " ").replace("__restrict__", " ").split()[:-1]
            params.append((" ".join(w for w in words if w != "*"), "*" in words, const))
        sigs[m.group(1)] = params
    return sigs


def check_launch(entry, sig, grid, block, args, shared_mem) -> None:
    """One launch against the entry's signature and the launch limits (AssertionError naming what is wrong)."""
    assert len(args) == len(sig), f"{entry}: {len(args)} arguments for {len(sig)} parameters"
    for k, ((ctype, ptr, _), a) in enumerate(zip(sig, args)):
        want = np.dtype(C_DTYPES[ctype])
        if ptr:
            assert isinstance(a, DevArray), f"{entry} argument {k} ({ctype}*): {type(a).__name__}, not a device array"
            ok = a.dtype == want or (ctype == "unsigned short" and a.dtype == np.float16)
            assert ok, f"{entry} argument {k} ({ctype}*): dtype {a.dtype}"
            strided = a.ndim == 4 and [t for t, p, _ in sig[k + 1:k + 4]] == ["long long"] * 3
            if k == 0 and entry.startswith("rope_"):        # read through the four strides that end the list
                assert a.ndim == 4 and tuple(args[-4:]) == tuple(s // a.itemsize for s in a.strides), \
                    f"{entry} argument 0: a {a.shape} view not read through its element strides"
            elif strided:
                assert a.strides[-1] == a.itemsize and \
                    tuple(args[k + 1:k + 4]) == tuple(s // a.itemsize for s in a.strides[:3]), \
                    f"{entry} argument {k}: a {a.shape} view not followed by its element strides"
            else:
                assert a.flags.c_contiguous, f"{entry} argument {k}: a strided {a.shape} array"
        else:
            assert isinstance(a, np.generic) and a.dtype == want, \
                f"{entry} argument {k} ({ctype}): {type(a).__name__} {getattr(a, 'dtype', '')}"
    assert all(isinstance(x, int) and x >= 1 for x in tuple(grid) + tuple(block)), (entry, grid, block)
    assert np.prod(block) <= 1024, (entry, block)
    assert grid[0] < 2**31 and all(g <= 65535 for g in tuple(grid)[1:]), (entry, grid)
    assert 0 <= shared_mem <= SHARED_DEFAULT, f"{entry}: {shared_mem} bytes of dynamic shared memory"


class Launch(NamedTuple):
    grid: tuple
    block: tuple
    shared_mem: int


def _adamw(args, launch):
    p, g, m, v, mask, *rest = args
    copy = rest.pop(0) if isinstance(rest[0], DevArray) else None
    coefs = kernels.AdamWCoefs(*(float(x) for x in rest[1:]))
    kernels.adamw_numpy(*(_plain(a) for a in (p, g, m, v, mask)), coefs, None if copy is None else _plain(copy))


def _copy(op):
    def run(args, launch):
        buf, flat, offsets, _, sizes, _ = (_plain(a) for a in args)
        (kernels.pack_numpy if op == "pack" else kernels.unpack_numpy)(buf, flat, offsets, sizes)
    return run


# entry prefix -> emulator(args, launch); the emulators of fused.cu, attention.cu and attention_mma.cu are keyed
# by their full entry names
PREFIXED = {"adamw_": _adamw, "pack_": _copy("pack"), "unpack_": _copy("unpack")}
EMULATED = {**emulated_fused.EMULATED, **emulated_flash.EMULATED}


def emulator(entry):
    run = EMULATED.get(entry) or next((f for pre, f in PREFIXED.items() if entry.startswith(pre)), None)
    if run is None:
        raise NotImplementedError(f"the CuPy stand-in has no emulator for kernel entry {entry}")
    return run


def _overlap(entry, sig, args) -> None:
    """Outputs do not overlap inputs (the .cu's launch assumptions; in-place entries have no const input
    that is their output)."""
    ins = [a for (_, ptr, const), a in zip(sig, args) if ptr and const]
    for (_, ptr, const), a in zip(sig, args):
        if ptr and not const:
            assert not any(np.shares_memory(a, b) for b in ins), f"{entry}: an output overlaps an input"


class _Kernel:
    def __init__(self, mod, entry, sig):
        self.mod, self.entry, self.sig = mod, entry, sig

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        args = tuple(args)
        check_launch(self.entry, self.sig, tuple(grid), tuple(block), args, shared_mem)
        _overlap(self.entry, self.sig, args)
        self.mod.launches.append(self.entry)
        LAUNCHES[f"raw:{self.entry}"] += 1
        emulator(self.entry)(args, Launch(tuple(grid), tuple(block), shared_mem))


class _Module:
    def __init__(self, mod, code):
        self.mod, self.sigs = mod, signatures(code)

    def compile(self):
        pass

    def get_function(self, entry):
        if entry not in self.sigs:
            raise KeyError(f"no extern \"C\" __global__ {entry} in the module's source")
        return _Kernel(self.mod, entry, self.sigs[entry])


# --------------------------------------------------------------------------------- cuBLAS

def _memory(ptr: int, itemsize: int, lo: int, hi: int, what: str) -> np.ndarray:
    """The elements [lo, hi) from ptr (element offsets) of the live device allocation ptr falls in, as one flat
    array of that allocation (offset 0 = ptr)."""
    for start, (end, ref) in list(_LIVE.items()):
        if ref() is not None and start <= ptr < end:
            assert (ptr - start) % itemsize == 0, f"{what}: pointer {ptr:#x} not aligned to {itemsize} bytes"
            assert start <= ptr + lo * itemsize and ptr + hi * itemsize <= end, \
                f"{what}: elements [{lo}, {hi}) from {ptr:#x} reach outside its allocation [{start:#x}, {end:#x})"
            count = (end - ptr) // itemsize
            ctype = {2: ctypes.c_uint16, 4: ctypes.c_float, 8: ctypes.c_double}[itemsize]
            return np.ctypeslib.as_array((ctype * count).from_address(ptr))
    raise AssertionError(f"{what}: pointer {ptr:#x} is in no device allocation")


def _operand(ptr, itemsize, rows, cols, ld, stride, batch, what):
    assert ld >= max(1, rows), f"{what}: ld {ld} < rows {rows}"
    hi = (rows - 1) + (cols - 1) * ld + (batch - 1) * stride + 1
    flat = _memory(ptr, itemsize, min(0, (batch - 1) * stride), hi, what)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), (stride * itemsize, itemsize, ld * itemsize))


def _gemm(mod, name, transa, transb, m, n, k, alpha, beta, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, isz, conv):
    N = 0
    a = _operand(A, isz[0], *((m, k) if transa == N else (k, m)), lda, sa, batch, f"{name} A")
    b = _operand(B, isz[1], *((k, n) if transb == N else (n, k)), ldb, sb, batch, f"{name} B")
    c = _operand(C, isz[2], m, n, ldc, sc, batch, f"{name} C")
    a, b = conv(a), conv(b)
    a = a if transa == N else a.swapaxes(-1, -2)
    b = b if transb == N else b.swapaxes(-1, -2)
    prod = np.matmul(a, b)
    c[...] = alpha * prod + (beta * c if beta != 0 else 0)
    mod.gemms.append((name, m, n, k, batch))
    LAUNCHES[f"cublas:{name}"] += 1


def make_cublas(mod) -> types.SimpleNamespace:
    f32, f64 = ctypes.c_float, ctypes.c_double

    def ex(handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch, comp, algo):
        from hpengine.nn import bf16_gemm
        assert (at, bt, ct, comp) == (bf16_gemm.CUDA_R_16BF, bf16_gemm.CUDA_R_16BF, bf16_gemm.CUDA_R_32F,
                                      bf16_gemm.CUBLAS_COMPUTE_32F), (at, bt, ct, comp)
        _gemm(mod, "gemmStridedBatchedEx", ta, tb, m, n, k, f32.from_address(alpha).value,
              f32.from_address(beta).value, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, (2, 2, 4),
              lambda x: bf16_bits.from_bf16_bits(np, np.ascontiguousarray(x)))

    def typed(name, ct, isz):
        def run(handle, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
            _gemm(mod, name, ta, tb, m, n, k, ct.from_address(alpha).value, ct.from_address(beta).value,
                  A, lda, sa, B, ldb, sb, C, ldc, sc, batch, (isz,) * 3, lambda x: x)
        return run

    modes = {}           # handle -> math mode (kept, not applied: the products stay float32)
    return types.SimpleNamespace(gemmStridedBatchedEx=ex, sgemmStridedBatched=typed("sgemmStridedBatched", f32, 4),
                                 dgemmStridedBatched=typed("dgemmStridedBatched", f64, 8),
                                 setMathMode=lambda handle, mode: modes.__setitem__(handle, mode),
                                 getMathMode=lambda handle: modes.get(handle, 0))


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in in place of cupy, cupyx and cuBLAS for one test; returns the cupy stand-in."""
    from hpengine.device import backend
    from hpengine.nn import gemm
    mod = make_module()
    cublas = make_cublas(mod)
    LAUNCHES.clear()
    MOVED.clear()
    mod.counts, mod.moved = LAUNCHES, MOVED
    monkeypatch.setattr(backend, "cupy_module", lambda: mod)
    monkeypatch.setattr(backend, "cublas_module", lambda: cublas)
    monkeypatch.setitem(sys.modules, "cupyx", make_cupyx())
    for name in ("_MODULES", "_FUNCS", "_TABLES", "_SMS"):
        monkeypatch.setattr(kernels, name, {})
    monkeypatch.setattr(bf16_bits, "_KERNELS", {})
    monkeypatch.setattr(gemm, "_WORKS", {})
    return mod
