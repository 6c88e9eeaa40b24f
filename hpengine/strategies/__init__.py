"""Parallel strategies. Each owns one concern; the engine talks to the gradient-sync strategy through
the GradSync protocol in base.py, and hands each strategy the frozen stage description and the
communicators it needs, never itself."""
from hpengine.optim import optimizer_kind
from hpengine.optim.base import TENSORS
from hpengine.strategies.base import GradSync, LocalSync
from hpengine.strategies.data_parallel import DataParallelSync
from hpengine.strategies.grad_storage import PLAIN, PlainStorage
from hpengine.strategies.sharding import ShardedSync
from hpengine.strategies.whole_tensors import WholeTensors


def make_grad_sync(res, stage, backend, comms, storage: PlainStorage = PLAIN) -> GradSync:
    """The gradient/parameter synchronisation for the resolved layout `res` (resolve.Resolved), storing
    parameters and gradients as `storage` (grad_storage.py; the run's from amp.Precision.storage) says. Under
    context parallelism the replicas' sums run over dp x cp (res.grad_group): each cp rank's gradient is its
    part of every sequence's. An optimizer that sees whole tensors gets the division of their work (`whole`)
    over its data-replica group: the sharding ranks, the owned range's replicas (dp x cp; ep-dp for experts) and tp."""
    sh, dp = comms["sharding"], comms[res.grad_group]
    if res.sh > 1:
        sync = ShardedSync(stage, backend, sh, dp, res.zstage, res.partition, comms.get("ep-dp"), storage,
                           res.experts_whole)
    elif dp.size > 1:
        sync = DataParallelSync(stage, backend, dp, res.bucket_mb, comms.get("ep-dp"), storage)
    else:
        sync = LocalSync(stage, backend, storage)
    kind = optimizer_kind(res.optimizer)
    if kind.sees == TENSORS:
        experts = comms.get("ep-dp") if res.ep > 1 else dp
        sharded = (sh, sync.ranges) if res.sh > 1 else (None, None)
        sync.whole = WholeTensors(stage.layout, sync.owned, kind.work, comms["tp"], dp, experts, backend.xp, *sharded,
                                  [s.range for s in stage.slots])
    return sync


__all__ = ["GradSync", "LocalSync", "DataParallelSync", "ShardedSync", "make_grad_sync"]
