"""Sequence parallelism trains exactly like one process, alone and beside every other switch; its
counted tp traffic equals the hand count of its collectives. Pipeline sends split across tp (Megatron's
scatter/gather) train the same and send 1/tp of the activation."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import assert_same, assert_same_params, config, need, reference, run

S = "strategy."
HEADS = ["model.n_heads=4", "model.d_model=16"]
LLAMA_TP = ["model.kind=llama", "model.d_model=32", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=48"]
KINDS = {"gpt": [], "llama": LLAMA_TP, "mlp": ["model.kind=mlp"]}
# see test_tensor_parallel.py: one llama weight starts with |g| ~ 1.5e-8, where Adam amplifies rounding
ADAM_FLOOR = {"gpt": 1e-13, "llama": 1e-12, "mlp": 1e-13}


def sp_cfg(corpus, tp, *extra):
    return config(corpus, *HEADS, S + "tensor_parallel.enable=true", f"{S}tensor_parallel.degree={tp}",
                  S + "tensor_parallel.sequence_parallel=true", *extra)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("tied", [False, True])
def test_sequence_parallel(corpus, world, kind, tied):
    n = world.Get_size()
    need(n in (2, 4), "tp = world size needs 2 or 4 ranks")
    extra = [*KINDS[kind], f"model.tie_head={str(tied).lower()}"]
    losses, params, eng = run(sp_cfg(corpus, n, *extra), world, steps=3)
    assert eng.res.sp and eng.ctx.seq.parts == n
    ref_l, ref_p, _ = run(config(corpus, *HEADS, *extra), MPI.COMM_SELF, steps=3)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR[kind])


PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2", S + "pipeline.micro_batches=2"]


@pytest.mark.parametrize("name,other", [
    ("dp", [S + "data_parallel.enable=true", S + "data_parallel.degree=2"]),
    ("pp_1f1b", PP2),
    ("sharding2", [S + "sharding.enable=true", S + "sharding.degree=2", S + "sharding.stage=2"]),
    ("sharding3_tied", [S + "sharding.enable=true", S + "sharding.degree=2", S + "sharding.stage=3",
                        "model.tie_head=true"]),
    ("recompute_merge", [S + "data_parallel.enable=true", S + "recompute.enable=true",
                         S + "gradient_merge.enable=true", S + "gradient_merge.k_steps=2"]),
    ("selective_llama_flash", [S + "data_parallel.enable=true", S + "recompute.enable=true",
                               S + "recompute.granularity=selective", *LLAMA_TP, "model.attention=flash"]),
    ("pp_interleaved_recompute", [*PP2, S + "pipeline.schedule=interleaved", S + "pipeline.virtual_stages=2",
                                  "model.n_layers=4", S + "recompute.enable=true", S + "recompute.every=2"]),
])
def test_sp2_with_another_axis(corpus, world, name, other):
    need(world.Get_size() == 4, "tp 2 x another axis of 2 needs 4 ranks")
    losses, params, eng = run(sp_cfg(corpus, 2, *other), world, steps=3)
    rest = [o for o in other if not o.startswith(S)]
    ref_l, ref_p, _ = run(config(corpus, *HEADS, *rest), MPI.COMM_SELF, steps=3)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR["llama" if "model.kind=llama" in rest else "gpt"])


@pytest.mark.parametrize("name,other", [
    ("tp2_pp2_sharding3_recompute", [*PP2, S + "sharding.enable=true", S + "sharding.stage=3",
                                     S + "recompute.enable=true"]),
    ("tp4_pp2_dp_llama", [*PP2, *LLAMA_TP]),
])
def test_sp_on_eight_ranks(corpus, world, name, other):
    need(world.Get_size() == 8, "needs 8 ranks")
    tp = 4 if name.startswith("tp4") else 2
    extra = other + ([S + "data_parallel.enable=true"] if name.endswith("llama") else [])
    losses, params, eng = run(sp_cfg(corpus, tp, *extra), world, steps=2)
    rest = [o for o in other if not o.startswith(S)]
    ref_l, ref_p, _ = run(config(corpus, *HEADS, *rest), MPI.COMM_SELF, steps=2)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR["llama" if "model.kind=llama" in rest else "gpt"])


def test_sp_traffic_by_hand(corpus, world):
    """One step of the tiny GPT under sequence parallelism, every collective counted at its whole (B, T, C)
    buffer: per layer 2 all-gathers and 2 reduce-scatters forward; backward 2 reduce-scatters and 4
    all-gathers (2 exits, 2 linear inputs gathered again); the embedding 1 reduce-scatter + 1 all-gather;
    the head 2 all-gathers + 1 reduce-scatter; allreduces: the loss's max, its (sum, target) pair, the
    squared norm, and once a step the gradients of the replicated tensors."""
    n = world.Get_size()
    need(n in (2, 4), "needs 2 or 4 ranks")
    cfg = sp_cfg(corpus, n)
    _, _, eng = run(cfg, world, steps=1)
    B, T, C, L = cfg.train.global_batch, cfg.model.seq_len, cfg.model.d_model, cfg.model.n_layers
    act = B * T * C * 8
    st = eng.mesh.comms["tp"].stats
    assert st["allgather"] == [6 * L + 3, (6 * L + 3) * act]
    assert st["reduce_scatter"] == [4 * L + 2, (4 * L + 2) * act]
    replicated = 6 * L * C + 2 * C + T * C          # ln1, ln2 (w, b), attn.proj.b, mlp.proj.b; ln_f; wpe
    assert st["allreduce"] == [4, B * T * 8 * 3 + 8 + replicated * 8]


def test_sp_activations_shrink(corpus, world):
    """The engine's cached bytes per micro-batch under sequence parallelism: the norms' caches, the
    linear inputs and a recomputed layer's input are 1/tp of plain tensor parallelism's (whose layer
    keeps them whole); attention and the MLP's inner activations are split either way."""
    n = world.Get_size()
    need(n == 2, "needs 2 ranks")
    peaks = {}
    for sp in (False, True):
        cfg = config(corpus, *HEADS, S + "tensor_parallel.enable=true", "train.global_batch=2",
                     f"{S}tensor_parallel.sequence_parallel={str(sp).lower()}", S + "recompute.enable=true",
                     S + "recompute.every=2", "model.n_layers=2")
        _, _, eng = run(cfg, world, steps=1)
        peaks[sp] = eng.memory()["activation_peak_bytes"]
    B, T, C = 2, 8, 16
    # layer 1 (not recomputed): layernorm caches of x-hat (T C) and 1/std (T) twice, the qkv and fc inputs
    # (T C each); layer 0 (recomputed) its input (T C); the head's norm (T C + T) and linear input (T C)
    split = B * 8 * (2 * (T * C + T) + 2 * T * C + T * C + (T * C + T) + T * C)
    assert peaks[False] - peaks[True] == split - split // n


@pytest.mark.parametrize("scatter", [True, False])
def test_pipeline_sends_split_across_tp(corpus, world, scatter):
    need(world.Get_size() == 4, "tp 2 x pp 2 needs 4 ranks")
    cfg = config(corpus, *HEADS, S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2", *PP2,
                 f"{S}pipeline.scatter_gather={str(scatter).lower()}")
    losses, params, eng = run(cfg, world, steps=2)
    ref_l, ref_p, _ = run(config(corpus, *HEADS), MPI.COMM_SELF, steps=2)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)
    B, T, C, m = cfg.train.global_batch, cfg.model.seq_len, cfg.model.d_model, 2
    whole = B * T * C * 8                 # one step's activations (or gradients) over one hop; two steps ran
    pp, tp = eng.mesh.comms["pp"].stats, eng.mesh.comms["tp"].stats
    assert pp["send"] == [2 * m, 2 * whole // (2 if scatter else 1)]
    assert tp.get("allgather", [0, 0]) == ([2 * m, 2 * whole] if scatter else [0, 0])   # each piece gathered whole
