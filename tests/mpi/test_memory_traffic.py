"""Counted model-state bytes equal the ZeRO formulas, and counted traffic equals what each strategy must
send, with Ψ (the parameter count) and the owners' shares worked out here from the model shape, not read
back from the engine's layout."""
import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, need, run

# The model of helpers.TINY with the keys its parameter count depends on pinned here, not left to defaults.
SHAPE = ["model.vocab_size=256", "model.ffn_mult=4", "model.tie_head=false"]
V, T, C, L, F = 256, 8, 16, 2, 64

# Tensor sizes by hand: V = 256, T = 8, C = 16, L = 2 layers, F = 4 C = 64.
SIZES = {"wte": V * C, "wpe": T * C, "ln_f.w": C, "ln_f.b": C, "lm_head.w": C * V}
for _i in range(L):
    SIZES.update({f"h.{_i}.ln1.w": C, f"h.{_i}.ln1.b": C,
                  f"h.{_i}.attn.qkv.w": C * 3 * C, f"h.{_i}.attn.qkv.b": 3 * C,
                  f"h.{_i}.attn.proj.w": C * C, f"h.{_i}.attn.proj.b": C,
                  f"h.{_i}.ln2.w": C, f"h.{_i}.ln2.b": C,
                  f"h.{_i}.mlp.fc.w": C * F, f"h.{_i}.mlp.fc.b": F,
                  f"h.{_i}.mlp.proj.w": F * C, f"h.{_i}.mlp.proj.b": C})
# Ψ = V C + T C + L (12 C^2 + 13 C) + 2 C + C V = 4096 + 128 + 2 * (3072 + 208) + 32 + 4096
PSI = 14912
assert sum(SIZES.values()) == PSI


def best_largest_share(sizes: list[int], n: int) -> int:
    """The smallest possible largest share when `sizes` (in order) are cut into n contiguous non-empty sets
    of whole tensors: dynamic programming over every cut, independent of the engine's search."""
    pre = np.concatenate([[0], np.cumsum(sizes)])
    m = len(sizes)
    best = {(1, j): int(pre[j]) for j in range(1, m + 1)}       # best[k, j]: first j tensors in k sets
    for k in range(2, n + 1):
        for j in range(k, m + 1):
            best[k, j] = min(max(best[k - 1, i], int(pre[j] - pre[i])) for i in range(k - 1, j))
    return best[n, m]


def check_partition(eng, world) -> int:
    """The owners' ranges tile [0, Ψ) in rank order, cut only between whole tensors, with the best
    possible largest share; returns this rank's share."""
    n = world.Get_size()
    lay = eng.layout
    assert {name: r.size for name, r in lay.ranges.items()} == SIZES
    own = eng.sync.owned
    spans = world.allgather((own.start, own.stop))
    assert spans[0][0] == 0 and spans[-1][1] == PSI
    assert all(spans[r][1] == spans[r + 1][0] for r in range(n - 1))
    starts = {r.start for r in lay.ranges.values()} | {PSI}
    assert all(a in starts and b in starts for a, b in spans), "a share cuts a tensor"
    order = sorted(lay.ranges, key=lambda name: lay.ranges[name].start)
    largest = best_largest_share([SIZES[name] for name in order], n)
    assert max(b - a for a, b in spans) == largest
    # imbalance: the largest share over the mean share Ψ / n
    assert eng.sync.imbalance == pytest.approx(largest * n / PSI, rel=1e-12)
    return own.stop - own.start


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_matches_zero_formula(corpus, world, stage):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    cfg = config(corpus, *SHAPE, "model.dtype=float32", "strategy.sharding.enable=true",
                 f"strategy.sharding.degree={n}", f"strategy.sharding.stage={stage}")
    _, _, eng = run(cfg, world, steps=1)
    own = check_partition(eng, world)
    mem = eng.memory()
    # float32 + AdamW: 4 (params) + 4 (grads) + 8 (m, v) bytes per element, the sharded parts per owner
    want = {1: (4 * PSI, 4 * PSI, 8 * own), 2: (4 * PSI, 4 * own, 8 * own), 3: (4 * own, 4 * own, 8 * own)}[stage]
    assert (mem["param_bytes"], mem["grad_bytes"], mem["optim_bytes"]) == want
    # every owner's model state summed over the ranks: the sharded parts add up to one whole copy
    total = world.allreduce(mem["optim_bytes"], op=MPI.SUM)
    assert total == 8 * PSI


def test_best_largest_share_by_hand():
    # [5, 1, 1, 5] in two sets: {5, 1} {1, 5} -> 6; in three: {5} {1, 1} {5} -> 5; one set: 12
    assert [best_largest_share([5, 1, 1, 5], n) for n in (1, 2, 3, 4)] == [12, 6, 5, 5]
    # [1, 2, 3, 4, 5] in two sets: {1, 2, 3} {4, 5} -> 9 (the cut after 4 gives 10)
    assert best_largest_share([1, 2, 3, 4, 5], 2) == 9


def test_data_parallel_traffic(corpus, world):
    n = world.Get_size()
    need(n > 1, "data parallel needs >= 2 ranks")
    cfg = config(corpus, *SHAPE, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}")
    _, _, eng = run(cfg, world, steps=2)
    calls, nbytes = eng.mesh.comms["dp"].stats["allreduce"]
    # per step: every float64 gradient element once (Ψ x 8 bytes) and the one-model float64 loss (8 bytes)
    assert nbytes == 2 * (PSI * 8 + 8) == 238608


@pytest.mark.parametrize("stage", [1, 2])
def test_sharding_traffic(corpus, world, stage):
    n = world.Get_size()
    need(n > 1, "sharding needs >= 2 ranks")
    cfg = config(corpus, *SHAPE, "strategy.sharding.enable=true", f"strategy.sharding.degree={n}",
                 f"strategy.sharding.stage={stage}")
    _, _, eng = run(cfg, world, steps=1)
    st = eng.mesh.comms["sharding"].stats
    assert st["reduce"][1] == PSI * 8 == 119296       # every gradient element reduced once, to its owner
    assert st["allgather"][1] == PSI * 8              # updated parameters shared once
    check_partition(eng, world)
