"""Would a library made for fusing element-wise chains speed up the CPU step? The GELU of the reference GPT's MLP
(its largest element-wise chain: 8 x 128 x 1024 float32 elements, forward and backward), as the engine computes it
(nn/activation.py: one NumPy ufunc a pass, in place), against the same formulas fused into one pass by numexpr
and by numba, where they are installed (neither is a dependency of hpengine: pip install numexpr numba). Rounds
interleave the sides; medians are quoted, each side's largest difference from NumPy's result, and the BLAS and
SIMD NumPy runs on. Numba's time excludes its compilation (done in the warm-up, and printed).

    OMP_NUM_THREADS=1 python benchmarks/bench_fused_cpu.py --repeats 5
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from _machine import cpu_name  # benchmarks/ is sys.path[0]
from _threads import ensure_threads

K, A = math.sqrt(2.0 / math.pi), 0.044715


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per side and round (default 20)")
    p.add_argument("--elements", type=int, default=8 * 128 * 1024, help="activation size (default the GPT's MLP)")
    p.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP/numexpr threads (default 1)")
    return p.parse_args(argv)


def numpy_side(np, x, dy):
    from hpengine.nn.activation import gelu_backward, gelu_forward  # noqa: PLC0415 - after the thread variables

    def forward():
        return gelu_forward(np, x)

    def backward(cache):
        return gelu_backward(np, dy, cache)
    return forward, backward


def numexpr_side(np, x, dy, threads):
    import numexpr as ne  # noqa: PLC0415 - optional
    ne.set_num_threads(threads)
    c1, c2, c3 = (np.float32(v) for v in (-2 * A * K, 2 * K, 6 * A * K))
    s, y, d = (np.empty_like(x) for _ in range(3))

    def forward():
        ne.evaluate("1 / (1 + exp((x * x * c1 - c2) * x))", out=s, local_dict={"x": x, "c1": c1, "c2": c2})
        ne.evaluate("x * s", out=y, local_dict={"x": x, "s": s})
        return y, (x, s)

    def backward(cache):
        xx, ss = cache
        ne.evaluate("((xx * xx * c3 + c2) * xx * (1 - ss) + 1) * ss * dy", out=d,
                    local_dict={"xx": xx, "ss": ss, "dy": dy, "c2": c2, "c3": c3})
        return d
    return forward, backward


def numba_side(np, x, dy):
    import numba  # noqa: PLC0415 - optional
    c1, c2, c3, one = (np.float32(v) for v in (-2 * A * K, 2 * K, 6 * A * K, 1.0))

    @numba.njit(cache=False)
    def fwd(x, y, s):
        for i in range(x.size):
            si = one / (one + np.exp((x[i] * x[i] * c1 - c2) * x[i]))
            s[i], y[i] = si, x[i] * si

    @numba.njit(cache=False)
    def bwd(x, s, dy, d):
        for i in range(x.size):
            d[i] = ((x[i] * x[i] * c3 + c2) * x[i] * (one - s[i]) + one) * s[i] * dy[i]
    s, y, d = (np.empty_like(x) for _ in range(3))

    def forward():
        fwd(x, y, s)
        return y, (x, s)

    def backward(cache):
        bwd(cache[0], cache[1], dy, d)
        return d
    return forward, backward


def timed(f, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls


def run(a) -> dict:
    import numpy as np  # noqa: PLC0415 - after the thread variables are set
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(a.elements) * 2).astype(np.float32)
    dy = rng.standard_normal(a.elements).astype(np.float32)
    sides, notes = {"numpy": numpy_side(np, x, dy)}, {}
    for name, make in (("numexpr", lambda: numexpr_side(np, x, dy, a.threads)), ("numba", lambda: numba_side(np, x, dy))):
        try:
            t0 = time.perf_counter()
            fwd, bwd = make()
            bwd(fwd()[1])                       # numba compiles here
            sides[name], notes[name] = (fwd, bwd), f"first call {time.perf_counter() - t0:.2f} s"
        except ImportError:
            notes[name] = "not installed"
    want_y, cache = sides["numpy"][0]()
    want_d = sides["numpy"][1](cache)
    diff = {}
    for name, (fwd, bwd) in sides.items():
        y, c = fwd()
        diff[name] = (float(np.abs(y - want_y).max()), float(np.abs(bwd(c) - want_d).max()))
    times = {name: ([], []) for name in sides}
    for _ in range(a.repeats):
        for name, (fwd, bwd) in sides.items():
            c = fwd()[1]
            times[name][0].append(timed(fwd, a.calls))
            times[name][1].append(timed(lambda: bwd(c), a.calls))
    blas = [d.get("architecture") for d in threadpool_info() if d.get("user_api") == "blas"]
    simd = getattr(np._core._multiarray_umath, "__cpu_features__", {})
    return {"cpu": cpu_name(), "elements": a.elements, "blas": blas,
            "avx512": bool(simd.get("AVX512_SKX")), "notes": notes, "diff": diff,
            "ms": {n: (1e3 * statistics.median(f), 1e3 * statistics.median(b)) for n, (f, b) in times.items()}}


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    r = run(a)
    print(f"GELU on {r['elements']:,} float32 elements, {r['cpu']}; NumPy's SIMD AVX-512: {r['avx512']}; "
          f"BLAS kernels {r['blas']}; {a.threads} thread(s); medians of {a.repeats} rounds x {a.calls} calls")
    base = sum(r["ms"]["numpy"])
    for name, (f, b) in r["ms"].items():
        df, db = r["diff"][name]
        print(f"  {name:8s} forward {f:6.3f} ms  backward {b:6.3f} ms  both {(f + b) / base:5.2f}x NumPy's time"
              f"  (max |diff| vs NumPy {df:.1e}, {db:.1e})")
    for name, note in r["notes"].items():
        print(f"  {name}: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
