"""Parallel strategies. Each owns one concern; the engine talks to the gradient-sync strategy
through the GradSync interface in base.py."""
from .base import LocalSync

NOT_IMPLEMENTED = {"data_parallel", "sharding", "pipeline", "tensor_parallel", "recompute",
                   "gradient_merge", "amp"}


def make_grad_sync(cfg, mesh, engine):
    """The gradient/parameter synchronisation for this configuration."""
    return LocalSync(engine)


__all__ = ["LocalSync", "make_grad_sync", "NOT_IMPLEMENTED"]
