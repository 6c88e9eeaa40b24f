"""Asynchronous checkpoints (checkpoint/background.py): the checkpoint a background writer finishes while
training goes on holds exactly the state of its step, bit for bit what a synchronous save of that step
holds, even when the writer is slower than the next step; a writer failing on one rank fails every rank at
the next step boundary with one message and leaves `latest` on the previous checkpoint; the writing of
replicated tensors is spread evenly over their replicas."""
import errno
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import config, need
from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.checkpoint import background, guard as ckpt_guard, shards
from hpengine.run import launch
from hpengine.run.build import build
from hpengine.run.train import save_state

log = logging.getLogger("hpengine")


@pytest.fixture
def roots(world):
    d = tempfile.mkdtemp(prefix="hpengine-async-") if world.Get_rank() == 0 else None
    d = Path(world.bcast(d, root=0))
    yield d / "async", d / "sync"
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def layout(n):
    if n == 1:
        return []
    if n == 2:
        return ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"]
    return ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2", "strategy.sharding.enable=true",
            f"strategy.sharding.degree={n // 2}", "strategy.sharding.stage=3"]


def steps_with_saver(eng, world, saver, first, count):
    """`count` training steps, each ended by the step-boundary agreement train.py makes."""
    for s in range(first, first + count):
        eng.train_step(s)
        _, _, writer = launch.step_boundary(world, False, saver.state())
        saver.settle(writer)


def every_tensor(root):
    r = shards.Reader(root)
    try:
        return {(kind, name): r.read(kind, name, tuple(slice(0, n) for n in shape))
                for name, shape in r.manifest["shapes"].items() for kind in r.kinds}
    finally:
        r.close()


def test_a_slow_writer_still_saves_its_own_step(corpus, world, roots, monkeypatch):
    """The writer sleeps before copying the buffers, so the next step's update would overwrite them first
    without the fence; the async checkpoint must equal the synchronous one of the same step."""
    root_a, root_s = roots
    cfg = config(corpus, *layout(world.Get_size()))
    eng = build(cfg, world)
    eng.train_step(0)
    eng.train_step(1)
    save_state(eng, root_s, 2, keep=1)                      # the synchronous save: copies, written at once
    real = background.snapshot

    def slow(pieces, buffers):
        time.sleep(1.0)
        return real(pieces, buffers)
    monkeypatch.setattr(background, "snapshot", slow)
    saver = background.Saver(eng.world, eng.tracer, log)
    eng.fence_updates(saver.fence)
    save_state(eng, root_a, 2, keep=1, saver=saver)
    steps_with_saver(eng, world, saver, 2, 2)               # the buffers change under the writer's feet
    saver.wait()
    world.Barrier()
    a, s = every_tensor(root_a), every_tensor(root_s)
    assert a.keys() == s.keys()
    for key in s:
        assert np.array_equal(a[key], s[key]), key
    assert (root_a / "latest").read_text().strip() == "step_00000002"


def test_a_writer_failing_on_one_rank_fails_every_rank_at_the_next_boundary(corpus, world, roots, monkeypatch):
    root = roots[0]
    cfg = config(corpus, *layout(world.Get_size()))
    eng = build(cfg, world)
    saver = background.Saver(eng.world, eng.tracer, log)
    eng.fence_updates(saver.fence)
    eng.train_step(0)
    save_state(eng, root, 1, keep=2, saver=saver)
    steps_with_saver(eng, world, saver, 1, 1)
    saver.wait()                                             # published (the next save would wait too)
    assert (root / "latest").read_text().strip() == "step_00000001"

    def full(path, parts):          # a shard's data write
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    if world.Get_rank() == world.Get_size() - 1:
        monkeypatch.setattr(ckpt_guard, "write_at", full)
    save_state(eng, root, 2, keep=2, saver=saver)
    with pytest.raises(shards.CheckpointError) as e:
        steps_with_saver(eng, world, saver, 2, 200)         # raised at the first boundary after the failure
    msg = str(e.value)
    assert "no room for the checkpoint of step 2" in msg and "No space left on device" in msg, msg
    assert "'latest' still names step_00000001" in msg, msg
    assert set(world.allgather(msg)) == {msg}
    world.Barrier()
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000001"]
    assert shards.Reader(root).verify() == []


def test_replicas_share_the_writing(corpus, world, roots):
    n = world.Get_size()
    need(n > 1, "one rank writes everything")
    cfg = config(corpus, "strategy.data_parallel.enable=true", f"strategy.data_parallel.degree={n}")
    eng = build(cfg, world)
    eng.train_step(0)
    save_state(eng, roots[1], 1, keep=1)
    world.Barrier()
    r = shards.Reader(roots[1])
    mine = {}
    for p in r.manifest["pieces"]:
        mine[p["file"]] = mine.get(p["file"], 0) + p["flat"][1] - p["flat"][0]
    total = sum(int(np.prod(s)) for s in r.manifest["shapes"].values()) * len(r.kinds)
    assert len(mine) == n and sum(mine.values()) == total          # every value once
    assert max(mine.values()) - min(mine.values()) <= len(r.kinds), mine   # equal shares
    r.close()
