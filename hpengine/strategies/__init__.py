"""Parallel strategies. Each owns one concern; the engine talks to the gradient-sync strategy
through the GradSync interface in base.py."""
from .base import LocalSync
from .data_parallel import DataParallelSync
from .sharding import ShardedSync


def make_grad_sync(cfg, mesh, engine):
    """The gradient/parameter synchronisation for this configuration."""
    sh, dp = mesh.comms["sharding"], mesh.comms["dp"]
    if sh.size > 1:
        s = cfg.strategy.sharding
        return ShardedSync(engine, sh, dp, s.stage, s.partition)
    if dp.size > 1:
        return DataParallelSync(engine, dp)
    return LocalSync(engine)


__all__ = ["LocalSync", "DataParallelSync", "ShardedSync", "make_grad_sync"]
