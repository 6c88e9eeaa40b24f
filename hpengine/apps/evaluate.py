"""`hpengine eval CHECKPOINT --data FILE`: the exact mean loss of a checkpoint's model over every token of a
token file (under the checkpoint's data.document_mask, within each document), with perplexity and bits per
byte. Owns the evaluation config, the deterministic pass plan over data-parallel replicas, and the report.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import tomllib
from functools import partial
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpengine.checkpoint import shards as checkpoint
from hpengine.checkpoint.export import refuse_checkpoint_target
from hpengine.checkpoint.locate import find_checkpoint
from hpengine.config import load as C
from hpengine.data.batch import Batch
from hpengine.data.dataset import check_vocab
from hpengine.data.documents import counted_targets, offsets_of, window_documents
from hpengine.data.format import BYTES, DataError, TokenFile
from hpengine.dist.agree import agree_or_raise
from hpengine.files.bars import bar
from hpengine.files.safe import probe_writable, write_file
from hpengine.run.build import build, load_together

log = logging.getLogger("hpengine")

# The model comes from the checkpoint's saved config; the layout from this invocation (strategies off, then
# --config's [strategy]/[runtime]/[mesh] tables and --set; on several ranks with no parallel axis switched
# on, data parallel over every rank; context-parallel ranks evaluate as more data-parallel replicas).
AXIS_SWITCHES = ("data_parallel", "sharding", "pipeline", "tensor_parallel", "context_parallel")
def eval_config(manifest: dict, cfg_path=None, overrides=(), world_size: int = 1):
    """The checkpoint's own config with every strategy off, then --config's layout tables and --set."""
    raw = tomllib.loads(manifest["config"])
    raw["strategy"] = {}
    raw.setdefault("runtime", {})["trace"] = False
    if cfg_path is not None:
        layout = C._read_toml(Path(cfg_path))
        for key in ("strategy", "runtime", "mesh"):
            if key in layout:
                raw[key] = layout[key]
    for item in overrides:
        C._apply_override(raw, item)
    if world_size > 1 and not any(raw.get("strategy", {}).get(s, {}).get("enable") for s in AXIS_SWITCHES):
        raw.setdefault("strategy", {})["data_parallel"] = {"enable": True, "degree": -1}
    s = raw.get("strategy", {})
    _context_as_data_parallel(s)
    if "tensor_parallel" in s:     # forward only, no activations kept: sequence parallelism would save nothing,
        s["tensor_parallel"]["sequence_parallel"] = False     # and the last window's length need not divide by tp
    m = s.get("pipeline", {}).get("micro_batches", 1) if s.get("pipeline", {}).get("enable") else 1
    k = s.get("gradient_merge", {}).get("k_steps", 1) if s.get("gradient_merge", {}).get("enable") else 1
    raw.setdefault("train", {})["global_batch"] = world_size * m * k     # divides by any replica count
    cfg = C.from_dict(raw)
    C.validate(cfg)
    return cfg


def open_data(path, cfg, manifest: dict) -> TokenFile:
    """The token file, checked against the model's vocabulary and the checkpoint's tokenizer."""
    tf = TokenFile(path)
    try:
        check_vocab(tf, cfg.model.vocab_size)
        old = (manifest.get("data") or {}).get("tokenizer_sha256")
        if old is not None and old != tf.tokenizer_sha256:
            files = ", ".join(manifest["data"].get("files", []))
            raise DataError(f"data file '{tf.path}' has tokenizer sha256 {tf.tokenizer_sha256 or 'none (version 1)'} "
                            f"but the checkpoint was trained on data with tokenizer sha256 {old} ({files}): "
                            "evaluate on a file built with the checkpoint's tokenizer (the run folder's "
                            "tokenizer.json)")
        if tf.n_tokens < 2:
            raise DataError(f"data file '{tf.path}' holds {tf.n_tokens} token(s): nothing to predict")
        if cfg.data.document_mask and counted_total(tf, True) == 0:
            raise DataError(f"data file '{tf.path}': its {tf.n_docs} documents are one token each, and "
                            "data.document_mask = true predicts nothing across a boundary: nothing to score")
    except BaseException:
        tf.close()
        raise
    return tf


def count_bytes(tf: TokenFile, block: int = 2**20, documents: bool = False) -> int | None:
    """UTF-8 bytes of the text the predicted tokens (all but the first; documents: all but each document's
    first, which nothing before it in its document predicts) decode to; None without a tokenizer."""
    n = tf.n_tokens
    if tf.tokenizer is None:
        return None
    if tf.tokenizer == BYTES:        # one byte per id, the eos ids excepted
        total, firsts = 0, offsets_of(tf)[1:-1] if documents else np.zeros(0, np.int64)
        for a in range(1, n, block):
            t = tf.read(a, min(n, a + block))
            keep = t != tf.eos_id if tf.eos_id >= 0 else np.ones(t.size, bool)
            keep[firsts[(firsts >= a) & (firsts < a + t.size)] - a] = False
            total += int(np.count_nonzero(keep))
        return total
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tf.tokenizer)
    offs = tf.doc_offsets if tf.doc_offsets is not None else np.array([0, n])
    total = 0
    for d in range(len(offs) - 1):       # decode document by document (blocks inside a very long one)
        lo, hi = int(offs[d]) + 1 if documents else max(int(offs[d]), 1), int(offs[d + 1])
        for a in range(lo, hi, block):
            ids = tf.read(a, min(hi, a + block)).astype(np.int64).tolist()
            total += len(tok.decode(ids).encode("utf-8"))
    return total


def build_engine(cfg, world):
    """train.build without a training dataset: layout, backend, mesh and the engine."""

    return build(cfg, world, with_data=False)


def _context_as_data_parallel(s: dict) -> None:
    """A layout's context-parallel ranks evaluate as data-parallel replicas (dp x cp of them): forward only,
    whole windows each, so the last, partial window need not divide into 2 cp chunks; the figures are the
    same. In place on the raw [strategy] table."""
    cp = s.get("context_parallel", {})
    if not cp.get("enable"):
        return
    c, dp = cp.get("degree", -1), s.get("data_parallel", {})
    d = dp.get("degree", -1) if dp.get("enable") else 1
    s["data_parallel"] = {**dp, "enable": True, "degree": -1 if -1 in (c, d) else c * d}
    s["context_parallel"] = {**cp, "enable": False}


# The windows are cut into contiguous ranges, one per data-parallel
# replica; every replica runs the same number of passes (idle ones repeat a dummy pass whose loss is not
# counted, so stage-3 sharding gathers stay in step) and the NLL sums are added over the world in float64,
# so every rank reports the figures of one process (to rounding).
def plan_passes(n_tokens: int, T: int, replicas: int, batch: int, m: int) -> list[list[tuple]]:
    """Per replica, its passes as (first window, windows, length, counted): `windows` consecutive windows
    of `length` targets each. A pass of fewer rows than a multiple of the m micro-batches runs as m copies
    of one window (loss normalised by m). Every replica gets the same number of passes; padding passes
    (counted = False) repeat the first window."""
    predicted = n_tokens - 1
    full, r = divmod(predicted, T)
    out = []
    for i in range(replicas):
        lo, hi = i * full // replicas, (i + 1) * full // replicas
        passes, w = [], lo
        while hi - w >= batch:
            passes.append((w, batch, T, True))
            w += batch
        if (hi - w) // m:
            q = (hi - w) // m * m
            passes.append((w, q, T, True))
            w += q
        passes += [(v, 1, T, True) for v in range(w, hi)]
        if r and i == replicas - 1:
            passes.append((full, 1, r, True))
        out.append(passes)
    dummy = (0, 1, T if full else r, False)
    most = max(len(p) for p in out)
    return [p + [dummy] * (most - len(p)) for p in out]


def _windows(tf, first: int, count: int, length: int, T: int, copies: int, documents: bool = False,
             tokens: bool = True) -> Batch:
    """The Batch of windows first .. first+count-1 (each `copies` times); documents: with their segments,
    positions and loss mask (tokens=False: those alone, for a pipeline stage that reads no token)."""
    fields = {}
    if documents:
        starts = (first + np.arange(count, dtype=np.int64)) * T
        got = window_documents(offsets_of(tf), starts, length)
        fields = dict(zip(("segments", "positions", "loss_mask"), got))
    if tokens:
        rows = np.empty((count, length + 1), dtype=np.int64)
        for j in range(count):
            s = (first + j) * T
            rows[j] = tf.read(s, s + length + 1)
        fields["tokens"], fields["targets"] = rows[:, :-1], rows[:, 1:]
    if copies > 1:
        fields = {f: np.repeat(a, copies, axis=0) for f, a in fields.items()}
    return Batch(**{f: np.ascontiguousarray(a) for f, a in fields.items()}, shape=(count * copies, length))


def counted_total(tf, documents: bool) -> int:
    """Targets a whole pass over the file counts: every token but the first; under documents, less each
    document's first token (whichever window holds it, the loss mask drops its prediction)."""
    if not documents:
        return tf.n_tokens - 1
    offs = offsets_of(tf)
    return tf.n_tokens - 1 - int(np.count_nonzero((offs > 0) & (offs < tf.n_tokens)))


