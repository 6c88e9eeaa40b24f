"""Pipeline schedules as data (hpengine.layout.schedules): completeness and order of every stage's
actions, activation memory, deadlock-free simulation with the theoretical bubble, broken schedules
caught by the simulation, and input validation."""
from __future__ import annotations

from collections import Counter

import pytest

from hpengine.layout.schedules import (SCHEDULES, Action, bubble_fraction, fthenb, interleaved,
                                           make_schedule, one_f_one_b, peak_in_flight, placement, simulate)

PS = range(1, 9)
MS = range(1, 33)
VS = (2, 3)


def cases():
    """(name, p, m, v) over the whole grid; interleaved only where m % p == 0."""
    for p in PS:
        for m in MS:
            yield "fthenb", p, m, 1
            yield "1f1b", p, m, 1
            if m % p == 0:
                for v in VS:
                    yield "interleaved", p, m, v


def interleaved_warmup(p, m, stage, v):
    return min((p - stage - 1) * 2 + (v - 1) * p, m * v)


@pytest.mark.parametrize("name", ["fthenb", "1f1b", "interleaved"])
def test_every_unit_once_and_forward_before_backward(name):
    for sname, p, m, v in cases():
        if sname != name:
            continue
        for stage in range(p):
            acts = make_schedule(name, p, m, stage, v)
            units = {(mb, c) for mb in range(m) for c in range(v)}
            assert Counter((a.kind, a.mb, a.chunk) for a in acts) == Counter(
                [("F", *u) for u in units] + [("B", *u) for u in units]), (p, m, v, stage)
            where = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(acts)}
            assert all(where["F", mb, c] < where["B", mb, c] for mb, c in units), (p, m, v, stage)


def test_peak_in_flight():
    for p in PS:
        for m in MS:
            for stage in range(p):
                assert peak_in_flight(fthenb(p, m, stage)) == m
                # Megatron 1F1B: p - stage - 1 warm-up forwards plus the one in the steady state.
                assert peak_in_flight(one_f_one_b(p, m, stage)) == min(p - stage, m) <= p
            if m % p == 0:
                for v in VS:
                    for stage in range(p):
                        w = interleaved_warmup(p, m, stage, v)
                        assert peak_in_flight(interleaved(p, m, stage, v)) == min(w + 1, m * v)


def test_peak_in_flight_counts_chunks_separately():
    acts = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("F", 1, 0)]
    assert peak_in_flight(acts) == 2


def test_simulation_matches_theory_everywhere():
    # Each action is one round and each hop one round of latency, so the step is the critical path:
    # 2 * (work per stage + p - 1) rounds; for interleaved an action is one chunk (1/v of a stage),
    # which is exactly where the v in (p - 1) / (v * m + p - 1) comes from.
    for name, p, m, v in cases():
        r = simulate(p, m, name, v)
        work = m * v
        assert r["busy"] == [2 * work] * p
        assert r["rounds"] == 2 * (work + p - 1), (name, p, m, v)
        assert r["bubble"] == pytest.approx(bubble_fraction(name, p, m, v), abs=1e-12)


def test_interleaved_bubble_below_1f1b():
    for p in range(2, 9):
        for m in range(p, 33, p):
            b1 = simulate(p, m, "1f1b")["bubble"]
            for v in VS:
                assert simulate(p, m, "interleaved", v)["bubble"] < b1
                assert bubble_fraction("interleaved", p, m, v) < bubble_fraction("1f1b", p, m)


def test_one_process_has_no_bubble():
    for name, v in [("fthenb", 1), ("1f1b", 1), ("interleaved", 2)]:
        assert simulate(1, 4, name, v)["bubble"] == 0
        assert bubble_fraction(name, 1, 4, v) == 0


