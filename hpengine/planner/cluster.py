"""The machine the planner plans for: `Cluster` (devices, memory and what is kept free of it, FLOP/s, links,
sites of nodes behind a slow link, the CPU figures --calibrate measures and the GPU figures of planner/gpu.py)
and `load_cluster`, which reads a [cluster] table and flags and checks every value, one line per mistake."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass

from hpengine.config.load import ConfigError


class PlanError(ConfigError):
    """A planning request that cannot be answered (unknown preset, bad cluster, nothing fits)."""


@dataclass
class Cluster:
    """The machine: devices, their memory and sustained FLOP/s, and the links between them."""
    nodes: int = 1
    gpus_per_node: int = 8
    mem_gb: float = 80.0            # memory per device
    intra_bw_gbs: float = 150.0     # per-device bandwidth inside a node (NVLink)
    inter_bw_gbs: float = 25.0      # per-device bandwidth between nodes (InfiniBand)
    intra_latency_us: float = 5.0   # per round of a small collective (--calibrate: as the engine calls one)
    inter_latency_us: float = 10.0
    tflops: float = 150.0           # sustained 16-bit FLOP/s (amp)
    tflops_fp32: float = 15.0
    tflops_fp64: float = 7.5
    # measured on CPUs by --calibrate; the defaults leave them out (a GPU's step is its FLOPs and links)
    cores_per_node: float = 0       # CPU cores the node's ranks share in effect (0: one per device, none shared)
    block_us: float = 0.0           # overhead of a block's forward or backward pass (Python, NumPy calls)
    act_ns: float = 0.0             # per 4 bytes of activations a forward caches: elementwise work, fwd + bwd
    optimizer_ns: float = 0.0       # per owned float32 element: AdamW, its norm and zeroing
    step_overhead_us: float = 0.0   # fixed per-step cost (Python, data); --calibrate leaves it out
    overlap: float = 1.0            # share of the last backward that hides gradient sync (0: no progress beside it)
    reduce_bw_gbs: float = 0.0      # a block's gradient reduced to its owner, inside a node (0: the link's)
    allgather_bw_gbs: float = 0.0   # a block gathered from its owner (stage 3), inside a node (0: the link's)
    # GPUs (planner/gpu.py; all 0: one sustained rate for every GEMM). Set, tflops* are datasheet peaks and a
    # GEMM of harmonic mean dimension d sustains gemm_eff_max * d / (d + gemm_half_dim) of them
    gemm_half_dim: float = 0.0      # GEMM dimension at which half of gemm_eff_max is reached
    gemm_eff_max: float = 1.0       # share of the peak the largest GEMMs sustain
    mem_bw_gbs: float = 0.0         # device memory bandwidth, element-wise passes and memory-bound GEMMs
    launch_us: float = 0.0          # per GEMM call (kernel launch and tail)
    # GB kept free per device: CUDA context + cuBLAS workspace (~0.5-1 GB), MPI/NCCL buffers (~0.5 GB),
    # allocator fragmentation (a few % of what is used); None: 4 GB, or 5 % of a memory under 80 GB
    reserve_gb: float | None = None
    # MoE under expert parallelism: the most-loaded expert's tokens over the mean (a run's moe_load_max); its
    # rank's expert GEMMs and received rows take this factor, and every rank waits for it (1: balanced)
    moe_imbalance: float = 1.0
    # sites: groups of site_nodes consecutive nodes behind a slow link (0: one site). The link's figures are per
    # device, like inter_bw_gbs: a collective whose ranks span sites runs at them
    site_nodes: int = 0             # nodes per site (0: every node on one fabric)
    site_bw_gbs: float = 0.0        # per-device bandwidth between sites
    site_latency_ms: float = 0.0    # per round of a small collective between sites

    @property
    def reserve(self) -> float:
        return self.reserve_gb if self.reserve_gb is not None else min(4.0, 0.05 * self.mem_gb)

    @property
    def usable_gb(self) -> float:
        return self.mem_gb - self.reserve

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sites(self) -> int:
        """Sites behind the slow link (1 without one)."""
        return self.nodes // self.site_nodes if self.site_nodes else 1

    def spans_sites(self, span: int) -> bool:
        """Whether a group of ranks spread over `span` consecutive ranks (from a multiple of span) crosses the
        slow link between sites: it does unless it fits whole into one site's ranks."""
        site = self.site_nodes * self.gpus_per_node
        return self.sites > 1 and not (span <= site and site % span == 0)

    def site_link(self) -> tuple[float, float, str]:
        """(bytes per second, latency in seconds, its name) of the link between sites."""
        return (self.site_bw_gbs * 1e9, self.site_latency_ms * 1e-3,
                f"the link between sites ({self.site_bw_gbs:g} GB/s, {self.site_latency_ms:g} ms)")


