"""Pin BLAS/OpenMP threads before the array library loads (stdlib only: shared by the hpengine and the
PyTorch benchmark, which run in different environments)."""
import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def ensure_threads(n: int, script: str) -> None:
    """Re-exec `script` with the thread variables set unless they already are (BLAS reads them at load)."""
    if n <= 0 or all(os.environ.get(v) == str(n) for v in THREAD_VARS):
        return
    env = dict(os.environ, **{v: str(n) for v in THREAD_VARS})
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]], env)