# The pass is deterministic and covers the file once: window w reads tokens[w*T : w*T + T + 1] (inputs its
# first T, targets the last T), windows step by T = model.seq_len, so every token but the first is predicted
# exactly once; the last, partial window (r < T targets) runs as a sequence of its own length r. The loss is
# the sum of the per-token NLL (float64) divided by the number of predicted tokens. Under the checkpoint's
# data.document_mask the windows carry their documents as training's do (data/documents.py): attention stays
# inside a document, positions restart at each, and a target in another document than its input is neither
# scored nor counted, so the divisor is the counted targets (every token but each document's first).
def evaluate(checkpoint_path, data_path, cfg_path=None, overrides=(), batch: int = 8, world=None) -> dict:
    """Collective over world: the figures of the comment above (the same dict on every rank)."""
    world = world or MPI.COMM_WORLD
    if batch < 1:
        raise C.ConfigError(f"--batch {batch}: must be >= 1 (windows per pass and replica)")
    reader = agree_or_raise(world, lambda: find_checkpoint(checkpoint_path), checkpoint.CheckpointError,
                            (checkpoint.CheckpointError, OSError, ValueError, KeyError))
    try:
        cfg = eval_config(reader.manifest, cfg_path, overrides, world.Get_size())
        tf = agree_or_raise(world, lambda: open_data(data_path, cfg, reader.manifest), DataError, (DataError,))
        try:
            eng = build_engine(cfg, world)
            agree_or_raise(world, lambda: reader.check_shapes(eng.true_shapes()), checkpoint.CheckpointError,
                           (checkpoint.CheckpointError,))

            load_together(eng, reader, params_only=True)
            return _run(eng, cfg, reader, tf, batch, checkpoint_path, data_path)
        finally:
            tf.close()
    finally:
        reader.close()


