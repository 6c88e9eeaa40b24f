"""Reduction groups: every tensor's sums and its place in the global norm, read off a hand-worked layout (a
tied GPT of 2 layers on pp 2 x tp 2: the embedding and h.0 on stage 0, h.1 and the head on stage 1)."""
import pytest

from hpengine.config import load_config
from hpengine.layout.reduction import REPLICAS, norm_excluded, reductions, summed_over, tied_sums
from hpengine.layout.resolve import resolve
from hpengine.layout.stage import build_stage

CFG = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
       "model.tie_head=true", "train.global_batch=4", "strategy.tensor_parallel.enable=true",
       "strategy.tensor_parallel.degree=2", "strategy.pipeline.enable=true", "strategy.pipeline.degree=2",
       "strategy.pipeline.micro_batches=2"]


def _reds(pp_rank, tp_rank, sp):
    cfg = load_config(None, CFG)
    st = build_stage(cfg.model, resolve(cfg, 4), pp_rank, tp_rank)
    return st, {r.tensor: r for r in reductions(st, tp_rank, sp)}


@pytest.mark.parametrize("sp", [False, True])
def test_stage0_tp_rank1(sp):
    st, r = _reds(0, 1, sp)
    assert r["wte"].sum_over == ("tied",) + REPLICAS and r["wte"].counted and not r["wte"].copy
    assert r["h.0.attn.qkv.w"].sum_over == REPLICAS and r["h.0.attn.qkv.w"].counted    # split over tp
    # held whole by every tp rank: counted on tp rank 0 only; summed over tp only under sequence parallelism
    for whole in ("wpe", "h.0.ln1.w", "h.0.attn.proj.b"):
        assert not r[whole].counted and r[whole].sum_over == REPLICAS + (("tp",) if sp else ())
    assert [x.tensor for x in tied_sums(r.values(), st)] == ["wte"]


def test_stage1_holds_the_copy_and_counts_it_nowhere():
    st, r = _reds(1, 0, False)
    assert r["wte"].copy and not r["wte"].counted and r["wte"].block == "head"
    assert r["wte"].sum_over == ("tied",) + REPLICAS
    assert r["ln_f.w"].counted and r["h.1.mlp.fc.w"].counted
    assert norm_excluded(r.values()) == ["wte"]
    assert summed_over(r.values(), "tp") == []


def test_norm_excludes_copies_then_tp_replicas_in_layout_order():
    st, r = _reds(1, 1, True)
    ex = norm_excluded(r.values())
    assert ex[0] == "wte" and set(ex[1:]) == {n for n, x in r.items() if x.sum_over[-1] == "tp"}
    assert ex[1:] == [sp.name for sp in st.layout.specs if sp.tp_dim is None]


MOE = ["model.kind=llama", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
       "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.dense_layers=1", "train.global_batch=8",
       "strategy.data_parallel.enable=true", "strategy.expert_parallel.enable=true"]


@pytest.mark.parametrize("ep", [1, 2])
def test_experts_split_over_ep_sum_over_their_replicas_and_over_ep_in_the_norm(ep):
    cfg = load_config(None, MOE + [f"strategy.expert_parallel.degree={ep}"])
    st = build_stage(cfg.model, resolve(cfg, 2), 0, 0, ep_rank=1 % ep)
    r = {x.tensor: x for x in reductions(st, 0, False)}
    experts = ["h.1.moe.experts.gate.w", "h.1.moe.experts.up.w", "h.1.moe.experts.down.w"]
    for name in experts:      # the router and every dense tensor are held whole by every ep rank
        assert r[name].sum_over == (("ep-dp", "sharding") if ep > 1 else REPLICAS)
        assert r[name].norm_over == (("ep",) if ep > 1 else ()) and r[name].counted
    assert [t for t, x in r.items() if x.norm_over] == (experts if ep > 1 else [])
    assert r["h.1.moe.router.w"].sum_over == REPLICAS and r["h.1.moe.router.w"].norm_over == ()
    assert st.layout.expert_ranges() == ([st.layout.ranges[n] for n in experts] if ep > 1 else [])
