"""Building a token file from text: read documents one at a time, tokenize them in batches, append the
tokens to a raw temporary file, then write the token file (format.py) from it. Memory holds one batch,
the tokenizer and 8 bytes per document, whatever the size of the corpus.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from hpengine.data import inputs, tokenizer as toks
from hpengine.data.format import BYTES, DataError, publish, temp_name, write_token_file
from hpengine.files.bars import bar
from hpengine.files.safe import probe_writable, write_file

log = logging.getLogger("hpengine.data")

_BATCH_DOCS = 1000                  # a batch ends after this many documents ...
_BATCH_CHARS = 2 * 2**20            # ... or this many characters of text
_PIECE_CHARS = 2**16                # a longer document is encoded in pieces cut at line starts
_IN_FLIGHT = 2                      # batches queued per worker process


def build_corpus(paths: Iterable[str | Path], out: str | Path, vocab_size: int | None = None, *,
                 source: str | None = None, tokenizer: str | Path = BYTES, train_tokenizer: bool = False,
                 tokenizer_sample: float | int | str | None = None, tokenizer_out: str | Path | None = None,
                 eos_token: str | None = None, text_field: str = "text", jsonl: bool = False,
                 include: Iterable[str] = (), exclude: Iterable[str] = (), workers: int = 1,
                 progress: bool = False, overwrite: bool = True) -> dict:
    """Tokenizes the documents of `paths` (files, folders, "-" for standard input; inputs.py) into the
    token file `out`. Returns the summary: path, n_docs, n_tokens, n_files, vocab_size, eos_id,
    tokenizer_kind, tokenizer_sha256, tokenizer_path (the saved tokenizer.json when one was trained,
    else None), the skipped_* counts, first_bad_record, text_field and seconds.

    tokenizer          "bytes" (vocab_size None or 256) or the path of a tokenizer.json (vocab_size None)
    train_tokenizer    train a byte-level BPE of vocab_size ids on the documents (or on a sample:
                       tokenizer_sample, a fraction in (0, 1] or a number of documents), save it to
                       tokenizer_out (default: out with the suffix .tokenizer.json) and tokenize with it
    eos_token          the token ending every document, for a tokenizer.json (default: tokenizer.py)
    text_field         the document field of JSON Lines records; jsonl: standard input is JSON Lines
    include, exclude   globs selecting the files found in folders
    source             a short description stored in the file (default: the paths)
    overwrite          replace an existing token file or tokenizer file (False: refuse it, DataError)
    """
    start = time.perf_counter()
    paths, out = [str(p) for p in paths], Path(out)
    sample = _check_args(paths, vocab_size, tokenizer, train_tokenizer, tokenizer_sample, tokenizer_out,
                         eos_token, text_field, workers)
    tok_out = tokenizer_path(out, tokenizer_out) if train_tokenizer else None
    _check_outputs(out, tok_out, overwrite)
    spec = None if train_tokenizer else toks.load(tokenizer, eos_token)
    sources = inputs.find_sources(paths, include=include, exclude=exclude, jsonl_stdin=jsonl,
                                  avoid=[out] + ([tok_out] if tok_out else []))
    if source is None:
        source = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    for path in [out] + ([tok_out] if tok_out else []):   # a read-only folder: one line before any input is read
        with _writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            probe_writable(path.parent, "build")
    temps: list[Path] = []
    try:
        with _writing(out):
            sources, spooled = inputs.spool_stdin(sources, out.parent, f".{out.name}.")
        temps += [spooled] if spooled else []
        tok_tmp = None
        if train_tokenizer:
            spec = _train(sources, paths, vocab_size, sample, text_field, progress)
            tok_tmp = temp_name(tok_out)
            with _writing(tok_out):
                write_file(tok_tmp, spec.text, overwrite=False)
            temps.append(tok_tmp)            # only once it is ours: whatever held the name before stays
        counts = inputs.Counts()
        with _writing(out):
            raw = _temp_file(out, ".raw", temps)
        lengths = _encode_all(sources, counts, spec, text_field, raw, workers, progress, out)
        if lengths.size == 0:
            raise _empty(paths, counts, text_field)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        attrs = {**spec.attrs(), **counts.attrs(), "source": source[:200]}
        with _writing(out):
            write_token_file(out, raw, spec.dtype, offsets, attrs, overwrite=overwrite)
        if tok_tmp is not None:
            with _writing(tok_out):
                publish(tok_tmp, tok_out, overwrite, "the trained tokenizer's file")
    finally:
        for t in temps:
            t.unlink(missing_ok=True)
    info = {"path": str(out), "n_docs": int(lengths.size), "n_tokens": int(offsets[-1]),
            "vocab_size": spec.vocab_size, "eos_id": spec.eos_id, "tokenizer_kind": spec.kind,
            "tokenizer_sha256": spec.sha256, "tokenizer_path": str(tok_out) if tok_out else None,
            **counts.attrs(), "first_bad_record": counts.first_bad_record, "text_field": text_field,
            "seconds": time.perf_counter() - start}
    log.info("%s", summary_line(info))
    return info


def _check_args(paths, vocab_size, tokenizer, train, sample, tokenizer_out, eos_token, text_field, workers):
    """One DataError line for any inconsistent setting; returns the validated tokenizer sample."""
    if not paths:
        raise DataError("no corpus sources given: expected files, folders, or '-' for standard input")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DataError(f"--workers {workers} is invalid: expected an integer >= 1")
    if not isinstance(text_field, str) or not text_field:
        raise DataError(f"--text-field {text_field!r} is invalid: expected the name of a JSON field")
    if train:
        if str(tokenizer) != BYTES:
            raise DataError(f"--train-tokenizer and --tokenizer {tokenizer} exclude each other: train a new "
                            "tokenizer or use an existing one")
        if eos_token is not None:
            raise DataError(f"--eos-token {eos_token!r} does not apply to --train-tokenizer: the trained "
                            f"tokenizer's eos is {toks.TRAINED_EOS}")
        if vocab_size is None:
            raise DataError("--train-tokenizer needs --vocab-size N: the number of ids of the new tokenizer")
        toks.check_bpe_vocab(vocab_size)
        return toks.check_sample(sample)
    for flag, value in (("--tokenizer-sample", sample), ("--tokenizer-out", tokenizer_out)):
        if value is not None:
            raise DataError(f"{flag} {value} only applies with --train-tokenizer")
    if vocab_size is not None and (str(tokenizer) != BYTES or vocab_size != 256):
        raise DataError(f"--vocab-size {vocab_size} only applies with --train-tokenizer: the tokenizer "
                        f"{tokenizer!s} has its own vocabulary (bytes: 256 ids)")
    return None


def tokenizer_path(out: str | Path, tokenizer_out: str | Path | None) -> Path:
    """Where a trained tokenizer.json goes: tokenizer_out, else out with the suffix .tokenizer.json."""
    return Path(tokenizer_out or Path(out).with_suffix(".tokenizer.json"))


# Every output first lives under a temporary name in its own folder, created exclusively (never through a
# link); the token file and a trained tokenizer.json appear only when the build succeeds, and no temporary
# file outlives the build, whatever stops it (an error, Ctrl-C). With overwrite=False (the command line
# without --force) an existing output is refused before anything is read.
def _check_outputs(out: Path, tok_out: Path | None, overwrite: bool) -> None:
    """One DataError line for an output that must not be written: a folder, the same file twice, or (without
    overwrite) a file that exists already."""
    if out.is_dir():
        raise DataError(f"--out {out}: is a folder; name the .h5 file to write, e.g. --out {out / 'tokens.h5'}")
    if os.path.lexists(out) and not overwrite:
        raise DataError(f"--out '{out}' already exists (pass --force to replace it)")
    if tok_out is None:
        return
    if tok_out.is_dir():
        raise DataError(f"--tokenizer-out {tok_out}: is a folder; name the .json file to write, e.g. "
                        f"--tokenizer-out {tok_out / 'tokenizer.json'}")
    if os.path.abspath(tok_out) == os.path.abspath(out):
        raise DataError(f"--tokenizer-out {tok_out} is the --out file: give the tokenizer its own file, e.g. "
                        f"--tokenizer-out {out.with_suffix('.tokenizer.json')}")
    if os.path.lexists(tok_out) and not overwrite:
        raise DataError(f"the trained tokenizer's file '{tok_out}' already exists (pass --force to replace it, "
                        "or --tokenizer-out PATH to save it elsewhere)")


@contextlib.contextmanager
def _writing(path: Path):
    """An OSError while writing the output `path` (or a temporary file beside it) as one DataError line."""
    try:
        yield
    except OSError as exc:
        raise DataError(f"data build: cannot write '{path}': {exc.strerror or exc}") from None


def _temp_file(beside: Path, suffix: str, temps: list[Path]) -> Path:
    """A new empty file named after `beside`, in its folder (renames stay on one file system)."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=suffix)
    os.close(fd)
    temps.append(Path(tmp))
    return Path(tmp)


