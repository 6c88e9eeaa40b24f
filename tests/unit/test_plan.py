"""The planner without MPI: ZeRO's Figure 1, model states by stage and precision, tensor and pipeline
splits of the parameter count, activations held per schedule, the alpha-beta costs and the calibrated
CPU terms, every enumerated layout legal for the engine, the best written as a loadable config,
`hpengine plan` and its errors."""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hpengine.cli.commands import main
from hpengine.config.load import enabled_strategies, load_config
from hpengine.models import build_model
from hpengine.planner.search import (Cluster, PlanError, candidates, check_at_start, config_for, load_cluster, search,
                           with_preset, write_best)
from hpengine.planner.memory import block_activations, model_state, zero_bytes
from hpengine.planner.model import collective_s, compute_s, flops_per_microbatch, link, stage_times, step_time
from hpengine.planner.stages import stages
from hpengine.layout.resolve import split_blocks
from hpengine.layout.schedules import make_schedule, peak_in_flight, peak_live
from hpengine.layout.resolve import resolve

TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=4", "model.n_heads=4", "model.seq_len=8",
        "train.global_batch=16"]


PP4 = ["strategy.pipeline.enable=true", "strategy.pipeline.degree=4", "strategy.pipeline.micro_batches=4"]


def tiny(*extra):
    return load_config(None, TINY + list(extra))


# ---- memory model -----------------------------------------------------------------------------------

def test_zero_paper_figure_1():
    """Ψ = 7.5 B parameters, N = 64 devices, mixed precision (2 + 2 + K = 12 bytes per parameter)."""
    psi, n = 7.5e9, 64
    got = [sum(zero_bytes(psi, psi / n, stage, 2, 2, 12)) / 1e9 for stage in (0, 1, 2, 3)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.05)


@pytest.mark.parametrize("amp,want", [(False, (4, 4, 8)), (True, (2, 2, 12))])
def test_model_state_by_stage_and_precision(amp, want):
    cfg = tiny("model.dtype=float32", "strategy.sharding.enable=true", "strategy.sharding.degree=4",
               "strategy.sharding.partition=flat", f"strategy.amp.enable={str(amp).lower()}")
    w, g, k = want
    for zstage in (1, 2, 3):
        cfg.strategy.sharding.stage = zstage
        lay = resolve(cfg, 4)
        st = stages(cfg.model, 1, 1, 1)[0]
        psi = st.psi
        mem = model_state(cfg.model, st, lay, 1)
        share = -(-psi // 4)   # flat partition: the largest of four equal ranges
        assert (mem["params"], mem["grads"], mem["optimizer"]) == zero_bytes(psi, share, zstage, w, g, k)
    assert zero_bytes(psi, share, 1, 4, 4, 8) == (4 * psi, 4 * psi, 8 * share)
    assert zero_bytes(psi, share, 2, 4, 4, 8) == (4 * psi, 4 * share, 8 * share)
    assert zero_bytes(psi, share, 3, 4, 4, 8) == (4 * share, 4 * share, 8 * share)


def gpt_params(C, L, V, T, F, tp, tied):
    """Hand count per tp rank: split matrices and biases divided by tp, layernorms and the row-split
    biases replicated."""
    layer = 4 * C + (3 * C * C + 3 * C + C * C + C * F + F + F * C) // tp + 2 * C
    head = 2 * C + (0 if tied else C * V // tp)
    return V * C // tp + T * C + L * layer + head


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_divides_split_tensors_only(tp, tied):
    cfg = tiny(f"model.tie_head={str(tied).lower()}")
    st = stages(cfg.model, tp, 1, 1)[0]
    assert st.psi == gpt_params(16, 4, 256, 8, 64, tp, tied)


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (2, 2)])
def test_pipeline_stages_split_the_blocks(p, v):
    cfg = tiny("model.tie_head=true")
    sts = stages(cfg.model, 1, p, v)
    whole = stages(cfg.model, 1, 1, 1)[0].psi
    wte = 256 * 16
    assert sum(s.psi for s in sts) == whole + wte          # the last stage holds a copy of the tied wte
    model = build_model(cfg.model)
    chunks = split_blocks(model.blocks(), p, v, "uniform", None)
    assert [[list(c) for c in st.chunks] for st in sts] == [[chunks[c * p + s] for c in range(v)] for s in range(p)]


