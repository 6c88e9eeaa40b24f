"""Parallel strategies. Each owns one concern; the engine talks to the gradient-sync strategy through
the GradSync protocol in base.py, and hands each strategy the frozen stage description and the
communicators it needs, never itself."""
from hpengine.strategies.base import GradSync, LocalSync
from hpengine.strategies.data_parallel import DataParallelSync
from hpengine.strategies.grad_storage import PLAIN, PlainStorage
from hpengine.strategies.sharding import ShardedSync


def make_grad_sync(res, stage, backend, comms, storage: PlainStorage = PLAIN) -> GradSync:
    """The gradient/parameter synchronisation for the resolved layout `res` (resolve.Resolved), storing
    parameters and gradients as `storage` (grad_storage.py; the run's from amp.Precision.storage) says. Under
    context parallelism the replicas' sums run over dp x cp (res.grad_group): each cp rank's gradient is its
    part of every sequence's."""
    sh, dp = comms["sharding"], comms[res.grad_group]
    if res.sh > 1:
        return ShardedSync(stage, backend, sh, dp, res.zstage, res.partition, comms.get("ep-dp"), storage)
    if dp.size > 1:
        return DataParallelSync(stage, backend, dp, res.bucket_mb, comms.get("ep-dp"), storage)
    return LocalSync(stage, backend, storage)


__all__ = ["GradSync", "LocalSync", "DataParallelSync", "ShardedSync", "make_grad_sync"]
