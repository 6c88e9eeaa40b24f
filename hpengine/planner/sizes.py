"""Closed-form sizes of decoders with multi-head latent attention (MLA) and routed-expert layers (DeepSeek-V3,
Kimi K2): parameters, the parameters one token activates, training FLOPs per token, the multi-token-prediction
module and the latent cache; an independent count of what the deepseek kind's specs hold and the planner charges.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAShape:
    """A DeepSeek-V3 style decoder: the first dense_layers layers keep a SwiGLU MLP of ffn_hidden, the others
    route each token to top_k of `experts` SwiGLU experts of expert_hidden (optionally within its topk_groups best
    of n_groups groups) beside `shared` always-on ones; RMSNorms, untied head; mtp_depth extra prediction
    modules. Grouped routing chooses among the experts: it changes no count here."""
    vocab: int
    d_model: int
    n_layers: int
    dense_layers: int
    n_heads: int
    q_lora_rank: int        # 0 = q straight from the hidden state
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    ffn_hidden: int
    expert_hidden: int
    experts: int
    shared: int
    top_k: int
    n_groups: int = 1
    topk_groups: int = 1
    mtp_depth: int = 0

    @classmethod
    def of(cls, m) -> "MLAShape":
        """The shape of a deepseek [model] config whose shared expert is a whole number of expert widths."""
        e, a = m.moe, m.mla
        if e.shared_hidden % e.expert_hidden:
            raise ValueError(f"model.moe.shared_hidden = {e.shared_hidden}: MLAShape counts shared experts of "
                             f"expert_hidden = {e.expert_hidden}; use a multiple of it")
        return cls(vocab=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, dense_layers=e.dense_layers,
                   n_heads=m.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                   qk_nope=a.qk_nope_head_dim, qk_rope=a.qk_rope_head_dim, v_head=a.v_head_dim,
                   ffn_hidden=m.ffn_hidden, expert_hidden=e.expert_hidden, experts=e.num_experts,
                   shared=e.shared_hidden // e.expert_hidden, top_k=e.top_k, n_groups=e.n_groups,
                   topk_groups=e.topk_groups, mtp_depth=m.mtp.depth)

    # -- parameters ------------------------------------------------------------------------------------

    def attention(self) -> int:
        """q: C x q_lora, its RMSNorm, q_lora x H (nope + rope) (q_lora_rank 0: C x H (nope + rope)); keys and
        values: C x (kv_lora + rope), the latent's RMSNorm, kv_lora x H (nope + v); out: H v x C."""
        C, H, r, L = self.d_model, self.n_heads, self.q_lora_rank, self.kv_lora_rank
        qk = self.qk_nope + self.qk_rope
        q = C * r + r + r * H * qk if r else C * H * qk
        return q + C * (L + self.qk_rope) + L + L * H * (self.qk_nope + self.v_head) + H * self.v_head * C

    def swiglu(self, width: int) -> int:
        return 3 * self.d_model * width

    def layer(self, routed: bool, active: bool = False) -> int:
        """One layer's two RMSNorms, attention and MLP; routed: the router (C x E), the experts (all of them, or
        the top_k a token reaches when `active`) and the shared ones."""
        base = 2 * self.d_model + self.attention()
        if not routed:
            return base + self.swiglu(self.ffn_hidden)
        chosen = self.top_k if active else self.experts
        return base + self.d_model * self.experts + (chosen + self.shared) * self.swiglu(self.expert_hidden)

    def embedding(self) -> int:
        return self.vocab * self.d_model

    def params(self) -> int:
        """The main model: embedding, layers, final RMSNorm, head (the published total; no MTP module)."""
        return (2 * self.embedding() + self.d_model + self.dense_layers * self.layer(False)
                + (self.n_layers - self.dense_layers) * self.layer(True))

    def activated(self) -> int:
        """Parameters one token's forward multiplies by: every layer's attention and norms, the dense MLPs, a
        routed layer's router, top_k and shared experts, the final norm and head; not the input embedding, a
        lookup (DeepSeek's count: V2-Lite's 2.4B, V2's 21B, V3's 37B)."""
        routed = self.n_layers - self.dense_layers
        return (self.embedding() + self.d_model + self.dense_layers * self.layer(False)
                + routed * self.layer(True, active=True))

    def mtp_params(self, stored: bool = False) -> int:
        """One multi-token-prediction module per depth (DeepSeek-V3 section 2.2): two RMSNorms of C, the 2C x C
        projection, a routed layer and a final RMSNorm; it shares the embedding and head with the main model,
        which a checkpoint (`stored`) holds again for each module."""
        C = self.d_model
        one = 2 * C + 2 * C * C + self.layer(True) + C + (2 * self.embedding() if stored else 0)
        return self.mtp_depth * one

    # -- compute and caches ----------------------------------------------------------------------------

    def attention_flops(self, seq_len: int) -> int:
        """Forward FLOPs per token of one layer's scores (nope + rope wide) and their product with the values (v
        wide), over all seq_len keys as the llama kind counts them: 2 T H (nope + rope + v)."""
        return 2 * seq_len * self.n_heads * (self.qk_nope + self.qk_rope + self.v_head)

    def flops_per_token(self, seq_len: int, mtp: bool = True) -> int:
        """Training FLOPs (forward and backward) per token: 6 x the activated parameters plus 3 x the attention
        forward of every layer; with `mtp`, each module's matmuls (its projection, routed layer and the shared
        head) and attention too. What MFU counts: the activated parameters, not the total."""
        out = 6 * self.activated() + 3 * self.n_layers * self.attention_flops(seq_len)
        if mtp and self.mtp_depth:
            C = self.d_model
            module = 2 * C + 2 * C * C + self.layer(True, active=True) + C + self.embedding()
            out += self.mtp_depth * (6 * module + 3 * self.attention_flops(seq_len))
        return out

    def latent_cache(self, tokens: int) -> int:
        """Elements decoding keeps per sequence of `tokens`: each layer's compressed keys and values (kv_lora)
        and the shared rotary key (rope) per token, where plain multi-head attention keeps H (nope + rope + v)."""
        return tokens * self.n_layers * (self.kv_lora_rank + self.qk_rope)
