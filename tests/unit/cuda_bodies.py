"""Compiling a CuPy ElementwiseKernel body without CuPy: the body wrapped in a one-element-per-thread __global__
function and built with nvcc for sm_80, for the tests that hold the bfloat16 conversion bodies to compiling
cleanly on the device they are written for."""
from __future__ import annotations

from hpengine.device import kernels


def compile_body(tmp_path, entry: str, params: str, code: str) -> str:
    """nvcc's log of `entry(params, int n)` running `code` for element i < n (code declares and uses the body's
    names); asserts the entry was compiled without a warning."""
    src = tmp_path / f"{entry}.cu"
    src.write_text(f'extern "C" __global__ void {entry}({params}, int n) {{\n'
                   "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n" + code + "}\n")
    log = kernels.compile_check(entry, archs=("sm_80",), path=str(src), compiler="nvcc")["sm_80"]   # raises on failure
    assert f"Compiling entry function '{entry}' for 'sm_80'" in log, log
    assert [line for line in log.splitlines() if "warning" in line.lower()] == [], log
    return log
