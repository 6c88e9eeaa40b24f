"""The planner under Muon: the Newton-Schulz FLOP count against the iteration's own matmuls, a tiny model's step
time above AdamW's by exactly its Newton-Schulz FLOPs over the float64 rate, its memory one state value an element
of the Muon matrices below AdamW's, the owners and the updates' travel under sharding, and `hpengine plan
--optimizer muon`."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.optim.muon import newton_schulz
from hpengine.planner import muon as plan_muon
from hpengine.planner.model import predict_layout
from hpengine.planner.search import Cluster
from hpengine.planner.stages import stages

TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=4", "model.seq_len=8",
        "train.global_batch=4", "model.dtype=float64"]
# per layer (s = 16 on every matrix; 4 s^2 l + 2 s^3 an iteration): qkv 16 x 48: 57,344, attn proj 16 x 16: 24,576,
# fc 16 x 64 and mlp proj 64 x 16: 73,728 each; 229,376 an iteration, 5 iterations, 2 layers
TINY_NS_FLOPS = 2 * 5 * (57_344 + 24_576 + 73_728 + 73_728)


class Counted(np.ndarray):
    """An array that adds each matmul's 2 m k n FLOPs (per matrix of a stack) to `Counted.flops`."""
    flops = 0

    def __matmul__(self, other):
        *batch, m, k = self.shape
        Counted.flops += 2 * m * k * other.shape[-1] * int(np.prod(batch, dtype=np.int64))
        return super().__matmul__(other)


@pytest.mark.parametrize("shape", [(16, 48), (64, 16), (3, 20, 12), (7, 7)])
def test_flop_count_is_that_of_newton_schulz(shape):
    g = np.random.default_rng(0).normal(size=shape).view(Counted)
    Counted.flops = 0
    newton_schulz(np, g, (3.4445, -4.775, 2.0315), 5)
    count = shape[0] if len(shape) == 3 else 1
    assert Counted.flops == plan_muon.flops(shape[-2], shape[-1], 5, count)


def _predict(*extra, world=1, cluster=None):
    cfg = load_config(None, TINY + list(extra))
    return predict_layout(cfg, resolve(cfg, world), cluster or Cluster(gpus_per_node=world, tflops_fp64=1e-3))


def test_muon_step_exceeds_adamw_by_its_newton_schulz_flops_and_holds_one_value_per_matrix_element():
    adamw, muon = _predict(), _predict("optim.name=muon")
    assert TINY_NS_FLOPS == 2_293_760
    assert muon["time"]["step"] - adamw["time"]["step"] == pytest.approx(TINY_NS_FLOPS / 1e9, rel=1e-9)
    # one float64 value an element on the Muon matrices (2 layers of qkv 16 x 48, proj 16 x 16, fc and proj 16 x 64:
    # 3,072 elements a layer), AdamW's two elsewhere: 8 bytes an element of the matrices fewer than AdamW holds
    less = {k: v - (8 * 2 * 3072 if k in ("optimizer", "total") else 0) for k, v in adamw["memory"].items()}
    assert muon["memory"] == less
    fewer = _predict("optim.name=muon", "optim.muon_ns_steps=2")
    assert fewer["time"]["step"] - adamw["time"]["step"] == pytest.approx(TINY_NS_FLOPS * 2 / 5 / 1e9, rel=1e-9)


def test_float32_and_amp_iterate_at_the_float32_rate():
    c = Cluster(tflops_fp32=2e-3, tflops_fp64=1e-3, tflops=1.0)
    for extra in (["model.dtype=float32"], ["model.dtype=float32", "strategy.amp.enable=true"]):
        adamw, muon = _predict(*extra, cluster=c), _predict("optim.name=muon", *extra, cluster=c)
        assert muon["time"]["step"] - adamw["time"]["step"] == pytest.approx(TINY_NS_FLOPS / 2e9, rel=1e-9)


def test_sharding_owners_divide_the_work_like_replicas_and_the_updates_travel_to_them():
    sh = ["optim.name=muon", "strategy.sharding.enable=true", "strategy.sharding.stage=1"]
    cfg = load_config(None, TINY + sh)
    lay, st = resolve(cfg, 2), stages(cfg.model, 1, 1, 1)[0]
    per_owner = [plan_muon.owner_matrices(st, lay, 1, r) for r in range(2)]
    dp = load_config(None, TINY + ["optim.name=muon", "strategy.data_parallel.enable=true"])
    # the owners are chosen over both sharding ranks, whatever range holds a matrix: as two dp replicas divide it
    assert per_owner[0] == per_owner[1] == plan_muon.owner_matrices(st, resolve(dp, 2), 1, 1)
    busiest = sum(plan_muon.flops(*shape, 5, n) for shape, n in per_owner[0])
    largest = max(plan_muon.flops(m[1], m[2], 5, m[0]) for m in st.muon if m is not None)
    # heaviest first to the least loaded: the busiest holds half the work, at most one matrix more
    assert TINY_NS_FLOPS / 2 <= busiest <= TINY_NS_FLOPS / 2 + largest and busiest < TINY_NS_FLOPS
    # the step waits for the busiest owner and the two alltoallv that move updates to it and results back
    c = Cluster(gpus_per_node=2, tflops_fp64=1e-3)
    moved, calls = plan_muon.hop_elements(st, lay, 1)
    assert moved > 0 and calls == 2
    hop = moved * 8 / (c.intra_bw_gbs * 1e9) + calls * c.intra_latency_us * 1e-6
    t = _predict(*sh, world=2, cluster=c)["time"]["step"] - _predict(*sh[1:], world=2, cluster=c)["time"]["step"]
    assert t == pytest.approx(busiest / 1e9 + hop, rel=1e-9)


def test_routed_experts_are_orthogonalised_each_and_the_router_is_not():
    cfg = load_config(None, ["model.kind=llama", "model.d_model=16", "model.n_layers=2", "model.n_heads=4",
                             "model.n_kv_heads=2", "model.seq_len=8", "model.moe.num_experts=4", "model.moe.top_k=2",
                             "model.moe.expert_hidden=12", "model.moe.dense_layers=1", "optim.name=muon"])
    st = stages(cfg.model, 1, 1, 1)[0]
    shapes = dict(plan_muon.owner_matrices(st, resolve(cfg, 1), 1))
    assert shapes[(16, 12)] >= 4 and shapes[(12, 16)] >= 4      # 4 experts' up/gate and down matrices
    assert (16, 4) not in shapes                                 # the router (16 x 4) stays with AdamW


def test_cli_plan_optimizer_flag(tmp_path, capsys):
    sets = [a for t in TINY for a in ("--set", t)]
    assert main(["plan", *sets, "--gpus-per-node", "2", "--optimizer", "muon", "--top", "3"]) == 0
    assert "optimizer muon" in capsys.readouterr().out
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\nkind = 'gpt'\nd_model = 16\nn_layers = 2\nn_heads = 4\nseq_len = 8\ndtype = 'float64'\n"
                   "[train]\nglobal_batch = 4\n[optim]\nname = 'muon'\n")
    assert main(["plan", "--check", str(cfg), "--world", "1"]) == 0
    assert "optimizer muon" in capsys.readouterr().out
    assert main(["plan", "--check", str(cfg), "--world", "1", "--optimizer", "adamw"]) == 0
    assert "optimizer adamw" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", *sets, "--optimizer", "lion"])
    assert e.value.code == 2 and "--optimizer: invalid choice: 'lion'" in capsys.readouterr().err
