"""Checkpoint faults that hit one rank only still stop every rank together, with the same one line: a full
disk while one rank writes its shard (the previous checkpoint stays `latest`), an unwritable checkpoint
folder at start-up, an edited manifest at --resume."""
import errno
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import config
from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.checkpoint import shards as checkpoint
from hpengine.checkpoint import guard as ckpt_guard
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

STAGE3 = ["strategy.sharding.enable=true", "strategy.sharding.stage=3"]


@pytest.fixture
def root(world):
    d = tempfile.mkdtemp(prefix="hpengine-faults-") if world.Get_rank() == 0 else None
    d = Path(world.bcast(d, root=0))
    yield d
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def engine(corpus, world):
    n = world.Get_size()
    cfg = config(corpus, *(STAGE3 + [f"strategy.sharding.degree={n}"] if n > 1 else []))
    return cfg, build(cfg, world)


def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_latest(corpus, world, root, monkeypatch):
    _, eng = engine(corpus, world)
    eng.train_step(0)
    save_state(eng, root, 1, keep=2)
    last = world.Get_size() - 1

    def full(path, parts):          # a shard's data write
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    if world.Get_rank() == last:
        monkeypatch.setattr(ckpt_guard, "write_at", full)
    eng.train_step(1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        save_state(eng, root, 2, keep=2)
    msg = str(e.value)
    assert f"checkpoint folder '{root}' (checkpoint.dir): no room for the checkpoint of step 2" in msg
    assert "No space left on device" in msg and "needs about" in msg and "'latest' still names step_00000001" in msg
    assert set(world.allgather(msg)) == {msg}
    world.Barrier()
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000001"]
    assert checkpoint.Reader(root).verify() == []


def test_check_writable_agrees_across_ranks(world, root, monkeypatch):
    good = root / "ckpts"
    ckpt_guard.check_writable(world, good)
    world.Barrier()
    assert good.is_dir() and list(good.iterdir()) == []
    if world.Get_rank() == world.Get_size() - 1:        # one rank cannot write (another node's mount, say)
        def denied(folder, tag):
            raise PermissionError(errno.EACCES, "Permission denied", str(folder))
        monkeypatch.setattr(ckpt_guard, "probe_writable", denied)
    with pytest.raises(checkpoint.CheckpointError) as e:
        ckpt_guard.check_writable(world, good)
    assert str(e.value) == (f"checkpoint folder '{good}' (checkpoint.dir) is not writable: Permission denied; "
                            "set checkpoint.dir to a folder every rank can write")
    monkeypatch.undo()
    blocker = root / "file"
    if world.Get_rank() == 0:
        blocker.write_text("")
    world.Barrier()
    with pytest.raises(checkpoint.CheckpointError) as e:
        ckpt_guard.check_writable(world, blocker / "ckpts")
    assert f"'{blocker}' is a file, not a folder" in str(e.value)


def test_resume_from_an_edited_manifest_fails_on_every_rank(corpus, world, root):
    cfg, eng = engine(corpus, world)
    eng.train_step(0)
    save_state(eng, root, 1, keep=2)
    manifest = root / "step_00000001" / "manifest.json"
    world.Barrier()
    if world.Get_rank() == 0:
        m = json.loads(manifest.read_text())
        m["state"]["opt_steps"] += 1
        manifest.write_text(json.dumps(m))
    world.Barrier()
    cfg, eng = engine(corpus, world)
    with pytest.raises(checkpoint.CheckpointError) as e:
        restore(eng, cfg, root)
    assert str(e.value) == (f"--resume {root}: manifest '{manifest}' does not match its checksum (manifest_sha256): "
                            "it was edited or corrupted; use another checkpoint")
