"""What the commands that write files refuse: `eval --json`, `data build`, `ckpt export` and `plot` never
replace an existing file without --force, never write into a checkpoint folder, never write through a link
put where an output goes, and a folder that is missing or on a read-only file system is one line (exit 2)
before any work; `generate`'s bad prompt, seed and temperature are one line too."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpengine.cli import after
from hpengine.cli.commands import main
from hpengine.data import build_corpus
from hpengine.data import format as token_format

TINY = ["model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "train.global_batch=4",
        "runtime.backend='numpy'", "train.log_every=1000", "train.steps=2", "checkpoint.every=2",
        "model.kind='gpt'"]
TEXT = "evaluate me: every token once, é and 日本 included.\n"


def cli(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("outputs") / "run"
    args = ["train"]
    for item in [*TINY, f"data.path={small_corpus}", f"train.out_dir={out}"]:
        args += ["--set", item]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def evalfile(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldata")
    docs = []
    for i, text in enumerate([TEXT, TEXT.upper(), "tail"]):
        (root / f"d{i}.txt").write_text(text, encoding="utf-8")
        docs.append(root / f"d{i}.txt")
    build_corpus(docs, root / "e.h5", 256)
    return root / "e.h5"


def step_of(run: Path) -> Path:
    return run / "checkpoints" / "step_00000002"


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def readonly(tmp_path, monkeypatch):
    """An empty folder on a read-only file system: a real read-only tmpfs mount (we run as root, where a
    chmod 0o555 folder is still writable), else os.open and os.mkdir failing with EROFS inside it."""
    d = tmp_path / "ro"
    d.mkdir()
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(d)], capture_output=True, text=True,
                           timeout=30)
        mounted = p.returncode == 0
    except (OSError, subprocess.SubprocessError):
        mounted = False
    if not mounted:                     # no mount permission here: the same errno from the same calls
        real_open, real_mkdir = os.open, os.mkdir

        def inside(path) -> bool:
            return os.path.abspath(os.fsdecode(path)).startswith(str(d) + os.sep)

        def ro_open(path, flags, *args, **kwargs):
            if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
            return real_open(path, flags, *args, **kwargs)

        def ro_mkdir(path, *args, **kwargs):
            if inside(path):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
            return real_mkdir(path, *args, **kwargs)
        monkeypatch.setattr(os, "open", ro_open)
        monkeypatch.setattr(os, "mkdir", ro_mkdir)
    try:
        yield d
    finally:
        if mounted:
            subprocess.run(["umount", str(d)], capture_output=True, timeout=30)


def no_evaluation(*_a, **_k):
    raise AssertionError("the evaluation ran although its --json output could not be written")


# --------------------------------------------------------------------------------- eval --json

def test_eval_json_never_writes_into_a_checkpoint_folder(run, evalfile, capsys, monkeypatch):
    monkeypatch.setattr(after, "evaluate", no_evaluation)
    before = snapshot(run / "checkpoints")
    step = step_of(run)
    for target, words in ((step / "manifest.json", "is a checkpoint folder (it holds manifest.json)"),
                          (run / "checkpoints" / "e.json", "is a checkpoint folder (it holds latest)"),
                          (step / "sub" / "e.json", "is inside the checkpoint")):
        rc, out, err = cli(capsys, "eval", run, "--data", evalfile, "--json", target, "--force")
        assert rc == 2 and one_line(err) and words in err and str(target) in err, err
    assert snapshot(run / "checkpoints") == before


def test_eval_json_refuses_an_existing_file_unless_forced(run, evalfile, capsys, tmp_path, monkeypatch):
    keep = tmp_path / "e.json"
    keep.write_text("someone's notes")
    with monkeypatch.context() as m:
        m.setattr(after, "evaluate", no_evaluation)
        rc, _, err = cli(capsys, "eval", run, "--data", evalfile, "--json", keep)
    assert rc == 2 and err == f"hpengine: error: --json '{keep}' already exists (pass --force to replace it)\n"
    assert keep.read_text() == "someone's notes"
    rc, _, err = cli(capsys, "eval", run, "--data", evalfile, "--json", keep, "--force")
    assert rc == 0, err
    assert json.loads(keep.read_text())["tokens"] > 0


def test_eval_json_into_a_missing_folder_is_one_line_before_the_evaluation(run, evalfile, capsys, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(after, "evaluate", no_evaluation)
    target = tmp_path / "nowhere" / "e.json"
    rc, out, err = cli(capsys, "eval", run, "--data", evalfile, "--json", target)
    assert rc == 2 and one_line(err) and out == ""
    assert err == (f"hpengine: error: --json '{target}': folder '{target.parent}' does not exist (create it "
                   "first, or name a file in an existing folder)\n")


def test_eval_json_on_a_read_only_file_system(run, evalfile, capsys, readonly, monkeypatch):
    monkeypatch.setattr(after, "evaluate", no_evaluation)
    target = readonly / "e.json"
    rc, _, err = cli(capsys, "eval", run, "--data", evalfile, "--json", target)
    assert rc == 2 and err == f"hpengine: error: eval --json: cannot write '{target}': Read-only file system\n"


def test_a_file_that_appears_during_the_evaluation_is_kept(run, evalfile, capsys, tmp_path, monkeypatch):
    """The exclusive write refuses it (UnsafeFile, one line through the command line's handler)."""
    target = tmp_path / "e.json"

    def evaluate_while_someone_writes(*_a, **_k):
        target.write_text("written meanwhile")
        return {"data": str(evalfile), "tokens": 1, "loss": 1.0, "perplexity": 2.7, "bits_per_byte": None}
    monkeypatch.setattr(after, "evaluate", evaluate_while_someone_writes)
    rc, _, err = cli(capsys, "eval", run, "--data", evalfile, "--json", target)
    assert rc == 2 and one_line(err) and f"'{target}' already exists" in err
    assert target.read_text() == "written meanwhile"


# --------------------------------------------------------------------------------- data build

def test_data_build_refuses_an_existing_tokenizer_file_unless_forced(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text(TEXT * 40, encoding="utf-8")
    out, tok = tmp_path / "c.h5", tmp_path / "c.tokenizer.json"
    tok.write_text("someone's tokenizer")
    args = ["data", "build", src, "--out", out, "--train-tokenizer", "--vocab-size", "300"]
    rc, _, err = cli(capsys, *args)
    assert rc == 2 and err == (f"hpengine: error: the trained tokenizer's file '{tok}' already exists (pass "
                               "--force to replace it, or --tokenizer-out PATH to save it elsewhere)\n")
    assert tok.read_text() == "someone's tokenizer" and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.tokenizer.json", "t.txt"]
    rc, _, err = cli(capsys, *args, "--force")
    assert rc == 0, err
    assert json.loads(tok.read_text())["model"]["type"] == "BPE"
    rc, _, err = cli(capsys, "data", "build", src, "--out", out, "--force", "--train-tokenizer", "--vocab-size",
                     "300", "--tokenizer-out", out)
    assert rc == 2 and one_line(err) and "is the --out file" in err


def test_data_build_replaces_a_link_and_never_writes_through_one(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text(TEXT * 40, encoding="utf-8")
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    out, tok = tmp_path / "c.h5", tmp_path / "c.tokenizer.json"
    out.symlink_to(victim)
    tok.symlink_to(victim)
    rc, _, err = cli(capsys, "data", "build", src, "--out", out, "--force", "--train-tokenizer",
                     "--vocab-size", "300")
    assert rc == 0, err
    assert victim.read_text() == "not yours"
    assert not out.is_symlink() and not tok.is_symlink() and token_format.TokenFile(out).n_tokens > 0


def test_token_file_temporary_is_created_exclusively(tmp_path, monkeypatch):
    """A link planted at the temporary file's name is not written through: the write fails, the link and
    what it points at stay as they were."""
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(1, 11)))
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    planted = tmp_path / ".c.h5.planted.tmp"
    planted.symlink_to(victim)
    monkeypatch.setattr(token_format, "temp_name", lambda beside: planted)
    with pytest.raises(OSError):
        token_format.write_token_file(tmp_path / "c.h5", raw, "uint8", [0, 10], {"vocab_size": 256})
    assert victim.read_text() == "not yours" and planted.is_symlink() and not (tmp_path / "c.h5").exists()


def test_data_build_on_a_read_only_file_system(tmp_path, capsys, readonly):
    src = tmp_path / "t.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = readonly / "c.h5"
    rc, _, err = cli(capsys, "data", "build", src, "--out", out)
    assert rc == 2 and err == f"hpengine: error: data build: cannot write '{out}': Read-only file system\n"


# --------------------------------------------------------------------------------- ckpt export

@pytest.mark.parametrize("fmt", ["hdf5", "safetensors", "hf"])
def test_export_on_a_read_only_file_system(run, capsys, readonly, fmt):
    pytest.importorskip("safetensors")
    out = readonly / "model"
    rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", out, "--format", fmt)
    assert rc == 2 and err == f"hpengine: error: ckpt export: cannot write '{out}': Read-only file system\n"


def test_export_never_writes_into_or_replaces_a_checkpoint(run, capsys):
    before = snapshot(run)
    step = step_of(run)
    for out, fmt, words in ((step / "model.h5", "hdf5", "is a checkpoint folder (it holds manifest.json)"),
                            (run / "checkpoints" / "m.safetensors", "safetensors", "(it holds latest)"),
                            (step, "hf", "is or holds the checkpoint"),
                            (run, "hf", "is or holds the checkpoint")):
        rc, _, err = cli(capsys, "ckpt", "export", step, out, "--format", fmt, "--force")
        assert rc == 2 and one_line(err) and words in err, err
    assert snapshot(run) == before


def test_export_keeps_files_it_did_not_write(run, capsys, tmp_path):
    """Files beside OUT named like a temporary or a backup of it are someone else's: kept."""
    pytest.importorskip("safetensors")
    out = tmp_path / "model.safetensors"
    neighbours = {out.name + ".export-tmp": "a", out.name + ".old-export": "b", out.name + ".tmp": "c"}
    for name, text in neighbours.items():
        (tmp_path / name).write_text(text)
    for force in ([], ["--force"]):
        rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", out, "--format", "safetensors", *force)
        assert rc == 0, err
    assert {n: (tmp_path / n).read_text() for n in neighbours} == neighbours
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, *neighbours])


