"""`hpengine plan` on 2 sites of 2 nodes behind a 1 Gbit/s, 50 ms link: collectives that cross the link are timed
at its rate, DiLoCo candidates (2 islands) carry the replica bytes and link time worked out here from the model's
parameter count, a cluster without sites plans as before, and bad site values are one line each."""
from __future__ import annotations

import math

import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.models import build_model
from hpengine.planner import islands
from hpengine.planner.cluster import Cluster, PlanError, load_cluster
from hpengine.planner.model import predict_layout
from hpengine.planner.search import config_for, searched

MODEL = ["model.kind=gpt", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32",
         "model.dtype=float32", "train.global_batch=16"]
SITES = dict(nodes=4, gpus_per_node=1, mem_gb=16, site_nodes=2, site_bw_gbs=0.125, site_latency_ms=50)
RATE, LAT = 0.125e9, 0.05             # 1 Gbit/s, 50 ms
INTER_RATE, INTER_LAT = 25e9, 10e-6   # Cluster's defaults between nodes


def sizes(cfg) -> list[int]:
    return [math.prod(sp.global_shape) for sp in build_model(cfg.model).all_specs()]


def cluster_file(tmp_path, **keys):
    f = tmp_path / "sites.toml"
    f.write_text("# two sites\n[cluster]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    return str(f)


def test_dp_across_sites_pays_the_slow_link():
    """dp 4 over 4 nodes of 2 sites, nothing hidden (overlap 0): the gradient allreduce (4 bytes a parameter + the
    8-byte loss, one bucket) takes 2(n-1)/n bytes / 0.125 GB/s + log2(4) x 50 ms, the loss's scalar allreduce
    2 x 50 ms; the step is longer than on one fabric by exactly the difference of the two links."""
    cfg = load_config(None, MODEL + ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=4"])
    lay = resolve(cfg, 4)
    sites, flat = Cluster(overlap=0.0, **SITES), Cluster(overlap=0.0, nodes=4, gpus_per_node=1, mem_gb=16)
    b = 4 * sum(sizes(cfg)) + 8
    dp_site, dp_flat = 1.5 * b / RATE + 2 * LAT, 1.5 * b / INTER_RATE + 2 * INTER_LAT
    r, f = predict_layout(cfg, lay, sites), predict_layout(cfg, lay, flat)
    assert r["time"]["dp"] == pytest.approx(dp_site, rel=1e-12)
    assert r["time"]["step"] - f["time"]["step"] == pytest.approx(dp_site - dp_flat + 2 * (LAT - INTER_LAT),
                                                                  rel=1e-9)
    assert islands.crossing(r, sites) == [("dp", b, pytest.approx(dp_site))]


def test_only_groups_that_cross_pay():
    """dp 2 x pp 2 (pp outermost): each dp pair sits in one site, the two stages in different sites."""
    cfg = load_config(None, MODEL + ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2",
                                     "strategy.pipeline.enable=true", "strategy.pipeline.degree=2",
                                     "strategy.pipeline.micro_batches=2"])
    r = predict_layout(cfg, resolve(cfg, 4), Cluster(**SITES))
    assert [axis for axis, _, _ in islands.crossing(r, Cluster(**SITES))] == ["pp"]


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("h", islands.INNER_STEPS)
def test_diloco_candidate_replica_bytes_and_link_time(h, quantize):
    """Islands of dp 2 on each site, float32: a period moves the parameters once, 4 bytes each (allreduce), or
    both islands' int8 payloads (a byte a value, each tensor padded to blocks of 256, plus 4 bytes a block); per
    step that over H. The link takes 50 ms a call (one allreduce, or int8's two) + period bytes / 0.125 GB/s; the step
    adds that / H to the island's own step."""
    cfg = load_config(None, MODEL)
    cluster = Cluster(**SITES)
    island_cfg, island_cluster = islands.island_search_inputs(cfg, cluster)
    assert (island_cfg.train.global_batch, island_cluster.world) == (8, 2)
    inner = load_config(None, MODEL + ["train.global_batch=8", "strategy.data_parallel.enable=true",
                                       "strategy.data_parallel.degree=2"])
    island = resolve(inner, 2)
    c = islands.candidate(cfg, island_cfg, island, cluster, config_for, h, quantize)
    n, blocks = sum(sizes(cfg)), sum(-(-k // 256) for k in sizes(cfg))
    period = 4 * n if quantize == "none" else 2 * (256 * blocks + 4 * blocks)
    assert c["layout"].islands == 2 and c["layout"].dp == 2
    assert c["replica_bytes"] == pytest.approx(period / h, rel=1e-12)
    calls = 1 if quantize == "none" else 2          # the int8 exchange's alltoallv and allgather each wait the latency
    assert c["time"]["replica"] == pytest.approx((calls * LAT + period / RATE) / h, rel=1e-12)
    alone = predict_layout(inner, island, island_cluster)["time"]["step"]
    assert c["time"]["step"] == pytest.approx(alone + (calls * LAT + period / RATE) / h, rel=1e-12)
    sets = islands.settings(cfg, c["config"]).split()
    assert f"strategy.diloco.inner_steps={h}" in sets and "strategy.diloco.replicas=2" in sets
    again = load_config(None, MODEL + [s for s in sets if s != "--set"])     # what the user pastes
    assert resolve(again, 4).islands == 2 and resolve(again, 4).dp == 2


def test_plan_lists_diloco_apart_with_settings(tmp_path, capsys):
    """The command: the exact table first, the slow link's cost of its best, then the DiLoCo rows (each H and
    quantize once), the note that DiLoCo changes the optimisation, and one line of settings that resolve to 2
    islands."""
    path = cluster_file(tmp_path, **SITES)
    assert main(["plan", *sum((["--set", s] for s in MODEL), []), "--cluster", path, "--top", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "0.125 GB/s and 50 ms between 2 sites of 2 nodes" in " ".join(lines[:3])
    assert any(ln.startswith("slow link: the link between sites (0.125 GB/s, 50 ms)") for ln in lines)
    text = " ".join(" ".join(lines).split())
    assert "DiLoCo changes the optimisation: it is not the same run as one process" in text
    assert text.index("best: ") < text.index("DiLoCo: one island per site (2 islands of 2 x 1 devices)")
    head = next(ln for ln in lines if "H quant" in ln)
    rows = lines[lines.index(head) + 2:][:4]
    assert len({tuple(r.split("|")[1].split()) for r in rows}) == 4            # each (H, quantize) once
    assert all(len(ln) <= 120 for ln in lines if not ln.startswith("  --set"))
    sets = next(ln for ln in lines if ln.startswith("  --set")).split()
    assert "strategy.diloco.enable=true" in sets and "strategy.diloco.replicas=2" in sets
    assert resolve(load_config(None, MODEL + [s for s in sets if s != "--set"]), 4).islands == 2


def test_without_sites_the_plan_is_unchanged(tmp_path, capsys):
    """No site keys, or one site holding every node: no slow link, no DiLoCo lines, the same table and best."""
    base = dict(nodes=4, gpus_per_node=1, mem_gb=16)
    args = ["plan", *sum((["--set", s] for s in MODEL), []), "--top", "4", "--cluster"]
    outs = []
    for keys in (base, dict(base, site_nodes=4, site_bw_gbs=0.125, site_latency_ms=50)):
        assert main(args + [cluster_file(tmp_path, **keys)]) == 0
        out = capsys.readouterr().out
        assert "slow link" not in out and "DiLoCo" not in out
        outs.append([ln for ln in out.splitlines()[3:] if not ln.startswith("searched ")])
    assert outs[0] == outs[1]
    assert Cluster(nodes=4).spans_sites(4) is False


@pytest.mark.parametrize("keys,msg", [
    (dict(site_nodes=3), "cluster.site_nodes = 3: must divide nodes = 4 (sites of equal size; 0 = one site"),
    (dict(site_nodes=2), "cluster.site_nodes = 2: needs site_bw_gbs > 0, the per-device bandwidth"),
    (dict(site_bw_gbs=0.125), "cluster.site_bw_gbs = 0.125: applies only with site_nodes > 0"),
    (dict(site_nodes=2, site_bw_gbs=30), "cluster: site_bw_gbs = 30 exceeds inter_bw_gbs = 25"),
    (dict(site_nodes=2, site_bw_gbs=0.1, site_latency_ms=0.001), "cluster: site_latency_ms = 0.001 is below inter_latency_us"),
    (dict(site_nodes=2.5), "cluster.site_nodes = 2.5: must be a non-negative integer"),
    (dict(site_latency_ms=-1), "cluster.site_latency_ms = -1: must be a non-negative number"),
])
def test_bad_site_values_are_one_line(tmp_path, capsys, keys, msg):
    path = cluster_file(tmp_path, nodes=4, **keys)
    with pytest.raises(PlanError, match="^" + msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_cluster(path)
    assert main(["plan", *sum((["--set", s] for s in MODEL), []), "--cluster", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err


def test_batch_that_does_not_split_over_sites(tmp_path, capsys):
    """A global batch the sites cannot share: the exact plan stands, and one line says why no island is proposed."""
    path = cluster_file(tmp_path, **dict(SITES, nodes=6, site_nodes=2))
    sets = MODEL + ["model.n_layers=6"]          # 6 ranks: pp 3 x dp 2 takes a batch of 16
    assert main(["plan", *sum((["--set", s] for s in sets), []), "--cluster", path, "--top", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no DiLoCo candidate: train.global_batch = 16 does not split over 3 sites (one island each)" in out


def test_check_of_a_diloco_config_uses_the_link_between_sites(tmp_path, capsys):
    """plan --check of 2 islands on the 2 sites: the replica bytes (4 bytes a parameter over H = 50) on 0.125 GB/s
    and 50 ms, unless runtime.replica_link names another link."""
    path = cluster_file(tmp_path, **SITES)
    sets = MODEL + ["strategy.diloco.enable=true", "strategy.diloco.replicas=2", "strategy.data_parallel.enable=true"]
    args = ["plan", "--check", str(tmp_path / "none.toml"), "--cluster", path, *sum((["--set", s] for s in sets), [])]
    (tmp_path / "none.toml").write_text("")
    assert main(args) == 0
    out = capsys.readouterr().out
    secs = (LAT + 4 * sum(sizes(load_config(None, MODEL))) / RATE) / 50
    assert f"on the link between sites (0.125 GB/s, 50 ms) the replica bytes take {secs * 1e3:.3g} ms per step" in out
    assert main(args + ["--set", "runtime.replica_link=8Mbit/s,20ms"]) == 0
    assert "on runtime.replica_link 8Mbit/s,20ms" in capsys.readouterr().out


def test_pruned_search_ranks_as_the_exhaustive_one_across_sites():
    """The branch and bound's floors stay floors with the slower link between sites: the same first rows, figures."""
    cfg = load_config(None, MODEL + ["model.n_layers=4", "train.global_batch=32"])
    cluster = Cluster(nodes=4, gpus_per_node=2, mem_gb=16, site_nodes=2, site_bw_gbs=0.125, site_latency_ms=50)
    every, n, _ = searched(cfg, cluster, 2)
    fit, evaluated, pruned = searched(cfg, cluster, 2, 5)
    assert evaluated + pruned == n and pruned > 0
    assert [(r["layout"], r["time"], r["memory"]) for r in fit[:5]] == [
        (r["layout"], r["time"], r["memory"]) for r in every[:5]]
