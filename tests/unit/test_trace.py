"""Issue 11 on one process: the tracer's bound, tracing off records nothing, the merged Chrome trace, the
end-of-run breakdown (bytes equal the comm stats), FLOPs formula, and `hpengine plot` (PNGs, bad input)."""
from __future__ import annotations

import json
import sys

import pytest
from mpi4py import MPI

from hpengine.run import train as train_mod
from hpengine.cli.commands import main
from hpengine.dist.comm import TRACED
from hpengine.config.load import ConfigError, load_config
from hpengine.apps.plot import PlotError, plot_run
from hpengine.run.trace import CATEGORIES, OFF, Tracer, merge, model_flops
from hpengine.run.build import build
from hpengine.run.train import train

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.steps=4", "train.eval_every=2"]
PNG = b"\x89PNG\r\n\x1a\n"


def run(small_corpus, out, *extra, monkeypatch=None):
    """train() on a tiny config; returns (summary, engine)."""
    built = {}

    def keep(cfg, world=None):
        eng, prediction = build_job(cfg, world)
        built["eng"] = eng
        return eng, prediction
    build_job = train_mod.build_job
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "build_job", keep)
        summary = train(load_config(None, TINY + [f"data.path={small_corpus}", f"train.out_dir={out}", *extra]))
    return summary, built["eng"]


def valid_chrome_trace(doc: dict) -> list[dict]:
    """The "X" events of a Chrome trace (JSON object format), after checking every event's fields."""
    assert isinstance(doc["traceEvents"], list)
    xs = []
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0 and isinstance(e["ts"], (int, float)), e
            assert isinstance(e["cat"], str) and isinstance(e["args"], dict), e
            xs.append(e)
        else:
            assert "name" in e["args"] or "sort_index" in e["args"], e
    return xs


# ---------------------------------------------------------------- the tracer

def test_buffer_keeps_the_latest_events_within_its_bound():
    tr = Tracer(record=True, max_events=5)
    for i in range(12):
        tr.lap("forward", tr.now(), "F", (i, 0))
    assert len(tr.events) == 5 and tr.dropped == 7
    assert [e[4][0] for e in tr.events] == [7, 8, 9, 10, 11]
    assert tr.seconds["forward"] > 0


def test_tracer_off_keeps_phase_timers_but_records_no_events():
    tr = Tracer()
    t = tr.lap("data", tr.now())
    tr.lap("optimizer", t)
    assert tr.events is None and tr.dropped == 0 and set(tr.seconds) == {"data", "optimizer"}
    assert OFF.record is False


def test_merge_aligns_clocks_and_gives_each_category_one_tid_on_every_rank():
    c0 = {"tp": 0, "sharding": 0, "dp": 0, "pp": 0}
    c1 = dict(c0, pp=1)
    parts = [(0, c0, [("forward", "F", 1_000_000, 2_000, (0, 0)), ("comm:pp", "Isend", 1_003_000, 500, 4096)], 0),
             (1, c1, [("backward", "B", 5_000_000, 1_000, (0, 1)), ("forward", "F", 4_000_000, 1_000, (0, 1))], 3)]
    doc = merge(parts, [(0, 0), (3_000_000, 1_500)], t_zero=1_000_000)
    xs = valid_chrome_trace(json.loads(json.dumps(doc)))
    by = {(e["pid"], e["name"]): e for e in xs}
    assert by[(0, "F0")]["ts"] == 0.0 and by[(0, "F0")]["dur"] == 2.0
    assert by[(1, "F0")]["ts"] == 0.0 and by[(1, "B0")]["ts"] == 1000.0      # rank 1's clock runs 3 ms ahead
    assert by[(1, "F0")]["tid"] == by[(0, "F0")]["tid"] != by[(1, "B0")]["tid"]
    assert by[(0, "Isend")]["args"] == {"bytes": 4096, "comm": "pp"}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 [dp0 sh0 pp0 tp0]", 1: "rank 1 [dp0 sh0 pp1 tp0]"}
    assert doc["otherData"]["dropped_events"] == [0, 3] and doc["otherData"]["clock_error_us"] == [0.0, 1.5]


# ---------------------------------------------------------------- a real run

def test_trace_on_writes_a_chrome_trace_and_a_breakdown(tmp_path, small_corpus):
    out = tmp_path / "run"
    summary, eng = run(small_corpus, out, "runtime.trace=true", "checkpoint.every=2",
                       "strategy.pipeline.enable=true", "strategy.pipeline.micro_batches=2")
    doc = json.loads((out / "trace.json").read_text())
    xs = valid_chrome_trace(doc)
    cats = {e["cat"] for e in xs}
    assert {"step", "forward", "backward", "data", "grad sync wait", "optimizer", "eval", "checkpoint"} <= cats
    fwd = sorted(e["name"] for e in xs if e["cat"] == "forward")
    assert fwd == sorted(["F0", "F1"] * 4)         # 4 steps x 2 micro-batches (evaluation is one "eval" span)
    assert len([e for e in xs if e["cat"] == "step"]) == 4
    bd = json.loads((out / "breakdown.json").read_text())
    assert bd["steps"] == 4 and bd["ranks"] == 1 and set(bd["time"]) == {c for c, _ in CATEGORIES} | {"other"}
    assert bd["time"]["forward"]["mean_s"] > 0 and bd["time"]["checkpoint"]["mean_s"] > 0
    assert abs(sum(t["mean_s"] for t in bd["time"].values()) - bd["wall_s"]) < 1e-6
    for c in [*eng.mesh.comms.values(), eng.world]:
        if c is not None:
            assert bd["bytes"][c.name]["per_rank"] == [sum(b for _, b in c.stats.values())]
    assert bd["memory"][0]["param_bytes"] == eng.memory()["param_bytes"]
    flops, formula = model_flops(eng)
    assert bd["flops"]["per_step"] == flops and "6 x Psi" in formula
    assert bd["flops"]["achieved_flop_s"] == pytest.approx(flops * 4 / bd["flops"]["train_step_s"])


