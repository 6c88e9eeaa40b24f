"""The argument check shared by the flash kernels' launch tests: each argument a launcher hands a kernel has
the C type of the entry's signature, and a strided (B, heads, T, hd) tensor is followed by its three element
strides, for the tests that hold flash_cuda's launches against the .cu signatures without a GPU."""
from __future__ import annotations

import numpy as np

# C parameter types of the flash entries -> the NumPy dtype an argument must have
C_TYPES = {"float*": np.float32, "double*": np.float64, "unsigned short*": np.uint16, "float": np.float32,
           "double": np.float64, "long long": np.int64, "int": np.int32, "int*": np.int32}
NULL_OK = ("int*",)         # the optional document ids: a null pointer is 8 zero bytes (flash_cuda.NULL)


def check_args(entry: str, args, sig, same_dtype: bool) -> None:
    """args against signature sig (C type names). same_dtype: pointers must have the C type's dtype exactly (else
    only its item size: a float32 kernel reading bfloat16 bits' twin storage), and flat buffers are checked too."""
    assert len(args) == len(sig), (entry, len(args), sig)
    for k, (ctype, a) in enumerate(zip(sig, args)):
        want = np.dtype(C_TYPES[ctype])
        if ctype in NULL_OK and isinstance(a, np.uint64):
            assert a == 0, (entry, k, ctype, a)
        elif ctype.endswith("*"):
            ok = a.dtype == want if same_dtype else a.dtype.itemsize == want.itemsize
            assert isinstance(a, np.ndarray) and ok, (entry, k, ctype)
            if a.ndim == 4:                                    # a strided tensor: its three strides follow
                assert a.strides[-1] == a.itemsize
                assert tuple(args[k + 1:k + 4]) == tuple(s // a.itemsize for s in a.strides[:3]), (entry, k)
            else:
                assert a.flags.c_contiguous and (same_dtype or a.dtype == want)
        else:
            assert isinstance(a, np.generic) and a.dtype == want, (entry, k, ctype, type(a))