def test_export_replaces_a_link_and_never_writes_through_one(run, capsys, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    out = tmp_path / "model.h5"
    out.symlink_to(victim)
    rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", out)
    assert rc == 2 and err == f"hpengine: error: '{out}' already exists (pass --force to replace it)\n"
    rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", out, "--force")
    assert rc == 0, err
    assert victim.read_text() == "not yours" and not out.is_symlink() and out.stat().st_size > 0


def test_export_hf_force_replaces_only_a_previous_export(run, capsys, tmp_path):
    pytest.importorskip("safetensors")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", folder, "--format", "hf", "--force")
    assert rc == 2 and one_line(err) and "is a folder that is not an hf export (thesis.tex)" in err
    assert (folder / "thesis.tex").read_text() == "years of work"
    hf = tmp_path / "hf"
    for _ in range(2):                  # a previous export is replaced
        rc, _, err = cli(capsys, "ckpt", "export", run / "checkpoints", hf, "--format", "hf", "--force")
        assert rc == 0, err
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in hf.iterdir()}


# --------------------------------------------------------------------------------- plot

def metrics_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4}
            for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_replaces_a_planted_link_and_never_writes_through_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    (run / "plots").mkdir()
    (run / "plots" / "loss.png").symlink_to(victim)
    rc, out, err = cli(capsys, "plot", run)
    assert rc == 0, err
    assert victim.read_text() == "not yours"
    png = run / "plots" / "loss.png"
    assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_a_plots_folder_that_is_a_link(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "plots").symlink_to(elsewhere)
    rc, _, err = cli(capsys, "plot", run)
    assert rc == 2 and one_line(err) and "is a symbolic link" in err and "--out DIR" in err
    assert list(elsewhere.iterdir()) == []


