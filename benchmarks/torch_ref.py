"""PyTorch eager reference for bench_core.py: the same pre-LN GPT-2 model and optimizer step.

Byte vocab, learned positions, blocks of LN -> QKV (bias) -> causal attention -> proj -> residual ->
LN -> MLP 4x GELU(tanh) -> residual, final LN, untied head, mean cross-entropy, global-norm clipping
and AdamW (decay on matrices and embeddings only, like hpengine). Attention is either written out
(--attn explicit: matmul, mask, softmax, matmul) or F.scaled_dot_product_attention (--attn sdpa).
torch is not an hpengine dependency: run this with the python of a separate venv that has torch, e.g.

    $TORCH_PYTHON benchmarks/torch_ref.py --attn sdpa --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time

from _threads import ensure_threads  # noqa: E402 - benchmarks/ is sys.path[0]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", choices=("explicit", "sdpa"), default="explicit")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default 20)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="untimed warm-up seconds (default 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    return p.parse_args(argv)


def build(a, torch, device="cpu"):
    """(model, optimizer) on `device`. The weights are drawn on the CPU and then moved, so a seed gives the
    same initial model on every device; the optimizer is made after the move, on the moved parameters."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, C, H, sdpa):
            super().__init__()
            self.H, self.sdpa = H, sdpa
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def attn(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.H, C // self.H).permute(2, 0, 3, 1, 4)
            if self.sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // self.H))
                mask = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
                y = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            C = a.d_model
            self.wte, self.wpe = nn.Embedding(a.vocab, C), nn.Embedding(a.seq, C)
            self.blocks = nn.ModuleList(Block(C, a.heads, a.attn == "sdpa") for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(C)
            self.head = nn.Linear(C, a.vocab, bias=False)
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * a.layers) if n.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, std=std)
                elif n.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, tgt):
            x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    model = GPT().to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=False)
    return model, opt


def make_step(torch, model, opt, a, device="cpu"):
    """One optimizer step on a random batch (fixed generator): zero, forward, backward, clip 1.0, AdamW."""
    gen = torch.Generator(device=device).manual_seed(0)

    def step():
        idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=device, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()
    return step


def timed(step, a) -> dict:
    """Warm up for a.warmup_s seconds, then time a.steps calls of step() one by one: the JSON fields of
    the timing (median wall and CPU time per step, tokens/s, peak RSS)."""
    n, t_end = 0, time.perf_counter() + a.warmup_s
    while n == 0 or time.perf_counter() < t_end:
        step()
        n += 1
    times, cpu = [], []
    for _ in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med, toks = statistics.median(times), a.batch * a.seq
    return {"warmup_steps": n, "steps": a.steps, "median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3,
            "tokens_per_s": toks / med, "median_cpu_ms": statistics.median(cpu) * 1e3,
            "tokens_per_cpu_s": toks / statistics.median(cpu),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        sys.exit(f"torch_ref.py: PyTorch is not installed for {sys.executable}; run it with the python of a "
                 "venv that has torch (python3 -m venv DIR && DIR/bin/pip install torch numpy, then "
                 "DIR/bin/python benchmarks/torch_ref.py); see benchmarks/README.md")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1234)
    model, opt = build(a, torch)
    step = make_step(torch, model, opt, a)

    r = {"engine": f"torch-{a.attn}", "torch": torch.__version__, "threads": torch.get_num_threads(),
         "n_params": sum(p.numel() for p in model.parameters()), **timed(step, a)}
    print(f"torch {r['torch']} attn={a.attn} threads={r['threads']} params={r['n_params']:,}\n"
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
