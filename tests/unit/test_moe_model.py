"""The llama kind with routed experts ([model.moe]): the whole model's gradient (the cross-entropy plus the
weighted aux and z losses of every MoE layer) against central finite differences in float64, for the router,
the experts, the shared expert and the dense layers around them; the config's one-line refusals."""
import numpy as np
import pytest
from model_grads import assert_gradient_matches_differences, loss_and_grad

from hpengine.config.load import ConfigError, ModelConfig, MoEConfig, load_config
from hpengine.layout.resolve import resolve
from hpengine.models import build_model
from hpengine.models.context import LOCAL
from hpengine.params.buffers import FlatBuffer, Layout
from hpengine.params.init import init_flat

B, T, V = 2, 8, 40
MOE = dict(num_experts=4, top_k=2, expert_hidden=12, shared_hidden=8, dense_layers=1, aux_loss=0.05, z_loss=0.01)


def model(**moe):
    mc = ModelConfig(kind="llama", vocab_size=V, seq_len=T, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2,
                     ffn_hidden=24, dtype="float64", moe=MoEConfig(**moe))
    m = build_model(mc)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 5)
    P.data[:] += np.random.default_rng(2).standard_normal(P.data.size) * 0.2     # routers far from uniform
    return m, P, lay


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_whole_model_gradient_against_finite_differences(router):
    m, P, lay = model(**MOE, router=router)
    rng = np.random.default_rng(0)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    names = ["h.1.moe.router.w", "h.2.moe.experts.gate.w", "h.1.moe.experts.up.w", "h.2.moe.experts.down.w",
             "h.1.moe.shared.down.w", "h.0.mlp.up.w", "h.2.attn.q.w", "h.1.mlp_norm.w", "wte"]
    assert_gradient_matches_differences(m, P, lay, idx, y, names, rng, picks=6)


def test_balancing_losses_enter_the_loss_with_their_coefficients():
    rng = np.random.default_rng(1)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    base = dict(MOE, aux_loss=0.0, z_loss=0.0)
    m0, P, lay = model(**base)
    l0, _ = loss_and_grad(m0, P, lay, idx, y, grad=False)
    m1, _, _ = model(**dict(base, aux_loss=0.5, z_loss=0.25))
    l1, _ = loss_and_grad(m1, P, lay, idx, y, grad=False)
    h, _ = m1.embed_forward(np, P, idx, LOCAL)
    aux = z = 0.0
    for i in range(m1.n_layers):
        h, c = m1.layer_forward(np, P, i, h, LOCAL, loss=(float(B * T), 1.0))
        st = m1.layer_stats(i, c)
        if st is not None:
            aux, z = aux + st.aux, z + st.z
    assert aux > 0 and z > 0
    assert l1 - l0 == pytest.approx(0.5 * aux + 0.25 * z, rel=1e-12)


def test_dense_layers_keep_the_dense_mlp():
    m, _, _ = model(**MOE)
    names = {s.name for s in m.all_specs()}
    assert "h.0.mlp.gate.w" in names and "h.0.moe.router.w" not in names
    assert {"h.1.moe.router.w", "h.2.moe.experts.down.w", "h.2.moe.shared.up.w"} <= names
    assert "h.1.mlp.gate.w" not in names


