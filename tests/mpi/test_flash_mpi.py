"""model.attention = "flash" under tensor parallel 2 trains like one process with standard attention
(float64, 5 steps: losses, gradient norms and parameters to 1e-10), for gpt, for llama with grouped-query
heads and for deepseek's latent attention (values narrower than queries and keys); tiles of 3 queries and 2 keys
so the 8-token sequences span several of them."""
import numpy as np
import pytest

from helpers import assert_same, assert_same_params, config, need, reference, run
from hpengine.nn import flash

HEADS = ["model.n_heads=4", "model.d_model=16"]
LLAMA = ["model.kind=llama", "model.d_model=32", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=48"]
DEEPSEEK = ["model.kind=deepseek", "model.n_heads=4", "model.ffn_hidden=24", "model.mla.q_lora_rank=5",
            "model.mla.kv_lora_rank=6", "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4",
            "model.mla.v_head_dim=3"]
KINDS = {"gpt": [], "llama": LLAMA, "deepseek": DEEPSEEK}
ADAM_FLOOR = {"gpt": 1e-13, "llama": 1e-12, "deepseek": 1e-12}       # as in test_tensor_parallel.py


@pytest.mark.parametrize("kind", list(KINDS))
def test_flash_tp2_equals_standard_one_process(corpus, world, kind, monkeypatch):
    need(world.Get_size() == 2, "tp 2 = world size needs 2 ranks")
    monkeypatch.setattr(flash, "BQ", 3)
    monkeypatch.setattr(flash, "BK", 2)
    model = HEADS + KINDS[kind]
    losses, params, eng = run(config(corpus, *model, "model.attention=flash", "strategy.tensor_parallel.enable=true",
                                     "strategy.tensor_parallel.degree=2"), world)
    assert eng.slots[0].model.flash and eng.mesh.degrees["tp"] == 2
    ref_l, ref_p, ref = reference(corpus, *model)
    assert not ref.slots[0].model.flash
    assert_same(losses, ref_l)
    assert_same(np.array(eng.grad_norms), np.array(ref.grad_norms))
    assert_same_params(params, ref_p, atol=ADAM_FLOOR[kind])
