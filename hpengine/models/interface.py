"""What a model kind declares, by concern, and all that the rest of the engine reads of it: its numerics
(blocks, parameter specs, layer pairs), its facts for the planner (caches, FLOPs, collectives), its
decoding, and its capabilities (attention and head widths, routed experts) as data from its config. Every kind
in models.KINDS satisfies these protocols (tests/unit/test_model_interface.py checks names and signatures).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Capabilities:
    """What a model of a [model] config can do, as the layout, the planner and the config checks ask it."""
    attention: bool             # mixes positions: context parallelism has a sequence to split
    qk_width: int               # per-head width of queries and keys (0 without attention)
    v_width: int                # per-head width of values (0 without attention)
    kv_heads: int = 0           # key/value heads (what a key/value exchange carries per token, per head)
    experts: int = 0            # routed experts per MoE layer (0: dense)
    capacity_factor: float = 0.0    # an expert's capacity over its even share (0: dropless)
    top_k: int = 0              # experts each token is routed to
    mtp_depth: int = 0          # multi-token prediction modules after the head (their targets ride on the batch)


@runtime_checkable
class Numerics(Protocol):
    """A model's forward and backward, block by block: pure layer pairs over a flat buffer's views."""
    n_layers: int
    moe: Any                    # its MoE component (models/moe_mlp.py), None for a dense model

    def blocks(self) -> list: ...
    def specs(self, block: str) -> list: ...
    def all_specs(self) -> list: ...
    def gemm_weight(self, name: str) -> bool: ...
    def embed_forward(self, xp, P, idx, ctx): ...
    def embed_backward(self, xp, dx, cache, G, ctx, defer=None): ...
    def layer_forward(self, xp, P, i, x, ctx, keep_scores=True, loss=None): ...
    def layer_backward(self, xp, dy, cache, P, G, i, ctx, defer=None): ...
    def layer_stats(self, i, cache): ...
    def qk_columns(self, i: int, tp: int) -> tuple: ...      # (models/attention_logits.QKColumns, ...), group
    def head_forward(self, xp, P, x, targets, norm, ctx): ...
    def head_backward(self, xp, cache, G, ctx, P, dloss=1.0, defer=None): ...


@runtime_checkable
class PlannerFacts(Protocol):
    """What the planner and the layout checks read of a model without running it."""
    def tp_divides(self, tp: int) -> str: ...
    def tp_allreduces(self) -> tuple: ...
    def sp_regathers(self) -> int: ...              # region entries per layer gathering their input again in backward
    def attention_flops(self, tokens: int, tp: int) -> int: ...
    def attention_flops_text(self) -> tuple: ...    # (a step's attention term, what it counts), for the run report
    def decode_cache_elements(self) -> int: ...     # elements decoding caches per token of context, every layer
    def cache_bytes(self, rows: int, tp: int, item: int, amp: bool, share: int, parts: int = 1, cp: int = 1,
                    cp_comm: str = "ring") -> dict: ...


@runtime_checkable
class Decoding(Protocol):
    """Token-by-token generation with a key/value cache (hpengine generate)."""
    def decode_cache(self, xp, dtype): ...
    def decode_embed(self, xp, P, ids, start): ...
    def decode_layer(self, xp, P, i, x, cache, start): ...
    def head_logits(self, xp, P, x): ...


class Model(Numerics, PlannerFacts, Decoding, Protocol):
    """A model kind's object: every concern above."""
