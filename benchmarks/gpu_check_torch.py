"""gpu_check's PyTorch worker: tokens/s and peak device memory of the same model shape as the hpengine
side (benchmarks/torch_llama.py's Llama or torch_ref.py's GPT), eager and then under torch.compile, in
one process. It runs under the interpreter that has torch (--torch-python), so it imports only the
standard library, torch and the other benchmarks' standard-library modules.

The peer of hpengine's bf16 amp (float32 master weights, bf16 GEMM operands, float32 AdamW state in one
fused kernel) is torch.autocast(bfloat16) over float32 parameters with AdamW(fused=True): the precision
recipe PyTorch users train in, with the optimizer as one fused kernel like hpengine's; attention is
F.scaled_dot_product_attention (its flash kernel on an H200), TF32 off for what stays float32. With
--cpu-smoke it runs on the CPU, and torch.compile uses the "eager" backend (no code generation).
"""
from __future__ import annotations

import statistics
import sys
import time

from gpu_check_options import model_shape, save_result
from gpu_check_report import tokens_per_s


def _module(shape: dict):
    import torch_llama                                   # noqa: PLC0415 - benchmarks/torch_llama.py
    import torch_ref                                     # noqa: PLC0415 - benchmarks/torch_ref.py
    return torch_llama if shape.get("kind") == "llama" else torch_ref


def build_torch(torch, shape: dict, attn: str, dev: str):
    """(model, one-step function) of the shape's model on `dev` in float32 (torch_llama.py's for kind
    llama, else torch_ref.py's), the scripts' own AdamW(fused=False)."""
    import torch_ref                                     # noqa: PLC0415
    model, opt, ra = build_model(torch, shape, attn, dev)
    return model, torch_ref.make_step(torch, model, opt, ra, dev)


def build_model(torch, shape: dict, attn: str, dev: str, fused_adamw: bool = False):
    """(model, optimizer, the script's parsed arguments); fused_adamw swaps in AdamW(fused=True) with the
    same groups and settings."""
    mod = _module(shape)
    torch.set_float32_matmul_precision("highest")
    args = ["--attn", attn, "--vocab", str(shape["vocab"]), "--d-model", str(shape["d_model"]),
            "--layers", str(shape["n_layers"]), "--heads", str(shape["n_heads"]),
            "--seq", str(shape["seq_len"]), "--batch", str(shape["batch"])]
    if shape.get("kind") == "llama":
        args += ["--kv-heads", str(shape["n_kv_heads"]), "--ffn-hidden", str(shape["ffn_hidden"])]
    ra = mod.parse(args)
    torch.manual_seed(1234)
    model, opt = mod.build(ra, torch, device=dev)
    if fused_adamw:
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        opt = torch.optim.AdamW(groups, lr=opt.defaults["lr"], betas=opt.defaults["betas"], eps=opt.defaults["eps"],
                                fused=True)
    return model, opt, ra


def _timed(step, a, sync) -> dict:
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
    return {"warmup_steps": n, "steps": a.steps, "median_step_ms": statistics.median(times) * 1e3,
            "min_step_ms": min(times) * 1e3}


def worker_torch(a) -> dict:
    shape = model_shape(a, a.model)
    try:
        import torch                                     # noqa: PLC0415
    except ImportError as e:
        return {"skipped": f"torch is not importable by {sys.executable} ({e}); pass --torch-python"}
    import torch_ref                                     # noqa: PLC0415
    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda":
        if not torch.cuda.is_available():
            return {"error": "torch sees no CUDA device"}
        torch.backends.cuda.matmul.allow_tf32 = False    # what stays float32 is float32 (CUPY_TF32=0 there)
        torch.backends.cudnn.allow_tf32 = False
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(1)
        sync = (lambda: None)
    model, opt, ra = build_model(torch, shape, "sdpa", dev, fused_adamw=True)

    class Bf16(torch.nn.Module):
        """The model's forward under torch.autocast(bfloat16); parameters and optimizer stay float32."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, idx, tgt):
            with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                return self.m(idx, tgt)

    res = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "model": shape, "precision": "autocast bf16, float32 parameters, AdamW fused, sdpa attention"}

    def run(wrapped, key: str) -> None:
        step = torch_ref.make_step(torch, wrapped, opt, ra, dev)
        t0 = time.perf_counter()
        step()                                           # the first step (compiles under torch.compile)
        sync()
        r = {"first_step_s": time.perf_counter() - t0, **_timed(step, a, sync),
             "n_params": sum(p.numel() for p in model.parameters())}
        r["tokens_per_s"] = tokens_per_s(shape["batch"], shape["seq_len"], r["median_step_ms"] / 1e3)
        if dev == "cuda":
            r["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            r["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        res[key] = r
        save_result(a.result, res)

    eager = Bf16(model)
    run(eager, "eager")
    if a.no_compile:
        res["compile"] = {"skipped": "--no-compile"}
        return res
    if dev == "cuda":
        torch.cuda.empty_cache()                         # the compiled run's peak starts from what it holds
        torch.cuda.reset_peak_memory_stats()
    try:
        run(torch.compile(eager, backend="eager" if a.cpu_smoke else "inductor"), "compile")
    except Exception as e:                               # noqa: BLE001 - reported in the table
        print(f"torch.compile failed: {type(e).__name__}: {e}", file=sys.stderr)
        res["compile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return res
