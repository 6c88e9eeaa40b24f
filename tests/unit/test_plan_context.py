"""The planner under context parallelism: the search proposes cp degrees where they are legal (seq_len divisible
by 2 cp, never for the mlp kind or MoE models), each cp candidate written as a config resolves to itself, a long
sequence on small devices picks cp > 1 and says why, and a rank's predicted activations shrink with cp. The
bytes themselves (caches, the ring's messages, the gradient sum over dp x cp) are checked against the engine's
counts in tests/mpi/test_plan_vs_engine.py."""
from hpengine.cli import main
from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.planner.model import predict_layout
from hpengine.planner.search import Cluster, candidates, config_for, describe

LLAMA = ["model.kind=llama", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=48", "model.seq_len=16", "train.global_batch=8"]


def test_cp_candidates_are_legal_and_resolve_to_themselves():
    cfg = load_config(None, LLAMA)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    lays = list(candidates(cfg, cluster, max_rows=2))
    cps = {lay.cp for lay in lays}
    assert cps == {1, 2, 4, 8}                  # 16 tokens: 2 cp divides them up to cp 8
    for lay in [x for x in lays if x.cp > 1]:
        assert lay.world == cluster.world and cfg.model.seq_len % (2 * lay.cp) == 0
        assert lay.granularity == "full"        # selective recompute drops nothing under cp
        assert resolve(config_for(cfg, lay), cluster.world) == lay
    assert "cp 2 (ring)" in describe(next(x for x in lays if x.cp == 2))


def test_no_cp_for_short_sequences_mlp_or_moe():
    cluster = Cluster(nodes=1, gpus_per_node=4)
    odd = load_config(None, LLAMA + ["model.seq_len=6"])        # 6 tokens: 2 x 2 does not divide them
    assert {lay.cp for lay in candidates(odd, cluster, max_rows=1)} == {1}
    mlp = load_config(None, ["model.kind=mlp", "model.d_model=32", "model.seq_len=16", "train.global_batch=8"])
    assert {lay.cp for lay in candidates(mlp, cluster, max_rows=1)} == {1}
    moe = load_config(None, LLAMA + ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=16"])
    assert {lay.cp for lay in candidates(moe, cluster, max_rows=1)} == {1}


def test_activations_shrink_with_cp():
    cfg = load_config(None, LLAMA + ["model.seq_len=64"])
    acts = []
    for cp in (1, 2, 4):
        c = load_config(None, LLAMA + ["model.seq_len=64", "strategy.context_parallel.enable=true",
                                       f"strategy.context_parallel.degree={cp}"]) if cp > 1 else cfg
        r = predict_layout(c, resolve(c, cp), Cluster(nodes=1, gpus_per_node=4))
        acts.append(r["memory"]["activations"])
        if cp > 1:
            assert set(r["stages"][0]["traffic"]["cp"]) == {"send", "recv", "allreduce"}
            assert r["time"]["cp"] >= 0 and "cp" in r["time"]
    assert acts[0] > acts[1] > acts[2]


def test_long_sequence_on_small_devices_picks_cp_and_says_why(capsys):
    assert main(["plan", "--set", "model.kind=llama", "--set", "model.d_model=256", "--set", "model.n_layers=4",
                 "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--seq", "32768", "--global-batch", "8",
                 "--nodes", "1", "--gpus-per-node", "8", "--mem-gb", "0.3", "--reserve-gb", "0",
                 "--max-micro-batch", "1", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "seq 32768" in text
    head = next(ln for ln in text.splitlines() if ln.lstrip().startswith("#"))
    assert head.split()[:3] == ["#", "tp", "cp"]
    best = next(ln for ln in text.splitlines() if ln.startswith("best: "))
    assert "cp 8 (ring)" in best
    assert "context parallel: memory: cp 1 does not fit" in text
    rows = [ln for ln in text.splitlines() if ln[:3].strip().isdigit() and "|" in ln]
    assert len(rows) == 3 and all(int(r.split()[2]) > 1 for r in rows)     # the cp column: every fit splits
