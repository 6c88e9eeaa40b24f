"""Zero-bubble schedules (hpengine.layout.zero_bubble): every stage's F/B/W complete and in order, the timed
simulation against the dataflow rules, the step, bubble and memory against closed forms worked out by
hand, hand-written orders and timelines for p = 2, m = 4, deadlocks caught, and input validation."""
from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.layout.resolve import chunks as model_chunks, resolve, stage_chunks
from hpengine.layout.schedules import (SCHEDULES, Action, bubble_fraction, make_schedule, one_f_one_b, peak_in_flight,
                                       placement)
from hpengine.layout.schedules import simulate as simulate_rounds
from hpengine.layout.zero_bubble import (ZERO_BUBBLE, Placement, Times, make_zero_bubble,
                                         simulate, simulate_schedule, zb1p, zbv)

PS = range(1, 9)
MS = range(1, 33)


def accepted():
    """(name, p, m) over the grid wherever the schedule takes it: zbv needs m >= 2p - 1."""
    for p in PS:
        for m in MS:
            yield "zb1p", p, m
            if m >= 2 * p - 1:
                yield "zbv", p, m


def chunks(name):
    return 2 if name == "zbv" else 1


def virtual(name, p, stage, chunk):
    """Written out again rather than taken from Placement: the V turns on stage p - 1."""
    return 2 * p - 1 - stage if name == "zbv" and chunk == 1 else stage


def words(acts):
    return " ".join(map(str, acts))


def test_every_unit_once_and_f_before_b_before_w():
    for name, p, m in accepted():
        for stage in range(p):
            acts = make_zero_bubble(name, p, m, stage)
            units = [(mb, c) for mb in range(m) for c in range(chunks(name))]
            assert Counter((a.kind, a.mb, a.chunk) for a in acts) == Counter(
                (k, *u) for k in "FBW" for u in units), (name, p, m, stage)
            where = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(acts)}
            assert all(where["F", *u] < where["B", *u] < where["W", *u] for u in units), (name, p, m, stage)
            if name == "zb1p":  # ZB-H1 only moves W's: without them it is 1F1B
                assert [a for a in acts if a.kind != "W"] == one_f_one_b(p, m, stage)


def test_simulated_timeline_keeps_the_dataflow():
    # Read the start times back and check each action against its inputs by hand: F after the previous
    # virtual stage's F, B after its own F and the next virtual stage's B, W after its B; one at a time.
    for name, p, m in accepted():
        r = simulate_schedule(name, p, m)
        last = chunks(name) * p - 1
        t = {}
        for s in range(p):
            acts = make_zero_bubble(name, p, m, s)
            starts = r["start"][s]
            assert all(b - a >= 1 for a, b in pairwise(starts)), (name, p, m, s)
            for a, st in zip(acts, starts):
                t[a.kind, a.mb, virtual(name, p, s, a.chunk)] = st
        for (kind, mb, g), st in t.items():
            if kind == "F" and g > 0:
                assert st >= t["F", mb, g - 1] + 1
            if kind == "B":
                assert st >= t["F", mb, g] + 1
                if g < last:
                    assert st >= t["B", mb, g + 1] + 1, (name, p, m, mb, g)
            if kind == "W":
                assert st >= t["B", mb, g] + 1
        assert r["rounds"] == max(t.values()) + 1


def test_step_and_bubble_match_the_closed_forms():
    # zb1p: each stage works 3m; stage 0 cannot run a B before 2p - 1 and holds at most min(p, m)
    # forwards before it, so it idles 2p - 1 - min(p, m): p - 1 when m >= p, else 2p - 1 - m.
    # zbv: each stage works 6m chunk-actions; stage p - 1 starts at p - 1, so at best 6m + p - 1.
    for name, p, m in accepted():
        r = simulate_schedule(name, p, m)
        work = 3 * m * chunks(name)
        idle = (2 * p - 1 - min(p, m)) if name == "zb1p" else p - 1
        assert r["busy"] == [work] * p
        assert r["rounds"] == work + idle, (name, p, m)
        assert r["bubble"] == pytest.approx(idle / (work + idle), abs=1e-12)
        if m >= p:
            assert r["bubble"] == pytest.approx((p - 1) / (work + p - 1), abs=1e-12)


