"""The GPU check users run (through benchmarks/gpu_check.sh): runs each part as a subprocess with its own
time limit inside one overall deadline, so a hang or crash costs only that part; prints each part's rows
as soon as it has finished (and rewrites gpu_check.json/.md/.log in --out, $OUT), so a run cut short still
reports, and the whole table last. The parts' work lives in gpu_check_hpengine.py, gpu_check_torch.py,
gpu_check_attention.py, gpu_check_kernels.py (documents, muon) and the package's checks (hpengine.doctor: the
bandwidth part, and `hpengine doctor` as the doctor part); benchmarks/README.md describes the parts and targets.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the sibling modules import each other by name, whether this file runs as a script or is loaded by path
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gpu_check_attention import worker_attention, worker_attention_torch        # noqa: E402
from gpu_check_hpengine import TRANSPORTS, worker_corpus, worker_hpengine, worker_losses  # noqa: E402
from gpu_check_kernels import doc_shape, rows_documents, rows_muon, worker_documents, worker_muon  # noqa: E402
from gpu_check_models import rows_attention, rows_speed                        # noqa: E402
from gpu_check_options import PARTS, SPEED_PARTS, attn_shape, model_shape, parse, part_limit, save_result  # noqa: E402
from gpu_check_report import (Row, cluster_table, doctor_lines, format_table, markdown_table,  # noqa: E402
                              pytest_counts, rows_bandwidth, rows_calibrate, rows_doctor, rows_dp2, rows_tests,
                              rows_transports, verdict)
from gpu_check_torch import worker_torch                                        # noqa: E402


# ------------------------------------------------------------------------------ orchestrator

class Deadline:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.seconds - self.elapsed()


class Runner:
    """Runs each part as a subprocess (its own session, so a timeout ends mpiexec and its ranks too) with
    a limit clipped to the overall deadline; collects the results and everyone's output."""

    def __init__(self, a, workdir: Path):
        self.a, self.workdir = a, workdir
        self.deadline = Deadline(a.deadline_s)
        self.results: dict = {}
        self.log_path = workdir / "gpu_check.log"
        self.proc = None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", CUPY_TF32="0", HPENGINE_CACHE=str(workdir / "cache"),
                        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if a.cpu_smoke:
            self.env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def note(self, msg: str) -> None:
        print(f"[{self.deadline.elapsed():6.1f} s] {msg}", flush=True)

    def run(self, key: str, cmd: list[str], limit: float, optional: bool = False, parse_json: bool = True) -> dict:
        budget = min(limit, self.deadline.remaining() - 2)
        if budget < (limit if optional else min(10.0, limit)):
            res = {"skipped": f"no time left ({self.deadline.remaining():.0f} s of the deadline)"}
            self.note(f"{key}: skipped, {res['skipped']}")
            self.results[key] = res
            return res
        result_path = self.workdir / f"{key.replace(':', '_')}.json"
        result_path.unlink(missing_ok=True)
        if parse_json:
            cmd = cmd + ["--result", str(result_path)]
        t0 = time.monotonic()
        part_log = self.workdir / f"{key.replace(':', '_')}.log"
        with open(part_log, "w") as lf:
            try:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=lf, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            except OSError as e:                         # e.g. a --torch-python that does not exist
                res = {"error": f"cannot start {cmd[0]}: {e.strerror or e}"}
                self.note(f"{key}: FAILED ({res['error']})")
                self.results[key] = res
                return res
            timed_out = False
            try:
                rc = self.proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
                self.kill()
            except BaseException:                        # stopped by a signal: end the part's processes too
                self.kill()
                raise
            finally:
                self.proc = None
        wall = time.monotonic() - t0
        text = part_log.read_text(errors="replace")
        with open(self.log_path, "a") as f:
            f.write(f"\n===== {key}: {' '.join(cmd)}\n===== rc {rc}, {wall:.1f} s{', TIMED OUT' if timed_out else ''}\n")
            f.write(text)
        res: dict = {}
        if parse_json and result_path.is_file():
            try:
                res = json.loads(result_path.read_text())
            except ValueError as e:
                res = {"error": f"unreadable result: {e}"}
        res.update(rc=rc, wall_s=round(wall, 1))
        if timed_out:
            res["error"] = f"timed out after {budget:.0f} s"
        elif rc != 0 and "error" not in res and key not in ("tests", "doctor"):   # failures are their rows
            res["error"] = f"exit status {rc}: {_last_line(text)}"
        if res.get("error"):
            tail = "\n".join("    " + s for s in text.rstrip().splitlines()[-15:])
            self.note(f"{key}: FAILED ({res['error']}) after {wall:.1f} s; last lines:\n{tail}")
        else:
            self.note(f"{key}: done in {wall:.1f} s")
        res["log"] = text if not parse_json else None
        self.results[key] = res
        return res

    def kill(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _last_line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1][:200] if lines else "no output"


