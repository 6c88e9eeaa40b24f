"""The bf16 storage and GEMM-operand policy a layer is handed (`num=`): whether its GEMMs take bfloat16 operands,
how what only GEMMs read of its output is stored (rounded, or bits when packed), and the registry of arrays
whose bfloat16 bits are at hand. OFF is every run without bf16 amp; strategies/amp.py makes the others.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from hpengine.device import backend
from hpengine.device.bf16_bits import to_bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.nn import bf16_gemm


@dataclasses.dataclass(frozen=True, eq=False)
class Numerics:
    """bf16: every GEMM takes bfloat16 operands and sums in float32. bits (packed storage): a layer output that
    only GEMMs read is written as bfloat16 bits (uint16). store: such an output is stored as the GEMMs take it;
    False (float32_out) for a layer whose output a float32 reader takes, its GEMMs still bfloat16. held: data
    pointer of a float32 array -> (that array, its bfloat16 operand), owned by whoever made this policy and
    shared by its float32_out twin."""
    bf16: bool = False
    bits: bool = False
    store: bool = True
    held: dict | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.bf16 and self.held is None:     # each bf16 policy made holds its own registry
            object.__setattr__(self, "held", {})

    @property
    def stores(self) -> bool:
        """Whether a layer output that only GEMMs read is stored as bfloat16 (bits or rounded values)."""
        return self.bf16 and self.store

    @property
    def writes_bits(self) -> bool:
        """Whether such an output is written as bfloat16 bits (uint16)."""
        return self.bf16 and self.bits and self.store

    @property
    def float32_out(self) -> Numerics:
        """This policy for a layer whose output a float32 reader takes: the same GEMMs, the output as computed."""
        return dataclasses.replace(self, store=False) if self.stores else self

    def store_for_gemm(self, xp, y, on: bool = True):
        """y (float32), what only GEMMs, bfloat16-reading kernels and caches read of a layer (its output, or a
        cache the next kernel takes as bits), as bf16 amp stores it: its bfloat16 bits (packed storage), else
        rounded to bfloat16 values in place; y itself when this policy stores nothing in bfloat16, or on=False
        (a caller whose own condition says float32)."""
        if not on or not self.stores or y.dtype != np.float32:
            return y
        return to_bf16_bits(xp, y) if self.bits else round_bf16_(xp, y)

    def matmul(self, xp, a, b, out=None, accumulate=False):
        """out = a @ b (or out += a @ b) with bfloat16 operands and float32 sums (bf16_gemm.matmul), the held
        arrays read as their bits."""
        return bf16_gemm.matmul(xp, a, b, out, accumulate, self.held)

    def product_stored(self, xp, a, b, bias=None):
        """a @ b (+ bias), bfloat16 operands and float32 sums, stored as this policy stores a GEMM output that
        other layers read: its bfloat16 bits (packed; on CuPy cuBLAS writes them), else rounded to bfloat16
        values (float32); float32 when it stores nothing in bfloat16."""
        if xp.__name__ == "cupy" and self.writes_bits:
            return bf16_gemm.product_bits(xp, a, b, bias, self.held)
        y = self.matmul(xp, a, b) if self.bf16 else a @ b
        if bias is not None:
            y += bias
        return self.store_for_gemm(xp, y)

    # A float32 array whose bfloat16 bits are already at hand (a packed parameter, unpacked for one block:
    # strategies/bf16_storage.UnpackedParams) is registered with `hold_bits`: an operand that views it goes in
    # as the same view of those bits (CuPy: no conversion pass; NumPy: no rounded copy, its values are bfloat16
    # already). `held` converts an array once for all the products inside it (a gradient two products read).
    def hold_bits(self, values, bits) -> None:
        """Register float32 `values` (C-contiguous) as holding exactly the bfloat16 values of `bits` (uint16, its
        shape): until release_bits, a GEMM operand in values' memory reads the bits (CuPy) or values themselves,
        already bfloat16 (NumPy). Neither may change while registered (parameters during one block's pass)."""
        if self.held is None:
            raise ValueError("hold_bits: this precision policy has no bfloat16 operands to hold")
        if values.dtype != np.float32 or bits.dtype != np.uint16 or values.shape != bits.shape or \
                not values.flags.c_contiguous:
            raise ValueError(f"hold_bits: C-contiguous float32 values and uint16 bits of one shape, got "
                             f"{values.dtype} {values.shape} and {bits.dtype} {bits.shape}")
        self.held[backend.data_ptr(values)] = (values, values if backend.on_host(values) else bits)

    def release_bits(self, values) -> None:
        if self.held is not None:
            self.held.pop(backend.data_ptr(values), None)

    @contextlib.contextmanager
    def converted(self, xp, *arrays):
        """Inside, the GEMMs take each of these float32 arrays (C-contiguous ones; others as before) as bfloat16
        operands converted once here, however many products read them or their views: none may change inside."""
        reg = self.held if self.bf16 else None
        mine = [] if reg is None else [a for a in arrays if a is not None and a.dtype == np.float32 and a.size
                                       and a.flags.c_contiguous and backend.data_ptr(a) not in reg]
        for a in mine:
            reg[backend.data_ptr(a)] = (a, bf16_gemm.operand_copy(xp, a))
        try:
            yield
        finally:
            for a in mine:
                reg.pop(backend.data_ptr(a), None)


OFF = Numerics()        # no bf16 amp: float GEMMs, every output as computed
