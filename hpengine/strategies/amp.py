"""Mixed precision: the run's precision policy (Precision: what amp rounds, where) and dynamic loss scaling.
Compute runs in float16 or bfloat16; the owner of each range keeps the float32 master weights and the
optimizer's state.
"""
from __future__ import annotations

import numpy as np

from hpengine.device.precision import round_bf16_
from hpengine.layout.cache import cache_arrays
from hpengine.nn import OFF, Numerics
from hpengine.strategies.bf16_storage import UnpackedParams, pack_cache, unpack_cache
from hpengine.strategies.grad_storage import PLAIN, Bf16Storage


# bfloat16 has float32's exponent range, so it trains without loss scaling by default
# (amp.loss_scaling = "auto").
def loss_scaling(acfg) -> bool:
    """Whether dynamic loss scaling runs: "auto" = float16 only."""
    if acfg.loss_scaling == "auto":
        return acfg.dtype == "float16"
    return acfg.loss_scaling == "dynamic"


# float16's smallest subnormal: under it the scaled loss gradient is 0 in float16, so even the unscaled
# gradients overflow; the scale only gets there when every step overflows (about 40 halvings from 65536)
MIN_SCALE = 2.0 ** -24


# An overflow anywhere makes every rank skip the same step and lower the scale;
# `growth_interval` clean steps in a row raise it again; a scale below MIN_SCALE or `max_skipped` skips in a row is a diverged
# run, which stops.
class LossScaler:
    def __init__(self, acfg):
        self.scale = float(acfg.init_scale)
        self.growth_interval, self.backoff = acfg.growth_interval, acfg.backoff
        self.growth_factor = acfg.growth_factor
        self.max_skipped = acfg.max_skipped
        self.good_steps = 0
        self.skipped = 0
        self.in_a_row = 0            # steps skipped since the last applied one (not saved: it starts at 0)

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after growth_interval clean steps."""
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            self.in_a_row += 1
            return
        self.in_a_row = 0
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def collapsed(self) -> str | None:
        """Why the run has diverged after a skipped step (the scale fell under MIN_SCALE, or max_skipped steps in
        a row overflowed), as the rest of one line after the step; None while it may still recover."""
        if self.scale >= MIN_SCALE and not (self.max_skipped and self.in_a_row >= self.max_skipped):
            return None
        why = (f"strategy.amp.max_skipped = {self.max_skipped}" if self.scale >= MIN_SCALE
               else f"under the floor 2**-24 = {MIN_SCALE:g}")
        return (f"the gradients overflowed on {self.in_a_row} steps in a row (every one skipped) and the loss scale "
                f"fell to {self.scale:g} ({why}): the run has diverged; stopping without saving this model; lower "
                "optim.lr (or raise optim.warmup_steps) and resume from the last checkpoint (--resume latest) or "
                "start over, or train with strategy.amp.dtype = \"bfloat16\"")

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load(self, st: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(st["scale"]), int(st["good_steps"]), int(st["skipped"])


class Precision:
    """The one precision policy of a run: where amp rounds what it stores and how the reduced gradient is
    made ready for the float32 update. With amp off every method is a no-op or a pass-through.

    bfloat16 is stored where a bf16 implementation stores it: a block's output and its caches, its input
    gradient in backward, the compute copy of the parameters and, with amp.grad_dtype = "bfloat16", the
    gradients; each of those but the gradients is rounded here and nowhere else. The values are bfloat16
    values kept in float32 (device/precision.py), except, with `packed` (amp.bf16_storage), the caches and the
    compute copy: the caches are held as bfloat16 bits, 2 bytes an element, from the end of the block's forward
    to the start of its backward, and the compute copy is a flat buffer of bits (uint16; MPI gathers it as it
    is) that the layers read as float32, one block at a time (strategies/bf16_storage.py).

    bfloat16 gradients are bfloat16 values wherever they rest, so a sum of several stages rounds after each:
    after a block's backward (its own tensors and those it reads of other blocks: a tied head's wte), after the
    tied copies' allreduce, after the replicas' (or sharding owners') reduction of each piece, after each dp or
    ep-dp piece's allreduce of the owned range under sharding, and after sequence parallel's sum over tp of the
    replicated tensors (ready_grad). The gradient sync rounds all but the last (its grads_done and reductions,
    through `storage`, the grad_storage policy it is built with), since it alone knows where the gradients are
    stored; packed, they are stored as bfloat16 bits and summed as float32 wire copies (MPI has no bfloat16 sum),
    packing being the rounding."""

    def __init__(self, acfg, amp_on: bool, packed: bool = False):
        self.amp = amp_on
        self.bf16 = amp_on and acfg.dtype == "bfloat16"
        self.packed = self.bf16 and packed
        self.bf16_grads = self.bf16 and acfg.grad_dtype == "bfloat16"
        self.scaler = LossScaler(acfg) if amp_on and loss_scaling(acfg) else None
        # what the layers are handed (the context's num part): bfloat16 GEMM operands under bf16 amp, and,
        # packed, what only GEMMs read written as bfloat16 bits; its held registry is this run's
        self.numerics = Numerics(bf16=True, bits=self.packed) if self.bf16 else OFF
        # how the gradient sync stores the compute copy and the gradients between sums
        grads = ("bits" if self.packed else "rounded") if self.bf16_grads else "float32"
        self.storage = Bf16Storage(self.packed, grads) if self.bf16 else PLAIN

    def master_dtype(self, compute_dtype):
        """The dtype of the owned parameters the optimizer updates: float32 masters under amp."""
        return np.float32 if self.amp else compute_dtype

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def stored_activations_(self, xp, kind: str, h, cache, param_roots: set = frozenset()):
        """A block's output and what it keeps for backward, as bf16 would store them; returns the cache as
        stored. The output h is rounded in place (the next block reads bf16 values); the cache is rounded in
        place too, or, packed, replaced by its bfloat16 bits, leaving out views of parameter storage
        (param_roots: bf16 already, and kept by the buffers anyway). The head's loss math stays float32, as
        Megatron's."""
        if not self.bf16 or kind == "head":
            return cache
        if self.packed:
            if h.dtype == np.float32 and h.ndim:
                round_bf16_(xp, h)
            return pack_cache(xp, cache, param_roots)
        for a in cache_arrays((h, cache)):
            if a.dtype == np.float32 and a.ndim:
                round_bf16_(xp, a)
        return cache

    def unpacked(self, xp, cache):
        """A block's cache as its backward reads it: float32 arrays (packed: converted back, this block only)."""
        return unpack_cache(xp, cache) if self.packed else cache

    def input_grad_(self, xp, d) -> None:
        """A block's input gradient in backward, as bf16 stores it."""
        if self.bf16:
            round_bf16_(xp, d)

    def held_params_(self, xp, arrays) -> None:
        """The compute copy of the parameters a rank holds, as bfloat16 values (after init and loads); bits
        (packed: uint16) are bfloat16 already, written so at init (GradSync.store_params) and by loads."""
        if self.bf16:
            for a in arrays:
                if a is not None and a.dtype == np.float32:
                    round_bf16_(xp, a)

    def layer_params(self, xp, buf, gemm_weight=None, specs=()):
        """What a block's layers read of the parameters buffer `buf` hands out: float32 values (packed: unpacked
        from the bits, for this block access only, the block's tensors (specs) in one conversion; the bits
        themselves for the tensors gemm_weight(name) says only GEMMs read)."""
        if not self.packed:
            return buf
        gemm_weight = gemm_weight or (lambda name: False)
        return UnpackedParams(xp, buf, gemm_weight, tuple(sp.name for sp in specs if not gemm_weight(sp.name)),
                              self.numerics)

    def ready_grad(self, xp, g, all_finite):
        """The reduced owned gradient for the update: float32 and unscaled under amp; None when the loss
        scaler saw an overflow on any rank (`all_finite(local_ok)` agrees on it collectively). bfloat16
        gradients are rounded once more here: sequence parallel's replicated sum over tp comes last."""
        if self.bf16_grads:
            round_bf16_(xp, g)
        if self.scaler is None:
            return g.astype(np.float32) if self.amp and g.dtype != np.float32 else g
        if not all_finite(bool(xp.isfinite(g).all())):
            return None
        g32 = g.astype(np.float32)
        g32 *= 1.0 / self.scaler.scale
        return g32
