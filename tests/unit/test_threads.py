"""Each rank's BLAS/OpenMP pool: its bound cores over the node's ranks bound to overlapping cores, unless the
user set a thread count (runtime.blas_threads, or OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS);
the start-up log names the choice, and threadpoolctl inside the ranks reports it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy  # noqa: F401  (loads the BLAS library threadpoolctl reports)
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from hpengine.device import threads
from hpengine.config.load import ConfigError, load_config

BIN = Path(sys.executable).parent
NO_ENV = {}


ALL8 = range(8)


@pytest.mark.parametrize("mine, others, want, sharing", [
    (ALL8, [ALL8] * 3, 2, 4),                       # unbound (MPICH's default): every rank shares the node
    (ALL8, [], 8, 1),
    (range(4), [range(4, 8)], 4, 1),                # disjoint bindings do not share: 4, not 8 cores / 2 ranks
    ({0}, [{1}], 1, 1),                             # Open MPI's default at -n 2: one core each
    ({0}, [{0}] * 3, 1, 4),                         # at least 1
    (range(4), [{2, 3, 4, 5}, {6, 7}], 2, 2),       # only the overlapping rank counts
    (range(3), [range(3)], 1, 2),                   # rounded down
    (range(64), [range(64, 128)] * 3, 64, 1)])
def test_automatic_is_my_cores_over_the_ranks_bound_to_overlapping_cores(mine, others, want, sharing):
    n, why = threads.choose(0, mine, others, environ=NO_ENV)
    assert n == want
    assert f"bound to {len(set(mine))} core(s)" in why and f"shared by {sharing} of the {1 + len(others)} rank(s)" in why


def test_the_reason_names_the_bound_cores():
    assert threads.share({0, 1, 2, 3, 8, 10, 11}, [])[1].startswith(
        "automatic: this rank is bound to 7 core(s) (0-3,8,10-11), shared by 1 of the 1 rank(s)")
    assert threads.cores_text([5]) == "5" and threads.cores_text([]) == ""


def test_idle_cores_under_the_launcher_are_named_with_the_fix():
    note = threads.idle_note([{0}], parent=range(4))
    assert note.startswith("; cores 1-3 of the 4 the launcher may use run no rank") and "--bind-to none" in note
    assert threads.idle_note([{0}, {1}], parent={0, 1}) == ""      # -n 2 on 2 cores: every core has a rank
    assert threads.idle_note([ALL8], parent=ALL8) == "" and threads.idle_note([{0}], parent=()) == ""


@pytest.mark.parametrize("var", threads.ENV_VARS)
def test_a_thread_count_in_the_environment_is_left_alone(var):
    n, why = threads.choose(0, ALL8, [ALL8], environ={var: "3"})
    assert n is None and f"{var}=3" in why
    assert threads.choose(0, ALL8, [ALL8], environ={var: ""})[0] == 4          # empty = not set


def test_the_config_key_wins_over_everything():
    assert threads.choose(5, ALL8, [ALL8], environ={"OMP_NUM_THREADS": "1"})[0] == 5
    assert threads.choose(3, {0, 1}, [{0, 1}] * 7, environ=NO_ENV) == (3, "runtime.blas_threads = 3")


def test_bound_cores_is_the_affinity_mask():
    assert threads.bound_cores() == frozenset(os.sched_getaffinity(0))


def test_pin_sets_the_pools_and_the_line(monkeypatch):
    for v in threads.ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    blas = lambda: {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}  # noqa: E731
    if not blas():
        pytest.skip("threadpoolctl finds no BLAS library in this process")
    with threadpool_limits(limits=None):            # restores this process's pools afterwards
        line = threads.pin(3, {0})
        assert blas() == {3}
        assert line == threads.describe() and line.startswith("BLAS threads per rank: 3 (runtime.blas_threads = 3")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        threadpool_limits(limits=7)
        assert threads.pin(0, {0}) == "BLAS threads per rank: left as set in the environment (OMP_NUM_THREADS=2)"
        assert blas() == {7}                         # untouched


def test_a_negative_setting_is_one_clear_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["runtime.blas_threads=-1"])
    msg = str(e.value)
    assert "runtime.blas_threads" in msg and "-1" in msg and ">= 0" in msg and "\n" not in msg


RANK_SCRIPT = """
import json, os, sys
from mpi4py import MPI
from threadpoolctl import threadpool_info
from hpengine.config.load import load_config
from hpengine.run.train import train
train(load_config(None, json.loads(sys.argv[1])))
blas = sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(sys.argv[2], f"pools{rank}.json"), "w") as f:
    json.dump({"rank": rank, "blas": blas, "cores": len(os.sched_getaffinity(0))}, f)
"""


def test_two_ranks_without_thread_variables_pin_their_pools(tmp_path, small_corpus):
    if not (BIN / "mpiexec").exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    keys = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
            "train.global_batch=4", "train.steps=2", "runtime.backend='numpy'", f"data.path='{small_corpus}'",
            f"train.out_dir='{tmp_path / 'run'}'", "strategy.data_parallel.enable=true"]
    env = {k: v for k, v in os.environ.items()
           if k not in threads.ENV_VARS and not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    res = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-c", RANK_SCRIPT, json.dumps(keys),
                          str(tmp_path)],
                         capture_output=True, text=True, env={**env, "HPENGINE_CACHE": str(tmp_path / "c")},
                         cwd=tmp_path, timeout=180)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    pools = [json.loads((tmp_path / f"pools{r}.json").read_text()) for r in range(2)]
    assert sorted(p["rank"] for p in pools) == [0, 1]
    want = max(1, pools[0]["cores"] // 2)            # the affinity the ranks themselves see, 2 ranks per node
    assert all(p["blas"] == [max(1, p["cores"] // 2)] for p in pools), pools
    lines = [ln for ln in res.stdout.splitlines() if "BLAS threads per rank" in ln]
    assert len(lines) == 1, res.stdout                # logged once, by rank 0
    assert re.search(rf"BLAS threads per rank: {want} \(automatic: this rank is bound to {pools[0]['cores']} "
                     r"core\(s\) \([0-9,-]+\), shared by 2 of the 2 rank\(s\) on the node", lines[0]), lines[0]
