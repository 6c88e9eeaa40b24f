"""`hpengine generate RUN_DIR|CHECKPOINT`: text from a checkpoint's model, one process, NumPy.

Incremental decoding with a key/value cache: the prompt runs once through every layer, each layer keeping its
keys and values (gpt: the k and v columns of the fused head-major qkv linear; llama: the rotated keys and the
values per key/value head, rotary positions offset by the cache length); each new token then runs alone
through the layers, attending to the cached keys and values: O(context) per token. The mlp model mixes no
positions, so its cache is empty. `cache=False` runs the whole context through the models' own layer
functions for every token instead (for checks and benchmarks). Generation stops at the eos token, after
max_new tokens, or when the context reaches model.seq_len (with a note: positions beyond it were never trained).

Sampling: the last position's logits in float64; greedy = argmax; else divided by the temperature, then top-k,
then top-p (the smallest set of most likely tokens whose probability sums to >= p), drawn with
numpy.random.Generator(PCG64(seed)).
"""
from __future__ import annotations

import codecs
import math
import sys
import time
import tomllib

import numpy as np

from .config import ConfigError
from .data.format import DataError
from .models import LocalTP, build_model
from .models.common import head_weight, mlp_forward
from .nn import layernorm_forward, linear_forward, rmsnorm_forward, rope_forward, rope_tables, swiglu_forward


def head_logits(model, P, x):
    """The head without its loss: final norm and output projection of x (..., C) -> logits (..., V)."""
    if model.cfg.kind == "llama":
        h, _ = rmsnorm_forward(np, x, P["norm.w"], model.eps)
    else:
        h, _ = layernorm_forward(np, x, P["ln_f.w"], P["ln_f.b"])
    w, _ = head_weight(P, None, model.tied)
    logits, _ = linear_forward(np, h, w)
    return logits[..., :model.V]


def full_logits(model, P, ids):
    """Logits (n, V) of every position of ids, through the models' own embed and layer functions."""
    tp = LocalTP()
    x, _ = model.embed_forward(np, P, np.asarray(ids, dtype=np.int64)[None, :], tp)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(np, P, i, x, tp)
    return head_logits(model, P, x)[0]


def _softmax_rows(s, start):
    # s: (..., n, L) scores of query positions start .. start+n-1 over keys 0 .. L-1, causal, in place
    n, L = s.shape[-2:]
    q = np.arange(start, start + n)[:, None]
    s[..., np.arange(L)[None, :] > q] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