def test_1f1b_under_the_same_simulator():
    # 1F1B's B is B + W, time 2: (m + p - 1) slots of F + B = 3 each, 3(p - 1) of them idle.
    for p in PS:
        for m in MS:
            r = simulate([one_f_one_b(p, m, s) for s in range(p)], Placement(p), times=Times(B=2))
            assert r["rounds"] == 3 * (m + p - 1)
            assert r["bubble"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert r["peak_stash"] == [0] * p


def test_unit_rounds_agree_with_schedules_simulate():
    # The timed simulator at unit times is the round simulator of schedules.py.
    for p in (1, 2, 3, 4, 8):
        for m in (1, 3, 8, 16):
            cases = [("fthenb", 1), ("1f1b", 1)] + ([("interleaved", 2), ("interleaved", 3)] if m % p == 0 else [])
            for name, v in cases:
                acts = [make_schedule(name, p, m, s, v) for s in range(p)]
                old, new = simulate_rounds(p, m, name, v), simulate(acts, Placement(p, v))
                assert (new["rounds"], new["busy"]) == (old["rounds"], old["busy"]), (name, p, m, v)


def test_zero_bubble_idles_a_third_and_a_sixth_of_1f1b():
    for p in range(2, 9):
        for m in range(2 * p - 1, 33):
            f1b = simulate([one_f_one_b(p, m, s) for s in range(p)], Placement(p), times=Times(B=2))
            h1, v = simulate_schedule("zb1p", p, m), simulate_schedule("zbv", p, m)
            assert 3 * (h1["rounds"] - 3 * m) == f1b["rounds"] - 3 * m
            # zbv's chunk is half a stage: in chunk-units 1F1B idles 2 * 3(p - 1), zbv p - 1.
            assert 6 * (v["rounds"] - 6 * m) == 2 * (f1b["rounds"] - 3 * m)
            assert v["bubble"] < h1["bubble"] < f1b["bubble"]


def test_peak_memory():
    # zb1p, stage s: 1F1B's min(p - s, m) between F and B; W_i waits for B_{i+s}, so s + 1 between
    # B and W; together p on every stage. zbv, chunk-units: 2p between F and B (p stage-equivalents,
    # 1F1B's stage 0), 2s + 1 between B and W (s deferred pairs and one), 2p between F and W.
    for name, p, m in accepted():
        r = simulate_schedule(name, p, m)
        if name == "zb1p":
            assert r["peak_live"] == [min(p - s, m) for s in range(p)]
            assert r["peak_live"] == [peak_in_flight(one_f_one_b(p, m, s)) for s in range(p)]
            assert r["peak_stash"] == [min(s + 1, m) for s in range(p)], (p, m)
            assert r["peak_held"] == [min(p, m)] * p
        else:
            assert r["peak_live"] == [2 * p] * p
            assert r["peak_stash"] == [2 * s + 1 for s in range(p)], (p, m)
            assert r["peak_held"] == [2 * p] * p


@pytest.mark.parametrize("tf, tb, tw", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 1, 1), (3, 4, 2), (2, 2, 2)])
def test_zb1p_idles_the_papers_figure(tf, tb, tw):
    # Qi et al.'s ZB-H1 bubble per stage, (p - 1)(T_F + T_B - T_W), when W is the cheapest pass.
    for p in (2, 3, 5, 8):
        for m in (p, p + 1, 2 * p, 3 * p + 1):
            r = simulate_schedule("zb1p", p, m, times=Times(tf, tb, tw))
            assert r["rounds"] - m * (tf + tb + tw) == (p - 1) * (tf + tb - tw), (p, m)


