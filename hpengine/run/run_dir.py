"""The run folder of `hpengine train`: locked while a job trains in it, checked and made by rank 0 (agreed
on every rank), its config.toml (the config the run trains with, rewritten on --resume), tokenizer.json and
launch.json (how it was launched), and metrics.jsonl trimmed to the resumed step on --resume. A fresh run
refuses a folder holding any file a run writes, and a checkpoint folder holding checkpoints it does not resume."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpengine.checkpoint.guard import STEP_NAME
from hpengine.config.load import to_toml
from hpengine.data.format import BYTES
from hpengine.dist.agree import agree_or_raise
from hpengine.files import Busy, UnsafeFile, hold_lock, holder_text, read_text, release, write_file

# every file a run writes into its folder (a fresh run refuses a folder holding any of them)
LAUNCH_FILE = "launch.json"     # how the run's latest launch started: launcher, ranks, mesh, the launch to repeat
RUN_FILES = ("metrics.jsonl", "config.toml", "tokenizer.json", "summary.json", "trace.json", "breakdown.json",
             "ranks.jsonl", "failures.jsonl", LAUNCH_FILE)
LOCK = ".hpengine.lock"


class RunError(RuntimeError):
    """A user-facing problem with the run (folder, batch arithmetic, switch settings); one clear line."""


def tokenizer_json(data) -> str | None:
    """The run folder's tokenizer.json for this data (see the module doc)."""
    if data.tokenizer is None:
        return None
    return json.dumps({"hpengine": "bytes"}) + "\n" if data.tokenizer == BYTES else data.tokenizer


def _blocker(out: Path) -> str | None:
    blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), None)
    if blocker is None:
        return None
    return ("is an existing file, not a folder" if blocker == out else
            f"'{blocker}' is a file, so no folder can be made below it") + "; choose another path"


def lock_run_dir(cfg, world):
    """Collective: rank 0 makes the run folder and holds its lock until unlock_run_dir (the kernel releases it
    if the job dies); a folder another job is training in is refused on every rank with one line naming that
    job. Returns rank 0's lock (None elsewhere, or where the file system has no locks)."""
    out = Path(cfg.train.out_dir)
    if not cfg.train.out_dir.strip():
        return None            # refused with the reason that fits the command (resume, prepare_run_dir)
    held = []

    def lock():
        if world.Get_rank() != 0:
            return
        why = _blocker(out)
        if why:
            raise RunError(f"train.out_dir = '{out}': {why}")
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            held.append((hold_lock(out / LOCK, holder_text(f"training in '{out}'")), out if made else None))
        except Busy as exc:
            raise RunError(f"train.out_dir = '{out}' is in use: {exc} holds its lock ('{out / LOCK}'); wait for "
                           "that job to end, or choose another train.out_dir") from None
    try:
        agree_or_raise(world, lock, RunError, (RunError, UnsafeFile, OSError))
    except RunError as exc:
        msg = str(exc)
        raise RunError(msg if msg.startswith("train.out_dir") else f"train.out_dir = '{out}': {msg}") from None
    return held[0] if held else None


def unlock_run_dir(handle) -> None:
    """Give back the run folder's lock (lock_run_dir's result). A folder this job made that holds nothing but
    the lock (the run was refused before it wrote anything) is removed again."""
    if handle is None:
        return
    fd, made = handle
    release(fd)
    try:
        if made is not None and [p.name for p in made.iterdir()] == [LOCK]:
            (made / LOCK).unlink()
            made.rmdir()
    except OSError:
        pass


def _checkpoints_in(root: Path) -> str | None:
    """What marks root as holding checkpoints (its `latest` or a step folder), or None."""
    if os.path.lexists(root / "latest"):
        return "'latest'"
    if root.is_dir():
        step = next((p.name for p in sorted(root.iterdir()) if STEP_NAME.fullmatch(p.name)), None)
        if step:
            return f"'{step}'"
    return None


def resumes_from(root: Path, resume) -> bool:
    """Whether --resume (None, 'latest', a path, or True: somewhere) continues the checkpoints in root."""
    if resume is None or resume is False:
        return False
    if resume is True or resume == "latest":
        return True
    try:
        return Path(resume).resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def prepare_run_dir(cfg, world, resuming=False, data=None, launched=None) -> Path:
    """The run folder; refused if it already holds results, unless resuming (metrics are appended).
    `resuming`: the --resume value (a checkpoint folder, 'latest'; True: resuming; None/False: fresh).
    `launched` (launch.launch_record()): written to launch.json."""
    out = Path(cfg.train.out_dir)
    if not cfg.train.out_dir.strip():
        raise RunError("train.out_dir = '': empty; name a run folder, e.g. --set train.out_dir=runs/x")
    fresh = resuming is None or resuming is False
    root = Path(cfg.checkpoint.dir or out / "checkpoints")

    def prepare():
        if world.Get_rank() != 0:
            return
        why = _blocker(out)
        if why:
            raise RunError(f"train.out_dir = '{out}': {why}")
        held = [n for n in RUN_FILES if os.path.lexists(out / n)]
        if fresh and held:
            raise RunError(f"train.out_dir = '{out}' already holds results ({', '.join(held[:3])}); choose a new "
                           f"folder, e.g. --set train.out_dir={out}-2, or continue it with --resume auto")
        marked = _checkpoints_in(root)
        if marked and not resumes_from(root, resuming):
            raise RunError(f"checkpoint.dir = '{root}' already holds checkpoints ({marked}) that this run does not "
                           f"resume from; continue them with --resume {root}, or choose another checkpoint.dir "
                           "(or train.out_dir)")
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "config.toml", to_toml(cfg))       # resumed: the config it trains with now (--set)
        if launched is not None:
            write_file(out / LAUNCH_FILE, json.dumps(launched, indent=1) + "\n")
        tok = tokenizer_json(data) if data is not None else None
        if tok is not None and not (not fresh and os.path.lexists(out / "tokenizer.json")):
            write_file(out / "tokenizer.json", tok)
    try:
        agree_or_raise(world, prepare, RunError, (RunError, UnsafeFile, OSError))
    except RunError as exc:
        msg = str(exc)
        raise RunError(msg if msg.startswith(("train.out_dir", "checkpoint.dir")) else
                       f"train.out_dir = '{out}': {msg}") from None
    return out


def trim_metrics(out: Path, start: int, rank: int) -> None:
    """On resume from the checkpoint of step `start` (optimizer steps completed): drop metrics.jsonl rows of
    steps > start (a crash after the checkpoint left rows that the resumed run replays; rows number steps
    from 1), so every step appears once."""
    path = out / "metrics.jsonl"
    if rank != 0 or not os.path.lexists(path):
        return
    keep = [line for line in read_text(path, "metrics", limit=None).splitlines(keepends=True)
            if line.strip() and _step_of(line) <= start]
    write_file(path, "".join(keep))


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1

