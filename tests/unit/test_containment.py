"""Files stay in their folder: planted links, paths that leave a checkpoint, FIFOs, edited and unsigned
manifests, user folders beside the checkpoints, a second job in one run folder. Each test plants the thing
itself and checks that nothing outside was read or written and that the refusal is one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from hpengine.checkpoint import seal
from hpengine.checkpoint import shards as checkpoint
from hpengine.checkpoint.write import OWNER
from test_checkpoint import cli, one_line, tiny   # noqa: E402 - tests/unit/test_checkpoint.py

STEPS = ["train.steps=2", "checkpoint.every=1", "train.eval_every=0"]


@pytest.fixture(scope="module")
def run2(tmp_path_factory, small_corpus):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("contain") / "run"
    rc = cli_plain("train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 0
    return out


def cli_plain(*args) -> int:
    from hpengine.cli.commands import main
    return main([str(a) for a in args])


def copy_run(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def manifest_of(root, step=2):
    path = root / f"step_{step:08d}" / "manifest.json"
    return path, json.loads(path.read_text())


def reseal(path, m, key=None):
    """Rewrite a manifest with a valid checksum (what anyone who edits it can do), signed with `key` if given."""
    m = {k: v for k, v in m.items() if k not in (seal.SUM_KEY, seal.MAC_KEY)}
    path.write_text(json.dumps(seal.seal(m, key)))


# ---------------------------------------------------------------- writes never follow a planted link

def test_a_planted_latest_tmp_link_does_not_redirect_the_pointer(tmp_path, small_corpus, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    os.symlink("../victim.txt", out / "checkpoints" / "latest.tmp")
    os.symlink("../victim.txt", out / "checkpoints" / "latest")       # the pointer itself a link, too
    os.symlink("../victim.txt", out / "checkpoints" / ".probe-r00000")
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS), "--resume", "auto")
    assert victim.read_text() == "precious"
    # a `latest` that is a link is not a checkpoint of this folder: refused, not followed
    assert rc == 2 and "symbolic link" in one_line(err), err
    os.unlink(out / "checkpoints" / "latest")
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 0, err
    assert victim.read_text() == "precious"
    latest = out / "checkpoints" / "latest"
    assert not latest.is_symlink() and latest.read_text() == "step_00000002\n"


def test_config_and_tokenizer_are_not_written_through_links(tmp_path, small_corpus, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink("../victim.txt", out / "config.toml")
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 2 and "already holds results" in one_line(err)
    assert victim.read_text() == "precious"


# ---------------------------------------------------------------- names a checkpoint gives stay inside it

@pytest.mark.parametrize("name", ["../../outside/x.h5", "ABSOLUTE", "sub/../../x.h5", "link.h5"])
def test_a_shard_name_leaving_the_folder_is_refused(tmp_path, run2, capsys, name):
    run = copy_run(run2, tmp_path)
    root = run / "checkpoints"
    outside = tmp_path / "outside"
    outside.mkdir()
    path, m = manifest_of(root)
    real = root / "step_00000002" / m["pieces"][0]["file"]
    shutil.copy(real, outside / "x.h5")
    if name == "ABSOLUTE":
        name = str(outside / "x.h5")
    if name == "link.h5":
        os.symlink(outside / "x.h5", root / "step_00000002" / "link.h5")
    for p in m["pieces"]:
        if p["file"] == real.name:
            p["file"] = name
    reseal(path, m)
    for cmd in (["ckpt", "verify", root], ["ckpt", "info", root], ["ckpt", "export", root, tmp_path / "o.h5"]):
        rc, said, err = cli(capsys, *cmd)
        assert rc != 0, (cmd, said)
        line = one_line(err)
        assert any(w in line for w in ("leaves the folder", "absolute path", "symbolic link")), line
    rc, _, err = cli(capsys, "train", run / "config.toml", "--set", "train.steps=3", "--set", f"train.out_dir={run}",
                     "--resume", "latest")
    assert rc == 2 and any(w in one_line(err) for w in ("leaves the folder", "absolute path", "symbolic link")), err


@pytest.mark.parametrize("pointer", ["../elsewhere/step_00000002", "/tmp\n", "step_2", "step_00000002/../../x"])
def test_a_latest_pointer_naming_anything_but_a_step_folder_is_refused(tmp_path, run2, capsys, pointer):
    run = copy_run(run2, tmp_path)
    (run / "checkpoints" / "latest").write_text(pointer)
    rc, _, err = cli(capsys, "ckpt", "verify", run / "checkpoints")
    assert rc == 2 and "not a step folder" in one_line(err), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["shard", "manifest", "latest"])
def test_a_fifo_in_place_of_a_file_is_refused_without_hanging(tmp_path, run2, capsys, what):
    run = copy_run(run2, tmp_path)
    root = run / "checkpoints"
    path, m = manifest_of(root)
    target = {"shard": root / "step_00000002" / m["pieces"][0]["file"], "manifest": path,
              "latest": root / "latest"}[what]
    target.unlink()
    os.mkfifo(target)
    t0 = time.monotonic()
    rc, _, err = cli(capsys, "ckpt", "verify", root)
    assert rc != 0 and "not a regular file" in err and time.monotonic() - t0 < 30, err
    rc, _, err = cli(capsys, "eval", root, "--data", run / "none.h5")
    assert rc != 0 and time.monotonic() - t0 < 30


def test_a_manifest_that_is_a_json_list_is_one_line(tmp_path, run2, capsys):
    run = copy_run(run2, tmp_path)
    path, _ = manifest_of(run / "checkpoints")
    path.write_text("[1, 2, 3]")
    rc, _, err = cli(capsys, "ckpt", "verify", run / "checkpoints")
    assert rc == 2 and "not an object" in one_line(err)


# ---------------------------------------------------------------- the checksum and the key

def test_without_a_key_an_edited_and_rechecksummed_manifest_is_accepted(tmp_path, run2, monkeypatch):
    """What the checksum cannot catch (the docs say so): someone who edits the manifest and recomputes it."""
    monkeypatch.delenv(seal.KEY_ENV, raising=False)
    run = copy_run(run2, tmp_path)
    path, m = manifest_of(run / "checkpoints")
    m["state"]["opt_steps"] = 999
    reseal(path, m)
    assert checkpoint.Reader(run / "checkpoints").manifest["state"]["opt_steps"] == 999


def test_with_a_key_edited_unsigned_and_wrongly_signed_manifests_are_refused(tmp_path, small_corpus, capsys,
                                                                               monkeypatch):
    monkeypatch.setenv(seal.KEY_ENV, "s3cret-key-of-this-lab")
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 0, err
    root = out / "checkpoints"
    path, m = manifest_of(root)
    assert m[seal.MAC_KEY] == seal.manifest_mac(m, b"s3cret-key-of-this-lab")       # an HMAC of this key
    assert checkpoint.Reader(root).verify() == []
    good = path.read_text()
    m["state"]["opt_steps"] = 999
    reseal(path, m)                                    # checksum recomputed, MAC dropped
    rc, _, err = cli(capsys, "ckpt", "verify", root)
    assert rc == 2 and "is not signed" in one_line(err)
    reseal(path, m, key=b"another key")                # signed, by someone without this key
    rc, _, err = cli(capsys, "ckpt", "verify", root)
    assert rc == 2 and "fails its signature check" in one_line(err)
    path.write_text(good)
    rc, _, err = cli(capsys, "train", out / "config.toml", "--set", "train.steps=3", "--resume", "latest")
    assert rc == 0, err
    monkeypatch.setenv(seal.KEY_ENV, "a different key")
    rc, _, err = cli(capsys, "train", out / "config.toml", "--set", "train.steps=4", "--resume", "latest")
    assert rc == 2 and "fails its signature check" in one_line(err)


def test_a_key_file_is_read_without_its_newline(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("abc\n")
    monkeypatch.setenv(seal.KEY_FILE_ENV, str(key))
    assert seal.load_key() == b"abc"
    key.write_text("\n")
    with pytest.raises(seal.CheckpointError, match="is empty"):
        seal.load_key()


# ---------------------------------------------------------------- never delete what the run did not write

def test_pruning_spares_user_folders_and_the_newest(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    root = out / "checkpoints"
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS, "checkpoint.keep=1"))
    assert rc == 0, err
    shutil.copytree(root / "step_00000002", root / "step_00000002_best")     # the user's copies
    shutil.copytree(root / "step_00000002", root / "step_best")
    (root / "step_99999999").mkdir()                                          # not a checkpoint of this run
    rc, _, err = cli(capsys, "train", out / "config.toml", "--set", "train.steps=4", "--set", "checkpoint.keep=1",
                     "--resume", "auto")
    assert rc == 0, err
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".discard-"))   # being deleted
    assert names == [OWNER, "latest", "step_00000002_best", "step_00000004", "step_99999999", "step_best"]
    assert (root / "latest").read_text() == "step_00000004\n"


def test_a_fresh_run_refuses_a_checkpoint_folder_of_another_run(tmp_path, run2, small_corpus, capsys):
    theirs = copy_run(run2, tmp_path) / "checkpoints"
    before = sorted(p.name for p in theirs.iterdir())
    rc, _, err = cli(capsys, "train", "configs/default.toml",
                     *tiny(small_corpus, tmp_path / "mine", *STEPS, f"checkpoint.dir={theirs}"))
    assert rc == 2 and "already holds checkpoints" in one_line(err) and "--resume" in err
    assert sorted(p.name for p in theirs.iterdir()) == before
    assert (theirs / "latest").read_text() == "step_00000002\n"


def test_a_fresh_run_refuses_a_folder_holding_files_a_run_writes(tmp_path, small_corpus, capsys):
    out = tmp_path / "hf-model"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 2 and "tokenizer.json" in one_line(err)
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'


def test_config_toml_follows_set_on_resume_so_the_continue_line_works(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 0, err
    rc, _, err = cli(capsys, "train", out / "config.toml", "--set", "train.steps=4", "--resume", "latest")
    assert rc == 0, err
    assert "steps = 4" in (out / "config.toml").read_text()
    # the printed continue command (config.toml, --resume auto) trains on to the new end, not "complete"
    rc, _, err = cli(capsys, "train", out / "config.toml", "--set", "train.steps=5", "--resume", "auto")
    assert rc == 0, err


# ---------------------------------------------------------------- one job per run folder

LOCKER = """
import sys, time
from hpengine.files import hold_lock
fd = hold_lock(sys.argv[1], "training in 'run' by process 4242 on node-a (batch job 77)")
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_job_in_a_run_folder_is_refused_naming_the_holder(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, str(out / ".hpengine.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS), "--resume", "auto")
        line = one_line(err)
        assert rc == 2 and "is in use" in line and "batch job 77" in line and "node-a" in line, line
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died: the kernel dropped its lock, and the folder is usable again (no stale lock)
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS), "--resume", "auto")
    assert rc == 0, err


def test_a_resumed_run_writes_its_files_past_planted_links(tmp_path, small_corpus, capsys):
    """Links planted in a run folder between two jobs: every file the resumed run writes replaces its link."""
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, *STEPS))
    assert rc == 0, err
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = ("config.toml", "summary.json", "ranks.jsonl", "breakdown.json", "failures.jsonl")
    for name in names:
        (out / name).unlink(missing_ok=True)
        os.symlink(victim, out / name)
    rc, _, err = cli(capsys, "train", "configs/default.toml", *tiny(small_corpus, out, "train.steps=3",
                                                                    "checkpoint.every=1"), "--resume", "latest")
    assert rc == 0, err
    assert victim.read_text() == "precious"
    assert all(not (out / n).is_symlink() for n in names[:4])
