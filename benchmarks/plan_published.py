"""The planner against published large runs on A100 clusters: for each run, the published per-GPU
throughput, the layout, and the planner's prediction with clusters/a100_80gb_dgx.toml (per-GPU TFLOP/s by
the paper's own FLOP count, whether it fits in memory) and their ratio; also what the single-rate model
(every GEMM at gemm_eff_max of the peak, no element-wise or launch cost) predicts, to show the trend.

Runs (GPT, vocabulary 51,200, sequence 2,048, mixed precision, Selene's DGX A100 80GB nodes):
  * Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    SC21 (2021), Table 1: weak scaling 1.7B to 1T parameters, full activation recomputation, interleaved
    pipeline schedule; "achieved teraFLOP/s per GPU" counts the recomputed forward (their Eq. 3:
    96 B s l h^2 (1 + s/6h + V/16lh)).
  * Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), Tables 3
    and 5: 22B, 175B, 530B, 1T at tensor parallel 8, no data parallelism, sequence parallelism + selective
    recompute; model FLOPs utilisation of 312 TFLOP/s (their model FLOPs: 72 B s l h^2 (1 + s/6h + V/12lh)).
    Predicted with the same switches; --no-sp predicts them without sequence parallelism.
Table 1 does not give the micro-batch size or the interleaving: one sequence per micro-batch is assumed
(the planner would pick larger ones for the smaller models, their GEMMs running faster) and the planner
picks the fastest schedule that fits, 1F1B or interleaved with 2, 3 or 4 chunks.

    .venv/bin/python benchmarks/plan_published.py [--cluster clusters/a100_80gb_dgx.toml]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpengine.planner.calibrate import GB  # noqa: E402
from hpengine.config.load import ConfigError, load_config  # noqa: E402
from hpengine.planner.search import predict_layout, load_cluster  # noqa: E402
from hpengine.layout.resolve import resolve  # noqa: E402

V, S = 51200, 2048
# (name, heads, hidden, layers, tp, pp, gpus, batch, published TFLOP/s per GPU)
NARAYANAN = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
             ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
             ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
             ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
             ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# (name, heads, hidden, layers, tp, pp, gpus, batch, micro-batch, interleaved chunks, published iteration s, MFU);
# three interleaved chunks for the 175B and 530B runs (their section 6), none stated for the 1T one
KORTHIKANTI = [("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.10, 0.415),
               ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 13.75, 0.514),
               ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 37.83, 0.560),
               ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 71.49, 0.563)]


def narayanan_flops(B, h, layers):
    return 96 * B * S * layers * h * h * (1 + S / (6 * h) + V / (16 * layers * h))


def model_flops(B, h, layers):
    return 72 * B * S * layers * h * h * (1 + S / (6 * h) + V / (12 * layers * h))


def layouts(heads, h, layers, tp, pp, gpus, B, recompute, rows_choices, sp=False):
    """Configs of the published degrees: each micro-batch size and pipeline schedule."""
    dp = gpus // (tp * pp)
    share = B // dp
    base = ["model.kind=gpt", f"model.vocab_size={V}", f"model.seq_len={S}", f"model.d_model={h}",
            f"model.n_heads={heads}", f"model.n_layers={layers}", "model.tie_head=true", f"train.global_batch={B}",
            "strategy.amp.enable=true", "strategy.amp.dtype=float16"]
    base += ["strategy.tensor_parallel.enable=true", f"strategy.tensor_parallel.degree={tp}",
             f"strategy.tensor_parallel.sequence_parallel={str(sp).lower()}"] if tp > 1 else []
    base += ["strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={dp}"] if dp > 1 else []
    base += ["strategy.recompute.enable=true", f"strategy.recompute.granularity={recompute}"] if recompute else []
    for rows in rows_choices:
        if share % rows:
            continue
        n = share // rows
        if pp == 1:
            yield base + (["strategy.gradient_merge.enable=true", f"strategy.gradient_merge.k_steps={n}"] if n > 1
                          else [])
            continue
        pipe = base + ["strategy.pipeline.enable=true", f"strategy.pipeline.degree={pp}",
                       f"strategy.pipeline.micro_batches={n}"]
        yield pipe + ["strategy.pipeline.schedule=1f1b"]
        for v in (2, 3, 4):
            if layers % (pp * v) == 0 and n % pp == 0:
                yield pipe + ["strategy.pipeline.schedule=interleaved", f"strategy.pipeline.virtual_stages={v}"]


def best(run, cluster, recompute, rows_choices, chunks=None, sp=False):
    """(whether it fits, the prediction, the config): the fastest layout that fits, or the smallest when
    none fits; chunks: only that many interleaved chunks (1: 1F1B)."""
    heads, h, layers, tp, pp, gpus, B = run
    out = []
    for ov in layouts(heads, h, layers, tp, pp, gpus, B, recompute, rows_choices, sp):
        try:
            cfg = load_config(None, ov)
            lay = resolve(cfg, gpus)
        except (ConfigError, ValueError):
            continue
        if chunks is not None and lay.pp > 1 and lay.v != chunks:
            continue
        r = predict_layout(cfg, lay, cluster, (0, 1, lay.pp - 1))
        out.append((r["memory"]["total"] <= cluster.usable_gb * GB, r, cfg))
    fit = [o for o in out if o[0]]
    if fit:
        return min(fit, key=lambda o: o[1]["time"]["step"])
    return min(out, key=lambda o: o[1]["memory"]["total"])


def flat(cluster):
    """The single-rate model: every GEMM at gemm_eff_max of the peak, nothing else charged."""
    return dataclasses.replace(cluster, tflops=cluster.tflops * cluster.gemm_eff_max, gemm_half_dim=0.0,
                               mem_bw_gbs=0.0, launch_us=0.0)


def lay_text(lay):
    s = lay.schedule + (f"/{lay.v}" if lay.v > 1 else "") if lay.pp > 1 else "-"
    return f"tp {lay.tp}{' sp' if lay.sp else ''} pp {lay.pp} dp {lay.dp} {s} mb {lay.rows}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "clusters" / "a100_80gb_dgx.toml"))
    ap.add_argument("--no-sp", action="store_true", help="predict the Korthikanti runs without sequence parallelism")
    a = ap.parse_args(argv)
    c = load_cluster(a.cluster)
    c1 = flat(c)
    print(f"cluster {a.cluster}: {c.tflops:g} TFLOP/s peak, GEMMs at {c.gemm_eff_max:g} d/(d + {c.gemm_half_dim:g}), "
          f"{c.mem_bw_gbs:g} GB/s, {c.launch_us:g} us a GEMM; usable {c.usable_gb:g} GB per device")
    print("\nNarayanan et al. 2021, Table 1 (full recompute; TFLOP/s per GPU by their Eq. 3)")
    print(f"{'model':>7} {'GPUs':>5} {'layout (schedule: the planner)':<38} {'GB':>5} {'fits':>4} | "
          f"{'published':>9} {'predicted':>9} {'ratio':>5} | {'1-rate':>6} {'ratio':>5}")
    for name, heads, h, layers, tp, pp, gpus, B, pub in NARAYANAN:
        run = (heads, h, layers, tp, pp, gpus, B)
        ok, r, cfg = best(run, c, "full", (1,))
        pred = narayanan_flops(B, h, layers) / r["time"]["step"] / gpus / 1e12
        r1 = predict_layout(cfg, r["layout"], c1, (0, 1, r["layout"].pp - 1))
        one = narayanan_flops(B, h, layers) / r1["time"]["step"] / gpus / 1e12
        print(f"{name:>7} {gpus:>5} {lay_text(r['layout']):<38} {r['memory']['total'] / GB:>5.1f} "
              f"{'y' if ok else 'NO':>4} | {pub:>9.0f} {pred:>9.1f} {pred / pub:>5.2f} | {one:>6.1f} {one / pub:>5.2f}")
    print("\nKorthikanti et al. 2022, Tables 3 and 5 (sequence parallel + selective recompute"
          + ("; predicted without sequence parallelism)" if a.no_sp else ")"))
    print(f"{'model':>7} {'GPUs':>5} {'layout (published)':<38} {'GB':>5} {'fits':>4} | "
          f"{'pub s':>7} {'pred s':>7} {'pub MFU':>7} {'pred MFU':>8} {'ratio':>5}")
    for name, heads, h, layers, tp, pp, gpus, B, mb, v, secs, mfu in KORTHIKANTI:
        ok, r, _ = best((heads, h, layers, tp, pp, gpus, B), c, "selective", (mb,), v, not a.no_sp)
        step = r["time"]["step"]
        pred = model_flops(B, h, layers) / step / gpus / (c.tflops * 1e12)
        print(f"{name:>7} {gpus:>5} {lay_text(r['layout']):<38} {r['memory']['total'] / GB:>5.1f} "
              f"{'y' if ok else 'NO':>4} | {secs:>7.2f} {step:>7.2f} {mfu:>7.1%} {pred:>8.1%} {pred / mfu:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
