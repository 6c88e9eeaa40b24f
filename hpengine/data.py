"""Token data: HDF5 token files, the built-in corpus, and the deterministic global-batch sampler.

A global batch is a pure function of (seed, step, split); ranks only take row slices of it, which is
what lets every parallel layout see exactly the batches of the one-process run. No MPI here: the
engine decides which rank builds a corpus and everyone reads it.
"""
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

log = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({
    ".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".toml", ".json",
    ".cfg", ".ini", ".yaml", ".yml", ".html", ".htm", ".xml", ".css", ".js", ".tex", ".csv", ".sh",
})
SEPARATOR = b"\n\n"
SPLITS = {"train": 0, "val": 1}
# Domain tag mixed into the sampler key so batch draws never share a stream with parameter init,
# which is also keyed on the run seed.
_SAMPLER_TAG = 0x64617461  # "data"
_FLUSH_BYTES = 4 * 2**20
_CHUNK = 2**20
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                               "__pycache__"})


class DataError(Exception):
    """A data file or data setting is unusable; the message names the file/key and what is expected."""


# ----------------------------------------------------------------------------- building

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


def _token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size} is invalid: expected a positive integer")
    # Tokens are bytes, but the file records the model's id width so it can be extended later.
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 2**16
                    else np.uint32)


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
    dtype = _token_dtype(vocab_size)
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
        _make_durable(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("built corpus %s: %d files, %d tokens", out, n_files, n_tokens)
    return {"n_files": n_files, "n_tokens": n_tokens, "path": str(out)}


def _make_durable(tmp: str) -> None:
    # mkstemp creates 0600; a shared cache must be readable like any normally created file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # the rename must not become visible before the data is on disk


# ----------------------------------------------------------------------------- built-in corpus

def default_corpus_path() -> Path:
    """Cache file of the built-in corpus: $HPENGINE_CACHE or ~/.cache/hpengine, per Python version."""
    root = os.environ.get("HPENGINE_CACHE") or Path.home() / ".cache" / "hpengine"
    return Path(root) / f"stdlib-{sys.version_info.major}.{sys.version_info.minor}.h5"


def _stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's own *.py files (no tests, no site-packages), sorted, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in _folder_files(root, {".py"}, _STDLIB_SKIP_DIRS):
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size + len(SEPARATOR)
    return chosen


def ensure_default_corpus(max_bytes: int = 16 * 2**20) -> Path:
    """Builds the built-in corpus unless it is cached; returns its path.

    `max_bytes` only applies when building: an existing cache file is reused as it is.
    """
    path = default_corpus_path()
    if path.is_file():
        return path
    files = _stdlib_files(max_bytes)
    if not files:
        raise DataError(f"no standard-library sources under '{sysconfig.get_paths()['stdlib']}': "
                        "set data.path to an HDF5 token file instead")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    build_corpus(files, path, vocab_size=256, source=f"python {version} stdlib *.py")
    return path


# ----------------------------------------------------------------------------- dataset + sampler

def _read_tokens(path: Path, vocab_size: int) -> np.ndarray:
    """Loads and checks the file's "tokens" dataset; every failure is a one-line DataError."""
    if not path.is_file() or not os.access(path, os.R_OK):
        why = "no such file" if not path.exists() else "not a readable file"
        raise DataError(f"data file '{path}' not found/unreadable: {why} (set data.path, "
                        "or leave it empty for the built-in corpus)")
    if not h5py.is_hdf5(path):
        raise DataError(f"data file '{path}' is not an HDF5 file: expected one written by "
                        "`hpengine data build`")
    try:
        with h5py.File(path, "r") as h5:
            if not isinstance(h5.get("tokens"), h5py.Dataset):
                names = []
                h5.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
                raise DataError(f"data file '{path}' has no dataset 'tokens' (it has: "
                                f"{', '.join(names) or 'no datasets'})")
            ds = h5["tokens"]
            if ds.ndim != 1 or ds.dtype.kind != "u":
                raise DataError(f"data file '{path}': dataset 'tokens' is {ds.dtype} of shape "
                                f"{ds.shape}; expected 1-D unsigned integers")
            file_vocab = ds.file.attrs.get("vocab_size")
            tokens = ds[()]
    except (OSError, RuntimeError) as e:  # h5py's errors for truncated or corrupt files
        raise DataError(f"data file '{path}' not found/unreadable: {e}") from e
    if file_vocab is not None and int(file_vocab) > vocab_size:
        raise DataError(f"data file '{path}' was built for vocab_size={int(file_vocab)} > "
                        f"model.vocab_size={vocab_size}")
    top = int(tokens.max()) if tokens.size else -1
    if top >= vocab_size:
        raise DataError(f"data file '{path}' holds token id {top} >= model.vocab_size={vocab_size}")
    return tokens


class TokenDataset:
    """A token file held in memory: "train" is the first 1 - val_fraction of it, "val" the rest."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int, val_fraction: float):
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} is invalid: expected 0 < value < 1")
        if seq_len < 1 or vocab_size < 1:
            raise DataError(f"model.seq_len={seq_len} and model.vocab_size={vocab_size} "
                            "must both be positive")
        self.path, self.seq_len, self.vocab_size = Path(path), seq_len, vocab_size
        self.tokens = _read_tokens(self.path, vocab_size)
        n_train = int(len(self.tokens) * (1.0 - val_fraction))
        self._splits = {"train": self.tokens[:n_train], "val": self.tokens[n_train:]}
        for name, toks in self._splits.items():
            if len(toks) < seq_len + 1:
                raise DataError(f"data file '{self.path}': split '{name}' has {len(toks)} tokens, "
                                f"fewer than model.seq_len + 1 = {seq_len + 1} (use a larger file, "
                                "a shorter seq_len or another data.val_fraction)")
        log.info("loaded %s: %d train + %d val tokens", self.path, n_train,
                 len(self.tokens) - n_train)

    def _split(self, split: str) -> np.ndarray:
        if split not in self._splits:
            raise ValueError(f"split={split!r} is invalid: expected one of {sorted(self._splits)}")
        return self._splits[split]

    def n_tokens(self, split: str) -> int:
        return len(self._split(split))

    def offsets(self, split: str, step: int, seed: int, global_batch: int) -> np.ndarray:
        """Start positions of the global batch of `step`: a pure function of (seed, step, split)."""
        toks = self._split(split)
        step, seed, global_batch = map(operator.index, (step, seed, global_batch))
        if step < 0 or global_batch < 1:
            raise ValueError(f"step={step} and global_batch={global_batch} must be >= 0 and >= 1")
        # Hash the tuple into a Philox key: no state carries over between calls, so any step can be
        # drawn in any order and a resumed run sees the same batches. The raw 64-bit outputs are
        # fixed by the Philox algorithm itself (unlike Generator.integers across NumPy versions); the
        # modulo bias is n_windows / 2**64, far below anything measurable.
        entropy = [_SAMPLER_TAG, seed & (2**64 - 1), SPLITS[split], step]
        key = np.random.SeedSequence(entropy).generate_state(2, np.uint64)
        raw = np.random.Philox(key=key).random_raw(global_batch)
        n_windows = len(toks) - self.seq_len  # offsets 0 .. n - seq_len - 1 leave room for y
        return (raw % np.uint64(n_windows)).astype(np.int64)

    def batch(self, split: str, step: int, seed: int, global_batch: int, start: int = 0,
              count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, start + count) of the global batch of `step`: x, y of (count, seq_len) int64."""
        offs = self.offsets(split, step, seed, global_batch)
        start = operator.index(start)
        count = global_batch - start if count is None else operator.index(count)
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"start={start}, count={count} select rows outside the global batch of "
                             f"{global_batch}: expected 0 <= start <= start + count <= {global_batch}")
        offs = offs[start:start + count]
        windows = self._split(split)[offs[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
