"""Reading token files for training: the splits and the deterministic global-batch sampler.

A global batch is a pure function of (seed, step, split); ranks only take row slices of it, which is
what lets every parallel layout see exactly the batches of the one-process run. No MPI here.
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

from .format import DataError, make_durable, token_dtype

log = logging.getLogger("hpengine.data")

SPLITS = {"train": 0, "val": 1}
# Domain tag mixed into the sampler key so batch draws never share a stream with parameter init,
# which is also keyed on the run seed.
_SAMPLER_TAG = 0x64617461  # "data"


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