def _bar(progress: bool, total: int, desc: str):
    return bar(total, desc, unit="B", show=progress, scale=True)


class _Counted:
    """Passes documents through, counting them and moving a progress bar."""

    def __init__(self, docs: Iterator[str], counts: inputs.Counts, bar):
        self.docs, self.counts, self.bar, self.n = docs, counts, bar, 0

    def __iter__(self):
        for d in self.docs:
            self.n += 1
            if self.n % 1000 == 0:
                self.bar.update(self.counts.bytes_done - self.bar.n)
            yield d


def _train(sources, paths, vocab_size, sample, text_field, progress) -> toks.TokenizerSpec:
    counts = inputs.Counts()
    with _bar(progress, sum(s.size for s in sources), "reading for the tokenizer") as bar:
        docs = _Counted(inputs.documents(sources, counts, text_field), counts, bar)
        spec = toks.train_bpe(toks.sample(docs, sample), vocab_size, progress)
    if docs.n == 0:
        raise _empty(paths, counts, text_field)
    return spec


def _batches(docs: Iterable[str], cut: bool) -> Iterator[tuple[list[str], list[bool]]]:
    """(texts, ends) of about _BATCH_CHARS characters or _BATCH_DOCS documents: a document longer
    than _PIECE_CHARS is cut into pieces at line starts (when `cut`), which may fall in several
    batches; ends[i] says whether texts[i] ends its document."""
    texts, ends, size = [], [], 0
    for doc in docs:
        pieces = toks.cut_at_lines(doc, _PIECE_CHARS) if cut and len(doc) > _PIECE_CHARS else [doc]
        for i, piece in enumerate(pieces, 1):
            texts.append(piece)
            ends.append(i == len(pieces))
            size += len(piece)
            if len(texts) >= _BATCH_DOCS or size >= _BATCH_CHARS:
                yield texts, ends
                texts, ends, size = [], [], 0
    if texts:
        yield texts, ends


