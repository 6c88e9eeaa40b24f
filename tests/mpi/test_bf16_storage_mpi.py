"""bfloat16 storage in 2 bytes (amp.bf16_storage = "packed": activation caches and the parameters' compute copy as
bfloat16 bits) trains bit for bit like the float32 storage of the same values across ranks: pipeline 1F1B, a
zero-bubble schedule (its W stash holds what backward unpacked), tensor parallelism with sequence parallelism,
and sharding stages 2 and 3 (whose all-gathers move the bits), on 2 ranks. Each rank's packed cache peak is
below the float32 one and equals the planner's prediction; its compute copy takes half the bytes, and so do the
pipeline's sends (bfloat16 bits), as the planner predicts. A checkpoint
saved under one storage continues bit for bit under the other."""
import numpy as np
import pytest

from helpers import LLAMA, config, need, run
from hpengine.planner.model import for_rank
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

S = "strategy."
BF16 = ["model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2"]
SH2 = [S + "sharding.enable=true", S + "sharding.degree=2"]
LAYOUTS = {
    "pp2_1f1b_gpt": PP2 + [S + "pipeline.micro_batches=2"],
    "pp2_zb1p_llama": LLAMA + PP2 + [S + "pipeline.micro_batches=4", S + "pipeline.schedule=zb1p"],
    "tp2_sp_llama": LLAMA + [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2",
                             S + "tensor_parallel.sequence_parallel=true"],
    "sh2_stage2_gpt": SH2 + [S + "sharding.stage=2"],
    "sh2_stage3_llama": LLAMA + SH2 + [S + "sharding.stage=3"],
}


def bf16_config(corpus, name, mode):
    return config(corpus, "runtime.backend=numpy", *BF16, *LAYOUTS[name], S + f"amp.bf16_storage={mode}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_equals_float32_storage(corpus, world, name):
    need(world.Get_size() == 2, "the layouts take 2 ranks")
    out = {mode: run(bf16_config(corpus, name, mode), world, steps=2) for mode in ("float32", "packed")}
    (la, pa, ea), (lb, pb, eb) = out["float32"], out["packed"]
    assert eb.precision.packed and not ea.precision.packed
    assert np.array_equal(la, lb), name
    assert all(pa[n].dtype == pb[n].dtype == np.float32 and np.array_equal(pa[n], pb[n]) for n in pa), name
    assert eb.cache_peak < ea.cache_peak, name
    assert 2 * eb.memory()["param_bytes"] == ea.memory()["param_bytes"], name
    plan = for_rank(eb.cfg, world.Get_size(), eb.mesh.coords)
    pred = plan["memory"]
    assert (eb.cache_peak, eb.memory()["param_bytes"]) == (pred["activations"], pred["params"]), name
    if name.startswith("pp"):       # what crosses stages travels as bfloat16 bits: half the bytes, as planned
        fa, fb = ea.mesh.comms["pp"].stats, eb.mesh.comms["pp"].stats
        assert fb["send"][0] == fa["send"][0] and 2 * fb["send"][1] == fa["send"][1] and fb["recv"] == fb["send"]
        assert fb["send"][1] == 2 * plan["traffic"]["pp"]["send"], name


@pytest.mark.parametrize("name,save,load", [("sh2_stage3_llama", "packed", "float32"),
                                            ("sh2_stage3_llama", "float32", "packed"),
                                            ("sh2_stage2_gpt", "packed", "float32")])
def test_checkpoint_crosses_storage(corpus, world, root, name, save, load):
    """Saved after 2 steps under one storage, loaded under the other, 2 more steps: the straight 4-step run."""
    need(world.Get_size() == 2, "the layouts take 2 ranks")
    want_losses, want_params, _ = run(bf16_config(corpus, name, load), world, steps=4)
    _, _, eng = run(bf16_config(corpus, name, save), world, steps=2)
    save_state(eng, root, 2, keep=2)
    world.Barrier()
    cfg = bf16_config(corpus, name, load)
    resumed = build(cfg, world)
    assert restore(resumed, cfg, root) == 2
    assert resumed.precision.packed == (load == "packed")
    losses = [resumed.train_step(s)["loss"] for s in (2, 3)]
    assert losses == list(want_losses[2:, 0]), (name, save, load)
    got = resumed.named_params()
    assert all(np.array_equal(got[n], want_params[n]) for n in want_params), (name, save, load)
