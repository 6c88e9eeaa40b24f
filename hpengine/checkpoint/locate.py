"""Finding the checkpoint a command names: a run folder (its checkpoints/latest), a checkpoints folder or a
step folder; the message says how to make one when there is none."""
from __future__ import annotations

from pathlib import Path

from hpengine.checkpoint import shards as checkpoint

_HINT = ("save one by training with checkpoint.at_end = true (the default: a checkpoint after the last "
         "step) or checkpoint.every = N")


def find_checkpoint(path) -> checkpoint.Reader:
    """A Reader of CHECKPOINT: a run folder (its checkpoints/latest), a checkpoints folder or a step folder."""
    p = Path(path)
    if (p / "checkpoints").is_dir() and not (p / "manifest.json").exists() and not (p / "latest").exists():
        p = p / "checkpoints"
    try:
        return checkpoint.Reader(p)
    except checkpoint.CheckpointError as exc:
        raise checkpoint.CheckpointError(f"no usable checkpoint at '{path}': {exc}; {_HINT}") from None
