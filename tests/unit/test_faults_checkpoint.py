"""Injected checkpoint faults end with one clear line and leave the last good checkpoint usable: a full disk
during a 4-rank stage-3 save, an edited manifest, an export of another shape as checkpoint.init_from, bad
export paths, a kill while pruning old checkpoints, and checkpoint folders that are files or unwritable."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.checkpoint import shards as checkpoint
from hpengine.checkpoint import guard as ckpt_guard, seal
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import save_state
from test_checkpoint import cli  # noqa: E402 - `hpengine ARGS` in this process (tests/unit/test_checkpoint.py)

BIN = Path(sys.executable).parent
T = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
     "model.dtype='float64'", "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000"]
STAGE3 = ["strategy.sharding.enable=true", "strategy.sharding.degree=4", "strategy.sharding.stage=3"]


def sets(corpus, out, *extra) -> list[str]:
    args = []
    for item in [*T, f"data.path={corpus}", f"train.out_dir={out}", *extra]:
        args += ["--set", item]
    return args


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if not ln.startswith("manifest ")]   # no warnings expected
    assert len(set(lines)) == 1 and "Traceback" not in err, f"expected one error line, got:\n{err}"
    assert lines[0].startswith("hpengine: error: "), lines[0]
    return lines[0]


def one_message(err: str) -> str:
    """The error of a job whose ranks each print the same line (their output may interleave)."""
    assert "Traceback" not in err and "Exception ignored" not in err and "Abort" not in err, err
    msgs = {m.strip() for m in err.split("hpengine: error: ")[1:]}
    assert len(msgs) == 1 and not err.split("hpengine: error: ")[0].strip(), f"expected one message, got:\n{err}"
    return msgs.pop()


def child_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    return {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HPENGINE_CACHE": str(tmp_path / "cache")}


def mpirun(tmp_path, n, *argv, timeout=240) -> subprocess.CompletedProcess:
    exe = BIN / "mpiexec"
    if not exe.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    return subprocess.run([str(exe), "-n", str(n), *map(str, argv)], capture_output=True, text=True,
                          env=child_env(tmp_path), cwd=tmp_path, timeout=timeout)


def tiny_engine(corpus, out, *extra):
    cfg = load_config(None, [a for a in sets(corpus, out, *extra) if a != "--set"])
    return cfg, build(cfg)


@pytest.fixture(scope="module")
def run5(tmp_path_factory, small_corpus):
    """A one-process run folder with checkpoints/step_00000005 (opt_steps 5)."""
    out = tmp_path_factory.mktemp("run5") / "run"
    assert main(["train", *sets(small_corpus, out, "train.steps=5", "checkpoint.every=5")]) == 0
    return out


def copy_root(run, tmp_path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", root)
    return root


# ---------------------------------------------------------------- (a) disk full during a save

LIMITED = r"""
import resource, signal, sys
from mpi4py import MPI                      # MPI starts before the limit: its shared memory is not a file write
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
lim = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (lim, lim))
from hpengine.cli.commands import main
sys.exit(main(sys.argv[2:]))
"""


def test_file_system_full_during_a_4_rank_stage3_save(tmp_path, small_corpus):
    """RLIMIT_FSIZE (SIGXFSZ ignored) makes every write past the limit fail with EFBIG, as a full disk fails
    with ENOSPC: the second save fails on every rank with one line; step 3 stays `latest` and intact."""
    out, root = tmp_path / "run", tmp_path / "ckpts"
    first = mpirun(tmp_path, 4, BIN / "hpengine", "train",
                   *sets(small_corpus, out, *STAGE3, "train.steps=3", "checkpoint.every=3", f"checkpoint.dir={root}"))
    assert first.returncode == 0, first.stderr
    shards = sorted((root / "step_00000003").glob("shard_*.h5"))
    assert len(shards) == 4
    limit = min(p.stat().st_size for p in shards) // 2          # metrics.jsonl stays far below it
    (tmp_path / "limited.py").write_text(LIMITED)
    res = mpirun(tmp_path, 4, sys.executable, tmp_path / "limited.py", limit, "train",
                 *sets(small_corpus, out, *STAGE3, "train.steps=6", "checkpoint.every=3", f"checkpoint.dir={root}"),
                 "--resume", "latest")
    assert res.returncode == 2, res.stderr
    line = one_message(res.stderr)
    for w in (f"'{root}'", "checkpoint.dir", "step 6", "File too large", "needs about", "MiB free",
              "'latest' still names step_00000003"):
        assert w in line, (w, line)
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000003"]     # the half save is gone
    assert checkpoint.Reader(root).verify() == []


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, small_corpus, monkeypatch):
    """The free space the file system reports is below what the shards need: nothing is written."""
    root = tmp_path / "ckpts"
    _, eng = tiny_engine(small_corpus, tmp_path / "unused")
    save_state(eng, root, 1, 2)
    need = sum(a.nbytes for a in eng.named_params().values()) * 3    # params + two Adam moments
    free = need // 2
    monkeypatch.setattr(ckpt_guard.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * need, 0, free))
    with pytest.raises(checkpoint.CheckpointError) as e:
        save_state(eng, root, 2, 2)
    line = str(e.value)
    for w in (f"'{root}'", "step 2", f"needs about {need / 2**20:.2f} MiB", f"{free / 2**20:.2f} MiB free",
              "'latest' still names step_00000001"):
        assert w in line, (w, line)
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000001"]


# ---------------------------------------------------------------- (b) the manifest's checksum

def edit(manifest: Path, kind: str) -> None:
    m = json.loads(manifest.read_text())
    if kind == "opt_steps":
        assert m["state"]["opt_steps"] == 5
        m["state"]["opt_steps"] = 6
    elif kind == "step":
        m["step"] = 2
    elif kind == "flat":
        m["pieces"][0]["flat"][1] += 10 ** 6
    elif kind == "box":
        m["pieces"][0]["box"][0] = [0, 10 ** 6]
    manifest.write_text(json.dumps(m))


@pytest.mark.parametrize("kind", ["opt_steps", "step", "flat", "box"])
def test_an_edited_manifest_is_refused_by_verify_resume_and_export(tmp_path, small_corpus, capsys, run5, kind):
    root = copy_root(run5, tmp_path)
    manifest = root / "step_00000005" / "manifest.json"
    edit(manifest, kind)
    words = [str(manifest), "does not match its checksum"]
    rc, _, err = cli(capsys, "ckpt", "verify", root)
    assert rc != 0
    assert all(w in one_line(err) for w in words), err
    rc, _, err = cli(capsys, "train", *sets(small_corpus, tmp_path / "run", "train.steps=7"), "--resume", root)
    assert rc == 2 and all(w in one_line(err) for w in words), err
    assert not (tmp_path / "run").exists()
    rc, _, err = cli(capsys, "ckpt", "export", root, tmp_path / "out.h5")
    assert rc == 2 and all(w in one_line(err) for w in words), err
    assert not (tmp_path / "out.h5").exists()


def test_a_manifest_without_checksum_loads_with_a_warning(tmp_path, small_corpus, capsys, run5, caplog):
    """Checkpoints written before manifests were checksummed still resume (warning), and an impossible
    piece index in one is still one line, not an IndexError."""
    root = copy_root(run5, tmp_path)
    manifest = root / "step_00000005" / "manifest.json"
    m = json.loads(manifest.read_text())
    assert m.pop(seal.SUM_KEY) == seal.manifest_digest(m)
    manifest.write_text(json.dumps(m))
    with caplog.at_level("WARNING", logger="hpengine"):
        r = checkpoint.Reader(root)
    assert r.step == 5 and r.verify() == []
    assert any("has no checksum" in rec.getMessage() and str(manifest) in rec.getMessage() for rec in caplog.records)
    m["pieces"][0]["flat"][1] += 10 ** 6
    manifest.write_text(json.dumps(m))
    rc, _, err = cli(capsys, "ckpt", "export", root, tmp_path / "out.h5")
    line = one_line(err)
    assert rc == 2 and str(manifest) in line and "malformed" in line and "flat range" in line


# ---------------------------------------------------------------- (c) init_from of another shape

def test_init_from_an_export_of_another_shape_is_refused(tmp_path, small_corpus, capsys, run5):
    exp = tmp_path / "exp.h5"
    assert cli(capsys, "ckpt", "export", run5 / "checkpoints", exp)[0] == 0
    out = tmp_path / "wide"
    rc, _, err = cli(capsys, "train", *sets(small_corpus, out, f"checkpoint.init_from={exp}", "model.d_model=32",
                                            "train.steps=1"))
    line = one_line(err)
    assert rc == 2
    for w in (str(exp), "'wte'", "[256, 16] in the file", "[256, 32] in the config"):
        assert w in line, (w, line)
    assert not out.exists()
    rc, _, err = cli(capsys, "train", *sets(small_corpus, tmp_path / "deep", f"checkpoint.init_from={exp}",
                                            "model.n_layers=3", "train.steps=1"))
    assert rc == 2 and "has no tensor 'h.2." in one_line(err)


# ---------------------------------------------------------------- (d) export output paths

@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_export_into_an_existing_folder_is_refused_even_with_force(tmp_path, capsys, run5, fmt):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep me")
    for force in ([], ["--force"]):
        rc, _, err = cli(capsys, "ckpt", "export", run5 / "checkpoints", folder, "--format", fmt, *force)
        line = one_line(err)
        assert rc == 2 and f"'{folder}' is a folder" in line and str(folder / "model.") in line
    assert (folder / "keep.txt").read_text() == "keep me" and len(list(folder.iterdir())) == 1


def test_export_into_a_missing_folder_is_one_line(tmp_path, capsys, run5):
    out = tmp_path / "no" / "such" / "out.h5"
    rc, _, err = cli(capsys, "ckpt", "export", run5 / "checkpoints", out)
    assert rc == 2 and f"output '{out}': folder '{out.parent}' does not exist" in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors", "hf"])
def test_export_writes_a_temporary_name_then_renames(tmp_path, capsys, run5, monkeypatch, fmt):
    out, renames, real = tmp_path / "out", [], os.replace

    def spy(src, dst):
        if Path(dst) == out:
            assert not out.exists() and Path(src).exists() and Path(src) != out
            renames.append(Path(src))
        real(src, dst)
    monkeypatch.setattr(os, "replace", spy)
    rc, _, err = cli(capsys, "ckpt", "export", run5 / "checkpoints", out, "--format", fmt)
    assert rc == 0, err
    assert len(renames) == 1 and renames[0].parent == out.parent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------- (e) a kill while pruning

class Killed(BaseException):
    pass


def test_a_kill_while_pruning_leaves_no_half_deleted_step_folder(tmp_path, small_corpus, monkeypatch):
    root = tmp_path / "ckpts"
    _, eng = tiny_engine(small_corpus, tmp_path / "unused")
    save_state(eng, root, 1, 1)
    real = shutil.rmtree

    def killed_half_way(path, ignore_errors=False, **kw):
        path = Path(path)
        if not path.exists():
            return
        next(path.glob("shard_*.h5")).unlink()               # one shard gone, then the kill
        raise Killed
    monkeypatch.setattr(shutil, "rmtree", killed_half_way)
    with pytest.raises(Killed):
        save_state(eng, root, 2, 1)                          # publishing step 2 prunes step 1
    monkeypatch.setattr(shutil, "rmtree", real)
    steps = sorted(root.glob("step_*"))
    assert [p.name for p in steps] == ["step_00000002"]
    for step in steps:
        assert checkpoint.Reader(step).verify() == [], step
    save_state(eng, root, 3, 1)                              # the next save clears what the kill left
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000003"]


# ---------------------------------------------------------------- (f), (g) the checkpoint folder

def test_a_checkpoint_dir_under_a_file_is_named(tmp_path, small_corpus, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    root = blocker / "ckpts"
    rc, _, err = cli(capsys, "train", *sets(small_corpus, tmp_path / "run", "train.steps=1", "checkpoint.every=1",
                                            f"checkpoint.dir={root}"))
    line = one_line(err)
    assert rc == 2
    for w in (f"checkpoint folder '{root}' (checkpoint.dir)", "Not a directory", f"'{blocker}' is a file"):
        assert w in line, (w, line)
    from mpi4py import MPI
    with pytest.raises(checkpoint.CheckpointError) as e:
        ckpt_guard.check_writable(MPI.COMM_SELF, root)
    assert f"'{root}' (checkpoint.dir) is not writable" in str(e.value) and f"'{blocker}' is a file" in str(e.value)


UNWRITABLE = r"""
import os, sys
from mpi4py import MPI
from hpengine.checkpoint import guard as ckpt_guard             # imported first: the interpreter's files may be private to root
if os.geteuid() == 0:                       # root writes anywhere: check as an ordinary user
    os.setgid(65534)
    os.setuid(65534)
