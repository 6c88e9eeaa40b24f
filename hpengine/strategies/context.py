"""The parallel context (models/context.py) a layout hands its model's blocks: the tensor-parallel part
over the tp communicator, the sequence-parallel split when the layout has one, and the local parts for
what no strategy here distributes yet (the attention's keys and values, experts)."""
from __future__ import annotations

from hpengine.models.context import LOCAL, Context
from hpengine.strategies.sequence_parallel import SequenceParallel, SequenceSplit
from hpengine.strategies.tensor_parallel import TensorParallel


def make_context(res, comms, vocab: int) -> Context:
    """The context of this rank for the resolved layout `res` (resolve.Resolved); comms: the mesh's
    communicators by axis ("tp" used); vocab: the unpadded vocabulary size."""
    if res.tp == 1:
        return LOCAL
    if res.sp:
        return Context(SequenceParallel(comms["tp"], vocab), SequenceSplit(comms["tp"]), LOCAL.attn, LOCAL.ep)
    return Context(TensorParallel(comms["tp"], vocab), LOCAL.seq, LOCAL.attn, LOCAL.ep)
