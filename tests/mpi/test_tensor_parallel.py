"""Tensor parallel and the 4-D mesh train exactly like one process; counted tp traffic equals Megatron's
formula (two allreduces of B·T·C forward and two backward per layer and micro-batch)."""
import numpy as np
import pytest

from helpers import assert_same, assert_same_params, config, need, reference, run

HEADS = ["model.n_heads=4", "model.d_model=16"]
# llama, 8 query heads over 4 key/value heads (head_dim 4), so tp 4 holds one key/value head per rank
LLAMA_TP = ["model.kind=llama", "model.d_model=32", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=48"]
# Adam's update g / (|g| + eps) amplifies an absolute difference in g by lr / eps where |g| is about eps.
# In this model one weight (h.0.attn.o.w[21, 27]) starts with |g| = 1.5e-8: the ~1e-18 rounding difference
# of tp's narrower GEMMs becomes 9e-13 of that weight after the first step, while every other element
# agrees to 4e-17. The absolute floor is raised to 1e-12 for it; the relative check stays 1e-10.
ADAM_FLOOR = {"gpt": 1e-13, "llama": 1e-12}


def tp_cfg(corpus, tp, *extra):
    return config(corpus, *HEADS, "strategy.tensor_parallel.enable=true", f"strategy.tensor_parallel.degree={tp}",
                  *extra)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel(corpus, world, tied, kind):
    n = world.Get_size()
    need(n in (2, 4), "tp = world size needs 2 or 4 ranks")
    model = LLAMA_TP if kind == "llama" else []
    losses, params, eng = run(tp_cfg(corpus, n, *model, f"model.tie_head={str(tied).lower()}"), world)
    ref_l, ref_p, _ = reference(corpus, *HEADS, *model, f"model.tie_head={str(tied).lower()}")
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR[kind])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_padded_vocabulary(corpus, world, kind):
    """vocab 258 over tp 4 pads to 260: padded entries never touch the loss or the gradients."""
    n = world.Get_size()
    need(n == 4, "needs 4 ranks")
    model = LLAMA_TP if kind == "llama" else []
    losses, params, eng = run(tp_cfg(corpus, 4, *model, "model.vocab_size=258"), world)
    assert eng.layout.shapes["wte"][0] == 65
    ref_l, ref_p, _ = reference(corpus, *HEADS, *model, "model.vocab_size=258")
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR[kind])


@pytest.mark.parametrize("other", [
    ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"],
    ["strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2"],
    ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=2"],
    ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=3"],
])
def test_tp2_with_another_axis(corpus, world, other):
    need(world.Get_size() == 4, "tp 2 x another axis of 2 needs 4 ranks")
    losses, params, eng = run(tp_cfg(corpus, 2, *other), world)
    ref_l, ref_p, _ = reference(corpus, *HEADS)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p)


@pytest.mark.parametrize("axis", ["data_parallel", "sharding"])
def test_four_d_mesh(corpus, world, axis):
    need(world.Get_size() == 8, "dp/sharding 2 x pp 2 x tp 2 needs 8 ranks")
    extra = [f"strategy.{axis}.enable=true", f"strategy.{axis}.degree=2",
             "strategy.pipeline.enable=true", "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=2",
             "strategy.pipeline.schedule=1f1b"]
    if axis == "sharding":
        extra.append("strategy.sharding.stage=2")
    losses, params, eng = run(tp_cfg(corpus, 2, *extra), world, steps=3)
    ref_l, ref_p, _ = reference(corpus, *HEADS)
    assert_same(losses, ref_l[:3])
    # reference ran 5 steps; compare parameters after 3 steps with a 3-step reference
    _, ref_p3, _ = run(config(corpus, *HEADS), __import__("mpi4py").MPI.COMM_SELF, steps=3)
    assert_same_params(params, ref_p3)


