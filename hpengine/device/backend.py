"""Array backend: NumPy on CPU, CuPy on GPU. The only module that imports cupy.
Everything else asks the Backend for `xp` (the array module), the compute dtype and `sync()`;
host <-> device moves happen only at the edges (data in, metrics and checkpoints out) and, without a
CUDA-aware MPI, through the pinned host buffers of `HostStaging` around each MPI call.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections import OrderedDict

import numpy as np

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
CUBLAS_TF32_TENSOR_OP_MATH = 3       # cublasMath_t
log = logging.getLogger("hpengine")


class BackendError(RuntimeError):
    pass


class DeviceShareError(BackendError):
    """More ranks on a node than devices, without the explicit setting that allows sharing."""


def cupy_module():
    """The cupy module, or a BackendError saying how to get it."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported only here
    except ImportError as e:
        raise BackendError(f"CuPy is not importable ({e}); install hpengine[gpu] (cupy-cuda13x) on a "
                           "machine with an NVIDIA driver, or use runtime.backend = 'numpy'") from e
    return cupy


def cublas_module():
    """CuPy's thin cuBLAS binding (strided-batched GEMM for hpengine/nn/gemm.py)."""
    cupy_module()
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 - ships with CuPy
    return cublas


def nccl_module():
    """CuPy's NCCL binding (cupy.cuda.nccl), or a BackendError saying how to get it. CuPy loads libnccl from
    the system or from the nvidia-nccl-cu13 wheel; without either the module imports but is not available."""
    cupy_module()
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - ships with CuPy, usable only when libnccl is found
    except ImportError as e:
        raise BackendError(f"CuPy's NCCL binding is not importable ({e}); pip install nvidia-nccl-cu13 "
                           "(or install NCCL on the system)") from e
    if not getattr(nccl, "available", False) or not hasattr(nccl, "get_unique_id"):
        raise BackendError("CuPy found no NCCL library (libnccl.so.2); pip install nvidia-nccl-cu13 "
                           "(or install NCCL on the system)")
    return nccl


class CudaNccl:
    """What dist/nccl.py needs of the device to hand CuPy arrays to NCCL: the nccl module, which arrays
    live on the device, their pointers, the streams NCCL runs on and events on them. A stand-in with the same
    methods lets the CPU tests check which calls go where.

    NCCL runs on a stream of its own, so a gradient bucket's reduction overlaps the backward still being
    queued on the compute stream: each call first waits (on the device) for what the compute stream has
    queued, and a caller that needs the result in order makes the compute stream wait for the call's event
    (join), without blocking the host."""

    def __init__(self, cupy):
        self.cupy = cupy
        self._comm = None

    def module(self):
        return nccl_module()

    def on_device(self, arr) -> bool:
        return not on_host(arr)

    def ptr(self, arr) -> int:
        return arr.data.ptr

    def _event(self, stream):
        ev = self.cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        return ev

    def new_stream(self):
        """A stream of its own (each point-to-point channel's, dist/nccl_p2p.py)."""
        return self.cupy.cuda.Stream(non_blocking=True)

    def stream(self, s=None) -> int:
        """The handle of stream s (default: the collectives' NCCL stream), made to wait first for what the
        compute stream has queued (the buffers' producers, a reused buffer's last reader): no host sync."""
        if s is None:
            if self._comm is None:
                self._comm = self.new_stream()
            s = self._comm
        s.wait_event(self._event(self.cupy.cuda.get_current_stream()))
        return s.ptr

    def record(self, s=None):
        """An event on stream s (default: the collectives' NCCL stream) after the calls queued on it."""
        return self._event(self._comm if s is None else s)

    def join(self, event) -> None:
        """The compute stream waits (on the device) for event: what it queues next sees the call's result."""
        self.cupy.cuda.get_current_stream().wait_event(event)

    def synchronize(self, event) -> None:
        event.synchronize()

    def done(self, event) -> bool:
        return bool(event.done)


def scatter_add(a, indices, values) -> None:
    """a[indices] += values on CuPy arrays, repeated indices summed (GPU atomics)."""
    cupy_module()
    import cupyx  # noqa: PLC0415 - ships with CuPy
    cupyx.scatter_add(a, indices, values)