MAY_BE_ZERO = ("cores_per_node", "block_us", "act_ns", "optimizer_ns", "step_overhead_us", "overlap", "reduce_bw_gbs",
               "allgather_bw_gbs", "gemm_half_dim", "mem_bw_gbs", "launch_us", "reserve_gb", "site_nodes", "site_bw_gbs",
               "site_latency_ms")


def load_cluster(path=None, **flags) -> Cluster:
    """A Cluster from the [cluster] table of a TOML file, then flags (None = not given); checked."""
    raw = {}
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as e:
            raise PlanError(f"--cluster {path}: cannot read it ({e.strerror or e}); give a TOML file with a "
                            "[cluster] table, e.g. clusters/a100_80gb_dgx.toml") from None
        except tomllib.TOMLDecodeError as e:
            raise PlanError(f"--cluster {path}: invalid TOML: {e}") from None
        if not isinstance(doc.get("cluster"), dict):
            raise PlanError(f"--cluster {path}: no [cluster] table")
        raw = doc["cluster"]
    raw.update({k: v for k, v in flags.items() if v is not None})
    names = {f.name: f.type for f in dataclasses.fields(Cluster)}
    for k, v in raw.items():
        if k not in names:
            raise PlanError(f"cluster.{k}: unknown key; valid keys: {', '.join(names)}")
        ok = isinstance(v, int) if names[k] == "int" else isinstance(v, (int, float))
        what = "integer" if names[k] == "int" else "number"
        least = "non-negative" if k in MAY_BE_ZERO else "positive"
        if not ok or isinstance(v, bool) or not (v >= 0 if k in MAY_BE_ZERO else v > 0) or not math.isfinite(v):
            raise PlanError(f"cluster.{k} = {v!r}: must be a {least} {what}")
    c = Cluster(**raw)
    if c.moe_imbalance < 1:
        raise PlanError(f"cluster.moe_imbalance = {c.moe_imbalance:g}: the most-loaded expert's tokens over the "
                        "mean is at least 1 (1 = balanced routing)")
    if c.gemm_eff_max > 1:
        raise PlanError(f"cluster.gemm_eff_max = {c.gemm_eff_max}: a share of the peak, at most 1")
    if c.reserve >= c.mem_gb:
        raise PlanError(f"cluster.reserve_gb = {c.reserve:g}: the GB kept free of each device must be below "
                        f"mem_gb = {c.mem_gb:g} (0 keeps none)")
    if c.inter_bw_gbs > c.intra_bw_gbs:
        raise PlanError(f"cluster: inter_bw_gbs = {c.inter_bw_gbs} exceeds intra_bw_gbs = {c.intra_bw_gbs}; links "
                        "between nodes are not faster than inside one, check the figures")
    if c.inter_latency_us < c.intra_latency_us:
        raise PlanError(f"cluster: inter_latency_us = {c.inter_latency_us} is below intra_latency_us = "
                        f"{c.intra_latency_us}; check the figures")
    _check_sites(c)
    return c


def _check_sites(c: Cluster) -> None:
    """Sites: whole groups of nodes, with a link between them no faster than the one between nodes."""
    if not c.site_nodes:
        for k in ("site_bw_gbs", "site_latency_ms"):
            if getattr(c, k):
                raise PlanError(f"cluster.{k} = {getattr(c, k):g}: applies only with site_nodes > 0 (the nodes per "
                                "site behind the slow link)")
        return
    if c.nodes % c.site_nodes:
        raise PlanError(f"cluster.site_nodes = {c.site_nodes}: must divide nodes = {c.nodes} (sites of equal size; "
                        "0 = one site, no slow link)")
    if not c.site_bw_gbs:
        raise PlanError(f"cluster.site_nodes = {c.site_nodes}: needs site_bw_gbs > 0, the per-device bandwidth of the "
                        "link between sites in GB/s (1 Gbit/s = 0.125)")
    if c.site_bw_gbs > c.inter_bw_gbs:
        raise PlanError(f"cluster: site_bw_gbs = {c.site_bw_gbs:g} exceeds inter_bw_gbs = {c.inter_bw_gbs:g}; the link "
                        "between sites is not faster than the one between nodes, check the figures")
    if c.site_latency_ms * 1e3 < c.inter_latency_us:
        raise PlanError(f"cluster: site_latency_ms = {c.site_latency_ms:g} is below inter_latency_us = "
                        f"{c.inter_latency_us:g} (in microseconds); check the figures")
