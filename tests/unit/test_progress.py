"""The progress line (step N/total, elapsed, ETA, tokens/s, MFU, memory), the metrics.jsonl fields it adds,
the peak FLOP/s table, the measured CPU peak and its cache, and runtime.peak_tflops."""
from __future__ import annotations

import json
import re

import pytest

from hpengine.run import progress
from hpengine.planner import peaks
from hpengine.config.load import ConfigError, load_config
from hpengine.run.train import train

V, T, C, L, B = 256, 8, 16, 2, 4          # vocabulary, seq_len, d_model, layers, global batch
TINY = ["model.kind='gpt'", f"model.seq_len={T}", f"model.d_model={C}", f"model.n_layers={L}", "model.n_heads=2",
        f"model.vocab_size={V}", "model.ffn_mult=4", "model.tie_head=false", f"train.global_batch={B}",
        "runtime.backend='numpy'", "train.steps=5", "train.eval_every=0", "train.log_every=2"]


def closed_form_flops() -> float:
    """6 N tokens + attention, written from the GPT's shapes: N = wte V C + wpe T C + L (12 C^2 + 13 C)
    + ln_f 2 C + head C V; attention 12 L T C per token (QK^T and PV, forward + backward)."""
    n = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C + C * V
    tokens = B * T
    return 6 * n * tokens + 12 * L * T * C * tokens


def run(small_corpus, out, *extra):
    return train(load_config(None, TINY + [f"data.path={small_corpus}", f"train.out_dir={out}", *extra]))


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mfu_is_the_closed_form_flops_over_step_time_and_the_set_peak(tmp_path, small_corpus):
    run(small_corpus, tmp_path / "run", "runtime.peak_tflops=0.05")
    rs = rows(tmp_path / "run")
    assert len(rs) == 5
    for r in rs:
        want = closed_form_flops() / (r["step_ms"] / 1e3) / 5e10
        assert r["mfu"] == pytest.approx(want, rel=1e-12)


def test_metrics_rows_carry_elapsed_eta_and_memory(tmp_path, small_corpus):
    run(small_corpus, tmp_path / "run")
    rs = rows(tmp_path / "run")
    for r in rs:
        assert {"mfu", "elapsed_s", "eta_s", "mem_bytes"} <= set(r)
        assert r["mem_bytes"] > 10 * 2**20           # peak RSS of a Python process with NumPy
        assert r["mfu"] is None or 0 < r["mfu"]
    elapsed = [r["elapsed_s"] for r in rs]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert rs[-1]["eta_s"] == 0 and rs[1]["eta_s"] > 0
    assert rs[0]["eta_s"] is None                    # one step, the slow first one, tells no ETA
    assert isinstance(rs[0]["mfu"], float)           # on the CPU the GEMM rate is timed at start-up


def test_progress_line_shows_total_mfu_memory_elapsed_and_eta(tmp_path, small_corpus, capsys):
    run(small_corpus, tmp_path / "run", "runtime.peak_tflops=0.05")
    out = capsys.readouterr().out
    assert "MFU against 0.05 TFLOP/s per rank x 1 rank(s) (runtime.peak_tflops)" in out
    line = re.compile(r"step +(\d+)/5 \| loss [\d.]+ \| lr \S+ \| gnorm [\d.]+ \| [\d,]+ tok/s \| \d+ ms \| "
                      r"MFU [\d.]+% \| RSS [\d,]+ MiB \| \d+:\d\d:\d\d elapsed, ETA (\d+:\d\d:\d\d|n/a)$")
    shown = [m for m in map(line.search, out.splitlines()) if m]
    assert len(shown) == 3                            # the first step and every log_every = 2