def test_activations_held_per_schedule():
    """F-then-B holds m micro-batches, 1F1B min(p - s, m), interleaved p·v + p - 1 chunk caches at most
    on stage 0 (Megatron 2021: p (1 + (p - 1) / (p v)) micro-batches' worth); all equal the schedules'."""
    for p in range(1, 6):
        for m in range(1, 13):
            for s in range(p):
                for name in ("fthenb", "1f1b"):
                    assert peak_live(name, p, m, 1, s, (1,)) == peak_in_flight(make_schedule(name, p, m, s))
                for v in (2, 3):
                    if m % p == 0:
                        got = peak_live("interleaved", p, m, v, s, (1,) * v)
                        assert got == peak_in_flight(make_schedule("interleaved", p, m, s, v))
                        if s == 0:
                            assert got == min(p * v + p - 1, m * v)


# ---- communication and time model -------------------------------------------------------------------

def test_alpha_beta_costs():
    assert collective_s("allreduce", 4, 8e9, 0, 0.0, 1e9) == pytest.approx(12.0)   # 2 (n-1)/n bytes
    assert collective_s("allgather", 4, 8e9, 0, 0.0, 1e9) == pytest.approx(6.0)
    assert collective_s("reduce", 4, 8e9, 0, 0.0, 1e9) == pytest.approx(6.0)
    assert collective_s("send", 2, 1e9, 3, 1e-6, 1e9) == pytest.approx(1 + 3e-6)
    assert collective_s("allreduce", 1, 8e9, 5, 1.0, 1e9) == 0
    for op in ("allreduce", "reduce", "allgather"):        # ceil(log2 n) latencies per call
        assert collective_s(op, 4, 0, 3, 1.0, 1e9) == 6 and collective_s(op, 5, 0, 1, 1.0, 1e9) == 3


def test_cpu_terms_of_a_micro_batch():
    """Calibrated CPUs add block_us per block pass (a recomputed block's forward runs twice) and act_ns
    per 4 bytes of cached activations (a recomputed layer's second forward: half again); ranks beyond
    the cores slow everything by ranks / cores."""
    for rc in ("false", "true"):
        cfg = tiny(f"strategy.recompute.enable={rc}", "model.dtype=float32")
        lay, st = resolve(cfg, 1), stages(cfg.model, 1, 1, 1)[0]
        flops = Cluster(tflops_fp32=1.0)
        base = flops_per_microbatch(cfg.model, st, lay) / 1e12
        assert compute_s(cfg.model, st, lay, flops) == pytest.approx(base)
        again = 4 if rc == "true" else 0
        c = Cluster(tflops_fp32=1.0, block_us=100.0)
        assert compute_s(cfg.model, st, lay, c) == pytest.approx(base + (2 * 6 + again) * 100e-6)
        a = block_activations(cfg.model, lay, 4)
        cached = a["embed"] + 4 * a["layer"] + a["head"] + again * a["layer"] / 2
        c = Cluster(tflops_fp32=1.0, act_ns=2.0)
        assert compute_s(cfg.model, st, lay, c) == pytest.approx(base + cached / 4 * 2e-9)
    c = Cluster(gpus_per_node=4, tflops_fp32=1.0, block_us=100.0, cores_per_node=2)
    lay = resolve(tiny("strategy.data_parallel.enable=true"), 4)
    one, four = (stage_times(cfg.model, st, lay, 0, 1, cl)["compute"] for cl in (replace(c, cores_per_node=4), c))
    assert four == pytest.approx(2 * one)


def test_reduce_and_allgather_at_their_own_bandwidth():
    cfg = tiny("strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.data_parallel.enable=true")
    lay = resolve(cfg, 8)                    # sharding 4 inside a node of 4, dp 2 across the nodes
    c = Cluster(nodes=2, gpus_per_node=4, intra_bw_gbs=100, inter_bw_gbs=10, reduce_bw_gbs=20, allgather_bw_gbs=0)
    assert link(lay, "sharding", c, "reduce")[1] == 20e9 and link(lay, "sharding", c, "allgather")[1] == 100e9
    assert link(lay, "dp", c, "reduce")[1] == 10e9          # across nodes: the slower of the two


