"""The run folder of `hpengine train`: checked and made by rank 0 (agreed on every rank), its config.toml
and tokenizer.json, and metrics.jsonl trimmed to the resumed step on --resume."""
from __future__ import annotations

import json
from pathlib import Path

from hpengine.config.load import to_toml
from hpengine.data.format import BYTES
from hpengine.dist.agree import agree_or_raise


class RunError(RuntimeError):
    """A user-facing problem with the run (folder, batch arithmetic, switch settings); one clear line."""


def tokenizer_json(data) -> str | None:
    """The run folder's tokenizer.json for this data (see the module doc)."""
    if data.tokenizer is None:
        return None
    return json.dumps({"hpengine": "bytes"}) + "\n" if data.tokenizer == BYTES else data.tokenizer


def prepare_run_dir(cfg, world, resuming: bool = False, data=None) -> Path:
    """The run folder; refused if it already holds results, unless resuming (metrics are appended)."""
    out = Path(cfg.train.out_dir)
    if not cfg.train.out_dir.strip():
        raise RunError("train.out_dir = '': empty; name a run folder, e.g. --set train.out_dir=runs/x")

    def prepare():
        if world.Get_rank() != 0:
            return
        blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise RunError(f"train.out_dir = '{out}': " + ("is an existing file, not a folder" if blocker == out else
                           f"'{blocker}' is a file, so no folder can be made below it") + "; choose another path")
        if not resuming and ((out / "metrics.jsonl").exists() or (out / "config.toml").exists()):
            raise RunError(f"train.out_dir = '{out}' already holds results (metrics.jsonl/config.toml); "
                           f"choose a new folder, e.g. --set train.out_dir={out}-2")
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "config.toml").exists():
            (out / "config.toml").write_text(to_toml(cfg))
        tok = tokenizer_json(data) if data is not None else None
        if tok is not None and not (resuming and (out / "tokenizer.json").exists()):
            (out / "tokenizer.json").write_text(tok)
    try:
        agree_or_raise(world, prepare, RunError, (RunError, OSError))
    except RunError as exc:
        msg = str(exc)
        raise RunError(msg if msg.startswith("train.out_dir") else f"train.out_dir = '{out}': {msg}") from None
    return out


def trim_metrics(out: Path, start: int, rank: int) -> None:
    """On resume from the checkpoint of step `start` (optimizer steps completed): drop metrics.jsonl rows of
    steps > start (a crash after the checkpoint left rows that the resumed run replays; rows number steps
    from 1), so every step appears once."""
    path = out / "metrics.jsonl"
    if rank != 0 or not path.exists():
        return
    keep = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and _step_of(line) <= start]
    path.write_text("".join(keep))


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1

