"""`make test` runs every part even when one fails and ends with a table of parts: the real Makefile with a
part forced to fail, a scratch Makefile whose parts pass, fail and skip in each way, and the pytest summary
lines the table reads."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import parts  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def _env():
    """The environment without what an enclosing make or make test passes down (flags, variables, notes)."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PART_NOTES")}


def _rows(out: str) -> dict[str, list[str]]:
    table = out[out.index("== make test:"):].splitlines()[2:]
    rows = table[:next(i for i, row in enumerate(table) if row.startswith("=="))]
    return {row.split()[0]: row.split(None, 3)[1:] for row in rows}


def test_make_test_runs_every_part_after_a_failure_and_prints_the_table():
    env = _env()
    if subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT, env=env).returncode != 0:
        pytest.skip(".venv is missing or older than setup.cfg: this test would reinstall it")
    # test-mpi fails at once (MPIEXEC=false) at every world size; the parts after it still run
    p = subprocess.run(["make", "test", "TEST_PARTS=test-mpi test-imports test-interop", "MPIEXEC=false",
                        "HF_TESTS=0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Contracts: " in out and "KEPT" in out, out          # test-imports ran after test-mpi failed
    rows = _rows(out)
    assert list(rows) == ["test-mpi", "test-imports", "test-interop"], out
    assert rows["test-mpi"][0] == "FAILED" and "-n 1 -n 2 -n 4 -n 8" in rows["test-mpi"][2], out
    assert rows["test-imports"][0] == "passed", out
    assert rows["test-interop"][0] == "skipped" and "HF_TESTS=0" in rows["test-interop"][2], out
    assert "== 1 of 3 parts failed: test-mpi" in out, out


def test_the_table_tells_passed_failed_and_each_kind_of_skip(tmp_path):
    (tmp_path / "test_all_skip.py").write_text(textwrap.dedent("""
        import pytest
        @pytest.mark.skip(reason="no SLURM on this machine")
        def test_a(): pass
        """))
    (tmp_path / "test_mixed.py").write_text("def test_ok(): pass\ndef test_bad(): assert 1 == 2\n")
    py = sys.executable
    (tmp_path / "Makefile").write_text(textwrap.dedent(f"""
        NOTE := note() {{ echo "$$*"; [ -z "$${{PART_NOTES:-}}" ] || echo "$$*" >>"$$PART_NOTES"; }};
        all-skip:
        \t{py} -m pytest -q -rs -p no:cacheprovider test_all_skip.py
        mixed:
        \t{py} -m pytest -q -p no:cacheprovider test_mixed.py
        noted:
        \t@$(NOTE) note "the wheel is not installable here: this part skips"
        fine:
        \t@echo all good
        """))
    p = subprocess.run([py, str(ROOT / "tests" / "parts.py"), "--make", f"make -C {tmp_path}",
                        "mixed", "all-skip", "noted", "fine"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    rows = _rows(p.stdout)
    assert rows["mixed"][:1] == ["FAILED"] and rows["mixed"][2].startswith("1 failed, 1 passed"), p.stdout
    assert rows["all-skip"][0] == "skipped" and "1 skipped; no SLURM on this machine" in rows["all-skip"][2]
    assert rows["noted"] == ["skipped", "0:00", "the wheel is not installable here: this part skips"]
    assert rows["fine"] == ["passed", "0:00"]
    assert "== 1 of 4 parts failed: mixed" in p.stdout


def test_pytest_summaries_are_summed_over_the_runs_of_a_part():
    lines = ["...F..", "4 failed, 1618 passed, 6 skipped, 3 warnings in 1400.20s (0:23:20)",
             "== tests/mpi under mpiexec -n 2", "========= 435 passed, 115 skipped in 49.56s =========",
             "1 error in 0.50s", "test_x.py: 12 passed is what this line says, but it is not a summary"]
    assert parts.counts(lines) == {"failed": 4, "passed": 2053, "skipped": 121, "error": 1}
    assert parts.verdict({"rc": 0, "counts": {"skipped": 3}, "notes": []}) == "skipped"
    assert parts.verdict({"rc": 0, "counts": {}, "notes": []}) == "passed"
    assert parts.verdict({"rc": 2, "counts": {"passed": 5}, "notes": []}) == "FAILED"
