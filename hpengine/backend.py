"""Array backend: NumPy on CPU, CuPy on GPU. The only module that imports cupy.

Everything else asks the Backend for `xp` (the array module), the compute dtype and `sync()`;
host <-> device moves happen only at the edges (data in, metrics and checkpoints out).
"""
from __future__ import annotations

import numpy as np

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


class BackendError(RuntimeError):
    pass


class Backend:
    """Array module + dtype + device of one rank."""

    def __init__(self, name: str, dtype: str, device: int | None = None):
        self.name = name
        self.dtype = np.dtype(DTYPES[dtype])
        self.device = device
        if name == "cupy":
            import cupy  # noqa: PLC0415 - optional dependency, imported only here
            self.xp = cupy
            cupy.cuda.Device(device or 0).use()
        else:
            self.xp = np

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def sync(self) -> None:
        """Wait for queued device work; MPI must not touch a device buffer before this."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, a):
        return self.xp.asnumpy(a) if self.is_gpu else np.asarray(a)

    def to_device(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def zeros(self, n, dtype=None):
        return self.xp.zeros(n, dtype=dtype or self.dtype)


def cupy_usable() -> bool:
    try:
        import cupy  # noqa: PLC0415
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any import/driver failure means "not usable"
        return False


def make_backend(kind: str, dtype: str, local_rank: int = 0) -> Backend:
    """Resolve runtime.backend ('auto' | 'numpy' | 'cupy') to a Backend for this rank."""
    if kind == "numpy":
        return Backend("numpy", dtype)
    if kind == "cupy":
        if not cupy_usable():
            raise BackendError("runtime.backend = 'cupy' but CuPy is not installed or no CUDA device is "
                               "visible; install hpengine[gpu] or use backend = 'numpy' / 'auto'")
        import cupy  # noqa: PLC0415
        return Backend("cupy", dtype, device=local_rank % cupy.cuda.runtime.getDeviceCount())
    if kind == "auto":
        return make_backend("cupy" if cupy_usable() else "numpy", dtype, local_rank)
    raise BackendError(f"runtime.backend = {kind!r}: valid values are 'auto', 'numpy', 'cupy'")
