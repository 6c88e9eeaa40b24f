"""gpu_check's model figures and their rows: parameter counts and training FLOPs per token of the model
shapes, MFU against the device's datasheet peak, peak device memory, and the table rows of the llama and
gpt2 parts (hpengine under bf16 amp against PyTorch autocast bf16, eager and compiled) and of the attention
part (hpengine's flash attention kernels against torch's sdpa flash kernel on the same inputs).
Standard library only: pure functions of the results, tested without a GPU.
"""
from __future__ import annotations

import functools
import math
import runpy
from pathlib import Path

from gpu_check_options import ATTN_RTOL, MEMORY_TARGET, MFU_TARGET, SPEED_TARGET, model_label
from gpu_check_report import Row, err_text, judged

PEAKS_FILE = Path(__file__).resolve().parents[1] / "hpengine" / "planner" / "peaks.py"


# ------------------------------------------------------------------------- arithmetic (pure)

def head_dim(shape: dict) -> int:
    return shape["d_model"] // shape["n_heads"]


def n_params(shape: dict) -> int:
    """Parameters of a model shape (the formulas above MODELS in gpu_check_options.py)."""
    d, L, V, T = shape["d_model"], shape["n_layers"], shape["vocab"], shape["seq_len"]
    if shape.get("kind") == "llama":
        hd, H, K, F = head_dim(shape), shape["n_heads"], shape["n_kv_heads"], shape["ffn_hidden"]
        return 2 * V * d + L * (d * hd * (2 * H + 2 * K) + 3 * d * F + 2 * d) + d
    return 2 * V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d


def flops_per_token(shape: dict) -> float:
    """Training FLOPs per token: 6 N + 12 L T H hd, the formula of hpengine's own progress line
    (run/trace.model_flops): every parameter counted (embeddings too), and the attention scores and values
    of forward and backward counted whole (the causal half that is skipped is not subtracted)."""
    return 6.0 * n_params(shape) + 12.0 * shape["n_layers"] * shape["seq_len"] * shape["n_heads"] * head_dim(shape)


@functools.lru_cache(maxsize=None)
def _table_peak():
    """hpengine/planner/peaks.py's table_peak, read from the file (it imports nothing), so this module needs
    neither numpy nor the hpengine package under the PyTorch interpreter."""
    return runpy.run_path(str(PEAKS_FILE))["table_peak"]


