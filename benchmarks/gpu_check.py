"""GPU check (issue 8, item 5): GPU tests, kernel bandwidth, tokens/s vs PyTorch eager, a 2-rank staged run.

Run through benchmarks/gpu_check.sh, which sets up MPI and PYTHONPATH on a machine without network access
and states the device-tool invocation. Parts, each a subprocess with its own time limit inside one overall
deadline (default 440 s), so a hang or crash in one part costs only that part:

  tests      pytest tests/gpu -q                      pass/fail counts; target: none failed
  bandwidth  fused AdamW kernel and pack kernel vs a device-to-device copy of the same bytes, CUDA events,
             warm-up, median of >= 20 repetitions at 256M parameters; target >= 85 % of the copy
  ref        tokens/s of the reference GPT (hpengine defaults) on hpengine (runtime.backend = cupy)
             next to PyTorch eager on the same model, GPU and precision (float32, TF32 off); target >= 1.0x
  dp2        `mpiexec -n 2` data parallel (and sharding stage 2), both ranks on the one GPU
             (runtime.share_devices = true), host-staged MPI (runtime.cuda_aware_mpi = false): losses and
             gradient norms equal the 1-rank run's to float32 tolerance, and the staging buffers were used
  gpt2       tokens/s of a GPT-2-small-sized model, hpengine vs PyTorch eager, as for ref

The table comes last on stdout; with $OUT (or --out) set, gpu_check.json, gpu_check.md and gpu_check.log
(every part's output) are written there. --cpu-smoke runs the same control flow on the CPU with NumPy
stand-ins (host timers instead of CUDA events, runtime.backend = numpy, torch on the CPU when importable)
and tiny sizes; its speed figures mean nothing and are not judged (status "smoke").

Byte model of the AdamW kernel (the issue's 28 B per float32 parameter): read p, g, m, v and write p, m, v,
7 x 4 bytes. The 1-byte decay mask it also reads is not counted (counting it would add 1/28 = 3.6 % to the
kernel's figure). The copy it is measured against copies 14 bytes per parameter: 14 read + 14 written.
Bandwidths count bytes read plus bytes written, for the kernels and for the copies alike.

GPT-2-small-sized model: d_model 768, 12 layers, 12 heads, seq 1024, vocab 50304 (GPT-2's 50257 padded to
a multiple of 64), untied head like the reference model (163M parameters), batch 8 (8192 tokens per step);
the tokens are the built-in byte corpus (ids < 256), which does not change the cost of a step.

Only the standard library is imported at module level: the orchestrator stays light, and the PyTorch worker
runs under whichever interpreter has torch (--torch-python).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("tests", "bandwidth", "ref", "dp2", "gpt2")       # the order they run in
ADAMW_BYTES_PER_PARAM = 28        # read p, g, m, v + write p, m, v (float32); the mask byte not counted
BW_TARGET = 0.85                  # kernel bandwidth / copy bandwidth
SPEED_TARGET = 1.0                # hpengine tokens/s / PyTorch eager tokens/s
LOSS_RTOL = 1e-5                  # 2-rank vs 1-rank loss, float32
GNORM_RTOL = 1e-4                 # 2-rank vs 1-rank gradient norm, float32 (reduced in another order)

# model shapes: (d_model, n_layers, n_heads, seq_len, vocab, batch)
MODELS = {
    "ref": dict(d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab=256, batch=8),
    "gpt2": dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, vocab=50304, batch=8),
}
SMOKE_MODELS = {
    "ref": dict(d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=256, batch=4),
    "gpt2": dict(d_model=48, n_layers=2, n_heads=4, seq_len=32, vocab=320, batch=2),
}
# per-part limits in seconds (GPU, smoke); the overall deadline clips them further
LIMITS = {
    "corpus": (30, 30), "tests": (150, 60), "bandwidth": (60, 30),
    "hpengine": (120, 45), "torch": (75, 45), "dp2-1": (60, 45), "dp2-2": (90, 45),
}


# ------------------------------------------------------------------------------ arguments

def count(text: str) -> int:
    """'256M' -> 268435456, '4k' -> 4096, '1000' -> 1000 (binary suffixes k, M, G)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count such as 1000, 64k, 256M or 1G")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def name_list(valid):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(valid)}")
        return items
    return parse


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the whole control flow on the CPU: NumPy stand-ins, tiny sizes, nothing judged "
                        "but errors and the 2-rank equality")
    p.add_argument("--parts", type=name_list(PARTS), default=list(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="overall time limit of the parts in seconds (default 440; 240 with --cpu-smoke)")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="folder for gpu_check.json/.md/.log (default $OUT; none when unset)")
    p.add_argument("--mpiexec", default=None, help="mpiexec for the dp2 part (default $MPIEXEC, the one beside "
                   "the interpreter, or PATH's)")
    p.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON") or sys.executable,
                   help="interpreter with torch for the PyTorch side (default $TORCH_PYTHON or this one)")
    p.add_argument("--torch-attn", type=name_list(("explicit", "sdpa")), default=["explicit", "sdpa"],
                   help="PyTorch attention variants; the first is judged (explicit = the same math as "
                        "hpengine), the others are shown for information when time allows")
    p.add_argument("--bw-params", type=count, default=None, help="AdamW parameters (default 256M; smoke 1M)")
    p.add_argument("--bw-reps", type=int, default=None, help="timed repetitions (default 25; smoke 3)")
    p.add_argument("--bw-inner", type=int, default=None,
                   help="launches per timed repetition (default 5; smoke 1): back to back, so the host's "
                        "per-call checks do not leave the GPU idle inside the timed region")
    p.add_argument("--pack-segments", type=int, default=64, help="segments the pack kernel gathers (default 64)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; smoke 3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps at least (default 3; smoke 1)")
    p.add_argument("--warmup-s", type=float, default=None, help="untimed seconds at least (default 2; smoke 0)")
    p.add_argument("--gpt2-batch", type=int, default=None, help="batch of the GPT-2-small model (default 8)")
    p.add_argument("--dp2-steps", type=int, default=6, help="steps of the 1-rank and 2-rank runs (default 6)")
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL, help=f"default {LOSS_RTOL:g}")
    p.add_argument("--gnorm-rtol", type=float, default=GNORM_RTOL, help=f"default {GNORM_RTOL:g}")
    # internal: run one part's work in this process and write its result as JSON
    p.add_argument("--worker", choices=("corpus", "bandwidth", "hpengine", "torch", "losses"), help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=tuple(MODELS), default="ref", help=argparse.SUPPRESS)
    p.add_argument("--attn", choices=("explicit", "sdpa"), default="explicit", help=argparse.SUPPRESS)
    p.add_argument("--variants", default="single", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    for name, gpu, cpu in (("deadline_s", 440.0, 240.0), ("bw_params", 256 << 20, 1 << 20), ("bw_reps", 25, 3),
                           ("bw_inner", 5, 1), ("steps", 20, 3), ("warmup_steps", 3, 1), ("warmup_s", 2.0, 0.0),
                           ("gpt2_batch", 8, 2)):
        if getattr(a, name) is None:
            setattr(a, name, cpu if smoke else gpu)
    for name in ("bw_reps", "bw_inner", "steps", "pack_segments", "gpt2_batch", "dp2_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.bw_params < 1024:
        p.error("--bw-params must be >= 1024")
    a.bw_params -= a.bw_params % 4          # whole 16-byte vectors; 14 bytes per parameter fill whole floats
    return a


def model_shape(a, name: str) -> dict:
    shape = dict((SMOKE_MODELS if a.cpu_smoke else MODELS)[name])
    if name == "gpt2" and not a.cpu_smoke:
        shape["batch"] = a.gpt2_batch
    return shape


def model_label(shape: dict) -> str:
    return (f"d{shape['d_model']} L{shape['n_layers']} H{shape['n_heads']} T{shape['seq_len']} "
            f"V{shape['vocab']} B{shape['batch']}")


# ------------------------------------------------------------------------- arithmetic (pure)

def adamw_traffic(n_params: int) -> int:
    """Bytes the fused AdamW moves for n float32 parameters (read p, g, m, v; write p, m, v)."""
    return ADAMW_BYTES_PER_PARAM * n_params


def copy_nbytes_for(traffic: int) -> int:
    """Size of the device-to-device copy whose traffic (bytes read + bytes written) equals `traffic`."""
    return traffic // 2


def bandwidth(traffic: int, seconds: float) -> float:
    """Bytes per second, counting bytes read plus bytes written."""
    return traffic / seconds if seconds > 0 else float("inf")


def tokens_per_s(batch: int, seq_len: int, step_s: float) -> float:
    return batch * seq_len / step_s if step_s > 0 else float("inf")


def max_rel_diff(got, want) -> float:
    """Largest |got - want| / |want| over two equal-length sequences (inf when lengths differ or a value
    is not finite)."""
    got, want = list(got), list(want)
    if len(got) != len(want) or not got:
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        if not (math.isfinite(g) and math.isfinite(w)):
            return float("inf")
        worst = max(worst, abs(g - w) / abs(w) if w else abs(g))
    return worst


_PYTEST_WORDS = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors",
                 "errors": "errors", "xfailed": "xfailed", "xpassed": "xpassed", "deselected": "deselected"}


def pytest_counts(text: str) -> dict | None:
    """Counts from pytest's last summary line ('3 failed, 60 passed, 2 skipped in 9.1s'); None if absent."""
    for line in reversed(text.strip().splitlines()):
        if not re.search(r"\b(passed|failed|skipped|errors?|no tests ran|deselected)\b", line) or \
                not re.search(r"\bin [\d.]+s\b", line):
            continue
        counts = dict.fromkeys(("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "deselected"), 0)
        for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", line):
            counts[_PYTEST_WORDS[word]] += int(num)
        return counts
    return None


# ------------------------------------------------------------------------------- the table

@dataclass
class Row:
    what: str
    value: str
    target: str = "-"
    status: str = "INFO"          # PASS | FAIL | INFO | SKIP | smoke
    detail: dict = field(default_factory=dict)


def judged(ok: bool, smoke: bool, judge_in_smoke: bool = False) -> str:
    if smoke and not judge_in_smoke:
        return "smoke"
    return "PASS" if ok else "FAIL"


def format_table(rows: list[Row]) -> str:
    """Plain-text table (what, value, target, status), columns padded to their widest cell."""
    head = ("what", "value", "target", "status")
    cells = [head] + [(r.what, r.value, r.target, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    line = lambda c: "  ".join(s.ljust(w) for s, w in zip(c, widths)).rstrip()   # noqa: E731
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(c) for c in cells[1:]])


def markdown_table(rows: list[Row]) -> str:
    esc = lambda s: s.replace("|", "\\|")                                          # noqa: E731
    out = ["| what | value | target | status |", "|---|---|---|---|"]
    out += [f"| {esc(r.what)} | {esc(r.value)} | {esc(r.target)} | {r.status} |" for r in rows]
    return "\n".join(out)


def verdict(rows: list[Row]) -> int:
    """Exit status: 1 when any row failed, else 0."""
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def _tbps(x: float) -> str:
    return f"{x / 1e12:.2f} TB/s" if x >= 1e11 else f"{x / 1e9:.1f} GB/s"


def _err(res: dict | None, what: str) -> str:
    if res is None:
        return f"{what}: not run"
    if res.get("skipped"):
        return f"{what}: {res['skipped']}"
    return f"{what}: {res.get('error') or 'failed'}"


def rows_tests(res: dict | None, smoke: bool) -> list[Row]:
    if res is None or res.get("counts") is None:
        return [Row("GPU tests (pytest tests/gpu)", _err(res, "pytest"), "0 failed",
                    "SKIP" if res and res.get("skipped") else "FAIL", res or {})]
    c = res["counts"]
    ok = c["failed"] == 0 and c["errors"] == 0 and res.get("rc") == 0 and (smoke or c["passed"] > 0)
    value = f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped"
    return [Row("GPU tests (pytest tests/gpu)", value, "0 failed", "PASS" if ok else "FAIL", c)]


def rows_bandwidth(res: dict | None, smoke: bool) -> list[Row]:
    names = (("adamw", "AdamW kernel", "copy", True), ("pack", "pack kernel", "pack_copy", True),
             ("unpack", "unpack kernel", "pack_copy", False))
    if res is None or "timings" not in res:
        st = "SKIP" if res and res.get("skipped") else "FAIL"
        return [Row(f"{label} bandwidth", _err(res, "bandwidth"), f">= {BW_TARGET:.0%} of D2D copy" if tgt else "-",
                    st if tgt else "INFO") for _, label, _, tgt in names]
    t, rows = res["timings"], []
    for key, label, ref, tgt in names:
        k, c = t[key], t[ref]
        bw_k, bw_c = bandwidth(k["traffic"], k["median_s"]), bandwidth(c["traffic"], c["median_s"])
        ratio = bw_k / bw_c
        what = f"{label} bandwidth" + (f", {res['n_params'] / 2**20:.0f}M params x 28 B" if key == "adamw"
                                       else f", {res['segments']} segments, {k['traffic'] / 2 / 2**30:.2f} GiB"
                                       if key == "pack" else " (info)")
        value = f"{_tbps(bw_k)} = {ratio:.0%} of copy {_tbps(bw_c)} ({c['how']})"
        rows.append(Row(what, value, f">= {BW_TARGET:.0%} of copy" if tgt else "-",
                        judged(ratio >= BW_TARGET, smoke) if tgt else "INFO",
                        {"kernel_Bps": bw_k, "copy_Bps": bw_c, "ratio": ratio}))
    return rows


def rows_speed(model: str, shape: dict, hpe: dict | None, torch_res: dict, attn: list[str], smoke: bool) -> list[Row]:
    label = "ref GPT" if model == "ref" else "GPT-2 small"
    what = f"tokens/s {label} {model_label(shape)}"
    if hpe is None or "tokens_per_s" not in hpe:
        return [Row(what, _err(hpe, "hpengine"), f">= {SPEED_TARGET:.1f}x torch eager",
                    "SKIP" if hpe and hpe.get("skipped") else "FAIL", hpe or {})]
    rows = []
    for i, at in enumerate(attn):
        tr = torch_res.get(at)
        tgt = f">= {SPEED_TARGET:.1f}x torch" if i == 0 else "-"
        w = what if i == 0 else f"  vs torch {at} attention (info)"
        if tr is None or "tokens_per_s" not in tr:
            skipped = tr is not None and tr.get("skipped")
            rows.append(Row(w, f"hpengine {hpe['tokens_per_s']:,.0f}; {_err(tr, 'torch ' + at)}", tgt,
                            "SKIP" if (skipped or i) else "FAIL", tr or {}))
            continue
        ratio = hpe["tokens_per_s"] / tr["tokens_per_s"]
        same = hpe.get("n_params") == tr.get("n_params")
        value = (f"hpengine {hpe['tokens_per_s']:,.0f} / torch {tr['tokens_per_s']:,.0f} = {ratio:.2f}x"
                 + ("" if same else f" (params differ: {hpe.get('n_params')} vs {tr.get('n_params')})"))
        status = ("FAIL" if not same else judged(ratio >= SPEED_TARGET, smoke)) if i == 0 else "INFO"
        rows.append(Row(w, value, tgt, status, {"ratio": ratio, "hpengine": hpe, "torch": tr}))
    return rows


def rows_dp2(single: dict | None, multi: dict | None, smoke: bool, loss_rtol: float, gnorm_rtol: float) -> list[Row]:
    labels = {"dp": "2 ranks on 1 GPU, staged MPI: dp", "sharding": "2 ranks on 1 GPU, staged MPI: sharding 2"}
    target = f"rtol {loss_rtol:.0e} (gnorm {gnorm_rtol:.0e})" + ("" if smoke else ", staged")
    bad = next((r for r in (single, multi) if r is None or "variants" not in r), "none")
    if bad != "none":
        st = "SKIP" if bad and bad.get("skipped") else "FAIL"
        return [Row(labels[v], _err(bad, "1-rank run" if bad is single else "2-rank run"), target, st)
                for v in ("dp", "sharding")]
    ref = single["variants"]["single"]
    rows = []
    for v in ("dp", "sharding"):
        got = multi["variants"].get(v)
        if got is None or "losses" not in got:
            rows.append(Row(labels[v], (got or {}).get("error", "not run"), target, "FAIL"))
            continue
        dl, dg = max_rel_diff(got["losses"], ref["losses"]), max_rel_diff(got["grad_norms"], ref["grad_norms"])
        staged = all(not ca for ca in got["cuda_aware"]) and all(b > 0 for b in got["staged_bytes"])
        ok = dl <= loss_rtol and dg <= gnorm_rtol and multi.get("world") == 2 and (smoke or staged)
        value = (f"rel. diff loss {dl:.0e}, gnorm {dg:.0e} ({len(got['losses'])} steps); "
                 + (f"{sum(got['staged_bytes']) / 2**20:.1f} MiB pinned, devices {got['devices']}"
                    if not smoke else f"backend {got['backend']}"))
        rows.append(Row(labels[v], value, target, "PASS" if ok else "FAIL",
                        {"loss_rel": dl, "gnorm_rel": dg, "run": got, "reference": ref}))
    return rows


def build_rows(results: dict, a) -> list[Row]:
    """The table, in the brief's order, from the parts' results (absent parts are left out)."""
    rows: list[Row] = []
    smoke = a.cpu_smoke
    if "tests" in a.parts:
        rows += rows_tests(results.get("tests"), smoke)
    if "bandwidth" in a.parts:
        rows += rows_bandwidth(results.get("bandwidth"), smoke)
    for m in ("ref", "gpt2"):
        if m in a.parts:
            rows += rows_speed(m, model_shape(a, m), results.get(f"{m}:hpengine"),
                               {at: results.get(f"{m}:torch-{at}") for at in a.torch_attn}, a.torch_attn, smoke)
    if "dp2" in a.parts:
        rows += rows_dp2(results.get("dp2:1"), results.get("dp2:2"), smoke, a.loss_rtol, a.gnorm_rtol)
    return rows


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
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=lf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
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
        elif rc != 0 and "error" not in res and not (key == "tests"):
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
    mpiexec = find_mpiexec(a.mpiexec)
    results = runner.results
    rows: list[Row] = []

    def on_term(signum, _frame):
        raise SystemExit(f"gpu_check: stopped by signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    runner.note(f"gpu_check {'CPU smoke' if a.cpu_smoke else 'GPU'} run: parts {','.join(a.parts)}; deadline "
                f"{a.deadline_s:.0f} s; work folder {workdir}; mpiexec {mpiexec or 'none'}; torch python "
                f"{a.torch_python}")
    try:
        needs_corpus = any(p in a.parts for p in ("ref", "gpt2", "dp2"))
        data = None
        if needs_corpus:
            r = runner.run("corpus", me + ["--worker", "corpus"], _limit(a, "corpus"))
            data = r.get("path")
        if "tests" in a.parts:
            cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
            if _has_module("pytest_timeout"):
                cmd.append(f"--timeout={int(_limit(a, 'tests'))}")
            r = runner.run("tests", cmd, _limit(a, "tests"), parse_json=False)
            r["counts"] = pytest_counts(r.pop("log") or "")
            if r["counts"] is None and "error" not in r:
                r["error"] = f"no pytest summary (exit status {r['rc']})"
        if "bandwidth" in a.parts:
            runner.run("bandwidth", me + ["--worker", "bandwidth", "--bw-params", str(a.bw_params), "--bw-reps",
                                          str(a.bw_reps), "--bw-inner", str(a.bw_inner), "--pack-segments",
                                          str(a.pack_segments)], _limit(a, "bandwidth"))
        speed_args = ["--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps), "--warmup-s",
                      str(a.warmup_s), "--gpt2-batch", str(a.gpt2_batch)]
        torch_cmd = [a.torch_python, str(Path(__file__).resolve())] + (["--cpu-smoke"] if a.cpu_smoke else [])

        def speed(model):
            if data is None:
                results[f"{model}:hpengine"] = {"error": "no corpus"}
                return
            runner.run(f"{model}:hpengine", me + ["--worker", "hpengine", "--model", model, "--data", data]
                       + speed_args, _limit(a, "hpengine"))
            for i, at in enumerate(a.torch_attn):
                runner.run(f"{model}:torch-{at}", torch_cmd + ["--worker", "torch", "--model", model, "--attn", at]
                           + speed_args, _limit(a, "torch"), optional=i > 0)

        if "ref" in a.parts:
            speed("ref")
        if "dp2" in a.parts:
            if mpiexec is None or data is None:
                why = {"skipped" if a.cpu_smoke else "error": "no mpiexec" if mpiexec is None else "no corpus"}
                results["dp2:1"], results["dp2:2"] = dict(why), dict(why)
            else:
                common = ["--worker", "losses", "--data", data, "--dp2-steps", str(a.dp2_steps)]
                runner.run("dp2:1", [mpiexec, "-n", "1"] + me + common + ["--variants", "single"], _limit(a, "dp2-1"))
                runner.run("dp2:2", [mpiexec, "-n", "2"] + me + common + ["--variants", "dp,sharding"],
                           _limit(a, "dp2-2"))
        if "gpt2" in a.parts:
            speed("gpt2")
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


def _limit(a, part: str) -> float:
    return LIMITS[part][1 if a.cpu_smoke else 0]


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


# ----------------------------------------------------------------------------------- workers

def write_result(a, res: dict) -> None:
    if a.result:
        Path(a.result).write_text(json.dumps(res, indent=1, default=str))


def worker_corpus(a) -> dict:
    from hpengine.data import ensure_default_corpus       # noqa: PLC0415
    return {"path": str(ensure_default_corpus(max_bytes=(256 << 10) if a.cpu_smoke else (4 << 20)))}


class EventTimer:
    """Seconds per call of fn, from CUDA events around `inner` back-to-back calls on the current stream."""

    def __init__(self, cupy):
        self.cp = cupy

    def __call__(self, fn, inner: int) -> float:
        s = self.cp.cuda.get_current_stream()
        e0, e1 = self.cp.cuda.Event(), self.cp.cuda.Event()
        e0.record(s)
        for _ in range(inner):
            fn()
        e1.record(s)
        e1.synchronize()
        return self.cp.cuda.get_elapsed_time(e0, e1) / 1e3 / inner


class HostTimer:
    """The CPU stand-in: wall time per call."""

    def __call__(self, fn, inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


def pack_segments(n: int, k: int, seed: int = 0):
    """k segments over a buffer of n floats, each starting on a 16-byte boundary and a multiple of 4
    long, with small gaps between them (the tensors of a gradient bucket); together about 90 % of n."""
    import random                                        # noqa: PLC0415
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(k)]
    gaps = [4 * rng.randint(1, 16) for _ in range(k)]
    room = int(0.9 * n) - sum(gaps)
    sizes = [max(4, int(room * w / sum(weights)) // 4 * 4) for w in weights]
    offsets, pos = [], 0
    for s, gap in zip(sizes, gaps):
        pos += gap
        offsets.append(pos)
        pos += s
    assert pos <= n, (pos, n)
    return offsets, sizes


def worker_bandwidth(a) -> dict:
    from hpengine import kernels                         # noqa: PLC0415
    import numpy as np                                   # noqa: PLC0415
    if a.cpu_smoke:
        xp, timer, device = np, HostTimer(), "cpu (NumPy twins)"
    else:
        import cupy as xp                                # noqa: PLC0415
        timer = EventTimer(xp)
        device = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
        device = device.decode() if isinstance(device, bytes) else str(device)
    n, f32 = a.bw_params, np.float32

    def rand(size, scale=1.0):
        if xp is np:
            return (np.random.default_rng(size).standard_normal(size, dtype=f32) * f32(scale))
        return xp.random.standard_normal(size, dtype=f32) * f32(scale)

    # AdamW over n parameters, against a copy of 14 bytes per parameter (same traffic, 28 B/param)
    p, g, m = rand(n), rand(n, 1e-2), rand(n, 1e-3)
    v = xp.abs(rand(n, 1e-2)) ** 2
    mask = xp.ones(n, dtype=xp.uint8)                   # decay on the matrices; the last 1/16 (norms, biases)
    mask[n - n // 16:] = 0                               # without (few long runs, as in a real layout)
    coefs = kernels.adamw_coefs(10, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0)
    traffic = adamw_traffic(n)
    csrc = rand(copy_nbytes_for(traffic) // 4)
    cdst = xp.empty_like(csrc)
    # pack: k segments of a buffer of n floats into one message, against a copy of the message's bytes
    offsets, sizes = pack_segments(n, a.pack_segments)
    psrc = rand(n)
    msg = xp.full(sum(sizes), xp.nan, dtype=f32)
    mcopy = xp.empty_like(msg)
    kernels.pack(msg, psrc, offsets, sizes)
    if bool(xp.isnan(msg).any()):
        raise RuntimeError("pack left elements of the message unwritten")
    ops = {
        "adamw": (traffic, lambda: kernels.adamw(p, g, m, v, mask, coefs)),
        "pack": (2 * msg.nbytes, lambda: kernels.pack(msg, psrc, offsets, sizes)),
        "unpack": (2 * msg.nbytes, lambda: kernels.unpack(msg, psrc, offsets, sizes)),
        "copy:elementwise": (2 * cdst.nbytes, lambda: xp.copyto(cdst, csrc)),
        "pack_copy:elementwise": (2 * mcopy.nbytes, lambda: xp.copyto(mcopy, msg)),
    }
    if xp is not np:
        ops["copy:memcpy"] = (2 * cdst.nbytes, lambda: cdst.data.copy_from_device_async(csrc.data, csrc.nbytes))
        ops["pack_copy:memcpy"] = (2 * mcopy.nbytes,
                                   lambda: mcopy.data.copy_from_device_async(msg.data, msg.nbytes))
    times = {k: [] for k in ops}
    warm = 2 if a.cpu_smoke else 3
    for rep in range(warm + a.bw_reps):                  # interleaved: clocks drift alike for every op
        for k, (_, fn) in ops.items():
            t = timer(fn, a.bw_inner)
            if rep >= warm:
                times[k].append(t)
    if bool(xp.isnan(p).any()):
        raise RuntimeError("AdamW produced NaN")
    timings = {}
    for k, (tr, _) in ops.items():
        timings[k] = {"traffic": tr, "median_s": statistics.median(times[k]), "min_s": min(times[k]),
                      "reps": len(times[k]), "Bps": bandwidth(tr, statistics.median(times[k]))}
    for ref in ("copy", "pack_copy"):                   # the reference: the faster way to copy those bytes
        best = max((k for k in timings if k.startswith(ref + ":")), key=lambda k: timings[k]["Bps"])
        timings[ref] = dict(timings[best], how=best.split(":")[1])
    return {"device": device, "n_params": n, "segments": len(sizes), "message_bytes": int(msg.nbytes),
            "inner": a.bw_inner, "timings": timings}


def build_engine(shape: dict, data: str, backend: str):
    """One process's hpengine Engine for a model shape (float32, no evaluation, a long schedule)."""
    from hpengine.config import load_config              # noqa: PLC0415
    from hpengine.train import build                     # noqa: PLC0415
    return build(load_config(None, [
        "train.eval_every=0", f"runtime.backend='{backend}'",
        "runtime.cuda_aware_mpi=false", f"data.path='{data}'", f"model.d_model={shape['d_model']}",
        f"model.n_layers={shape['n_layers']}", f"model.n_heads={shape['n_heads']}",
        f"model.seq_len={shape['seq_len']}", f"model.vocab_size={shape['vocab']}",
        f"train.global_batch={shape['batch']}", f"train.steps={10**6}"]))


def worker_hpengine(a) -> dict:
    shape = model_shape(a, a.model)
    eng = build_engine(shape, a.data, "numpy" if a.cpu_smoke else "cupy")
    if eng.be.is_gpu:
        cupy = eng.be.xp
        sync = cupy.cuda.Device().synchronize
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        device = device.decode() if isinstance(device, bytes) else str(device)
    else:
        sync, device = (lambda: None), "cpu"
    step, t_end = 0, time.perf_counter() + a.warmup_s
    while step < a.warmup_steps or time.perf_counter() < t_end:
        eng.train_step(step)
        step += 1
    warm, times, losses = step, [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        m = eng.train_step(step)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
        step += 1
    med = statistics.median(times)
    res = {"engine": "hpengine", "backend": eng.be.name, "device": device, "model": shape,
           "n_params": eng.n_params(), "warmup_steps": warm, "steps": a.steps, "median_step_ms": med * 1e3,
           "min_step_ms": min(times) * 1e3, "tokens_per_s": tokens_per_s(shape["batch"], shape["seq_len"], med),
           "last_loss": losses[-1]}
    if eng.be.is_gpu:
        res["device_pool_bytes"] = int(eng.be.xp.get_default_memory_pool().total_bytes())
    return res


class _TorchOn:
    """torch itself, except that torch.ones creates on `device`: torch_ref's explicit attention builds its
    causal mask with torch.ones at every forward, so its model runs on the GPU unchanged."""

    def __init__(self, torch, device):
        self._torch, self._device = torch, device

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def ones(self, *size, **kw):
        kw.setdefault("device", self._device)
        return self._torch.ones(*size, **kw)


def build_torch(torch, shape: dict, attn: str, dev: str):
    """(model, one-step function) of benchmarks/torch_ref.py's model for a shape, on `dev` in float32;
    model is None when the optimizer's parameters did not follow the model to the device."""
    sys.path.insert(0, str(HERE))
    import torch_ref                                     # noqa: PLC0415 - benchmarks/torch_ref.py: the model
    torch.set_float32_matmul_precision("highest")
    ra = torch_ref.parse(["--attn", attn, "--vocab", str(shape["vocab"]), "--d-model", str(shape["d_model"]),
                          "--layers", str(shape["n_layers"]), "--heads", str(shape["n_heads"]),
                          "--seq", str(shape["seq_len"]), "--batch", str(shape["batch"])])
    torch.manual_seed(1234)
    model, opt = torch_ref.build(ra, _TorchOn(torch, dev))
    model.to(dev)                                        # parameters move in place: the optimizer keeps them
    if any(p.device.type != dev for grp in opt.param_groups for p in grp["params"]):
        return None, None
    return model, torch_ref.make_step(torch, model, opt, ra, dev)


def worker_torch(a) -> dict:
    shape = model_shape(a, a.model)
    try:
        import torch                                     # noqa: PLC0415
    except ImportError as e:
        return {"skipped": f"torch is not importable by {sys.executable} ({e}); pass --torch-python"}
    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda":
        if not torch.cuda.is_available():
            return {"error": "torch sees no CUDA device"}
        torch.backends.cuda.matmul.allow_tf32 = False    # float32 as on the hpengine side (CUPY_TF32=0)
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    model, step = build_torch(torch, shape, a.attn, dev)
    if model is None:
        return {"error": "optimizer parameters did not move with the model"}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    n, t_end = 0, time.perf_counter() + a.warmup_s
    while n < a.warmup_steps or time.perf_counter() < t_end:
        step()
        n += 1
    times = []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    res = {"engine": f"torch-{a.attn}", "torch": torch.__version__, "device": dev, "model": shape,
           "n_params": sum(p.numel() for p in model.parameters()), "warmup_steps": n, "steps": a.steps,
           "median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3,
           "tokens_per_s": tokens_per_s(shape["batch"], shape["seq_len"], med)}
    if dev == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
        res["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return res


DP2_VARIANTS = {
    "single": [],
    "dp": ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=2"],
    "sharding": ["strategy.sharding.enable=true", "strategy.sharding.degree=2", "strategy.sharding.stage=2"],
}


def worker_losses(a) -> dict | None:
    """Under mpiexec: train each variant for --dp2-steps steps; rank 0 returns losses, gradient norms and
    how the ranks reached MPI (CUDA-aware or not, bytes of pinned staging buffers, device ids)."""
    from mpi4py import MPI                               # noqa: PLC0415
    from hpengine.config import load_config              # noqa: PLC0415
    from hpengine.train import build                     # noqa: PLC0415
    world = MPI.COMM_WORLD
    shape = model_shape(a, "ref")
    common = [f"runtime.backend='{'numpy' if a.cpu_smoke else 'cupy'}'", "runtime.cuda_aware_mpi=false",
              "runtime.share_devices=true", "train.eval_every=0", f"data.path='{a.data}'",
              f"model.d_model={shape['d_model']}", f"model.n_layers={shape['n_layers']}",
              f"model.n_heads={shape['n_heads']}", f"model.seq_len={shape['seq_len']}",
              f"train.global_batch={shape['batch']}", f"train.steps={a.dp2_steps}",
              "optim.warmup_steps=0", "optim.lr=1e-2"]
    out = {"world": world.Get_size(), "variants": {}}
    for v in a.variants.split(","):
        try:
            eng = build(load_config(None, common + DP2_VARIANTS[v]))
            losses, norms = [], []
            for step in range(a.dp2_steps):
                m = eng.train_step(step)
                losses.append(float(m["loss"]))
                norms.append(float(m["grad_norm"]))
            staged = eng.be.staging.nbytes if eng.be.staging is not None else 0
            info = world.gather((bool(eng.be.cuda_aware), int(staged), eng.be.device), root=0)
            out["variants"][v] = {"losses": losses, "grad_norms": norms, "backend": eng.be.name,
                                  "cuda_aware": [i[0] for i in info or []], "staged_bytes": [i[1] for i in info or []],
                                  "devices": [i[2] for i in info or []], "degrees": dict(eng.mesh.degrees)}
        except Exception as e:                           # noqa: BLE001 - reported in the table
            out["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
            print(f"rank {world.Get_rank()}: variant {v} failed:", file=sys.stderr)
            import traceback                             # noqa: PLC0415
            traceback.print_exc()
            world.Abort(1)
    return out if world.Get_rank() == 0 else None


WORKERS = {"corpus": worker_corpus, "bandwidth": worker_bandwidth, "hpengine": worker_hpengine,
           "torch": worker_torch, "losses": worker_losses}


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        res = WORKERS[a.worker](a)
        if res is not None:
            write_result(a, res)
            print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, default=str))
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