@pytest.mark.parametrize("sets,message", [
    (["model.kind=gpt", "model.moe.num_experts=4"], "model.moe applies to model.kind = 'llama'"),
    (["model.kind=llama", "model.moe.num_experts=4", "model.moe.top_k=5"],
     "model.moe.top_k = 5 is more than model.moe.num_experts = 4"),
    (["model.kind=llama", "model.moe.top_k=1"], "model.moe keys are set but model.moe.num_experts = 0"),
    (["model.kind=llama", "model.moe.num_experts=4", "model.moe.dense_layers=4"],
     "model.moe.dense_layers = 4 leaves no MoE layer in model.n_layers = 4"),
])
def test_impossible_moe_configs_are_one_clear_line(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert message in str(e.value) and "\n" not in str(e.value)


EP = ["strategy.expert_parallel.enable=true", "strategy.data_parallel.enable=true"]


@pytest.mark.parametrize("sets,world,message", [
    (["model.kind=llama", "strategy.expert_parallel.degree=2"], 2,
     "strategy.expert_parallel.degree = 2 needs a model with routed experts"),
    (["model.kind=llama", "model.moe.num_experts=6", "strategy.expert_parallel.degree=4"], 4,
     "strategy.expert_parallel.degree = 4 must divide model.moe.num_experts = 6; valid: [1, 2, 3, 6]"),
    (["model.kind=llama", "model.moe.num_experts=8", "strategy.expert_parallel.degree=4",
      "strategy.data_parallel.degree=2", "strategy.pipeline.enable=true", "strategy.pipeline.degree=2"], 4,
     "strategy.expert_parallel.degree = 4 must divide data_parallel x sharding = 2 x 1 = 2 (experts are split "
     "inside those ranks; no extra ranks); valid: [1, 2]"),
    (["model.kind=llama", "model.moe.num_experts=6", "strategy.expert_parallel.degree=3",
      "strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.data_parallel.degree=2"], 4,
     "strategy.expert_parallel.degree = 3 must divide data_parallel x sharding = 2 x 2 = 4 (experts are split "
     "inside those ranks; no extra ranks); valid: [1, 2]"),
    (["model.kind=llama", "model.moe.num_experts=4", "strategy.expert_parallel.degree=4", "optim.name=muon",
      "strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.data_parallel.degree=1"], 4,
     "optim.name = 'muon' with strategy.expert_parallel.degree = 4 across sharding ranks (it does not divide "
     "data_parallel.degree = 1) is not supported; use optim.name = 'adamw' or an ep degree that divides 1"),
])
def test_impossible_expert_parallel_layouts_are_one_clear_line(sets, world, message):
    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, EP + sets), world)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dp,sh,ep,inside", [(2, 2, 2, ("dp",)), (2, 2, 4, ("dp", "sharding")),
                                             (1, 4, 4, ("dp", "sharding")), (1, 4, 2, ("dp", "sharding")),
                                             (4, 2, 2, ("dp",))])
def test_expert_parallel_folds_inside_dp_or_across_sharding(dp, sh, ep, inside):
    """ep folds inside dp when it divides dp (a sharding group shares one expert block, as before); otherwise
    inside dp x sharding, each rank then keeping its expert block whole (experts_whole)."""
    sets = ["model.kind=llama", "model.moe.num_experts=8", f"strategy.expert_parallel.degree={ep}",
            f"strategy.data_parallel.degree={dp}", "strategy.sharding.enable=true", f"strategy.sharding.degree={sh}",
            "train.global_batch=8"]
    res = resolve(load_config(None, EP + sets), dp * sh)
    assert res.degrees.folds == {"ep": (ep, inside, ())}
    assert res.experts_whole == (inside != ("dp",))


def test_expert_parallel_degree_minus_one_takes_every_data_parallel_rank():
    res = resolve(load_config(None, EP + ["model.kind=llama", "model.moe.num_experts=8"]), 4)
    assert (res.dp, res.ep) == (4, 4)


# ------------------------------------------------------------------ capacity and router biases

def routed_caches(m, P, idx, loss=(float(B * T), 1.0)):
    """Each MoE layer's (router input, router weight, its MoE cache) of a forward over idx."""
    h, _ = m.embed_forward(np, P, idx, LOCAL)
    out = {}
    for i in range(m.n_layers):
        h, c = m.layer_forward(np, P, i, h, LOCAL, loss=loss)
        if m.layer_stats(i, c) is not None:
            out[i] = c[-1]
    return h, out


