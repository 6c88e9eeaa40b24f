"""benchmarks/gpu_check.py and its modules without a GPU: argument parsing, the bandwidth and tokens/s
arithmetic, pytest's summary, the table and its verdicts, part time limits, and the whole script's control
flow end to end in --cpu-smoke mode (NumPy stand-ins, tiny sizes) through benchmarks/gpu_check.sh."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))      # the gpu_check modules import each other by name

import gpu_check as gc  # noqa: E402 - the orchestrator
import gpu_check_bandwidth as bw  # noqa: E402
import gpu_check_options as opts  # noqa: E402
import gpu_check_report as rep  # noqa: E402


# ----------------------------------------------------------------------------------- arguments

def test_defaults_gpu_and_smoke():
    a = opts.parse([])
    assert a.parts == list(opts.PARTS) and not a.cpu_smoke
    assert (a.deadline_s, a.bw_params, a.bw_reps, a.steps) == (440, 256 << 20, 25, 20)
    assert a.bw_reps >= 20 and a.torch_attn == ["explicit", "sdpa"]
    s = opts.parse(["--cpu-smoke"])
    assert s.cpu_smoke and s.bw_params == 1 << 20 and s.steps == 3 and s.deadline_s == 240
    assert opts.model_shape(a, "gpt2") == dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, vocab=50304, batch=8)
    assert opts.model_shape(a, "ref") == dict(d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab=256, batch=8)
    assert opts.model_shape(opts.parse(["--gpt2-batch", "4"]), "gpt2")["batch"] == 4


def test_argument_values():
    assert opts.count("256M") == 256 << 20 and opts.count("64k") == 65536 and opts.count("1G") == 1 << 30
    assert opts.count("1000") == 1000
    assert opts.parse(["--bw-params", "1000003"]).bw_params == 1000000      # whole 16-byte vectors
    assert opts.parse(["--parts", "bandwidth, dp2"]).parts == ["bandwidth", "dp2"]
    assert opts.parse(["--torch-attn", "sdpa"]).torch_attn == ["sdpa"]
    for bad in (["--parts", "bandwidth,nope"], ["--parts", ""], ["--bw-params", "12x"], ["--bw-reps", "0"],
                ["--bw-params", "100"], ["--torch-attn", "flash"]):
        with pytest.raises(SystemExit):
            opts.parse(bad)


# ---------------------------------------------------------------------------------- arithmetic

def test_byte_model_and_rates():
    n = 256 << 20
    assert rep.adamw_traffic(n) == 28 * n                     # read p, g, m, v; write p, m, v
    assert rep.copy_nbytes_for(rep.adamw_traffic(n)) == 14 * n  # 14 read + 14 written per parameter
    assert rep.bandwidth(28 * n, 28 * n / 4e12) == pytest.approx(4e12)
    assert rep.bandwidth(1, 0.0) == float("inf")
    assert rep.tokens_per_s(8, 1024, 0.5) == pytest.approx(16384)
    assert rep.max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert rep.max_rel_diff([1.0, 2.002], [1.0, 2.0]) == pytest.approx(1e-3)
    assert rep.max_rel_diff([1.0], [1.0, 2.0]) == float("inf")
    assert rep.max_rel_diff([float("nan")], [1.0]) == float("inf")
    assert rep.max_rel_diff([], []) == float("inf")


def test_pack_segments_are_aligned_and_inside():
    n = 1 << 20
    offs, sizes = bw.pack_segments(n, 64)
    assert len(offs) == len(sizes) == 64
    assert all(o % 4 == 0 and s % 4 == 0 and s > 0 for o, s in zip(offs, sizes))
    assert all(a + s < b for a, s, b in zip(offs, sizes, offs[1:]))      # disjoint, in order, with gaps
    assert offs[-1] + sizes[-1] <= n and 0.85 * n < sum(sizes) <= 0.9 * n
    assert bw.pack_segments(n, 64) == (offs, sizes)                      # deterministic


def test_host_timer():
    calls = []
    t = bw.HostTimer()(lambda: calls.append(time.sleep(0.001)), 3)
    assert len(calls) == 3 and t >= 0.001


@pytest.mark.parametrize("text, want", [
    ("....\n3 failed, 60 passed, 2 skipped in 9.10s\n", dict(passed=60, failed=3, skipped=2, errors=0)),
    ("ss\n88 skipped in 0.38s", dict(passed=0, failed=0, skipped=88, errors=0)),
    ("== 5 passed, 2 warnings, 1 error in 3.1s ==", dict(passed=5, failed=0, skipped=0, errors=1)),
    ("x\n1 failed, 2 errors in 12.00s (0:00:12)\n", dict(passed=0, failed=1, skipped=0, errors=2)),
    ("no tests ran in 0.01s", dict(passed=0, failed=0, skipped=0, errors=0)),
])
def test_pytest_counts(text, want):
    got = rep.pytest_counts(text)
    assert {k: got[k] for k in want} == want


def test_pytest_counts_absent():
    assert rep.pytest_counts("ImportError: no module named cupy\n") is None


# ------------------------------------------------------------------------------------- table

def _timing(traffic, seconds, how=None):
    t = {"traffic": traffic, "median_s": seconds}
    return dict(t, how=how) if how else t


def _results(adamw_s=1.0, pack_s=1.0, hpe_tps=1200.0, staged=(4096, 4096), dp_loss=2.5):
    n, msg = 1 << 20, 1 << 22
    bw = {"n_params": n, "segments": 64, "timings": {
        "adamw": _timing(28 * n, adamw_s), "copy": _timing(28 * n, 0.9, "memcpy"),
        "pack": _timing(2 * msg, pack_s), "unpack": _timing(2 * msg, 2.0), "pack_copy": _timing(2 * msg, 0.9, "memcpy")}}
    ref_run = {"losses": [2.5, 2.4], "grad_norms": [1.0, 0.9]}
    dp = {"losses": [dp_loss, 2.4], "grad_norms": [1.0, 0.9], "cuda_aware": [False, False],
          "staged_bytes": list(staged), "devices": [0, 0], "backend": "cupy"}
    return {
        "tests": {"rc": 0, "counts": dict(passed=70, failed=0, skipped=2, errors=0, xfailed=0, xpassed=0, deselected=0)},
        "bandwidth": bw,
        "ref:hpengine": {"tokens_per_s": hpe_tps, "n_params": 10},
        "ref:torch-explicit": {"tokens_per_s": 1000.0, "n_params": 10},
        "ref:torch-sdpa": {"skipped": "no time left (20 s of the deadline)"},
        "gpt2:hpengine": {"error": "timed out after 120 s"},
        "gpt2:torch-explicit": {"tokens_per_s": 1000.0, "n_params": 10},
        "dp2:1": {"world": 1, "variants": {"single": ref_run}},
        "dp2:2": {"world": 2, "variants": {"dp": dp, "sharding": dict(dp)}},
    }


def _status(rows):
    return [(r.what.split(",")[0].split(" d")[0].strip(), r.status) for r in rows]


def test_rows_and_verdict_all_good():
    a = opts.parse([])
    rows = rep.build_rows(_results(), a)
    st = dict(_status(rows))
    assert st["GPU tests (pytest tests/gpu)"] == "PASS"
    assert st["AdamW kernel bandwidth"] == "PASS"               # 0.9 s copy / 1.0 s kernel = 90 %
    assert st["pack kernel bandwidth"] == "PASS"
    assert st["unpack kernel bandwidth (info)"] == "INFO"
    assert st["tokens/s ref GPT"] == "PASS"                     # 1.2x
    assert st["vs torch sdpa attention (info)"] == "SKIP"
    assert st["tokens/s GPT-2 small"] == "FAIL"                 # hpengine side timed out
    assert st["2 ranks on 1 GPU"] == "PASS"
    assert [r.status for r in rows if r.what.startswith("2 ranks")] == ["PASS", "PASS"]
    assert rep.verdict(rows) == 1
    assert rep.verdict([r for r in rows if "GPT-2" not in r.what]) == 0
    adamw = next(r for r in rows if r.what.startswith("AdamW"))
    assert adamw.detail["ratio"] == pytest.approx(0.9) and "90% of copy" in adamw.value and "memcpy" in adamw.value


def test_rows_failures():
    a = opts.parse([])
    rows = rep.build_rows(_results(adamw_s=1.2, pack_s=1.5, hpe_tps=900.0, staged=(0, 4096), dp_loss=2.6), a)
    st = {r.what: r.status for r in rows}
    assert st[next(k for k in st if k.startswith("AdamW"))] == "FAIL"     # 75 % of the copy
    assert st[next(k for k in st if k.startswith("pack"))] == "FAIL"
    assert st[next(k for k in st if k.startswith("tokens/s ref"))] == "FAIL"   # 0.9x
    assert [r.status for r in rows if r.what.startswith("2 ranks")] == ["FAIL", "FAIL"]
    # the same figures in a smoke run: speeds are not judged, 2-rank equality still is
    s = rep.build_rows(_results(adamw_s=1.2, hpe_tps=900.0, staged=(0, 0)), opts.parse(["--cpu-smoke"]))
    sst = {r.what: r.status for r in s}
    assert sst[next(k for k in sst if k.startswith("AdamW"))] == "smoke"
    assert [r.status for r in s if r.what.startswith("2 ranks")] == ["PASS", "PASS"]


def test_rows_parameter_mismatch_and_missing_parts():
    a = opts.parse(["--parts", "ref,dp2,tests"])
    res = _results()
    res["ref:torch-explicit"]["n_params"] = 11
    del res["dp2:2"]
    res["tests"] = {"rc": 2, "error": "timed out after 150 s", "counts": None}
    rows = rep.build_rows(res, a)
    assert len(rows) == 5                      # tests, ref vs explicit and sdpa, two 2-rank rows
    ref = next(r for r in rows if r.what.startswith("tokens/s"))
    assert ref.status == "FAIL" and "params differ" in ref.value
    assert rows[0].status == "FAIL" and "timed out" in rows[0].value
    assert all(r.status == "FAIL" and "not run" in r.value for r in rows if r.what.startswith("2 ranks"))
    assert not any("bandwidth" in r.what for r in rows)


def test_table_formats():
    rows = [rep.Row("a", "1", ">= 2", "FAIL"), rep.Row("longer what", "x|y", "-", "INFO")]
    text = rep.format_table(rows).splitlines()
    assert text[0].split() == ["what", "value", "target", "status"] and set(text[1]) <= {"-", " "}
    assert text[2].index("1") == text[3].index("x|y") == text[0].index("value")
    md = rep.markdown_table(rows).splitlines()
    assert md[0] == "| what | value | target | status |" and md[3] == "| longer what | x\\|y | - | INFO |"


# ---------------------------------------------------------------------------- orchestration

def test_part_time_limit_and_deadline(tmp_path):
    a = opts.parse(["--cpu-smoke", "--deadline-s", "60"])
    r = gc.Runner(a, tmp_path)
    t0 = time.monotonic()
    res = r.run("sleepy", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                limit=1.5, parse_json=False)
    assert time.monotonic() - t0 < 15 and "timed out" in res["error"] and "started" in res["log"]
    assert "===== sleepy" in (tmp_path / "gpu_check.log").read_text()
    late = gc.Runner(opts.parse(["--cpu-smoke", "--deadline-s", "5"]), tmp_path)
    assert "no time left" in late.run("late", [sys.executable, "-c", "pass"], limit=30)["skipped"]
    assert "no time left" in late.run("opt", [sys.executable, "-c", "pass"], limit=4, optional=True)["skipped"]


def test_shell_header_states_the_device_invocation_and_fits_8_minutes():
    head = SHELL.read_text().split("set -u")[0]
    timeout_s = int(re.search(r"timeout_s:\s*(\d+)", head).group(1))
    assert "bash benchmarks/gpu_check.sh" in head and '["benchmarks/wheels"]' in head
    backstop = int(re.search(r"timeout -k (\d+) (\d+)", SHELL.read_text()).group(2))
    assert opts.parse([]).deadline_s < backstop <= 480 - 10 < timeout_s <= 600


@pytest.mark.timeout(240)
def test_cpu_smoke_end_to_end(tmp_path):
    """The whole control flow through the shell wrapper: every part runs (torch parts skip when this
    interpreter has no torch), the table comes last, the JSON and Markdown land in $OUT."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), TORCH_PYTHON=sys.executable)
    env.pop("MPIEXEC", None)
    p = subprocess.run(["bash", str(SHELL), "--cpu-smoke", "--deadline-s", "200"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=230, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    tail = p.stdout.strip().splitlines()
    table_start = max(i for i, s in enumerate(tail) if s.startswith("what "))
    names = [s.split("  ")[0] for s in tail[table_start + 2:]]
    assert names[0] == "GPU tests (pytest tests/gpu)" and any(n.startswith("AdamW") for n in names)
    assert sum(n.startswith("tokens/s") for n in names) == 2 and sum(n.startswith("2 ranks") for n in names) == 2
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["mode"] == "cpu-smoke" and len(doc["rows"]) == len(names)
    assert {r["status"] for r in doc["rows"]} <= {"PASS", "INFO", "SKIP", "smoke"}
    by = {r["what"]: r for r in doc["rows"]}
    assert by["GPU tests (pytest tests/gpu)"]["status"] == "PASS"
    assert doc["results"]["bandwidth"]["timings"]["adamw"]["traffic"] == 28 * (1 << 20)
    assert doc["results"]["ref:hpengine"]["tokens_per_s"] > 0
    assert doc["results"]["calibrate"]["cluster"]["tflops_fp32"] > 0      # --device cpu in the smoke run
    mpi = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpi:
        assert [r["status"] for r in doc["rows"] if r["what"].startswith("2 ranks")] == ["PASS", "PASS"]
    assert "| what | value | target | status |" in (tmp_path / "gpu_check.md").read_text()
    assert "===== dp2:2" in (tmp_path / "gpu_check.log").read_text() or not mpi


@pytest.mark.timeout(120)
def test_gpu_profile_cpu_smoke(tmp_path):
    """benchmarks/gpu_profile.py's control flow on NumPy: both models, fused on and off, the report in $OUT
    (the profiler part needs a GPU and is skipped)."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--cpu-smoke", "--rounds", "1",
                        "--steps", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
                       check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    report = (tmp_path / "gpu_profile.txt").read_text()
    assert report == p.stdout
    assert report.count("fused on / off step time:") == 2 and "failed" not in report
