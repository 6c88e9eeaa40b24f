"""The installation checks of `hpengine doctor`, one Check each: hpengine and its kernel sources, the MPI library
(every rank answering an allreduce), whether MPI takes CUDA device buffers, CuPy and the device, NCCL, and the
CUDA kernels compiling (nvcc or NVRTC, no GPU needed). A check never raises: what went wrong is its detail,
with what would fix it. The device's parity and speed checks are in parity.py and speed.py.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import mpi4py
import numpy as np
from mpi4py import MPI

from hpengine.device import backend, kernels

OK, FAILED, SKIPPED = "ok", "FAILED", "skipped"
ALL_KERNELS = kernels.KERNELS + ("attention", "attention_mma")   # every kernels/*.cu the engine loads
DEFAULT_ARCH = kernels.ARCHS[-1]                                 # compiled for when there is no device


@dataclass(frozen=True)
class Check:
    name: str
    status: str           # OK | FAILED | SKIPPED
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}"


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------------- hpengine

def installation() -> Check:
    """hpengine's version, Python, NumPy, and where the .cu files are found (a missing one fails)."""
    where = f"hpengine {_version('hpengine')}, Python {platform.python_version()}, NumPy {np.__version__}"
    try:
        dirs = sorted({str(kernels.source_path(k).parent) for k in ALL_KERNELS})
    except kernels.KernelError as e:
        return Check("hpengine", FAILED, f"{where}; {e}")
    return Check("hpengine", OK, f"{where}; {len(ALL_KERNELS)} kernel sources in {', '.join(dirs)}")


# ------------------------------------------------------------------------------------------ MPI

def library_name(text: str) -> str:
    """'MPICH Version:      5.0.2\\n...' -> 'MPICH 5.0.2'; 'Open MPI v5.0.3, package: ...' -> 'Open MPI v5.0.3'."""
    first = next((s for s in text.splitlines() if s.strip()), "unknown")
    first = re.sub(r"\s*\b[Vv]ersion\b\s*:?\s*", " ", first, count=1).split(",")[0]
    return " ".join(first.split())[:80] or "unknown"


def mpi(world) -> Check:
    """The library, the standard it implements, and every rank of `world` reaching the others (collective)."""
    try:
        name = library_name(MPI.Get_library_version())
        n, rank = world.Get_size(), world.Get_rank()
        got = world.allreduce(rank)
        nodes = len(set(world.allgather(MPI.Get_processor_name())))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return Check("MPI", FAILED, f"mpi4py {mpi4py.__version__}: {reason(e)}")
    std = "%d.%d" % MPI.Get_version()
    detail = f"{name} (MPI {std}, mpi4py {mpi4py.__version__}); {n} rank{'s' * (n > 1)} on {nodes} node" \
             f"{'s' * (nodes > 1)}"
    if got != n * (n - 1) // 2:
        return Check("MPI", FAILED, f"{detail}: an allreduce of the ranks gave {got}, not {n * (n - 1) // 2}")
    return Check("MPI", OK, detail + " answered an allreduce")


