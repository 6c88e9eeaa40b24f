"""gpu_check's attention part: causal attention forward + backward at one shape (B, H, T, hd), hpengine's
flash attention kernels (hpengine/nn/flash_cuda.py) against torch's F.scaled_dot_product_attention with its
flash kernel, each in its own interpreter. Both sides draw the same inputs from one closed-form pattern,
rounded to bfloat16, and report the norm of every output and gradient and its dot product with another
pattern, so the table can check that the two computed the same thing.

hpengine variants: "bf16" runs flash_cuda under bf16 amp (float32 storage holding bf16 values, the path the
models take; the kernels it picks are listed, and only float32 kernels there means no bf16 path: "not
available"), "bits" hands it 2-byte bf16 storage (uint16), "float32" the float32 kernels. With --cpu-smoke the
float32 variant is nn/flash.py's NumPy twin and the others are not available; torch runs float32 on the CPU.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

from gpu_check_options import attn_shape, save_result

TENSORS = ("q", "k", "v", "do", "w")            # w: the pattern every output is dotted with
AMPLITUDE = {"q": 0.5, "k": 0.5, "v": 1.0, "do": 1.0, "w": 1.0}


def pattern_float64(xp, n: int, j: int):
    """Tensor j's n values before scaling: sin(0.001 ((7919 i) mod 10007) + j), float64, from int64
    indices (CuPy or NumPy; pattern_torch is the same operations in torch)."""
    i = xp.arange(n, dtype=xp.int64)
    return xp.sin(((i * 7919) % 10007).astype(xp.float64) * 0.001 + j)


def pattern_torch(torch, n: int, j: int, device: str):
    i = torch.arange(n, dtype=torch.int64, device=device)
    return torch.sin(((i * 7919) % 10007).to(torch.float64) * 0.001 + j)


def timings(timer, fwd, fwd_bwd, reps: int) -> dict:
    """Median milliseconds of forward and of forward + backward, interleaved, after two of each untimed."""
    for _ in range(2):
        fwd()
        fwd_bwd()
    tf, tb = [], []
    for _ in range(reps):
        tf.append(timer(fwd, 1))
        tb.append(timer(fwd_bwd, 1))
    return {"fwd_ms": statistics.median(tf) * 1e3, "fwd_bwd_ms": statistics.median(tb) * 1e3, "reps": reps}


def _checks(xp, named: dict, w) -> dict:
    """{name: {"norm", "dot"}}: float64 norm of each array and its dot product with w / |w|."""
    wn = w.astype(xp.float64)
    wn = wn / float(xp.sqrt((wn * wn).sum()))
    out = {}
    for name, x in named.items():
        x64 = x.astype(xp.float64)
        out[name] = {"norm": float(xp.sqrt((x64 * x64).sum())), "dot": float((x64 * wn).sum())}
    return out


def _checks_torch(torch, named: dict, w) -> dict:
    """_checks for torch tensors."""
    wn = w.to(torch.float64)
    wn = wn / wn.norm()
    return {name: {"norm": float(x.to(torch.float64).norm()), "dot": float((x.to(torch.float64) * wn).sum())}
            for name, x in named.items()}


# ----------------------------------------------------------------------------------- hpengine

def worker_attention(a) -> dict:
    from hpengine.device import kernels                       # noqa: PLC0415
    from hpengine.doctor.bandwidth import device_setup        # noqa: PLC0415
    from hpengine.device.precision import round_bf16_          # noqa: PLC0415
    from hpengine.nn import flash, flash_cuda                  # noqa: PLC0415
    B, H, T, hd = attn_shape(a)
    n, scale = B * H * T * hd, 1.0 / math.sqrt(hd)
    xp, timer, device = device_setup(a.cpu_smoke, "cpu")
    x = {name: round_bf16_(xp, (AMPLITUDE[name] * pattern_float64(xp, n, j)).astype(xp.float32).reshape(B, H, T, hd))
         for j, name in enumerate(TENSORS)}
    res = {"shape": [B, H, T, hd], "device": device, "variants": {}}

    def gpu_variant(key: str):
        """(fwd, fwd_bwd, outputs) on CuPy: outputs() gives float32 o, dq, dk, dv of the last call."""
        q, k, v, do = (x[t] for t in ("q", "k", "v", "do"))
        if key == "bits":
            q, k, v, do = (flash_cuda.to_bf16(xp, t) for t in (q, k, v, do))
        o, dq, dk, dv = (xp.empty_like(q) for _ in range(4))
        state = {}

        mma = flash_cuda.use_mma(q.dtype, key == "bf16")      # as nn/flash.py asks under bf16 amp

        def fwd():
            state["lse"] = flash_cuda.forward(xp, q, k, v, o, scale, mma=mma)

        def fwd_bwd():
            fwd()
            flash_cuda.backward(xp, q, k, v, o, do, state["lse"], dq, dk, dv, scale, mma=mma)

        def outputs():
            conv = (lambda t: flash_cuda.from_bf16(xp, t)) if key == "bits" else (lambda t: t)
            return {"o": conv(o), "dq": conv(dq), "dk": conv(dk), "dv": conv(dv)}
        return fwd, fwd_bwd, outputs

    def numpy_variant():
        """nn/flash.py's NumPy twin (q scaled on the way in, as the llama path hands it)."""
        q, k, v, do = (x[t] for t in ("q", "k", "v", "do"))
        dy = xp.ascontiguousarray(do.transpose(0, 2, 1, 3)).reshape(B, T, H * hd)
        state = {}

        def fwd():
            state["y"], state["cache"] = flash.flash_gqa_forward(xp, q * xp.float32(scale), k, v)

        def fwd_bwd():
            fwd()
            state["grads"] = flash.flash_gqa_backward(xp, dy, state["cache"])

        def outputs():
            dq, dk, dv = state["grads"]
            return {"o": state["y"].reshape(B, T, H, hd).transpose(0, 2, 1, 3), "dq": dq * xp.float32(scale),
                    "dk": dk, "dv": dv}
        return fwd, fwd_bwd, outputs

    for key in ("bf16", "bits", "float32"):     # bf16 first: the kernels it loads are listed before float32's
        try:
            if a.cpu_smoke and key != "float32":
                res["variants"][key] = {"not_available": "needs CuPy (flash_cuda.py's kernels)"}
                continue
            before = set(getattr(kernels, "_FUNCS", {}))
            fwd, fwd_bwd, outputs = numpy_variant() if a.cpu_smoke else gpu_variant(key)
            fwd_bwd()
            out = {"checks": _checks(xp, outputs(), x["w"]), **timings(timer, fwd, fwd_bwd, a.attn_reps)}
            new = sorted(str(f[1]) for f in set(getattr(kernels, "_FUNCS", {})) - before)
            if new:
                out["kernels"] = new
            if key == "bf16" and new and all(e.endswith("_f32") for e in new):
                out["not_available"] = (f"under bf16 amp flash_cuda runs its float32 kernels ({', '.join(new)}): "
                                        f"no bf16 path in this tree; {out['fwd_bwd_ms']:.2f} ms")
            res["variants"][key] = out
        except Exception as e:                       # noqa: BLE001 - reported in the table
            print(f"attention variant {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
            res["variants"][key] = ({"not_available": f"{type(e).__name__}: {e}"} if key == "bits" and
                                    isinstance(e, (ValueError, TypeError)) else {"error": f"{type(e).__name__}: {e}"})
        save_result(a.result, res)
    return res


# -------------------------------------------------------------------------------------- torch

def worker_attention_torch(a) -> dict:
    try:
        import torch                                 # noqa: PLC0415
        import torch.nn.functional as F              # noqa: PLC0415
    except ImportError as e:
        return {"skipped": f"torch is not importable by {sys.executable} ({e}); pass --torch-python"}
    B, H, T, hd = attn_shape(a)
    n = B * H * T * hd
    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        return {"error": "torch sees no CUDA device"}
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16

    def make(j, name):
        t = (AMPLITUDE[name] * pattern_torch(torch, n, j, dev)).float().reshape(B, H, T, hd)
        return t.to(torch.bfloat16).to(dtype)       # bf16-rounded values, as on the hpengine side
    x = {name: make(j, name) for j, name in enumerate(TENSORS)}
    q, k, v = (x[t].clone().requires_grad_() for t in ("q", "k", "v"))
    backend, ctx = "default", None
    if dev == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel      # noqa: PLC0415
            ctx, backend = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)), "flash"
        except ImportError:
            pass
    state = {}

    def fwd():
        if ctx is None:
            state["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with ctx():
                state["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fwd()
        state["o"].backward(x["do"])
    if dev == "cuda":
        timer = CudaEvents(torch)
    else:
        torch.set_num_threads(1)
        timer = host_timer
    fwd_bwd()
    with torch.no_grad():
        checks = _checks_torch(torch, {"o": state["o"], "dq": q.grad, "dk": k.grad, "dv": v.grad}, x["w"])
    return {"checks": checks, "dtype": str(dtype).replace("torch.", ""), "backend": backend, "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            **timings(timer, fwd, fwd_bwd, a.attn_reps)}


class CudaEvents:
    """EventTimer's torch twin: seconds per call from CUDA events on the current stream."""

    def __init__(self, torch):
        self.torch = torch

    def __call__(self, fn, inner: int) -> float:
        e0, e1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3 / inner


def host_timer(fn, inner: int) -> float:
    """Wall seconds per call (the CPU side; hpengine.doctor.bandwidth.HostTimer's twin, which this interpreter,
    torch's, may not be able to import)."""
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner
