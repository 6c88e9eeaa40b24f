"""gpu_check's hpengine-side workers: the byte corpus every training part reads, tokens/s and peak device
memory of one process training a model shape (runtime.backend = cupy, or numpy with --cpu-smoke; bf16 amp
in the llama and gpt2 parts), and the 1-rank and 2-rank runs of the dp2 part under mpiexec: losses,
gradient norms and how the ranks reached MPI, then GPT-2 small by 2 ranks with runtime.collectives = "mpi"
(host-staged) and "nccl", where this tree has that setting.
hpengine is imported inside the workers, so the orchestrator can import this module without it.
"""
from __future__ import annotations

import gc
import logging
import statistics
import sys
import time
from dataclasses import fields

from gpu_check_options import model_shape, save_result
from gpu_check_report import tokens_per_s


def worker_corpus(a) -> dict:
    from hpengine.data import ensure_default_corpus       # noqa: PLC0415
    return {"path": str(ensure_default_corpus(max_bytes=(256 << 10) if a.cpu_smoke else (4 << 20)))}


def shape_overrides(shape: dict) -> list[str]:
    """--set lines of a model shape (gpu_check_options.MODELS)."""
    out = [f"model.kind='{shape.get('kind', 'gpt')}'", f"model.d_model={shape['d_model']}",
           f"model.n_layers={shape['n_layers']}", f"model.n_heads={shape['n_heads']}",
           f"model.seq_len={shape['seq_len']}", f"model.vocab_size={shape['vocab']}",
           f"train.global_batch={shape['batch']}"]
    if shape.get("kind") == "llama":
        out += [f"model.n_kv_heads={shape['n_kv_heads']}", f"model.ffn_hidden={shape['ffn_hidden']}"]
    return out


def build_engine(shape: dict, data: str, backend: str, extra: list[str] = ()):
    """One process's hpengine Engine for a model shape (float32 unless `extra` says otherwise, no
    evaluation, a long schedule)."""
    from hpengine.config.load import load_config              # noqa: PLC0415
    from hpengine.run.build import build                     # noqa: PLC0415
    return build(load_config(None, ["train.eval_every=0", f"runtime.backend='{backend}'",
                                    "runtime.cuda_aware_mpi=false", f"data.path='{data}'", f"train.steps={10**6}"]
                             + shape_overrides(shape) + list(extra)))


def device_of(be) -> tuple:
    """(synchronize, device name) of an engine's backend."""
    if not be.is_gpu:
        return (lambda: None), "cpu"
    cupy = be.xp
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return cupy.cuda.Device().synchronize, name.decode() if isinstance(name, bytes) else str(name)


class Memory:
    """Device memory high-water marks sampled between steps: CuPy's pool (bytes it holds from the device,
    which it keeps until freed, so the largest sample is its peak: the peer of torch's max_memory_reserved)
    and the device's used bytes (memGetInfo: every process, the CUDA context and libraries included)."""

    def __init__(self, be):
        self.cp = be.xp if be.is_gpu else None
        self.pool = self.used = 0

    def sample(self) -> None:
        if self.cp is not None:
            self.pool = max(self.pool, int(self.cp.get_default_memory_pool().total_bytes()))
            free, total = self.cp.cuda.runtime.memGetInfo()
            self.used = max(self.used, int(total - free))

    def figures(self) -> dict:
        return {"pool_peak_bytes": self.pool, "device_used_peak_bytes": self.used} if self.cp is not None else {}


def timed_steps(eng, a, sync, mem=None, first: int = 0) -> dict:
    """Warm-up (a.warmup_steps and a.warmup_s at least), then a.steps timed steps: step times, losses, and
    each timed step's exposed gradient-sync wait (the engine's 'grad sync wait' phase)."""
    step, t_end = first, time.perf_counter() + a.warmup_s
    losses = []
    while step - first < a.warmup_steps or time.perf_counter() < t_end:
        losses.append(float(eng.train_step(step)["loss"]))
        step += 1
        if mem is not None:
            mem.sample()
    warm, times, waits = step - first, [], []
    for _ in range(a.steps):
        sync()
        w0, t0 = eng.tracer.seconds["grad sync wait"], time.perf_counter()
        losses.append(float(eng.train_step(step)["loss"]))
        sync()
        times.append(time.perf_counter() - t0)
        waits.append(eng.tracer.seconds["grad sync wait"] - w0)
        step += 1
        if mem is not None:
            mem.sample()
    return {"warmup_steps": warm, "steps": a.steps, "median_step_ms": statistics.median(times) * 1e3,
            "min_step_ms": min(times) * 1e3, "grad_sync_wait_ms": statistics.median(waits) * 1e3, "losses": losses}


def worker_hpengine(a) -> dict:
    shape = model_shape(a, a.model)
    t0 = time.perf_counter()
    eng = build_engine(shape, a.data, "numpy" if a.cpu_smoke else "cupy",
                       ["strategy.amp.enable=true", "strategy.amp.dtype='bfloat16'",
                        f"model.attention='{a.hpe_attention}'"])
    build_s = time.perf_counter() - t0
    sync, device = device_of(eng.be)
    mem = Memory(eng.be)
    mem.sample()
    r = timed_steps(eng, a, sync, mem)
    return {"engine": "hpengine", "backend": eng.be.name, "device": device, "model": shape,
            "precision": f"amp bf16, model.attention {a.hpe_attention}", "build_s": build_s,
            "n_params": eng.n_params(), **{k: v for k, v in r.items() if k != "losses"},
            "tokens_per_s": tokens_per_s(shape["batch"], shape["seq_len"], r["median_step_ms"] / 1e3),
            "last_loss": r["losses"][-1], **mem.figures()}