def on_host(a) -> bool:
    """Whether array a lives in host memory: a NumPy array or scalar that does not export the CUDA array
    interface (CuPy arrays, and device arrays of any library that hands out device pointers, do)."""
    return isinstance(a, (np.ndarray, np.generic)) and not hasattr(a, "__cuda_array_interface__")


def data_ptr(a) -> int:
    """The address of array a's first element: CuPy's data.ptr, or NumPy's array interface."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]


def array_module(a):
    """numpy for NumPy arrays, cupy for CuPy arrays."""
    return np if on_host(a) else cupy_module().get_array_module(a)


class Backend:
    """Array module + dtype + device of one rank, and how its arrays reach MPI."""

    def __init__(self, name: str, dtype: str, device: int | None = None, cuda_aware: bool = False):
        self.name = name
        self.dtype = np.dtype(DTYPES[dtype])
        self.device = device
        self.cuda_aware = cuda_aware
        if name == "cupy":
            cupy = cupy_module()
            self.xp = cupy
            cupy.cuda.Device(device or 0).use()
            self.staging = HostStaging(cupy)
        else:
            self.xp = np
            self.staging = None

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def nccl_device(self) -> CudaNccl:
        """The device side of NCCL calls (dist/nccl.py), or a BackendError when this backend has none."""
        if not self.is_gpu:
            raise BackendError(f"the backend is {self.name}, and NCCL needs CuPy arrays on a GPU")
        return CudaNccl(self.xp)

    def set_matmul_precision(self, precision: str) -> str:
        """runtime.matmul_precision: "tf32" puts this device's cuBLAS handle in TF32 tensor-op math (float32
        GEMMs with TF32 inputs and float32 accumulation, cupy.matmul included); returns what applies."""
        self.matmul_precision = "highest"
        if precision == "tf32" and self.is_gpu:
            cublas = cublas_module()
            cublas.setMathMode(self.xp.cuda.device.get_cublas_handle(), CUBLAS_TF32_TENSOR_OP_MATH)
            self.matmul_precision = "tf32"
        return self.matmul_precision

    def sync(self) -> None:
        """Wait for queued device work; MPI must not touch a device buffer before this."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, a, pinned: bool = False):
        """A NumPy array of `a` (a view on the CPU); pinned=True on a GPU copies into page-locked host memory
        (an asynchronous checkpoint's snapshot, which stays in host memory while it is written)."""
        if not self.is_gpu:
            return np.asarray(a)
        if not pinned:
            return self.xp.asnumpy(a)
        import cupyx  # noqa: PLC0415 - ships with CuPy
        out = cupyx.empty_pinned(a.shape, a.dtype)
        a.get(out=out)
        return out

    def to_device(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def zeros(self, n, dtype=None):
        return self.xp.zeros(n, dtype=dtype or self.dtype)

    def stage_out(self, arr, copy: bool = True):
        """The buffer to hand MPI for arr, after sync(): arr itself (NumPy, or CUDA-aware MPI), else a
        reused pinned host buffer holding arr's values (copy=False: receive-only, contents undefined)."""
        self.sync()
        if not self.is_gpu or self.cuda_aware or on_host(arr):   # host arrays go as they are
            return arr
        return self.staging.stage_out(arr, copy)

    def stage_in(self, host, arr) -> None:
        """After MPI has written into host (from stage_out(arr)), bring the values back into arr."""
        if host is not arr:
            self.staging.stage_in(host, arr)


class HostStaging:
    """Reusable pinned host mirrors of device buffers, for an MPI that cannot read device memory.

    A mirror is keyed by the device buffer (pointer, size, dtype), so buffers in flight at the same
    time (non-blocking collectives on several buckets) never share one; the least recently used are
    dropped past max_bytes (an MPI request still using one keeps it alive through its reference)."""

    def __init__(self, cupy, max_bytes: int = 8 << 30):
        self.cupy, self.max_bytes, self.nbytes = cupy, max_bytes, 0
        self._buffers: OrderedDict = OrderedDict()

    def host_buffer(self, arr):
        key = (int(arr.data.ptr), arr.size, arr.dtype.str)
        host = self._buffers.pop(key, None)
        if host is None:
            mem = self.cupy.cuda.alloc_pinned_memory(max(arr.nbytes, 1))
            host = np.frombuffer(mem, dtype=arr.dtype, count=arr.size)
            self.nbytes += arr.nbytes
            while self._buffers and self.nbytes > self.max_bytes:
                self.nbytes -= self._buffers.popitem(last=False)[1].nbytes
        self._buffers[key] = host
        return host if host.shape == arr.shape else host.reshape(arr.shape)

    def stage_out(self, arr, copy: bool = True):
        if not arr.flags.c_contiguous:
            raise BackendError(f"MPI buffers must be contiguous; got a strided {arr.shape} array")
        host = self.host_buffer(arr)
        if copy:
            arr.get(out=host)
        return host

    def stage_in(self, host, arr) -> None:
        arr.set(host)
        self.cupy.cuda.get_current_stream().synchronize()   # host may be reused by the next MPI call


def keep_heap() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the kernel after every step.

    Each step frees its activations after backward; with glibc's defaults the heap is trimmed and large
    blocks are unmapped, so the next forward page-faults them back in (~19,000 minor faults, ~50 ms per
    step of the reference model, benchmarks/README.md). Keeping the heap (trim threshold 1 GiB, mmap
    threshold 32 MiB) removes that. No effect outside glibc; an explicit MALLOC_* environment wins."""
    if sys.platform != "linux" or os.environ.get("MALLOC_TRIM_THRESHOLD_") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 32 << 20))


def cupy_usable() -> bool:
    try:
        return cupy_module().cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any import/driver failure means "not usable"
        return False


def _probe(device: int) -> None:
    """Make one allocation on the device: a visible but unusable device (exclusive mode taken,
    driver mismatch) fails here rather than in the first layer."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        cupy.zeros(1, dtype=np.float32).sum()
        cupy.cuda.Device(device).synchronize()


def _cupy_backend(dtype, local_rank, local_size, share_devices, cuda_aware) -> Backend:
    count = cupy_module().cuda.runtime.getDeviceCount()
    if local_size > count and not share_devices:
        raise DeviceShareError(f"{local_size} ranks on this node but {count} CUDA device(s): run at most "
                           f"{count} rank(s) per node, or let ranks share devices explicitly "
                           "(runtime.share_devices = true)")
    if local_size > count:
        log.warning("%d ranks share %d CUDA device(s) on this node", local_size, count)
    device = local_rank % count
    _probe(device)
    be = Backend("cupy", dtype, device=device)
    be.cuda_aware = bool(cuda_aware)
    return be


def make_backend(kind: str, dtype: str, local_rank: int = 0, local_size: int = 1,
                 share_devices: bool = False, cuda_aware: bool = False) -> Backend:
    """Resolve runtime.backend ('auto' | 'numpy' | 'cupy') to a Backend for this rank; the device is
    local_rank (from topology.node_ranks) modulo the visible devices. cuda_aware: whether MPI takes this
    GPU's buffers directly (dist.comm.resolve_cuda_aware decides it from runtime.cuda_aware_mpi)."""
    if kind == "numpy":
        return Backend("numpy", dtype)
    if kind == "cupy":
        if not cupy_usable():
            raise BackendError("runtime.backend = 'cupy' but CuPy is not installed or no CUDA device is "
                               "visible; install hpengine[gpu] or use backend = 'numpy' / 'auto'")
        try:
            return _cupy_backend(dtype, local_rank, local_size, share_devices, cuda_aware)
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - a driver/runtime error: say which device and why
            raise BackendError(f"runtime.backend = 'cupy': CUDA device {local_rank} is not usable "
                               f"({type(e).__name__}: {e})") from e
    if kind == "auto":
        if cupy_usable():
            try:
                return make_backend("cupy", dtype, local_rank, local_size, share_devices, cuda_aware)
            except DeviceShareError:
                raise
            except BackendError as e:
                log.warning("runtime.backend = 'auto': using NumPy (%s)", e)
        return Backend("numpy", dtype)
    raise BackendError(f"runtime.backend = {kind!r}: valid values are 'auto', 'numpy', 'cupy'")