def test_pipeline_bubble_in_step_time():
    """p - 1 idle micro-batch slots per pass (1/v of them interleaved), on top of m micro-batches."""
    times = {"compute": 1.0, "tp": 0.5, "pp": 0.5, "dp": 0.0, "sharding": 0.0, "fixed": 0.0}
    for sched, v in (("fthenb", 1), ("1f1b", 1), ("interleaved", 2)):
        cfg = tiny(*PP4, f"strategy.pipeline.schedule={sched}", f"strategy.pipeline.virtual_stages={v}",
                   "model.n_layers=8")     # p x v chunks need as many layers
        t = step_time([{"times": times}], resolve(cfg, 4))
        assert t["bubble"] == pytest.approx(3 * 2.0 / v) and t["compute"] == pytest.approx(4.0)
        assert t["step"] == pytest.approx(4 * 2.0 + 3 * 2.0 / v)


def test_axis_inside_or_across_nodes():
    cfg = tiny("strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=4",
               "strategy.data_parallel.enable=true", "strategy.pipeline.enable=true", "strategy.pipeline.degree=2")
    lay = resolve(cfg, 16)                   # tp 4 innermost, dp 2, pp 2 outermost
    c = Cluster(nodes=2, gpus_per_node=8, intra_bw_gbs=100, inter_bw_gbs=10)
    assert link(lay, "tp", c)[1] == 100e9 and link(lay, "dp", c)[1] == 100e9
    assert link(lay, "pp", c)[1] == 10e9       # stride 8: the two stages sit on different nodes


# ---- search -----------------------------------------------------------------------------------------

def test_every_candidate_is_a_legal_engine_layout():
    cfg = tiny()
    cluster = Cluster(nodes=2, gpus_per_node=4)
    seen = 0
    for lay in candidates(cfg, cluster):
        c = config_for(cfg, lay)
        assert resolve(c, cluster.world) == lay     # and resolve's checks (batch arithmetic ...) pass
        assert lay.world == cluster.world and lay.tp <= 4
        assert lay.rows * lay.k * lay.m * lay.dp * lay.sh == c.train.global_batch
        stages(c.model, lay.tp, lay.pp, lay.v)      # the pipeline split exists
        seen += 1
    assert seen > 100


def test_best_layout_written_as_a_runnable_config(tmp_path):
    cfg = with_preset(load_config(None), "gpt2-124m")
    cluster = Cluster(nodes=1, gpus_per_node=4, mem_gb=16)
    fit, n = search(cfg, cluster)
    assert n >= len(fit) > 0
    assert all(r["memory"]["total"] <= 16e9 for r in fit)
    assert [r["time"]["step"] for r in fit] == sorted(r["time"]["step"] for r in fit)
    path = tmp_path / "best.toml"
    c = write_best(cfg, fit[0], str(path), cluster)
    loaded = load_config(path)
    assert loaded == c and resolve(loaded, 4) == fit[0]["layout"]
    header = path.read_text().splitlines()[1]
    assert all(name in header for name in enabled_strategies(loaded))


def test_nothing_fits_names_the_smallest_memory():
    cfg = with_preset(load_config(None), "175b")
    with pytest.raises(PlanError, match=r"no layout fits: the smallest needs [\d.]+ GB per device"):
        search(cfg, Cluster(nodes=1, gpus_per_node=2, mem_gb=16))


# ---- command line -----------------------------------------------------------------------------------

def test_cli_plan_writes_best(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "1.3b", "--nodes", "2", "--gpus-per-node", "8", "--mem-gb", "40",
                 "--top", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if ln[:3].strip().isdigit()]
    assert len(rows) == 5 and "tok/s" in text and f"wrote {out}" in text
    cfg = load_config(out)
    assert cfg.model.d_model == 2048 and enabled_strategies(cfg)
    assert main(["plan", "--check", str(out), "--world", "16"]) == 0
    text = capsys.readouterr().out
    assert "memory per device" in text and "traffic per step" in text and "fits in 80 GB" in text


