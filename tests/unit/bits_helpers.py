"""What the tests of the kernels' bfloat16-bits entries share: device arrays of the CuPy stand-in in and out, and
bfloat16 by ml_dtypes (nearest, ties to even), an oracle independent of the engine's and the stand-in's rounding."""
from __future__ import annotations

import ml_dtypes
import numpy as np


def dev(device, a):
    """a on the stand-in device (contiguous)."""
    return device.asarray(np.ascontiguousarray(a))


def host(a):
    """A stand-in device array's values on the host."""
    return np.asarray(a.get())


def bf16(a):
    """The bfloat16 bits of float32 values, by ml_dtypes."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def values(bits):
    """The float32 values bfloat16 bits hold, by ml_dtypes."""
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def same_bits(bits, f32_out):
    """A bits entry's output (a stand-in device array) equals ml_dtypes' bfloat16 of f32_out (host or device
    float32 values): dtype uint16, f32_out's shape, every element."""
    got = host(bits)
    want = host(f32_out) if hasattr(f32_out, "get") else np.asarray(f32_out)
    assert got.dtype == np.uint16 and got.shape == want.shape
    np.testing.assert_array_equal(got, bf16(want))
