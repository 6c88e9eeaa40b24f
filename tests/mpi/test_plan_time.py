"""The planner's step time against the engine's (issue 10, 5(c)): `hpengine plan --calibrate` measures
this machine's primitive costs at this world size (-n 4, as the issue states it, and -n 2), then
several layouts of a small GPT train a few steps; each predicted step time is within 30% of the
measured median, and the prediction orders every two layouts whose measured times differ by more
than 30% as they measured. The machine may be shared and noisy: up to three attempts, each
calibrating and measuring afresh (layouts interleaved), and the test passes when one attempt meets
every condition; a failure shows each attempt's table.

Step times mean nothing while another job takes cores from the ranks (measured: the same layout 28 ms in
one attempt and 54 ms in the next beside one busy-looping process), and a burst of such work during a
calibration moves every prediction. So each attempt calibrates before and after measuring and predicts
from both; it is judged only when the two calibrations predict every layout within 15% of each other
and the ranks got at least 90% of the node's cores in effect in both (calibrate.cores_in_effect). The
prediction is the mean of the two. When no attempt could be judged, the test skips and says so."""
import statistics
import tempfile
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from helpers import need
from hpengine.calibrate import calibrate, physical_cores
from hpengine.config import load_config
from hpengine.plan import evaluate, load_cluster
from hpengine.plan_model import layout_of
from hpengine.train import build

S = "strategy."
DP = [S + "data_parallel.enable=true", S + "data_parallel.degree=-1"]
PP2 = [S + "pipeline.enable=true", S + "pipeline.degree=2", S + "pipeline.micro_batches=4",
       S + "pipeline.schedule=1f1b"]
TP2 = [S + "tensor_parallel.enable=true", S + "tensor_parallel.degree=2"]


def sharding(stage):
    return [S + "sharding.enable=true", S + "sharding.degree=-1", f"{S}sharding.stage={stage}"]


MODEL = ["model.kind=gpt", "model.d_model=64", "model.n_layers=4", "model.n_heads=2", "model.seq_len=32",
         "model.dtype=float32", "train.global_batch=8", "train.eval_every=0", "runtime.backend=numpy"]
# (name, overrides) per world size: layouts whose measured times differ, so the ranking is tested too
LAYOUTS = {4: [("dp 4", DP), ("sharding 2 x 4", sharding(2)), ("sharding 3 x 4", sharding(3)),
               ("pp 2 (1f1b, m 4) x dp 2", PP2 + DP), ("tp 2 x dp 2", TP2 + DP),
               ("tp 2 x pp 2 (1f1b, m 4)", TP2 + PP2)],
           2: [("dp 2", DP), ("sharding 3 x 2", sharding(3)), ("pp 2 (1f1b, m 4)", PP2), ("tp 2", TP2)]}
TOLERANCE, ATTEMPTS, ROUNDS, WARMUP, STEPS = 0.30, 4, 2, 2, 3
STABLE = 0.15                    # the two calibrations of an attempt predict every layout this close


def measure(engines, world):
    """Median step seconds of each engine (a step lasts as long as its slowest rank), rounds interleaved;
    each visit starts with untimed steps (more on the first: buffers are allocated, caches filled)."""
    times, done = {name: [] for name in engines}, dict.fromkeys(engines, 0)
    for r in range(ROUNDS):
        for name, eng in engines.items():
            untimed = WARMUP if r == 0 else 1
            for i in range(untimed + STEPS):
                world.Barrier()
                t = time.perf_counter()
                eng.train_step(done[name])
                done[name] += 1
                if i >= untimed:
                    times[name].append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return {name: statistics.median(v) for name, v in times.items()}


def calibrated(world, path):
    path.write_text(world.bcast(calibrate(), root=0))
    return load_cluster(str(path))


def attempt(corpus, world, tmp):
    """(table, problems, why it is not judged or "") of one measurement of every layout between two
    calibrations."""
    n = world.Get_size()
    cfgs = {name: load_config(None, MODEL + [f"data.path={corpus}", *extra]) for name, extra in LAYOUTS[n]}
    before = calibrated(world, tmp / "before.toml")
    measured = measure({name: build(cfg, world) for name, cfg in cfgs.items()}, world)
    after = calibrated(world, tmp / "after.toml")
    pred = [{name: evaluate(cfg, layout_of(cfg, n), c)["time"]["step"] for name, cfg in cfgs.items()}
            for c in (before, after)]
    predicted = {name: (pred[0][name] + pred[1][name]) / 2 for name in cfgs}
    full = min(n, physical_cores())
    cores = min(before.cores_per_node, after.cores_per_node)
    drift = max(abs(pred[1][name] / pred[0][name] - 1) for name in cfgs)
    why = (f"the ranks had {cores:.2f} of {full} cores in effect" if cores < 0.9 * full else
           f"the two calibrations predict {drift:.0%} apart" if drift > STABLE else "")
    return *report(predicted, measured), why



def report(predicted, measured):
    problems, rows = [], [f"{'layout':<26} {'predicted ms':>12} {'measured ms':>11} {'ratio':>6}"]
    for name in predicted:
        ratio = predicted[name] / measured[name]
        rows.append(f"{name:<26} {predicted[name] * 1e3:>12.2f} {measured[name] * 1e3:>11.2f} {ratio:>6.2f}")
        if abs(ratio - 1) > TOLERANCE:
            problems.append(f"{name}: predicted / measured = {ratio:.2f}")
    for a in predicted:
        for b in predicted:
            if measured[a] > (1 + TOLERANCE) * measured[b] and not predicted[a] > predicted[b]:
                problems.append(f"{a}: measured {measured[a] / measured[b]:.2f}x as long as {b}, predicted no longer")
    return "\n".join(rows), problems


def test_predicted_step_time_within_30_percent(corpus, world):
    need(world.Get_size() in LAYOUTS, "5(c) is checked at -n 4 (as issue 10 states it) and -n 2")
    tables, judged = [], 0
    for i in range(ATTEMPTS):
        # each rank its own folder (pytest's tmp_path, cleaned up by every rank at once, races under MPI)
        with tempfile.TemporaryDirectory(prefix="hpengine-plan-time-") as tmp:
            table, problems, why = attempt(corpus, world, Path(tmp))
        if not problems:
            return
        judged += not why
        tables.append(f"attempt {i + 1}{f' (not judged: {why})' if why else ''}:\n{table}"
                      + "".join(f"\n  {p}" for p in problems))
    if not judged:
        pytest.skip("other work held the cores in every attempt; step times not judged\n" + "\n".join(tables))
    raise AssertionError("no attempt predicted every layout within 30% in the measured order\n" + "\n".join(tables))
