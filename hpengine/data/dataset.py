"""Reading token files for training: the splits, blends of several files, and the deterministic global-batch
sampler. Windows are read where they lie (format.TokenFile); a rank holds no token array, only each
file's document offsets. A global batch is a pure function of (seed, step, split); ranks only take row
slices of it, which is what lets every parallel layout see exactly the batches of the one-process run.
No MPI here."""
from __future__ import annotations

import json
import logging
import operator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpengine.data.batch import Batch
from hpengine.data.documents import counted_ahead, counted_targets, offsets_of, window_documents
from hpengine.data.format import BYTES, DataError, TokenFile

log = logging.getLogger("hpengine.data")

SPLITS = {"train": 0, "val": 1}
# Domain tag mixed into the sampler key so batch draws never share a stream with parameter init,
# which is also keyed on the run seed.
_SAMPLER_TAG = 0x64617461  # "data"


@dataclass(frozen=True)
class Part:
    """One source's share of a split: tokens[lo:hi] of an open file."""
    file: TokenFile
    lo: int
    hi: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


def tokenizer_label(tf: TokenFile) -> str:
    """How a file's tokenizer is named in messages: its kind and the first digits of its sha256."""
    if tf.tokenizer_sha256 is None:
        return "no tokenizer recorded: a version-1 file"
    kind = tf.tokenizer
    if kind != BYTES:
        try:
            kind = json.loads(kind)["model"]["type"]
        except (TypeError, ValueError, KeyError):
            kind = "Hugging Face"
    return f"tokenizer {kind}, sha256 {tf.tokenizer_sha256[:8]}"


def _identity(tf: TokenFile) -> tuple:
    """What two files of one blend (or a file and its validation file) must share."""
    if tf.tokenizer_sha256 is None:
        return (None,)
    return tf.tokenizer_sha256, tf.vocab_size, tf.eos_id


def _describe(tf: TokenFile) -> str:
    if tf.tokenizer_sha256 is None:
        return f"'{tf.path}' ({tokenizer_label(tf)})"
    return f"'{tf.path}' (vocab_size = {tf.vocab_size}, eos_id = {tf.eos_id}, {tokenizer_label(tf)})"


def file_vocab(tf: TokenFile) -> tuple[int, bool]:
    """(vocabulary size the file needs, whether it is stated): the vocab_size attribute, else the largest
    id + 1 (read in blocks)."""
    if tf.vocab_size is not None:
        return tf.vocab_size, True
    return tf.max_token() + 1, False


def check_vocab(tf: TokenFile, model_vocab: int) -> int:
    need, stated = file_vocab(tf)
    if need > model_vocab:
        what = "was built for" if stated else f"holds token ids up to {need - 1}, so needs"
        raise DataError(f"data file '{tf.path}' {what} vocab_size = {need} ({tokenizer_label(tf)}) but "
                        f"model.vocab_size = {model_vocab}; set model.vocab_size >= {need}")
    return need


def val_start(tf: TokenFile, val_fraction: float) -> int:
    """First token of the validation split inside tf: the first document boundary at or after
    (1 - val_fraction) x n_tokens, at least one document on each side; a token position in a file without
    document boundaries (version 1)."""
    cut = int(tf.n_tokens * (1.0 - val_fraction))
    d = tf.doc_offsets
    if d is None:
        log.info("%s has no document boundaries (a version-1 file): validation is its last %d tokens",
                 tf.path, tf.n_tokens - cut)
        return cut
    if len(d) < 3:
        raise DataError(f"data file '{tf.path}' holds a single document ({tf.n_tokens} tokens), so "
                        f"data.val_fraction = {val_fraction} cannot split it by documents: set data.val_path "
                        "to a separate validation file, or build the file from several documents")
    k = min(max(int(np.searchsorted(d, cut, side="left")), 1), len(d) - 2)
    return int(d[k])


def _weights(sources) -> list[tuple[str, float]]:
    out = []
    for i, s in enumerate(sources):
        path, weight = (s.path, s.weight) if hasattr(s, "path") else tuple(s)
        if not str(path):
            raise DataError(f"data.sources[{i}].path is empty: expected a token file")
        if not float(weight) > 0:
            raise DataError(f"data.sources[{i}].weight = {weight}: must be > 0")
        out.append((str(path), float(weight)))
    return out