def _run(eng, cfg, reader, tf, batch, checkpoint_path, data_path) -> dict:
    res, T, m, docs = eng.res, cfg.model.seq_len, eng.res.m, cfg.data.document_mask
    batch = -(-batch // m) * m
    me = res.replica(eng.mesh.coords)
    passes = plan_passes(tf.n_tokens, T, res.replicas, batch, m)[me]
    count_here = eng.tp.rank == 0          # every tp rank holds the whole loss: count it once
    K = len(eng.slots)
    nll, tokens, t0 = np.zeros(K), 0.0, time.perf_counter()
    with bar(len(passes), "evaluating", unit="batch", rank=eng.mesh.rank) as shown:    # rank 0's replica
        for first, count, length, counted in passes:
            copies = m if count % m else 1
            # read by the stages that compute on rows, once per tp group (engine/rows.py)
            read = partial(_windows, tf, first, count, length, T, copies, docs)
            b = eng.rows.shared(read, count * copies, length, partial(read, tokens=False) if docs else None)
            for k, slot in enumerate(eng.slots):     # every model of a train.models > 1 checkpoint, same windows
                out = eng.forward_backward(slot, b, float(copies), grad=False)
                if counted and count_here:
                    nll[k] += float(out)
            if counted and count_here and eng.mesh.coords["pp"] == res.pp - 1:
                tokens += counted_targets(offsets_of(tf), (first + np.arange(count)) * T, length) if docs \
                    else count * length
            shown.update(1)
    total = eng.world.allreduce_(np.concatenate([nll, [tokens]]).astype(np.float64))
    n = int(round(float(total[-1])))
    if n != counted_total(tf, docs):
        raise RuntimeError(f"evaluated {n} tokens, expected {counted_total(tf, docs)}")
    n_bytes = agree_or_raise(eng.world, lambda: count_bytes(tf, documents=docs) if eng.mesh.rank == 0 else None,
                             DataError,
                             (DataError, OSError, ValueError))
    n_bytes = eng.world.bcast_obj(n_bytes, root=0)
    per = [_figures(float(total[k]), n, n_bytes) for k in range(K)]
    seconds = eng.world.bcast_obj(time.perf_counter() - t0, root=0)
    out = {"checkpoint": str(reader.dir), "step": reader.step, "data": str(data_path), "tokens": n,
           "bytes": n_bytes, **per[0], "world": eng.mesh.size, "layout": eng.mesh.degrees,
           "batches": len(passes), "replicas": res.replicas, "seconds": seconds}
    if K > 1:
        out["models"] = per          # the top-level figures are model 0's
    return out


def _figures(nll_sum: float, n: int, n_bytes) -> dict:
    loss = nll_sum / n
    return {"nll_sum": nll_sum, "loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "bits_per_byte": loss / math.log(2) * n / n_bytes if n_bytes else None}


def line(r: dict, checkpoint_arg) -> str:
    def figs(f):
        bpb = "-" if f["bits_per_byte"] is None else f"{f['bits_per_byte']:.6f}"
        return f"loss {f['loss']:.6f}, perplexity {f['perplexity']:.4f}, bits/byte {bpb}"
    head = f"eval {checkpoint_arg} on {r['data']}: {r['tokens']:,} tokens, "
    body = figs(r) if "models" not in r else "; ".join(f"model {k}: {figs(f)}" for k, f in enumerate(r["models"]))
    return head + body + (f"; {_passes(r)}" if "batches" in r else "")


def _passes(r: dict) -> str:
    """How the figures were reached, e.g. "128 batches in 91 s" (per replica when there are several)."""
    b, s = r["batches"], r["seconds"]
    per = "" if r["replicas"] == 1 else f" on each of {r['replicas']} replicas"
    return f"{b:,} batch{'' if b == 1 else 'es'}{per} in {s:.1f} s" if s < 10 else f"{b:,} batches{per} in {s:,.0f} s"


def check_json_out(path, checkpoint_arg, data_path=None, force: bool = False) -> None:
    """Refuse, before the evaluation runs, a --json file that must not or cannot be written: one in a
    checkpoint folder or inside the evaluated checkpoint (even with force), the --data file, a folder, an
    existing file without force, and a folder that is missing or not writable."""
    p = Path(path)
    if p.name in ("", ".", ".."):
        raise C.ConfigError(f"--json '{path}' names no file: give a file path such as '{p / 'eval.json'}'")
    refuse_checkpoint_target(p, checkpoint_arg, "--json")
    if data_path is not None and os.path.abspath(p) == os.path.abspath(data_path):
        raise C.ConfigError(f"--json '{path}' is the --data file: give the figures their own file, e.g. "
                            f"'{p.with_suffix('.json')}'")
    if not p.parent.is_dir():
        raise C.ConfigError(f"--json '{path}': folder '{p.parent}' does not exist (create it first, or name "
                            "a file in an existing folder)")
    if p.is_dir():
        raise C.ConfigError(f"--json '{path}' is a folder: name the file to write, e.g. '{p / 'eval.json'}'")
    if os.path.lexists(p) and not force:
        raise C.ConfigError(f"--json '{path}' already exists (pass --force to replace it)")
    try:
        probe_writable(p.parent, "eval")
    except OSError as exc:
        raise C.ConfigError(f"eval --json: cannot write '{path}': {exc.strerror or exc}") from None


def write_json(r: dict, out, overwrite: bool = True) -> None:
    """The figures as JSON into `out`: a path (written by write_file: a fresh temporary file renamed onto
    it; overwrite=False refuses an existing one), or an open text stream (the caller's standard output)."""
    text = json.dumps(r, indent=1) + "\n"
    if hasattr(out, "write"):
        out.write(text)
        out.flush()
        return
    try:
        write_file(out, text, overwrite=overwrite)
    except OSError as exc:
        raise C.ConfigError(f"eval --json: cannot write '{out}': {exc.strerror or exc}") from None
