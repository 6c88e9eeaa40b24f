"""The array backend and what runs on it: NumPy or CuPy (backend.py, the only `import cupy`), the CUDA
kernels and their NumPy twins (kernels.py), bfloat16 rounding (precision.py) and bits (bf16_bits.py), BLAS
thread pools (threads.py).
Exports: Backend, BackendError, make_backend."""
from hpengine.device.backend import Backend, BackendError, make_backend

__all__ = ["Backend", "BackendError", "make_backend"]
