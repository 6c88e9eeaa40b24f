"""The planner's GPU model and memory headroom: with no GPU figures a micro-batch costs its FLOPs at the one
sustained rate, exactly as before; with them every GEMM runs at its shape's rate, so the per-GPU throughput
of the Megatron-LM weak-scaling runs rises with the model; a GEMM's time, a small GPT's GEMMs, FLOPs, GEMM
time and element-wise time by hand; the GEMMs of the other kinds cover their FLOPs; the GPU calibration's fit
recovers known constants; the cluster files load; layouts keep the reserve free; every bad `hpengine plan`
input is one stderr line."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpengine.planner.calibrate import GB
from hpengine.planner.calibrate_gpu import fit_device, table
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.models import build_model
from hpengine.planner.search import Cluster, PlanError, predict_layout, load_cluster, search, with_preset
from hpengine.planner.gpu import gemm_flops, gemm_s, gemms, matmul_s
from hpengine.planner.model import compute_s, flops_per_microbatch
from hpengine.planner.stages import stages
from hpengine.layout.resolve import resolve

ROOT = Path(__file__).resolve().parents[2]
A100 = ROOT / "clusters" / "a100_80gb_dgx.toml"


def gpt(heads, h, layers, batch, *extra):
    return load_config(None, ["model.kind=gpt", "model.vocab_size=51200", "model.seq_len=2048", f"model.d_model={h}",
                              f"model.n_heads={heads}", f"model.n_layers={layers}", "model.tie_head=true",
                              f"train.global_batch={batch}", "strategy.amp.enable=true", *extra])


def degrees(tp, pp, dp, m=1, v=1, k=1):
    out = ["strategy.recompute.enable=true"]
    out += ["strategy.tensor_parallel.enable=true", f"strategy.tensor_parallel.degree={tp}"] if tp > 1 else []
    out += ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={dp}"] if dp > 1 else []
    out += ["strategy.gradient_merge.enable=true", f"strategy.gradient_merge.k_steps={k}"] if k > 1 else []
    if pp > 1:
        out += ["strategy.pipeline.enable=true", f"strategy.pipeline.degree={pp}",
                f"strategy.pipeline.micro_batches={m}",
                "strategy.pipeline.schedule=" + ("interleaved" if v > 1 else "1f1b"),
                f"strategy.pipeline.virtual_stages={v}"]
    return out


# Narayanan et al. 2021 (SC21), Table 1 rows: (heads, hidden, layers, gpus, batch) and the layout, one sequence
# per micro-batch
RUNS = {"1.7B": (gpt(24, 2304, 24, 512, *degrees(1, 1, 32, k=16)), 32),
        "145.6B": (gpt(96, 12288, 80, 2304, *degrees(8, 8, 24, m=96, v=2)), 1536),
        "1T": (gpt(160, 25600, 128, 3072, *degrees(8, 64, 6, m=512, v=2)), 3072)}


def tflops_per_gpu(cfg, world, cluster) -> float:
    """Model FLOPs (6 N tokens + attention, the recomputed forward left out) per second and device."""
    lay = resolve(cfg, world)
    r = predict_layout(cfg, lay, cluster, (0, 1, lay.pp - 1))
    n, m = sum(math.prod(sp.global_shape) for sp in build_model(cfg.model).all_specs()), cfg.model
    flops = cfg.train.global_batch * m.seq_len * (6 * n + 12 * m.n_layers * m.d_model * m.seq_len)
    return flops / r["time"]["step"] / world / 1e12


# A small GPT worked out by hand: d_model 64, 2 heads (head dim 32), 1 layer, T = 16, vocab 100 (untied head),
# 4 sequences per micro-batch (M = 64 tokens). Per call, FLOPs 2 MKN (x batch): qkv 64x64x192 1572864, attention
# projection 64x64x64 524288, fc 64x64x256 2097152, MLP projection 64x256x64 2097152, head 64x64x100 819200,
# Q K^T 16x32x16 and P V 16x16x32 per sequence and head (batch 4 x 2 = 8) 131072 each. Forward and two
# backward GEMMs: 3 x 7372800 = 22118400; full recompute runs the layer's GEMMs once more: 4 x 6553600 +
# 3 x 819200 = 28672000; selective runs Q K^T once more: + 131072 = 22249472; a head tied to the embedding
# multiplies by the same numbers. tp 2 halves each.
SMALL = ["model.kind=gpt", "model.d_model=64", "model.n_heads=2", "model.n_layers=1", "model.seq_len=16",
         "model.vocab_size=100", "train.global_batch=4", "model.dtype=float32"]
FULL, SELECTIVE = ["strategy.recompute.enable=true"], ["strategy.recompute.enable=true",
                                                        "strategy.recompute.granularity=selective"]
SMALL_FLOPS = {"plain": 22118400, "full": 28672000, "selective": 22249472, "tied": 22118400}


def _with(lay, **degrees):
    """lay with some of its parallel degrees changed (a layout the planner would not write)."""
    return dataclasses.replace(lay, degrees=dataclasses.replace(lay.degrees, **degrees))


def small(variant, tp=1, *extra):
    variants = {"plain": [], "full": FULL, "selective": SELECTIVE, "tied": ["model.tie_head=true"]}
    cfg = load_config(None, SMALL + variants[variant] + list(extra))
    return cfg, _with(resolve(cfg, 1), tp=tp), stages(cfg.model, tp, 1, 1)[0]


def test_without_gpu_figures_one_rate_as_before():
    """No gemm_half_dim, mem_bw_gbs, launch_us: the hand-counted FLOPs at the one sustained rate (tflops
    under amp, tflops_fp32 else; the default cluster's 15 TFLOP/s fp32), any recompute."""
    for variant, amp in (("plain", False), ("plain", True), ("full", False), ("selective", False)):
        cfg, lay, st = small(variant, 1, *(["strategy.amp.enable=true"] if amp else []))
        assert bool(lay.amp) == amp
        rate = (200.0 if amp else 20.0) * 1e12
        got = compute_s(cfg.model, st, lay, Cluster(tflops=200.0, tflops_fp32=20.0))
        assert got == pytest.approx(SMALL_FLOPS[variant] / rate, rel=1e-12)
    cfg, lay, st = small("plain")
    assert compute_s(cfg.model, st, lay, Cluster()) == pytest.approx(22118400 / 15e12, rel=1e-12)


def test_gemm_time_by_hand():
    # 4096^3 in fp16 on an A100-like device: d = 4096, eff = 0.9 * 4096 / 4352 = 0.84706; 2 * 4096^3 =
    # 1.37439e11 FLOPs at 312e12 * 0.84706 = 2.64282e14 FLOP/s = 520.05 us (the 100.7 MB it moves take 57.5 us
    # at 1.75 TB/s: compute-bound), + 5 us launch = 525.05 us
    assert gemm_s(4096, 4096, 4096, 312e12, 2, 256, 0.9, 1.75e12, 5e-6) == pytest.approx(525.05e-6, rel=1e-4)
    # one row times 8192 x 8192 (a matrix-vector product): 2 * (8192 + 8192^2 + 8192) bytes = 134.25 MB at
    # 1.75 TB/s = 76.71 us, more than its 41.3 us of compute: memory-bound, + 5 us = 81.71 us
    assert gemm_s(1, 8192, 8192, 312e12, 2, 256, 0.9, 1.75e12, 5e-6) == pytest.approx(81.71e-6, rel=1e-3)
    # without the shape terms: FLOPs at the peak
    assert gemm_s(1024, 1024, 1024, 1e12, 2) == pytest.approx(2 * 1024**3 / 1e12)


@pytest.mark.parametrize("variant", ["plain", "full", "selective", "tied"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gemms_by_hand(variant, tp):
    """The small GPT's GEMMs (calls, M, K, N, batch) per tp rank, and their FLOPs, as counted above: 3 calls
    each (forward, the input's and the weight's gradient), 4 for a fully recomputed layer's, one more Q K^T
    for a selectively recomputed layer; tp 2 splits qkv, fc and the head by columns, the two projections by
    rows, and the heads. A tied head multiplies by the embedding's (vocab x d_model) slice, listed as K = vocab,
    N = d_model (the same FLOPs, bytes and harmonic dimension)."""
    cfg, lay, st = small(variant, tp)
    c = 4 if variant == "full" else 3
    qk = c + (variant == "selective")
    t = tp
    head = (3, 64, 100 // t, 64, 1) if variant == "tied" else (3, 64, 64, 100 // t, 1)
    want = {(c, 64, 64, 192 // t, 1), (c, 64, 64 // t, 64, 1), (c, 64, 64, 256 // t, 1), (c, 64, 256 // t, 64, 1),
            head, (qk, 16, 32, 16, 8 // t), (c, 16, 16, 32, 8 // t)}
    got = gemms(cfg.model, st, lay)
    assert sorted(got) == sorted(want)
    assert gemm_flops(got) == SMALL_FLOPS[variant] / tp
    assert flops_per_microbatch(cfg.model, st, lay) == SMALL_FLOPS[variant] / tp


def test_small_gpt_gemm_time_by_hand():
    """matmul_s of the small GPT (plain, tp 1) on a device of 1 TFLOP/s fp32 peak, gemm_eff_max 0.8, d_half
    64, 40 GB/s, 2 us per launch, each GEMM max(batch 2MKN / (peak eff(d)), batch 4 (MK + KN + MN) / bw) + 2 us,
    eff(d) = 0.8 d / (d + 64), d = 3 / (1/M + 1/K + 1/N):
      qkv 64x64x192: d = 576/7, eff = 0.45; 1572864 / 0.45e12 = 3.495253 us > 114688 B / 40 GB/s = 2.8672 us
      attention projection 64^3: d = 64, eff = 0.4; 1.31072 us > 1.2288 us
      fc 64x64x256 and MLP projection 64x256x64: d = 256/3, eff = 16/35; 4.58752 us > 3.6864 us
      head 64x64x100: d = 800/11, eff = 20/47; 1.92512 us > 1.6896 us
      Q K^T 16x32x16 and P V 16x16x32, batch 8: d = 19.2, eff = 12/65; 0.709973 us < 40960 B at 40 GB/s =
        1.024 us: memory-bound
    3 calls each: 3 (5.495253 + 3.31072 + 2 x 6.58752 + 3.92512 + 2 x 3.024) us = 95.8624 us."""
    cfg, lay, st = small("plain")
    c = Cluster(gemm_half_dim=64.0, gemm_eff_max=0.8, mem_bw_gbs=40.0, launch_us=2.0)
    assert matmul_s(cfg.model, st, lay, c, 1e12, 4) == pytest.approx(95.8624e-6, rel=1e-9)


@pytest.mark.parametrize("kind,extra", [
    ("llama", ["model.n_kv_heads=2"]),
    ("llama", ["model.n_kv_heads=2", "strategy.recompute.enable=true", "strategy.recompute.granularity=selective"]),
    ("llama", ["model.n_kv_heads=2", "model.head_dim=24"]),
    ("mlp", [])])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_gemms_cover_the_flops(kind, extra, tp, pp):
    """The kinds not counted by hand above: the GEMMs enumerated from each block's weight matrices add up
    to the closed-form FLOPs (6 N tokens over the stage's matmul weights + the attention formula), per stage."""
    cfg = load_config(None, [f"model.kind={kind}", "model.d_model=64", "model.n_heads=4", "model.n_layers=4",
                             "model.seq_len=16", "train.global_batch=4", *extra])
    lay = _with(resolve(cfg, 1), tp=tp, pp=pp)
    for st in stages(cfg.model, tp, pp, 1):
        assert gemm_flops(gemms(cfg.model, st, lay)) == pytest.approx(flops_per_microbatch(cfg.model, st, lay))


def test_per_gpu_throughput_rises_with_the_model():
    """Megatron-LM's weak scaling (137 -> 148 -> 163 TFLOP/s per GPU for 1.7B, 145.6B, 1T): GEMMs by shape
    rise with the model; one rate for every GEMM falls (the larger runs' communication and bubble)."""
    shaped = load_cluster(str(A100))
    flat = dataclasses.replace(shaped, tflops=shaped.tflops * shaped.gemm_eff_max, gemm_half_dim=0.0,
                               mem_bw_gbs=0.0, launch_us=0.0)
    rise = [tflops_per_gpu(cfg, w, shaped) for cfg, w in RUNS.values()]
    assert rise[0] < rise[1] < rise[2]
    assert rise[2] / rise[0] > 1.1
    one = [tflops_per_gpu(cfg, w, flat) for cfg, w in RUNS.values()]
    assert one[0] > one[2]


def test_gpu_fit_recovers_known_constants():
    peak, half, eff, bw, launch = 989e12, 480.0, 0.78, 3.9e12, 6e-6
    shapes = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (8192, 8192, 8192), (4096, 2048, 6144)]
    gemm = [(s, gemm_s(*s, peak, 2, half, eff, 0.0, launch)) for s in shapes]
    copies = [(n, 2e-6 + n / bw) for n in (1e8, 4e8, 1.6e9)]
    launches = [(n, 1e-4 + n * launch) for n in (200, 2000)]
    got = fit_device(gemm, copies, launches, peak)
    assert got["gemm_half_dim"] == pytest.approx(half, rel=1e-6)
    assert got["gemm_eff_max"] == pytest.approx(eff, rel=1e-6)
    assert got["mem_bw_gbs"] == pytest.approx(bw / 1e9, rel=1e-6)
    assert got["launch_us"] == pytest.approx(launch * 1e6, rel=1e-6)


def test_gpu_calibration_table_loads_back(tmp_path):
    vals = fit_device([((1024,) * 3, 2e-5), ((4096,) * 3, 6e-4)], [(1e8, 6e-5), (1e9, 5.5e-4)],
                      [(200, 1e-3), (2000, 1e-2)], 312e12)
    vals.update(gpus_per_node=8, mem_gb=85.1, tflops=312.0, tflops_fp32=19.5, tflops_fp64=19.5)
    f = tmp_path / "gpu.toml"
    f.write_text(table(vals, "NVIDIA A100-SXM4-80GB"))
    c = load_cluster(str(f))
    assert c.gemm_half_dim == pytest.approx(vals["gemm_half_dim"], rel=1e-3) and c.launch_us == pytest.approx(5.0)


def test_cluster_files_load():
    a100 = load_cluster(str(A100))
    assert (a100.world, a100.mem_gb, a100.tflops, a100.tflops_fp32, a100.tflops_fp64) == (8, 80, 312, 19.5, 19.5)
    assert (a100.intra_bw_gbs, a100.inter_bw_gbs, a100.reserve) == (300, 25, 4)
    h200 = load_cluster(str(ROOT / "clusters" / "h200_node.toml"), nodes=4)
    assert (h200.world, h200.mem_gb, h200.tflops, h200.intra_bw_gbs, h200.inter_bw_gbs) == (32, 141, 989, 450, 50)
    assert h200.usable_gb == 137 and h200.mem_bw_gbs > 0 and h200.gemm_half_dim > 0


def test_layouts_keep_the_reserve_free():
    assert Cluster().reserve == 4 and Cluster(mem_gb=16).reserve == pytest.approx(0.8)
    assert Cluster(reserve_gb=0).usable_gb == 80
    cfg = with_preset(load_config(None), "1.3b")
    for reserve in (0.0, 10.0):
        c = Cluster(nodes=1, gpus_per_node=8, mem_gb=40, reserve_gb=reserve)
        fit, _ = search(cfg, c)
        assert max(r["memory"]["total"] for r in fit) <= (40 - reserve) * GB
    unreserved, _ = search(cfg, Cluster(gpus_per_node=8, mem_gb=40, reserve_gb=0))
    assert any(r["memory"]["total"] > 30 * GB for r in unreserved)      # the reserve is what keeps them out
    with pytest.raises(PlanError, match=r"devices have 0.5 GB: 16 GB less 15.5 GB kept free \(cluster.reserve_gb"):
        search(cfg, Cluster(gpus_per_node=2, mem_gb=16, reserve_gb=15.5))
    with pytest.raises(PlanError, match="cluster.reserve_gb = 80: the GB kept free of each device must be below"):
        load_cluster(None, reserve_gb=80.0)


def plan(capsys, *args) -> tuple:
    """(exit status, stderr) of `hpengine plan ARGS` in this process."""
    try:
        rc = main(["plan", *map(str, args)])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args,says", [
    (["--nodes", "x"], "argument --nodes: invalid int value: 'x'"),
    (["--nodes", "0"], "--nodes 0: must be an integer >= 1"),
    (["--nodes", "-2"], "--nodes -2: must be an integer >= 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0: must be an integer >= 1"),
    (["--gpus-per-node", "1.5"], "argument --gpus-per-node: invalid int value"),
    (["--mem-gb", "abc"], "argument --mem-gb: invalid float value: 'abc'"),
    (["--mem-gb", "0"], "cluster.mem_gb = 0.0: must be a positive number"),
    (["--mem-gb", "nan"], "cluster.mem_gb = nan: must be a positive number"),
    (["--reserve-gb", "-1"], "cluster.reserve_gb = -1.0: must be a non-negative number"),
    (["--reserve-gb", "80"], "cluster.reserve_gb = 80: the GB kept free of each device must be below mem_gb = 80"),
    (["--reserve-gb", "x"], "argument --reserve-gb: invalid float value"),
    (["--cluster", "/nonexistent/c.toml"], "--cluster /nonexistent/c.toml: cannot read it"),
    (["--cluster", "."], "--cluster .: cannot read it"),
    (["--model", "3b"], "--model 3b: unknown preset"),
    (["--check", "/nonexistent/x.toml"], "config file not found: /nonexistent/x.toml"),
    (["--top", "0"], "--top 0: must be an integer >= 1"),
    (["--global-batch", "0"], "--global-batch 0: must be an integer >= 1"),
    (["--world", "4"], "--world 4: only applies with --check"),
    (["--device", "gpu"], "--device gpu: only applies with --calibrate"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_plan_input_is_one_line(args, says, capsys):
    rc, err = plan(capsys, *args)
    assert rc == 2 and err.count("\n") == 1 and says in err, err


def test_bad_cluster_files_are_one_line(tmp_path, capsys):
    for text, says in (("x = [\n", "invalid TOML"), ("cluster = 3\n", "no [cluster] table"),
                       ("[cluster]\nmem_gb = 'a'\n", "cluster.mem_gb = 'a': must be a positive number"),
                       ("[cluster]\ngemm_eff_max = 1.5\n", "cluster.gemm_eff_max = 1.5: a share of the peak"),
                       ("[cluster]\nmem_gb = 4\nreserve_gb = 4\n", "cluster.reserve_gb = 4")):
        f = tmp_path / "c.toml"
        f.write_text(text)
        rc, err = plan(capsys, "--cluster", f)
        assert rc == 2 and err.count("\n") == 1 and says in err, err


def test_the_installed_command_says_one_line():
    exe = Path(sys.executable).with_name("hpengine")
    for args in (["--nodes", "x"], ["--mem-gb", "-1"]):
        p = subprocess.run([str(exe), "plan", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "error" in p.stderr, p.stderr


def test_check_shows_the_headroom(capsys):
    assert main(["plan", "--check", str(ROOT / "configs" / "hybrid_4d.toml"), "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "fits in 80 GB per device less 4 GB kept free" in out and "headroom" in out


def test_block_bytes_drive_the_elementwise_time():
    """mem_bw_gbs alone (10 TB/s, at 1 TFLOP/s every GEMM compute-bound): the small GPT's hand-counted FLOPs
    at the rate plus 4 passes over its cached bytes at the bandwidth. Cached, float32: the layer (64 tokens)
    ln1 64*64 + 64 = 4160, qkv's input 4096, attention 5*64*64 = 20480 + probabilities 4 sequences x 2 heads x
    (8*8 + 8*16) = 1536, ln2 4160, fc's input 4096, GELU 2*64*256 = 32768: 71296 elements = 285184 bytes; the
    embedding 64 x (int64 + bool) = 576; the head's norm 4160 * 4 + its input 4096 * 4 + probabilities
    64*100*4 + the int64 targets 4*16*8 = 59136; together 344896 bytes."""
    cfg, lay, st = small("plain")
    c = Cluster(tflops_fp32=1.0, mem_bw_gbs=1e4)
    assert compute_s(cfg.model, st, lay, c) == pytest.approx(22118400 / 1e12 + 4 * 344896 / 1e13, rel=1e-12)
