"""`hpengine generate RUN_DIR|CHECKPOINT`: text from a checkpoint's model, one process, NumPy or CuPy.
Owns the device choice, the decoders (key/value-cached or full-context), sampling, the prompt's text
codecs, and the generation loop with its stopping rules.
"""
from __future__ import annotations

import codecs
import math
import sys
import time
import tomllib

import numpy as np

from hpengine.checkpoint.export import (
    eos_id_of,
    read_params,
    run_tokenizer,
    select_model,
)
from hpengine.checkpoint.locate import find_checkpoint
from hpengine.config.load import ConfigError, from_dict
from hpengine.data.format import DataError
from hpengine.device import backend
from hpengine.models.moe_bias import saved_bias
from hpengine.files.bars import bar, watched
from hpengine.models import LOCAL, build_model

# device "gpu" keeps the parameters, caches and activations on the current CUDA device (CuPy, the layers' fused
# kernels and cuBLAS); only each step's logits come back to the host for sampling. "auto" is the GPU when CuPy
# finds a usable device, else the CPU.
DEVICES = ("auto", "cpu", "gpu")


def array_module(device: str):
    """(xp, device name) for --device."""
    if device not in DEVICES:
        raise ConfigError(f"--device {device!r}: valid values are {', '.join(DEVICES)}")
    if device == "auto":
        device = "gpu" if backend.cupy_usable() else "cpu"
    if device == "gpu":
        if not backend.cupy_usable():
            raise ConfigError("--device gpu: no usable CUDA device through CuPy (install hpengine[gpu] on a "
                              "machine with an NVIDIA driver, or pass --device cpu)")
        return backend.cupy_module(), "gpu"
    return np, "cpu"


def to_host(a):
    return np.asarray(a) if backend.on_host(a) else a.get()


def full_logits(model, P, ids, xp=np):
    """Logits (n, V) of every position of ids, through the models' own training embed and layer functions."""
    x, _ = model.embed_forward(xp, P, xp.asarray(np.asarray(ids, dtype=np.int64)[None, :]), LOCAL)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(xp, P, i, x, LOCAL)
    return to_host(model.head_logits(xp, P, x)[0])


# Incremental decoding with a key/value cache, through each model's decode methods (models/decode.py): the
# prompt runs once through every layer, each layer keeping its keys and values; each new token then runs alone
# through the layers, attending to the cached ones: O(context) per token. `cache=False` runs the whole
# context through the models' own training forward for every token instead (for checks and benchmarks).
# A checkpoint trained with data.document_mask = true needs nothing more: a prompt is one document, its
# positions run from 0 and it attends only to itself, which is what both decoders compute.
class KVDecoder:
    """A model's forward over new positions only, with the model's per-layer caches of model.seq_len rows."""

    def __init__(self, model, P, xp=np):
        self.m, self.P, self.xp = model, P, xp
        self.cache = model.decode_cache(xp, P["wte"].dtype)
        self.n = 0          # positions in the cache

    def forward(self, ids):
        """Logits (n, V) on the host of the new positions ids (appended after the cached ones)."""
        m, P, s, xp = self.m, self.P, self.n, self.xp
        ids = xp.asarray(np.asarray(ids, dtype=np.int64)[None, :])
        n = ids.shape[1]
        if s + n > m.cfg.seq_len:
            raise ValueError(f"{s + n} positions exceed model.seq_len = {m.cfg.seq_len}")
        x = m.decode_embed(xp, P, ids, s)
        for i in range(m.n_layers):
            x = m.decode_layer(xp, P, i, x, self.cache[i], s)
        self.n = s + n
        return to_host(m.head_logits(xp, P, x)[0])


class FullDecoder:
    """The same interface without a cache: every call runs the whole context."""

    def __init__(self, model, P, xp=np):
        self.m, self.P, self.xp, self.ids = model, P, xp, []

    def forward(self, ids):
        self.ids += [int(t) for t in ids]
        return full_logits(self.m, self.P, self.ids, self.xp)[-len(ids):]


# --- sampling ----------------------------------------------------------------------------------
def check_sampling(temperature, top_k, top_p, greedy) -> None:
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: must be >= 1")
    if not greedy and not 0 < temperature < math.inf:
        raise ConfigError(f"--temperature {temperature}: must be a finite number > 0 (or pass --greedy for "
                          "argmax decoding)")


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"--seed {seed}: must be an integer >= 0 (numpy's PCG64 takes any non-negative "
                          "integer)")


