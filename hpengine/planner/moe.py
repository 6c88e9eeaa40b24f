"""The planner's model of mixture-of-experts layers under expert parallelism (strategies/expert_parallel.py):
the all-to-alls of the routed rows (how many, how many bytes, how long), what a layer keeps of the rows it
received, and the MoE figures the engine adds to the loss allreduce (models/moe_figures.py). The experts'
caches without expert parallelism are the model's own cache_bytes; their split over ep is the layout's."""
from __future__ import annotations

from hpengine.models import build_model, capabilities
from hpengine.planner import recompute as rc


def alltoall_calls(mcfg, st, lay) -> int:
    """MPI_Alltoallv calls of a rank per step: per MoE layer of the stage and micro-batch four (dispatch,
    combine and their backwards), six for a fully recomputed layer, whose forward runs again; four for each
    multi-token prediction module's MoE block, which runs with the head."""
    moe, again = build_model(mcfg).moe, rc.full(st, lay)
    per_mb = sum(6 if b.name in again else 4 for b in st.kinds if b.kind == "layer" and moe.routed(b.layer))
    per_mb += 4 * capabilities(mcfg).mtp_depth * sum(b.kind == "head" for b in st.kinds)
    return per_mb * lay.k * lay.m


def alltoall_bytes(mcfg, st, lay, item: int) -> int:
    """Bytes a rank hands MPI_Alltoallv per step with balanced routing: each call the routed rows (rows x T x
    top_k) of d_model each. The rows a rank sends back depend on the routing; over the ep group the bytes add
    up to exactly ep times this."""
    return alltoall_calls(mcfg, st, lay) * lay.rows * mcfg.seq_len * build_model(mcfg).moe.k * mcfg.d_model * item


def alltoall_seconds(lay, nbytes: float, calls: float, alpha: float, beta: float) -> float:
    """The all-to-alls on the critical path: (ep - 1) / ep of the rows leave the rank, one latency a call."""
    return (lay.ep - 1) / lay.ep * nbytes / beta + calls * alpha


def received_cache(mcfg, rows: int, ep: int, item: int) -> int:
    """Bytes an MoE layer keeps under expert parallelism (ep ranks) beyond its own cache, per micro-batch of `rows`
    sequences: the rows it received (balanced routing: as many as it sent), their regrouping order and the
    exchange's row counts."""
    S = rows * mcfg.seq_len * build_model(mcfg).moe.k
    return S * mcfg.d_model * item + 8 * S + 2 * 8 * ep


def loss_figures(mcfg, models: int = 1) -> int:
    """Values the engine adds to the loss allreduce for an MoE model: the aux and z shares, the selections per
    expert of every layer (of every model when router biases follow them) and, under a capacity, the drops per
    layer (models/moe_figures.py: MoEFigures.values)."""
    if not capabilities(mcfg).experts:
        return 0
    e = mcfg.moe
    loads = models if e.bias_update_rate > 0 else 1
    return 2 + loads * mcfg.n_layers * e.num_experts + (mcfg.n_layers if e.capacity_factor > 0 else 0)
