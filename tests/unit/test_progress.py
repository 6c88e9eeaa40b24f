"""The progress line (step N/total, elapsed, ETA, tokens/s, MFU, memory), the metrics.jsonl fields it adds,
the peak FLOP/s table, and runtime.peak_tflops."""
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
    run(small_corpus, tmp_path / "run", "runtime.peak_tflops=0.002")
    rs = rows(tmp_path / "run")
    assert len(rs) == 5
    for r in rs:
        want = closed_form_flops() / (r["step_ms"] / 1e3) / 2e9
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
    assert rs[-1]["eta_s"] == 0 and rs[0]["eta_s"] > 0
    assert isinstance(rs[0]["mfu"], float)           # on the CPU the GEMM rate is timed at start-up


def test_progress_line_shows_total_mfu_memory_elapsed_and_eta(tmp_path, small_corpus, capsys):
    run(small_corpus, tmp_path / "run", "runtime.peak_tflops=0.002")
    out = capsys.readouterr().out
    assert "MFU against 0.002 TFLOP/s per rank x 1 rank(s) (runtime.peak_tflops)" in out
    line = re.compile(r"step +(\d+)/5 \| loss [\d.]+ \| lr \S+ \| gnorm [\d.]+ \| [\d,]+ tok/s \| \d+ ms \| "
                      r"MFU [\d.]+% \| RSS [\d,]+ MiB \| \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d$")
    shown = [m for m in map(line.search, out.splitlines()) if m]
    assert len(shown) == 3                            # the first step and every log_every = 2


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_eta_uses_the_mean_of_the_recent_steps():
    clock = _Clock()
    p = progress.Progress(total=100, start=10, flops_step=1e9, peak_total=None, clock=clock)
    clock.t = 500.0                                   # one slow first step ...
    p.update({"step_ms": 1.0})
    for _ in range(progress.RECENT):                   # ... then RECENT steps of 2 s each
        clock.t += 2.0
        f = p.update({"step_ms": 2000.0})
    done = 10 + 1 + progress.RECENT
    assert p.label() == f"{done}/100"
    assert f["eta_s"] == pytest.approx(2.0 * (100 - done))
    assert f["elapsed_s"] == pytest.approx(500 + 2.0 * progress.RECENT)
    assert f["mfu"] is None                           # no peak: no MFU, and the line leaves it out
    assert "MFU" not in progress.suffix(f)
    assert progress.hms(3725) == "1:02:05"


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
