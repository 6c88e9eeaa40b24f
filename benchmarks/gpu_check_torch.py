"""gpu_check's PyTorch worker: tokens/s of benchmarks/torch_ref.py's model, the same shape as the hpengine
side, in PyTorch eager on the GPU (float32, TF32 off) or on the CPU with --cpu-smoke. It runs under the
interpreter that has torch (--torch-python), so it imports only the standard library, torch and the
other benchmarks' standard-library modules.
"""
from __future__ import annotations

import statistics
import sys
import time

from gpu_check_options import model_shape
from gpu_check_report import tokens_per_s


def build_torch(torch, shape: dict, attn: str, dev: str):
    """(model, one-step function) of benchmarks/torch_ref.py's model for a shape, on `dev` in float32."""
    import torch_ref                                     # noqa: PLC0415 - benchmarks/torch_ref.py: the model
    torch.set_float32_matmul_precision("highest")
    ra = torch_ref.parse(["--attn", attn, "--vocab", str(shape["vocab"]), "--d-model", str(shape["d_model"]),
                          "--layers", str(shape["n_layers"]), "--heads", str(shape["n_heads"]),
                          "--seq", str(shape["seq_len"]), "--batch", str(shape["batch"])])
    torch.manual_seed(1234)
    model, opt = torch_ref.build(ra, torch, device=dev)
    return model, torch_ref.make_step(torch, model, opt, ra, dev)


def worker_torch(a) -> dict:
    shape = model_shape(a, a.model)
    try:
        import torch                                     # noqa: PLC0415
    except ImportError as e:
        return {"skipped": f"torch is not importable by {sys.executable} ({e}); pass --torch-python"}
    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda":
        if not torch.cuda.is_available():
            return {"error": "torch sees no CUDA device"}
        torch.backends.cuda.matmul.allow_tf32 = False    # float32 as on the hpengine side (CUPY_TF32=0)
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    model, step = build_torch(torch, shape, a.attn, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    n, t_end = 0, time.perf_counter() + a.warmup_s
    while n < a.warmup_steps or time.perf_counter() < t_end:
        step()
        n += 1
    times = []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    res = {"engine": f"torch-{a.attn}", "torch": torch.__version__, "device": dev, "model": shape,
           "n_params": sum(p.numel() for p in model.parameters()), "warmup_steps": n, "steps": a.steps,
           "median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3,
           "tokens_per_s": tokens_per_s(shape["batch"], shape["seq_len"], med)}
    if dev == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
        res["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return res