def check_prompt(prompt) -> None:
    """The prompt must be text that UTF-8 can encode: an argument that was not UTF-8 arrives with its bad
    bytes as lone surrogates (Python's surrogateescape), named here as the bytes they were."""
    if not isinstance(prompt, str):
        raise DataError(f"the prompt must be text, not {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        bad = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"U+{code:04X} (a lone surrogate)"
        try:
            shown = prompt[:40].encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            shown = prompt[:40].encode("utf-8", "backslashreplace")
        raise DataError(f"--prompt {shown!r}{'...' if len(prompt) > 40 else ''} is not UTF-8 text ({bad} at "
                        f"character {exc.start}); give UTF-8 text") from None


# Sampling: the last position's logits in float64; greedy = argmax; else shifted so the largest is 0 and divided
# by the temperature (any finite temperature > 0: a tiny one underflows to argmax, never to inf - inf), then
# top-k, then top-p (the smallest set of most likely tokens whose probability sums to >= p), drawn with
# numpy.random.Generator(PCG64(seed)), seed an integer >= 0.
def sample(logits, rng, temperature=1.0, top_k=None, top_p=None, greedy=False) -> int:
    """One token id from a position's logits (see the comment above)."""
    z = np.asarray(logits, dtype=np.float64)
    if greedy:
        return int(np.argmax(z))
    with np.errstate(over="ignore"):             # <= 0: a tiny temperature gives -inf, never inf - inf = nan
        z = (z - z.max()) / temperature
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


def load(path, note=None, xp=np, model_index=None):
    """(model, parameters as xp arrays, tokenizer) of a run folder, checkpoints folder or step folder;
    model_index picks one model of a train.models > 1 checkpoint."""
    note = note or (lambda s: print(f"hpengine: note: {s}", file=sys.stderr, flush=True))
    r = find_checkpoint(path)
    r.close()
    r, P = read_params(r.dir)
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    P = select_model(P, cfg, model_index)
    model = build_model(cfg.model, 1)
    if model.moe is not None:     # aux-loss-free balancing: route as the run did
        model.moe.set_bias(xp, saved_bias(r.manifest["state"], model_index or 0))
    for k, v in P.items():      # float16 storage computes in float32, as amp's master weights
        P[k] = xp.asarray(v.astype(np.float32) if v.dtype.itemsize < 4 else v)
    tok, _ = run_tokenizer(r, cfg)
    if tok is None:
        note(f"no tokenizer.json of the run found next to '{r.dir}': treating ids as UTF-8 bytes")
        text = ByteText()
    elif tok == "bytes":
        text = ByteText()
    else:
        text = HFText(tok, eos_id_of(r, tok))
    return model, P, text


# Generation stops at the eos token, after max_new tokens, or when the context reaches model.seq_len (with a
# note: positions beyond it were never trained).
def generate(path, prompt="", max_new=100, temperature=1.0, top_k=None, top_p=None, seed=0, greedy=False,
             cache=True, out=None, note=None, device="cpu", model_index=None) -> dict:
    """Generate, streaming the new text to `out` (default stdout); returns the ids and figures."""
    out = out or sys.stdout
    note = note or (lambda s: print(f"hpengine: note: {s}", file=sys.stderr, flush=True))
    check_sampling(temperature, top_k, top_p, greedy)
    check_seed(seed)
    check_prompt(prompt)
    if max_new < 0:
        raise ConfigError(f"--max-new-tokens {max_new}: must be >= 0")
    xp, device = array_module(device)
    model, P, text = load(path, note, xp, model_index)
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
    dec = (KVDecoder if cache else FullDecoder)(model, P, xp)
    rng = np.random.Generator(np.random.PCG64(seed))
    new, steps = [], []
    t0 = time.perf_counter()
    if max_new and len(ids) >= T:
        note(f"the prompt fills the context (model.seq_len = {T} tokens): nothing generated")
    elif max_new:
        # text streaming to a terminal is its own progress; written to a file or a pipe, a bar counts it
        with bar(min(max_new, T - len(ids)), "generating", unit="tok", show=watched() and not watched(out)) as shown:
            logits = dec.forward(ids)[-1]
            while True:
                steps.append(logits)
                tok = sample(logits, rng, temperature, top_k, top_p, greedy)
                new.append(tok)
                ids.append(tok)
                shown.update(1)
                if tok == text.eos:
                    break
                s = text.stream(tok)
                if s:
                    out.write(s)
                    out.flush()
                if len(new) >= max_new:
                    break
                if len(ids) >= T:
                    break
                logits = dec.forward([tok])[-1]
        if len(ids) >= T and tok != text.eos and len(new) < max_new:     # said once the bar is gone
            note(f"stopped at model.seq_len = {T} tokens of context (prompt and generated)")
    dt = time.perf_counter() - t0
    s = text.stream(None, final=True)
    if s:
        out.write(s)
    out.write("\n")
    out.flush()
    return {"prompt_tokens": n_prompt, "tokens": new, "seconds": dt, "cache": cache, "device": device,
            "tokens_per_s": len(new) / dt if dt > 0 else math.inf, "logits": steps}


def stats_line(r: dict) -> str:
    return (f"generate: {len(r['tokens'])} tokens after a {r['prompt_tokens']}-token prompt in {r['seconds']:.3f} s, "
            f"{r['tokens_per_s']:.1f} tokens/s, kv cache {'on' if r['cache'] else 'off'}, {r['device']}")
