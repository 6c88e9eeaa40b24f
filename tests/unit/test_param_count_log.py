"""The start-up line names the whole model's parameter count, also under pipeline parallelism, where each
rank holds a stage: the count equals the one-process run's, and the stage's share is shown beside it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
LINE = re.compile(r"model gpt: ([\d,]+) parameters, (\d+) blocks(?: \(pipeline stage 0 of 2: ([\d,]+) parameters, "
                  r"(\d+) blocks\))?,")


def start_line(tmp_path, small_corpus, n, name, *extra) -> re.Match:
    keys = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
            "model.tie_head=true", "train.global_batch=4", "train.steps=1", "runtime.backend='numpy'",
            f"data.path={small_corpus}", f"train.out_dir={tmp_path / name}", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    cmd = [str(BIN / "mpiexec"), "-n", str(n), str(BIN / "hpengine"), "train", *[x for k in keys for x in ("--set", k)]]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    found = LINE.search(res.stdout)
    assert found, res.stdout
    return found


def test_pipeline_start_line_counts_the_whole_model(tmp_path, small_corpus):
    if not (BIN / "mpiexec").exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    one = start_line(tmp_path, small_corpus, 1, "one")
    two = start_line(tmp_path, small_corpus, 2, "pp", "strategy.pipeline.enable=true")
    assert one.group(3) is None                        # no stage share without a pipeline
    assert two.group(1) == one.group(1) and two.group(2) == one.group(2) == "4"   # embed, 2 layers, head
    stage0 = int(two.group(3).replace(",", ""))
    assert 0 < stage0 < int(one.group(1).replace(",", "")) and two.group(4) == "2"
