"""tests/gpu, whose tests skip without a GPU, run here on the CuPy stand-in (tests/gpu/conftest.py installs it
under HPENGINE_STANDIN=1): every GPU test's own Python and the CuPy branches it drives run before a device is
lent, against the emulated kernels; only what needs the device itself (its compiler's errors, TF32 arithmetic)
skips, by name."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_tests_pass_on_the_standin():
    env = dict(os.environ, HPENGINE_STANDIN="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", r.stdout))
    assert counts.get("passed", 0) >= 150 and not counts.get("failed") and counts.get("skipped", 0) <= 3, tail