def expected_keep(idx, capacity):
    """The capacity rule by a direct loop: per sequence, tokens in position order, each token's slots in
    rank order; an expert takes an assignment while it holds fewer than `capacity` of the sequence's."""
    keep = np.zeros(idx.shape, dtype=bool)
    for b in range(idx.shape[0] // T):
        taken = {}
        for t in range(b * T, (b + 1) * T):
            for s, e in enumerate(idx[t]):
                keep[t, s] = taken.get(e, 0) < capacity
                taken[e] = taken.get(e, 0) + 1
    return keep


def test_capacity_drops_exactly_the_rule():
    """capacity_factor 0.5, 4 experts, top 2, 8 tokens: capacity ceil(0.5 x 8 x 2 / 4) = 2 per sequence; the
    layer sends exactly the kept (token, slot) pairs to its experts, the selection taken from the per-token
    loop of test_moe_layers.naive_router (not from the code under test)."""
    from test_moe_layers import naive_router
    m, P, _ = model(**MOE, capacity_factor=0.5)
    assert m.moe.capacity == 2
    idx = np.random.default_rng(3).integers(0, V, (B, T))
    _, caches = routed_caches(m, P, idx)
    total = 0
    for i, (c_r, c_e, _, stats) in caches.items():
        chosen = naive_router(c_r[0], P[f"h.{i}.moe.router.w"], 2, T, 1.0, "softmax", True)[0]
        keep = expected_keep(chosen, 2)
        order = c_e[3][1]                               # the dispatched (token, slot) pairs, by expert
        assert sorted(order.tolist()) == [t * 2 + s for t in range(B * T) for s in range(2) if keep[t, s]]
        assert int(stats.dropped) == int((~keep).sum())
        np.testing.assert_array_equal(stats.load, np.bincount(chosen.reshape(-1), minlength=4))   # before drops
        total += int((~keep).sum())
    assert total > 0
    # evaluation (no loss) routes dropless: the output of a model without capacity, bit for bit
    m0, _, _ = model(**MOE)
    h, caches = routed_caches(m, P, idx, loss=None)
    h0, _ = routed_caches(m0, P, idx, loss=None)
    np.testing.assert_array_equal(h, h0)
    assert all(int(c[3].dropped) == 0 for c in caches.values())


def test_whole_model_gradient_with_capacity_and_bias():
    m, P, lay = model(**MOE, capacity_factor=0.5)
    bias = np.zeros((3, 4))
    bias[1], bias[2] = [0.08, -0.05, 0.0, 0.03], [-0.06, 0.0, 0.07, 0.02]
    rng = np.random.default_rng(4)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    loads = [c[3].load.copy() for c in routed_caches(m, P, idx)[1].values()]
    m.moe.set_bias(np, bias)
    caches = routed_caches(m, P, idx)[1]
    assert any((c[3].load != ld).any() for c, ld in zip(caches.values(), loads))      # the bias moved choices
    assert sum(int(c[3].dropped) for c in caches.values()) > 0
    names = ["h.1.moe.router.w", "h.2.moe.router.w", "h.2.moe.experts.up.w", "h.1.moe.experts.down.w",
             "h.1.attn.k.w", "wte"]
    assert_gradient_matches_differences(m, P, lay, idx, y, names, rng, picks=5, nonzero=False)


def test_router_bias_update_by_hand():
    from hpengine.models.moe_bias import RouterBias, RouterBiasError
    models = [model(**MOE, bias_update_rate=0.25)[0] for _ in range(2)]
    rb = RouterBias(models, 0.25, np)
    assert rb.meta() == {}                                  # all zero: nothing to store
    loads = np.zeros((2, 3, 4))
    loads[0, 1], loads[0, 2] = [10, 6, 8, 8], [3, 3, 3, 3]      # mean 8: over, under, even, even; balanced
    loads[1, 1], loads[1, 2] = [0, 16, 8, 8], [1, 2, 3, 6]      # mean 8; mean 3
    rb.update(loads)
    np.testing.assert_array_equal(rb.bias[0], [[0, 0, 0, 0], [-0.25, 0.25, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(rb.bias[1], [[0, 0, 0, 0], [0.25, -0.25, 0, 0], [0.25, 0.25, 0, -0.25]])
    rb.update(loads[::-1])                                   # each model its own loads: model 0 now gets model 1's
    np.testing.assert_array_equal(rb.bias[0], [[0, 0, 0, 0], [0, 0, 0, 0], [0.25, 0.25, 0, -0.25]])
    np.testing.assert_array_equal(rb.bias[1], [[0, 0, 0, 0], [0, 0, 0, 0], [0.25, 0.25, 0, -0.25]])
    assert models[0].moe.bias is not None and "h.0" not in models[0].moe.bias     # the dense layer has none
    np.testing.assert_array_equal(models[1].moe.bias["h.2"], [0.25, 0.25, 0, -0.25])
    # a checkpoint's form and back; the wrong shape is refused in one line
    other = RouterBias([model(**MOE)[0] for _ in range(2)], 0.0, np)
    other.load(rb.meta())
    for a, b in zip(other.bias, rb.bias):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(RouterBiasError) as e:
        RouterBias([models[0]], 0.25, np).load(rb.meta())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sets,message", [
    (["model.moe.capacity_factor=-1"], "model.moe.capacity_factor"),
    (["model.moe.bias_update_rate=-0.1"], "model.moe.bias_update_rate"),
])
def test_negative_routing_settings_are_refused(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.kind=llama", "model.moe.num_experts=4"] + sets)
    assert message in str(e.value) and "must be >= 0" in str(e.value) and "\n" not in str(e.value)


def test_hf_export_refuses_router_biases():
    from hpengine.models import kind_of
    mc = load_config(None, ["model.kind=llama", "model.moe.num_experts=4", "model.moe.bias_update_rate=0.001"]).model
    assert "model.moe.bias_update_rate = 0" in kind_of("llama").hf.export_refusal(mc)
    mc = load_config(None, ["model.kind=llama", "model.moe.num_experts=4", "model.moe.capacity_factor=1.0"]).model
    assert kind_of("llama").hf.export_refusal(mc) == ""     # capacity is a training rule: inference is dropless


def test_engine_step_updates_the_biases_from_the_batch_loads(tmp_path):
    """One engine step on one process: the biases become rate x sign(mean - load) of the selections the step's
    batch makes (counted here by a forward of the model on that batch), and moe_dropped is its dropped share."""
    import h5py
    from mpi4py import MPI

    from hpengine.run.build import build
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = np.random.default_rng(7).integers(0, V, 3000).astype(np.uint8)
    moe = [f"model.moe.{k}={v}" for k, v in dict(MOE, capacity_factor=0.75, bias_update_rate=0.125).items()]
    cfg = load_config(None, ["model.kind=llama", f"model.vocab_size={V}", f"model.seq_len={T}", "model.d_model=16",
                             "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24",
                             "model.dtype=float64", "train.global_batch=4", f"data.path={path}", *moe])
    eng = build(cfg, MPI.COMM_SELF)
    slot = eng.slots[0]
    x = eng.rows.read("train", 0, slot.seed).tokens
    h, _ = slot.model.embed_forward(np, eng.sync.params, x, LOCAL)
    loads, dropped = {}, 0
    for i in range(3):
        h, c = slot.model.layer_forward(np, eng.sync.params, i, h, LOCAL, loss=(4.0 * T, 1.0))
        st = slot.model.layer_stats(i, c)
        if st is not None:
            loads[i], dropped = st.load.astype(float), dropped + int(st.dropped)
    got = eng.train_step(0)
    for i, load in loads.items():
        np.testing.assert_array_equal(eng.router_bias.bias[0][i], 0.125 * np.sign(load.mean() - load))
    assert eng.router_bias.bias[0][0].tolist() == [0.0] * 4 and np.abs(eng.router_bias.bias[0]).sum() > 0
    assert dropped > 0 and got["moe_dropped"] == pytest.approx(dropped / (2 * 4 * T * 2), rel=1e-15)
    assert len(got["moe_dropped_per_layer"]) == 2


def test_tensor_parallel_experts_need_a_width_the_degree_divides():
    sets = ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=32", "model.moe.num_experts=4",
            "model.moe.expert_hidden=13", "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]
    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, sets), 2)
    msg = str(e.value)
    assert "tensor_parallel.degree = 2 must divide the expert width model.moe.expert_hidden = 13" in msg
    assert "\n" not in msg
    assert resolve(load_config(None, sets[:4] + ["model.moe.expert_hidden=14"] + sets[5:]), 2).tp == 2