def test_tp_traffic_formula(corpus, world):
    n = world.Get_size()
    need(n in (2, 4), "needs 2 or 4 ranks")
    cfg = tp_cfg(corpus, n)
    _, _, eng = run(cfg, world, steps=1)
    B, T, C, L = cfg.train.global_batch, cfg.model.seq_len, cfg.model.d_model, cfg.model.n_layers
    item = np.dtype(cfg.model.dtype).itemsize
    per_token_values = (4 * L + 2) * C + 3     # 2 fwd + 2 bwd per layer, embedding fwd, head bwd; loss stats
    act = B * T * per_token_values * item
    norm_bytes = 8 * len(eng.slots)           # the float64 squared-norm vector
    calls, got = eng.mesh.comms["tp"].stats["allreduce"]
    assert got == act + norm_bytes


QK = ["model.qk_norm=true", "model.n_layers=2"]
# q/k norms (model.qk_norm): each tp rank's gradient of the whole (head_dim,) weights is its heads' part,
# summed over tp with and without sequence parallelism; zb1p runs the norms' weight gradients in B
QK_LAYOUTS = {   # name -> (world size, overrides)
    "tp2": (2, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]),
    "tp2_sp": (2, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                   "strategy.tensor_parallel.sequence_parallel=true"]),
    "dp2": (2, ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"]),
    "tp2_sp_pp2_zb1p_flash": (4, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                                  "strategy.tensor_parallel.sequence_parallel=true", "strategy.pipeline.enable=true",
                                  "strategy.pipeline.degree=2", "strategy.pipeline.micro_batches=4",
                                  "strategy.pipeline.schedule=zb1p", "model.attention=flash"]),
}


@pytest.mark.parametrize("name", list(QK_LAYOUTS))
def test_qk_norm_equals_one_process(corpus, world, name):
    n, extra = QK_LAYOUTS[name]
    need(world.Get_size() == n, f"{name} needs {n} ranks")
    losses, params, _ = run(config(corpus, *HEADS, *LLAMA_TP, *QK, *extra), world)
    assert "h.1.attn.q_norm.w" in params
    ref_l, ref_p, _ = reference(corpus, *HEADS, *LLAMA_TP, *QK, *(e for e in extra if e.startswith("model.")))
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR["llama"])
    assert not np.allclose(params["h.1.attn.k_norm.w"], 1.0)      # the norms trained


# heads of their own width (model.head_dim 6 at d_model 32 and 8 heads, not 4): q (32, 48), k and v (32, 24),
# o (48, 32), split over tp by whole heads as before
HD = ["model.head_dim=6", "model.n_layers=2"]
HD_LAYOUTS = {   # name -> (world size, overrides)
    "tp2_qk_norm": (2, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                        "model.qk_norm=true"]),
    "tp2_sp_flash": (2, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                         "strategy.tensor_parallel.sequence_parallel=true", "model.attention=flash"]),
    "tp4": (4, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=4"]),
    "tp2_pp2_zb1p": (4, ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
                         "strategy.pipeline.enable=true", "strategy.pipeline.degree=2",
                         "strategy.pipeline.micro_batches=4", "strategy.pipeline.schedule=zb1p"]),
}


@pytest.mark.parametrize("name", list(HD_LAYOUTS))
def test_head_dim_equals_one_process(corpus, world, name):
    n, extra = HD_LAYOUTS[name]
    need(world.Get_size() == n, f"{name} needs {n} ranks")
    losses, params, eng = run(config(corpus, *HEADS, *LLAMA_TP, *HD, *extra), world)
    tp, i = eng.res.tp, next(n.split(".")[1] for n in eng.layout.shapes if n.endswith(".attn.q.w"))
    assert eng.layout.shapes[f"h.{i}.attn.q.w"] == (32, 48 // tp) and eng.layout.shapes[f"h.{i}.attn.o.w"] == (48 // tp, 32)
    ref_l, ref_p, _ = reference(corpus, *HEADS, *LLAMA_TP, *HD, *(e for e in extra if e.startswith("model.")))
    assert ref_p["h.1.attn.v.w"].shape == (32, 4 * 6)
    assert_same(losses, ref_l)
    assert_same_params(params, ref_p, atol=ADAM_FLOOR["llama"])
