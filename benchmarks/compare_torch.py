"""hpengine vs PyTorch eager on one thread, interleaved: runs bench_core.py and torch_ref.py (explicit
and sdpa attention) in turn, --repeats times each, every run a fresh process with its own warm-up, and
prints the median tokens/s of each side and the ratio hpengine / torch. Standard library only. The
torch sides run under --torch-python (else $TORCH_PYTHON); with neither, they are skipped.
--model llama compares the Llama reference instead: bench_core.py with model.kind = "llama", 8 query
heads and 2 key/value heads, against torch_llama.py; --model moe the same with configs/moe_small.toml's
experts (8 of width 256, top 2) against torch_llama.py --experts 8.

    python3 benchmarks/compare_torch.py --torch-python "$TORCH_PYTHON" --repeats 3 --json compare.json
    python3 benchmarks/compare_torch.py --model llama --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# per model: (bench_core.py --set overrides, torch script, its model options). The shared shape (vocab
# 256, d_model 256, 4 layers, seq 128, global batch 8, lr 3e-3) is hpengine's default and each torch
# script's; what differs from the defaults is passed here.
MODELS = {
    "gpt": ([], "torch_ref.py", []),
    "llama": (["model.kind=llama", "model.n_heads=8", "model.n_kv_heads=2"], "torch_llama.py",
              ["--heads", "8", "--kv-heads", "2"]),
    # configs/moe_small.toml's model: 8 experts of width 256, top 2, the first layer dense
    "moe": (["model.kind=llama", "model.n_heads=8", "model.n_kv_heads=2", "model.moe.num_experts=8",
             "model.moe.top_k=2", "model.moe.expert_hidden=256", "model.moe.dense_layers=1",
             "model.moe.aux_loss=0.01", "model.moe.z_loss=0.001"], "torch_llama.py",
            ["--heads", "8", "--kv-heads", "2", "--experts", "8", "--top-k", "2", "--expert-hidden", "256",
             "--dense-layers", "1", "--aux-loss", "0.01", "--z-loss", "0.001"]),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=tuple(MODELS), default="gpt",
                   help="reference model: gpt (torch_ref.py), llama or moe (torch_llama.py); default gpt")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="warm-up seconds per run (default 5)")
    p.add_argument("--machine-warmup-s", type=float, default=15.0,
                   help="untimed hpengine run before the first measurement (default 15; 0 = none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hpengine-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON") or None, metavar="PATH",
                   help="Python with torch for the torch sides (default $TORCH_PYTHON; neither = skipped)")
    p.add_argument("--json", default=None, help="write every run and the medians as JSON to this path")
    return p.parse_args(argv)


def one(cmd, out):
    res = subprocess.run(cmd + ["--json", out], capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout}{res.stderr}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    a = parse(argv)
    common = ["--steps", str(a.steps), "--warmup-s", str(a.warmup_s), "--threads", str(a.threads)]
    sets, script, opts = MODELS[a.model]
    sides = {"hpengine": [a.hpengine_python, os.path.join(HERE, "bench_core.py")]
             + [x for kv in sets for x in ("--set", kv)]}
    if a.torch_python:
        for attn in ("explicit", "sdpa"):
            sides[f"torch-{attn}"] = [a.torch_python, os.path.join(HERE, script), "--attn", attn, *opts]
    else:
        print("compare_torch.py: no Python with torch given (pass --torch-python PATH or set TORCH_PYTHON); "
              "the torch sides are skipped", flush=True)
    runs = {k: [] for k in sides}
    with tempfile.TemporaryDirectory(prefix="hpe-compare-") as tmp:
        if a.machine_warmup_s > 0:
            print(f"machine warm-up {a.machine_warmup_s:.0f} s ...", flush=True)
            one(sides["hpengine"] + ["--steps", "1", "--warmup-s", str(a.machine_warmup_s),
                                     "--threads", str(a.threads)], os.path.join(tmp, "warm.json"))
        for i in range(a.repeats):
            for k, cmd in sides.items():
                t0 = time.perf_counter()
                r = one(cmd + common, os.path.join(tmp, f"{k}-{i}.json"))
                runs[k].append(r)
                print(f"run {i + 1}/{a.repeats} {k:<15} {r['tokens_per_s']:>8,.0f} tok/s  "
                      f"{r['median_step_ms']:6.1f} ms/step (CPU {r['median_cpu_ms']:6.1f})  "
                      f"RSS {r['peak_rss_bytes'] / 2**20:4.0f} MiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["tokens_per_cpu_s"] for r in v) for k, v in runs.items()}
    rss = {k: statistics.median(r["peak_rss_bytes"] for r in v) for k, v in runs.items()}
    params = {k: v[0]["n_params"] for k, v in runs.items()}
    # tokens per CPU-second is the steadier figure on a shared machine (a preempted step costs wall
    # time, not CPU time); on a quiet machine both agree
    print(f"\n{'side':<15} {'median tok/s':>12} {'ratio':>6} {'tok/CPU-s':>10} {'ratio':>6} {'peak RSS':>9}")
    for k in sides:
        print(f"{k:<15} {med[k]:>12,.0f} {med['hpengine'] / med[k]:>6.2f} {cpu[k]:>10,.0f} "
              f"{cpu['hpengine'] / cpu[k]:>6.2f} {rss[k] / 2**20:>5.0f} MiB")
    print("ratio = hpengine / side")
    print(f"model {a.model}, parameters: " + ", ".join(f"{k} {n:,}" for k, n in params.items()))
    if len(set(params.values())) > 1:
        print("WARNING: the sides' parameter counts differ: they are not the same model", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "n_params": params, "threads": a.threads, "repeats": a.repeats,
                       "median_tokens_per_s": med, "median_tokens_per_cpu_s": cpu, "median_peak_rss_bytes": rss,
                       "ratio": {k: med["hpengine"] / med[k] for k in sides if k != "hpengine"},
                       "ratio_cpu": {k: cpu["hpengine"] / cpu[k] for k in sides if k != "hpengine"},
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
