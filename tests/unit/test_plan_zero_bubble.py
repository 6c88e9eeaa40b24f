"""The planner on the zero-bubble schedules: their bubble in the step time is the closed form (a third of
1F1B's idle slots for zb1p, a sixth for zbv, in the units of one F, B or W), zbv's V sends twice 1F1B's
pipeline bytes from every stage, the W stash adds to the activation peak, and `hpengine plan` searches both."""
import pytest

from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.planner.memory import activations, block_activations, precision
from hpengine.planner.model import stage_facts, step_time, traffic
from hpengine.planner.search import Cluster, candidates

TINY = ["model.d_model=32", "model.n_layers=8", "model.n_heads=4", "model.seq_len=16", "train.global_batch=16"]


def layout(p, m, schedule, *extra):
    cfg = load_config(None, TINY + ["strategy.pipeline.enable=true", f"strategy.pipeline.degree={p}",
                                    f"strategy.pipeline.micro_batches={m}", f"strategy.pipeline.schedule={schedule}",
                                    *extra])
    return cfg, resolve(cfg, p)


@pytest.mark.parametrize("schedule,idle", [("1f1b", 3 * 3 * 2 / 3), ("zb1p", 3 * 2 / 3), ("zbv", 3 * 2 / 6)])
def test_bubble_in_step_time(schedule, idle):
    """p = 4, m = 8, a micro-batch of 2 s (F + B + W, 2/3 s each): 1F1B idles 3 slots of F + (B + W), ZB-H1
    p - 1 slots of one action, ZB-V p - 1 of one action on a half-size chunk."""
    times = {"compute": 1.5, "tp": 0.0, "pp": 0.5, "dp": 0.0, "sharding": 0.0, "fixed": 0.0}
    _, lay = layout(4, 8, schedule)
    t = step_time([{"times": times}], lay)
    assert t["bubble"] == pytest.approx(idle)
    assert t["step"] == pytest.approx(8 * 2.0 + idle)


def test_zbv_sends_twice_1f1b_pipeline_bytes_on_every_stage():
    for p in (2, 4):
        got = {}
        for schedule in ("1f1b", "zbv"):
            cfg, lay = layout(p, 8, schedule)
            sts = stage_facts(cfg, lay)
            got[schedule] = [traffic(cfg.model, sts[s], lay, s, 1)["pp"]["send"] for s in range(p)]
        assert got["zbv"] == [2 * b for b in got["1f1b"]], p


def test_w_stash_raises_the_activation_peak_of_late_stages():
    """zb1p at p = 2: stage 0 runs W_i before F_{i+2}, so its peak is 1F1B's two live caches; stage 1 runs F_{i+1}
    while W_i's stash is held, one cache more than 1F1B's one, less what B_i freed: cache + stash."""
    cfg, lay = layout(2, 4, "1f1b")
    item, sts = precision(cfg.model, "")[3], stage_facts(cfg, lay)
    peaks = {}
    for schedule in ("1f1b", "zb1p"):
        cfg, lay = layout(2, 4, schedule)
        peaks[schedule] = [activations(cfg.model, sts[s], lay, s, item) for s in range(2)]
    assert peaks["zb1p"][0] == peaks["1f1b"][0]
    stash = sum(block_activations(cfg.model, lay, item)["w_" + sts[1].kind_of[b].kind] for b in sts[1].chunks[0])
    assert peaks["zb1p"][1] == peaks["1f1b"][1] + stash


def test_plan_searches_both():
    cfg = load_config(None, TINY)
    seen = {(lay.schedule, lay.v) for lay in candidates(cfg, Cluster(nodes=1, gpus_per_node=4))}
    assert {("zb1p", 1), ("zbv", 2)} <= seen

