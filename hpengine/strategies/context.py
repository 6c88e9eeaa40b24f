"""The parallel context (models/context.py) a layout hands its model's blocks: the tensor-parallel part
over the tp communicator, the sequence-parallel split when the layout has one, experts over ep under expert
parallelism, and under context parallelism the attention over the cp ranks (ring or all-gather) with the
positions of this rank's head-tail part of every sequence; with the precision policy amp hands the layers."""
from __future__ import annotations

from hpengine.models.context import LOCAL, Context
from hpengine.strategies.context_attention import ContextAttention, ContextSeq
from hpengine.strategies.expert_parallel import ExpertParallel
from hpengine.strategies.sequence_parallel import SequenceParallel, SequenceSplit
from hpengine.strategies.tensor_parallel import TensorParallel, TensorParallelSeq


def make_context(res, comms, vocab: int, xp=None, seq_len: int = 0, num=LOCAL.num) -> Context:
    """The context of this rank for the resolved layout `res` (resolve.Resolved); comms: the mesh's
    communicators by axis ("tp", "ep" under expert parallelism, "cp" under context parallelism); vocab: the
    unpadded vocabulary size; xp: the array module (expert parallelism allocates its receive buffers; context
    parallelism keeps its positions there); seq_len: the whole sequence (context parallelism); num: the precision
    policy the layers are handed (strategies/amp.Precision.numerics)."""
    ep = ExpertParallel(comms["ep"], xp) if res.ep > 1 else LOCAL.ep
    if res.tp == 1:
        tp, seq = LOCAL.tp, LOCAL.seq
    elif res.sp:
        tp, seq = SequenceParallel(comms["tp"], vocab), SequenceSplit(comms["tp"])
    else:
        tp, seq = TensorParallel(comms["tp"], vocab), TensorParallelSeq(comms["tp"])
    attn = LOCAL.attn
    if res.cp > 1:
        attn = ContextAttention(comms["cp"], res.cp_comm, seq_len, xp)
        seq = ContextSeq(seq, attn.positions, xp)
    if res.tp == 1 and res.ep == 1 and res.cp == 1 and num is LOCAL.num:
        return LOCAL
    return Context(tp, seq, attn, ep, num)
