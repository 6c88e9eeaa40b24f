"""Shared fixtures: a private corpus cache (tests never touch ~/.cache), a clean `hpengine` logger
per test, and a small deterministic token file for training tests."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_corpus_cache():
    """Point HPENGINE_CACHE at a fresh, not yet created folder for the whole session (restored and
    removed afterwards). Nothing is created unless a test builds the built-in corpus, so a process
    killed mid-session (an MPI abort) leaves nothing behind; under mpiexec every rank gets its own."""
    path = os.path.join(tempfile.gettempdir(), f"hpengine-test-cache-{uuid.uuid4().hex}")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HPENGINE_CACHE", path)
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def restore_hpengine_logger():
    """train.setup_logging binds a handler to the sys.stdout of the moment (capsys's, say); put the
    logger back afterwards so a later test never logs into a closed capture stream."""
    logger = logging.getLogger("hpengine")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


_WORDS = ("the rank sends a buffer to its neighbour and waits for the reply while the gradient of each "
          "layer flows back through the pipeline and every shard of the optimizer state is updated by "
          "its owner before the parameters are shared again across the mesh").split()


def corpus_text(n_sentences: int = 400, seed: int = 0) -> bytes:
    """Deterministic, quickly learnable ASCII text: lower-case sentences from a few dozen words."""
    import numpy as np
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_sentences):
        words = [_WORDS[j] for j in rng.integers(0, len(_WORDS), size=int(rng.integers(4, 12)))]
        lines.append(" ".join(words) + ".")
    return ("\n".join(lines) + "\n").encode("ascii")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """Path of an HDF5 token file (vocab 256, ~24k tokens, three documents) built with
    hpengine.data.build_corpus: a split by documents keeps whole documents on each side."""
    from hpengine.data import build_corpus
    root = tmp_path_factory.mktemp("corpus")
    src = root / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(corpus_text(300, seed=0))
    (src / "b.md").write_bytes(corpus_text(200, seed=1))
    (src / "c.txt").write_bytes(corpus_text(100, seed=2))
    out = root / "small.h5"
    build_corpus([src], out, 256)
    return out