def _encoded(batches: Iterator[tuple[list[str], list[bool]]], spec: toks.TokenizerSpec, workers: int):
    """(tokens, lengths, ends) of each batch, in order."""
    if workers == 1 or spec.text == BYTES:
        encoder = toks.Encoder(spec)
        for texts, ends in batches:
            yield *encoder.encode(texts, ends), ends
        return
    with multiprocessing.get_context("spawn").Pool(workers, toks.init_worker, (spec,)) as pool:
        pending = collections.deque()
        for texts, ends in batches:
            pending.append((pool.apply_async(toks.encode_in_worker, (texts, ends)), ends))
            if len(pending) >= _IN_FLIGHT * workers:
                result, ends = pending.popleft()
                yield *result.get(), ends
        while pending:
            result, ends = pending.popleft()
            yield *result.get(), ends


# With workers > 1 the batches are encoded by that many processes ('spawn': safe whatever the parent
# has loaded, MPI included), each building the tokenizer once; results are taken in submission order,
# so the file is the same for any number of workers. The bytes tokenizer always encodes in-process.
def _encode_all(sources, counts, spec, text_field, raw: Path, workers: int, progress: bool,
                out: Path | None = None) -> np.ndarray:
    """Appends the tokens of every document to `raw` (the temporary file of the token file `out`); returns
    the document lengths (eos included)."""
    lengths, n_docs, n_tokens, t0 = [], 0, 0, time.perf_counter()
    carry = 0                                   # tokens of a document whose pieces are not all encoded
    docs = inputs.documents(sources, counts, text_field)
    with _writing(out or raw):                  # mkstemp made raw; reopening it never follows a link
        f = open(raw, "wb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW))
    with f, _bar(progress, sum(s.size for s in sources), "tokenizing") as bar, \
            contextlib.closing(_encoded(_batches(docs, spec.line_cuts), spec, workers)) as encoded:
        for tokens, lens, ends in encoded:
            with _writing(out or raw):
                f.write(memoryview(np.ascontiguousarray(tokens, dtype=spec.dtype)))
            total = np.cumsum(lens)                 # tokens up to the end of each text
            at_ends = total[np.asarray(ends, dtype=bool)]
            if at_ends.size:
                doc_lens = np.diff(at_ends, prepend=0)
                doc_lens[0] += carry
                lengths.append(doc_lens)
                carry, n_docs = int(total[-1] - at_ends[-1]), n_docs + at_ends.size
            else:
                carry += int(total[-1])
            n_tokens += tokens.size
            bar.update(counts.bytes_done - bar.n)
            rate = n_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{n_docs:,} docs, {rate:,.0f} tokens/s", refresh=False)
        bar.update(counts.bytes_done - bar.n)
        with _writing(out or raw):
            f.flush()
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def _skipped(c: dict, text_field: str) -> list[str]:
    parts = [f"{c[k]:,} {what}" for k, what in (("skipped_binary", "binary"),
                                                  ("skipped_undecodable", "undecodable"),
                                                  ("skipped_unreadable", "unreadable"),
                                                  ("skipped_empty", "empty")) if c[k]]
    if c["skipped_records"]:
        first = f" (first: {c['first_bad_record']})" if c.get("first_bad_record") else ""
        n = c["skipped_records"]
        parts.append(f'{n:,} record{"" if n == 1 else "s"} without "{text_field}"{first}')
    return parts


def _empty(paths, counts: inputs.Counts, text_field: str) -> DataError:
    c = {**counts.attrs(), "first_bad_record": counts.first_bad_record}
    skipped = _skipped(c, text_field)
    return DataError(f"no documents to build from {', '.join(paths)}: {_files(counts.n_files)} read"
                     + (f", skipped {', '.join(skipped)}" if skipped else "")
                     + f"; expected non-empty UTF-8 text files or JSON Lines records with a string field "
                     f'"{text_field}"')


def _files(n: int) -> str:
    return f"{n:,} file" + ("" if n == 1 else "s")


def summary_line(info: dict) -> str:
    """One line about a build: what was written, from what, what was skipped, how long it took."""
    docs = f"{info['n_docs']:,} document" + ("" if info["n_docs"] == 1 else "s")
    line = (f"wrote {info['path']}: {info['n_tokens']:,} tokens in {docs} (vocab {info['vocab_size']}, "
            f"eos {info['eos_id']}, tokenizer {info['tokenizer_kind']} sha256 {info['tokenizer_sha256'][:8]}...) "
            f"from {_files(info['n_files'])}")
    skipped = _skipped(info, info.get("text_field", "text"))
    if skipped:
        line += "; skipped " + ", ".join(skipped)
    if info.get("tokenizer_path"):
        line += f"; tokenizer saved to {info['tokenizer_path']}"
    return line + f" in {info['seconds']:.1f} s"
