"""gpu_check's command line and the fixed figures every part shares: the parts and their order, the
targets a run is judged against, the model shapes (GPU and --cpu-smoke), and each part's time limit.
Standard library only: the orchestrator and the PyTorch worker (another interpreter) both parse here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

DESCRIPTION = ("GPU check: GPU tests, tokens/s, MFU and peak memory of a 1B llama and GPT-2 small in bf16 against "
               "PyTorch, flash attention against sdpa, flash attention on packed documents, Muon's Newton-Schulz, "
               "kernel bandwidth, 2 ranks over staged MPI and NCCL, hpengine doctor.")
# the order they run in: the most important figures first, so a run cut short still has them
PARTS = ("tests", "llama", "gpt2", "attention", "documents", "muon", "bandwidth", "dp2", "doctor", "calibrate")
SPEED_PARTS = ("llama", "gpt2")   # hpengine (bf16 amp) against PyTorch (autocast bf16), eager and compiled
BW_TARGET = 0.85                  # kernel bandwidth / copy bandwidth (hpengine.doctor.bandwidth.TARGET, its judge)
SPEED_TARGET = 1.0                # hpengine tokens/s / PyTorch eager (sdpa) tokens/s
MFU_TARGET = {"llama": 0.40}      # hpengine's MFU; the other models' MFU is information
MEMORY_TARGET = 1.0               # hpengine's peak device memory / PyTorch's
ATTN_RTOL = 2e-2                  # hpengine attention outputs and gradients against torch's (bf16 inputs)
LOSS_RTOL = 1e-5                  # 2-rank vs 1-rank loss, float32
GNORM_RTOL = 1e-4                 # 2-rank vs 1-rank gradient norm, float32 (reduced in another order)

# Model shapes. gpt: d_model, n_layers, n_heads, seq_len, vocab; llama adds n_kv_heads and ffn_hidden
# (head_dim = d_model / n_heads). Parameters (gpu_check_speed.n_params):
#   gpt   N = 2 V d + T d + L (12 d^2 + 13 d) + 2 d        (token and position embeddings, untied head; per
#                                                           block qkv, proj, fc, out with biases, two layernorms)
#   llama N = 2 V d + L (d hd (2 H + 2 KV) + 3 d F + 2 d) + d   (embedding, untied head; q, k, v, o, gate, up,
#                                                           down without biases, two RMSNorms; final norm)
# llama: 2 * 32000 * 2048 + 20 * (2048 * 128 * 48 + 3 * 2048 * 5632 + 4096) + 2048 = 1,074,874,368 (1.07 B);
# at batch 4 x 2048 tokens it takes about 21 GB of parameters, gradients and AdamW state on the hpengine side
# (fp32 masters, compute copy, gradients, two moments) and fits one H200 with room for the activations.
# gpt2 is GPT-2 small's size (163,109,376 parameters with the untied head), its vocab 50257 padded to a
# multiple of 64 as GPU runs of it usually are. ref is the small model of the dp2 part's equality runs; comm
# is GPT-2 small trained by 2 ranks there (collectives mpi against nccl).
GPT2 = dict(kind="gpt", d_model=768, n_layers=12, n_heads=12, seq_len=1024, vocab=50304, batch=8)
MODELS = {
    "llama": dict(kind="llama", d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                  seq_len=2048, vocab=32000, batch=4),
    "gpt2": GPT2,
    "ref": dict(kind="gpt", d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab=256, batch=8),
    "comm": dict(GPT2, batch=4),
}
SMOKE_MODELS = {
    "llama": dict(kind="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, seq_len=32,
                  vocab=320, batch=2),
    "gpt2": dict(kind="gpt", d_model=48, n_layers=2, n_heads=4, seq_len=32, vocab=320, batch=2),
    "ref": dict(kind="gpt", d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=256, batch=4),
    "comm": dict(kind="gpt", d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=256, batch=4),
}
# the attention part's inputs: (batch, heads, seq_len, head_dim), causal, as torch sdpa's flash kernel takes them
ATTN_SHAPE, SMOKE_ATTN_SHAPE = (4, 16, 2048, 128), (1, 2, 40, 16)
# the documents part's: (batch, heads, seq_len, head_dim, mean document length), packed documents against causal
DOC_SHAPE, SMOKE_DOC_SHAPE = (2, 16, 4096, 128, 512), (2, 2, 96, 16, 16)
# per-part limits in seconds (GPU, smoke); the overall deadline clips them further
LIMITS = {
    "corpus": (30, 30), "tests": (150, 60), "llama:hpengine": (180, 45), "llama:torch": (180, 60),
    "gpt2:hpengine": (90, 45), "gpt2:torch": (120, 60), "attention:hpengine": (45, 30), "attention:torch": (45, 30),
    "documents": (45, 30), "muon": (45, 30), "bandwidth": (60, 30), "dp2-1": (45, 45), "dp2-2": (120, 60),
    "doctor": (90, 60), "calibrate": (60, 30),
}
WORKER_NAMES = ("corpus", "bandwidth", "hpengine", "torch", "losses", "attention", "attention_torch", "documents",
                "muon")
DEFAULT_DEADLINE_S = (500.0, 240.0)   # GPU (gpu_check.sh passes what its 10-minute total leaves), smoke


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
                        "but errors, the attention outputs' agreement and the 2-rank equality")
    p.add_argument("--parts", type=name_list(PARTS), default=list(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--deadline-s", type=float, default=None,
                   help=f"overall time limit of the parts in seconds (default {DEFAULT_DEADLINE_S[0]:.0f}; "
                        f"{DEFAULT_DEADLINE_S[1]:.0f} with --cpu-smoke)")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="folder for gpu_check.json/.md/.log (default $OUT; none when unset); rewritten after "
                        "every part, so a run stopped early leaves what it had")
    p.add_argument("--mpiexec", default=None, help="mpiexec for the dp2 part (default $MPIEXEC, the one beside "
                   "the interpreter, or PATH's)")
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON") or sys.executable,
                   help="interpreter with torch for the PyTorch side (default $TORCH_PYTHON or this one)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile rows (PyTorch eager only)")
    p.add_argument("--hpe-attention", choices=("flash", "standard"), default="flash",
                   help="hpengine's model.attention in the llama and gpt2 parts (default flash, the peer of "
                        "PyTorch's sdpa flash kernel: no T x T probabilities kept)")
    p.add_argument("--bw-params", type=count, default=None, help="AdamW parameters (default 256M; smoke 1M)")
    p.add_argument("--bw-reps", type=int, default=None, help="timed repetitions (default 25; smoke 3)")
    p.add_argument("--bw-inner", type=int, default=None,
                   help="launches per timed repetition (default 5; smoke 1): back to back, so the host's "
                        "per-call checks do not leave the GPU idle inside the timed region")
    p.add_argument("--pack-segments", type=int, default=64, help="segments the pack kernel gathers (default 64)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 10; smoke 2)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps at least (default 3; smoke 1)")
    p.add_argument("--warmup-s", type=float, default=None, help="untimed seconds at least (default 2; smoke 0)")
    p.add_argument("--attn-reps", type=int, default=None, help="timed attention repetitions (default 20; smoke 2)")
    p.add_argument("--llama-batch", type=int, default=None, help="batch of the llama model (default 4)")
    p.add_argument("--gpt2-batch", type=int, default=None, help="batch of the GPT-2-small model (default 8)")
    p.add_argument("--dp2-steps", type=int, default=6, help="steps of the 1-rank and 2-rank runs (default 6)")
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL, help=f"default {LOSS_RTOL:g}")
    p.add_argument("--gnorm-rtol", type=float, default=GNORM_RTOL, help=f"default {GNORM_RTOL:g}")
    # internal: run one part's work in this process and write its result as JSON
    p.add_argument("--worker", choices=WORKER_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=tuple(MODELS), default="ref", help=argparse.SUPPRESS)
    p.add_argument("--variants", default="single", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    for name, gpu, cpu in (("deadline_s",) + DEFAULT_DEADLINE_S, ("bw_params", 256 << 20, 1 << 20),
                           ("bw_reps", 25, 3), ("bw_inner", 5, 1), ("steps", 10, 2), ("warmup_steps", 3, 1),
                           ("warmup_s", 2.0, 0.0), ("attn_reps", 20, 2), ("llama_batch", 4, 2), ("gpt2_batch", 8, 2)):
        if getattr(a, name) is None:
            setattr(a, name, cpu if smoke else gpu)
    for name in ("bw_reps", "bw_inner", "steps", "pack_segments", "attn_reps", "llama_batch", "gpt2_batch",
                 "dp2_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.bw_params < 1024:
        p.error("--bw-params must be >= 1024")
    a.bw_params -= a.bw_params % 4          # whole 16-byte vectors; 14 bytes per parameter fill whole floats
    return a


def model_shape(a, name: str) -> dict:
    shape = dict((SMOKE_MODELS if a.cpu_smoke else MODELS)[name])
    if not a.cpu_smoke and name in ("llama", "gpt2"):
        shape["batch"] = getattr(a, f"{name}_batch")
    return shape


def attn_shape(a) -> tuple:
    return SMOKE_ATTN_SHAPE if a.cpu_smoke else ATTN_SHAPE


def model_label(shape: dict) -> str:
    kv = f" KV{shape['n_kv_heads']} F{shape['ffn_hidden']}" if shape.get("kind") == "llama" else ""
    return (f"d{shape['d_model']} L{shape['n_layers']} H{shape['n_heads']}{kv} T{shape['seq_len']} "
            f"V{shape['vocab']} B{shape['batch']}")


def part_limit(a, part: str) -> float:
    """A part's own time limit in seconds (before the overall deadline clips it)."""
    return LIMITS[part][1 if a.cpu_smoke else 0]


def save_result(path: str | None, res: dict) -> None:
    """A worker's result as JSON at `path` (the orchestrator's --result), replaced whole: workers call it
    after each stage, so a part stopped by its limit still reports the stages it finished."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)
