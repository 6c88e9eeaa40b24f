"""Expert blocks kept whole under sharding when expert parallel spans the sharding ranks (ep does not divide dp):
the ranks of a sharding group then hold different experts, so each keeps its own expert block whole (owned by
every rank that holds it, its gradient summed over ep-dp) and owns its partition share of everything else.
"""
from __future__ import annotations

from hpengine.params.buffers import Range, cut, packed, subtract


class ExpertsWhole:
    """Where a rank's owned parts lie: its sharding share less the expert ranges, and every expert range."""

    def __init__(self, experts, own: Range, block_ranges):
        self.experts = sorted(experts, key=lambda r: r.start)
        self.dense = subtract(own, self.experts)
        self.parts = packed(self.dense + self.experts)
        placed = [(x, self.offset(x)) for x in self.experts]
        self.blocks = {b: cut(placed, br) for b, br in block_ranges.items()}

    def offset(self, r: Range) -> int:
        """Where flat Range r (inside one owned part) sits in the packed owned arrays."""
        hit = cut(self.parts, r)
        if len(hit) != 1 or hit[0][0] != r:
            raise ValueError(f"range {r} is not inside one owned part")
        return hit[0][1]

    def block_experts(self, block) -> list:
        """(flat Range, offset in the owned arrays) of the expert ranges in `block`."""
        return self.blocks.get(block, [])

    def dense_parts(self, parts: dict) -> dict:
        """Each block's (owner, flat Range) parts of the sharding partition, less the expert ranges."""
        return {b: [(r, q) for r, p in ps for q in subtract(p, self.experts)] for b, ps in parts.items()}

    def dense_pieces(self, dp) -> list:
        """(Range in the owned arrays, communicator) of the dense owned parts their dp replicas average."""
        if dp.size == 1:
            return []
        return [(Range(at, at + r.size), dp) for r in self.dense for at in (self.offset(r),)]