def test_plot_on_a_read_only_file_system(tmp_path, capsys, readonly):
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path)
    out = readonly / "plots"
    rc, _, err = cli(capsys, "plot", run, "--out", out)
    assert rc == 2 and err == f"hpengine: error: plot: cannot write '{out}': Read-only file system\n"


# --------------------------------------------------------------------------------- generate

@pytest.mark.parametrize("args, words", [
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number > 0"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number > 0"),
    (["--prompt", "ab\udcff"], "--prompt b'ab\\xff' is not UTF-8 text (byte 0xff at character 2)"),
])
def test_generate_bad_values_are_one_line(run, capsys, args, words):
    rc, out, err = cli(capsys, "generate", run, "--max-new-tokens", "2", *args)
    assert rc == 2 and one_line(err) and words in err and out == "", err


def test_generate_prompt_file_that_is_not_utf8(run, capsys, tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"ok \xff")
    rc, out, err = cli(capsys, "generate", run, "--prompt-file", bad)
    assert rc == 2 and err == (f"hpengine: error: --prompt-file '{bad}' is not UTF-8 text (byte 0xff at offset 3: "
                               "invalid start byte); give a UTF-8 file\n")


def test_generate_prompt_argument_that_is_not_utf8(run, tmp_path):
    """A real command line: the shell hands over bytes, Python decodes them with surrogateescape."""
    p = subprocess.run([sys.executable, "-m", "hpengine", "generate", str(run), "--prompt", b"ab\xff",
                        "--max-new-tokens", "2", "--device", "cpu"], capture_output=True, timeout=300,
                       cwd=tmp_path)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 2 and one_line(err), err
    assert "--prompt b'ab\\xff' is not UTF-8 text (byte 0xff at character 2)" in err


def test_a_subnormal_temperature_samples_the_most_likely_token(run, capsys):
    """1e-310 divides the logits past the largest float; shifted first, it is argmax, as --greedy."""
    rc, greedy, err = cli(capsys, "generate", run, "--prompt", "the", "--greedy", "--max-new-tokens", "6",
                          "--device", "cpu")
    assert rc == 0, err
    rc, tiny, err = cli(capsys, "generate", run, "--prompt", "the", "--temperature", "1e-310",
                        "--max-new-tokens", "6", "--device", "cpu")
    assert rc == 0 and "Traceback" not in err, err
    assert tiny == greedy
