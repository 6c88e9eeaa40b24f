"""Checkpoints: resume is bit-exact, and a checkpoint written under one layout loads under any other —
continuing training equals the one-process run straight through (float64, rtol 1e-10)."""
import os

import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run
from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

N_SAVE, N_MORE = 2, 2
DP, SH, PP, TP = "data_parallel", "sharding", "pipeline", "tensor_parallel"
HEADS = ["model.n_heads=4", "model.n_layers=4"]
MODELS = {"gpt": HEADS, "llama": HEADS + LLAMA}


def layout(**degrees):
    o = []
    for name, deg in degrees.items():
        name = {"dp": DP, "sh": SH, "pp": PP, "tp": TP, "stage": None, "part": None}[name] or name
        if name == "stage":
            o.append(f"strategy.sharding.stage={deg}")
        elif name == "part":
            o.append(f"strategy.sharding.partition={deg}")
        else:
            o += [f"strategy.{name}.enable=true", f"strategy.{name}.degree={deg}"]
            if name == PP:
                o.append("strategy.pipeline.micro_batches=2")
    return o


def train_save_load(corpus, world, comm_a, a, comm_b, b, root, model=HEADS):
    """Train N_SAVE steps under layout a, save, load under layout b, train N_MORE; return b's results."""
    if comm_a is not None:
        _, _, eng_a = run(config(corpus, *model, *a), comm_a, steps=N_SAVE)
        save_state(eng_a, root, N_SAVE, keep=2)
    world.Barrier()
    cfg_b = config(corpus, *model, *b)
    eng_b = build(cfg_b, comm_b)
    assert restore(eng_b, cfg_b, root) == N_SAVE
    losses = [eng_b.train_step(s)["loss"] for s in range(N_SAVE, N_SAVE + N_MORE)]
    return losses, eng_b.named_params()


def straight(corpus, model=HEADS):
    l, p, _ = run(config(corpus, *model), MPI.COMM_SELF, steps=N_SAVE + N_MORE)
    return l[N_SAVE:, 0], p


PAIRS = {  # world size -> (layout a, layout b); "one" = one process
    2: [(layout(dp=2), layout(tp=2)), (layout(sh=2, stage=3), "one"), ("one", layout(pp=2)),
        (layout(pp=2), layout(sh=2, stage=2, part="flat"))],
    4: [(layout(dp=4), layout(pp=2, tp=2)), (layout(sh=4, stage=3), layout(dp=2, sh=2, stage=1)),
        (layout(tp=2, pp=2), "one"), ("one", layout(tp=2, sh=2, stage=3, part="flat")),
        (layout(pp=2, tp=2), layout(dp=4))],
    8: [(layout(dp=2, pp=2, tp=2), layout(sh=4, tp=2, stage=3)), (layout(sh=2, pp=2, tp=2, stage=2), "one")],
}


# the llama kind: one pair per world size, every axis touched on one side or the other
LLAMA_PAIRS = {2: [(layout(tp=2), layout(sh=2, stage=3))],
               4: [(layout(tp=2, pp=2), layout(dp=2, sh=2, stage=3, part="flat"))],
               8: [(layout(dp=2, pp=2, tp=2), "one")]}


@pytest.mark.parametrize("kind,pair", [("gpt", i) for i in range(5)] + [("llama", 0)])
def test_reshard(corpus, world, kind, pair, root):
    n = world.Get_size()
    pairs = (PAIRS if kind == "gpt" else LLAMA_PAIRS).get(n, [])
    need(pair < len(pairs), f"no {kind} layout pair {pair} at -n {n}")
    a, b = pairs[pair]
    if a == "one":       # rank 0 writes a one-process checkpoint, the world loads it
        comm_a, a = (MPI.COMM_SELF if world.Get_rank() == 0 else None), []
    else:
        comm_a = world
    if b == "one":       # the world writes, every rank loads it alone
        comm_b, b = MPI.COMM_SELF, []
    else:
        comm_b = world
    losses, params = train_save_load(corpus, world, comm_a, a, comm_b, b, root, MODELS[kind])
    ref_l, ref_p = straight(corpus, MODELS[kind])
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("kind", list(MODELS))
def test_resume_is_bit_exact(corpus, world, root, kind):
    n = world.Get_size()
    lay = layout(dp=2, sh=n // 2, stage=2) if n >= 4 else (layout(sh=n, stage=3) if n > 1 else [])
    if kind == "llama" and n >= 4:
        lay = layout(tp=2, sh=n // 2, stage=3)
    losses, params = train_save_load(corpus, world, world, lay, world, lay, root, MODELS[kind])
    l2, p2, _ = run(config(corpus, *MODELS[kind], *lay), world, steps=N_SAVE + N_MORE)
    assert_same(losses, l2[N_SAVE:, 0], rtol=0)
    assert_same_params(params, p2, rtol=0)
    assert sorted(n for n in os.listdir(root) if n != OWNER) == ["latest", f"step_{N_SAVE:08d}"]
