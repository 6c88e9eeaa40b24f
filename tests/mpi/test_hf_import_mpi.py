"""checkpoint.init_from = "hf:DIR" under every layout: rank 0 trains a one-process model (vocabulary 257,
so tensor parallelism pads it), exports it with --format hf; the world loads the folder under tp x pp (or
tp, or one process) and holds exactly the trained parameters, as does a one-process engine loading it. A
Mixtral-shaped model (routed experts, exported as MixtralForCausalLM) loads under expert parallelism: dp 2 x
ep 2, or dp 2 x ep 2 x sharding 2 at stage 3 with the expert blocks sharded."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, config, need, run
from hpengine.checkpoint.export import export
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

MODELS = {"gpt": ["model.n_heads=4", "model.n_layers=4", "model.vocab_size=257"],
          "llama": ["model.n_heads=4", "model.n_layers=4", "model.vocab_size=257", *LLAMA],
          "mixtral": ["model.n_heads=4", "model.n_layers=3", "model.vocab_size=257", *LLAMA, "model.moe.num_experts=4",
                      "model.moe.top_k=2", "model.moe.expert_hidden=12"]}
LAYOUTS = {1: [], 2: ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"],
           4: ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
               "strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2"]}
EP = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2", "strategy.expert_parallel.enable=true",
      "strategy.expert_parallel.degree=2"]
EP_LAYOUTS = {1: [], 2: EP, 4: EP + ["strategy.sharding.enable=true", "strategy.sharding.degree=2",
                                      "strategy.sharding.stage=3"]}


def load(corpus, model, layout, folder, comm):
    cfg = config(corpus, *model, *layout, f"checkpoint.init_from=hf:{folder}")
    eng = build(cfg, comm)
    assert restore(eng, cfg, None) == 0
    return eng.named_params()


@pytest.mark.parametrize("kind", list(MODELS))
def test_hf_init_from_any_layout(corpus, world, root, kind):
    n = world.Get_size()
    layouts = EP_LAYOUTS if kind == "mixtral" else LAYOUTS
    need(n in layouts, f"no layout for -n {n}")
    hf = os.path.join(root, "hf")
    trained = None
    if world.Get_rank() == 0:
        _, trained, eng = run(config(corpus, *MODELS[kind]), MPI.COMM_SELF, steps=2)
        save_state(eng, os.path.join(root, "ckpt"), 2, keep=1)
        export(os.path.join(root, "ckpt"), hf, fmt="hf", note=lambda s: None)
    trained = world.bcast(trained, root=0)
    got = load(corpus, MODELS[kind], layouts[n], hf, world)
    alone = load(corpus, MODELS[kind], [], hf, MPI.COMM_SELF)
    assert sorted(got) == sorted(alone) == sorted(trained)
    for name in trained:
        assert got[name].shape == trained[name].shape, name
        assert np.array_equal(got[name], trained[name]), name
        assert np.array_equal(alone[name], trained[name]), name
