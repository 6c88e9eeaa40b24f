"""`hpengine plan --check` of a DiLoCo config: the replica communicator's bytes per step and the islands' link time,
against the figures worked out here from the model's parameter count (the engine's counters are checked in
tests/mpi/test_plan_vs_engine.py)."""
from __future__ import annotations

import math
import re

import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.models import build_model

MODEL = ["model.kind=llama", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
         "model.ffn_hidden=128", "train.global_batch=16"]


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_check_gives_replica_bytes_and_link_time(tmp_path, capsys, quantize):
    """4 islands of one rank, H = 10, float32: an outer period moves n x 4 bytes (one allreduce), or twice one
    payload of a byte (int8) or half (int4) per value of each tensor padded to blocks of 256, plus 4 bytes per block
    (the alltoallv of its chunks, the allgather of the averaged chunks); 8 Mbit/s and 20 ms take 20 ms + bytes /
    1e6 s per call, once a period."""
    sets = MODEL + ["model.dtype=float32", "strategy.diloco.enable=true", "strategy.diloco.inner_steps=10",
                    f"strategy.diloco.quantize={quantize}", "runtime.replica_link=8Mbit/s,20ms"]
    sizes = [math.prod(sp.global_shape) for sp in build_model(load_config(None, sets).model).all_specs()]
    n, blocks = sum(sizes), sum(-(-k // 256) for k in sizes)       # the blocks start at each tensor
    payload = {"int8": 256 * blocks + 4 * blocks, "int4": 128 * blocks + 4 * blocks}.get(quantize)
    calls = {"none": [4 * n]}.get(quantize, [payload, payload])
    cfg = tmp_path / "diloco.toml"
    cfg.write_text('[model]\nkind = "llama"\n')
    args = ["plan", "--check", str(cfg), "--world", "4", "--nodes", "1", "--gpus-per-node", "4"]
    assert main(args + sum((["--set", s] for s in sets), [])) == 0
    out = capsys.readouterr().out
    ops = ["allreduce"] if quantize == "none" else ["alltoallv", "allgather"]
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("replica:"))
    assert all(op in line for op in ops) and ("alltoallv" in line) == (quantize != "none"), line
    shown = re.search(r"the replica bytes take ([\d.]+) (ms|us|s) per step", out)
    secs = float(shown.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6}[shown.group(2)]
    assert secs == pytest.approx(sum(0.02 + b / 1e6 for b in calls) / 10, rel=1e-2)     # shown to 3 digits
