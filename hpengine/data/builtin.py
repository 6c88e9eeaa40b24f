"""The built-in corpus: the Python standard library's own sources, built once and cached."""
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

from .build import SEPARATOR, _folder_files, build_corpus

_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                               "__pycache__"})


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