class KVDecoder:
    """A model's forward over new positions only, with per-layer key/value caches of model.seq_len rows."""

    def __init__(self, model, P):
        self.m, self.P, self.kind = model, P, model.cfg.kind
        self.dtype = P["wte"].dtype
        self.n = 0          # positions in the cache
        T, L = model.cfg.seq_len, model.n_layers
        if self.kind == "gpt":
            H, hd = model.H, model.C // model.H
            self.kv = [(np.zeros((H, T, hd), self.dtype), np.zeros((H, T, hd), self.dtype)) for _ in range(L)]
        elif self.kind == "llama":
            K, hd = model.K, model.hd
            self.kv = [(np.zeros((K, T, hd), self.dtype), np.zeros((K, T, hd), self.dtype)) for _ in range(L)]
            th = model.cfg.rope_theta
            self.rope = (rope_tables(np, T, hd, th, self.dtype),
                         rope_tables(np, T, hd, th, self.dtype, 1.0 / math.sqrt(hd)))
        else:
            self.kv = []

    def forward(self, ids):
        """Logits (n, V) of the new positions ids (appended after the cached ones)."""
        m, P, s = self.m, self.P, self.n
        ids = np.asarray(ids, dtype=np.int64)[None, :]
        n = ids.shape[1]
        if s + n > m.cfg.seq_len:
            raise ValueError(f"{s + n} positions exceed model.seq_len = {m.cfg.seq_len}")
        x = P["wte"][ids]
        if self.kind == "gpt":
            x = x + P["wpe"][s:s + n]
        for i in range(m.n_layers):
            if self.kind == "gpt":
                x = self._gpt_layer(i, x, s, n)
            elif self.kind == "llama":
                x = self._llama_layer(i, x, s, n)
            else:
                x, _ = m.layer_forward(np, P, i, x, LocalTP())     # no context mixing: nothing to cache
        self.n = s + n
        return head_logits(m, P, x)[0]

    def _gpt_layer(self, i, x, s, n):
        m, P, p = self.m, self.P, f"h.{i}"
        H = m.H
        hd = m.C // H
        h, _ = layernorm_forward(np, x, P[f"{p}.ln1.w"], P[f"{p}.ln1.b"])
        qkv, _ = linear_forward(np, h, P[f"{p}.attn.qkv.w"], P[f"{p}.attn.qkv.b"])
        qkv = qkv[0].reshape(n, H, 3, hd)            # column h*3*hd + j*hd + d
        Kc, Vc = self.kv[i]
        Kc[:, s:s + n] = qkv[:, :, 1].transpose(1, 0, 2)
        Vc[:, s:s + n] = qkv[:, :, 2].transpose(1, 0, 2)
        q = qkv[:, :, 0].transpose(1, 0, 2) * (1.0 / math.sqrt(hd))      # (H, n, hd)
        sc = _softmax_rows(q @ Kc[:, :s + n].swapaxes(-1, -2), s)        # (H, n, s+n)
        a = (sc @ Vc[:, :s + n]).transpose(1, 0, 2).reshape(1, n, H * hd)
        o, _ = linear_forward(np, a, P[f"{p}.attn.proj.w"])
        o += P[f"{p}.attn.proj.b"]
        o += x
        h2, _ = layernorm_forward(np, o, P[f"{p}.ln2.w"], P[f"{p}.ln2.b"])
        mo, _ = mlp_forward(np, P, f"{p}.mlp", h2, LocalTP())
        return o + mo

    def _llama_layer(self, i, x, s, n):
        m, P, p = self.m, self.P, f"h.{i}"
        H, K, hd = m.H, m.K, m.hd
        g = H // K
        (cos, sin), (qcos, qsin) = self.rope
        h, _ = rmsnorm_forward(np, x, P[f"{p}.attn_norm.w"], m.eps)
        q, _ = linear_forward(np, h, P[f"{p}.attn.q.w"])
        k, _ = linear_forward(np, h, P[f"{p}.attn.k.w"])
        v, _ = linear_forward(np, h, P[f"{p}.attn.v.w"])
        q = rope_forward(np, q.reshape(1, n, H, hd), qcos[s:s + n], qsin[s:s + n])[0]     # (H, n, hd), scaled
        k = rope_forward(np, k.reshape(1, n, K, hd), cos[s:s + n], sin[s:s + n])[0]       # (K, n, hd)
        Kc, Vc = self.kv[i]
        Kc[:, s:s + n] = k
        Vc[:, s:s + n] = v[0].reshape(n, K, hd).transpose(1, 0, 2)
        qg = q.reshape(K, g * n, hd)                 # query head h = kv head h // g, member h % g
        sc = (qg @ Kc[:, :s + n].swapaxes(-1, -2)).reshape(K, g, n, s + n)
        _softmax_rows(sc, s)
        a = (sc.reshape(K, g * n, s + n) @ Vc[:, :s + n]).reshape(H, n, hd)
        a = a.transpose(1, 0, 2).reshape(1, n, H * hd)
        o, _ = linear_forward(np, a, P[f"{p}.attn.o.w"])
        o += x
        h2, _ = rmsnorm_forward(np, o, P[f"{p}.mlp_norm.w"], m.eps)
        gt, _ = linear_forward(np, h2, P[f"{p}.mlp.gate.w"])
        up, _ = linear_forward(np, h2, P[f"{p}.mlp.up.w"])
        sw, _ = swiglu_forward(np, gt, up)
        d, _ = linear_forward(np, sw, P[f"{p}.mlp.down.w"])
        return o + d


class FullDecoder:
    """The same interface without a cache: every call runs the whole context."""

    def __init__(self, model, P):
        self.m, self.P, self.ids = model, P, []

    def forward(self, ids):
        self.ids += [int(t) for t in ids]
        return full_logits(self.m, self.P, self.ids)[-len(ids):]


# --- sampling ----------------------------------------------------------------------------------
def check_sampling(temperature, top_k, top_p, greedy) -> None:
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: must be >= 1")
    if not greedy and not temperature > 0:
        raise ConfigError(f"--temperature {temperature}: must be > 0 (or pass --greedy for argmax decoding)")


def sample(logits, rng, temperature=1.0, top_k=None, top_p=None, greedy=False) -> int:
    """One token id from a position's logits (see the module doc)."""
    z = np.asarray(logits, dtype=np.float64)
    if greedy:
        return int(np.argmax(z))
    z = z / temperature
    order = np.argsort(-z, kind="stable")        # most likely first; ties keep the lower id first
    if top_k is not None:
        order = order[:top_k]
    zs = z[order]
    pr = np.exp(zs - zs[0])
    pr /= pr.sum()
    if top_p is not None:
        keep = min(int(np.searchsorted(np.cumsum(pr), top_p)) + 1, len(pr))
        pr = pr[:keep] / pr[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(len(pr), p=pr)])