def test_trace_off_records_nothing_but_still_writes_the_breakdown(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    _, eng = run(small_corpus, out)
    assert not (out / "trace.json").exists()
    assert eng.tracer.events is None and eng.tracer.seconds["forward"] > 0
    for c in [*eng.mesh.comms.values(), eng.world]:
        if c is not None:       # no timed wrapper shadows the plain methods
            assert c.tracer is None and not set(TRACED) & set(vars(c))
    bd = json.loads((out / "breakdown.json").read_text())
    assert bd["mpi_call_s"] == {} and bd["time"]["backward"]["mean_s"] > 0
    stdout = capsys.readouterr().out
    assert "end-of-run breakdown" in stdout and "compute: forward" in stdout and "GFLOP/s" in stdout


# Parameter counts by hand for TINY (vocab V = 256, seq_len T = 8, d_model C = 16, n_layers L = 2, ffn
# width F = 4 C = 64), tensor by tensor:
#   GPT embed  wte V*C + wpe T*C                       = 4096 + 128                          = 4224
#   GPT layer  ln1 2C + qkv (C*3C + 3C) + proj (C*C + C)
#              + ln2 2C + fc (C*F + F) + proj (F*C + C) = 32 + 816 + 272 + 32 + 1088 + 1040  = 3280
#              (= 12 C^2 + 13 C = 3072 + 208)
#   MLP embed  wte V*C                                                                      = 4096
#   MLP layer  ln 2C + fc (C*F + F) + proj (F*C + C)   = 32 + 1088 + 1040                    = 2160
#   head       ln_f 2C (+ lm_head C*V when untied)     = 32 (+ 4096)
# so GPT untied: 4224 + 2*3280 + 32 + 4096 = 14912; tied: 14912 - 4096 = 10816; MLP untied:
# 4096 + 2*2160 + 32 + 4096 = 12544.
# FLOPs/step = tokens x (6 Psi + 12 L T C) per model, tokens = global_batch 4 x T 8 = 32, and the attention
# term 12 L T C = 12*2*8*16 = 3072 for the GPT only:
#   GPT untied: 32 * (6*14912 + 3072) = 32 * 92544 = 2961408
#   GPT tied:   32 * (6*10816 + 3072) = 32 * 67968 = 2174976
#   MLP untied: 32 * 6*12544          = 32 * 75264 = 2408448
#   two GPTs:   2 * 2961408                        = 5922816
@pytest.mark.parametrize("extra,psi,flops", [
    ([], 14912, 2961408),
    (["model.tie_head=true"], 10816, 2174976),
    (["model.kind='mlp'"], 12544, 2408448),
    (["train.models=2"], 2 * 14912, 5922816),
], ids=["gpt-untied", "gpt-tied", "mlp", "two-models"])
def test_model_flops_closed_form(small_corpus, extra, psi, flops):
    pinned = ["model.vocab_size=256", "model.ffn_mult=4", "model.tie_head=false"]   # not left to defaults
    eng = build(load_config(None, TINY + pinned + [f"data.path={small_corpus}", *extra]), MPI.COMM_SELF)
    assert eng.n_params() == psi
    got, formula = model_flops(eng)
    assert got == flops
    assert "6 x Psi" in formula


def test_trace_max_events_must_be_positive():
    with pytest.raises(ConfigError, match="runtime.trace_max_events"):
        load_config(None, ["runtime.trace_max_events=0"])


# ---------------------------------------------------------------- hpengine plot

def test_plot_writes_the_pngs_of_a_real_run(tmp_path, small_corpus, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    run(small_corpus, out, "runtime.trace=true", "strategy.pipeline.enable=true",
        "strategy.pipeline.micro_batches=2")
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0
    stdout = capsys.readouterr().out
    for name in ("loss.png", "throughput.png", "pipeline_gantt.png"):
        assert (out / "plots" / name).read_bytes()[:8] == PNG, name
        assert f"wrote {out / 'plots' / name}" in stdout
    assert main(["plot", str(out), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "pipeline_gantt.png").exists()


def test_plot_a_pipeline_run_without_trace_says_which_switch_records_it(tmp_path, small_corpus, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    run(small_corpus, out, "strategy.pipeline.enable=true", "strategy.pipeline.micro_batches=2")
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no trace.json" in err and "runtime.trace=true" in err
    assert (out / "plots" / "loss.png").exists() and not (out / "plots" / "pipeline_gantt.png").exists()


def test_plot_a_run_without_pipeline_has_no_gantt_note(tmp_path, small_corpus, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    run(small_corpus, out)
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0
    got = capsys.readouterr()
    assert got.err == "" and "wrote" in got.out
    assert not (out / "plots" / "pipeline_gantt.png").exists()


def test_plot_bad_input_is_one_clear_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a run folder" in err and "metrics.jsonl" in err and err.count("\n") == 1
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no steps" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0, "tokens_per_s": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    with pytest.raises(PlotError, match=r"needs matplotlib.*hpengine\[plot\]"):
        plot_run(tmp_path)
