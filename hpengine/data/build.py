"""Building token files from text: inputs, tokenization, the streaming write."""
from __future__ import annotations

import logging
import operator
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import h5py
import numpy as np

from .format import DataError, make_durable, token_dtype

log = logging.getLogger("hpengine.data")

TEXT_SUFFIXES = frozenset({
    ".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".toml", ".json",
    ".cfg", ".ini", ".yaml", ".yml", ".html", ".htm", ".xml", ".css", ".js", ".tex", ".csv", ".sh",
})
SEPARATOR = b"\n\n"
_FLUSH_BYTES = 4 * 2**20
_CHUNK = 2**20




def _folder_files(folder: Path, suffixes=TEXT_SUFFIXES,
                  skip_dirs=frozenset({"__pycache__"})) -> list[Path]:
    """Files below `folder` with one of `suffixes`, sorted by relative path; hidden folders skipped."""
    found = []
    # os.walk without followlinks cannot loop on symlinked folders; pruning `dirs` skips whole trees.
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
        found += [Path(root, f) for f in files if Path(f).suffix.lower() in suffixes]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _expand(paths: list[str | Path]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += _folder_files(p)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"corpus source '{p}' not found: expected an existing text file or folder")
    return files


def _read_text(path: Path) -> bytes | None:
    """The file's bytes, or None for a file to skip (unreadable, empty, or binary)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        log.warning("skipping unreadable file %s: %s", path, e)
        return None
    if b"\0" in data:
        log.info("skipping binary file %s (contains NUL bytes)", path)
        return None
    return data or None


class _Appender:
    """Appends bytes to a resizable dataset in large writes, so each compressed chunk is written once."""

    def __init__(self, ds: h5py.Dataset):
        self.ds, self.parts, self.pending, self.n = ds, [], 0, 0

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.pending += len(data)
        if self.pending >= _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        block = np.frombuffer(b"".join(self.parts), dtype=np.uint8)
        self.ds.resize((self.n + block.size,))
        self.ds[self.n:] = block
        self.n += block.size
        self.parts, self.pending = [], 0


def _write_tokens(h5: h5py.File, files: list[Path], dtype: np.dtype, vocab_size: int) -> int:
    """Writes the joined files into h5["tokens"]; returns how many files were used."""
    ds = h5.create_dataset("tokens", shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,),
                           compression="gzip", compression_opts=1)
    out, n_files = _Appender(ds), 0
    for path in files:
        data = _read_text(path)
        if data is None:
            continue
        top = max(data)
        if top >= vocab_size:
            raise DataError(f"file '{path}' has byte value {top} >= vocab_size={vocab_size}: "
                            f"byte-level tokens need vocab_size >= {top + 1}")
        if n_files:
            out.add(SEPARATOR)
        out.add(data)
        n_files += 1
    out.flush()
    return n_files


def build_corpus(paths: list[str | Path], out: str | Path, vocab_size: int = 256, *,
                 source: str | None = None) -> dict:
    """Writes text files and folders as byte tokens to the HDF5 file `out`, atomically.

    Returns {"n_files", "n_tokens", "path"}. `source` is a short description stored as an attribute.
    """
    dtype = token_dtype(vocab_size)
    files = _expand(paths)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        names = ", ".join(str(p) for p in paths[:3])
        source = names + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    # Temp file in the same folder: os.replace is atomic only within one file system, and a
    # concurrent reader then sees either no file or the whole file, never a half-written one.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as h5:
            n_files = _write_tokens(h5, files, dtype, vocab_size)
            if n_files == 0:
                raise DataError(f"no readable text files found in {[str(p) for p in paths]}: "
                                f"expected text files or folders holding {sorted(TEXT_SUFFIXES)}")
            n_tokens = h5["tokens"].shape[0]
            h5.attrs.update(vocab_size=vocab_size, n_files=n_files, source=source[:200])
        make_durable(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("built corpus %s: %d files, %d tokens", out, n_files, n_tokens)
    return {"n_files": n_files, "n_tokens": n_tokens, "path": str(out)}