# --- tokenizers --------------------------------------------------------------------------------
class ByteText:
    kind = "bytes"

    def __init__(self):
        self.eos = 0
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def encode(self, text):
        return list(text.encode("utf-8"))

    def stream(self, tok, final=False):
        """Text to print after token tok (None: flush at the end); whole UTF-8 characters only."""
        if tok is not None and tok > 255:       # no byte: a model with a larger vocabulary and no tokenizer
            return ""
        return self._dec.decode(b"" if tok is None else bytes([tok]), final=final)


class HFText:
    kind = "hf"

    def __init__(self, text, eos):
        from tokenizers import Tokenizer
        self.tok, self.eos = Tokenizer.from_str(text), eos
        self.ids, self.shown = [], 0

    def encode(self, text):
        try:
            return list(self.tok.encode(text, add_special_tokens=False).ids)
        except Exception as exc:  # noqa: BLE001 - the tokenizer's own error, as one line
            raise DataError(f"the run's tokenizer cannot encode the prompt: {exc}") from None

    def stream(self, tok, final=False):
        if tok is not None:
            self.ids.append(tok)
        text = self.tok.decode(self.ids)
        if not final and text.endswith("\ufffd"):      # an incomplete character: wait for its other bytes
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new


def load(path, note=None):
    """(model, parameters, tokenizer) of a run folder, checkpoints folder or step folder."""
    from .evaluate import find_checkpoint
    from .export import eos_id_of, run_tokenizer, read_params
    note = note or (lambda s: print(f"hpengine: note: {s}", file=sys.stderr, flush=True))
    r = find_checkpoint(path)
    r.close()
    r, P = read_params(r.dir)
    from .config import from_dict
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    model = build_model(cfg.model, 1)
    for k, v in P.items():
        if v.dtype.itemsize < 4:
            P[k] = v.astype(np.float32)
    tok, _ = run_tokenizer(r, cfg)
    if tok is None:
        note(f"no tokenizer.json of the run found next to '{r.dir}': treating ids as UTF-8 bytes")
        text = ByteText()
    elif tok == "bytes":
        text = ByteText()
    else:
        text = HFText(tok, eos_id_of(r, tok))
    return model, P, text


def generate(path, prompt="", max_new=100, temperature=1.0, top_k=None, top_p=None, seed=0, greedy=False,
             cache=True, out=None, note=None) -> dict:
    """Generate, streaming the new text to `out` (default stdout); returns the ids and figures."""
    out = out or sys.stdout
    note = note or (lambda s: print(f"hpengine: note: {s}", file=sys.stderr, flush=True))
    check_sampling(temperature, top_k, top_p, greedy)
    if max_new < 0:
        raise ConfigError(f"--max-new-tokens {max_new}: must be >= 0")
    model, P, text = load(path, note)
    T, V = model.cfg.seq_len, model.V
    ids = text.encode(prompt)
    if not ids:
        if text.eos is None:
            raise DataError("an empty prompt starts from the eos token, but the run's tokenizer has none: "
                            "give a prompt")
        ids = [text.eos]
    if max(ids) >= V:
        raise DataError(f"the prompt encodes to id {max(ids)}, outside the model's vocabulary of {V}")
    if len(ids) > T:
        raise DataError(f"the prompt is {len(ids)} tokens, more than model.seq_len = {T}: shorten it")
    n_prompt = len(ids)
    dec = KVDecoder(model, P) if cache else FullDecoder(model, P)
    rng = np.random.Generator(np.random.PCG64(seed))
    new, steps = [], []
    t0 = time.perf_counter()
    if max_new and len(ids) >= T:
        note(f"the prompt fills the context (model.seq_len = {T} tokens): nothing generated")
    elif max_new:
        logits = dec.forward(ids)[-1]
        while True:
            steps.append(logits)
            tok = sample(logits, rng, temperature, top_k, top_p, greedy)
            new.append(tok)
            ids.append(tok)
            if tok == text.eos:
                break
            s = text.stream(tok)
            if s:
                out.write(s)
                out.flush()
            if len(new) >= max_new:
                break
            if len(ids) >= T:
                note(f"stopped at model.seq_len = {T} tokens of context (prompt and generated)")
                break
            logits = dec.forward([tok])[-1]
    dt = time.perf_counter() - t0
    s = text.stream(None, final=True)
    if s:
        out.write(s)
    out.write("\n")
    out.flush()
    return {"prompt_tokens": n_prompt, "tokens": new, "seconds": dt, "cache": cache,
            "tokens_per_s": len(new) / dt if dt > 0 else math.inf, "logits": steps}


def stats_line(r: dict) -> str:
    return (f"generate: {len(r['tokens'])} tokens after a {r['prompt_tokens']}-token prompt in {r['seconds']:.3f} s, "
            f"{r['tokens_per_s']:.1f} tokens/s, kv cache {'on' if r['cache'] else 'off'}")
