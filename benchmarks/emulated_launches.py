"""What one training step would launch on a GPU, counted on the CPU: the engine runs with runtime.backend = "cupy"
on the NumPy stand-in for CuPy of tests/unit/emulated_cupy.py, which counts every RawKernel, ElementwiseKernel
and cuBLAS call, every CuPy ufunc call and every array-writing function or copy (CuPy launches about one kernel
for each), the bfloat16 conversions (ElementwiseKernels, pack_bf16) with the bytes they move, and the host's reads
of device arrays (each a wait for the device on a GPU). Deterministic: no timing, no GPU.

    .venv/bin/python benchmarks/emulated_launches.py configs/default.toml
    .venv/bin/python benchmarks/emulated_launches.py configs/llama_small.toml --set strategy.amp.enable=true \
        --set strategy.amp.dtype=bfloat16 --top 15
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))       # the stand-in lives beside the tests that check it


class _Patch:
    """Just what emulated_cupy.install needs of pytest's monkeypatch, kept for the life of the process."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)

    def setitem(self, mapping, key, value):
        mapping[key] = value


def main(argv=None, patch=None) -> int:
    """patch: what installs the stand-in (pytest's monkeypatch in a test; else for the life of the process)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="a config file (TOML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=10, help="list the most frequent launches (default 10)")
    a = p.parse_args(argv)
    import emulated_cupy  # noqa: PLC0415 - after sys.path has tests/unit
    from mpi4py import MPI  # noqa: PLC0415
    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    emulated_cupy.install(patch or _Patch())
    cfg = load_config(a.config, ["runtime.backend=cupy", *a.overrides])
    eng = build(cfg, MPI.COMM_SELF)
    eng.train_step(0)                              # first step: plans, kernel tables, allocations
    emulated_cupy.LAUNCHES.clear()
    emulated_cupy.MOVED.clear()
    emulated_cupy.READS.clear()
    eng.train_step(1)
    counts = emulated_cupy.LAUNCHES
    kinds = collections.Counter()
    for k, v in counts.items():
        kinds[k.split(":")[0]] += v
    print(f"{a.config} {' '.join(a.overrides)}")
    print(f"launches per step: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in kinds.most_common())})")
    moved = sum(emulated_cupy.MOVED.values())
    if moved:
        conv = sum(counts[k] for k in emulated_cupy.MOVED)      # the ElementwiseKernels' and pack_bf16's
        print(f"bfloat16 conversion kernels: {conv} launches, {moved / 2**20:.1f} MiB moved")
    reads = emulated_cupy.READS
    kinds_read = ", ".join(f"{k} {v}" for k, v in sorted(reads.items()))
    print(f"host reads of device arrays per step: {sum(reads.values())} ({kinds_read})")
    for k, v in counts.most_common(a.top):
        print(f"{v:6d}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
