"""Checkpoints from the outside: resume in a new process group through the real command line (bitwise,
float32 and float64), a save killed half-way, SIGTERM during training, damaged checkpoints (corrupted,
truncated or missing shard, another model, no manifest) that end with one clear line and touch nothing,
and the `ckpt info | verify | export` tools with `checkpoint.init_from`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import restore

BIN = Path(sys.executable).parent
TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000"]
DP2 = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"]
SH2 = ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=2"]
STEP2 = "step_00000002"


# ---------------------------------------------------------------- helpers

def tiny(corpus, out, *extra) -> list[str]:
    """`--set` arguments of a tiny run writing into `out`."""
    args = []
    for item in [*TINY, f"data.path={corpus}", f"train.out_dir={out}", *extra]:
        args += ["--set", item]
    return args


def mpiexec() -> Path:
    exe, script = BIN / "mpiexec", BIN / "hpengine"
    if not (exe.exists() and script.exists()):
        pytest.skip(f"no mpiexec or hpengine next to {sys.executable}")
    return exe


def child_env(tmp_path, **extra) -> dict:
    """Environment of a launched job: one thread per rank, a private corpus cache, and nothing of an
    MPI launcher that may have started pytest itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    return {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "HPENGINE_CACHE": str(tmp_path / "cache"), **extra}


def launch(tmp_path, n, *args, timeout=120) -> subprocess.CompletedProcess:
    """`mpiexec -n N hpengine ARGS`; fails the test (with both streams) when it does not exit 0."""
    res = subprocess.run([str(mpiexec()), "-n", str(n), str(BIN / "hpengine"), *args], capture_output=True,
                         text=True, env=child_env(tmp_path), cwd=tmp_path, timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def cli(capsys, *args) -> tuple[int, str, str]:
    """`hpengine ARGS` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("hpengine: error: "), lines[0]
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tree_hash(folder: Path) -> dict:
    """Relative path -> sha256 of every file below `folder`."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def read_export(path: Path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...]) if isinstance(obj, h5py.Dataset) else None)
    return out


def wait_for(cond, proc, what, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before {what}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def n_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))
    except OSError:
        return 0


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory, small_corpus):
    """A run folder whose checkpoints/ holds step 2 of a 2-rank sharding stage-2 run (two shard files);
    a one-process run (one shard) when no mpiexec is installed. Tests copy it before damaging it."""
    tmp = tmp_path_factory.mktemp("ckpt")
    out = tmp / "run"
    args = ["train", *tiny(small_corpus, out, "train.steps=2", "checkpoint.every=2")]
    if (BIN / "mpiexec").exists() and (BIN / "hpengine").exists():
        launch(tmp, 2, *args, *[x for s in SH2 for x in ("--set", s)])
    else:
        assert main(args) == 0
    return out


