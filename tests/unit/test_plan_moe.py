"""The planner on mixture-of-experts models (llama kind): legal candidates only (tensor-parallel experts where
the widths divide) and the matmul weights a token meets (top_k of the E experts). The MoE layers' activation bytes and the
figures riding on the loss allreduce are checked against the engine's counts in tests/mpi/test_plan_vs_engine.py."""
from math import prod

from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.models import build_model
from hpengine.planner.model import stage_facts
from hpengine.planner.search import Cluster, candidates, config_for, with_preset

TINY = ["model.d_model=32", "model.n_layers=8", "model.n_heads=4", "model.seq_len=16", "train.global_batch=16"]


def test_plan_of_an_moe_model_is_legal_and_counts_the_experts_it_runs():
    """An MoE model's candidates split its experts over tp where every width divides (expert_hidden 16, two
    key/value heads: tp 1 and 2), and a routed expert's weights count top_k / E of themselves in the per-micro-batch matmul
    weights (one GEMM per token and chosen expert)."""
    moe = ["model.kind=llama", "model.n_kv_heads=2", "model.moe.num_experts=4", "model.moe.top_k=2",
           "model.moe.expert_hidden=16"]
    cfg = load_config(None, TINY + moe)
    lays = list(candidates(cfg, Cluster(nodes=1, gpus_per_node=4)))
    assert lays and {lay.tp for lay in lays} == {1, 2}
    for lay in [x for x in lays if x.tp > 1][:10]:
        assert resolve(config_for(cfg, lay), 4) == lay
    dense = load_config(None, TINY + ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_hidden=16"])
    st_moe = stage_facts(cfg, resolve(cfg, 1))[0]
    st_dense = stage_facts(dense, resolve(dense, 1))[0]
    C, L, E, K, F = 32, 8, 4, 2, 16
    # each layer: the dense MLP's 3 C F against the experts' K x 3 C F plus the router's C E
    assert st_moe.matmul - st_dense.matmul == L * (K * 3 * C * F + C * E - 3 * C * F)


def test_expert_parallel_candidates_are_legal_and_hold_a_share_of_the_experts():
    """ep is searched for MoE models (divisors of dp x sharding that divide the experts: inside dp, or across
    sharding ranks); each such candidate written as a config resolves to itself, and its stage holds 1 / ep of every
    expert tensor."""
    cfg = load_config(None, TINY + ["model.kind=llama", "model.n_kv_heads=2", "model.moe.num_experts=4",
                                    "model.moe.expert_hidden=16"])
    cluster = Cluster(nodes=1, gpus_per_node=4)
    eps = [lay for lay in candidates(cfg, cluster) if lay.ep > 1]
    assert eps and all((lay.dp * lay.sh) % lay.ep == 0 and 4 % lay.ep == 0 for lay in eps)
    assert any(lay.sh > 1 for lay in eps) and any(lay.sh == 1 for lay in eps)
    across = [lay for lay in eps if lay.dp % lay.ep]
    assert across and all(lay.experts_whole and lay.sh > 1 for lay in across)
    for lay in eps[:10] + [lay for lay in eps if lay.sh > 1][:10] + across[:10]:
        assert resolve(config_for(cfg, lay), cluster.world) == lay
        if lay.pp == 1:     # one process holds ep blocks of the experts, this rank one
            one, here = stage_facts(cfg, resolve(cfg, 1))[0], stage_facts(cfg, lay)[0]
            assert here.experts > 0 and one.psi - here.psi == (lay.ep - 1) * here.experts


def test_mixtral_preset_has_mixtrals_46_7b_parameters():
    """Mixtral 8x7B by formula (V vocab, d width, L layers, H/K query/kv heads of hd, E experts of width F):
    2 V d (embedding, untied head) + L (2 d norms + d H hd + 2 d K hd + H hd d + d E router + 3 E d F) + d =
    46,702,792,704, Mistral's "46.7B total parameters"; top 2 of 8 experts make 12.9B active per token."""
    cfg = with_preset(load_config(None), "mixtral-8x7b")
    V, d, L, H, K, hd, E, F = 32000, 4096, 32, 32, 8, 128, 8, 14336
    want = 2 * V * d + L * (2 * d + d * H * hd + 2 * d * K * hd + H * hd * d + d * E + 3 * E * d * F) + d
    got = sum(prod(sp.global_shape) for sp in build_model(cfg.model).all_specs())
    assert got == want == 46_702_792_704
    active = want - L * 3 * (E - 2) * d * F
    assert round(active / 1e9, 1) == 12.9


def test_load_imbalance_slows_expert_parallel_by_the_hot_ranks_extra_expert_gemms():
    """cluster.moe_imbalance f: under expert parallelism the rank of the most-loaded expert runs f times its
    balanced expert GEMMs, 6 x tokens x (f - 1) x K x 3 C F FLOPs more per MoE layer and micro-batch (each
    token meets K experts of 3 C F weights), and receives f times the rows; without ep nothing changes."""
    from hpengine.planner.model import stage_times
    moe = ["model.kind=llama", "model.n_kv_heads=2", "model.moe.num_experts=4", "model.moe.top_k=2",
           "model.moe.expert_hidden=16", "train.global_batch=4"]
    ep = ["strategy.data_parallel.enable=true", "strategy.expert_parallel.enable=true", "strategy.expert_parallel.degree=4"]
    C, L, K, F, T = 32, 8, 2, 16, 16
    for sets, world in ((ep, 4), ([], 1)):
        cfg = load_config(None, TINY + moe + sets)
        lay = resolve(cfg, world)
        st = stage_facts(cfg, lay)[0]
        flat, hot = Cluster(nodes=1, gpus_per_node=4), Cluster(nodes=1, gpus_per_node=4, moe_imbalance=1.5)
        a, b = stage_times(cfg.model, st, lay, 0, 1, flat), stage_times(cfg.model, st, lay, 0, 1, hot)
        extra = 6 * lay.rows * T * 0.5 * L * K * 3 * C * F / (flat.tflops_fp32 * 1e12) if world > 1 else 0.0
        assert abs((b["compute"] - a["compute"]) - extra) <= 1e-12 * a["compute"]
        if world > 1:
            assert b["ep"] > a["ep"] > 0
        else:
            assert a == b
