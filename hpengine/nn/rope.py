"""Rotary position embedding, the "rotate half" convention of Hugging Face's Llama: the head dimension
splits into halves (x1, x2) and position t rotates each pair (x1[i], x2[i]) by the angle
t * theta^(-2i/hd):  y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin. Tables are (T, hd/2), or (B, T, hd/2)
read at each row's own positions (packed documents); YaRN (rope scaling) changes the frequencies and scale.
"""
import dataclasses
import math

import numpy as np

from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused
from hpengine.nn.numerics import OFF


# A scale folded into the tables (the
# query's 1/sqrt(hd)) costs nothing.
def rope_tables(xp, T: int, hd: int, theta: float, dtype, scale: float = 1.0, yarn=None):
    """cos and sin (T, hd/2) of every position and frequency, times `scale`, computed in float64; yarn (a YaRN):
    its frequencies, and its attention factor folded into `scale`."""
    if hd % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {hd}")
    if yarn is None:
        inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    else:
        inv, scale = yarn.inv_freq(hd, theta), scale * yarn.attention_factor()
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return (xp.asarray((np.cos(ang) * scale).astype(dtype)), xp.asarray((np.sin(ang) * scale).astype(dtype)))


# The rotation is linear, so backward rotates the gradient by the opposite angle. Forward reads the
# (B, T, H, hd) view of a projection's output and writes head-major (B, H, T, hd) arrays, the layout the
# attention's batched products want; backward turns that around.
def rope_forward(xp, x, cos, sin, num=OFF):
    # x: (B, T, H, hd) (any strides; bfloat16 bits under bf16 amp when a GEMM stored it so) -> y: (B, H, T, hd)
    # contiguous; num (nn/numerics.py): how y is stored for the GEMMs that read it (bits when packed;
    # num.float32_out: as computed)
    B, T, H, hd = x.shape
    bits = num.writes_bits
    if cos.ndim == 2 and fused.usable(xp, cos, sin) and x.dtype in (cos.dtype, xp.uint16):
        y = fused.rope_forward(xp, x, cos[:T], sin[:T], bits=bits and x.dtype == xp.float32)
        return num.store_for_gemm(xp, y)
    x = as_float32(xp, x)
    y = xp.empty((B, H, T, hd), dtype=x.dtype)
    _rotate(xp, x, y.transpose(0, 2, 1, 3), _at(cos, T), _at(sin, T), +1)
    return num.store_for_gemm(xp, y)


def rope_backward(xp, dy, cos, sin, num=OFF):
    # dy: (B, H, T, hd) -> dx: (B, T, H, hd) contiguous (reshapes to the projection's (B, T, H*hd)); num: how dx
    # is stored for the GEMMs that read it (bits when packed; num.float32_out: as computed)
    B, H, T, hd = dy.shape
    dy = as_float32(xp, dy)             # bf16 amp: flash attention's dq, dk may come as bits
    if cos.ndim == 2 and fused.usable(xp, dy, cos, sin):
        dx = fused.rope_backward(xp, dy, cos[:T], sin[:T], bits=num.writes_bits and dy.dtype == xp.float32)
        return num.store_for_gemm(xp, dx)
    dx = xp.empty((B, T, H, hd), dtype=dy.dtype)
    _rotate(xp, dy.transpose(0, 2, 1, 3), dx, _at(cos, T), _at(sin, T), -1)
    return num.store_for_gemm(xp, dx)


def _at(table, T):
    # a table's first T positions as _rotate broadcasts them over (B, T, H, hd/2): (T, 1, hd/2), or per row
    # (B, T, 1, hd/2)
    return table[:T, None, :] if table.ndim == 2 else table[:, :T, None, :]


def _rotate(xp, x, out, c, s, sign):
    # out = R(sign * angle) x on (B, T, H, hd) views; c, s broadcast as (T, 1, hd/2)
    h = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    xp.multiply(x1, c, out=o1)
    xp.multiply(x2, c, out=o2)
    t = x2 * s
    if sign > 0:
        o1 -= t
        xp.multiply(x1, s, out=t)
        o2 += t
    else:
        o1 += t
        xp.multiply(x1, s, out=t)
        o2 -= t



def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its Eq. 21): 0.1 mscale ln(scale) + 1, and 1 when scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# Hugging Face's _compute_yarn_parameters (rope_type "yarn"), in float64: dimension pairs that turn fewer
# than beta_slow times over the original context are interpolated (frequency / factor), those that turn more
# than beta_fast times are kept, and a linear ramp blends the pairs between.
@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN rope scaling (Peng et al. 2023) as Hugging Face computes it; mscale / mscale_all_dim 0 = unset."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def inv_freq(self, hd: int, theta: float) -> np.ndarray:
        """The (hd/2,) inverse frequencies, float64."""
        def correction_dim(rotations):
            return hd * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        if low == high:
            high += 0.001           # no zero-width ramp
        base = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
        keep = 1.0 - np.clip((np.arange(hd // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return base / self.factor * (1.0 - keep) + base * keep

    def attention_factor(self) -> float:
        """The scale of the cos and sin tables: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
        are set, else mscale(factor)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """What multiplies an MLA softmax scale (DeepSeek): mscale(factor, mscale_all_dim)^2, 1 when unset."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


# DeepSeek's checkpoints lay each rotated pair out adjacent, (x0, x1), (x2, x3), ...; Hugging Face's
# apply_rotary_pos_emb_interleave rotates them and writes the halves [evens', odds'], which is rope_forward of
# the de-interleaved input. Backward interleaves rope_backward's result again.
def deinterleave(xp, x):
    # x: (..., hd) -> (..., hd) [x0, x2, ..., x1, x3, ...], a new array
    return xp.concatenate((x[..., 0::2], x[..., 1::2]), axis=-1)


def interleave(xp, x, out=None):
    # x: (..., hd) [evens, odds] -> (..., hd) pairs adjacent again (into out when given)
    h = x.shape[-1] // 2
    out = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    out[..., 0::2] = x[..., :h]
    out[..., 1::2] = x[..., h:]
    return out