DP2_VARIANTS = {
    "single": [],
    "dp": ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"],
    "sharding": ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=2"],
}
TRANSPORTS = ("mpi", "nccl")     # runtime.collectives of the dp2 part's timed 2-rank runs, in this order


def has_collectives_setting() -> bool:
    """Whether this tree's config has runtime.collectives (the NCCL transport)."""
    from hpengine.config.tree import RuntimeConfig          # noqa: PLC0415
    return "collectives" in {f.name for f in fields(RuntimeConfig)}


class Warnings(logging.Handler):
    """Collects the hpengine logger's warnings (e.g. NCCL not usable, MPI used instead) for the table."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage()[:300])


def _free(be) -> None:
    """Give a dropped engine's device memory back before the next variant builds its own."""
    gc.collect()
    if be.is_gpu:
        be.xp.get_default_memory_pool().free_all_blocks()


def worker_losses(a) -> dict | None:
    """Under mpiexec: train each variant; rank 0 returns (and saves after each variant) what it saw.
    "single", "dp", "sharding": the small ref model for --dp2-steps steps, float32, host-staged MPI: losses,
    gradient norms and how the ranks reached MPI (CUDA-aware or not, pinned staging bytes, device ids).
    "mpi", "nccl": GPT-2 small by 2 data-parallel ranks with runtime.collectives set so (plain MPI where the
    setting does not exist; nccl then "not available"): tokens/s, the exposed gradient-sync wait per step,
    losses, warnings logged. A configuration refused the same way on every rank is reported, not raised."""
    from mpi4py import MPI                               # noqa: PLC0415
    from hpengine.config.load import load_config              # noqa: PLC0415
    from hpengine.config.tree import ConfigError              # noqa: PLC0415
    from hpengine.run.build import build                     # noqa: PLC0415
    world = MPI.COMM_WORLD
    backend = "numpy" if a.cpu_smoke else "cupy"
    common = [f"runtime.backend='{backend}'", "runtime.cuda_aware_mpi=false", "runtime.share_devices=true",
              "train.eval_every=0", f"data.path='{a.data}'", "optim.warmup_steps=0", "optim.lr=1e-2"]
    out = {"world": world.Get_size(), "variants": {}}
    have_setting = has_collectives_setting()
    log = logging.getLogger("hpengine")
    for v in a.variants.split(","):
        caught = Warnings()
        log.addHandler(caught)
        try:
            if v in TRANSPORTS:
                if not have_setting and v != "mpi":
                    out["variants"][v] = {"not_available": "runtime.collectives is not a setting of this tree"}
                    continue
                shape = model_shape(a, "comm")
                over = common + shape_overrides(shape) + DP2_VARIANTS["dp"] + [f"train.steps={10**6}", "optim.lr=1e-4"]
                over += [f"runtime.collectives='{v}'"] if have_setting else []
            else:
                shape = model_shape(a, "ref")
                over = common + shape_overrides(shape) + DP2_VARIANTS[v] + [f"train.steps={a.dp2_steps}"]
            try:
                eng = build(load_config(None, over))
            except ConfigError as e:                     # the same refusal on every rank: a row, not a crash
                out["variants"][v] = {"not_available": f"config: {e}"}
                continue
            got = {"backend": eng.be.name, "degrees": dict(eng.mesh.degrees)}
            if v in TRANSPORTS:
                sync, _ = device_of(eng.be)
                r = timed_steps(eng, a, sync)
                got.update(r, model=shape, collectives=v if have_setting else "mpi (no runtime.collectives)",
                           n_params=eng.n_params(), grad_bytes=int(eng.memory()["grad_bytes"]),
                           tokens_per_s=tokens_per_s(shape["batch"], shape["seq_len"], r["median_step_ms"] / 1e3),
                           comm_stats={c: {op: list(st) for op, st in getattr(comm, "stats", {}).items()}
                                       for c, comm in getattr(eng.mesh, "comms", {}).items()
                                       if getattr(comm, "size", 1) > 1})
            else:
                losses, norms = [], []
                for step in range(a.dp2_steps):
                    m = eng.train_step(step)
                    losses.append(float(m["loss"]))
                    norms.append(float(m["grad_norm"]))
                got.update(losses=losses, grad_norms=norms)
            # how the ranks reached MPI, once they have trained (the pinned staging grows with the first transfers)
            info = world.gather((bool(eng.be.cuda_aware), int(eng.be.staging.nbytes if eng.be.staging is not None
                                                               else 0), eng.be.device), root=0)
            got.update(cuda_aware=[i[0] for i in info or []], staged_bytes=[i[1] for i in info or []],
                       devices=[i[2] for i in info or []])
            warned = world.gather(caught.lines, root=0)
            if warned and any(warned):
                got["warnings"] = sorted({w for ws in warned for w in ws})
            out["variants"][v] = got
            be = eng.be
            del eng
            _free(be)
        except Exception as e:                           # noqa: BLE001 - reported in the table
            out["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
            print(f"rank {world.Get_rank()}: variant {v} failed:", file=sys.stderr)
            import traceback                             # noqa: PLC0415
            traceback.print_exc()
            if world.Get_rank() == 0:
                save_result(a.result, out)
            world.Abort(1)
        finally:
            log.removeHandler(caught)
            if world.Get_rank() == 0:
                save_result(a.result, out)
    return out if world.Get_rank() == 0 else None