def copy_root(ckpt_run, tmp_path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(ckpt_run / "checkpoints", root)
    return root


# ---------------------------------------------------------------- 1. resume in a new process group

@pytest.mark.parametrize("layout", [DP2, SH2], ids=["dp2", "sharding2-stage2"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_resume_in_a_new_process_group_is_bitwise(tmp_path, small_corpus, capsys, dtype, layout):
    """2N steps straight == N steps, exit, `--resume latest` in a second mpiexec, N more: the same
    loss lines and the same exported parameters and Adam moments, bit for bit."""
    base = [f"model.dtype='{dtype}'", "checkpoint.every=2", *layout]
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(tmp_path, 2, "train", *tiny(small_corpus, straight, *base, "train.steps=4"))
    launch(tmp_path, 2, "train", *tiny(small_corpus, split, *base, "train.steps=2"))
    res = launch(tmp_path, 2, "train", *tiny(small_corpus, split, *base, "train.steps=4"), "--resume", "latest")
    assert f"resumed from {split / 'checkpoints' / STEP2} at step 2" in res.stdout

    a, b = metrics(straight), metrics(split)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in b] == [m[key] for m in a], key     # JSON floats round-trip: bitwise

    for run in (straight, split):
        rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints" / "step_00000004", run / "final.h5")
        assert rc == 0, err
    ea, eb = read_export(straight / "final.h5"), read_export(split / "final.h5")
    assert sorted(ea) == sorted(eb) and any(k.startswith("adam_v/") for k in ea)
    for k in ea:
        assert ea[k].shape == eb[k].shape and np.array_equal(ea[k], eb[k]), k


# ---------------------------------------------------------------- 2. a save killed half-way

KILL_DURING_SECOND_SAVE = r"""
import sys, time
import h5py
from hpengine.checkpoint import write
from hpengine.cli.commands import main

marker, argv = sys.argv[1], sys.argv[2:]
real, calls = write._write_shard, []

def write_half(path, pieces):
    calls.append(path)
    if len(calls) == 1:
        return real(path, pieces)
    with h5py.File(path, "w") as f:        # half of the shard reaches the disk, then the kill comes
        for i, p in enumerate(pieces[: len(pieces) // 2]):
            f.create_dataset(f"{p[1]}/{i}", data=p[-1])
        f.flush()
        with open(marker, "w") as m:
            m.write(str(path))
        time.sleep(600)

write._write_shard = write_half
sys.exit(main(argv))
"""


def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path, small_corpus, capsys):
    """SIGKILL in the middle of writing step 4's shard (deterministic: the shard writer signals, then
    waits to be killed): step 2 and `latest` are intact, verify says ok, `--resume latest` repeats steps
    2-3 bitwise, and its save of step 4 removes the stale temporary folder."""
    out, marker = tmp_path / "run", tmp_path / "writing"
    args = tiny(small_corpus, out, "train.steps=4", "checkpoint.every=2")
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_SECOND_SAVE, str(marker), "train", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(tmp_path), cwd=tmp_path)
        wait_for(marker.exists, proc, "the second save started writing")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL

    root = out / "checkpoints"
    stale = root / ".tmp-step_00000004"
    assert (root / "latest").read_text().strip() == STEP2
    assert (stale / "shard_r00000.h5").exists() and not (stale / "manifest.json").exists()
    assert not (root / "step_00000004").exists()
    good = tree_hash(root / STEP2)

    rc, stdout, err = cli(capsys, "ckpt", "verify", root)
    assert (rc, err) == (0, "") and stdout.splitlines()[0].endswith(": ok") and "manifest not signed" in stdout
    rc, _, err = cli(capsys, "ckpt", "verify", stale)          # the half-written folder is not a checkpoint
    assert rc == 2 and "no manifest.json" in one_line(err)

    before = metrics(out)
    assert [m["step"] for m in before] == [1, 2, 3, 4]
    rc, stdout, err = cli(capsys, "train", *args, "--resume", "latest")
    assert rc == 0, err
    assert "at step 2" in stdout
    lines = metrics(out)              # the replayed steps replace the rows written after the checkpoint
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["loss"] for m in lines] == [m["loss"] for m in before]
    assert not stale.exists()
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert tree_hash(root / STEP2) == good
    assert cli(capsys, "ckpt", "verify", root)[0] == 0


