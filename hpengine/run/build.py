"""Building a rank's engine from a config: logging, the agreed backend (its GPU chosen by node-local rank),
the dataset (the built-in corpus made once, by rank 0), the mesh and its communicators; and loading a
checkpoint into it on every rank together. The training loop (train.py) and the apps both start here.
"""
from __future__ import annotations

import logging
import socket
import sys

from mpi4py import MPI

from hpengine.checkpoint import shards as checkpoint
from hpengine.config.load import parse_link
from hpengine.data import DataError, TokenDataset, ensure_default_corpus
from hpengine.device.backend import BackendError, keep_heap, make_backend
from hpengine.device.threads import bound_cores
from hpengine.device.threads import pin as pin_blas_threads
from hpengine.device.threads import pool_size as blas_pool_size
from hpengine.dist.agree import agree_or_raise
from hpengine.dist.comm import Comm, resolve_cuda_aware
from hpengine.dist.nccl import choose as choose_nccl
from hpengine.dist.link import SlowLink
from hpengine.dist.topology import REPLICA, Mesh, node_gather
from hpengine.engine.engine import Engine
from hpengine.layout.resolve import resolve
from hpengine.planner import search as plan
from hpengine.run import launch, memcheck, startguard

log = logging.getLogger("hpengine")


def setup_logging(mesh) -> None:
    logger = logging.getLogger("hpengine")
    logger.handlers.clear()
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"{mesh.prefix()} %(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO if mesh.rank == 0 else logging.WARNING)
    logger.propagate = False


def resolve_data_path(cfg, world) -> str:
    """data.path; "" when data.sources blends files; else the built-in corpus (built once, by rank 0)."""
    if cfg.data.path or cfg.data.sources:
        return cfg.data.path
    # one rank builds the cached corpus; the rest wait and read it
    path = agree_or_raise(world, lambda: str(ensure_default_corpus()) if world.Get_rank() == 0 else None,
                          DataError, (DataError, OSError))
    return world.bcast(path, root=0)


def build_dataset(cfg, world):
    """The token dataset of data.path / data.sources / data.val_path; a file that one rank cannot read
    stops every rank with its message."""
    d, m = cfg.data, cfg.model
    path = resolve_data_path(cfg, world)
    return agree_or_raise(world, lambda: TokenDataset(path, m.seq_len, m.vocab_size, d.val_fraction,
                                                      val_path=d.val_path, sources=d.sources,
                                                      document_mask=d.document_mask),
                          DataError, (DataError,))


def data_meta(data) -> dict:
    """What a checkpoint records of the data it was trained on."""
    return {"tokenizer_sha256": data.tokenizer_sha256, "files": data.paths}


def check_same_tokenizer(recorded: dict | None, data) -> None:
    """Token ids mean nothing under another tokenizer: refuse data whose tokenizer differs from the one a
    checkpoint recorded. Checkpoints that record none (older ones, or trained on version-1 files) pass."""
    old = (recorded or {}).get("tokenizer_sha256")
    if old is None or old == data.tokenizer_sha256:
        return
    new = data.tokenizer_sha256 or "none (version-1 files)"
    raise checkpoint.CheckpointError(
        f"the checkpoint was trained on data with tokenizer sha256 {old} ({', '.join(recorded.get('files', []))}) "
        f"but the data now has tokenizer sha256 {new} ({', '.join(data.paths)}): resume on data built with the "
        "checkpoint's tokenizer, or start a new run")


def compute_dtype(cfg) -> str:
    """The dtype activations and the parameters' compute copy live in: float16 under float16 amp; bfloat16
    is emulated on float32 storage (precision.py)."""
    amp = cfg.strategy.amp
    if amp.enable:
        return "float16" if amp.dtype == "float16" else "float32"
    return cfg.model.dtype


def agreed_backend(cfg, world, local: int, per_node: int, cores: list):
    """This rank's backend (its GPU chosen by node-local rank `local` of `per_node` ranks on the node; its
    BLAS pool from `cores`, each node rank's bound cores); devices can differ between nodes, so the ranks
    agree before any of them raises."""
    pin_blas_threads(cfg.runtime.blas_threads, cores[local], cores[:local] + cores[local + 1:])  # before any BLAS

    def make():
        try:
            be = make_backend(cfg.runtime.backend, compute_dtype(cfg), local, per_node,
                              share_devices=cfg.runtime.share_devices)
            be.cuda_aware = resolve_cuda_aware(cfg.runtime.cuda_aware_mpi, be)
            return be
        except BackendError as exc:
            raise BackendError(f"rank {world.Get_rank()}: {exc}") from None
    be = agree_or_raise(world, make, BackendError, (BackendError,))
    kinds = set(world.allgather(be.name))
    if len(kinds) > 1:
        raise BackendError(f"runtime.backend = '{cfg.runtime.backend}' resolved differently across ranks "
                           f"({sorted(kinds)}); set runtime.backend explicitly")
    if be.set_matmul_precision(cfg.runtime.matmul_precision) != cfg.runtime.matmul_precision and world.Get_rank() == 0:
        log.info("runtime.matmul_precision = '%s' has no effect on NumPy (float32 GEMMs stay float32)",
                 cfg.runtime.matmul_precision)
    return be


