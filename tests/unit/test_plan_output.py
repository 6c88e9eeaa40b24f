"""What `hpengine plan` prints: the cluster first, a table of at most 120 columns with its legend (--wide: every
part), the rows' precision; progress on a terminal's stderr, one summary line on a redirected one."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from hpengine.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["plan", "--model", "gpt2-124m", "--nodes", "1", "--gpus-per-node", "4", "--mem-gb", "16",
         "--max-micro-batch", "2"]


def test_table_fits_120_columns_with_a_legend_and_wide_shows_every_part(capsys):
    assert main(SMALL) == 0
    narrow = capsys.readouterr().out.splitlines()
    assert narrow[0].startswith("cluster: the built-in default") and "1 x 4 devices of 16 GB" in narrow[0]
    assert all(len(line) <= 120 for line in narrow), max(narrow, key=len)
    assert any(line.startswith("legend: tp tensor parallel degree") for line in narrow)
    text = "\n".join(narrow)
    for abbreviation in ("st ZeRO stage", "m micro-batches per pass", "k gradient-merge passes",
                         "mb sequences per micro-batch", "sp sequence parallel", "rc recompute"):
        assert abbreviation in text
    rows = [line for line in narrow if line[:3].strip().isdigit()]
    assert rows and all(" fp16 " in r or " fp32 " in r for r in rows)     # each row's own precision
    assert "float32)" not in narrow[3] or "amp rows compute in 16 bits" in text
    assert main(SMALL + ["--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    head = next(line for line in wide if line.lstrip().startswith("# tp"))
    assert len(head) > 120 and all(c in head for c in ("params", "grads", "optim", "act", "shard", "fixed"))
    assert max(map(len, wide)) > max(map(len, narrow))


def test_check_names_the_cluster_first(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(SMALL + ["--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["plan", "--check", str(out), "--cluster", str(ROOT / "clusters" / "a100_80gb_dgx.toml"),
                 "--nodes", "1", "--gpus-per-node", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cluster: --cluster ") and "DGX A100 80GB nodes" in lines[0]
    head = " ".join(" ".join(lines[:3]).split())
    assert "set by --nodes, --gpus-per-node" in head and "300 GB/s and 5 us inside a node" in head


def _plan(stderr_tty: bool) -> tuple[int, str]:
    """Run `hpengine plan` in a subprocess with stderr on a pseudo-terminal or a pipe: (status, stderr)."""
    cmd = [sys.executable, "-m", "hpengine", *SMALL]
    env = dict(os.environ, COLUMNS="100")
    if not stderr_tty:
        p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                           timeout=300)
        return p.returncode, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    got = b""
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:             # the child closed the terminal
            break
        if not chunk:
            break
        got += chunk
    os.close(master)
    return p.wait(timeout=300), got.decode(errors="replace")


def test_progress_on_a_terminal_and_one_line_when_redirected():
    rc, err = _plan(stderr_tty=False)
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpengine plan: searched ") and "pruned) in " in lines[0]
    rc, err = _plan(stderr_tty=True)
    assert rc == 0
    assert "\r" in err and "layouts" in err and "pruned" in err        # tqdm's bar, redrawn in place
