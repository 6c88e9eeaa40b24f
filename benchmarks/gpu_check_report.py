"""gpu_check's judgement: the rate arithmetic behind the bandwidth and tokens/s figures (the byte model is
hpengine.doctor.bandwidth's), pytest's summary line and `hpengine doctor`'s lines, the table's rows (each with
its target and PASS / FAIL / INFO / SKIP / smoke status) of the tests, bandwidth, doctor, calibrate and dp2
parts, the table in plain text and Markdown, and the exit status that follows from it. The model parts' rows
are in gpu_check_models.py. Standard library only: pure functions of the results, tested without a GPU.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gpu_check_options import BW_TARGET


# ------------------------------------------------------------------------- arithmetic (pure)

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


DOCTOR_LINE = re.compile(r"^(\S.*?)\s+(ok|FAILED|skipped)\s{2,}(.*)$")
DOCTOR_STATUS = {"ok": "PASS", "FAILED": "FAIL", "skipped": "SKIP"}


def doctor_lines(text: str) -> list[tuple[str, str, str]]:
    """(check, status, detail) of each line `hpengine doctor` printed ('NAME  ok|FAILED|skipped  detail')."""
    return [m.groups() for m in map(DOCTOR_LINE.match, text.splitlines()) if m]


def cluster_table(text: str) -> dict:
    """The `key = value` lines of a printed [cluster] table (plan --calibrate), numbers as floats."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\s*([a-z_0-9]+)\s*=\s*([-+0-9.eE]+)\s*", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


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


def err_text(res: dict | None, what: str) -> str:
    if res is None:
        return f"{what}: not run"
    if res.get("skipped"):
        return f"{what}: {res['skipped']}"
    return f"{what}: {res.get('error') or 'failed'}"


