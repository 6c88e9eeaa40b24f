"""On a device: the AdamW and pack kernels' bandwidth against a device-to-device copy of the same bytes
(bandwidth.py measures), one Check each, judged against bandwidth.TARGET of the copy; unpack's figure rides
on the pack line.
"""
from __future__ import annotations

from hpengine.doctor import bandwidth as bw
from hpengine.doctor.checks import FAILED, OK, Check, reason

DEFAULT_PARAMS = 64 << 20         # AdamW parameters timed (1.75 GiB moved per launch)
REPS, INNER = 10, 5               # timed repetitions, launches per repetition


def run(cp, n_params: int = DEFAULT_PARAMS, reps: int = REPS, inner: int = INNER):
    """'speed: adamw kernel' and 'speed: pack kernel', each its bandwidth and the copy's."""
    n = max(1024, n_params - n_params % 4)
    try:
        res = bw.measure(cp, bw.EventTimer(cp), bw.device_name(cp), n, reps, inner)
    except Exception as e:  # noqa: BLE001 - out of memory, a launch failure
        why = f"{reason(e)} (with {n:,} parameters; hpengine doctor --speed-params takes fewer)"
        yield Check("speed: adamw kernel", FAILED, why)
        yield Check("speed: pack kernel", FAILED, why)
        return
    t, r = res["timings"], bw.ratios(res)
    for key, ref, size in (("adamw", "copy", f"{_count(n)} parameters x {bw.ADAMW_BYTES_PER_PARAM} B"),
                           ("pack", "pack_copy", f"{res['segments']} segments, {_count(res['message_bytes'])} bytes")):
        detail = (f"{bw.rate(t[key]['Bps'])} = {r[key]:.0%} of a copy's {bw.rate(t[ref]['Bps'])} ({t[ref]['how']}); "
                  f"{size}; target >= {bw.TARGET:.0%}")
        if key == "pack":
            detail += f"; unpack {r['unpack']:.0%}"
        yield Check(f"speed: {key} kernel", OK if r[key] >= bw.TARGET else FAILED, detail)


def _count(n: int) -> str:
    return f"{n / 2**20:.0f}M" if n >= 1 << 20 else f"{n / 2**10:.0f}k"