try:
    ckpt_guard.check_writable(MPI.COMM_WORLD, sys.argv[1])
except ckpt_guard.CheckpointError as exc:
    print(exc)
    sys.exit(2)
"""


@pytest.fixture
def shared_tmp():
    """A temporary folder other users can reach (pytest's own is private to this user)."""
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="hpengine-ro-"))
    d.chmod(0o755)
    yield d
    for p in d.rglob("*"):
        if p.is_dir():
            p.chmod(0o755)
    shutil.rmtree(d, ignore_errors=True)


def test_check_writable_refuses_a_read_only_folder(shared_tmp):
    tmp_path = shared_tmp
    ro = tmp_path / "ro"
    ro.mkdir()
    for p in tmp_path.parents:
        if (p.stat().st_mode & 0o001) == 0:
            pytest.skip(f"'{p}' is not searchable by other users")
    ro.chmod(0o555)
    (tmp_path / "probe.py").write_text(UNWRITABLE)
    res = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(ro / "ckpts")], capture_output=True,
                         text=True, env=child_env(tmp_path), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stdout.strip() == (f"checkpoint folder '{ro / 'ckpts'}' (checkpoint.dir) is not writable: "
                                  "Permission denied; set checkpoint.dir to a folder every rank can write")
    ro.chmod(0o755)
    from mpi4py import MPI
    ckpt_guard.check_writable(MPI.COMM_SELF, ro / "ckpts")     # a writable one passes and stays clean
    assert (ro / "ckpts").is_dir() and list((ro / "ckpts").iterdir()) == []