def test_known_orders_and_timelines():
    # zb1p, p=2, m=4: stage 1 defers each W by one B. By hand, with every action one round:
    #   round   0   1   2   3   4   5   6   7   8   9   10  11  12
    #   stage 0 F0  F1  .   B0  W0  F2  B1  W1  F3  B2  W2  B3  W3
    #   stage 1 .   F0  B0  F1  B1  W0  F2  B2  W1  F3  B3  W2  W3
    # 13 = 3m + p - 1 rounds, one idle round per stage.
    assert words(zb1p(2, 4, 0)) == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"
    assert words(zb1p(2, 4, 1)) == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"
    r = simulate_schedule("zb1p", 2, 4)
    assert r["start"] == [[0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(1, 13))]
    # zbv, p=2, m=4: virtual stages 0 (stage 0), 1 (stage 1), 2 (stage 1, .c1), 3 (stage 0, .c1, loss).
    # Traced by hand: F0 reaches virtual 3 at round 3, its B leaves at 4 and is back on virtual 0 at 10;
    # stage 0 is busy 0..23 and stage 1 1..24, so 25 = 6m + p - 1 rounds.
    assert words(zbv(2, 4, 0)) == ("F0 F1 F2 F0.c1 B0.c1 W0.c1 F1.c1 B1.c1 W1.c1 F3 B0 W0 F2.c1 B2.c1 W2.c1 "
                                   "B1 W1 F3.c1 B3.c1 W3.c1 B2 W2 B3 W3")
    assert words(zbv(2, 4, 1)) == ("F0 F0.c1 F1 F1.c1 B0.c1 W0.c1 F2 B0 W0 F2.c1 B1.c1 W1.c1 F3 B1 W1 "
                                   "F3.c1 B2.c1 W2.c1 B2 B3.c1 B3 W2 W3.c1 W3")
    r = simulate_schedule("zbv", 2, 4)
    assert r["start"] == [list(range(24)), list(range(1, 25))]
    assert r["rounds"] == 25


def test_hop_costs_between_stages_only():
    # F0 of zbv, p=2, hop 0.5: virtual 0 at 0, virtual 1 (stage 1) at 1 + 0.5, virtual 2 on the same
    # stage right after (the V's turn, no send), virtual 3 back on stage 0 at 3.5 + 0.5.
    r = simulate_schedule("zbv", 2, 4, hop=0.5)
    first = {}
    for s in range(2):
        for a, st in zip(zbv(2, 4, s), r["start"][s]):
            first.setdefault((a.kind, a.mb, virtual("zbv", 2, s, a.chunk)), st)
    assert [first["F", 0, g] for g in range(4)] == [0, 1.5, 2.5, 4.0]


def test_single_stage_has_no_bubble():
    for name in ZERO_BUBBLE:
        assert simulate_schedule(name, 1, 4)["bubble"] == 0


def test_offered_to_the_engine_with_their_chunk_counts():
    assert set(ZERO_BUBBLE) <= set(SCHEDULES)
    assert make_schedule("zb1p", 2, 4, 1) == make_zero_bubble("zb1p", 2, 4, 1)
    assert make_schedule("zbv", 2, 4, 0, 2) == make_zero_bubble("zbv", 2, 4, 0)
    with pytest.raises(ValueError, match="'zbv' has 2 model chunk"):
        make_schedule("zbv", 2, 4, 0)
    with pytest.raises(ValueError, match="'zb1p' has 1 model chunk"):
        make_schedule("zb1p", 2, 4, 0, 2)


@pytest.mark.parametrize("name,v", [("zb1p", 1), ("zbv", 2)])
def test_theory_is_the_simulated_bubble(name, v):
    for p in range(1, 9):
        for m in range(2 * p - 1 if name == "zbv" else 1, 33, 3):
            assert bubble_fraction(name, p, m, v) == pytest.approx(simulate_rounds(p, m, name, v)["bubble"], abs=1e-12)


def deadlock(actions, place):
    with pytest.raises(RuntimeError, match="deadlock") as e:
        simulate(actions, place, label="broken")
    return str(e.value)


def test_w_before_its_b_deadlocks():
    acts = [zb1p(2, 2, 0), [Action("F", 0), Action("W", 0), Action("B", 0), Action("F", 1), Action("B", 1),
                            Action("W", 1)]]
    msg = deadlock(acts, Placement(2))
    assert "stage 1 waits at W0 for B0 of virtual stage 1 on stage 1" in msg
    assert "stage 0 waits at B0 for B0 of virtual stage 1 on stage 1" in msg


