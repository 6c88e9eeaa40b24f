"""plan --calibrate --device gpu's link measurement (calibrate_gpu.link_figures) run on NumPy buffers, the
same code the GPU path runs on device buffers: every rank agrees on positive, finite figures, counted as
the engine's allreduces, and the printed [cluster] table carries them (and leaves them out for one rank)."""
import math

import numpy as np

from helpers import need
from hpengine.planner import calibrate_gpu
from hpengine.dist.comm import Comm


def test_link_figures_on_host_buffers(world):
    need(world.Get_size() > 1, "a link needs two ranks")
    c = Comm(world, "calibrate")
    got = calibrate_gpu.link_figures(world, c, np, elements=(1 << 12, 1 << 18), reps=2)
    assert set(got) == set(calibrate_gpu.LINK_KEYS)
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    assert world.allgather(got) == [got] * world.Get_size()         # the slowest rank's times, everywhere
    assert c.stats["allreduce"][0] > 0
    vals = {k: 1.0 for k in calibrate_gpu.KEYS} | got
    text = calibrate_gpu.table(vals, "test device")
    assert f"intra_bw_gbs = {got['intra_bw_gbs']:.4g}" in text and "intra-node link" in text
    assert "intra_bw_gbs" not in calibrate_gpu.table({k: 1.0 for k in calibrate_gpu.KEYS}, "one rank")
