"""benchmarks/gpu_check.py and its modules without a GPU: argument parsing, the bandwidth arithmetic (of
hpengine.doctor.bandwidth, which the bandwidth part runs), tokens/s, parameter, FLOP and MFU arithmetic, pytest's
summary and `hpengine doctor`'s lines, the table and its verdicts, part time limits and partial results; and the
whole script's control flow end to end in --cpu-smoke mode (NumPy stand-ins, tiny sizes) through
benchmarks/gpu_check.sh (whose own tests are in test_gpu_check_shell.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpengine.doctor import bandwidth as bw

ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))      # the gpu_check modules import each other by name

import gpu_check as gc  # noqa: E402 - the orchestrator
import gpu_check_models as gm  # noqa: E402
import gpu_check_options as opts  # noqa: E402
import gpu_check_report as rep  # noqa: E402


# ----------------------------------------------------------------------------------- arguments

def test_defaults_gpu_and_smoke():
    a = opts.parse([])
    assert a.parts == list(opts.PARTS) and not a.cpu_smoke and not a.no_compile and a.hpe_attention == "flash"
    assert (a.deadline_s, a.bw_params, a.bw_reps, a.steps, a.attn_reps) == (500, 256 << 20, 25, 10, 20)
    assert a.parts[:3] == ["tests", "llama", "gpt2"]              # the most important figures first
    s = opts.parse(["--cpu-smoke"])
    assert s.cpu_smoke and s.bw_params == 1 << 20 and s.steps == 2 and s.deadline_s == 240
    assert opts.model_shape(a, "gpt2") == dict(kind="gpt", d_model=768, n_layers=12, n_heads=12, seq_len=1024,
                                               vocab=50304, batch=8)
    assert opts.model_shape(a, "llama") == dict(kind="llama", d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8,
                                                ffn_hidden=5632, seq_len=2048, vocab=32000, batch=4)
    assert opts.model_shape(opts.parse(["--gpt2-batch", "4"]), "gpt2")["batch"] == 4
    assert opts.model_shape(opts.parse(["--llama-batch", "2"]), "llama")["batch"] == 2
    assert opts.attn_shape(a) == (4, 16, 2048, 128)


def test_argument_values():
    assert opts.count("256M") == 256 << 20 and opts.count("64k") == 65536 and opts.count("1G") == 1 << 30
    assert opts.count("1000") == 1000
    assert opts.parse(["--bw-params", "1000003"]).bw_params == 1000000      # whole 16-byte vectors
    assert opts.parse(["--parts", "bandwidth, dp2"]).parts == ["bandwidth", "dp2"]
    assert opts.parse(["--hpe-attention", "standard", "--no-compile"]).hpe_attention == "standard"
    for bad in (["--parts", "bandwidth,nope"], ["--parts", ""], ["--bw-params", "12x"], ["--bw-reps", "0"],
                ["--bw-params", "100"], ["--hpe-attention", "ring"], ["--llama-batch", "0"], ["--parts", "ref"]):
        with pytest.raises(SystemExit):
            opts.parse(bad)


def test_save_result_replaces_the_file_whole(tmp_path):
    path = tmp_path / "r.json"
    opts.save_result(str(path), {"eager": {"tokens_per_s": 1.0}})
    opts.save_result(str(path), {"eager": {"tokens_per_s": 2.0}, "compile": {"x": 1}})
    assert json.loads(path.read_text()) == {"eager": {"tokens_per_s": 2.0}, "compile": {"x": 1}}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    opts.save_result(None, {"ignored": True})


# ---------------------------------------------------------------------------------- arithmetic

def test_byte_model_and_rates():
    n = 256 << 20
    assert bw.adamw_traffic(n) == 28 * n                      # read p, g, m, v; write p, m, v
    assert bw.copy_nbytes_for(bw.adamw_traffic(n)) == 14 * n   # 14 read + 14 written per parameter
    for rate in (rep.bandwidth, bw.bandwidth):                  # the table's and the measurement's
        assert rate(28 * n, 28 * n / 4e12) == pytest.approx(4e12)
        assert rate(1, 0.0) == float("inf")
    assert opts.BW_TARGET == bw.TARGET                          # the table judges as hpengine doctor does
    assert rep.tokens_per_s(8, 1024, 0.5) == pytest.approx(16384)
    assert rep.max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert rep.max_rel_diff([1.0, 2.002], [1.0, 2.0]) == pytest.approx(1e-3)
    assert rep.max_rel_diff([1.0], [1.0, 2.0]) == float("inf")
    assert rep.max_rel_diff([float("nan")], [1.0]) == float("inf")
    assert rep.max_rel_diff([], []) == float("inf")


def test_parameter_counts_against_published_figures():
    # GPT-2 small with its head tied to the embedding and vocab 50257 has 124,439,808 parameters (OpenAI's
    # checkpoint); the untied head adds V d. TinyLlama-1.1B (d 2048, 22 layers, 32 heads, 4 kv heads, SwiGLU
    # 5632, vocab 32000, untied) has 1,100,048,384.
    gpt2 = dict(kind="gpt", d_model=768, n_layers=12, n_heads=12, seq_len=1024, vocab=50257)
    assert gm.n_params(gpt2) - 50257 * 768 == 124_439_808
    tiny = dict(kind="llama", d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632, seq_len=2048,
                vocab=32000)
    assert gm.n_params(tiny) == 1_100_048_384
    llama = opts.MODELS["llama"]
    assert gm.n_params(llama) == 1_074_874_368 and 1.0e9 <= gm.n_params(llama) <= 1.2e9
    assert gm.n_params(opts.MODELS["gpt2"]) == 163_109_376


def test_flops_and_mfu():
    s = dict(kind="gpt", d_model=4, n_layers=1, n_heads=2, seq_len=8, vocab=10)
    n = 2 * 10 * 4 + 8 * 4 + (12 * 16 + 13 * 4) + 2 * 4          # 364
    assert gm.n_params(s) == n == 364
    assert gm.flops_per_token(s) == 6 * 364 + 12 * 1 * 8 * 4      # attention: 12 L T (H hd)
    assert gm.peak_bf16_flops("NVIDIA H200") == 989e12 and gm.peak_bf16_flops("NVIDIA H200 NVL") == 835.5e12
    assert gm.peak_bf16_flops("cpu") is None and gm.peak_bf16_flops("Some GPU") is None
    tps = 989e12 / gm.flops_per_token(s) / 2                     # half the peak
    assert gm.mfu(s, tps, "NVIDIA H200") == pytest.approx(0.5)
    assert gm.mfu(s, tps, "cpu") is None


def test_attention_agreement():
    want = {"o": {"norm": 10.0, "dot": 3.0}, "dq": {"norm": 2.0, "dot": -1.0}}
    assert gm.agreement(want, want) == 0.0
    got = {"o": {"norm": 10.1, "dot": 3.0}, "dq": {"norm": 2.0, "dot": -1.02}}
    assert gm.agreement(got, want) == pytest.approx(0.01)            # 0.1 / 10 and 0.02 / 2
    assert gm.agreement({"o": want["o"]}, want) == float("inf")       # dq missing
    assert gm.agreement({"o": {"norm": float("nan"), "dot": 0.0}, "dq": want["dq"]}, want) == float("inf")
    assert gm.agreement({}, {}) == float("inf")


def test_pack_segments_are_aligned_and_inside():
    n = 1 << 20
    offs, sizes = bw.pack_segments(n, 64)
    assert len(offs) == len(sizes) == 64
    assert all(o % 4 == 0 and s % 4 == 0 and s > 0 for o, s in zip(offs, sizes))
    assert all(a + s < b for a, s, b in zip(offs, sizes, offs[1:]))      # disjoint, in order, with gaps
    assert offs[-1] + sizes[-1] <= n and 0.85 * n < sum(sizes) <= 0.9 * n
    assert bw.pack_segments(n, 64) == (offs, sizes)                      # deterministic


def test_pack_segments_refuse_a_buffer_too_small():
    with pytest.raises(ValueError, match="segments need .* elements; the buffer has 100"):
        bw.pack_segments(100, 64)


def test_doctor_lines_and_rows():
    text = ("hpengine             ok       hpengine 0.1.0, Python 3.12\n"
            "CUDA-aware MPI       ok       no (MPIX_Query_cuda_support() = 0): host staging\n"
            "parity: adamw.cu     FAILED   adamw float32 n 5 offset 0 step 1: p: 4 bytes differ\n"
            "kernel speed         skipped  no CUDA device: CuPy is not importable\n"
            "hpengine doctor: 2 ok, 1 failed, 1 skipped\n")
    lines = rep.doctor_lines(text)
    assert [n for n, _, _ in lines] == ["hpengine", "CUDA-aware MPI", "parity: adamw.cu", "kernel speed"]
    rows = rep.rows_doctor({"rc": 1, "lines": lines})
    assert [r.status for r in rows] == ["PASS", "PASS", "FAIL", "SKIP"] and rows[3].value.startswith("no CUDA")
    assert rep.verdict(rows) == 1
    cut = rep.rows_doctor({"rc": None, "error": "timed out after 90 s", "lines": lines[:1]})
    assert [r.status for r in cut] == ["PASS", "FAIL"] and "timed out" in cut[1].value
    assert rep.rows_doctor(None)[0].status == "FAIL"
    assert "exit status 2" in rep.rows_doctor({"rc": 2, "lines": []})[0].value


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


H200 = "NVIDIA H200"


def _speed(tps, n, **kw):
    return dict(tokens_per_s=tps, n_params=n, **kw)


def _results(adamw_s=1.0, pack_s=1.0, hpe_tps=1200.0, staged=(4096, 4096), dp_loss=2.5, pool=30 << 30,
             nccl_loss=2.5):
    n, msg = 1 << 20, 1 << 22
    bw = {"n_params": n, "segments": 64, "timings": {
        "adamw": _timing(28 * n, adamw_s), "copy": _timing(28 * n, 0.9, "memcpy"),
        "pack": _timing(2 * msg, pack_s), "unpack": _timing(2 * msg, 2.0), "pack_copy": _timing(2 * msg, 0.9, "memcpy")}}
    ref_run = {"losses": [2.5, 2.4], "grad_norms": [1.0, 0.9]}
    dp = {"losses": [dp_loss, 2.4], "grad_norms": [1.0, 0.9], "cuda_aware": [False, False],
          "staged_bytes": list(staged), "devices": [0, 0], "backend": "cupy"}
    mpi = dict(dp, tokens_per_s=1000.0, grad_sync_wait_ms=5.0, grad_bytes=1 << 30, losses=[2.5, 2.4, 2.3])
    checks = {"o": {"norm": 10.0, "dot": 1.0}, "dq": {"norm": 1.0, "dot": 0.1}}
    n_llama, n_gpt2 = gm.n_params(opts.MODELS["llama"]), gm.n_params(opts.MODELS["gpt2"])
    # the llama's MFU at hpe_tps tokens/s on an H200: 1200 tok/s x 6.7 GFLOP/token is far below 40 %
    return {
        "tests": {"rc": 0, "counts": dict(passed=70, failed=0, skipped=2, errors=0, xfailed=0, xpassed=0, deselected=0)},
        "llama:hpengine": _speed(hpe_tps, n_llama, device=H200, pool_peak_bytes=pool),
        "llama:torch": {"eager": _speed(1000.0, n_llama, max_reserved_bytes=40 << 30, max_allocated_bytes=35 << 30),
                        "error": "timed out after 180 s"},          # stopped during torch.compile
        "gpt2:hpengine": {"error": "timed out after 90 s"},
        "gpt2:torch": {"eager": _speed(1000.0, n_gpt2), "compile": _speed(2000.0, n_gpt2, first_step_s=40.0)},
        "attention:hpengine": {"variants": {
            "bf16": {"not_available": "under bf16 amp flash_cuda runs its float32 kernels"},
            "bits": {"fwd_ms": 1.0, "fwd_bwd_ms": 4.0, "checks": checks},
            "float32": {"fwd_ms": 2.0, "fwd_bwd_ms": 8.0,
                        "checks": {"o": {"norm": 10.5, "dot": 1.0}, "dq": {"norm": 1.0, "dot": 0.1}}}}},
        "attention:torch": {"fwd_ms": 0.5, "fwd_bwd_ms": 2.0, "dtype": "bfloat16", "backend": "flash",
                            "checks": checks},
        "documents": {"documents": 16, "variants": {
            "bf16": {"causal": {"fwd_ms": 2.0, "fwd_bwd_ms": 6.0}, "documents": {"fwd_ms": 0.5, "fwd_bwd_ms": 1.5},
                     "speedup": 4.0, "agreement": 0.0},
            "float32": {"causal": {"fwd_ms": 8.0, "fwd_bwd_ms": 24.0}, "documents": {"fwd_ms": 2.0, "fwd_bwd_ms": 6.0},
                        "speedup": 4.0, "agreement": 2e-5}}},                  # past 1e-5: FAIL
        "muon": {"model": opts.MODELS["llama"], "matrices": 140, "parameters": 880_000_000, "agreement": 1e-7,
                 "variants": {"grouped": {"ms": 500.0, "tflops": 50.0}, "per_matrix": {"ms": 600.0, "tflops": 41.7}}},
        "bandwidth": bw,
        "doctor": {"rc": 0, "lines": [("MPI", "ok", "MPICH 5.0.2 (MPI 5.0, mpi4py 4.1.2); 1 rank on 1 node"),
                                      ("parity: adamw.cu", "ok", "bit for bit")]},
        "dp2:1": {"world": 1, "variants": {"single": ref_run}},
        "dp2:2": {"world": 2, "variants": {"dp": dp, "sharding": dict(dp), "mpi": mpi,
                                           "nccl": dict(mpi, tokens_per_s=1500.0, losses=[nccl_loss, 2.4, 2.3])}},
    }


def _status(rows):
    return {r.what: r.status for r in rows}


def _row(rows, start):
    return next(r for r in rows if r.what.strip().startswith(start))


def test_rows_and_verdict():
    a = opts.parse([])
    rows = gc.build_rows(_results(), a)
    assert rows[0].what == "GPU tests (pytest tests/gpu)" and rows[0].status == "PASS"
    assert _row(rows, "AdamW kernel bandwidth").status == "PASS"          # 0.9 s copy / 1.0 s kernel = 90 %
    assert _row(rows, "pack kernel bandwidth").status == "PASS"
    assert _row(rows, "unpack kernel bandwidth (info)").status == "INFO"
    speed = _row(rows, "tokens/s llama 1.07B")
    assert speed.status == "PASS" and "1.20x" in speed.value               # 1200 / 1000
    assert _row(rows, "MFU llama").status == "FAIL"                        # far below 40 %
    mem = _row(rows, "peak memory llama")
    assert mem.status == "PASS" and mem.detail["ratio"] == pytest.approx(0.75)   # 30 GiB pool / 40 GiB reserved
    comp = _row(rows, "vs torch.compile llama")
    assert comp.status == "INFO" and "timed out" in comp.value             # the eager row survived the timeout
    assert _row(rows, "tokens/s GPT-2 small").status == "FAIL"            # hpengine side timed out
    att = [r for r in rows if r.what.startswith("attention")]
    assert [r.status for r in att] == ["SKIP", "PASS", "FAIL"]              # not available; agree 0; 5e-2
    assert "not available" in att[0].value and "0.50x the speed" in att[1].value
    packed = [r.status for r in rows if r.what.startswith("flash fwd+bwd on packed")]
    assert packed == ["PASS", "FAIL"]                                      # bf16; float32 agrees 2e-5 only
    assert "4.00x" in _row(rows, "flash fwd+bwd on packed").value
    assert [r.status for r in rows if r.what.startswith("Muon Newton-Schulz")] == ["INFO", "INFO"]
    assert [r.status for r in rows if r.what.startswith("2 ranks on 1 GPU")] == ["PASS", "PASS"]
    assert _row(rows, "2 ranks dp, collectives mpi").status == "INFO"
    nccl = _row(rows, "2 ranks dp, collectives nccl")
    assert nccl.status == "PASS" and "1.50x mpi" in nccl.value and "share GPU 0" in nccl.value
    assert [(r.what, r.status) for r in rows if r.what.startswith("doctor")] == [("doctor: MPI", "PASS"),
                                                                                 ("doctor: parity: adamw.cu", "PASS")]
    assert gc.verdict(rows) == 1
    ok = [r for r in rows if "GPT-2" not in r.what and "MFU" not in r.what and "float32" not in r.what]
    assert gc.verdict(ok) == 0
    assert [r.what for r in gc.build_rows(_results(), a, ["attention"])] == [r.what for r in att]


def test_rows_failures():
    a = opts.parse([])
    rows = gc.build_rows(_results(adamw_s=1.2, pack_s=1.5, hpe_tps=900.0, staged=(0, 4096), dp_loss=2.6,
                                  pool=50 << 30, nccl_loss=2.6), a)
    st = _status(rows)
    assert st[_row(rows, "AdamW").what] == "FAIL"                          # 75 % of the copy
    assert st[_row(rows, "pack").what] == "FAIL"
    assert st[_row(rows, "tokens/s llama").what] == "FAIL"                 # 0.9x
    assert st[_row(rows, "peak memory llama").what] == "FAIL"              # 50 GiB > 40 GiB
    assert [r.status for r in rows if r.what.startswith("2 ranks on")] == ["FAIL", "FAIL"]
    assert st[_row(rows, "2 ranks dp, collectives nccl").what] == "FAIL"   # losses 4 % off mpi's
    # the same figures in a smoke run: speeds and memory are not judged; agreement and 2-rank equality are
    s = gc.build_rows(_results(adamw_s=1.2, hpe_tps=900.0, staged=(0, 0)), opts.parse(["--cpu-smoke"]))
    sst = _status(s)
    assert sst[_row(s, "AdamW").what] == "smoke" and sst[_row(s, "peak memory llama").what] == "smoke"
    assert [r.status for r in s if r.what.startswith("2 ranks on")] == ["PASS", "PASS"]
    assert [r.status for r in s if r.what.startswith("attention")] == ["SKIP", "PASS", "FAIL"]


def test_rows_parameter_mismatch_missing_parts_and_not_available():
    a = opts.parse(["--parts", "llama,dp2,tests"])
    res = _results()
    res["llama:torch"]["eager"]["n_params"] = 11
    res["dp2:2"] = {"world": 2, "variants": {"dp": res["dp2:2"]["variants"]["dp"],
                                             "nccl": {"not_available": "runtime.collectives is not a setting"}},
                    "error": "timed out after 120 s"}
    res["tests"] = {"rc": 2, "error": "timed out after 150 s", "counts": None}
    rows = gc.build_rows(res, a)
    assert [r.what.split(" ")[0] for r in rows] == ["GPU", "tokens/s", "", "", "", "2", "2", "2", "2"]
    llama = _row(rows, "tokens/s")
    assert llama.status == "FAIL" and "params differ" in llama.value
    assert rows[0].status == "FAIL" and "timed out" in rows[0].value
    assert _row(rows, "2 ranks on 1 GPU, staged MPI: sharding").status == "FAIL"   # not reached before the timeout
    assert _row(rows, "2 ranks dp, collectives mpi").status == "FAIL" and "timed out" in _row(
        rows, "2 ranks dp, collectives mpi").value
    assert _row(rows, "2 ranks dp, collectives nccl").status == "SKIP"
    assert not any("bandwidth" in r.what or "attention" in r.what for r in rows)
    # NCCL failing with the two ranks on one GPU is said so (information); on two GPUs it fails; a run that
    # logged a fall-back to MPI is not a pass
    two = _results()
    two["dp2:2"]["variants"]["nccl"] = {"error": "NcclError: NCCL_ERROR_INVALID_USAGE"}
    row = _row(gc.build_rows(two, a), "2 ranks dp, collectives nccl")
    assert row.status == "INFO" and "share one GPU" in row.value
    two["dp2:2"]["variants"]["mpi"]["devices"] = [0, 1]
    assert _row(gc.build_rows(two, a), "2 ranks dp, collectives nccl").status == "FAIL"
    back = _results()
    back["dp2:2"]["variants"]["nccl"]["warnings"] = ["NCCL not usable on rank 1 (no libnccl): MPI is used"]
    row = _row(gc.build_rows(back, a), "2 ranks dp, collectives nccl")
    assert row.status == "INFO" and "logged: NCCL not usable" in row.value
    del res["llama:torch"]
    none = gc.build_rows({"llama:hpengine": {"skipped": "no time left (3 s of the deadline)"}}, a)
    assert {r.status for r in none if "llama" in r.what} == {"SKIP"}          # MFU included: it has a target


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
    # a worker that saved a stage before its limit: the stage is kept, with the timeout as the part's error
    part = ("import json, sys, time; json.dump({'eager': {'tokens_per_s': 5.0}}, "
            "open(sys.argv[sys.argv.index('--result') + 1], 'w')); time.sleep(60)")
    res = r.run("partial", [sys.executable, "-c", part], limit=3)
    assert res["eager"] == {"tokens_per_s": 5.0} and "timed out" in res["error"]
    late = gc.Runner(opts.parse(["--cpu-smoke", "--deadline-s", "5"]), tmp_path)
    assert "no time left" in late.run("late", [sys.executable, "-c", "pass"], limit=30)["skipped"]
    assert "no time left" in late.run("opt", [sys.executable, "-c", "pass"], limit=4, optional=True)["skipped"]


@pytest.mark.timeout(240)
def test_cpu_smoke_end_to_end(tmp_path):
    """The whole control flow through the shell wrapper: every part runs (torch parts skip when this
    interpreter has no torch), each part's rows are printed when it finishes and the whole table comes
    last, the JSON and Markdown land in $OUT; the parameter formulas match both engines' counts."""
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
    assert names[0] == "GPU tests (pytest tests/gpu)" and names[1].startswith("tokens/s llama")
    assert sum(n.startswith("tokens/s") for n in names) == 2 and sum(n.startswith("2 ranks") for n in names) == 4
    assert sum(n.startswith("attention") for n in names) == 3 and any(n.startswith("AdamW") for n in names)
    assert {"doctor: MPI", "doctor: kernel parity", "doctor: kernel speed"} <= set(names)      # hpengine doctor's lines
    assert all(p.stdout.count(n) >= 2 for n in names)          # each row printed after its part, then at the end
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["mode"] == "cpu-smoke" and len(doc["rows"]) == len(names)
    assert {r["status"] for r in doc["rows"]} <= {"PASS", "INFO", "SKIP", "smoke"}
    by = {r["what"]: r for r in doc["rows"]}
    assert by["GPU tests (pytest tests/gpu)"]["status"] == "PASS"
    torch_here = importlib.util.find_spec("torch") is not None         # the interop extra's torch, if installed
    if torch_here:
        assert by[next(n for n in by if n.endswith("hpengine float32"))]["status"] == "PASS"   # agrees with torch
    res = doc["results"]
    assert res["bandwidth"]["timings"]["adamw"]["traffic"] == 28 * (1 << 20)
    for model in ("llama", "gpt2"):
        shape = opts.SMOKE_MODELS[model]
        assert res[f"{model}:hpengine"]["tokens_per_s"] > 0
        assert res[f"{model}:hpengine"]["n_params"] == gm.n_params(shape)
        for mode in ("eager", "compile") if torch_here else ():
            assert res[f"{model}:torch"][mode]["n_params"] == gm.n_params(shape)
    assert res["calibrate"]["cluster"]["tflops_fp32"] > 0      # --device cpu in the smoke run
    mpi = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpi:
        assert [r["status"] for r in doc["rows"] if r["what"].startswith("2 ranks")][:3] == ["PASS", "PASS", "INFO"]
        assert res["dp2:2"]["variants"]["mpi"]["tokens_per_s"] > 0
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
