"""Every shipped config in configs/ is proven runnable at the world size its comment names: `hpengine
config CFG --world N` resolves it fully (degrees, batch arithmetic, pipeline split, switch rules) without
MPI, for the N of the first `mpiexec -n N` line in its header."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def named_world(path: Path) -> int:
    found = re.search(r"^#.*mpiexec -n (\d+) hpengine train", path.read_text(), re.M)
    assert found, f"{path.name}: its header must name the world it runs on (`mpiexec -n N hpengine train ...`)"
    return int(found.group(1))


def config_cmd(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpengine", "config", *map(str, args)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_resolves_at_its_world_size(path):
    n = named_world(path)
    p = config_cmd(path, "--world", n)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"world {n}: ")


def test_a_world_that_does_not_fit_is_one_clear_line():
    path = next(p for p in CONFIGS if p.name == "hybrid_4d.toml")      # tp 2 x sharding 2 x pp 2
    p = config_cmd(path, "--world", 6)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0
    assert "multiply to 8 but the world size is 6" in p.stderr
