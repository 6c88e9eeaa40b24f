"""The parts a resolved layout is made of, each one small validated value: the parallel degrees with the mesh order
and the axes folded inside others (`Degrees`), the pipeline's plan, the amp policy and the batch split. The
layout (resolve.Resolved) holds one of each; the mesh, the pipeline executor and the precision read theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpengine.config.load import MESH_AXES, mesh_order


class TopologyError(ValueError):
    """Degrees or a mesh order no set of ranks can have (one line naming the values)."""


@dataclass(frozen=True, slots=True)
class Degrees:
    """Ranks along each mesh axis (tp, cp, sharding, dp, pp: every rank has one coordinate on each), the mesh
    order (innermost first) and expert parallelism's degree, folded inside dp x sharding (no ranks of its own)."""
    tp: int = 1
    cp: int = 1
    sh: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    order: tuple = MESH_AXES

    def __post_init__(self):
        object.__setattr__(self, "order", mesh_order(self.order))
        if sorted(self.order) != sorted(MESH_AXES):
            raise TopologyError(f"mesh.order = {list(self.order)}: must be a permutation of {list(MESH_AXES)}")
        for name in ("tp", "cp", "sh", "dp", "pp", "ep"):
            d = getattr(self, name)
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise TopologyError(f"degree {name} = {d!r}: must be a whole number >= 1")

    @property
    def by_axis(self) -> dict:
        """{axis: degree} for every mesh axis (the names of config and topology: "sharding" for sh)."""
        return {"tp": self.tp, "cp": self.cp, "sharding": self.sh, "dp": self.dp, "pp": self.pp}

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.sh * self.dp * self.pp

    @property
    def folds(self) -> dict:
        """{folded axis: (degree, the axes it splits, the axes its replicas also span)}: ep inside dp when it
        divides dp, else inside dp x sharding; its replicas across cp under context parallelism (topology.Mesh.fold)."""
        if self.ep == 1:
            return {}
        return {"ep": (self.ep, ("dp", "sharding") if self.experts_whole else ("dp",), ("cp",) if self.cp > 1 else ())}

    @property
    def experts_whole(self) -> bool:
        """Whether expert parallel spans sharding ranks (ep does not divide dp): a sharding group then holds
        several expert blocks, so each rank keeps its own block whole (not sharded), summed over its replicas."""
        return self.ep > 1 and self.dp % self.ep != 0

    @property
    def grad_axes(self) -> tuple:
        """The axes over which every gradient (and loss) is summed beyond the sharding owners, in mesh order:
        dp, and cp under context parallelism (each cp rank saw its part of every sequence)."""
        if self.cp == 1:
            return ("dp",)
        return tuple(a for a in self.order if a == "cp" or (a == "dp" and self.dp > 1))

    @property
    def replicas(self) -> int:
        """Ranks that each take a different slice of the global batch (dp x sharding)."""
        return self.dp * self.sh

    def replica(self, coords: dict) -> int:
        """Which slice of the global batch the rank at `coords` takes."""
        return coords["dp"] * self.sh + coords["sharding"]


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Micro-batches per pass (m), model chunks per pipeline rank (v), the schedule's name (layout/schedules.py),
    how layers are cut into chunks, and whether sends between stages are split across tp (scatter)."""
    m: int = 1
    v: int = 1
    schedule: str = "fthenb"
    split: object = "uniform"
    scatter: bool = False


@dataclass(frozen=True, slots=True)
class AmpPolicy:
    """Mixed precision as resolved: the amp dtype ("" off, "float16", "bfloat16"; True means float16), how bf16
    activation caches are stored ("packed" 2 bytes, "float32", or "auto" until the backend is known; "" without
    bf16) and whether gradients are held in bfloat16 (amp.grad_dtype)."""
    amp: bool | str = ""
    bf16_storage: str = ""
    bf16_grads: bool = False

    def packs_activations(self, gpu: bool) -> bool:
        """Whether activation caches are kept as bfloat16 bits (2 bytes), on a GPU backend (gpu) or not."""
        return self.bf16_storage == "packed" or (self.bf16_storage == "auto" and gpu)


@dataclass(frozen=True, slots=True)
class BatchSplit:
    """Sequences each replica takes per step (share) and the gradient-merge passes they run as (k)."""
    share: int = 1
    k: int = 1
