"""Recompute (full or selective) saves activation memory and changes nothing else; amp's dynamic loss scaling skips an
overflowing step on every rank together and lowers the scale; gradient merge equals one big pass."""
import numpy as np
import pytest

from helpers import LLAMA, assert_same, assert_same_params, config, need, run


def test_recompute_saves_activation_bytes(corpus, world):
    n = world.Get_size()
    dp = [f"strategy.data_parallel.enable={'true' if n > 1 else 'false'}"]
    plain_l, plain_p, plain = run(config(corpus, *dp), world, steps=2)
    rc_l, rc_p, rc = run(config(corpus, *dp, "strategy.recompute.enable=true"), world, steps=2)
    assert_same(rc_l, plain_l, rtol=0)
    assert_same_params(rc_p, plain_p, rtol=0)
    # every block keeps only its input: far fewer live activation bytes
    assert rc.memory()["activation_peak_bytes"] < 0.5 * plain.memory()["activation_peak_bytes"]


S = "strategy."
DP = [S + "data_parallel.enable=true"]
TP2 = [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2", S + "pipeline.micro_batches=2"]
EVERY2 = [S + "recompute.every=2"]
# a few layouts, not a cross product: both attention kinds, every 1 and 2, under tp and under a pipeline;
# the ranks left over go to data parallelism
SELECTIVE = [
    ("gpt_every1", 1, DP),
    ("llama_every2", 1, LLAMA + DP + EVERY2),
    ("gpt_tp2_every2", 2, TP2 + DP + EVERY2),
    ("llama_tp2", 2, LLAMA + TP2 + DP),
    ("gpt_pp2_1f1b", 2, PP2 + DP + ["model.n_layers=4"]),
    ("llama_pp2_every2", 2, LLAMA + PP2 + DP + EVERY2 + ["model.n_layers=4"]),
]


@pytest.mark.parametrize("name,ranks,extra", SELECTIVE, ids=[c[0] for c in SELECTIVE])
def test_selective_recompute_is_bit_exact(corpus, world, name, ranks, extra):
    """Selective recompute rebuilds the attention probabilities of the layers `every` picks in backward:
    losses, gradient norms and parameters are those of recompute off, bit for bit (float64)."""
    need(world.Get_size() % ranks == 0, f"{name} needs a multiple of {ranks} ranks")
    off_l, off_p, off = run(config(corpus, *extra), world, steps=3)
    sel_l, sel_p, sel = run(config(corpus, *extra, S + "recompute.enable=true",
                                   S + "recompute.granularity=selective"), world, steps=3)
    assert_same(sel_l, off_l, rtol=0)
    assert_same(sel.grad_norms, off.grad_norms, rtol=0)
    assert_same_params(sel_p, off_p, rtol=0, atol=0)
    assert sel.memory()["activation_peak_bytes"] < off.memory()["activation_peak_bytes"]   # it dropped something
    assert off_l[-1] < off_l[0]


def run_counting_passes(cfg, world, steps):
    """Like helpers.run, also recording the rows of every forward_backward pass train_step makes."""
    from hpengine.run.build import build
    eng = build(cfg, world)
    passes, plain = [], eng.forward_backward

    def spy(slot, batch, *args, **kwargs):
        passes.append(batch.rows)
        return plain(slot, batch, *args, **kwargs)
    eng.forward_backward = spy
    metrics = [eng.train_step(s) for s in range(steps)]
    return (np.array([m["loss"] for m in metrics]), np.array([m["grad_norm"] for m in metrics]),
            eng.named_params(), passes)


def test_gradient_merge_equals_one_big_pass(corpus, world):
    n, steps = world.Get_size(), 3
    # global batch 16: every replica's share (16 / n rows) splits into k = 2 passes up to n = 8
    base = ["model.dtype=float64", "train.global_batch=16"]
    if n > 1:
        base += ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}"]
    merge = ["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=2"]
    one_l, one_n, one_p, one_passes = run_counting_passes(config(corpus, *base), world, steps)
    gm_l, gm_n, gm_p, gm_passes = run_counting_passes(config(corpus, *base, *merge), world, steps)
    share = 16 // n
    # the switch really changes the passes: one pass of the whole share per step without it, two halves with it
    assert one_passes == [share] * steps
    assert gm_passes == [share // 2] * (2 * steps)
    # ... and nothing else: the same global batch gives the same losses, norms and parameters
    assert_same(gm_l, one_l, rtol=1e-10)
    assert_same(gm_n, one_n, rtol=1e-10)
    assert_same_params(gm_p, one_p, rtol=1e-10)
    assert one_l[-1] < one_l[0]                       # it trained: the comparison is not of two idle runs


def test_amp_overflow_skips_the_same_step_everywhere(corpus, world):
    n = world.Get_size()
    extra = ["model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.init_scale=1e8",
             "strategy.amp.backoff=1e-5"]
    if n > 1:
        extra += ["strategy.sharding.enable=true", f"strategy.sharding.degree={n}", "strategy.sharding.stage=2"]
    from hpengine.run.build import build
    eng = build(config(corpus, *extra), world)
    before = eng.named_params()
    m = eng.train_step(0)
    assert m.get("skipped") and m["loss_scale"] == 1e8 * 1e-5
    after = eng.named_params()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])      # nothing trained on the overflow
    flags = world.allgather((m["skipped"], m["loss_scale"]))
    assert len(set(flags)) == 1                                        # the same decision on every rank
    m2 = eng.train_step(1)
    assert not m2.get("skipped") and np.isfinite(m2["loss"])


def test_amp_scale_grows_after_growth_interval(corpus, world):
    from hpengine.run.build import build
    dp = "true" if world.Get_size() > 1 else "false"
    eng = build(config(corpus, "model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.init_scale=4",
                       "strategy.amp.growth_interval=2", "strategy.amp.growth_factor=2",
                       f"strategy.data_parallel.enable={dp}"), world)
    scales = [eng.train_step(s)["loss_scale"] for s in range(4)]
    assert scales == [4, 8, 8, 16]
