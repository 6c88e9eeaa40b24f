"""PyTorch eager reference for bench_core.py with model.kind = "llama": the same Llama model and step.

Written from the architecture (Hugging Face LlamaForCausalLM semantics; transformers is not used):
token embedding (no positions), pre-norm blocks x + attn(rmsnorm(x)) and x + mlp(rmsnorm(x)), final
RMSNorm, untied head, no biases. RMSNorm has a learned weight and computes its statistics in float32.
Attention has --heads query heads and --kv-heads key/value heads (grouped-query), the rotary embedding
in the "rotate half" convention with --rope-theta on q and k, causal softmax scaled by 1/sqrt(head_dim).
MLP = down(silu(gate(x)) * up(x)), hidden width --ffn-hidden (0 = Llama's rule: int(2 * 4 * d / 3)
rounded up to a multiple of --ffn-multiple-of). Attention is either written out (--attn explicit:
kv heads repeated, matmul, mask, softmax, matmul, like transformers' eager attention) or
F.scaled_dot_product_attention(is_causal=True) (--attn sdpa, with enable_gqa=True). The optimizer step
is torch_ref.py's: mean cross-entropy, clip_grad_norm_ 1.0, AdamW (decay on matrices and embeddings,
none on the norm weights); the init is hpengine's (normal, --init-std, o and down scaled by
1/sqrt(2 * layers), norm weights 1). --experts E > 0 makes every layer after --dense-layers a Mixtral MoE
MLP: a router linear to E logits, softmax in float32, the --top-k largest renormalised, each expert a SwiGLU
of width --expert-hidden run on the tokens that chose it (one matmul per expert on its gathered tokens, as
transformers' MixtralExperts does), outputs summed by gate; the loss adds --aux-loss x the per-sequence
load-balancing loss E sum_i f_i P_i (mean over sequences) and --z-loss x mean(logsumexp(logits)^2), as
hpengine's [model.moe] does (no decay on the router). torch is not an hpengine dependency: run this with the
python of a separate venv that has torch, e.g.

    $TORCH_PYTHON benchmarks/torch_llama.py --attn sdpa --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from _threads import ensure_threads  # noqa: E402 - benchmarks/ is sys.path[0]
from torch_ref import make_step, timed  # noqa: E402 - stdlib-only at import; torch is passed in


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default 20)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="untimed warm-up seconds (default 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (0 = --heads)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ffn-hidden", type=int, default=0, help="MLP hidden width (0 = Llama's rule)")
    p.add_argument("--ffn-multiple-of", type=int, default=256)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer (0 = dense)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=0, help="each expert's SwiGLU width (0 = the MLP's)")
    p.add_argument("--dense-layers", type=int, default=0, help="first layers that keep the dense MLP")
    p.add_argument("--aux-loss", type=float, default=0.0)
    p.add_argument("--z-loss", type=float, default=0.0)
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    return p.parse_args(argv)


def ffn_hidden(a) -> int:
    """--ffn-hidden, or Llama's rule: int(2 * 4d / 3) rounded up to a multiple of --ffn-multiple-of."""
    if a.ffn_hidden > 0:
        return a.ffn_hidden
    m = a.ffn_multiple_of
    return m * ((int(2 * 4 * a.d_model / 3) + m - 1) // m)


def build(a, torch, device="cpu"):
    """(model, optimizer) on `device`, drawn on the CPU and then moved (a seed gives the same model anywhere)."""
    nn, F = torch.nn, torch.nn.functional
    C, H = a.d_model, a.heads
    K = a.kv_heads or H
    if C % H or H % K:
        sys.exit(f"torch_llama.py: d_model {C} must split into {H} heads, and {H} heads into {K} kv heads")
    hd, Fh, g = C // H, ffn_hidden(a), H // K
    if hd % 2:
        sys.exit(f"torch_llama.py: the rotary embedding needs an even head dimension, got {hd}")

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            dt = x.dtype
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + a.norm_eps)
            return self.weight * h.to(dt)

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((-x2, x1), dim=-1)

    class MoE(nn.Module):
        """Mixtral's sparse MLP; adds its balancing losses to `extra` (a list the model sums into the loss)."""
        def __init__(self):
            super().__init__()
            E, Fe = a.experts, a.expert_hidden or Fh
            self.router = nn.Linear(C, E, bias=False)
            self.gate = nn.Parameter(torch.empty(E, C, Fe))
            self.up = nn.Parameter(torch.empty(E, C, Fe))
            self.down = nn.Parameter(torch.empty(E, Fe, C))

        def forward(self, h, extra):
            B, T, _ = h.shape
            x = h.reshape(-1, C)
            logits = self.router(x).float()
            probs = torch.softmax(logits, dim=-1)
            top, idx = torch.topk(probs, a.top_k, dim=-1)
            top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
            out = torch.zeros_like(x)
            for e in range(a.experts):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    xe = x[tok]
                    ye = (F.silu(xe @ self.gate[e]) * (xe @ self.up[e])) @ self.down[e]
                    out.index_add_(0, tok, ye * top[tok, slot, None])
            if a.aux_loss:       # per sequence: E sum_i f_i P_i, f a constant, then the mean over sequences
                with torch.no_grad():
                    f = F.one_hot(idx, a.experts).sum(1).view(B, T, -1).sum(1).float() / (T * a.top_k)
                P = probs.view(B, T, -1).mean(1)
                extra.append(a.aux_loss * a.experts * (f * P).sum(-1).mean())
            if a.z_loss:
                extra.append(a.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean())
            return out.view(B, T, C)

    class Block(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
            self.moe = MoE() if a.experts and layer >= a.dense_layers else None
            self.q = nn.Linear(C, H * hd, bias=False)
            self.k = nn.Linear(C, K * hd, bias=False)
            self.v = nn.Linear(C, K * hd, bias=False)
            self.o = nn.Linear(H * hd, C, bias=False)
            if self.moe is None:
                self.gate = nn.Linear(C, Fh, bias=False)
                self.up = nn.Linear(C, Fh, bias=False)
                self.down = nn.Linear(Fh, C, bias=False)

        def attn(self, x, cos, sin):
            B, T, _ = x.shape
            q = self.q(x).view(B, T, H, hd).transpose(1, 2)
            k = self.k(x).view(B, T, K, hd).transpose(1, 2)
            v = self.v(x).view(B, T, K, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if a.attn == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
            else:
                if g > 1:  # transformers' repeat_kv: query head i reads kv head i // g
                    k = k[:, :, None].expand(B, K, g, T, hd).reshape(B, H, T, hd)
                    v = v[:, :, None].expand(B, K, g, T, hd).reshape(B, H, T, hd)
                s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                y = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype) @ v
            return self.o(y.transpose(1, 2).reshape(B, T, H * hd))

        def forward(self, x, cos, sin, extra):
            x = x + self.attn(self.attn_norm(x), cos, sin)
            h = self.mlp_norm(x)
            if self.moe is not None:
                return x + self.moe(h, extra)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(a.vocab, C)
            self.blocks = nn.ModuleList(Block(i) for i in range(a.layers))
            self.norm = RMSNorm()
            self.head = nn.Linear(C, a.vocab, bias=False)
            inv = 1.0 / a.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
            ang = torch.arange(a.seq, dtype=torch.float64)[:, None] * inv[None, :]
            ang = torch.cat((ang, ang), dim=-1)          # (T, hd): the same angle for both halves
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)
            for n, p in self.named_parameters():   # hpengine's init: residual projections scaled down
                if p.dim() >= 2:
                    res = n.endswith(("o.weight", "down.weight", "moe.down"))
                    nn.init.normal_(p, std=a.init_std / math.sqrt(2 * a.layers) if res else a.init_std)

        def forward(self, idx, tgt):
            T = idx.shape[1]
            cos, sin = self.cos[:T], self.sin[:T]
            x, extra = self.embed(idx), []
            for b in self.blocks:
                x = b(x, cos, sin, extra)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1)) + sum(extra)

    model = Llama().to(device)
    # hpengine's decay: matrices, the embedding and the experts, not the norms nor the router
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "router" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "router" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=False)
    return model, opt


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        sys.exit(f"torch_llama.py: PyTorch is not installed for {sys.executable}; run it with the python of a "
                 "venv that has torch (python3 -m venv DIR && DIR/bin/pip install torch numpy, then "
                 "DIR/bin/python benchmarks/torch_llama.py); see benchmarks/README.md")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1234)
    model, opt = build(a, torch)
    step = make_step(torch, model, opt, a)

    r = {"engine": f"torch-{a.attn}", "model": "llama-moe" if a.experts else "llama", "torch": torch.__version__,
         "threads": torch.get_num_threads(), "n_params": sum(p.numel() for p in model.parameters()),
         "heads": a.heads, "kv_heads": a.kv_heads or a.heads, "ffn_hidden": ffn_hidden(a), **timed(step, a)}
    print(f"torch {r['torch']} llama attn={a.attn} threads={r['threads']} params={r['n_params']:,} "
          f"(d{a.d_model} L{a.layers} H{a.heads} KV{r['kv_heads']} F{r['ffn_hidden']} T{a.seq} B{a.batch})\n"
          f"step ms   median {r['median_step_ms']:.1f} | min {r['min_step_ms']:.1f} | "
          f"CPU median {r['median_cpu_ms']:.1f}\n"
          f"tokens/s  {r['tokens_per_s']:,.0f} (median)\n"
          f"peak RSS  {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