def cuda_support() -> tuple[bool | None, str]:
    """(whether the MPI library takes CUDA device buffers, how that was asked); None when it cannot be asked:
    MPI.Query_cuda_support, MPI 4.1's mpi_memory_alloc_kinds, else MPIX_Query_cuda_support (Open MPI, MPICH)."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query()), "MPI.Query_cuda_support()"
    kinds = MPI.INFO_ENV.Get("mpi_memory_alloc_kinds") or ""
    if "cuda" in kinds:
        return True, f"mpi_memory_alloc_kinds = {kinds!r}"
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        if kinds:
            return False, f"mpi_memory_alloc_kinds = {kinds!r}"
        return None, "the library offers neither MPIX_Query_cuda_support nor mpi_memory_alloc_kinds"
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn()), "MPIX_Query_cuda_support()"


def cuda_aware() -> Check:
    try:
        says, how = cuda_support()
    except Exception as e:  # noqa: BLE001
        return Check("CUDA-aware MPI", FAILED, f"asking the library failed: {reason(e)}")
    if says is None:
        return Check("CUDA-aware MPI", SKIPPED, f"cannot be asked: {how}; runtime.cuda_aware_mpi = 'auto' stages "
                     "device buffers through host memory (set true only for a library known to be CUDA-aware)")
    if says:
        return Check("CUDA-aware MPI", OK, f"yes ({how} says so): runtime.cuda_aware_mpi = 'auto' hands device "
                     "buffers to MPI")
    return Check("CUDA-aware MPI", OK, f"no ({how} = 0): device buffers go through pinned host memory "
                 "(runtime.cuda_aware_mpi = 'auto')")


# ----------------------------------------------------------------------------------------- CUDA

def cupy_or_reason():
    """(the cupy module, '') or (None, why it cannot be used, in a few words)."""
    try:
        return backend.cupy_module(), ""
    except backend.BackendError as e:
        return None, f"CuPy is not importable ({e.__cause__ or e})"


def device():
    """(Check, the cupy module when a device is usable else None): CuPy, the devices, the first one's
    name and architecture, one allocation on it."""
    cp, why = cupy_or_reason()
    if cp is None:
        return Check("CUDA device", SKIPPED, f"{why}: pip install 'hpengine[gpu]' (cupy-cuda13x) on a machine with "
                     "an NVIDIA GPU to check it"), None
    ver = f"CuPy {getattr(cp, '__version__', '?')}"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: the CPU path
        return Check("CUDA device", SKIPPED, f"{ver} sees no CUDA device ({reason(e)})"), None
    if count < 1:
        return Check("CUDA device", SKIPPED, f"{ver} sees no CUDA device"), None
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        arch = f"sm_{props['major']}{props['minor']}"
        cp.zeros(1, dtype=np.float32).sum()
        cp.cuda.Device().synchronize()
    except Exception as e:  # noqa: BLE001 - visible but not usable (exclusive mode, driver mismatch)
        return Check("CUDA device", FAILED, f"{ver} sees {count} device(s) but device 0 is not usable: "
                     f"{reason(e)}"), None
    versions = []
    for what, fn in (("CUDA runtime", "runtimeGetVersion"), ("driver", "driverGetVersion")):
        f = getattr(cp.cuda.runtime, fn, None)
        if f is not None:
            v = f()
            versions.append(f"{what} {v // 1000}.{v % 1000 // 10}")
    return Check("CUDA device", OK, f"{count} device{'s' * (count > 1)}, device 0 {name} ({arch}); "
                 + ", ".join([ver] + versions)), cp


def device_arch(cp) -> str:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return f"sm_{props['major']}{props['minor']}"


def nccl_version(code: int) -> str:
    """NCCL's version code as text: 22703 -> '2.27.3' (NCCL >= 2.9), 2708 -> '2.7.8' (before)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def nccl() -> Check:
    cp, why = cupy_or_reason()
    if cp is None:
        return Check("NCCL", SKIPPED, f"needs CuPy: {why}")
    try:
        mod = backend.nccl_module()
        return Check("NCCL", OK, f"cupy.cuda.nccl, NCCL {nccl_version(int(mod.get_version()))}: "
                     "runtime.collectives = 'nccl' can use it")
    except backend.BackendError as e:
        return Check("NCCL", FAILED, f"{e}; until then runtime.collectives = 'nccl' falls back to MPI")
    except Exception as e:  # noqa: BLE001
        return Check("NCCL", FAILED, f"cupy.cuda.nccl imports but its version cannot be read: {reason(e)}")


def _first_error(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return next((s for s in lines if "error" in s.lower() and not s.startswith("kernel ")),
                lines[0] if lines else "no log")[:200]


def kernels_compile(names, arch: str) -> Check:
    """Compile each named kernels/*.cu for `arch` (nvcc when found, else NVRTC), in parallel."""
    nvcc, nvrtc = kernels.find_nvcc(), kernels.find_nvrtc()
    if nvcc is None and nvrtc is None:
        return Check("kernels compile", SKIPPED, "neither nvcc nor NVRTC found (looked in $CUDA_HOME, $CUDA_PATH, "
                     "/usr/local/cuda, PATH and the nvidia-* wheels): pip install nvidia-cuda-nvrtc or a CUDA "
                     "toolkit to check them here; CuPy compiles them on the GPU anyway")
    compiler, tool = ("nvcc", nvcc) if nvcc else ("nvrtc", nvrtc)
    t0 = time.monotonic()

    def one(name):
        try:
            kernels.compile_check(name, archs=(arch,), compiler=compiler)
            return None
        except kernels.KernelError as e:
            return f"{name}: {_first_error(str(e))}"
        except Exception as e:  # noqa: BLE001 - e.g. an unreadable source
            return f"{name}: {reason(e)}"
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        errors = [e for e in pool.map(one, names) if e]
    took = time.monotonic() - t0
    if errors:
        return Check("kernels compile", FAILED, f"{len(errors)} of {len(names)} failed for {arch} with {compiler}: "
                     + "; ".join(errors))
    return Check("kernels compile", OK, f"{', '.join(names)} for {arch} with {compiler} ({tool}) in {took:.0f} s")
