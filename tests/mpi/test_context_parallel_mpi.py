"""Context parallelism trains exactly like one process (float64, rtol 1e-10: losses, gradient norms, every
parameter after a few steps): each sequence split over cp ranks in head-tail chunks, attention by the ring
(or the all-gather) for the gpt and llama kinds, standard and flash; alone at cp 2 and 4, and with data
parallel, tensor parallel (plain and sequence parallel), pipelines, sharding stage 3, recompute (full and
selective) and gradient merge, and for a mixture-of-experts llama (dropless; its aux loss counted per whole
sequence) alone, with expert parallel and with sequence parallel; a checkpoint saved under cp loads under one
process and back."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_resumes_like, assert_same, assert_same_params, config, need, run
from hpengine.run.build import build
from hpengine.run.train import save_state

STEPS = 3
S = "strategy."


def on(switch, degree, *more):
    return [f"{S}{switch}.enable=true", f"{S}{switch}.degree={degree}", *more]


def cp(degree, *more):
    return on("context_parallel", degree, *more)


def pp(degree, schedule, m=2, *more):
    return on("pipeline", degree, f"{S}pipeline.schedule={schedule}", f"{S}pipeline.micro_batches={m}", *more)


SEQ16 = ["model.seq_len=16"]        # cp 4 cuts a sequence into 8 chunks: two tokens each
FLASH = ["model.attention=flash"]
SELECTIVE = [S + "recompute.enable=true", S + "recompute.granularity=selective"]
# routed experts (dropless): the aux loss's per-sequence expert counts are summed over the cp ranks
MOE = LLAMA + ["model.n_layers=3", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=12",
               "model.moe.shared_hidden=8", "model.moe.dense_layers=1", "model.moe.aux_loss=0.05",
               "model.moe.z_loss=0.01"]

LAYOUTS = {   # name -> (world size, model overrides, layout overrides)
    "gpt_cp2": (2, [], cp(2)),
    "llama_cp2": (2, LLAMA, cp(2)),
    "gpt_cp2_flash": (2, FLASH, cp(2)),
    "llama_cp2_flash": (2, LLAMA + FLASH, cp(2)),
    "llama_cp2_allgather": (2, LLAMA, cp(2, S + "context_parallel.comm=allgather")),
    "gpt_cp2_allgather_flash": (2, FLASH, cp(2, S + "context_parallel.comm=allgather")),
    "llama_cp2_recompute": (2, LLAMA, cp(2, S + "recompute.enable=true")),
    "gpt_cp2_selective_merge": (2, [], cp(2, *SELECTIVE, S + "gradient_merge.enable=true",
                                         S + "gradient_merge.k_steps=2")),
    "gpt_cp2_dp2": (4, [], cp(2) + on("data_parallel", 2)),
    "llama_cp2_dp2_flash": (4, LLAMA + FLASH, cp(2) + on("data_parallel", 2)),
    "llama_cp2_tp2": (4, LLAMA, cp(2) + on("tensor_parallel", 2)),
    "gpt_cp2_tp2_sp": (4, [], cp(2) + on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")),
    "llama_cp2_pp2_1f1b": (4, LLAMA, cp(2) + pp(2, "1f1b")),
    "gpt_cp2_pp2_zb1p": (4, [], cp(2) + pp(2, "zb1p")),
    "llama_cp2_sh2_stage3": (4, LLAMA, cp(2) + on("sharding", 2, S + "sharding.stage=3")),
    "gpt_cp4": (4, SEQ16, cp(4)),
    "moe_cp2": (2, MOE, cp(2)),
    "gpt_cp2_two_models": (2, ["train.models=2"], cp(2)),
    "moe_cp2_dp2_ep2": (4, MOE, cp(2) + on("data_parallel", 2) + on("expert_parallel", 2)),
    "moe_cp2_tp2_sp": (4, MOE, cp(2) + on("tensor_parallel", 2, S + "tensor_parallel.sequence_parallel=true")),
    "llama_cp4_allgather": (4, LLAMA + SEQ16, cp(4, S + "context_parallel.comm=allgather")),
    "llama_cp2_tp2_pp2": (8, LLAMA, cp(2) + on("tensor_parallel", 2) + pp(2, "1f1b")),
    "gpt_cp2_tp2_sp_pp2_interleaved": (8, ["model.n_layers=4"], cp(2) + on("tensor_parallel", 2,
                                       S + "tensor_parallel.sequence_parallel=true")
                                       + pp(2, "interleaved", 2, S + "pipeline.virtual_stages=2")),
    "llama_cp4_dp2": (8, LLAMA + SEQ16, cp(4) + on("data_parallel", 2)),
    "gpt_cp2_dp2_sh2_stage2": (8, [], cp(2) + on("data_parallel", 2) + on("sharding", 2, S + "sharding.stage=2")),
}
_REF = {}


def reference(corpus, model):
    key = tuple(model)
    if key not in _REF:
        losses, params, eng = run(config(corpus, *model), MPI.COMM_SELF, STEPS)
        _REF[key] = losses, params, eng.grad_norms
    return _REF[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_one_process(corpus, world, name):
    n, model, layout = LAYOUTS[name]
    need(world.Get_size() == n, f"{name} runs at -n {n}")
    ref_l, ref_p, ref_norms = reference(corpus, model)
    losses, params, eng = run(config(corpus, *model, *layout), world, STEPS)
    assert eng.res.cp > 1
    assert_same(losses, ref_l)
    assert_same(eng.grad_norms, ref_norms)
    assert_same_params(params, ref_p)


def test_context_parallel_ring_moves_only_key_value_heads(corpus, world):
    """The ring's sends per step (llama, 4 query heads in 2 key/value groups): per layer forward the k, v
    block and its positions go on cp - 1 times, backward the k, v block cp - 1 times and the dk, dv sums cp
    times; only the K = 2 key/value heads travel."""
    need(world.Get_size() == 2, "runs at -n 2")
    cfg = config(corpus, *LLAMA, *cp(2))
    eng = build(cfg, world)
    cpc = eng.mesh.comms["cp"]
    calls0, sent0 = cpc.stats.get("send", [0, 0])
    eng.train_step(0)
    calls, sent = (a - b for a, b in zip(cpc.stats["send"], (calls0, sent0)))
    c = cfg.model
    B, Tk, K, hd, L = cfg.train.global_batch, c.seq_len // 2, c.n_kv_heads, c.d_model // c.n_heads, c.n_layers
    kv = 2 * B * K * Tk * hd * 8
    assert sent == L * ((kv + 8 * Tk) * 1 + kv * 1 + kv * 2)
    assert calls == L * (2 + 1 + 2)


@pytest.mark.parametrize("cp4", [False, True])
@pytest.mark.parametrize("direction", ["from_cp", "to_cp"])
def test_context_parallel_checkpoint_loads_under_one_process(corpus, world, root, direction, cp4):
    """Parameters are replicated over cp (cp rank 0 saves them): saved under cp 2 x dp 2 or cp 4 (at -n 4;
    cp 2 at -n 2), loaded under one process, and the other way; training goes on as the one-process run
    straight through."""
    n = world.Get_size()
    need(n in (2, 4) and (n == 4 or not cp4), "cp 2 at -n 2, cp 2 x dp 2 and cp 4 at -n 4")
    model = (*LLAMA, *(SEQ16 if cp4 else ()))
    lay = cp(4) if cp4 else (*cp(2), *(on("data_parallel", 2) if n == 4 else ()))
    if direction == "from_cp":
        _, _, eng = run(config(corpus, *model, *lay), world, 2)
        save_state(eng, root, 2, keep=1)
    elif world.Get_rank() == 0:
        _, _, eng = run(config(corpus, *model), MPI.COMM_SELF, 2)
        save_state(eng, root, 2, keep=1)
    world.Barrier()
    straight = run(config(corpus, *model), MPI.COMM_SELF, 4)
    comm, lay = (MPI.COMM_SELF, ()) if direction == "from_cp" else (world, lay)
    assert_resumes_like(config(corpus, *model, *lay), comm, root, straight)
    world.Barrier()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_context_parallel_under_amp_is_within_the_amp_tolerance(corpus, world, dtype):
    """amp at cp 2 against amp in one process (float32 storage): the losses agree within the amp tolerance
    of test_combinations.py (1e-2 relative); the ring's sums run in another order than one rank's."""
    need(world.Get_size() == 2, "cp 2 at -n 2")
    amp = ("model.dtype=float32", S + "amp.enable=true", f"{S}amp.dtype={dtype}")
    losses = run(config(corpus, *LLAMA, *amp, *cp(2)), world, STEPS)[0]
    ref = run(config(corpus, *LLAMA, *amp), MPI.COMM_SELF, STEPS)[0]
    np.testing.assert_allclose(losses, ref, rtol=1e-2)
