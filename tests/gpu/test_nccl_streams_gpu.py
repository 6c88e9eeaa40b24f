"""The device side of NCCL's point-to-point channels (backend.CudaNccl, dist/nccl_p2p.py) on one GPU: a channel's
own stream first waits for what the compute stream queued, and after join the compute stream waits for what the
channel's stream queued, with no host sync in between. No NCCL call (two ranks need two devices); a copy on
the channel's stream stands in for the transfer. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import pytest

from hpengine.device import backend

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")


def test_a_channel_stream_is_ordered_after_the_compute_stream_and_before_its_later_work():
    be = backend.Backend("cupy", "float64")
    cp, dev = be.xp, be.nccl_device()
    s = dev.new_stream()
    assert s is not dev.new_stream() and s.ptr != cp.cuda.get_current_stream().ptr
    a = cp.zeros(1 << 24)
    for _ in range(50):                 # long enough that an unordered copy would see a partial sum
        a += 1.0
    b = cp.empty_like(a)
    assert dev.stream(s) == s.ptr
    with s:
        b[...] = a                      # the "receive": on the channel's stream, after the producer of a
    ev = dev.record(s)
    dev.join(ev)
    b *= 2.0                            # compute-stream work after the join sees the copy
    assert float(b.min()) == float(b.max()) == 100.0
    dev.synchronize(ev)
    assert dev.done(ev)