def test_known_orders():
    s = lambda acts: " ".join(map(str, acts))  # noqa: E731
    assert s(fthenb(3, 3, 1)) == "F0 F1 F2 B0 B1 B2"
    assert s(one_f_one_b(4, 6, 0)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert s(one_f_one_b(4, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert s(one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"
    # Megatron interleaving, p=2, m=4, v=2: forwards take micro-batches in groups of p through
    # chunk 0 then chunk 1; backwards the same groups through chunk 1 then chunk 0.
    assert s(interleaved(2, 4, 0, 2)) == ("F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 "
                                          "B2.c1 B3.c1 B2 B3")
    assert s(interleaved(2, 4, 1, 2)) == ("F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 "
                                          "F3.c1 B3.c1 B2 B3")


def deadlock(p, m, acts, v=1):
    with pytest.raises(RuntimeError, match="deadlock") as e:
        simulate(p, m, "broken", v, actions=acts)
    return str(e.value)


def test_backward_before_downstream_can_send_it_deadlocks():
    # Stage 0 wants B0 before sending F1; stage 1 sends B0 only after receiving F1: a cycle.
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    msg = deadlock(2, 2, [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1), B(0)]])
    assert "stage 0 waits at B0" in msg and "stage 1 waits at F1" in msg


def test_reversed_order_on_one_stage_deadlocks():
    acts = [one_f_one_b(2, 4, 0), one_f_one_b(2, 4, 1)[::-1]]
    deadlock(2, 4, acts)  # the reversal also puts B3 before F3 on stage 1
    by_mb = sorted(one_f_one_b(2, 4, 1), key=lambda a: -a.mb)  # F3 B3 F2 B2 ...: F before B kept
    msg = deadlock(2, 4, [one_f_one_b(2, 4, 0), by_mb])
    assert "stage 1 waits at F3" in msg


def test_interleaved_with_chunks_swapped_on_one_stage_deadlocks():
    p, m, v = 4, 8, 2
    acts = [interleaved(p, m, s, v) for s in range(p)]
    acts[2] = [Action(a.kind, a.mb, v - 1 - a.chunk) for a in acts[2]]
    deadlock(p, m, acts, v)


def test_backward_before_own_forward_deadlocks():
    msg = deadlock(1, 1, [[Action("B", 0), Action("F", 0)]])
    assert "stage 0 waits at B0" in msg


def test_simulate_wants_one_list_per_stage():
    with pytest.raises(ValueError, match="p=3"):
        simulate(3, 2, "1f1b", actions=[fthenb(3, 2, 0)])


@pytest.mark.parametrize("args, kw, words", [
    (("zigzag", 2, 4, 0), {}, ["'zigzag'", "fthenb", "1f1b", "interleaved"]),
    (("1f1b", 2, 0, 0), {}, ["m=0"]),
    (("fthenb", 0, 4, 0), {}, ["p=0"]),
    (("1f1b", 4, 8, 4), {}, ["stage=4", "p=4"]),
    (("1f1b", 4, 8, -1), {}, ["stage=-1"]),
    (("1f1b", 4, 8, 0), {"v": 2}, ["v=2", "interleaved"]),
    (("interleaved", 4, 8, 0), {"v": 1}, ["v=1"]),
    (("interleaved", 4, 6, 0), {"v": 2}, ["m=6", "p=4"]),
])
def test_bad_inputs(args, kw, words):
    with pytest.raises(ValueError) as e:
        make_schedule(*args, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_inputs_elsewhere():
    with pytest.raises(ValueError, match="m=10, p=4"):
        interleaved(4, 10, 0, 2)
    with pytest.raises(ValueError, match="'gpipe'"):
        bubble_fraction("gpipe", 4, 8)
    with pytest.raises(ValueError, match="m=6, p=4"):
        simulate(4, 6, "interleaved", 2)
    with pytest.raises(ValueError, match="m=0"):
        one_f_one_b(2, 0, 0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_what_a_schedule_declares_is_what_its_action_lists_do(name):
    """Each schedule's declared facts against its own action lists at p = 4 (no name tested elsewhere)."""
    kind, p = SCHEDULES[name], 4
    v = kind.chunks or 2
    m = max(kind.min_micro_batches(p), 2 * p)
    lists = [make_schedule(name, p, m, s, v) for s in range(p)]
    kinds = {a.kind for acts in lists for a in acts}
    assert kind.splits_backward == ("W" in kinds)
    assert kind.holds_every_microbatch == all(peak_in_flight(acts) == m * v for acts in lists)
    assert {a.chunk for acts in lists for a in acts} == set(range(v))
    assert placement(name, p).vee == kind.vee and placement(name, p, v).v == v
    if kind.min_micro_batches(p) > 1:
        with pytest.raises(ValueError):
            [make_schedule(name, p, kind.min_micro_batches(p) - 1, s, v) for s in range(p)]
