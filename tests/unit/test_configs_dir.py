"""Every shipped config in configs/ is proven runnable at the world size its comment names: `hpengine
config CFG --world N` resolves it fully (degrees, batch arithmetic, pipeline split, switch rules) without
MPI, for the N of the first `mpiexec -n N` line in its header."""
import re
from pathlib import Path

import pytest

from hpengine.cli.commands import main

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def named_world(path: Path) -> int:
    found = re.search(r"^#.*mpiexec -n (\d+) hpengine train", path.read_text(), re.M)
    assert found, f"{path.name}: its header must name the world it runs on (`mpiexec -n N hpengine train ...`)"
    return int(found.group(1))


def config_cmd(capsys, *args) -> tuple:
    """(exit status, stdout, stderr) of `hpengine config ARGS`, run in this process (no MPI needed)."""
    rc = main(["config", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_resolves_at_its_world_size(path, capsys):
    n = named_world(path)
    rc, out, err = config_cmd(capsys, path, "--world", n)
    assert rc == 0, err
    assert out.startswith(f"world {n}: ")


def test_a_world_that_does_not_fit_is_one_clear_line(capsys):
    path = next(p for p in CONFIGS if p.name == "hybrid_4d.toml")      # tp 2 x sharding 2 x pp 2
    rc, out, err = config_cmd(capsys, path, "--world", 6)
    assert rc == 2 and out == ""
    assert err.strip().count("\n") == 0
    assert "multiply to 8 but the world size is 6" in err


@pytest.mark.parametrize("world", range(1, 9))
def test_the_default_config_runs_at_every_world_size_its_batch_allows(world, capsys):
    """configs/default.toml adapts: sharding takes every rank, so any world size that divides the global
    batch resolves (no degree to edit); the others get one line naming the batch and the world."""
    path = next(p for p in CONFIGS if p.name == "default.toml")
    batch = int(re.search(r"^global_batch = (\d+)", path.read_text(), re.M).group(1))
    rc, out, err = config_cmd(capsys, path, "--world", world)
    if batch % world == 0:
        assert rc == 0, err
        assert out.startswith(f"world {world}: ") and f"sharding {world}" in out.splitlines()[0]
        assert f"batch: global {batch} = {world} replica(s) x {batch // world} sequences" in out
    else:
        assert rc == 2 and out == "" and err.strip().count("\n") == 0
        assert f"train.global_batch = {batch} is not divisible by dp x sharding = 1 x {world}" in err
    assert world in (5, 7) or rc == 0, "the default job runs at 1, 2, 3, 4, 6 and 8 ranks"
