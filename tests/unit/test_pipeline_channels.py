"""The pipeline's point-to-point channels, one per (global chunk received, direction): in every schedule, over
the schedule tests' whole grid, the sender issues each channel's micro-batches in the same order as the
receiver (NCCL matches a send with a receive by that order alone), training and evaluation; and the executor
opens exactly the channels the schedules use. The traffic is derived here from the action lists and the
placement, not from the executor."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np

from hpengine.layout.schedules import SCHEDULES, chunks_per_stage, make_schedule, placement
from hpengine.strategies.pipeline import PipelineExecutor

PS = range(1, 9)
MS = range(1, 33)
VS = (2, 3)
FWD, BWD = 0, 1


def cases():
    """(name, p, m, v): every schedule over the grid of tests/unit/test_schedules.py and test_zero_bubble.py."""
    for name in SCHEDULES:
        for p in PS:
            for m in MS:
                if name == "interleaved":
                    yield from ((name, p, m, v) for v in VS if m % p == 0)
                elif name != "zbv" or m >= 2 * p - 1:
                    yield name, p, m, chunks_per_stage(name) or 1


def traffic(name, p, v, lists, key=lambda g, d: (g, d)):
    """({(src, dst, key(g_dst, direction)): [(g_dst, direction, micro-batch) in the sender's issue order]},
    the same in the receiver's order) for the per-stage action lists: an F on virtual stage g receives g's
    activations (g > 0) and sends g + 1's (g < V - 1); a B receives g's output gradient (g < V - 1) and sends
    g - 1's (g > 0). Pairs on one stage (ZB-V's turn) pass in memory and are left out."""
    place, V = placement(name, p, v), p * v
    st = place.stage_of
    sent, got = defaultdict(list), defaultdict(list)
    for s, actions in enumerate(lists):
        for a in actions:
            g = place.virtual(s, a.chunk)
            if a.kind == "F":
                ins, outs = [(g - 1, g, FWD)] if g > 0 else [], [(g + 1, FWD)] if g < V - 1 else []
            elif a.kind == "B":
                ins, outs = [(g + 1, g, BWD)] if g < V - 1 else [], [(g - 1, BWD)] if g > 0 else []
            else:
                continue
            for g_src, g_dst, d in ins:
                if st(g_src) != s:
                    got[st(g_src), s, key(g_dst, d)].append((g_dst, d, a.mb))
            for g_dst, d in outs:
                if st(g_dst) != s:
                    sent[s, st(g_dst), key(g_dst, d)].append((g_dst, d, a.mb))
    return dict(sent), dict(got)


def training(name, p, m, v):
    return [make_schedule(name, p, m, s, v) for s in range(p)]


def test_every_channel_is_sent_and_received_in_one_order():
    for name, p, m, v in cases():
        sent, got = traffic(name, p, v, training(name, p, m, v))
        assert sent.keys() == got.keys(), (name, p, m, v)
        for ch, msgs in sent.items():
            # the same order on both ends, and it is micro-batch order
            assert msgs == got[ch] == [(*ch[2], mb) for mb in range(m)], (name, p, m, v, ch, msgs, got[ch])


def executor(name, p, m, v, stage=0):
    """The executor of `stage` over a fake pp communicator that records the channels it is asked to open."""
    comm = SimpleNamespace(rank=stage, size=p, opened=[])
    comm.open_channels = comm.opened.extend
    return PipelineExecutor(comm, np, np.float64, p, v, m, name, 4), comm


def test_evaluation_takes_each_channel_in_one_order_too():
    for name, p, m, v in cases():
        if p > 1 and m in (1, 2 * p + 1):
            lists = [executor(name, p, m, v, s)[0]._forward_only() for s in range(p)]
            sent, got = traffic(name, p, v, lists)
            assert sent and all(msgs == got[ch] == [(*ch[2], mb) for mb in range(m)]
                                for ch, msgs in sent.items()), (name, p, m, v)


def test_the_executor_opens_the_channels_the_schedule_uses():
    for name, p, m, v in cases():
        if m == (2 * p - 1 if name == "zbv" else p * 2):
            sent, _ = traffic(name, p, v, training(name, p, m, v))
            ex, comm = executor(name, p, m, v)
            assert {c for c in ex.channels() if c[0] != c[1]} == set(sent), (name, p, v)
            assert comm.opened == (ex.channels() if p > 1 else [])


def test_one_channel_per_neighbour_would_mismatch_under_zbv():
    # why the key is (g_dst, direction), not just the neighbour: under ZB-V a stage sends chunk-0 activations
    # and chunk-1 gradients to its neighbour in another order than the neighbour receives them, and NCCL
    # would hand a receive another chunk's or micro-batch's data
    for p in (2, 3, 4):
        sent, got = traffic("zbv", p, 2, training("zbv", p, 2 * p, 2), key=lambda g, d: None)
        assert any(sent[ch] != got[ch] for ch in sent), p


def test_a_broken_order_is_caught():
    # the check can fail: two forwards of one chunk swapped on the receiving stage
    lists = training("1f1b", 2, 4, 1)
    i, j = (k for k, a in enumerate(lists[1]) if a.kind == "F" and a.mb in (1, 2))
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    sent, got = traffic("1f1b", 2, 1, lists)
    ch = (0, 1, (1, FWD))
    assert [mb for *_, mb in sent[ch]] == [0, 1, 2, 3] and [mb for *_, mb in got[ch]] == [0, 2, 1, 3]
