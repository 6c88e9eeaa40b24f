"""bfloat16 activation caches in 2 bytes (amp.bf16_storage = "packed") train bit for bit like the float32
storage of the same values across ranks: pipeline 1F1B, a zero-bubble schedule (its W stash holds what
backward unpacked) and tensor parallelism with sequence parallelism, on 2 ranks. Each rank's packed cache
peak is below the float32 one and equals the planner's prediction."""
import numpy as np
import pytest

from helpers import LLAMA, config, need, run
from hpengine.planner.model import for_rank

S = "strategy."
BF16 = ["model.dtype=float32", S + "amp.enable=true", S + "amp.dtype=bfloat16"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2"]
LAYOUTS = {
    "pp2_1f1b_gpt": PP2 + [S + "pipeline.micro_batches=2"],
    "pp2_zb1p_llama": LLAMA + PP2 + [S + "pipeline.micro_batches=4", S + "pipeline.schedule=zb1p"],
    "tp2_sp_llama": LLAMA + [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2",
                             S + "tensor_parallel.sequence_parallel=true"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_equals_float32_storage(corpus, world, name):
    need(world.Get_size() == 2, "the layouts take 2 ranks")
    out = {}
    for mode in ("float32", "packed"):
        cfg = config(corpus, "runtime.backend=numpy", *BF16, *LAYOUTS[name], S + f"amp.bf16_storage={mode}")
        out[mode] = run(cfg, world, steps=2)
    (la, pa, ea), (lb, pb, eb) = out["float32"], out["packed"]
    assert eb.precision.packed and not ea.precision.packed
    assert np.array_equal(la, lb), name
    assert all(np.array_equal(pa[n], pb[n]) for n in pa), name
    assert eb.cache_peak < ea.cache_peak, name
    assert eb.cache_peak == for_rank(eb.cfg, world.Get_size(), eb.mesh.coords)["memory"]["activations"], name
