"""The parallel context (models/context.py) a layout hands its model's blocks: the tensor-parallel part
over the tp communicator, the sequence-parallel split when the layout has one, and the local parts for
what no strategy here distributes yet (the attention's keys and values); experts over ep under expert
parallelism."""
from __future__ import annotations

from hpengine.models.context import LOCAL, Context
from hpengine.strategies.expert_parallel import ExpertParallel
from hpengine.strategies.sequence_parallel import SequenceParallel, SequenceSplit
from hpengine.strategies.tensor_parallel import TensorParallel, TensorParallelSeq


def make_context(res, comms, vocab: int, xp=None) -> Context:
    """The context of this rank for the resolved layout `res` (resolve.Resolved); comms: the mesh's
    communicators by axis ("tp", and "ep" under expert parallelism); vocab: the unpadded vocabulary size;
    xp: the array module (expert parallelism allocates its receive buffers)."""
    ep = ExpertParallel(comms["ep"], xp) if res.ep > 1 else LOCAL.ep
    if res.tp == 1:
        return Context(LOCAL.tp, LOCAL.seq, LOCAL.attn, ep) if res.ep > 1 else LOCAL
    if res.sp:
        return Context(SequenceParallel(comms["tp"], vocab), SequenceSplit(comms["tp"]), LOCAL.attn, ep)
    return Context(TensorParallel(comms["tp"], vocab), TensorParallelSeq(comms["tp"]), LOCAL.attn, ep)