class TokenDataset:
    """The train and val splits of one token file (data.path) or of a blend (data.sources), plus an
    optional separate validation file (data.val_path).

    `vocab_size`, `eos_id`, `tokenizer` ("bytes", a tokenizer.json text, or None for version-1 files) and
    `tokenizer_sha256` describe the data, shared by every file. document_mask: batches carry their rows'
    documents (segments, positions, loss mask: data/documents.py)."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int, val_fraction: float, *,
                 val_path: str | Path = "", sources=(), document_mask: bool = False):
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} is invalid: expected 0 < value < 1")
        if seq_len < 1 or vocab_size < 1:
            raise DataError(f"model.seq_len={seq_len} and model.vocab_size={vocab_size} must both be positive")
        blend = _weights(sources)
        if str(path) and blend:
            raise DataError(f"data.path = '{path}' and data.sources ({len(blend)} files) are both set: set "
                            "data.path for one file, or [[data.sources]] tables to blend several")
        if not blend:
            if not str(path):
                raise DataError("data.path is empty and data.sources has no entries: expected a token file")
            blend = [(str(path), 1.0)]
        self.seq_len, self.model_vocab, self.document_mask = seq_len, vocab_size, bool(document_mask)
        self.rows_read = 0          # windows read from the files so far (which ranks read is the engine's choice)
        self._files: list[TokenFile] = []
        try:
            self._open(blend, str(val_path), val_fraction)
        except BaseException:
            self.close()
            raise

    def _file(self, path: str) -> TokenFile:
        tf = TokenFile(path)
        self._files.append(tf)
        return tf

    def _open(self, blend, val_path: str, val_fraction: float) -> None:
        files = [self._file(p) for p, _ in blend]
        first = files[0]
        for tf in files[1:]:
            if _identity(tf) != _identity(first):
                raise DataError(f"data.sources {_describe(first)} and {_describe(tf)} differ: a blend must "
                                "share one tokenizer (vocab_size, eos_id, tokenizer); rebuild them with one")
        vf = self._file(val_path) if val_path else None
        if vf is not None and _identity(vf) != _identity(first):
            raise DataError(f"data.val_path {_describe(vf)} was built with another tokenizer than "
                            f"{_describe(first)}: build both with the same tokenizer")
        self.vocab_size = max(check_vocab(tf, self.model_vocab) for tf in files + ([vf] if vf else []))
        self.eos_id, self.tokenizer, self.tokenizer_sha256 = first.eos_id, first.tokenizer, first.tokenizer_sha256
        self.paths = [str(tf.path) for tf in self._files]
        weights = np.array([w for _, w in blend])
        if vf is None:
            cuts = [val_start(tf, val_fraction) for tf in files]
            train = [Part(tf, 0, c) for tf, c in zip(files, cuts)]
            val = [Part(tf, c, tf.n_tokens) for tf, c in zip(files, cuts)]
            val_weights = weights
        else:
            train, val, val_weights = [Part(tf, 0, tf.n_tokens) for tf in files], [Part(vf, 0, vf.n_tokens)], [1.0]
        hint = "another data.val_fraction" if vf is None else "a larger data.val_path"
        self._splits = {"train": self._checked("train", train, weights, hint),
                        "val": self._checked("val", val, np.asarray(val_weights), hint)}
        for i, tr in enumerate(train):
            log.info("data %s: %d train tokens%s", tr.file.path, tr.n,
                     "" if vf is not None else f" + {val[i].n} val tokens from token {tr.hi} on")
        if vf is not None:
            log.info("data.val_path %s: %d val tokens", vf.path, vf.n_tokens)

    def _checked(self, name: str, parts: list[Part], weights: np.ndarray, hint: str):
        for p in parts:
            if p.n < self.seq_len + 1:
                raise DataError(f"data file '{p.file.path}': split '{name}' has {p.n} tokens, fewer than "
                                f"model.seq_len + 1 = {self.seq_len + 1} (use a larger file, a shorter seq_len "
                                f"or {hint})")
        return parts, np.cumsum(weights) / weights.sum()

    def _split(self, split: str):
        if split not in self._splits:
            raise ValueError(f"split={split!r} is invalid: expected one of {sorted(self._splits)}")
        return self._splits[split]

    def n_tokens(self, split: str) -> int:
        return sum(p.n for p in self._split(split)[0])

    def rows(self, split: str, step: int, seed: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, offset) of every row of the global batch of `step`: which part of the split each row
        reads and where its window starts inside that part. A pure function of (seed, step, split)."""
        parts, cum = self._split(split)
        step, seed, global_batch = map(operator.index, (step, seed, global_batch))
        if step < 0 or global_batch < 1:
            raise ValueError(f"step={step} and global_batch={global_batch} must be >= 0 and >= 1")
        # Hash the tuple into a Philox key: no state carries over between calls, so any step can be
        # drawn in any order and a resumed run sees the same batches. The raw 64-bit outputs are
        # fixed by the Philox algorithm itself (unlike Generator.integers across NumPy versions); the
        # modulo bias is n_windows / 2**64, far below anything measurable.
        entropy = [_SAMPLER_TAG, seed & (2**64 - 1), SPLITS[split], step]
        gen = np.random.Philox(key=np.random.SeedSequence(entropy).generate_state(2, np.uint64))
        raw = gen.random_raw(global_batch)
        src = np.zeros(global_batch, dtype=np.int64)
        if len(parts) > 1:     # the next outputs of the same stream pick the sources: 53-bit uniforms
            u = (gen.random_raw(global_batch) >> np.uint64(11)).astype(np.float64) * 2.0**-53
            src = np.minimum(np.searchsorted(cum, u, side="right"), len(parts) - 1)
        n_windows = np.array([p.n - self.seq_len for p in parts], dtype=np.uint64)  # room for y
        return src, (raw % n_windows[src]).astype(np.int64)

    def offsets(self, split: str, step: int, seed: int, global_batch: int) -> np.ndarray:
        """Start of every row's window inside its source's split (see rows)."""
        return self.rows(split, step, seed, global_batch)[1]

    def batch(self, split: str, step: int, seed: int, global_batch: int, start: int = 0,
              count: int | None = None, tokens: bool = True) -> Batch:
        """Rows [start, start + count) of the global batch of `step`: a Batch of tokens and targets, (count, seq_len)
        int64 each; under document_mask also their segments, positions and loss mask (else those are their
        defaults). tokens=False: only the documents, from the offsets (no token is read)."""
        src, offs = self.rows(split, step, seed, global_batch)
        start = operator.index(start)
        count = global_batch - start if count is None else operator.index(count)
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"start={start}, count={count} select rows outside the global batch of "
                             f"{global_batch}: expected 0 <= start <= start + count <= {global_batch}")
        parts, n = self._split(split)[0], self.seq_len + 1
        src, offs = src[start:start + count], offs[start:start + count]
        docs = self._documents(parts, src, offs) if self.document_mask else {}
        if not tokens:
            return Batch(**docs, shape=(count, self.seq_len))
        windows = np.empty((count, n), dtype=np.int64)
        self.rows_read += count
        for i in range(count):
            p, o = parts[src[i]], int(offs[i])
            windows[i] = p.file.read(p.lo + o, p.lo + o + n)
        # copies whatever the row count (one row of windows would already be contiguous, and a view keeps
        # the whole window buffer alive in the caches that hold the targets)
        return Batch(windows[:, :-1].copy(), windows[:, 1:].copy(), **docs)

    def _documents(self, parts, src, offs) -> dict:
        """segments, positions and loss_mask of the rows (source, offset), by source file."""
        T = self.seq_len
        out = {f: np.empty((len(src), T), dtype=np.int64) for f in ("segments", "positions", "loss_mask")}
        for s in np.unique(src):
            rows = np.flatnonzero(src == s)
            p = parts[s]
            got = window_documents(offsets_of(p.file), p.lo + offs[rows], T)
            for f, a in zip(("segments", "positions", "loss_mask"), got):
                out[f][rows] = a
        return out

    def counted(self, split: str, step: int, seed: int, global_batch: int, ahead: int = 0) -> int:
        """Targets the loss counts in the global batch of `step`: global_batch x seq_len, less (document_mask)
        the predictions across a document boundary. A pure function of (seed, step, split), as the rows are.
        ahead = k > 0: those multi-token prediction's depth k counts (Batch.with_ahead), global_batch x
        (seq_len - k) less (document_mask) those whose target lies in another document."""
        T = self.seq_len
        if not self.document_mask:
            return global_batch * max(0, T - ahead)
        src, offs = self.rows(split, step, seed, global_batch)
        parts = self._split(split)[0]
        count = (lambda o, s: counted_ahead(o, s, T, ahead)) if ahead else (lambda o, s: counted_targets(o, s, T))
        return sum(count(offsets_of(parts[s].file), parts[s].lo + offs[src == s]) for s in np.unique(src))

    def close(self) -> None:
        for tf in self._files:
            tf.close()
        self._files = []

    def __del__(self):      # an engine dropped without close() must not keep its file descriptors
        try:
            self.close()
        except Exception:   # noqa: BLE001 - interpreter shutdown may have torn h5py down already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
