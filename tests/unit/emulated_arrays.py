"""The CuPy stand-in's device arrays (emulated_cupy.py): DevArray, a NumPy array that exports
__cuda_array_interface__ and has CuPy's .data.ptr, .get() and .set(), refuses to mix with host arrays, and is
counted as the device would launch kernels for it; the registry of live device allocations the cuBLAS checks use.
"""
from __future__ import annotations

import collections
import ctypes
import weakref

import numpy as np

# what the device would have launched, by kind: "raw:<entry>", "ew:<ElementwiseKernel>", "cublas:<call>",
# "ufunc:<name>" (a ufunc call, reduction or scatter), "fn:<name>" (a function that writes a new array),
# "copy" (setitem, copy, astype, fancy indexing); CuPy launches about one kernel for each
LAUNCHES: collections.Counter = collections.Counter()
MOVED: collections.Counter = collections.Counter()      # bytes each bf16 conversion read and wrote (by entry)
# device-to-host reads, each one a wait for the device on a GPU: "get" (a copy to the host), "float", "int",
# "bool", "item" (a 0-d array's value)
READS: collections.Counter = collections.Counter()
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
        READS["get"] += 1
        if out is not None:
            out[...] = self.view(np.ndarray)
            return out
        return np.array(self.view(np.ndarray), copy=True)

    def __float__(self):
        READS["float"] += 1
        return float(self.view(np.ndarray))

    def __int__(self):
        READS["int"] += 1
        return int(self.view(np.ndarray))

    def __bool__(self):
        READS["bool"] += 1
        return bool(self.view(np.ndarray))

    def item(self, *args):
        READS["item"] += 1
        return self.view(np.ndarray).item(*args)

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


