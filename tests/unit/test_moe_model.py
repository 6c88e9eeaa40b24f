"""The llama kind with routed experts ([model.moe]): the whole model's gradient (the cross-entropy plus the
weighted aux and z losses of every MoE layer) against central finite differences in float64, for the router,
the experts, the shared expert and the dense layers around them; the config's one-line refusals."""
import numpy as np
import pytest

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


def loss_and_grad(m, P, lay, idx, y, grad=True):
    """The training loss (cross-entropy + every MoE layer's weighted balancing share) and its gradient."""
    norm = float(B * T)
    h, ce = m.embed_forward(np, P, idx, LOCAL)
    caches, extra = [], 0.0
    for i in range(m.n_layers):
        h, c = m.layer_forward(np, P, i, h, LOCAL, loss=(norm, 1.0))
        st = m.layer_stats(i, c)
        extra += st.share if st is not None else 0.0
        caches.append(c)
    loss, ch = m.head_forward(np, P, h, y, norm, LOCAL)
    if not grad:
        return float(loss) + extra, None
    G = FlatBuffer(lay, np, np.float64)
    d = m.head_backward(np, ch, G, LOCAL, P)
    for i in reversed(range(m.n_layers)):
        d = m.layer_backward(np, d, caches[i], P, G, i, LOCAL)
    m.embed_backward(np, d, ce, G, LOCAL)
    return float(loss) + extra, G


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_whole_model_gradient_against_finite_differences(router):
    m, P, lay = model(**MOE, router=router)
    rng = np.random.default_rng(0)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    _, G = loss_and_grad(m, P, lay, idx, y)
    names = ["h.1.moe.router.w", "h.2.moe.experts.gate.w", "h.1.moe.experts.up.w", "h.2.moe.experts.down.w",
             "h.1.moe.shared.down.w", "h.0.mlp.up.w", "h.2.attn.q.w", "h.1.mlp_norm.w", "wte"]
    eps = 1e-6
    for name in names:
        flat = P[name].reshape(-1)
        picks = rng.choice(flat.size, size=6, replace=False)
        for j in picks:
            old = flat[j]
            flat[j] = old + eps
            lp, _ = loss_and_grad(m, P, lay, idx, y, grad=False)
            flat[j] = old - eps
            lm, _ = loss_and_grad(m, P, lay, idx, y, grad=False)
            flat[j] = old
            num, ana = (lp - lm) / (2 * eps), G[name].reshape(-1)[j]
            assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)) + 1e-9, (name, j, num, ana)
        assert np.abs(G[name]).max() > 0, name


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
     "strategy.expert_parallel.degree = 4 must divide the data-parallel degree 2"),
    (["model.kind=llama", "model.moe.num_experts=8", "strategy.expert_parallel.degree=2",
      "strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.data_parallel.degree=1"], 4,
     "strategy.expert_parallel.degree = 2 must divide the data-parallel degree 1 (experts are split inside the "
     "data-parallel ranks; no extra ranks; a sharding group shares one expert block); valid: [1]"),
])
def test_impossible_expert_parallel_layouts_are_one_clear_line(sets, world, message):
    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, EP + sets), world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_degree_minus_one_takes_every_data_parallel_rank():
    res = resolve(load_config(None, EP + ["model.kind=llama", "model.moe.num_experts=8"]), 4)
    assert (res.dp, res.ep) == (4, 4)
