"""What a new user meets first: `hpengine --version` and bare `hpengine`, the mesh line naming every axis
in use (expert parallel included), the start-up config line listing the keys the user set, config comments
and key docs in user terms, and scripts run from the folder above a checkout named hpengine/."""
from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import hpengine
from hpengine.cli.commands import main
from hpengine.config.load import Config, load_config
from hpengine.dist.topology import Mesh, describe
from hpengine.layout.resolve import resolve
from hpengine.run.runlog import config_line

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "data", "config", "ckpt", "plan", "plot", "eval", "generate", "doctor")


# ---- the command line ---------------------------------------------------------------------------------

def test_version_prints_the_installed_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"hpengine {metadata.version('hpengine')}\n"
    assert hpengine.__version__ == metadata.version("hpengine")


def test_bare_hpengine_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "arguments are required" not in err
    assert "usage: hpengine" in err and "name a command" in err and "--help" in err
    listed = err[err.index("commands:"):]
    for cmd in COMMANDS:
        assert re.search(rf"^\s+{cmd}\s+\S", listed, re.M), cmd      # each command with its one-line help


# ---- the mesh line ------------------------------------------------------------------------------------

class _World:
    """Just enough of a communicator for Mesh to lay out `size` ranks (this one rank 0) without MPI."""

    def __init__(self, size):
        self.size = size

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.size

    def Split(self, color, key):
        return _World(self.size)


def _moe(*sets):
    return load_config(ROOT / "configs" / "moe_small.toml", ["strategy.expert_parallel.enable=true", *sets])


def test_mesh_line_of_an_expert_parallel_run_names_ep_and_how_it_folds():
    res = resolve(_moe("strategy.expert_parallel.degree=2"), 4)
    assert (res.dp, res.ep) == (4, 2)
    mesh = Mesh(_World(4), res.degrees.by_axis, res.order)
    mesh.fold("ep", res.ep, ("dp",))           # as run/build.py folds it
    line = mesh.describe()
    assert line.startswith("mesh pp=1 x dp=4 x sharding=1 x tp=1 (order innermost first: tp, sharding, dp, pp) "
                           "on 4 ranks; ep=2 folded inside dp=4: the routed experts split over each block of 2")
    assert "(no extra ranks)" in line
    assert line == describe(res.degrees.by_axis, res.order, 4, {"ep": (2, ("dp",))})


def test_mesh_line_names_cp_when_on_and_ep_only_where_experts_are_split():
    res = resolve(_moe("strategy.expert_parallel.degree=1"), 4)
    mesh = Mesh(_World(4), res.degrees.by_axis, res.order)
    mesh.fold("ep", res.ep, ("dp",))
    assert "ep" not in mesh.describe()
    line = describe({"tp": 1, "cp": 2, "sharding": 2, "dp": 2, "pp": 1}, ("tp", "cp", "sharding", "dp", "pp"), 8,
                    {"ep": (2, ("dp", "sharding"))})
    assert line.startswith("mesh pp=1 x dp=2 x sharding=2 x cp=2 x tp=1 (order innermost first: tp, cp, sharding,")
    assert "ep=2 folded inside dp=2 x sharding=2:" in line


# ---- the start-up config line -------------------------------------------------------------------------

DENSE_LLAMA = """
[model]
kind = "llama"
d_model = 128
n_heads = 8
n_kv_heads = 2
ffn_multiple_of = 256       # its default: counted, not listed

[train]
steps = 50
"""


def test_config_line_lists_the_keys_the_user_set_and_no_moe_key(tmp_path):
    path = tmp_path / "dense.toml"
    path.write_text(DENSE_LLAMA)
    cfg = load_config(path, ["optim.lr=1e-3", "train.seed=1234"])
    line = config_line(cfg)
    assert line.startswith("config (resolved; written in full to config.toml; the keys you set): ")
    for key in ("model.kind = 'llama'", "model.d_model = 128", "model.n_heads = 8", "model.n_kv_heads = 2",
                "train.steps = 50", "optim.lr = 0.001"):
        assert key in line, key
    assert "moe" not in line and "rope_theta" not in line and "out_dir" not in line
    assert line.endswith("(and 2 more set to their default)")      # ffn_multiple_of, train.seed
    assert len(line) < 250


def test_config_line_of_a_config_built_in_code_lists_what_is_off_the_defaults_of_its_kind():
    cfg = Config()
    cfg.model.kind, cfg.model.n_kv_heads = "llama", 2
    line = config_line(cfg)
    assert line.endswith("keys not at their default): model.kind = 'llama', model.n_kv_heads = 2")
    assert config_line(load_config(None)).endswith("the keys you set): none")


# ---- words users read ---------------------------------------------------------------------------------

JARGON = re.compile(r"\bclaims?\s+\d|\bCN\d{6,}|patent|\bissue\s*#?\d", re.I)


def test_config_comments_and_key_docs_are_in_user_terms():
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted((ROOT / "configs").glob("*.toml"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "#" in line and JARGON.search(line)]
    reference = (ROOT / "docs" / "configuration.md").read_text()
    found += [line for line in reference.splitlines() if JARGON.search(line)]
    assert not found, found
    assert "one set of collectives per step serves them all" in reference     # train.models, said plainly


# ---- a checkout's folder named hpengine ---------------------------------------------------------------

def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    launcher = ("OMPI_", "PMI_", "PMIX_", "HYDRA_", "MPI_", "SLURM_")       # a plain process, not a rank
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONSTARTUP") and not k.startswith(launcher)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_folder_above_a_checkout_named_hpengine_imports_the_package(tmp_path):
    """A clone is named hpengine/: from its parent, that folder (no __init__.py there) would pass for the
    package, a namespace package without load_config. The venv `make` builds has the checkout on sys.path,
    and a package on sys.path wins over such a folder wherever it comes: the script runs."""
    pth = [Path(d, "hpengine-checkout.pth") for d in site.getsitepackages()]
    if not any(p.exists() for p in pth):
        pytest.skip("this Python's environment was not made by `make` (no hpengine-checkout.pth)")
    clone = tmp_path / "hpengine"
    clone.mkdir()
    shutil.copy(ROOT / "README.md", clone / "README.md")    # the checkout's top level, package folder aside
    (clone / "configs").mkdir()
    p = _python("import hpengine; print(hpengine.load_config.__module__, hpengine.__file__)", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["hpengine.config.load", str(ROOT / "hpengine" / "__init__.py")]