def find_mpiexec(given: str | None) -> str | None:
    if given is not None:
        return given or None                                 # --mpiexec '' means: none usable
    env = os.environ.get("MPIEXEC")
    if env:
        return env
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def orchestrate(a) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    runner = Runner(a, workdir)
    me = [sys.executable, str(Path(__file__).resolve())] + (["--cpu-smoke"] if a.cpu_smoke else [])
    torch_cmd = [a.torch_python, str(Path(__file__).resolve())] + (["--cpu-smoke"] if a.cpu_smoke else [])
    mpiexec = find_mpiexec(a.mpiexec)
    results = runner.results
    rows: list[Row] = []

    def on_term(signum, _frame):
        raise SystemExit(f"gpu_check: stopped by signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    runner.note(f"gpu_check {'CPU smoke' if a.cpu_smoke else 'GPU'} run: parts {','.join(a.parts)}; deadline "
                f"{a.deadline_s:.0f} s; work folder {workdir}; mpiexec {mpiexec or 'none'}; torch python "
                f"{a.torch_python}")
    speed_args = ["--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps), "--warmup-s", str(a.warmup_s),
                  "--llama-batch", str(a.llama_batch), "--gpt2-batch", str(a.gpt2_batch),
                  "--hpe-attention", a.hpe_attention] + (["--no-compile"] if a.no_compile else [])
    data = None

    def part_tests():
        cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
        if _has_module("pytest_timeout"):
            cmd.append(f"--timeout={int(part_limit(a, 'tests'))}")
        r = runner.run("tests", cmd, part_limit(a, "tests"), parse_json=False)
        r["counts"] = pytest_counts(r.pop("log") or "")
        if r["counts"] is None and "error" not in r:
            r["error"] = f"no pytest summary (exit status {r['rc']})"

    def part_speed(model):
        if data is None:
            results[f"{model}:hpengine"] = {"error": "no corpus"}
            return
        runner.run(f"{model}:hpengine", me + ["--worker", "hpengine", "--model", model, "--data", data] + speed_args,
                   part_limit(a, f"{model}:hpengine"))
        runner.run(f"{model}:torch", torch_cmd + ["--worker", "torch", "--model", model] + speed_args,
                   part_limit(a, f"{model}:torch"))

    def part_attention():
        reps = ["--attn-reps", str(a.attn_reps)]
        runner.run("attention:hpengine", me + ["--worker", "attention"] + reps, part_limit(a, "attention:hpengine"))
        runner.run("attention:torch", torch_cmd + ["--worker", "attention_torch"] + reps,
                   part_limit(a, "attention:torch"))

    def part_documents():
        runner.run("documents", me + ["--worker", "documents", "--attn-reps", str(a.attn_reps)],
                   part_limit(a, "documents"))

    def part_muon():
        runner.run("muon", me + ["--worker", "muon"], part_limit(a, "muon"))

    def part_bandwidth():
        runner.run("bandwidth", me + ["--worker", "bandwidth", "--bw-params", str(a.bw_params), "--bw-reps",
                                      str(a.bw_reps), "--bw-inner", str(a.bw_inner), "--pack-segments",
                                      str(a.pack_segments)], part_limit(a, "bandwidth"))

    def part_dp2():
        if mpiexec is None or data is None:
            why = {"skipped" if a.cpu_smoke else "error": "no mpiexec" if mpiexec is None else "no corpus"}
            results["dp2:1"], results["dp2:2"] = dict(why), dict(why)
            return
        common = ["--worker", "losses", "--data", data, "--dp2-steps", str(a.dp2_steps)] + speed_args[:6]
        runner.run("dp2:1", [mpiexec, "-n", "1"] + me + common + ["--variants", "single"], part_limit(a, "dp2-1"))
        variants = ",".join(("dp", "sharding") + TRANSPORTS)
        runner.run("dp2:2", [mpiexec, "-n", "2"] + me + common + ["--variants", variants], part_limit(a, "dp2-2"))

    def part_doctor():         # the installation's checks (2 ranks: device buffers through MPI); the earlier parts
        launcher = [mpiexec, "-n", "2"] if mpiexec else []          # have built every kernel on the device
        r = runner.run("doctor", launcher + [sys.executable, "-m", "hpengine", "doctor", "--kernels", "none"],
                       part_limit(a, "doctor"), parse_json=False)
        r["lines"] = doctor_lines(r.pop("log") or "")

    def part_calibrate():      # the planner's GPU figures (plan_gpu.py) for clusters/h200_node.toml; if time is left
        r = runner.run("calibrate", [sys.executable, "-m", "hpengine", "plan", "--calibrate", "--device",
                                     "cpu" if a.cpu_smoke else "gpu"], part_limit(a, "calibrate"), optional=True,
                       parse_json=False)
        r["cluster"] = cluster_table(r.pop("log") or "")

    run_part = {"tests": part_tests, "llama": lambda: part_speed("llama"), "gpt2": lambda: part_speed("gpt2"),
                "attention": part_attention, "documents": part_documents, "muon": part_muon,
                "bandwidth": part_bandwidth, "dp2": part_dp2, "doctor": part_doctor,
                "calibrate": part_calibrate}
    try:
        if any(p in a.parts for p in SPEED_PARTS + ("dp2",)):
            data = runner.run("corpus", me + ["--worker", "corpus"], part_limit(a, "corpus")).get("path")
        for part in (p for p in PARTS if p in a.parts):
            run_part[part]()
            print(format_table(build_rows(results, a, [part])), flush=True)      # this part's rows, now
            write_outputs(a, build_rows(results, a), results, runner)
    except (SystemExit, KeyboardInterrupt) as e:
        runner.kill()
        runner.note(f"stopped early: {e}")
    finally:
        rows = build_rows(results, a)
        write_outputs(a, rows, results, runner)
        print(f"\ngpu_check ({'CPU smoke: NumPy stand-ins, speeds not judged' if a.cpu_smoke else 'GPU'}), "
              f"{runner.deadline.elapsed():.0f} s; logs: {runner.log_path}")
        print(format_table(rows), flush=True)
    return verdict(rows)


