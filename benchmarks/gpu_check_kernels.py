"""gpu_check's documents and muon parts: flash attention with segment ids (packed documents of mean length 512 in
T 4096) against fully causal, on the float32 SIMT and the bf16 tensor-core kernels, with the first document's
rows, which both runs compute alike, as the agreement check; and Muon's Newton-Schulz iteration (5 steps,
float32) over every Muon matrix of the 1.07 B llama, one batched iteration per shape (what Muon runs on CuPy)
against one call per matrix. With --cpu-smoke: the NumPy twins at tiny sizes, the bf16 variant not available."""
from __future__ import annotations

import math
import sys

import gpu_check_options as opts
from gpu_check_attention import timings
from gpu_check_options import save_result
from gpu_check_report import Row, err_text, judged

DOC_RTOL = 1e-5          # the first document's rows, documents against causal (the same keys in the same tiles)
QUINTIC = (3.4445, -4.775, 2.0315)


def doc_shape(a) -> tuple:
    return opts.SMOKE_DOC_SHAPE if a.cpu_smoke else opts.DOC_SHAPE


def document_ids(np, B: int, T: int, mean: int):
    """(B, T) int64 document ids, nondecreasing along a row: lengths drawn from a geometric law of the given
    mean (seeded), the last document of a row cut at T."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(B):
        lengths = rng.geometric(1.0 / mean, size=T)
        rows.append(np.repeat(np.arange(T), lengths)[:T])
    return np.stack(rows)


def worker_documents(a) -> dict:
    from hpengine.device.precision import round_bf16_          # noqa: PLC0415
    from hpengine.doctor.bandwidth import device_setup         # noqa: PLC0415
    from hpengine.nn import flash, flash_cuda                  # noqa: PLC0415
    from hpengine.nn.numerics import OFF, Numerics             # noqa: PLC0415
    import numpy as np                                         # noqa: PLC0415
    B, H, T, hd, mean = doc_shape(a)
    xp, timer, device = device_setup(a.cpu_smoke, "cpu")
    host_ids = document_ids(np, B, T, mean)
    first = int((host_ids[0] == 0).sum())                  # the rows of row 0's first document
    seg = xp.asarray(host_ids)
    rng = np.random.default_rng(1)
    x = {n: round_bf16_(xp, xp.asarray(rng.standard_normal((B, H, T, hd)).astype(np.float32) * s))
         for n, s in (("q", 0.5 / math.sqrt(hd)), ("k", 1.0), ("v", 1.0))}
    dy = round_bf16_(xp, xp.asarray(rng.standard_normal((B, T, H * hd)).astype(np.float32)))
    res = {"shape": [B, H, T, hd], "mean_length": mean, "documents": int(host_ids.max(axis=1).sum() + B),
           "device": device, "variants": {}}
    for key, num in (("float32", OFF), ("bf16", Numerics(bf16=True))):
        if a.cpu_smoke and key == "bf16":
            res["variants"][key] = {"not_available": "needs CuPy (the tensor-core kernels)"}
            continue
        try:
            out = {}
            for mode, segments in (("causal", None), ("documents", seg)):
                state = {}

                def fwd(segments=segments, state=state):
                    state["y"], state["c"] = flash.flash_gqa_forward(xp, x["q"], x["k"], x["v"], num=num,
                                                                     segments=segments)

                def fwd_bwd(segments=segments, state=state):
                    fwd()
                    flash.flash_gqa_backward(xp, dy, state["c"], num, segments=segments)
                out[mode] = timings(timer, fwd, fwd_bwd, a.attn_reps)
                y = state["y"]
                out[mode]["first"] = (flash_cuda.from_bf16(xp, y) if y.dtype == np.uint16 else y)[0, :first]
            ref = out["causal"].pop("first").astype(xp.float64)
            got = out["documents"].pop("first").astype(xp.float64)
            out["agreement"] = float(xp.abs(got - ref).max()) / max(float(xp.abs(ref).max()), 1e-30)
            out["speedup"] = out["causal"]["fwd_bwd_ms"] / out["documents"]["fwd_bwd_ms"]
            res["variants"][key] = out
        except Exception as e:                       # noqa: BLE001 - reported in the table
            print(f"documents variant {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
            res["variants"][key] = {"error": f"{type(e).__name__}: {e}"}
        save_result(a.result, res)
    return res


def llama_matrices(shape: dict) -> list:
    """(count, in, out) of every Muon matrix of a llama of `shape` (q, k, v, o, gate, up, down per layer)."""
    d, L, H, KV, F = (shape[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"))
    hd = d // H
    per_layer = [(d, H * hd), (d, KV * hd), (d, KV * hd), (H * hd, d), (d, F), (d, F), (F, d)]
    return [(1, i, o) for _ in range(L) for i, o in per_layer]


def ns_flops(shapes, steps: int = 5) -> float:
    """FLOPs of the iteration: per step and matrix (m <= n after orientation) X X^T 2 m^2 n, A A 2 m^3, B X 2 m^2 n."""
    total = 0
    for c, i, o in shapes:
        m, n = min(i, o), max(i, o)
        total += c * (4 * m * m * n + 2 * m ** 3)
    return float(total * steps)


def worker_muon(a) -> dict:
    from hpengine.doctor.bandwidth import device_setup         # noqa: PLC0415
    from hpengine.optim.muon import newton_schulz              # noqa: PLC0415
    from hpengine.optim.same_shape import by_shape             # noqa: PLC0415
    import numpy as np                                         # noqa: PLC0415
    shape = (opts.SMOKE_MODELS if a.cpu_smoke else opts.MODELS)["llama"]
    xp, timer, device = device_setup(a.cpu_smoke, "cpu")
    shapes = llama_matrices(shape)
    rng = np.random.default_rng(2)
    stacks = [xp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]

    def ortho(u):                                             # Muon._orthogonalise: on torch's (out, in)
        return xp.swapaxes(newton_schulz(xp, xp.swapaxes(u, -1, -2), QUINTIC, 5), -1, -2)
    res = {"model": shape, "matrices": len(shapes), "parameters": sum(math.prod(s) for s in shapes),
           "flops": ns_flops(shapes), "device": device, "variants": {}}
    runs = {"grouped": lambda: by_shape(xp, stacks, ortho), "per_matrix": lambda: [ortho(s) for s in stacks]}
    outs = {}
    for key, fn in runs.items():
        try:
            outs[key] = fn()                                  # untimed: kernels, cuBLAS handles, the pool
            reps = 1 if a.cpu_smoke else 3
            ts = sorted(timer(fn, 1) for _ in range(reps))
            res["variants"][key] = {"ms": ts[len(ts) // 2] * 1e3, "reps": reps,
                                    "tflops": res["flops"] / ts[len(ts) // 2] / 1e12}
        except Exception as e:                                # noqa: BLE001 - reported in the table
            print(f"muon variant {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
            res["variants"][key] = {"error": f"{type(e).__name__}: {e}"}
        save_result(a.result, res)
    if len(outs) == 2:
        res["agreement"] = max(float(xp.abs(g - p).max()) / max(float(xp.abs(p).max()), 1e-30)
                               for g, p in zip(outs["grouped"], outs["per_matrix"]))
    return res


# ------------------------------------------------------------------------------------------ rows

def rows_documents(shape, res: dict | None, smoke: bool) -> list[Row]:
    """Per kernel family: fwd+bwd time with documents and fully causal (information), and the first document's
    rows of the two runs agreeing (judged)."""
    B, H, T, hd, mean = shape
    base = f"flash fwd+bwd on packed documents B{B} H{H} T{T} hd{hd} mean length {mean}"
    tgt = f"first document agrees <= {DOC_RTOL:.0e}"
    if res is None or "variants" not in res:
        return [Row(f"{base}: hpengine", err_text(res, "documents"), tgt,
                    "SKIP" if res and res.get("skipped") else "FAIL", res or {})]
    rows = []
    for key, label in (("bf16", "bf16 amp (tensor cores)"), ("float32", "float32")):
        v, what = res["variants"].get(key), f"{base}: {label}"
        if v is None:
            rows.append(Row(what, err_text(res if res.get("error") else None, "variant"), tgt,
                            "FAIL" if res.get("error") else "SKIP"))
        elif v.get("not_available"):
            rows.append(Row(what, f"not available: {v['not_available']}", tgt, "SKIP", v))
        elif v.get("error"):
            rows.append(Row(what, v["error"], tgt, "FAIL", v))
        else:
            d, c = v["documents"], v["causal"]
            value = (f"{d['fwd_bwd_ms']:.2f} ms (fwd {d['fwd_ms']:.2f}) against causal {c['fwd_bwd_ms']:.2f} ms "
                     f"(fwd {c['fwd_ms']:.2f}) = {v['speedup']:.2f}x; {res['documents']} documents; "
                     f"agree {v['agreement']:.0e}")
            rows.append(Row(what, value, tgt, judged(v["agreement"] <= DOC_RTOL, smoke, judge_in_smoke=True), v))
    return rows


def rows_muon(res: dict | None, smoke: bool) -> list[Row]:
    """Newton-Schulz over the llama's Muon matrices: grouped (batched per shape) and per matrix (information)."""
    if res is None or "variants" not in res:
        return [Row("Muon Newton-Schulz: hpengine", err_text(res, "muon"), "-",
                    "SKIP" if res and res.get("skipped") else "FAIL", res or {})]
    m = res["model"]
    base = (f"Muon Newton-Schulz 5 steps float32, {res['matrices']} matrices of llama d{m['d_model']} "
            f"L{m['n_layers']} ({res['parameters'] / 1e6:,.1f} M)")
    rows = []
    for key, label in (("grouped", "one batched call a shape"), ("per_matrix", "one call a matrix")):
        v = res["variants"].get(key)
        if v is None or v.get("error"):
            why = (v or {}).get("error") or err_text(res, "variant")
            rows.append(Row(f"{base}: {label}", why, "-", "FAIL", v or {}))
            continue
        agree = f"; agree {res['agreement']:.0e}" if key == "grouped" and "agreement" in res else ""
        rows.append(Row(f"{base}: {label}", f"{v['ms']:.1f} ms = {v['tflops']:.1f} TFLOP/s{agree}", "-",
                        "smoke" if smoke else "INFO", v))
    return rows
