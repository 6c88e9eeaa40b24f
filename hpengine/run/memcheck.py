"""Refuse a job whose predicted memory per rank (the planner's model, made once at start-up) exceeds the memory
this rank can have, before anything large is allocated. The ranks agree, so every rank stops with the same
line. `runtime.memory_check = false` skips it.
"""
from __future__ import annotations

import math

from hpengine.config.load import ConfigError
from hpengine.dist.agree import agree_or_raise
from hpengine.dist.topology import node_ranks
from hpengine.optim import optimizer_kind
from hpengine.planner.memory import buddy_bytes


class MemoryCheckError(ConfigError):
    """The job cannot fit in this rank's memory."""


def _gb(n: float) -> str:
    return f"{n / 1e12:.3g} TB" if n >= 1e12 else f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this node in bytes; None where the kernel does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_free(backend) -> int | None:
    try:
        return int(backend.xp.cuda.runtime.memGetInfo()[0])
    except Exception:  # noqa: BLE001 - no figure, no check
        return None


# The memory this rank can have: on CPU the node's MemAvailable (/proc/meminfo)
# divided by the ranks on the node, counting an asynchronous checkpoint's copy of the state; on a GPU the
# device's free memory divided by the ranks sharing it.
def limit_per_rank(backend, per_node: int, n_devices: int = 1) -> tuple[int, str] | None:
    """(bytes this rank may use, how that was found) or None when unknown."""
    if backend.is_gpu:
        free = device_free(backend)
        sharing = max(1, math.ceil(per_node / max(1, n_devices)))
        return None if free is None else (free // sharing, f"free device memory {_gb(free)} / {sharing} "
                                                            f"rank(s) on the device")
    avail = mem_available()
    return None if avail is None else (avail // per_node, f"MemAvailable {_gb(avail)} / {per_node} rank(s) "
                                                          "on this node")


def snapshot_bytes(cfg, res, mem: dict) -> int:
    """Host memory an asynchronous checkpoint keeps per rank (checkpoint/background.py): its share of the
    saved state (parameters at the optimizer's precision and its state, n values an element on the tensors that keep
    the fewest: at most (n + 1) / n x the state, or the state and float32 masters under amp), split over the ranks
    that hold the same values (dp x cp)."""
    c = cfg.checkpoint
    if not c.async_ or not (c.every or c.every_minutes or c.at_end):
        return 0
    kind = optimizer_kind(cfg.optim.name)
    n = kind.fewest or len(kind.state)
    state = mem.get("optimizer", 0) * (1.0 if cfg.strategy.amp.enable or not n else (n + 1) / n)
    return int(state / max(1, res.dp * res.cp))


def remedies(mem: dict) -> str:
    """The switches that shrink the largest parts of the prediction."""
    state = mem.get("params", 0) + mem.get("grads", 0) + mem.get("optimizer", 0)
    out = []
    if mem.get("checkpoint snapshot", 0) > 0.1 * mem["total"]:
        out.append("checkpoint.async=false (saves then wait for the disk but keep no copy of the state)")
    if state >= mem.get("activations", 0):
        out.append("shard the model state (strategy.sharding.enable=true, stage=3), split it with "
                   "strategy.tensor_parallel or strategy.pipeline, or use more ranks/nodes or a smaller [model]")
    if mem.get("activations", 0) > 0.1 * mem["total"]:
        out.append("cut activations with strategy.recompute, strategy.gradient_merge (k_steps), more "
                   "strategy.pipeline.micro_batches, strategy.tensor_parallel.sequence_parallel (with tp), "
                   "model.attention = 'flash' or a smaller train.global_batch / model.seq_len")
    return "; ".join(out)


def check_fits(cfg, res, world, backend, mem: dict | None, limit=None, per_node: int | None = None) -> tuple[int, str] | None:
    """Raise MemoryCheckError on every rank when a rank's predicted memory `mem` (the start-up prediction's,
    planner/search.predict_at_start; None: no check) exceeds its limit (collective); returns this rank's limit
    (bytes, how it was found), None when unknown or the check is off. per_node: the ranks on this node
    (topology.node_ranks, asked here when not given)."""
    if not getattr(cfg.runtime, "memory_check", True):
        return None
    if per_node is None:
        _, per_node = node_ranks(world)
    lim = None
    host = mem is not None and not backend.is_gpu        # on a GPU these are host memory, not the device's
    for name, extra in (("checkpoint snapshot", snapshot_bytes(cfg, res, mem) if host else 0),
                        ("buddy copies", buddy_bytes(cfg.resilience, mem) if host else 0)):
        if extra:
            mem = {**{k: v for k, v in mem.items() if k != "total"}, name: extra, "total": mem["total"] + extra}

    def fits():          # the limit is found inside: reading it can fail on one rank only
        nonlocal lim
        lim = limit if limit is not None else limit_per_rank(backend, per_node, _devices(backend))
        if mem is None or lim is None or mem["total"] <= lim[0]:
            return
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in mem.items() if k != "total" and v)
        raise MemoryCheckError(
            f"the job needs about {_gb(mem['total'])} per rank ({parts}) but rank {world.Get_rank()} has "
            f"{_gb(lim[0])} ({lim[1]}); to fit: {remedies(mem)}; or --set runtime.memory_check=false to "
            "start anyway")
    agree_or_raise(world, fits, MemoryCheckError, (MemoryCheckError,))
    return lim


def _devices(backend) -> int:
    try:
        return int(backend.xp.cuda.runtime.getDeviceCount()) if backend.is_gpu else 1
    except Exception:  # noqa: BLE001
        return 1