def test_a_muon_run_names_its_optimizer_in_rows_progress_line_start_up_and_summary(tmp_path, small_corpus, capsys):
    """Muon (not the default): every row and progress line name it; AdamW runs' rows stay as they were; the
    start-up line and summary.json name the optimizer either way."""
    summary = run(small_corpus, tmp_path / "muon", "optim.name='muon'")
    assert all(r["optimizer"] == "muon" for r in rows(tmp_path / "muon")) and summary["optimizer"] == "muon"
    out = capsys.readouterr().out
    assert len(re.findall(r"step +\d+/5 \| muon \| loss ", out)) == 3
    assert "optimizer muon: Newton-Schulz (5 iterations) on 8 weight matrices of the blocks" in out
    summary = run(small_corpus, tmp_path / "adamw")
    assert not any("optimizer" in r for r in rows(tmp_path / "adamw")) and summary["optimizer"] == "adamw"
    assert json.loads((tmp_path / "adamw" / "summary.json").read_text())["optimizer"] == "adamw"
    assert "optimizer adamw: lr " in capsys.readouterr().out


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_eta_is_the_median_step_after_the_warm_up_a_slow_first_step_does_not_count():
    clock = _Clock()
    p = progress.Progress(total=100, start=10, flops_step=1e9, peak_total=None, clock=clock)
    clock.t = 500.0                                   # one slow first step ...
    f = p.update({"step_ms": 1.0})
    assert f["eta_s"] is None and "ETA n/a" in progress.suffix(f)
    clock.t += 3.0
    assert p.update({"step_ms": 1.0})["eta_s"] == pytest.approx(3.0 * (100 - 12))   # the first one left out
    times = [2.0, 2.0, 9.0, 2.0, 2.5, 1.5, 2.0]       # ... then steps of about 2 s, one slow (an evaluation)
    for dt in times:
        clock.t += dt
        f = p.update({"step_ms": 2000.0})
    done = 10 + 2 + len(times)
    assert p.label() == f"{done}/100"
    after_warmup = times[progress.WARMUP - 2:]
    assert f["eta_s"] == pytest.approx(sorted(after_warmup)[len(after_warmup) // 2] * (100 - done))
    assert f["eta_s"] == pytest.approx(2.0 * (100 - done))
    assert f["elapsed_s"] == pytest.approx(500 + 3 + sum(times))
    assert f["mfu"] is None                           # no peak: no MFU figure
    assert "MFU n/a" in progress.suffix(f)
    assert progress.hms(3725) == "1:02:05" and progress.hms(None) == "n/a"


def test_eta_from_synthetic_step_times_ignores_a_slow_start():
    clock = _Clock()
    p = progress.Progress(total=240, start=0, flops_step=1e9, peak_total=None, clock=clock)
    etas = []
    for i in range(30):                               # a 4-minute run: 1 s steps after a 60 s first step
        clock.t += 60.0 if i == 0 else 1.0
        etas.append(p.update({"step_ms": 1000.0})["eta_s"])
    assert etas[0] is None
    assert all(e == pytest.approx(240 - i - 1) for i, e in enumerate(etas) if i)


def test_a_step_above_the_peak_shows_mfu_na_never_over_100_percent():
    seen = []
    p = progress.Progress(total=10, start=0, flops_step=1e9, peak_total=1e12, clock=_Clock(), exceeded=seen.append)
    assert p.update({"step_ms": 2.0})["mfu"] == pytest.approx(0.5)
    f = p.update({"step_ms": 0.5})                    # 2e12 FLOP/s: the peak was wrong
    assert f["mfu"] is None and seen == [pytest.approx(2e12)]
    assert "MFU n/a" in progress.suffix(f)
    assert p.update({"step_ms": 2.0})["mfu"] is None  # a peak once proved wrong is not trusted again
    assert seen == [pytest.approx(2e12)]
    assert "MFU n/a" in progress.suffix({"mfu": 1.23})
    assert "MFU 50.0%" in progress.suffix({"mfu": 0.5})
    assert json.loads(json.dumps(f))["mfu"] is None


def test_measured_peak_cache_keeps_the_best_and_ignores_a_corrupt_file(tmp_path, caplog):
    caplog.set_level("INFO", logger="hpengine")
    path = tmp_path / "cache" / peaks.CACHE_NAME
    assert peaks.best_peak("k", 5e9, path=path) == (5e9, "measured now")         # no file: measured, and filed
    assert peaks.best_peak("k", 2e9, path=path)[0] == 5e9                        # timed under load: the best stays
    peak, where = peaks.best_peak("k", 8e9, path=path)
    assert peak == 8e9 and "above the 5 GFLOP/s cached" in where
    assert peaks.best_peak("other", 1e9, path=path)[0] == 1e9                    # keyed: another CPU/kernel/dtype
    assert json.loads(path.read_text())["peaks"] == {"k": 8e9, "other": 1e9}
    for junk in (b"\x00\xff not json", b'{"peaks": {"k": 1e30}}', b"[1, 2]",
                 json.dumps({"format": peaks.CACHE_FORMAT, "peaks": {"k": "fast"}}).encode(),
                 json.dumps({"format": peaks.CACHE_FORMAT, "peaks": {"k": -1}}).encode()):
        path.write_bytes(junk)
        assert peaks.best_peak("k", 3e9, path=path) == (3e9, "measured now"), junk
        assert json.loads(path.read_text())["peaks"] == {"k": 3e9}           # replaced by a good one
    assert f"measured GEMM peaks ignored: '{path}'" in caplog.text
    bound = peaks.cpu_bound(4)
    path.write_text(json.dumps({"format": peaks.CACHE_FORMAT, "peaks": {"k": 90e9}}))
    assert peaks.best_peak("k", 3e9, bound, path)[0] == 90e9          # 30 x a timing under load: still the best
    path.write_text(json.dumps({"format": peaks.CACHE_FORMAT, "peaks": {"k": 1e30}}))
    assert peaks.best_peak("k", 3e9, bound, path)[0] == 3e9           # no CPU of 4 threads runs that: refused
    assert "refused" in caplog.text and json.loads(path.read_text())["peaks"] == {"k": 3e9}


def test_peak_key_names_the_cpu_the_blas_kernel_threads_and_dtype():
    key = peaks.peak_key("float32", 512, 4)
    assert peaks.cpu_model() in key and peaks.blas_kernel() in key and "4 thread(s)" in key and "float32 512^3" in key
    assert peaks.peak_key("float64", 512, 4) != key and peaks.peak_key("float32", 512, 2) != key


def test_mfu_never_exceeds_100_percent_after_a_calibration_under_load(tmp_path, small_corpus, monkeypatch):
    """Busy processes on every core while the peak is timed, none while training: every MFU is <= 1 or null."""
    import os
    import subprocess
    import sys
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path / "cache"))        # no earlier, unloaded figure
    real, timed = progress.measured_peak, []

    def under_load(*args):
        timed.append(args)
        spin = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
        busy = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
                for _ in range(min(16, len(os.sched_getaffinity(0))))]
        try:
            for b in busy:
                assert b.stdout.read(1) == b"x"            # spinning before the peak is timed
            return real(*args)
        finally:
            for b in busy:
                b.kill()
                b.wait()
                b.stdout.close()
    monkeypatch.setattr(progress, "measured_peak", under_load)
    run(small_corpus, tmp_path / "run", "train.steps=8")
    rs = rows(tmp_path / "run")
    assert len(rs) == 8 and len(timed) == 1                    # the run's peak was timed under load
    assert all(r["mfu"] is None or 0 < r["mfu"] <= 1.0 for r in rs)
    assert (tmp_path / "cache" / peaks.CACHE_NAME).is_file()


