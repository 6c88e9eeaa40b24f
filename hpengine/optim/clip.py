"""Global-norm clipping. Each rank contributes the squared sum of the gradient elements it alone
counts (its owned range); the caller sums these across ranks so every parameter counts exactly once.
"""
from __future__ import annotations

import numpy as np

# float64 copies are made this many elements at a time: a cache-sized scratch vector instead of a
# float64 copy of the whole range (twice its bytes, and page faults on every call).
CHUNK = 1 << 15


def sum_of_squares(xp, g) -> float:
    """Squared L2 norm of a gradient range, accumulated in float64."""
    if xp is not np or g.dtype == np.float64 or g.size <= CHUNK:
        g64 = g.astype(xp.float64, copy=False)
        return float(xp.dot(g64, g64))
    g = g.reshape(-1)
    buf, total = np.empty(CHUNK, dtype=np.float64), 0.0
    for i in range(0, g.size, CHUNK):
        b = buf[:min(CHUNK, g.size - i)]
        b[...] = g[i:i + CHUNK]
        total += float(np.dot(b, b))
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Multiplier for the gradients: 1 when the norm is within max_norm or clipping is off (max_norm 0),
    else max_norm / (norm + 1e-6) (the epsilon as PyTorch's clip_grad_norm_ has it)."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)