def rows_tests(res: dict | None, smoke: bool) -> list[Row]:
    if res is None or res.get("counts") is None:
        return [Row("GPU tests (pytest tests/gpu)", err_text(res, "pytest"), "0 failed",
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
        return [Row(f"{label} bandwidth", err_text(res, "bandwidth"), f">= {BW_TARGET:.0%} of D2D copy" if tgt else "-",
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


def rows_doctor(res: dict | None) -> list[Row]:
    """One row per `hpengine doctor` check: ok PASS, FAILED FAIL, skipped SKIP (with its reason)."""
    lines = (res or {}).get("lines") or []
    if not lines:
        if res is None or res.get("error") or res.get("skipped"):
            why = err_text(res, "doctor")
        else:
            why = f"doctor: no check lines (exit status {res.get('rc')})"
        return [Row("hpengine doctor", why, "none failed",
                    "SKIP" if res and res.get("skipped") else "FAIL", res or {})]
    rows = [Row(f"doctor: {name}", detail, "ok", DOCTOR_STATUS[status]) for name, status, detail in lines]
    if res.get("error") or res.get("rc") not in (0, 1):             # cut short, or a crash after some lines
        rows.append(Row("hpengine doctor", res.get("error") or f"exit status {res.get('rc')}", "exit status 0 or 1",
                        "FAIL"))
    return rows


def rows_calibrate(res: dict | None) -> list[Row]:
    """The planner's measured GPU figures (for clusters/h200_node.toml), information only."""
    c = (res or {}).get("cluster") or {}
    if not c or res.get("error"):
        return [Row("planner calibration (plan --calibrate)", err_text(res, "calibrate") if res else "not run", "-",
                    "SKIP" if res and res.get("skipped") else "INFO", res or {})]
    keys = [k for k in ("gemm_eff_max", "gemm_half_dim", "mem_bw_gbs", "launch_us", "tflops", "tflops_fp32", "act_ns")
            if k in c]
    return [Row("planner calibration (plan --calibrate)", ", ".join(f"{k} {c[k]:.4g}" for k in keys), "-", "INFO", c)]


def rows_dp2(single: dict | None, multi: dict | None, smoke: bool, loss_rtol: float, gnorm_rtol: float) -> list[Row]:
    labels = {"dp": "2 ranks on 1 GPU, staged MPI: dp", "sharding": "2 ranks on 1 GPU, staged MPI: sharding 2"}
    target = f"rtol {loss_rtol:.0e} (gnorm {gnorm_rtol:.0e})" + ("" if smoke else ", staged")
    bad = next((r for r in (single, multi) if r is None or "variants" not in r), "none")
    if bad != "none":
        st = "SKIP" if bad and bad.get("skipped") else "FAIL"
        return [Row(labels[v], err_text(bad, "1-rank run" if bad is single else "2-rank run"), target, st)
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


def _shared(run: dict | None) -> bool:
    """Whether a 2-rank run's ranks were on one device."""
    devs = (run or {}).get("devices") or []
    return len(devs) > 1 and len(set(devs)) < len(devs)


def rows_transports(multi: dict | None, smoke: bool, loss_rtol: float) -> list[Row]:
    """The dp2 part's timed 2-rank data-parallel runs, runtime.collectives = "mpi" (host-staged) and "nccl":
    tokens/s and the exposed gradient-sync wait per step (information); nccl's losses against mpi's (judged
    where both ran)."""
    runs = (multi or {}).get("variants") or {}
    mpi, rows = runs.get("mpi"), []
    for v in ("mpi", "nccl"):
        got, what = runs.get(v), f"2 ranks dp, collectives {v}" + (" (host-staged)" if v == "mpi" else "")
        tgt = "-" if v == "mpi" else f"losses = mpi's, rtol {loss_rtol:.0e}"
        if got is None:
            rows.append(Row(what, err_text(multi, "2-rank run") if multi is None or multi.get("error") or
                            multi.get("skipped") else "not run", tgt,
                            "SKIP" if multi is None or multi.get("skipped") or smoke else "FAIL"))
            continue
        if got.get("not_available"):
            rows.append(Row(what, f"not available: {got['not_available']}", tgt, "SKIP", got))
            continue
        shared = _shared(mpi) and v == "nccl"
        if "tokens_per_s" not in got:
            note = "; the 2 ranks share one GPU, which NCCL does not support" if shared else ""
            rows.append(Row(what, got.get("error", "failed") + note, tgt, "INFO" if shared else "FAIL", got))
            continue
        devs = got.get("devices") or []
        where = (f"{len(devs)} ranks share GPU {devs[0]} (runtime.share_devices)" if _shared(got)
                 else f"devices {devs}") if not smoke else f"backend {got.get('backend')}"
        value = (f"{got['tokens_per_s']:,.0f} tok/s, grad sync wait {got['grad_sync_wait_ms']:.1f} ms/step, "
                 f"{got.get('grad_bytes', 0) / 2**20:.0f} MiB of gradients; {where}")
        warn = got.get("warnings") or []
        if warn:
            value += f"; logged: {warn[0]}" + (f" (+{len(warn) - 1})" if len(warn) > 1 else "")
        if v == "mpi":
            rows.append(Row(what, value, tgt, "INFO", got))
            continue
        if mpi is None or "losses" not in mpi:
            rows.append(Row(what, value + "; no mpi run to compare with", tgt, "INFO", got))
            continue
        d = max_rel_diff(got["losses"], mpi["losses"])
        ratio = got["tokens_per_s"] / mpi["tokens_per_s"] if mpi.get("tokens_per_s") else float("inf")
        fell_back = any("nccl" in w.lower() for w in warn)      # e.g. NCCL not usable, MPI used instead
        rows.append(Row(what, f"{value}; {ratio:.2f}x mpi's tok/s; losses vs mpi {d:.0e}", tgt,
                        "FAIL" if d > loss_rtol else "INFO" if fell_back else "PASS",
                        {"loss_rel": d, "ratio": ratio, "run": got}))
    return rows
