"""The token file: the HDF5 file `hpengine data build` writes and training reads (version 2; version 1
read as one document without a tokenizer). Owns writing and publishing it and TokenFile, the reader.
No MPI here; reading never loads the token array: windows are read where they lie.
"""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
from pathlib import Path

import h5py
import numpy as np

from hpengine.files.safe import fsync_folder, open_regular

FORMAT, VERSION = "hpengine-tokens", 2
BYTES = "bytes"          # the tokenizer attribute of a byte-level file
_COPY_BLOCK = 64 * 2**20
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


class DataError(Exception):
    """A data file or data setting is unusable; the message names the file/key and what is expected."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of a vocabulary."""
    if vocab_size < 1:
        raise DataError(f"vocab_size = {vocab_size} is invalid: expected a positive integer")
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16 else np.uint32)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# Version 2 (what this hpengine writes):
#
#   tokens        1-D uint8 (vocab_size <= 256), uint16 (<= 65,536) or uint32; contiguous layout (no
#                 chunks, no compression), so a reader takes any window with one pread
#   doc_offsets   1-D int64 of n_docs + 1 entries, 0 first and n_tokens last: document d is
#                 tokens[doc_offsets[d]:doc_offsets[d + 1]] and ends with eos_id when there is one
#   attributes    format = "hpengine-tokens", version = 2, vocab_size, eos_id (-1 = none),
#                 tokenizer ("bytes", or the text of a Hugging Face tokenizer.json), tokenizer_sha256
#                 (of that text, UTF-8), n_docs, n_tokens, source, and the build's counts (n_files,
#                 skipped_binary, skipped_undecodable, skipped_records)
def write_token_file(out: str | Path, raw: str | Path, dtype, doc_offsets: np.ndarray, attrs: dict,
                     overwrite: bool = True) -> Path:
    """Write `out` from `raw` (a flat binary file of tokens of `dtype`) and the document offsets:
    contiguous "tokens" copied over in blocks (memory does not grow with the corpus), "doc_offsets",
    the version-2 attributes plus `attrs`. Written under a fresh temporary name in out's folder, created
    exclusively (never through a link), and renamed at the end: a reader sees no file or the whole file,
    and a failure leaves nothing under `out`. overwrite=False refuses an existing `out` (DataError)."""
    out, dtype = Path(out), np.dtype(dtype)
    n = os.path.getsize(raw) // dtype.itemsize
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    if n == 0 or doc_offsets[0] != 0 or doc_offsets[-1] != n or np.any(np.diff(doc_offsets) <= 0):
        raise ValueError(f"doc_offsets must rise strictly from 0 to the {n} tokens of {raw}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out)
    created = False
    try:
        with open_regular(raw, "token data") as src:
            h5 = h5py.File(tmp, "x")        # O_CREAT | O_EXCL: fails on anything already there, a link included
            created = True
            with h5:
                ds = h5.create_dataset("tokens", shape=(n,), dtype=dtype)         # contiguous
                step = max(1, _COPY_BLOCK // dtype.itemsize)
                for start in range(0, n, step):
                    block = np.frombuffer(src.read(min(step, n - start) * dtype.itemsize), dtype=dtype)
                    ds[start:start + block.size] = block
                h5.create_dataset("doc_offsets", data=doc_offsets)
                h5.attrs.update({"format": FORMAT, "version": VERSION, "n_tokens": n,
                                 "n_docs": len(doc_offsets) - 1, **attrs})
        with open_regular(tmp, "token file") as f:
            os.fsync(f.fileno())
        publish(tmp, out, overwrite, "--out")
    except BaseException:
        if created:
            Path(tmp).unlink(missing_ok=True)
        raise
    return out


def temp_name(beside: Path) -> Path:
    """A fresh name for a temporary file beside `beside` (hidden, never one that exists)."""
    return beside.with_name(f".{beside.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def publish(tmp: Path, out: Path, overwrite: bool, what: str) -> None:
    """Rename the finished temporary file tmp onto out (a link at out is replaced, never followed).
    overwrite=False refuses an existing out, atomically where the file system has hard links."""
    if overwrite:
        os.replace(tmp, out)
    else:
        try:
            os.link(tmp, out, follow_symlinks=False)      # fails when out exists: nothing is ever clobbered
        except FileExistsError:
            raise DataError(f"{what} '{out}' already exists (pass --force to replace it)") from None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            if os.path.lexists(out):
                raise DataError(f"{what} '{out}' already exists (pass --force to replace it)") from None
            os.replace(tmp, out)
        else:
            os.unlink(tmp)
    fsync_folder(out.parent)


# Version 1 (older hpengine, or any tool): a 1-D unsigned "tokens" dataset in any layout and at most a
# vocab_size attribute. It reads as one document without a tokenizer.
class TokenFile:
    """A token file opened for reading: its metadata, document offsets and windows read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file() or not os.access(self.path, os.R_OK):
            why = "no such file" if not self.path.exists() else "not a readable file"
            raise DataError(f"data file '{self.path}' not found/unreadable: {why} (set data.path, or leave it "
                            "empty for the built-in corpus)")
        if not h5py.is_hdf5(self.path):
            raise DataError(f"data file '{self.path}' is not an HDF5 file: expected one written by "
                            "`hpengine data build` (format: docs/data.md, 'Token files')")
        try:
            self._h5 = h5py.File(self.path, "r")
            self._open()
        except (OSError, RuntimeError, KeyError) as e:        # h5py's errors for truncated or corrupt files
            raise DataError(f"data file '{self.path}' not found/unreadable: {e}") from e

    def _open(self) -> None:
        h5 = self._h5
        ds = h5.get("tokens")
        if not isinstance(ds, h5py.Dataset):
            names = []
            h5.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            raise DataError(f"data file '{self.path}' has no dataset 'tokens' (it has: "
                            f"{', '.join(names) or 'no datasets'})")
        if ds.ndim != 1 or ds.dtype.kind != "u":
            raise DataError(f"data file '{self.path}': dataset 'tokens' is {ds.dtype} of shape {ds.shape}; "
                            "expected 1-D unsigned integers")
        a = h5.attrs
        self.version = int(a.get("version", 1)) if a.get("format") == FORMAT else 1
        self.dtype, self.n_tokens = ds.dtype, int(ds.shape[0])
        self.vocab_size = int(a["vocab_size"]) if "vocab_size" in a else None
        self.eos_id = int(a.get("eos_id", -1))
        self.tokenizer = str(a["tokenizer"]) if "tokenizer" in a else None
        self.tokenizer_sha256 = str(a["tokenizer_sha256"]) if "tokenizer_sha256" in a else None
        self.attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in a.items() if k != "tokenizer"}
        self._offsets, self._offsets_ds = None, None
        if self.version >= 2:         # its ends checked now, the whole array read when first asked for
            d = h5["doc_offsets"]
            if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.shape[0] < 1:
                raise DataError(f"data file '{self.path}': doc_offsets is {getattr(d, 'shape', 'not a dataset')}; "
                                "expected 1-D int64 of n_docs + 1 entries")
            first, last = int(d[0]), int(d[-1])
            if first != 0 or last != self.n_tokens:
                raise DataError(f"data file '{self.path}': doc_offsets run from {first} to {last}, expected 0 "
                                f"to the {self.n_tokens} tokens")
            self._offsets_ds = d
        # a contiguous, unfiltered dataset is read with pread at its byte offset; anything else through h5py
        offset = ds.id.get_offset() if ds.chunks is None and not ds.compression else None
        self._ds, self._offset, self._fd = ds, offset, None
        if offset is not None:
            self._fd = os.open(self.path, os.O_RDONLY)

    @property
    def doc_offsets(self) -> np.ndarray | None:
        """int64 document offsets (n_docs + 1), read on first use (a large file's info needs none); None
        for a version 1 file."""
        if self._offsets is None and self._offsets_ds is not None:
            self._offsets = np.asarray(self._offsets_ds[()], dtype=np.int64)
        return self._offsets

    @property
    def n_docs(self) -> int:
        return 1 if self._offsets_ds is None else self._offsets_ds.shape[0] - 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] as a new array of the file's dtype."""
        if self._fd is None:
            return self._ds[start:stop]
        item = self.dtype.itemsize
        buf = os.pread(self._fd, (stop - start) * item, self._offset + start * item)
        return np.frombuffer(buf, dtype=self.dtype)

    def windows(self, starts, length: int) -> np.ndarray:
        """(len(starts), length) int64: the windows tokens[s:s + length]."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(starts):
            out[i] = self.read(int(s), int(s) + length)
        return out

    def max_token(self, block: int = 2**24) -> int:
        """The largest id in the file, read in blocks (memory does not grow with the file)."""
        top = -1
        for start in range(0, self.n_tokens, block):
            top = max(top, int(self.read(start, min(self.n_tokens, start + block)).max()))
        return top

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._h5.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