def test_peak_table_knows_the_datacenter_gpus():
    assert peaks.table_peak("NVIDIA H200", "16bit") == 989.0
    assert peaks.table_peak("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peaks.table_peak("NVIDIA H100 PCIe", "16bit") == 756.0
    assert peaks.table_peak("NVIDIA A100-SXM4-80GB", "16bit") == 312.0
    assert peaks.table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peaks.table_peak("NVIDIA GeForce RTX 4090", "fp32") is None


class _FakeGPU:
    is_gpu, device = True, 0

    class xp:
        class cuda:
            class runtime:
                @staticmethod
                def getDeviceProperties(i):
                    return {"name": b"Some Future GPU"}


def test_unknown_gpu_without_peak_names_the_key():
    cfg = load_config(None, [])
    peak, why = progress.peak_per_rank(cfg, _FakeGPU, None, "float32")
    assert peak is None and "Some Future GPU" in why and "runtime.peak_tflops" in why
    cfg = load_config(None, ["runtime.peak_tflops=50"])
    assert progress.peak_per_rank(cfg, _FakeGPU, None, "float32") == (50e12, "runtime.peak_tflops")


def test_precision_column_follows_amp_dtype_and_tf32():
    assert peaks.precision_of(load_config(None, ["strategy.amp.enable=true"])) == "16bit"
    assert peaks.precision_of(load_config(None, ["model.dtype='float64'"])) == "fp64"
    assert peaks.precision_of(load_config(None, ["runtime.matmul_precision='tf32'"])) == "tf32"
    assert peaks.precision_of(load_config(None, [])) == "fp32"


def test_negative_peak_is_one_clear_line():
    with pytest.raises(ConfigError, match=r"runtime\.peak_tflops.*-1.*>= 0") as e:
        load_config(None, ["runtime.peak_tflops=-1"])
    assert "\n" not in str(e.value)


def test_the_line_redraws_only_on_a_terminal_outside_any_launcher(tmp_path):
    import os
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, open(tmp_path / "log", "w") as f:
            assert progress.redraws(tty, env={}) and not progress.redraws(f, env={})
            for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_STEP_ID"):   # Open MPI: a pty
                assert not progress.redraws(tty, env={var: "0"}), var
        r, w = os.pipe()
        with open(w, "w") as pipe:
            assert not progress.redraws(pipe, env={})
        os.close(r)
    finally:
        os.close(master)
        os.close(slave)


def test_measured_peak_starts_from_the_cached_best_and_a_fast_step_raises_it(tmp_path, monkeypatch):
    import numpy as np
    from hpengine.device.threads import pool_size
    from hpengine.planner import calibrate
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path))
    first, where = calibrate.measured_peak(np, np.float32, 64)
    assert first > 0 and where == "measured now"
    path, key = peaks.cache_file(), peaks.peak_key("float32", 64, pool_size())
    assert path == tmp_path / peaks.CACHE_NAME and json.loads(path.read_text())["peaks"] == {key: first}
    # a cached best well above this timing, yet below what any CPU of these threads could reach (else refused)
    best = min(8 * first, peaks.cpu_bound(pool_size()) / 2)
    path.write_text(json.dumps({"format": peaks.CACHE_FORMAT, "peaks": {key: best}}))
    again, where = calibrate.measured_peak(np, np.float32, 64)
    assert again == best and "cached" in where                       # a slower timing now does not lower it
    progress._raise("float32", 2, 4e12)                              # a step of 2 ranks ran at 4 TFLOP/s
    key512 = peaks.peak_key("float32", progress.gemm_size("float32"), pool_size())
    assert json.loads(path.read_text())["peaks"][key512] == 2e12