def build_rows(results: dict, a, parts=None) -> list[Row]:
    """The table, in the parts' order, from their results (parts not asked for are left out)."""
    rows: list[Row] = []
    smoke, asked = a.cpu_smoke, a.parts if parts is None else parts
    for part in (p for p in PARTS if p in asked):
        if part == "tests":
            rows += rows_tests(results.get("tests"), smoke)
        elif part in SPEED_PARTS:
            rows += rows_speed(part, model_shape(a, part), results.get(f"{part}:hpengine"),
                               results.get(f"{part}:torch"), smoke)
        elif part == "attention":
            rows += rows_attention(attn_shape(a), results.get("attention:hpengine"), results.get("attention:torch"),
                                   smoke)
        elif part == "documents":
            rows += rows_documents(doc_shape(a), results.get("documents"), smoke)
        elif part == "muon":
            rows += rows_muon(results.get("muon"), smoke)
        elif part == "bandwidth":
            rows += rows_bandwidth(results.get("bandwidth"), smoke)
        elif part == "dp2":
            rows += rows_dp2(results.get("dp2:1"), results.get("dp2:2"), smoke, a.loss_rtol, a.gnorm_rtol)
            rows += rows_transports(results.get("dp2:2"), smoke, a.loss_rtol)
        elif part == "doctor":
            rows += rows_doctor(results.get("doctor"))
        elif part == "calibrate":
            rows += rows_calibrate(results.get("calibrate"))
    return rows


def _has_module(name: str) -> bool:
    r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, check=False)
    return r.returncode == 0


def write_outputs(a, rows: list[Row], results: dict, runner: Runner) -> None:
    if not a.out:
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "mode": "cpu-smoke" if a.cpu_smoke else "gpu",
           "elapsed_s": round(runner.deadline.elapsed(), 1), "argv": sys.argv[1:],
           "rows": [asdict(r) for r in rows],
           "results": {k: {kk: vv for kk, vv in v.items() if kk != "log"} for k, v in results.items()}}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "gpu_check.md").write_text(f"GPU check, {doc['when']} ({doc['mode']}, {doc['elapsed_s']} s)\n\n"
                                      + markdown_table(rows) + "\n")
    if runner.log_path.is_file():
        shutil.copyfile(runner.log_path, out / "gpu_check.log")


# ------------------------------------------------------------------------- inside a part's process

def worker_bandwidth(a) -> dict:
    """The bandwidth part: hpengine.doctor.bandwidth at the sizes asked (NumPy twins with --cpu-smoke)."""
    from hpengine.doctor import bandwidth                # noqa: PLC0415 - the torch interpreter never gets here
    xp, timer, device = bandwidth.device_setup(a.cpu_smoke, "cpu (NumPy twins)")
    return bandwidth.measure(xp, timer, device, a.bw_params, a.bw_reps, a.bw_inner, a.pack_segments,
                             warm=2 if a.cpu_smoke else 3)


WORKERS = {"corpus": worker_corpus, "bandwidth": worker_bandwidth, "hpengine": worker_hpengine,
           "torch": worker_torch, "losses": worker_losses, "attention": worker_attention,
           "attention_torch": worker_attention_torch, "documents": worker_documents, "muon": worker_muon}


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        res = WORKERS[a.worker](a)
        if res is not None:
            save_result(a.result, res)
            print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, default=str))
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
