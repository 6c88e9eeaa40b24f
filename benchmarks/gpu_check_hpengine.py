"""gpu_check's hpengine-side workers: the byte corpus every training part reads, tokens/s of one process
training a model shape (runtime.backend = cupy, or numpy with --cpu-smoke), and the 1-rank and 2-rank
runs of the dp2 part under mpiexec, which report losses, gradient norms and how the ranks reached MPI.
hpengine is imported inside the workers, so the orchestrator can import this module without it.
"""
from __future__ import annotations

import statistics
import sys
import time

from gpu_check_options import model_shape
from gpu_check_report import tokens_per_s


def worker_corpus(a) -> dict:
    from hpengine.data import ensure_default_corpus       # noqa: PLC0415
    return {"path": str(ensure_default_corpus(max_bytes=(256 << 10) if a.cpu_smoke else (4 << 20)))}


def build_engine(shape: dict, data: str, backend: str):
    """One process's hpengine Engine for a model shape (float32, no evaluation, a long schedule)."""
    from hpengine.config.load import load_config              # noqa: PLC0415
    from hpengine.run.build import build                     # noqa: PLC0415
    return build(load_config(None, [
        "train.eval_every=0", f"runtime.backend='{backend}'",
        "runtime.cuda_aware_mpi=false", f"data.path='{data}'", f"model.d_model={shape['d_model']}",
        f"model.n_layers={shape['n_layers']}", f"model.n_heads={shape['n_heads']}",
        f"model.seq_len={shape['seq_len']}", f"model.vocab_size={shape['vocab']}",
        f"train.global_batch={shape['batch']}", f"train.steps={10**6}"]))


def worker_hpengine(a) -> dict:
    shape = model_shape(a, a.model)
    eng = build_engine(shape, a.data, "numpy" if a.cpu_smoke else "cupy")
    if eng.be.is_gpu:
        cupy = eng.be.xp
        sync = cupy.cuda.Device().synchronize
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        device = device.decode() if isinstance(device, bytes) else str(device)
    else:
        sync, device = (lambda: None), "cpu"
    step, t_end = 0, time.perf_counter() + a.warmup_s
    while step < a.warmup_steps or time.perf_counter() < t_end:
        eng.train_step(step)
        step += 1
    warm, times, losses = step, [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        m = eng.train_step(step)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
        step += 1
    med = statistics.median(times)
    res = {"engine": "hpengine", "backend": eng.be.name, "device": device, "model": shape,
           "n_params": eng.n_params(), "warmup_steps": warm, "steps": a.steps, "median_step_ms": med * 1e3,
           "min_step_ms": min(times) * 1e3, "tokens_per_s": tokens_per_s(shape["batch"], shape["seq_len"], med),
           "last_loss": losses[-1]}
    if eng.be.is_gpu:
        res["device_pool_bytes"] = int(eng.be.xp.get_default_memory_pool().total_bytes())
    return res


DP2_VARIANTS = {
    "single": [],
    "dp": ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"],
    "sharding": ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=2"],
}


def worker_losses(a) -> dict | None:
    """Under mpiexec: train each variant for --dp2-steps steps; rank 0 returns losses, gradient norms and
    how the ranks reached MPI (CUDA-aware or not, bytes of pinned staging buffers, device ids)."""
    from mpi4py import MPI                               # noqa: PLC0415
    from hpengine.config.load import load_config              # noqa: PLC0415
    from hpengine.run.build import build                     # noqa: PLC0415
    world = MPI.COMM_WORLD
    shape = model_shape(a, "ref")
    common = [f"runtime.backend='{'numpy' if a.cpu_smoke else 'cupy'}'", "runtime.cuda_aware_mpi=false",
              "runtime.share_devices=true", "train.eval_every=0", f"data.path='{a.data}'",
              f"model.d_model={shape['d_model']}", f"model.n_layers={shape['n_layers']}",
              f"model.n_heads={shape['n_heads']}", f"model.seq_len={shape['seq_len']}",
              f"train.global_batch={shape['batch']}", f"train.steps={a.dp2_steps}",
              "optim.warmup_steps=0", "optim.lr=1e-2"]
    out = {"world": world.Get_size(), "variants": {}}
    for v in a.variants.split(","):
        try:
            eng = build(load_config(None, common + DP2_VARIANTS[v]))
            losses, norms = [], []
            for step in range(a.dp2_steps):
                m = eng.train_step(step)
                losses.append(float(m["loss"]))
                norms.append(float(m["grad_norm"]))
            staged = eng.be.staging.nbytes if eng.be.staging is not None else 0
            info = world.gather((bool(eng.be.cuda_aware), int(staged), eng.be.device), root=0)
            out["variants"][v] = {"losses": losses, "grad_norms": norms, "backend": eng.be.name,
                                  "cuda_aware": [i[0] for i in info or []], "staged_bytes": [i[1] for i in info or []],
                                  "devices": [i[2] for i in info or []], "degrees": dict(eng.mesh.degrees)}
        except Exception as e:                           # noqa: BLE001 - reported in the table
            out["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
            print(f"rank {world.Get_rank()}: variant {v} failed:", file=sys.stderr)
            import traceback                             # noqa: PLC0415
            traceback.print_exc()
            world.Abort(1)
    return out if world.Get_rank() == 0 else None

