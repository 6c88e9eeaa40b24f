"""Kernel speed: the fused AdamW, pack and unpack kernels timed against a copy of the same bytes (cudaMemcpy and
an element-wise copy, the faster one kept), interleaved repetitions, medians; CUDA events on a device, a host
timer over the NumPy twins otherwise. Byte model: AdamW reads p, g, m, v and writes p, m, v (28 B per float32
parameter, the 1-byte decay mask not counted); bandwidths count bytes read plus bytes written.
"""
from __future__ import annotations

import random
import statistics
import time

import numpy as np

from hpengine.device import backend, kernels

ADAMW_BYTES_PER_PARAM = 28        # read p, g, m, v + write p, m, v (float32); the mask byte not counted
TARGET = 0.85                     # a kernel's bandwidth / the copy's, below which it is too slow
JUDGED = ("adamw", "pack")        # unpack is information


def adamw_traffic(n_params: int) -> int:
    """Bytes the fused AdamW moves for n float32 parameters (read p, g, m, v; write p, m, v)."""
    return ADAMW_BYTES_PER_PARAM * n_params


def copy_nbytes_for(traffic: int) -> int:
    """Size of the device-to-device copy whose traffic (bytes read + bytes written) equals `traffic`."""
    return traffic // 2


def bandwidth(traffic: int, seconds: float) -> float:
    """Bytes per second, counting bytes read plus bytes written."""
    return traffic / seconds if seconds > 0 else float("inf")


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
    if pos > n:
        raise ValueError(f"pack_segments: {k} segments need {pos} elements; the buffer has {n} (use fewer segments)")
    return offsets, sizes


def device_name(cupy) -> str:
    """The current CUDA device's name."""
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_setup(on_host: bool, cpu_name: str) -> tuple:
    """(array module, timer, device name): NumPy and the host clock when on_host, else CuPy and CUDA events on
    the current device."""
    if on_host:
        return np, HostTimer(), cpu_name
    cupy = backend.cupy_module()
    return cupy, EventTimer(cupy), device_name(cupy)


def measure(xp, timer, device: str, n: int, reps: int, inner: int, segments: int = 64, warm: int = 3) -> dict:
    """Times AdamW over n float32 parameters (n a multiple of 4: whole 16-byte vectors) and pack/unpack of
    `segments` segments of an n-float buffer, each against a copy of the same bytes; `reps` interleaved timed
    repetitions of `inner` back-to-back launches after `warm` untimed ones. {"timings": {op: {"traffic",
    "median_s", "min_s", "reps", "Bps"}}, ...}; "copy" and "pack_copy" are the faster way to copy."""
    if n < 1024 or n % 4:
        raise ValueError(f"measure: n = {n}; a multiple of 4 of at least 1024 is needed (whole 16-byte vectors)")
    f32 = np.float32

    def rand(size, scale=1.0):
        if xp is np:
            return np.random.default_rng(size).standard_normal(size, dtype=f32) * f32(scale)
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
    offsets, sizes = pack_segments(n, segments)
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
    for rep in range(warm + reps):                       # interleaved: clocks drift alike for every op
        for k, (_, fn) in ops.items():
            t = timer(fn, inner)
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
            "inner": inner, "timings": timings}


def ratios(res: dict) -> dict[str, float]:
    """Each kernel's bandwidth over its copy's: {"adamw", "pack", "unpack"}."""
    t = res["timings"]
    return {k: t[k]["Bps"] / t["copy" if k == "adamw" else "pack_copy"]["Bps"] for k in ("adamw", "pack", "unpack")}


def rate(bps: float) -> str:
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e11 else f"{bps / 1e9:.1f} GB/s"
