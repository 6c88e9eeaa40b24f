"""gpu_check's command line and the fixed figures every part shares: the parts and their order, the
targets a run is judged against, the model shapes (GPU and --cpu-smoke), and each part's time limit.
Standard library only: the orchestrator and the PyTorch worker (another interpreter) both parse here.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

DESCRIPTION = "GPU check: GPU tests, kernel bandwidth, tokens/s vs PyTorch eager, a 2-rank staged run."
PARTS = ("tests", "bandwidth", "calibrate", "ref", "dp2", "gpt2")       # the order they run in
ADAMW_BYTES_PER_PARAM = 28        # read p, g, m, v + write p, m, v (float32); the mask byte not counted
BW_TARGET = 0.85                  # kernel bandwidth / copy bandwidth
SPEED_TARGET = 1.0                # hpengine tokens/s / PyTorch eager tokens/s
LOSS_RTOL = 1e-5                  # 2-rank vs 1-rank loss, float32
GNORM_RTOL = 1e-4                 # 2-rank vs 1-rank gradient norm, float32 (reduced in another order)

# model shapes: (d_model, n_layers, n_heads, seq_len, vocab, batch); gpt2 is GPT-2 small's size, its
# vocab 50257 padded to a multiple of 64 as GPU runs of it usually are
MODELS = {
    "ref": dict(d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab=256, batch=8),
    "gpt2": dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, vocab=50304, batch=8),
}
SMOKE_MODELS = {
    "ref": dict(d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=256, batch=4),
    "gpt2": dict(d_model=48, n_layers=2, n_heads=4, seq_len=32, vocab=320, batch=2),
}
# per-part limits in seconds (GPU, smoke); the overall deadline clips them further
LIMITS = {
    "corpus": (30, 30), "tests": (150, 60), "bandwidth": (60, 30), "calibrate": (60, 30),
    "hpengine": (120, 45), "torch": (75, 45), "dp2-1": (60, 45), "dp2-2": (90, 45),
}
WORKER_NAMES = ("corpus", "bandwidth", "hpengine", "torch", "losses")


def count(text: str) -> int:
    """'256M' -> 268435456, '4k' -> 4096, '1000' -> 1000 (binary suffixes k, M, G)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count such as 1000, 64k, 256M or 1G")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def name_list(valid):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(valid)}")
        return items
    return parse


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the whole control flow on the CPU: NumPy stand-ins, tiny sizes, nothing judged "
                        "but errors and the 2-rank equality")
    p.add_argument("--parts", type=name_list(PARTS), default=list(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="overall time limit of the parts in seconds (default 440; 240 with --cpu-smoke)")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="folder for gpu_check.json/.md/.log (default $OUT; none when unset)")
    p.add_argument("--mpiexec", default=None, help="mpiexec for the dp2 part (default $MPIEXEC, the one beside "
                   "the interpreter, or PATH's)")
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON") or sys.executable,
                   help="interpreter with torch for the PyTorch side (default $TORCH_PYTHON or this one)")
    p.add_argument("--torch-attn", type=name_list(("explicit", "sdpa")), default=["explicit", "sdpa"],
                   help="PyTorch attention variants; the first is judged (explicit = the same math as "
                        "hpengine), the others are shown for information when time allows")
    p.add_argument("--bw-params", type=count, default=None, help="AdamW parameters (default 256M; smoke 1M)")
    p.add_argument("--bw-reps", type=int, default=None, help="timed repetitions (default 25; smoke 3)")
    p.add_argument("--bw-inner", type=int, default=None,
                   help="launches per timed repetition (default 5; smoke 1): back to back, so the host's "
                        "per-call checks do not leave the GPU idle inside the timed region")
    p.add_argument("--pack-segments", type=int, default=64, help="segments the pack kernel gathers (default 64)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; smoke 3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps at least (default 3; smoke 1)")
    p.add_argument("--warmup-s", type=float, default=None, help="untimed seconds at least (default 2; smoke 0)")
    p.add_argument("--gpt2-batch", type=int, default=None, help="batch of the GPT-2-small model (default 8)")
    p.add_argument("--dp2-steps", type=int, default=6, help="steps of the 1-rank and 2-rank runs (default 6)")
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL, help=f"default {LOSS_RTOL:g}")
    p.add_argument("--gnorm-rtol", type=float, default=GNORM_RTOL, help=f"default {GNORM_RTOL:g}")
    # internal: run one part's work in this process and write its result as JSON
    p.add_argument("--worker", choices=WORKER_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=tuple(MODELS), default="ref", help=argparse.SUPPRESS)
    p.add_argument("--attn", choices=("explicit", "sdpa"), default="explicit", help=argparse.SUPPRESS)
    p.add_argument("--variants", default="single", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    for name, gpu, cpu in (("deadline_s", 440.0, 240.0), ("bw_params", 256 << 20, 1 << 20), ("bw_reps", 25, 3),
                           ("bw_inner", 5, 1), ("steps", 20, 3), ("warmup_steps", 3, 1), ("warmup_s", 2.0, 0.0),
                           ("gpt2_batch", 8, 2)):
        if getattr(a, name) is None:
            setattr(a, name, cpu if smoke else gpu)
    for name in ("bw_reps", "bw_inner", "steps", "pack_segments", "gpt2_batch", "dp2_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.bw_params < 1024:
        p.error("--bw-params must be >= 1024")
    a.bw_params -= a.bw_params % 4          # whole 16-byte vectors; 14 bytes per parameter fill whole floats
    return a


def model_shape(a, name: str) -> dict:
    shape = dict((SMOKE_MODELS if a.cpu_smoke else MODELS)[name])
    if name == "gpt2" and not a.cpu_smoke:
        shape["batch"] = a.gpt2_batch
    return shape


def model_label(shape: dict) -> str:
    return (f"d{shape['d_model']} L{shape['n_layers']} H{shape['n_heads']} T{shape['seq_len']} "
            f"V{shape['vocab']} B{shape['batch']}")


def part_limit(a, part: str) -> float:
    """A part's own time limit in seconds (before the overall deadline clips it)."""
    return LIMITS[part][1 if a.cpu_smoke else 0]
