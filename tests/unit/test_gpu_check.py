"""benchmarks/gpu_check.py and its modules without a GPU: argument parsing, the bandwidth and tokens/s
arithmetic, pytest's summary, the table and its verdicts, part time limits; benchmarks/gpu_check.sh's syntax,
shellcheck, and its MPI handling (smoke skip, wheel install, network-module retry) and hand-off to
gpu_check.py against a fake interpreter; and the whole script's control flow end to end in --cpu-smoke mode
(NumPy stand-ins, tiny sizes) through benchmarks/gpu_check.sh."""
from __future__ import annotations

import json
import os
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


# ------------------------------------------------------------------------ the shell wrapper

def test_shell_syntax_and_shellcheck():
    p = subprocess.run(["bash", "-n", str(SHELL)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make test-unit installs it where apt-get is usable as root)")
    # SC2163: `export $opts` exports the NAME=value words of one of mpi_world2's option strings on purpose
    # (test_shell_retries_mpi_network_modules_and_exports_the_one_that_works checks that it does)
    p = subprocess.run(["shellcheck", "--exclude=SC2163", str(SHELL)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


FAKE_PYTHON = r"""#!/usr/bin/env bash
# stands in for the interpreter: answers the wrapper's probes, "installs" MPICH, records the gpu_check.py call
F=@FAKE@
if [ "$1" = -c ]; then
  case "$2" in
    *sysconfig*) echo "$F/data" ;;
    *sys.version*) echo 3.12.0 ;;
    *Get_library_version*)
      [ -e "$F/installed" ] || { echo "ModuleNotFoundError: No module named 'mpi4py'"; exit 1; }
      echo "MPICH Version: 5.0.2" ;;
    *Barrier*) : ;;
    *) exit 9 ;;
  esac
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  printf '%s\0' "$@" > "$F/pip.args"
  mkdir -p "$F/data/bin" && cp "$F/mpiexec" "$F/data/bin/mpiexec" && touch "$F/installed"
  exit 0
fi
if [ "$1" = benchmarks/gpu_check.py ]; then
  printf '%s\0' "$@" > "$F/gpu_check.args"
  printf '%s\0' "PWD=$PWD" "PYTHONPATH=$PYTHONPATH" "MPICH_CH4_NETMOD=${MPICH_CH4_NETMOD:-}" \
    "FI_PROVIDER=${FI_PROVIDER:-}" > "$F/gpu_check.env"
  exit 3
fi
exit 9
"""
# a 2-rank world comes up only over OFI's tcp provider (as when the default network module fails)
FAKE_MPIEXEC = r"""#!/usr/bin/env bash
echo "${MPICH_CH4_NETMOD:-default}/${FI_PROVIDER:-default}" >> @FAKE@/mpiexec.calls
[ "${MPICH_CH4_NETMOD:-}" = ofi ] && [ "${FI_PROVIDER:-}" = tcp ] || exit 1
shift 2
exec "$@"
"""
FAKE_TIMEOUT = r"""#!/usr/bin/env bash
mkdir -p @FAKE@/timeout.d
printf '%s\0' "$@" > "@FAKE@/timeout.d/$(ls @FAKE@/timeout.d | wc -l)"
exec @TIMEOUT@ "$@"
"""


def _nul_list(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _run_wrapper(tmp_path, *args, wheel=False):
    """benchmarks/gpu_check.sh copied into a bare tree (no benchmarks/wheels, no .whl) with a fake
    interpreter at .venv/bin/python, fake mpiexec and a recording timeout first on PATH. Returns (the
    process, the fake's folder)."""
    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils' timeout")
    root, fake, stubs = tmp_path / "tree", tmp_path / "fake", tmp_path / "stubs"
    for d in (root / "benchmarks", root / ".venv" / "bin", fake / "wheels", stubs):
        d.mkdir(parents=True)
    shutil.copy(SHELL, root / "benchmarks" / "gpu_check.sh")
    for path, text in ((root / ".venv" / "bin" / "python", FAKE_PYTHON), (fake / "mpiexec", FAKE_MPIEXEC),
                       (stubs / "mpiexec", FAKE_MPIEXEC), (stubs / "timeout", FAKE_TIMEOUT)):
        path.write_text(text.replace("@FAKE@", str(fake)).replace("@TIMEOUT@", shutil.which("timeout")))
        path.chmod(0o755)
    if wheel:
        (fake / "wheels" / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "MPIEXEC", "PYTHONPATH", "MPICH_CH4_NETMOD", "FI_PROVIDER", "HPENGINE_MPICH_PREFIX")}
    env.update(PATH=f"{stubs}:{os.environ['PATH']}", GPU_CHECK_WHEELS=str(fake / "wheels"))
    p = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    return p, fake


def _backstop(fake: Path, root: Path) -> list[str]:
    """The arguments of the last timeout call (the one around gpu_check.py), checked to be that call."""
    calls = sorted((fake / "timeout.d").iterdir(), key=lambda f: int(f.name))
    args = _nul_list(calls[-1])
    assert args[:2] == ["-k", args[1]] and args[3:5] == [str(root / ".venv" / "bin" / "python"),
                                                         "benchmarks/gpu_check.py"], args
    return args


def test_shell_smoke_without_mpi_skips_two_ranks_and_passes_everything_on(tmp_path):
    """--cpu-smoke where mpi4py does not import: no install attempt, gpu_check.py run by the tree's
    .venv/bin/python from the tree's root with the tree first on PYTHONPATH, every argument passed on after
    an empty --mpiexec, under a timeout whose kill lands after gpu_check.py's own deadline and within 8
    minutes; the wrapper exits with gpu_check.py's status."""
    p, fake = _run_wrapper(tmp_path, "--cpu-smoke", "--deadline-s", "5", "--parts", "bandwidth")
    root = tmp_path / "tree"
    assert p.returncode == 3, p.stdout + p.stderr
    assert "the smoke run skips the 2-rank part" in p.stdout and "installing MPICH" not in p.stdout
    assert not (fake / "pip.args").exists() and not (fake / "mpiexec.calls").exists()
    assert _nul_list(fake / "gpu_check.args") == ["benchmarks/gpu_check.py", "--mpiexec", "", "--cpu-smoke",
                                                  "--deadline-s", "5", "--parts", "bandwidth"]
    env = dict(kv.split("=", 1) for kv in _nul_list(fake / "gpu_check.env"))
    assert env["PWD"] == str(root) and env["PYTHONPATH"].split(":")[0] == str(root)
    args = _backstop(fake, root)
    kill, limit = int(args[1]), int(args[2])
    assert opts.parse([]).deadline_s < limit and limit + kill <= 8 * 60


def test_shell_without_mpi_or_wheel_says_what_to_carry(tmp_path):
    """A GPU run (no --cpu-smoke) where MPI does not work and no wheel is found: it says to carry
    benchmarks/wheels, installs nothing and still runs gpu_check.py, with no mpiexec."""
    p, fake = _run_wrapper(tmp_path, "--parts", "tests")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "MPI not usable as found" in p.stdout and "carry benchmarks/wheels" in p.stdout
    assert not (fake / "pip.args").exists()
    assert _nul_list(fake / "gpu_check.args") == ["benchmarks/gpu_check.py", "--mpiexec", "", "--parts", "tests"]


def test_shell_installs_the_wheel_and_retries_mpi_network_modules(tmp_path):
    """MPI missing and a wheel in $GPU_CHECK_WHEELS: pip installs it offline from there; the installed
    mpiexec (in the interpreter's data folder) fails its 2-rank world with the default network module and
    works with OFI over tcp, which the wrapper exports to gpu_check.py along with that mpiexec."""
    p, fake = _run_wrapper(tmp_path, "--parts", "dp2", wheel=True)
    assert p.returncode == 3, p.stdout + p.stderr
    pip = _nul_list(fake / "pip.args")
    assert pip[:3] == ["-m", "pip", "install"] and pip[-1] == "mpich" and "--no-index" in pip
    assert pip[pip.index("--find-links") + 1] == str(fake / "wheels")
    assert (fake / "mpiexec.calls").read_text().split() == ["default/default", "ofi/tcp"]
    assert "MPI works with MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp" in p.stdout
    mpx = str(fake / "data" / "bin" / "mpiexec")
    assert f"MPI: MPICH Version: 5.0.2; mpiexec {mpx}" in p.stdout
    assert _nul_list(fake / "gpu_check.args") == ["benchmarks/gpu_check.py", "--mpiexec", mpx, "--parts", "dp2"]
    env = dict(kv.split("=", 1) for kv in _nul_list(fake / "gpu_check.env"))
    assert (env["MPICH_CH4_NETMOD"], env["FI_PROVIDER"]) == ("ofi", "tcp")


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