def warn_split_groups(mesh, world) -> None:
    """Rank 0 warns when tensor- or context-parallel groups (collectives in every layer) span nodes that
    could each hold whole groups: the launcher interleaved the nodes' ranks (collective)."""
    hosts = world.allgather(socket.gethostname())
    if mesh.rank != 0:
        return
    for axis, split in mesh.needlessly_split(hosts).items():
        d = mesh.degrees[axis]
        shown = "; ".join(f"ranks {g} on {'+'.join(sorted({hosts[r] for r in g}))}" for g in split[:4])
        more = f"; {len(split) - 4} more" if len(split) > 4 else ""
        log.warning("%s groups span nodes (%s%s) though each node's ranks could hold whole groups of %d: "
                    "every layer's %s collectives cross the network. Give each node consecutive ranks "
                    "(mpiexec -hosts a:N,b:N or -ppn N, srun --distribution=block) or change mesh.order",
                    axis, shown, more, d, axis)


def communicators(cfg, backend, nccl):
    """How the mesh wraps each MPI communicator: a Comm, or on the axis runtime.link_axis names (DiLoCo's replica
    axis, or dp) under runtime.replica_link a SlowLink (the simulated link)."""
    link = parse_link(cfg.runtime.replica_link) if cfg.runtime.replica_link else None
    slowed = REPLICA if cfg.runtime.link_axis == "replica" else "dp"

    def wrap(c, axis):
        if axis == slowed and link is not None:
            return SlowLink(c, axis, backend, nccl, *link)
        return Comm(c, axis, backend, nccl)
    return wrap


def build(cfg, world=None, with_data: bool = True, nccl_device=None) -> Engine:
    """The engine of build_job (its start-up prediction dropped)."""
    return build_job(cfg, world, with_data, nccl_device)[0]


def build_job(cfg, world=None, with_data: bool = True, nccl_device=None) -> tuple[Engine, dict]:
    """Resolved layout, mesh, backend, dataset (unless with_data is False: the caller feeds the engine) and
    engine for this rank. Every check that needs no communicator (resolve) runs before the first
    collective; those that can differ by rank are agreed. nccl_device stands in for the backend's NCCL
    adapter under runtime.collectives = "nccl" (the CPU tests' NumPy stand-in, dist/nccl.py). Returns the engine
    and the job's start-up prediction (planner/search.predict_at_start: memory, step time with a cluster file)."""
    startguard.mpi_ready()          # a Ctrl-C during start-up: now MPI can abort every rank
    world = world or MPI.COMM_WORLD
    launch.check_world(world)
    res = resolve(cfg, world.Get_size())
    # asked once: the device, BLAS threads and memory check use these (with each node rank's bound cores)
    local, per_node, cores = node_gather(world, sorted(bound_cores()))
    backend = agreed_backend(cfg, world, local, per_node, cores)
    prediction = plan.predict_at_start(cfg, res.on_device(backend.is_gpu))     # the job's one prediction
    limit = memcheck.check_fits(cfg, res, world, backend, prediction["memory"], per_node=per_node)
    if not backend.is_gpu:
        keep_heap()
    node = {"local_rank": local, "node_ranks": per_node, "blas_threads": blas_pool_size(),
            "device": backend.device, "memory_limit": limit[1] if limit else None}
    nccl = choose_nccl(cfg.runtime.collectives, backend, world, nccl_device)     # None: MPI carries all
    deg = res.degrees
    mesh = Mesh(world, {**deg.by_axis, REPLICA: deg.islands}, deg.order, wrap=communicators(cfg, backend, nccl),
                node=node)
    if len(deg.grad_axes) > 1:  # context parallel with data parallel: gradients summed over dp x cp
        mesh.group(*deg.grad_axes)
    for axis, (d, inside, across) in deg.folds.items():    # the expert blocks, inside dp, and their replicas
        mesh.fold(axis, d, inside, across)
    setup_logging(mesh)
    warn_split_groups(mesh, world)
    return Engine(cfg, res, mesh, backend, build_dataset(cfg, world) if with_data else None), prediction


def load_together(eng, reader, params_only: bool = False) -> None:
    """Every rank loads its part; a rank that cannot makes every rank stop with its message."""
    agree_or_raise(eng.world, lambda: eng.load(reader, params_only), checkpoint.CheckpointError,
                   (OSError, checkpoint.CheckpointError, KeyError, ValueError))