def peak_bf16_flops(device: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by name (NVIDIA's datasheet, as the progress line uses); None for a
    device the table does not know (the CPU included)."""
    if not device or device == "cpu":
        return None
    tflops = _table_peak()(device, "16bit")
    return None if tflops is None else tflops * 1e12


def mfu(shape: dict, tokens_per_s: float, device: str | None) -> float | None:
    peak = peak_bf16_flops(device)
    return None if peak is None else flops_per_token(shape) * tokens_per_s / peak


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def agreement(got: dict, want: dict) -> float:
    """Largest difference between two sides' checks of the same tensors ({name: {"norm", "dot"}}: the norm
    and the dot product with a fixed pattern of unit norm), relative to the reference side's norm; inf when
    a tensor is missing or a figure is not finite."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if g is None or not w["norm"] > 0:
            return float("inf")
        diffs = (abs(g["norm"] - w["norm"]), abs(g["dot"] - w["dot"]))
        if not all(math.isfinite(x) for x in diffs):
            return float("inf")
        d = max(diffs) / w["norm"]
        worst = max(worst, d)
    return worst if want else float("inf")


# ------------------------------------------------------------------------------------ rows

LABELS = {"llama": "llama", "gpt2": "GPT-2 small"}


def rows_speed(model: str, shape: dict, hpe: dict | None, tr: dict | None, smoke: bool) -> list[Row]:
    """tokens/s against PyTorch eager (judged), MFU, peak memory, and tokens/s against torch.compile."""
    n = n_params(shape)
    label = f"{LABELS.get(model, model)} {n / 1e9:.2f}B" if n >= 5e8 else f"{LABELS.get(model, model)} {n / 1e6:.0f}M"
    what = f"tokens/s {label} bf16 ({model_label(shape)})"
    tgt = f">= {SPEED_TARGET:.1f}x torch eager"
    mfu_tgt = f">= {MFU_TARGET[model]:.0%}" if model in MFU_TARGET else "-"
    mem_tgt = f"<= {MEMORY_TARGET:.1f}x torch"
    hpe, tr = hpe or None, tr or None
    if hpe is None or "tokens_per_s" not in hpe:
        st = "SKIP" if hpe and hpe.get("skipped") else "FAIL"
        why = err_text(hpe, "hpengine")
        return [Row(what, why, tgt, st, hpe or {}),
                Row(f"  MFU {label}", why, mfu_tgt, st if mfu_tgt != "-" else "INFO"),
                Row(f"  peak memory {label}", why, mem_tgt, st)]
    eager, comp = (tr or {}).get("eager"), (tr or {}).get("compile")
    if comp is None and tr and (tr.get("error") or tr.get("skipped")):
        comp = {k: tr[k] for k in ("error", "skipped") if tr.get(k)}       # the part stopped before it
    h_tps, rows = hpe["tokens_per_s"], []
    same = hpe.get("n_params") == n and (eager is None or eager.get("n_params") in (None, n))
    if eager is None or "tokens_per_s" not in eager:
        src = eager if eager is not None else tr
        skipped = bool(src and src.get("skipped"))
        rows.append(Row(what, f"hpengine {h_tps:,.0f}; {err_text(src, 'torch eager')}", tgt,
                        "SKIP" if skipped else "FAIL",
                        {"hpengine": hpe, "torch": tr}))
    else:
        ratio = h_tps / eager["tokens_per_s"]
        value = (f"hpengine {h_tps:,.0f} / torch eager {eager['tokens_per_s']:,.0f} = {ratio:.2f}x"
                 + ("" if same else f" (params differ: hpengine {hpe.get('n_params')}, torch "
                                    f"{eager.get('n_params')}, formula {n})"))
        rows.append(Row(what, value, tgt, "FAIL" if not same else judged(ratio >= SPEED_TARGET, smoke),
                        {"ratio": ratio, "hpengine": hpe, "torch": tr}))
    # MFU: against the dense bf16 peak of the device hpengine ran on
    dev = hpe.get("device")
    m = mfu(shape, h_tps, dev)
    if m is None:
        rows.append(Row(f"  MFU {label}", f"no bf16 peak known for device {dev!r}", mfu_tgt,
                        "smoke" if smoke else "INFO"))
    else:
        parts = [f"hpengine {m:.1%}"] + [f"torch {k} {mfu(shape, r['tokens_per_s'], dev):.1%}"
                                          for k, r in (("eager", eager), ("compiled", comp))
                                          if r and "tokens_per_s" in r]
        value = (" / ".join(parts) + f" of {peak_bf16_flops(dev) / 1e12:.0f} TFLOP/s ({dev}; "
                 f"{flops_per_token(shape) / 1e9:.2f} GFLOP/token)")
        st = judged(m >= MFU_TARGET[model], smoke) if model in MFU_TARGET else "INFO"
        rows.append(Row(f"  MFU {label}", value, mfu_tgt, st, {"mfu": m}))
    # peak memory: the allocators' high-water marks (CuPy's pool against torch's reserved bytes)
    pool = hpe.get("pool_peak_bytes")
    t_res = (eager or {}).get("max_reserved_bytes")
    if pool is None or t_res is None:
        why = "no device memory figures (CPU run)" if pool is None else err_text(eager, "torch eager")
        rows.append(Row(f"  peak memory {label}", why, mem_tgt, "smoke" if smoke else ("FAIL" if pool else "INFO")))
    else:
        r = pool / t_res if t_res else float("inf")
        value = (f"hpengine {gib(pool)} (CuPy pool) / torch {gib(t_res)} (reserved; allocated "
                 f"{gib(eager.get('max_allocated_bytes', 0))}) = {r:.2f}x")
        rows.append(Row(f"  peak memory {label}", value, mem_tgt, judged(r <= MEMORY_TARGET, smoke), {"ratio": r}))
    # torch.compile: information
    cw = f"  vs torch.compile {label} (info)"
    if comp is None:
        rows.append(Row(cw, "not run", "-", "SKIP"))
    elif "tokens_per_s" not in comp:
        rows.append(Row(cw, f"hpengine {h_tps:,.0f}; {err_text(comp, 'torch.compile')}", "-",
                        "SKIP" if comp.get("skipped") else "INFO", comp))
    else:
        rc = h_tps / comp["tokens_per_s"]
        rows.append(Row(cw, f"hpengine {h_tps:,.0f} / torch compiled {comp['tokens_per_s']:,.0f} = {rc:.2f}x; "
                            f"compile and first step {comp.get('first_step_s', 0):.0f} s", "-", "INFO", {"ratio": rc}))
    return rows


ATTN_VARIANTS = (("bf16", "bf16 amp"), ("bits", "bf16 bits"), ("float32", "float32"))


def rows_attention(shape, hpe: dict | None, tr: dict | None, smoke: bool) -> list[Row]:
    """hpengine's flash attention (forward + backward) under bf16 amp, on 2-byte bf16 storage and in float32,
    against torch's sdpa flash kernel on the same bf16-rounded inputs: time (information) and agreement of
    the outputs and gradients (judged)."""
    B, H, T, hd = shape
    base = f"attention fwd+bwd B{B} H{H} T{T} hd{hd} causal"
    tgt = f"agree <= {ATTN_RTOL:.0e}"
    if tr is None or "fwd_bwd_ms" not in tr:
        torch_txt = err_text(tr, "torch sdpa")
        tr = None
    else:
        torch_txt = " ".join(str(x) for x in ("torch sdpa", tr.get("backend"), tr.get("dtype"),
                                              f"{tr['fwd_bwd_ms']:.2f} ms") if x)
    if hpe is None or "variants" not in hpe:
        return [Row(f"{base}: hpengine", f"{err_text(hpe, 'hpengine')}; {torch_txt}", tgt,
                    "SKIP" if hpe and hpe.get("skipped") else "FAIL", hpe or {})]
    rows = []
    for key, label in ATTN_VARIANTS:
        v = hpe["variants"].get(key)
        what = f"{base}: hpengine {label}"
        if v is None:
            stopped = bool(hpe.get("error"))          # the part ended (timed out) before this variant
            rows.append(Row(what, err_text(hpe if stopped else None, "variant"), tgt, "FAIL" if stopped else "SKIP"))
        elif v.get("not_available"):
            rows.append(Row(what, f"not available: {v['not_available']}", tgt, "SKIP", v))
        elif v.get("error"):
            rows.append(Row(what, v["error"], tgt, "FAIL", v))
        else:
            kern = f"; kernels {', '.join(v['kernels'])}" if v.get("kernels") else ""
            if tr is None:
                rows.append(Row(what, f"{v['fwd_bwd_ms']:.2f} ms (fwd {v['fwd_ms']:.2f}); {torch_txt}{kern}", tgt,
                                "SKIP" if smoke else "FAIL", v))
                continue
            diff = agreement(v["checks"], tr["checks"])
            speed = tr["fwd_bwd_ms"] / v["fwd_bwd_ms"] if v["fwd_bwd_ms"] > 0 else float("inf")
            value = (f"{v['fwd_bwd_ms']:.2f} ms (fwd {v['fwd_ms']:.2f}) = {speed:.2f}x the speed of {torch_txt} "
                     f"(fwd {tr['fwd_ms']:.2f}); agree {diff:.0e}{kern}")
            rows.append(Row(what, value, tgt, judged(diff <= ATTN_RTOL, smoke, judge_in_smoke=True),
                            {"speed": speed, "agreement": diff, "hpengine": v, "torch": tr}))
    return rows
