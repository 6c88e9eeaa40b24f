"""gpu_check's bandwidth worker: the fused AdamW, pack and unpack kernels timed against a copy of the same
bytes (cudaMemcpy and an element-wise copy, the faster one kept), interleaved repetitions, medians. On the
GPU it times with CUDA events; with --cpu-smoke the NumPy twins run under a host timer. Byte model: AdamW
reads p, g, m, v and writes p, m, v (28 B per float32 parameter); bandwidths count read plus written.
"""
from __future__ import annotations

import statistics
import time

from gpu_check_report import adamw_traffic, bandwidth, copy_nbytes_for


class EventTimer:
    """Seconds per call of fn, from CUDA events around `inner` back-to-back calls on the current stream."""

    def __init__(self, cupy):
        self.cp = cupy

    def __call__(self, fn, inner: int) -> float:
        s = self.cp.cuda.get_current_stream()
        e0, e1 = self.cp.cuda.Event(), self.cp.cuda.Event()
        e0.record(s)
        for _ in range(inner):
            fn()
        e1.record(s)
        e1.synchronize()
        return self.cp.cuda.get_elapsed_time(e0, e1) / 1e3 / inner


class HostTimer:
    """The CPU stand-in: wall time per call."""

    def __call__(self, fn, inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


def pack_segments(n: int, k: int, seed: int = 0):
    """k segments over a buffer of n floats, each starting on a 16-byte boundary and a multiple of 4
    long, with small gaps between them (the tensors of a gradient bucket); together about 90 % of n."""
    import random                                        # noqa: PLC0415
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(k)]
    gaps = [4 * rng.randint(1, 16) for _ in range(k)]
    room = int(0.9 * n) - sum(gaps)
    sizes = [max(4, int(room * w / sum(weights)) // 4 * 4) for w in weights]
    offsets, pos = [], 0
    for s, gap in zip(sizes, gaps):
        pos += gap
        offsets.append(pos)
        pos += s
    assert pos <= n, (pos, n)
    return offsets, sizes


def device_setup(cpu_smoke: bool, cpu_name: str) -> tuple:
    """(array module, timer, device name) of a worker: NumPy and the host clock with --cpu-smoke, else CuPy and
    CUDA events on the current device."""
    if cpu_smoke:
        import numpy as np                               # noqa: PLC0415
        return np, HostTimer(), cpu_name
    import cupy as xp                                    # noqa: PLC0415
    name = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
    return xp, EventTimer(xp), name.decode() if isinstance(name, bytes) else str(name)


def worker_bandwidth(a) -> dict:
    from hpengine.device import kernels                         # noqa: PLC0415
    import numpy as np                                   # noqa: PLC0415
    xp, timer, device = device_setup(a.cpu_smoke, "cpu (NumPy twins)")
    n, f32 = a.bw_params, np.float32

    def rand(size, scale=1.0):
        if xp is np:
            return (np.random.default_rng(size).standard_normal(size, dtype=f32) * f32(scale))
        return xp.random.standard_normal(size, dtype=f32) * f32(scale)

    # AdamW over n parameters, against a copy of 14 bytes per parameter (same traffic, 28 B/param)
    p, g, m = rand(n), rand(n, 1e-2), rand(n, 1e-3)
    v = xp.abs(rand(n, 1e-2)) ** 2
    mask = xp.ones(n, dtype=xp.uint8)                   # decay on the matrices; the last 1/16 (norms, biases)
    mask[n - n // 16:] = 0                               # without (few long runs, as in a real layout)
    coefs = kernels.adamw_coefs(10, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0)
    traffic = adamw_traffic(n)
    csrc = rand(copy_nbytes_for(traffic) // 4)
    cdst = xp.empty_like(csrc)
    # pack: k segments of a buffer of n floats into one message, against a copy of the message's bytes
    offsets, sizes = pack_segments(n, a.pack_segments)
    psrc = rand(n)
    msg = xp.full(sum(sizes), xp.nan, dtype=f32)
    mcopy = xp.empty_like(msg)
    kernels.pack(msg, psrc, offsets, sizes)
    if bool(xp.isnan(msg).any()):
        raise RuntimeError("pack left elements of the message unwritten")
    ops = {
        "adamw": (traffic, lambda: kernels.adamw(p, g, m, v, mask, coefs)),
        "pack": (2 * msg.nbytes, lambda: kernels.pack(msg, psrc, offsets, sizes)),
        "unpack": (2 * msg.nbytes, lambda: kernels.unpack(msg, psrc, offsets, sizes)),
        "copy:elementwise": (2 * cdst.nbytes, lambda: xp.copyto(cdst, csrc)),
        "pack_copy:elementwise": (2 * mcopy.nbytes, lambda: xp.copyto(mcopy, msg)),
    }
    if xp is not np:
        ops["copy:memcpy"] = (2 * cdst.nbytes, lambda: cdst.data.copy_from_device_async(csrc.data, csrc.nbytes))
        ops["pack_copy:memcpy"] = (2 * mcopy.nbytes,
                                   lambda: mcopy.data.copy_from_device_async(msg.data, msg.nbytes))
    times = {k: [] for k in ops}
    warm = 2 if a.cpu_smoke else 3
    for rep in range(warm + a.bw_reps):                  # interleaved: clocks drift alike for every op
        for k, (_, fn) in ops.items():
            t = timer(fn, a.bw_inner)
            if rep >= warm:
                times[k].append(t)
    if bool(xp.isnan(p).any()):
        raise RuntimeError("AdamW produced NaN")
    timings = {}
    for k, (tr, _) in ops.items():
        timings[k] = {"traffic": tr, "median_s": statistics.median(times[k]), "min_s": min(times[k]),
                      "reps": len(times[k]), "Bps": bandwidth(tr, statistics.median(times[k]))}
    for ref in ("copy", "pack_copy"):                   # the reference: the faster way to copy those bytes
        best = max((k for k in timings if k.startswith(ref + ":")), key=lambda k: timings[k]["Bps"])
        timings[ref] = dict(timings[best], how=best.split(":")[1])
    return {"device": device, "n_params": n, "segments": len(sizes), "message_bytes": int(msg.nbytes),
            "inner": a.bw_inner, "timings": timings}