def test_cli_plan_refuses_an_existing_out_unless_force(tmp_path, capsys):
    out, args = tmp_path / "mine.toml", ["plan", "--model", "1.3b", "--nodes", "1", "--gpus-per-node", "8",
                                          "--mem-gb", "80", "--top", "1"]
    out.write_text("# the user's own config\n")
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists (pass --force" in err
    assert out.read_text() == "# the user's own config\n"
    assert main([*args, "--out", str(out), "--force"]) == 0
    assert load_config(out).model.d_model == 2048


@pytest.mark.parametrize("args,msg", [
    (["--model", "3b"], "unknown preset; choose one of gpt2-124m, 1.3b, 7b, 13b, 175b, llama3-8b, llama3-70b, "
                       "llama3.2-1b, mixtral-8x7b, deepseek-v3, kimi-k2 (aliases: 124m = gpt2-124m, gpt2 = gpt2-124m, 6.7b = 7b)"),
    (["--model", "175b", "--nodes", "1", "--gpus-per-node", "1", "--mem-gb", "16"], "no layout fits"),
    (["--model", "7b", "--inter-bw-gbs", "900"], "inter_bw_gbs = 900.0 exceeds intra_bw_gbs"),
    (["--model", "7b", "--mem-gb", "-1"], "cluster.mem_gb = -1.0: must be a positive number"),
])
def test_cli_bad_input(args, msg, capsys):
    assert main(["plan", *args]) == 2
    assert msg in capsys.readouterr().err


def test_cluster_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[cluster]\nnodes = 2\ngpus_per_node = 4\nmem_gb = 24\n")
    c = load_cluster(str(f), mem_gb=32.0, nodes=None)
    assert (c.world, c.mem_gb) == (8, 32.0)
    f.write_text("[cluster]\nnodez = 2\n")
    with pytest.raises(PlanError, match="cluster.nodez: unknown key"):
        load_cluster(str(f))
    assert load_cluster(None, overlap=0.0, block_us=0.0).overlap == 0       # CPU figures may be 0
    with pytest.raises(PlanError, match="cluster.act_ns = -1.0: must be a non-negative number"):
        load_cluster(None, act_ns=-1.0)


def test_check_at_start_warns_over_device_memory(monkeypatch, caplog):
    cfg = tiny()
    log = logging.getLogger("hpengine.test_plan")
    monkeypatch.setenv("HPENGINE_DEVICE_MEMORY_GB", "1e-6")
    with caplog.at_level(logging.INFO, logger=log.name):
        r = check_at_start(cfg, 1, log)
    assert "predicted memory per rank" in caplog.text and "exceeds the device memory" in caplog.text
    assert r["memory"]["total"] > 1e3
    monkeypatch.setenv("HPENGINE_DEVICE_MEMORY_GB", "80")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=log.name):
        check_at_start(cfg, 1, log)
    assert "exceeds" not in caplog.text


def test_calibrate_prints_a_usable_cluster(tmp_path, capsys):
    assert main(["plan", "--calibrate", "--gpus-per-node", "2"]) == 0
    f = tmp_path / "c.toml"
    f.write_text(capsys.readouterr().out)
    c = load_cluster(str(f))
    assert c.gpus_per_node == 2 and c.tflops_fp32 > 0 and math.isfinite(c.intra_bw_gbs)
    assert c.cores_per_node >= 1 and c.block_us > 0 and c.act_ns > 0 and c.optimizer_ns > 0


def test_layouts_of_equal_step_time_rank_by_memory():
    """The search's order: step time first; among equal times, less memory per device first."""
    fit, _ = search(load_config(None, TINY), Cluster(nodes=1, gpus_per_node=4))
    pairs = [(round(a["time"]["step"], 9), a["memory"]["total"], round(b["time"]["step"], 9), b["memory"]["total"])
             for a, b in zip(fit, fit[1:])]
    assert any(ta == tb and ma != mb for ta, ma, tb, mb in pairs)      # the tie-break is exercised
    assert all(ta < tb or (ta == tb and ma <= mb) for ta, ma, tb, mb in pairs)


TINY_SETS = [a for t in TINY for a in ("--set", t)]


def test_plan_names_the_cluster_it_assumes(capsys):
    """The plan says which machine it ranks layouts for: the built-in default with its figures, or the file."""
    assert main(["plan", *TINY_SETS, "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "cluster: the built-in default (--cluster FILE or the flags set yours): 1 x 4 devices of 80 GB" in out
    path = Path(__file__).resolve().parents[2] / "clusters" / "h200_node.toml"
    assert main(["plan", *TINY_SETS, "--cluster", str(path)]) == 0
    assert f"cluster: --cluster {path}: " in capsys.readouterr().out