def test_vee_with_chunks_swapped_on_one_stage_deadlocks():
    acts = [zbv(2, 3, 0), [Action(a.kind, a.mb, 1 - a.chunk) for a in zbv(2, 3, 1)]]
    msg = deadlock(acts, placement("zbv", 2))
    assert "stage 1 waits at F0.c1 for F0 of virtual stage 1 on stage 1" in msg


def test_backward_before_downstream_can_send_it_deadlocks():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    msg = deadlock([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1), B(0)]], Placement(2))
    assert "stage 0 waits at B0" in msg and "stage 1 waits at F1" in msg


@pytest.mark.parametrize("args, words_", [
    (("zb2p", 2, 4, 0), ["'zb2p'", "zb1p", "zbv"]),
    (("zbv", 4, 6, 0), ["m=6", "p=4", "2p - 1 = 7"]),
    (("zbv", 1, 0, 0), ["m=0"]),
    (("zb1p", 0, 4, 0), ["p=0"]),
    (("zb1p", 4, 8, 4), ["stage=4", "p=4"]),
    (("zbv", 4, 8, -1), ["stage=-1"]),
])
def test_bad_schedule_inputs(args, words_):
    with pytest.raises(ValueError) as e:
        make_zero_bubble(*args)
    msg = str(e.value)
    assert all(w in msg for w in words_) and "\n" not in msg, msg


@pytest.mark.parametrize("call, words_", [
    (lambda: simulate([zb1p(2, 4, 0)], Placement(2)), ["got 1", "p=2"]),
    (lambda: simulate([[Action("X", 0)]], Placement(1)), ["kind='X'", "F/B/W"]),
    (lambda: simulate([[Action("F", 0, 1)]], Placement(1)), ["chunk=1", "0..0"]),
    (lambda: simulate([zb1p(1, 2, 0)], Placement(1), times=Times(W=0)), ["> 0", "W=0"]),
    (lambda: placement("gpipe", 2), ["'gpipe'", "zbv", "interleaved"]),
])
def test_bad_simulation_inputs(call, words_):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert all(w in msg for w in words_) and "\n" not in msg, msg


def _resolve(world, *extra):
    return resolve(load_config(None, ["strategy.pipeline.enable=true", "model.n_layers=8", "train.global_batch=16",
                                      *extra]), world)


@pytest.mark.parametrize("extra,world,message", [
    (["strategy.pipeline.schedule=zbv", "strategy.pipeline.virtual_stages=3", "strategy.pipeline.micro_batches=8"], 2,
     "pipeline.schedule = 'zbv' places 2 model chunks per rank (a V); pipeline.virtual_stages = 3 must be 2"),
    (["strategy.pipeline.schedule=zbv", "strategy.pipeline.micro_batches=4"], 4,
     "pipeline.schedule = 'zbv' needs pipeline.micro_batches >= 2 x degree - 1 = 7 for degree 4, got 4"),
    (["strategy.pipeline.schedule=zbv", "strategy.pipeline.micro_batches=8", "model.n_layers=6"], 4,
     "pipeline.degree x virtual_stages = 4 x 2 = 8 chunks but the model has only 6 blocks"),
    (["strategy.pipeline.schedule=zb1p", "strategy.pipeline.virtual_stages=2", "strategy.pipeline.micro_batches=4"], 2,
     "pipeline.virtual_stages = 2 needs pipeline.schedule = 'interleaved' (zbv always has 2; zb1p has 1)"),
])
def test_impossible_zero_bubble_layouts_are_one_clear_line(extra, world, message):
    with pytest.raises((ConfigError, ValueError)) as e:
        _resolve(world, *extra)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_zbv_takes_its_two_chunks_in_a_v():
    res = _resolve(4, "strategy.pipeline.schedule=zbv", "strategy.pipeline.micro_batches=8")
    assert (res.v, res.schedule) == (2, "zbv")
    cfg = load_config(None, ["model.n_layers=8"])
    every = model_chunks(cfg.model, res)
    assert every[0][0] == "embed" and every[-1][-1] == "head"
    # rank r: chunks r and 2p - 1 - r, so rank 0 holds the embedding and the head
    assert [stage_chunks(cfg.model, res, r) for r in range(4)] == [(every[r], every[7 - r]) for r in range(4)]
