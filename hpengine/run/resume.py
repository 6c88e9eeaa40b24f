"""`hpengine train --resume auto` (what batch jobs and every continue line pass): the run folder's latest
checkpoint when there is one, else a fresh start; a folder with results but no checkpoint starts over in
place, its earlier files kept as <name>.before-<time>. Refused in one line for an empty train.out_dir or a
complete run. Rank 0 looks and every rank gets its answer; a resume under another world size or mesh than
the checkpoint's says so in one line (layout_change)."""
from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

from hpengine.checkpoint.shards import CheckpointError, step_folder
from hpengine.dist.agree import agree_or_raise
from hpengine.files import UnsafeFile, read_text
from hpengine.run.launch import launch_words
from hpengine.run.run_dir import LAUNCH_FILE, RUN_FILES, RunError, resumes_from

AUTO, LATEST = "auto", "latest"
OUTERMOST_FIRST = ("pp", "dp", "sharding", "cp", "tp")     # how a mesh is named in the layout-change line


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
        step_dir = step_folder(root)                        # a `latest` naming a missing step: CheckpointError
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


def _manifest(step_dir: Path) -> dict:
    try:
        return json.loads(read_text(step_dir / "manifest.json", "manifest", limit=1 << 30))
    except (OSError, UnsafeFile, ValueError) as exc:
        raise CheckpointError(f"manifest '{step_dir / 'manifest.json'}' is unreadable: {exc}") from None


def _step(step_dir: Path) -> int:
    try:
        return int(_manifest(step_dir)["step"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"manifest '{step_dir / 'manifest.json'}' is unreadable: {exc}") from None


def layout_change(cfg, resume, launched: dict) -> str | None:
    """The line rank 0 logs when the checkpoint that --resume `resume` loads (checked already) was saved by
    another world size or mesh than `launched` (launch.launch_record()); None when they agree. The
    earlier launch is named as the run folder's launch.json has it when that launch saved this checkpoint."""
    root = Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")
    try:
        manifest = _manifest(step_folder(root if resume == LATEST else resume))
        world, mesh = int(manifest["world"]), dict(manifest["layout"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return None                      # a manifest without these facts: nothing to compare
    if world == launched["ranks"] and _axes(mesh) == _axes(launched["mesh"]):
        return None
    was = _launch_phrase(_earlier_launch(cfg, root, resume, world), world, "as")
    now = _launch_phrase(launched, launched["ranks"], "under")
    islands = launched["mesh"].get("replica", 1)
    same = ("the layout changes, the training does not (the same global batches, the same result as one process up "
            "to rounding)") if islands == mesh.get("replica", 1) else (
            f"from here on {islands} DiLoCo islands meet every {cfg.strategy.diloco.inner_steps} steps: the training "
            "is no longer one process's" if islands > 1 else "the DiLoCo islands end")
    return f"resuming a run launched {was} ({_mesh_words(mesh)}) {now} ({_mesh_words(launched['mesh'])}): {same}"


def _launch_phrase(launched: dict | None, ranks: int, word: str) -> str:
    """`as mpiexec -n 4` (`word` and the launch), or `on 1 rank` without a launcher."""
    try:
        words = shlex.join(launch_words(launched)) if launched else ""
    except (TypeError, KeyError, AttributeError):           # a launch.json written by something else
        words = ""
    return f"{word} {words}" if words else f"on {ranks} rank{'s' if ranks != 1 else ''}"


def _earlier_launch(cfg, root: Path, resume, world: int) -> dict | None:
    """The run folder's launch.json (how its latest launch started) when the checkpoint is the run's own and
    that launch had the checkpoint's `world` ranks; else None."""
    if not resumes_from(root, resume):
        return None
    try:
        found = json.loads(read_text(Path(cfg.train.out_dir) / LAUNCH_FILE, "launch record", limit=1 << 16))
    except (OSError, UnsafeFile, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("ranks") == world else None


def _axes(mesh: dict) -> dict:
    return {a: d for a, d in mesh.items() if d != 1}


def _mesh_words(mesh: dict) -> str:
    """`mesh pp=2 x dp=2` (the axes of degree > 1, outermost first), or `no parallel axes`."""
    axes = _axes(mesh)
    order = sorted(axes, key=lambda a: OUTERMOST_FIRST.index(a) if a in OUTERMOST_FIRST else len(OUTERMOST_FIRST))
    return "mesh " + " x ".join(f"{a}={axes[a]}" for a in order) if axes else "no parallel axes"