def make_stale(root: Path, step: int) -> Path:
    """What a save killed half-way leaves: a temporary folder with half a shard and no manifest."""
    stale = root / f".tmp-step_{step:08d}"
    stale.mkdir()
    src = next((root / STEP2).glob("shard_*.h5"))
    data = src.read_bytes()
    (stale / src.name).write_bytes(data[: len(data) // 2])
    return stale


def test_stale_temporary_folder_next_to_a_good_checkpoint(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    args = tiny(small_corpus, out, "train.steps=2", "checkpoint.every=2")
    assert cli(capsys, "train", *args)[0] == 0
    root = out / "checkpoints"
    stale = make_stale(root, 4)
    good = tree_hash(root / STEP2)
    rc, stdout, err = cli(capsys, "ckpt", "verify", root)
    assert (rc, err) == (0, "") and stdout.splitlines()[0].endswith(": ok") and "manifest not signed" in stdout
    rc, stdout, err = cli(capsys, "ckpt", "info", root)
    assert rc == 0 and "step 2," in stdout and "checksums: ok" in stdout
    rc, stdout, err = cli(capsys, "train", *tiny(small_corpus, out, "train.steps=4", "checkpoint.every=2"),
                          "--resume", "latest")
    assert rc == 0, err
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    assert tree_hash(root / STEP2) == good
    assert not stale.exists(), "the save of step 4 removes the stale .tmp-step_00000004"


def test_a_later_save_removes_stale_temporary_folders_of_other_steps(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    assert cli(capsys, "train", *tiny(small_corpus, out, "train.steps=2", "checkpoint.every=2"))[0] == 0
    stale = make_stale(out / "checkpoints", 3)
    rc, _, err = cli(capsys, "train", *tiny(small_corpus, out, "train.steps=4", "checkpoint.every=2"),
                     "--resume", "latest")
    assert rc == 0, err
    assert not stale.exists()


# ---------------------------------------------------------------- 3. SIGTERM during training

def rank_pid(tag: str, rank: int) -> int:
    """Process id of MPI rank `rank` of the job whose environment carries HPENGINE_TEST_TAG=tag."""
    want = {f"HPENGINE_TEST_TAG={tag}".encode(), f"PMI_RANK={rank}".encode()}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = set((d / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                return int(d.name)
    pytest.fail(f"no process of rank {rank} found in /proc")


@pytest.mark.parametrize("target", ["mpiexec", "rank1"])
def test_sigterm_saves_at_the_step_boundary_and_exits_cleanly(tmp_path, small_corpus, capsys, target):
    """SIGTERM to mpiexec (Hydra forwards it to every rank) or to rank 1 alone (the ranks agree on the
    stop): exit 75 (stopped early, resumable), a verified checkpoint of the last finished step, the stop line in the log, and
    `--resume latest` continues from that step."""
    if target == "rank1" and not Path("/proc/self/environ").exists():
        pytest.skip("finding a rank's process id needs /proc")
    out, tag = tmp_path / "run", uuid.uuid4().hex
    args = tiny(small_corpus, out, "train.steps=100000", "checkpoint.every=0", "train.eval_every=0", *SH2)
    with open(tmp_path / "job.out", "w") as so, open(tmp_path / "job.err", "w") as se:
        proc = subprocess.Popen([str(mpiexec()), "-n", "2", str(BIN / "hpengine"), "train", *args], stdout=so,
                                stderr=se, env=child_env(tmp_path, HPENGINE_TEST_TAG=tag), cwd=tmp_path)
        wait_for(lambda: n_lines(out / "metrics.jsonl") >= 3, proc, "three training steps")
        os.kill(proc.pid if target == "mpiexec" else rank_pid(tag, 1), signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    stdout, stderr = (tmp_path / "job.out").read_text(), (tmp_path / "job.err").read_text()
    assert rc == 75, f"exit {rc}\n{stdout}\n{stderr}"
    steps = [m["step"] for m in metrics(out)]
    n = len(steps)
    assert steps == list(range(1, n + 1)) and 3 <= n < 100000
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", f"step_{n:08d}"]
    assert (root / "latest").read_text().strip() == f"step_{n:08d}"
    assert f"SIGTERM received: stopping cleanly after step {n} of 100000 (checkpoint saved)" in stdout
    assert cli(capsys, "ckpt", "verify", root)[0] == 0

    more = tiny(small_corpus, out, f"train.steps={n + 2}", "checkpoint.every=0", "train.eval_every=0")
    rc, stdout, err = cli(capsys, "train", *more, "--resume", "latest")
    assert rc == 0, err
    assert f"at step {n}" in stdout
    assert [m["step"] for m in metrics(out)] == list(range(1, n + 3))


# ---------------------------------------------------------------- 4. damaged checkpoints

def flip_byte(path: Path) -> str:
    """Flip one byte in the middle of the data of the first parameter dataset; returns its name."""
    with h5py.File(path, "r") as f:
        name = next(f"param/{k}" for k in f["param"])
        off, size = f[name].id.get_offset(), f[name].id.get_storage_size()
    with open(path, "r+b") as fh:
        fh.seek(off + size // 2)
        b = fh.read(1)[0]
        fh.seek(off + size // 2)
        fh.write(bytes([b ^ 0xFF]))
    return name


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def last_shard(root: Path) -> Path:
    return sorted((root / STEP2).glob("shard_*.h5"))[-1]


def damage(kind: str, root: Path) -> tuple[Path, list[str]]:
    """Damage a copied checkpoints root; returns (what to load, words the error must contain)."""
    step = root / STEP2
    if kind == "corrupted":
        shard = last_shard(root)
        dset = flip_byte(shard)
        return step, [shard.name, "checksum mismatch", dset, "corrupted"]
    if kind == "truncated":
        shard = last_shard(root)
        truncate(shard)
        return step, [shard.name, "truncated"]
    if kind == "missing shard":
        shard = last_shard(root)
        shard.unlink()
        return step, [shard.name, "missing", "No such file"]
    if kind == "no manifest":
        (step / "manifest.json").unlink()
        return step, [str(step), "no manifest.json"]
    if kind == "manifest not JSON":
        m = step / "manifest.json"
        m.write_text(m.read_text()[:100])
        return step, [str(m), "not JSON"]
    if kind == "latest dangling":
        shutil.rmtree(step)
        return root, [str(root / "latest"), STEP2, "no manifest.json"]
    if kind == "does not exist":
        return root / "nowhere", [str(root / "nowhere"), "does not exist"]
    raise AssertionError(kind)


SHARD_DAMAGE = ["corrupted", "truncated", "missing shard"]
FOLDER_DAMAGE = ["no manifest", "manifest not JSON", "latest dangling", "does not exist"]


@pytest.mark.parametrize("kind", SHARD_DAMAGE + FOLDER_DAMAGE)
def test_resume_from_a_damaged_checkpoint(tmp_path, small_corpus, capsys, ckpt_run, kind):
    root = copy_root(ckpt_run, tmp_path)
    target, words = damage(kind, root)
    before, out = tree_hash(root), tmp_path / "run"
    rc, _, err = cli(capsys, "train", *tiny(small_corpus, out, "train.steps=4"), "--resume", target)
    assert rc == 2
    line = one_line(err)
    for w in words:
        assert w in line, (w, line)
    assert tree_hash(root) == before
    assert not out.exists()


def test_resume_with_another_model_shape(tmp_path, small_corpus, capsys, ckpt_run):
    root = copy_root(ckpt_run, tmp_path)
    before, out = tree_hash(root), tmp_path / "run"
    rc, _, err = cli(capsys, "train", *tiny(small_corpus, out, "model.d_model=32", "train.steps=4"),
                     "--resume", root)
    assert rc == 2
    line = one_line(err)
    for w in (str(root / STEP2), "different model", "checkpoint [256, 16], config [256, 32]",
              "the checkpoint's gpt model has model.d_model = 16, the config asks for 32"):
        assert w in line, (w, line)
    assert tree_hash(root) == before
    assert not out.exists()


def test_resume_with_another_model_kind_names_both_kinds(tmp_path, small_corpus, capsys, ckpt_run):
    root = copy_root(ckpt_run, tmp_path)
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", *tiny(small_corpus, out, "model.kind='llama'", "model.n_kv_heads=1",
                                            "train.steps=4"), "--resume", root)
    assert rc == 2
    line = one_line(err)
    assert "the checkpoint holds a gpt model (model.kind = 'gpt'), the config asks for llama" in line, line
    assert not out.exists()




@pytest.mark.parametrize("kind", ["corrupted", "truncated", "missing shard"])
def test_verify_and_info_report_a_damaged_shard(tmp_path, capsys, ckpt_run, kind):
    root = copy_root(ckpt_run, tmp_path)
    target, words = damage(kind, root)
    before = tree_hash(root)
    rc, stdout, err = cli(capsys, "ckpt", "info", target)
    assert rc == 1 and "checksums: " in stdout and "problem(s)" in stdout
    rc, stdout, err = cli(capsys, "ckpt", "verify", target)
    assert rc == 1 and stdout.strip() == f"{target}: CORRUPTED"
    assert tree_hash(root) == before
    line = one_line(err)
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("kind", FOLDER_DAMAGE)
def test_tools_on_a_folder_that_is_not_a_checkpoint(tmp_path, capsys, ckpt_run, kind):
    root = copy_root(ckpt_run, tmp_path)
    target, words = damage(kind, root)
    before = tree_hash(root)
    for cmd in (["info", target], ["verify", target], ["export", target, tmp_path / "out.h5"]):
        rc, _, err = cli(capsys, "ckpt", *cmd)
        assert rc == 2, cmd
        line = one_line(err)
        for w in words:
            assert w in line, (cmd, w, line)
    assert tree_hash(root) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]




@pytest.mark.parametrize("kind", SHARD_DAMAGE)
def test_export_of_a_damaged_checkpoint_writes_nothing(tmp_path, capsys, ckpt_run, kind):
    root = copy_root(ckpt_run, tmp_path)
    target, words = damage(kind, root)
    before = tree_hash(root)
    rc, _, err = cli(capsys, "ckpt", "export", target, tmp_path / "out.h5")
    assert rc == 2
    line = one_line(err)
    assert words[0] in line, line
    assert tree_hash(root) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


# ---------------------------------------------------------------- 5. info, export, init_from

def tiny_engine(corpus, out, *extra):
    cfg = load_config(None, [a for a in tiny(corpus, out, *extra) if a != "--set"])
    return cfg, build(cfg)


def test_info_export_and_init_from(tmp_path, small_corpus, capsys, ckpt_run):
    root = ckpt_run / "checkpoints"
    manifest = json.loads((root / STEP2 / "manifest.json").read_text())
    world = manifest["world"]
    _, eng = tiny_engine(small_corpus, tmp_path / "unused")
    shapes = eng.true_shapes()
    assert manifest["shapes"] == shapes

    rc, stdout, err = cli(capsys, "ckpt", "info", root)
    assert (rc, err) == (0, "")
    assert f"{root / STEP2}: step 2, written by {world} ranks with degrees " in stdout
    assert str(manifest["layout"]) in stdout
    assert f"{len(shapes)} tensors, {sum(int(np.prod(s)) for s in shapes.values()):,} elements, {world} shard" in stdout
    assert " MiB" in stdout and "checksums: ok" in stdout

    export = tmp_path / "export.h5"
    rc, stdout, err = cli(capsys, "ckpt", "export", root, export)
    assert (rc, err) == (0, "") and f"{len(shapes)} tensors at step 2" in stdout
    data = read_export(export)
    assert sorted(data) == sorted(f"{k}/{n}" for k in ("param", "adam_m", "adam_v") for n in shapes)
    for key, arr in data.items():
        assert list(arr.shape) == shapes[key.split("/", 1)[1]], key
    assert not any(np.all(data[f"adam_v/{n}"] == 0) for n in shapes)

    cfg, eng = tiny_engine(small_corpus, tmp_path / "unused")       # the export holds the checkpoint's values
    assert restore(eng, cfg, root) == 2
    for name, arr in eng.named_params().items():
        assert np.array_equal(arr, data[f"param/{name}"]), name

    cfg, eng = tiny_engine(small_corpus, tmp_path / "unused", f"checkpoint.init_from={export}")
    assert restore(eng, cfg, None) == 0
    for name, arr in eng.named_params().items():
        assert np.array_equal(arr, data[f"param/{name}"]), name

    out = tmp_path / "zero-lr"           # through the command line: a 0-LR step keeps the exported values
    rc, stdout, err = cli(capsys, "train", *tiny(small_corpus, out, f"checkpoint.init_from={export}", "optim.lr=0",
                                                 "train.steps=1", "checkpoint.every=1"))
    assert rc == 0, err
    assert f"parameters initialised from {export}" in stdout
    assert cli(capsys, "ckpt", "export", out / "checkpoints", tmp_path / "again.h5")[0] == 0
    again = read_export(tmp_path / "again.h5")
    for name in shapes:
        assert np.array_equal(again[f"param/{name}"], data[f"param/{name}"]), name


def test_info_into_a_closed_pipe_ends_quietly(tmp_path, ckpt_run):
    """`hpengine ckpt info DIR | head -1`: the reader leaves early; the command ends without a traceback,
    as a tool ended by SIGPIPE does (status 141)."""
    exe, root = BIN / "hpengine", ckpt_run / "checkpoints"
    if not exe.exists():
        pytest.skip(f"no hpengine next to {sys.executable}")
    env = child_env(tmp_path)
    res = subprocess.run(["bash", "-c", f"'{exe}' ckpt info '{root}' | head -1"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith(f"{root / STEP2}: step 2,") and res.stdout.count("\n") == 1
    # the same with the reader surely gone before the first write (head may still be reading above)
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([str(exe), "ckpt", "info", str(root)], stdout=w, stderr=subprocess.PIPE, text=True,
                             env=env, timeout=60)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (141, "")
