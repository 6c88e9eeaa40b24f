"""The pipeline executor reads its micro-batches' losses (a 0-d device array each on a GPU: a read waits for
the device) only once every forward and backward of the pass is queued, in micro-batch order, and returns their
sum as the host adds them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hpengine.data.batch import Batch
from hpengine.strategies.pipeline import PipelineExecutor


class Loss:
    """A micro-batch's loss whose read is an event."""

    def __init__(self, value, mb, events):
        self.value, self.mb, self.events = value, mb, events

    def __float__(self):
        self.events.append(("read", self.mb))
        return self.value


@pytest.mark.parametrize("schedule,m", [("fthenb", 3), ("1f1b", 4)])
def test_losses_are_read_after_every_action(schedule, m):
    events, values = [], [0.1, 0.7, 1e-17, 2.5][:m]
    ex = PipelineExecutor(SimpleNamespace(rank=0, size=1), np, np.float64, 1, 1, m, schedule, 4)
    rows = iter(range(m))

    def forward(chunk, x, batch, grad):
        mb = next(rows)
        events.append(("F", mb))
        return Loss(values[mb], mb, events), mb

    def backward(chunk, dout, cache, defer):
        events.append(("B", cache))

    x = np.zeros((m, 2))
    loss = ex.run([("h.0",)], forward, backward, lambda last: None, Batch(x, x), True)
    kinds = [k for k, _ in events]
    assert kinds.count("F") == kinds.count("B") == kinds.count("read") == m
    assert kinds[-m:] == ["read"] * m and [mb for k, mb in events if k == "read"] == list(range(m))
    want = 0.0
    for v in values:
        want += v
    assert loss == want
