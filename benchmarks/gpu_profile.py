"""Where a GPU training step's time goes: hpengine with its fused layer kernels on and off (step times
interleaved, medians), and a kernel table of one hpengine step and one PyTorch eager step from
torch.profiler (CUPTI records every CUDA kernel of the process, CuPy's included): kernel count, summed
kernel time and wall time per step tell a launch-bound step from a GPU-bound one.

    python3 benchmarks/gpu_profile.py [--models ref,gpt2] [--rounds 3] [--steps 4]

Run on a GPU machine next to benchmarks/gpu_check.py (same models, same corpus); with $OUT set, the
report is also written to $OUT/gpu_profile.txt. `--cpu-smoke` runs the same control flow on NumPy with
tiny models (timings meaningless; the profiler part is skipped).
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from gpu_check_hpengine import build_engine  # noqa: E402
from gpu_check_options import MODELS, SMOKE_MODELS, model_label  # noqa: E402
from gpu_check_torch import build_torch  # noqa: E402


def step_times(eng, sync, steps: int, first: int) -> list[float]:
    out = []
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        eng.train_step(first + i)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def kernel_table(torch, fn, sync, label: str, rows: int) -> str:
    """torch.profiler over two calls of fn: kernels per step, kernel time, wall time, the top kernels."""
    from torch.profiler import ProfilerActivity, profile   # noqa: PLC0415
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        fn()
        sync()
    wall = (time.perf_counter() - t0) / 2
    kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
    gpu_us = sum(e.device_time for e in kern) / 2 if kern and hasattr(kern[0], "device_time") else \
        sum(e.cuda_time for e in kern) / 2
    head = (f"{label}: {len(kern) / 2:.0f} kernels per step, {gpu_us / 1e3:.1f} ms of kernel time, "
            f"{wall * 1e3:.1f} ms wall per step (profiled)")
    try:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    except Exception as e:  # noqa: BLE001 - older/newer column names
        table = f"(no table: {e})"
    return head + "\n" + table


def run_model(a, name: str, data: str, out: io.StringIO) -> None:
    from hpengine.nn import fused                         # noqa: PLC0415
    shape = dict((SMOKE_MODELS if a.cpu_smoke else MODELS)[name])
    eng = build_engine(shape, data, "numpy" if a.cpu_smoke else "cupy")
    sync = eng.be.xp.cuda.Device().synchronize if eng.be.is_gpu else (lambda: None)
    tokens = shape["batch"] * shape["seq_len"]
    step = 0
    for on in (True, False, True):                        # warm both paths (kernels compile, pools fill)
        fused.ENABLED = on
        step_times(eng, sync, 2, step)
        step += 2
    times = {True: [], False: []}
    for _ in range(a.rounds):                             # interleaved: the machine's drift hits both
        for on in (True, False):
            fused.ENABLED = on
            times[on] += step_times(eng, sync, a.steps, step)
            step += a.steps
    fused.ENABLED = True
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"== {name} {model_label(shape)}, {eng.n_params():,} params, backend {eng.be.name}", file=out)
    for on in (True, False):
        print(f"   fused {'on ' if on else 'off'}: median {med[on] * 1e3:8.2f} ms/step "
              f"({tokens / med[on]:,.0f} tok/s) over {len(times[on])} steps", file=out)
    print(f"   fused on / off step time: {med[True] / med[False]:.2f}", file=out)
    if a.cpu_smoke or a.no_profiler:
        return
    try:
        import torch                                      # noqa: PLC0415
    except ImportError as e:
        print(f"   (no kernel tables: torch not importable: {e})", file=out)
        return
    box = {"step": step}

    def hp_step():
        eng.train_step(box["step"])
        box["step"] += 1
    print(kernel_table(torch, hp_step, sync, f"hpengine {name}", a.rows), file=out)
    del eng                                               # its device memory back before PyTorch's model
    eng_xp = sys.modules.get("cupy")
    if eng_xp is not None:
        eng_xp.get_default_memory_pool().free_all_blocks()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for attn in a.attn:
        model, tstep = build_torch(torch, shape, attn, "cuda")
        for _ in range(3):
            tstep()
        print(kernel_table(torch, tstep, torch.cuda.synchronize, f"torch eager ({attn}) {name}", a.rows), file=out)
        del model, tstep
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="ref,gpt2", help="comma-separated subset of ref,gpt2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    p.add_argument("--rows", type=int, default=18, help="kernels shown per table")
    p.add_argument("--attn", default="explicit", help="PyTorch attention variants profiled (explicit,sdpa)")
    p.add_argument("--no-profiler", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args(argv)
    a.attn = [s for s in a.attn.split(",") if s]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hpengine.data import ensure_default_corpus       # noqa: PLC0415
    data = str(ensure_default_corpus(max_bytes=(256 << 10) if a.cpu_smoke else (4 << 20)))
    report = io.StringIO()
    for name in [s for s in a.models.split(",") if s]:
        t0 = time.perf_counter()
        buf = io.StringIO()
        try:
            with redirect_stdout(sys.stderr):             # the engine's own log lines stay out of the report
                run_model(a, name, data, buf)
        except Exception as e:  # noqa: BLE001 - one model's failure still leaves the other's report
            buf.write(f"== {name}: failed: {type(e).__name__}: {e}\n")
        buf.write(f"   ({time.perf_counter() - t0:.0f} s)\n")
        print(buf.getvalue(), end="", flush=True)
        report.write(buf.getvalue())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_profile.txt").write_text(report.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
