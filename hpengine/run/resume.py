"""`hpengine train --resume auto`: continue from the run folder's latest checkpoint when there is one, start
fresh when the folder holds no checkpoint yet. A folder with results (metrics.jsonl, config.toml) but no
checkpoint (a run stopped before its first save) starts over in place: the earlier files are kept beside
the new ones as metrics.before-<time>.jsonl and config.before-<time>.toml; nothing is deleted. A batch job that always passes it (jobs/slurm_train.sbatch) resumes
by itself after a requeue or a resubmission into the same run folder.

Refused with one line where it cannot mean either:
- train.out_dir is empty (there is no run folder to look in);
- the latest checkpoint is already at train.steps: the run is complete, there is nothing to train.

Rank 0 looks at the file system and every rank gets its answer, so all ranks resume (or not) together.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpengine.checkpoint.shards import CheckpointError, resolve
from hpengine.dist.agree import agree_or_raise
from hpengine.files import UnsafeFile, read_text
from hpengine.run.run_dir import RUN_FILES, RunError

AUTO, LATEST = "auto", "latest"


def resolve_resume(cfg, world, resume, log=None):
    """The --resume value train() should use: for 'auto' the checkpoints root when it holds a checkpoint,
    else None (a fresh start); any other value unchanged. Collective on world."""
    if resume is None or resume == LATEST:
        return resume
    if resume != AUTO:
        if not Path(resume).exists():
            raise RunError(f"--resume {resume!r}: the checkpoint folder does not exist; give a checkpoint folder, "
                           f"'{LATEST}' (the run folder's newest checkpoint) or '{AUTO}' (that checkpoint when "
                           "there is one, else a fresh start)")
        return resume

    def look():
        return _look(cfg) if world.Get_rank() == 0 else None
    found = agree_or_raise(world, look, RunError, (RunError, CheckpointError, OSError, UnsafeFile))
    found = world.bcast(found, root=0) if world.Get_size() > 1 else found
    root, note = found
    if log is not None:
        log.info("--resume auto: %s", note)
    return root


def _look(cfg) -> tuple[str | None, str]:
    """(checkpoints root or None, what was found); raises RunError where auto makes no sense."""
    if not cfg.train.out_dir.strip():
        raise RunError("--resume auto: train.out_dir = '' is empty; auto resumes from the run folder's "
                       "checkpoints, so name one, e.g. --set train.out_dir=runs/x")
    out = Path(cfg.train.out_dir)
    root = Path(cfg.checkpoint.dir or out / "checkpoints")
    if os.path.lexists(root / "latest"):
        step_dir = resolve(root)                        # a `latest` naming a missing step: CheckpointError
        step = _step(step_dir)
        if step >= cfg.train.steps:
            raise RunError(f"--resume auto: the run in '{out}' is already complete: its latest checkpoint "
                           f"'{step_dir}' is at step {step} and train.steps = {cfg.train.steps}; raise "
                           "train.steps to train on, or choose a new train.out_dir")
        return str(root), f"resuming from the latest checkpoint under {root} (step {step})"
    held = [n for n in RUN_FILES if os.path.lexists(out / n)]
    if held:
        kept = set_aside(out, held)
        return None, (f"'{out}' holds an earlier run but no checkpoint ('{root / 'latest'}' does not exist): "
                      f"starting over from step 0 in that folder; its earlier files are kept as "
                      f"{', '.join(kept)}")
    return None, f"no checkpoint under {root} yet: starting from step 0"


def set_aside(out: Path, names) -> list[str]:
    """Rename each of `names` in out to `<stem>.before-<local time>[-k]<suffix>` (never over an existing
    file); the new names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = []
    for name in names:
        stem, suffix = Path(name).stem, Path(name).suffix
        k, new = 1, out / f"{stem}.before-{stamp}{suffix}"
        while new.exists():
            k += 1
            new = out / f"{stem}.before-{stamp}-{k}{suffix}"
        (out / name).rename(new)
        kept.append(new.name)
    return kept


def _step(step_dir: Path) -> int:
    try:
        return int(json.loads(read_text(step_dir / "manifest.json", "manifest", limit=1 << 30))["step"])
    except (OSError, UnsafeFile, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"manifest '{step_dir / 'manifest.json'}' is unreadable: {exc}") from None
