"""Global-norm clipping. Each rank contributes the squared sum of the gradient elements it alone
counts (its owned range); the caller sums these across ranks so every parameter counts exactly once.
"""
from __future__ import annotations


def sum_of_squares(xp, g) -> float:
    """Squared L2 norm of a gradient range, accumulated in float64."""
    return float(xp.dot(g.astype(xp.float64, copy=False), g.astype(xp.float64, copy=False)))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Multiplier for the gradients: min(1, max_norm / norm); 1 when clipping is off (max_norm 0)."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)
