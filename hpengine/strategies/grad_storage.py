"""How a gradient sync stores what it holds, as the run's precision policy (amp.Precision) decides: the compute
copy of the parameters (float values or bfloat16 bits) and the gradients between sums (as computed, rounded to
bfloat16 after each sum, or bfloat16 bits summed through float32 wire copies). The sync calls it where storing
differs and otherwise knows nothing of precision.
"""
from __future__ import annotations

import numpy as np

from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
from hpengine.device.precision import round_bf16_


class PlainStorage:
    """Parameters and gradients stored as computed, in the backend's dtype: every method an identity or a no-op
    (the default: amp off, or amp keeping float32 gradients and float values)."""

    rounds = False      # storing a sum changes it: grads_done and every reduction store their sums again
    encoded = False     # gradients rest in a form MPI cannot sum and the layers cannot accumulate into (see below)

    def param_dtype(self, dtype) -> np.dtype:
        """The dtype of the compute copy of parameters computed in `dtype`."""
        return np.dtype(dtype)

    def params(self, xp, values):
        """The compute copy as stored, from the float values init wrote (these same ones when nothing changes)."""
        return values

    def param_values(self, xp, stored):
        """The compute copy's float values from its stored form (these same ones when stored as values)."""
        return stored

    def grad_dtype(self, dtype) -> np.dtype:
        """The dtype gradients computed in `dtype` rest in."""
        return np.dtype(dtype)

    def round_(self, xp, g) -> None:
        """A sum of float gradients g, in place, as the storage keeps its values."""

    def decode(self, xp, stored):
        """Stored gradients as float32 values, new ones when encoded (a block's scratch, a wire copy, the
        update's view); the syncs decode encoded storage only."""
        return stored

    def encode(self, xp, values, out) -> None:
        """Float32 gradient values written into encoded storage `out` (rounding them to what it can hold)."""
        out[...] = values


PLAIN = PlainStorage()


class Bf16Storage(PlainStorage):
    """bfloat16 amp: with `param_bits` the compute copy is the bits of its bfloat16 values (uint16, 2 bytes a
    parameter; MPI gathers them as they are); gradients "float32" as computed, "rounded" to bfloat16 values after
    every sum, or "bits": stored as their bfloat16 bits (uint16), which MPI cannot sum, so each reduction sums
    float32 copies and stores the result back as bits (encoding is the rounding)."""

    def __init__(self, param_bits: bool, grads: str = "float32"):
        if grads not in ("float32", "rounded", "bits"):
            raise ValueError(f"bfloat16 gradients are float32, rounded or bits, not {grads!r}")
        self.param_bits = param_bits
        self.rounds = grads != "float32"
        self.encoded = grads == "bits"

    def param_dtype(self, dtype) -> np.dtype:
        return np.dtype(np.uint16) if self.param_bits else np.dtype(dtype)

    def params(self, xp, values):
        return to_bf16_bits(xp, values) if self.param_bits else values

    def param_values(self, xp, stored):
        return from_bf16_bits(xp, stored) if self.param_bits else stored

    def grad_dtype(self, dtype) -> np.dtype:
        return np.dtype(np.uint16) if self.encoded else np.dtype(dtype)

    def round_(self, xp, g) -> None:
        if self.rounds:
            round_bf16_(xp, g)

    def decode(self, xp, stored):
        return from_bf16_bits(xp, stored)

    def encode(self, xp, values, out) -> None:
        to_bf16_bits(xp, values, out=out)
