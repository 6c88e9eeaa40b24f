"""The built-in corpus: the Python standard library's own sources, byte-tokenized once and cached.
Owns the choice of files (no tests, no site-packages, up to a byte budget) and the cache file's path."""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from hpengine.data.build import build_corpus
from hpengine.data.format import DataError
from hpengine.data.inputs import SKIP_DIRS, walk

DEFAULT_MAX_BYTES = 16 * 2**20
_STDLIB_SKIP_DIRS = SKIP_DIRS | {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def default_corpus_path() -> Path:
    """Cache file of the built-in corpus: $HPENGINE_CACHE or ~/.cache/hpengine, per Python version and
    token-file version (a cache in an older format is rebuilt under the new name, never misread)."""
    root = os.environ.get("HPENGINE_CACHE") or Path.home() / ".cache" / "hpengine"
    return Path(root) / f"stdlib-{sys.version_info.major}.{sys.version_info.minor}.v2.h5"


def stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's own *.py files (no tests, no site-packages), in walk order, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in walk(root, include=["*.py"], skip_dirs=_STDLIB_SKIP_DIRS):
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size + 1          # + the eos after each document
    return chosen


def stdlib_source() -> str:
    return f"python {sys.version_info.major}.{sys.version_info.minor} stdlib *.py"


def ensure_default_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Builds the built-in corpus unless it is cached; returns its path.

    `max_bytes` only applies when building: an existing cache file is reused as it is.
    """
    path = default_corpus_path()
    if path.is_file():
        return path
    files = stdlib_files(max_bytes)
    if not files:
        raise DataError(f"no standard-library sources under '{sysconfig.get_paths()['stdlib']}': "
                        "set data.path to an HDF5 token file instead")
    build_corpus(files, path, source=stdlib_source())
    return path
