"""Checkpoints: the shard format and manifest, read (shards.py), written and published (write.py), written in
the background (background.py), what keeps a bad folder or a failing file system to one line (guard.py), exports for other tools (export.py), starting from a Hugging Face folder
(hf_import.py) and finding a checkpoint from a run folder (locate.py).
Exports: Reader, CheckpointError, find_checkpoint."""
from hpengine.checkpoint.locate import find_checkpoint
from hpengine.checkpoint.shards import CheckpointError, Reader

__all__ = ["CheckpointError", "Reader", "find_checkpoint"]
