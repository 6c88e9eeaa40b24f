"""benchmarks/bench_fused_cpu.py runs its NumPy side as the engine computes GELU and reports the optional sides
(numexpr, numba) as measured or not installed; where installed, their fused formulas agree with the engine's to
float32 rounding."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fused_cpu as bfc  # noqa: E402


def test_the_sides_run_and_agree():
    r = bfc.run(bfc.parse(["--repeats", "1", "--calls", "1", "--elements", "4096", "--threads", "0"]))
    assert set(r["ms"]) >= {"numpy"} and all(f > 0 and b > 0 for f, b in r["ms"].values())
    assert r["diff"]["numpy"] == (0.0, 0.0)
    for name in ("numexpr", "numba"):
        installed = importlib.util.find_spec(name) is not None
        assert (name in r["ms"]) == installed and (r["notes"][name] == "not installed") != installed
        if installed:
            assert max(r["diff"][name]) < 1e-4
    assert bfc.main(["--repeats", "1", "--calls", "1", "--elements", "1024", "--threads", "0"]) == 0
