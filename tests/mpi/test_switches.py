"""Recompute saves activation memory and changes nothing else; amp's dynamic loss scaling skips an
overflowing step on every rank together and lowers the scale; gradient merge equals one big pass."""
import numpy as np

from helpers import assert_same, assert_same_params, config, run


def test_recompute_saves_activation_bytes(corpus, world):
    n = world.Get_size()
    dp = [f"strategy.data_parallel.enable={'true' if n > 1 else 'false'}"]
    plain_l, plain_p, plain = run(config(corpus, *dp), world, steps=2)
    rc_l, rc_p, rc = run(config(corpus, *dp, "strategy.recompute.enable=true"), world, steps=2)
    assert_same(rc_l, plain_l, rtol=0)
    assert_same_params(rc_p, plain_p, rtol=0)
    # every block keeps only its input: far fewer live activation bytes
    assert rc.memory()["activation_peak_bytes"] < 0.5 * plain.memory()["activation_peak_bytes"]


def test_amp_overflow_skips_the_same_step_everywhere(corpus, world):
    n = world.Get_size()
    extra = ["model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.init_scale=1e8",
             "strategy.amp.backoff=1e-5"]
    if n > 1:
        extra += ["strategy.sharding.enable=true", f"strategy.sharding.degree={n}", "strategy.sharding.stage=2"]
    from hpengine.train import build
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
    from hpengine.train import build
    dp = "true" if world.Get_size() > 1 else "false"
    eng = build(config(corpus, "model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.init_scale=4",
                       "strategy.amp.growth_interval=2", "strategy.amp.growth_factor=2",
                       f"strategy.data_parallel.enable={dp}"), world)
    scales = [eng.train_step(s)["loss_scale"] for s in range(4)]
    assert scales == [4, 8, 8, 16]
