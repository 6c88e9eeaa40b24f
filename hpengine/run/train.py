"""The training loop: run folder, logging, evaluation cadence, metrics.jsonl, final summary.
Launch with `hpengine train CONFIG` (one process) or `mpiexec -n N hpengine train CONFIG`.
"""
from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpengine.checkpoint import background, guard as ckpt_guard, hf_import, shards as checkpoint, write as ckpt_write
from hpengine.config.load import to_toml
from hpengine.dist.agree import agree_or_raise
from hpengine.dist.watchdog import Watchdog, progress as bytes_written
from hpengine.files import UnsafeFile, open_append, write_file
from hpengine.planner import search as plan
from hpengine.planner.memory import buddy_bytes
from hpengine.run import faults, launch, progress, resilience, supervisor, tensorboard as tboard, trace
from hpengine.run.build import (
    build_job,
    check_same_tokenizer,
    compute_dtype,
    data_meta,
    load_together,
)
from hpengine.run.resilience import Resilience
from hpengine.run.resume import layout_change, resolve_resume
from hpengine.run.runlog import log_memory, log_pipeline, log_start
from hpengine.run.run_dir import RunError, lock_run_dir, prepare_run_dir, trim_metrics, unlock_run_dir

log = logging.getLogger("hpengine")


def _lines(m: dict) -> list[dict]:
    """metrics.jsonl lines of one step: one, or one per model (with a `model` field)."""
    if "models" not in m:
        return [m]
    common = {k: v for k, v in m.items() if k not in ("models", "loss", "lr", "grad_norm", "val_loss")}
    return [{**common, **pm} for pm in m["models"]]


def _fmt(m: dict, total: int | str = "?") -> str:
    s = ("" if "model" not in m else f"model {m['model']} | ") + f"step {m['step']:>5}/{total} | " + (
        f"{m['optimizer']} | " if "optimizer" in m else "") + (
        f"loss {m['loss']:.4f} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f}"
        f" | {m['tokens_per_s']:,.0f} tok/s | {m['step_ms']:.0f} ms")
    if "mtp_loss" in m:          # multi-token prediction: the mean of its depths' cross-entropies (unweighted)
        s += f" | mtp {m['mtp_loss']:.4f}"
    if "moe_aux_loss" in m:      # the MoE layers' balancing losses, mean per layer (aux: 1 under uniform routing)
        s += f" | moe aux {m['moe_aux_loss']:.3f} z {m['moe_z_loss']:.3g} load max/mean {m['moe_load_max']:.2f}"
    if "outer_step" in m:        # DiLoCo: outer steps done; at one, this island's drift and the mean pseudo-gradient
        s += f" | outer {m['outer_step']}" + (
            f" drift {m['outer_drift']:.3g} pgrad {m['outer_grad_norm']:.3g} sent {m['replica_bytes'] / 1e6:.2f} MB"
            if "outer_drift" in m else "")
    if "moe_dropped" in m:       # under a capacity: the share of (token, slot) assignments dropped
        s += f" dropped {m['moe_dropped']:.3f}"
    return s + progress.suffix(m) + (f" | val {m['val_loss']:.4f}" if "val_loss" in m else "")


def _fp_quiet():
    """NumPy's overflow/invalid warnings off: a diverging run reaches inf/NaN in many places at once, and the
    engine's non-finite check reports it in one line (the warnings would only print a screen before it)."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


# The run folder keeps the data's tokenizer as tokenizer.json: the Hugging Face tokenizer.json text the token
# files carry (its sha256 is the tokenizer_sha256 that summary.json and every checkpoint record), or
# {"hpengine": "bytes"} for byte-level files (ids 0-255 are the bytes); none for files that record no tokenizer
# (version 1).
def train(cfg, world=None, resume=None) -> dict:
    """Run optimizer steps up to cfg.train.steps (from a checkpoint's step when resuming); returns the
    final summary (same on every rank). The run folder is locked for the whole run."""
    world = world or MPI.COMM_WORLD
    guard = None
    if cfg.resilience.on_failure != "abort":     # spares held idle; the mesh is the world less them
        guard = Resilience(cfg, world)
        if guard.spare:
            return _serve_as_spare(cfg, guard)
        world = guard.compute
    eng, prediction = build_job(cfg, world)
    lock = lock_run_dir(cfg, world)             # before anything reads or renames inside the folder
    try:
        try:
            return _train(eng, cfg, world, resume, prediction, guard)
        except resilience.LeftMesh:         # shrink: this rank's replica left the mesh; it serves as a spare
            return _serve_as_spare(guard.cfg, guard)
    finally:
        unlock_run_dir(lock)


def _serve_as_spare(cfg, guard) -> dict:
    """A spare rank: it waits; when a rank dies and this one takes its place, it trains from there on."""
    while guard.wait():
        got = guard.recover()
        if got is not None:
            eng = resilience.rebuilt(guard.cfg, guard, got)
            try:
                return _train(eng, guard.cfg, guard.compute, None, None, guard, joined=got[0])
            except resilience.LeftMesh:         # a later shrink dropped its replica: it waits again
                continue
    return {"spare": True, "stopped_early": None}


def _train(eng, cfg, world, resume, prediction, guard=None, joined=None) -> dict:
    if joined is not None:      # a spare that took a dead rank's place, at step `joined`
        supervisor.report(faults.rank_record(eng.mesh), cfg.train.out_dir, survive=True)
        return _train_loop(eng, cfg, world, joined, guard, _Joined(cfg, world))
    launched = launch.launch_record(world.Get_size(), eng.mesh.degrees)     # launch.json, summary.json
    note = launch.open_mpi_start_note(continue_command(cfg.train.out_dir, launched))
    if note:          # Ctrl-C to mpirun kills the ranks before anything can say how to go on: said up front
        log.info("%s", note)
    resume = resolve_resume(cfg, world, resume, log)     # --resume auto: a checkpoint, or None
    start = restore(eng, cfg, resume)
    if resume is not None and world.Get_rank() == 0:      # before prepare_run_dir replaces launch.json
        change = layout_change(cfg, resume, launched)
        if change:
            log.info("%s", change)
    if start >= cfg.train.steps:              # the same step on every rank: every rank refuses together
        raise RunError(f"--resume {resume}: the checkpoint is at step {start} and train.steps = "
                       f"{cfg.train.steps}: nothing to train; raise train.steps (--set train.steps=N) to go on")
    out = prepare_run_dir(cfg, world, resuming=resume, data=eng.data, launched=launched)
    failures_before = faults.failures_size(out)     # what an earlier run of a resumed folder recorded
    if cfg.checkpoint.at_end or cfg.checkpoint.every or cfg.checkpoint.every_minutes:   # found now, not at the first save
        ckpt_guard.check_writable(world, checkpoint_root(cfg))
    log_start(eng, cfg)
    ranks = faults.gather_ranks(world, eng.mesh)
    log.info("ranks (host, pid, mesh coordinates): %s", faults.write_ranks_file(ranks, out, world.Get_rank()))
    supervisor.report(ranks[world.Get_rank()], out, survive=guard is not None)     # a death without a message is named
    # watching peers, the launcher and the run folder's failures from here: a rank that dies now can leave
    # the others waiting in a start-up collective
    monitor = faults.Monitor(ranks, world.Get_rank(), watch_parent=faults.launched(), run_dir=out,
                             failures_seen=failures_before, survive=guard is not None).start()
    try:
        plan.log_prediction(prediction, log, rank=eng.mesh.rank)
        if guard is not None:        # the memory check counted them: the start-up log says both
            guard.predicted = buddy_bytes(cfg.resilience, prediction.get("memory"))
        if resume is not None:
            trim_metrics(out, start, world.Get_rank())
        metrics_f = agree_or_raise(world, lambda: _open_metrics(out, resume) if world.Get_rank() == 0 else None,
                                   RunError, (RunError, UnsafeFile))
        prog = progress.begin(eng, cfg, world, start, compute_dtype(cfg), log)     # MFU peak, ETA, memory
        tbw = tboard.open_writer(cfg, out, world.Get_rank())
        tracer = trace.attach(eng, cfg)    # phase timers always; a timeline under runtime.trace
        t_start = time.perf_counter()
        watchdog = Watchdog(cfg.runtime.watchdog_s, eng.mesh.prefix()).start()
    except BaseException:
        monitor.stop()
        raise
    setup = _Setup(out, metrics_f, prog, tbw, tracer, watchdog, monitor, t_start, launched)
    return _train_loop(eng, cfg, world, start, guard, setup)


class _Setup:
    """What the training loop needs of the run's start-up."""

    def __init__(self, out, metrics_f, prog, tbw, tracer, watchdog, monitor, t_start, launched):
        self.out, self.metrics_f, self.prog, self.tbw, self.tracer = out, metrics_f, prog, tbw, tracer
        self.watchdog, self.monitor, self.t_start, self.launched = watchdog, monitor, t_start, launched


class _Joined(_Setup):
    """A spare's start-up when it takes a dead rank's place: the run folder exists; rank 0 writes metrics."""

    def __init__(self, cfg, world):
        super().__init__(Path(cfg.train.out_dir), None, None, None, None,
                         Watchdog(cfg.runtime.watchdog_s, "").start(), None, time.perf_counter(),
                         launch.launch_record(world.Get_size() + cfg.resilience.spares, {}))


def _train_loop(eng, cfg, world, start, guard, setup) -> dict:
    out, launched, watchdog = setup.out, setup.launched, setup.watchdog
    history, stop, saved = [], None, None
    if setup.prog is None:             # a spare joining: the collectives every rank runs after a recovery
        history, saved, stop = resilience.rejoin(eng, cfg, world, setup, start, history, (saved, stop),
                                                 guard.survivor(), _open_metrics)
        saved = _resave(eng, cfg, guard, start, None) or saved
    elif guard is not None:
        guard.commit(eng, start)       # the buddy copies of the state training starts from
    launch.on_interrupt(setup.monitor.interrupted if setup.monitor else None)
    restore_signals = launch.install_stop_handlers()
    last_save = _clock()      # when this run last saved (checkpoint.every_minutes); `saved`: which step
    saver = background.Saver(eng.world, eng.tracer, log) if cfg.checkpoint.async_ else None
    eng.fence_updates(_fence(saver, watchdog) if saver else None)
    held = False           # a periodic save due at a skipped (overflowed) step: made at the next applied step
    if saver and not eng.be.is_gpu and (cfg.checkpoint.every or cfg.checkpoint.every_minutes or cfg.checkpoint.at_end):
        saver.warm(eng.state_pieces(copy=False)[0])       # the snapshot's memory, mapped while the first steps run
    step = start
    try:
        while True:
            try:
                if step >= cfg.train.steps or stop:        # the run's end, run again after a recovery in it
                    saved = _save_at_end(eng, cfg, history, saved, stop, saver, watchdog, guard)
                    _last_barrier(world, history, start, saver, watchdog, guard)
                    break
                if guard is not None:
                    guard.before_step(step)
                tracer = setup.tracer
                watchdog.heartbeat(step + 1, "train_step")       # the step in progress, 1-based as everywhere
                t = tracer.now()
                with _fp_quiet():
                    m = eng.train_step(step)
                tracer.lap("step", t, "step", step + 1)
                if _eval_due(cfg, step):
                    watchdog.heartbeat(step + 1, "evaluate")
                    if guard is not None:
                        guard.before("eval", step + 1)
                    t = tracer.now()
                    with _fp_quiet():
                        _add_eval(m, eng.evaluate())
                    tracer.lap("eval", t)
                m.update(setup.prog.update(m))
                if guard is not None:
                    guard.note(m)         # the first step after a recovery says so in metrics.jsonl
                history.append(m)
                if step == start:
                    log_memory(eng)
                _record(cfg, m, setup.metrics_f)
                if setup.tbw:
                    setup.tbw.scalars(m["step"], tboard.scalars_of(_lines(m)))
                now = _clock()
                stop, timed, writer = launch.step_boundary(world, _time_due(cfg, now - last_save),
                                                           saver.state() if saver else 0)    # the same on every rank
                if guard is not None:      # after the boundary every rank has run the step: no rank is two ahead
                    guard.commit(eng, step + 1)
                    if step == start:
                        log.info("resilience: buddy copies %.2f MiB of host memory per rank (this rank's state and "
                                 "its partner's, the last 2 steps; %.2f MiB predicted)", guard.copy_bytes() / 2**20,
                                 guard.predicted / 2**20)
                if saver:
                    with watchdog.during("checkpoint", bytes_written):     # its publishing is checkpoint work
                        saver.settle(writer)     # publishes the save in flight once every rank's writer has finished
                if stop and stop != "SIGINT" and step + 1 == cfg.train.steps:
                    stop = None      # it came during the last step: the run is complete, not stopped early
                # an overflowed step may be the start of a divergence: no periodic save of it (Ctrl-C: no save)
                periodic = _ckpt_due(cfg, step) or held or (timed and stop != "SIGINT")
                held = periodic and bool(m.get("skipped")) and not stop
                if (stop and stop != "SIGINT") or (periodic and not held):
                    watchdog.heartbeat(step + 1, "checkpoint", bytes_written)
                    with resilience.saving(guard, step + 1) as hook:     # a failure now: saved again
                        save_checkpoint(eng, cfg, step + 1, saver, hook)
                    saved, last_save = step + 1, _clock()
            except Exception as exc:       # noqa: BLE001 - a dead peer is survived; anything else is raised again
                if guard is None or not guard.handles(exc):
                    raise
                got = guard.recover(eng.mesh.comms.values())
                if got is None:         # shrink: this rank's replica left the mesh
                    raise resilience.LeftMesh() from None
                world, step, cfg = guard.compute, got[0], guard.cfg
                eng = resilience.rebuilt(cfg, guard, got)
                history, saved, stop = resilience.rejoin(eng, cfg, world, setup, step, history, (saved, stop),
                                                         guard.survivor(), _open_metrics)
                saved = _resave(eng, cfg, guard, step, saver) or saved
                continue
            if stop:
                log.info("%s received: stopping cleanly after step %d of %d (%s)", stop, step + 1, cfg.train.steps,
                         "checkpoint saved" if saved == step + 1 else "no checkpoint: interrupted")
                continue
            step += 1
    finally:
        eng.fence_updates(None)
        if saver:        # an error (a diverged step) left a save in flight: its writer ends before the process
            watchdog.heartbeat(watchdog.step, "checkpoint", bytes_written)
            saver.abandon()
        if setup.monitor:
            setup.monitor.stop()
        launch.on_interrupt(None)
        watchdog.stop()
        restore_signals()
        if setup.metrics_f:
            setup.metrics_f.close()
        if setup.tbw:
            setup.tbw.close()
    log_pipeline(eng, cfg)
    summary = summarize(eng, history, time.perf_counter() - setup.t_start, out, stop, launched)
    trace.finish(eng, out, history, summary["wall_s"])   # trace.json, breakdown table + .json
    log.info("%s", next_steps(cfg, out, stop, launched))    # the last line: where the run is, what to try
    return summary


def continue_command(out, launched=None) -> str:
    """The command that continues the run in folder `out`: from its latest checkpoint, or over again when
    it has none (--resume auto), under the launch that started it (launch.launch_record() or
    launched_as(); None: this process's), e.g. `mpiexec -n 4 hpengine train RUN/config.toml --resume auto`."""
    words = launch.launch_words(launch.launched_as() if launched is None else launched)
    return shlex.join([*words, "hpengine", "train"]) + f" {shlex.quote(str(out))}/config.toml --resume auto"


def next_steps(cfg, out, stop=None, launched=None) -> str:
    """The run's last line (rank 0): its folder and the commands to try next on it (a stopped run: the one
    that continues it, under `launched`, see continue_command)."""
    q = shlex.quote(str(out))
    root = checkpoint_root(cfg)
    if stop:         # --resume auto: from the latest checkpoint, or over again in this folder when none
        saved = "" if (root / "latest").exists() else ", no checkpoint yet: it starts over in this folder"
        cont = continue_command(out, launched)
        return f"run folder {q} (stopped early by {stop}{saved}); continue with: {cont}"
    if not (root / "latest").exists():
        return f"run folder {q} (no checkpoint saved); next: hpengine plot {q}"
    ck = q if not cfg.checkpoint.dir else shlex.quote(str(root))
    model = " --model 0" if cfg.train.models > 1 else ""
    data = shlex.quote(cfg.data.val_path) if cfg.data.val_path else "TOKENS.h5"   # hpengine data build ... --out
    return (f"run folder {q}; next: hpengine generate {ck}{model} --prompt 'def ' ; "
            f"hpengine eval {ck} --data {data} ; hpengine plot {q}")


def _save_at_end(eng, cfg, history, saved, stop, saver, watchdog, guard) -> int | None:
    """The final model's checkpoint that checkpoint.at_end asks for (for eval and --resume), unless the last step
    is saved already or Ctrl-C stopped the run; the step saved last."""
    if not (cfg.checkpoint.at_end and history and saved != history[-1]["step"] and stop != "SIGINT"):
        return saved
    last = history[-1]["step"]
    watchdog.heartbeat(last, "checkpoint", bytes_written)
    with resilience.saving(guard, last) as hook:     # a failure now: the recovery saves this step again
        save_checkpoint(eng, cfg, last, saver, hook)
    return last


def _last_barrier(world, history, start, saver, watchdog, guard) -> None:
    """The save in flight published, then nobody exits (ends its process) while a peer still watches it; with
    resilience, the barrier is the whole job's and lets the spares still waiting go home."""
    if saver:
        watchdog.heartbeat(history[-1]["step"] if history else start, "checkpoint", bytes_written)
        saver.wait()
    if guard is not None:
        guard.finish()
    elif world.Get_size() > 1:
        world.Barrier()


def _resave(eng, cfg, guard, step: int, saver) -> int | None:
    """After a recovery: the checkpoint a failure cut short is written again (the new mesh holds the state of its
    step); the step saved, or None. What the cut save left is cleared by the new save's start (write.begin)."""
    if guard.resave != step:
        return None
    save_checkpoint(eng, cfg, step, saver)
    return step


def _fence(saver, watchdog):
    """The engine's hook before an update: wait for the save's snapshot, as a checkpoint phase."""
    def fence():
        if not saver.copied.is_set():
            with watchdog.during("checkpoint", bytes_written):
                saver.fence()
    return fence


def _open_metrics(out, resume):
    """metrics.jsonl, appended to: on --resume the file trimmed to the resumed step, else a new empty one."""
    path = Path(out) / "metrics.jsonl"
    try:
        if not resume:
            write_file(path, "")
        return open_append(path, "metrics.jsonl")
    except OSError as exc:
        raise RunError(f"cannot write '{path}': {exc.strerror or exc}; check the run folder's permissions and "
                       "free space") from None


def _eval_due(cfg, step) -> bool:
    ev = cfg.train.eval_every
    return bool(ev) and ((step + 1) % ev == 0 or step + 1 == cfg.train.steps)


_clock = time.monotonic       # wall time for checkpoint.every_minutes (a test may replace it)


def _time_due(cfg, since_s: float) -> bool:
    """Whether this rank's clock says a checkpoint.every_minutes save is due."""
    every = cfg.checkpoint.every_minutes
    return bool(every) and since_s >= every * 60.0


def _ckpt_due(cfg, step) -> bool:
    ev = cfg.checkpoint.every
    return bool(ev) and ((step + 1) % ev == 0 or step + 1 == cfg.train.steps)


def _add_eval(m, vals) -> None:
    m["val_loss"] = vals[0]
    for pm, v in zip(m.get("models", []), vals):
        pm["val_loss"] = v


def _record(cfg, m, metrics_f) -> None:
    if metrics_f is None:
        return
    for line in _lines(m):
        metrics_f.write(json.dumps(line) + "\n")
    metrics_f.flush()
    step = m["step"]       # optimizer steps completed, 1-based
    if step % cfg.train.log_every == 0 or step == 1 or "val_loss" in m:
        for line in _lines(m):
            log.info("%s", _fmt(line, cfg.train.steps))
    elif progress.redraws(sys.stdout):
        print(f"\r  step {step}/{cfg.train.steps} loss {m['loss']:.4f}", end="", flush=True)


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")


def save_state(eng, root, step: int, keep: int, saver=None, after_write=None) -> Path | None:
    """Collective: this job's checkpoint of `step` under root (checkpoint/write.py writes it); with an
    asynchronous `saver` (checkpoint/background.py) only started, and None returned. after_write: called once
    this rank's shard is written (the resilience tests' fault injection)."""
    pieces, meta = eng.state_pieces(copy=saver is None)     # the writer reads the live buffers before the update
    meta = {"config": to_toml(eng.cfg), **meta, "data": data_meta(eng.data)}
    if saver is not None:
        saver.start(root, step, keep, pieces, meta, live=not eng.be.is_gpu)
        return None
    return ckpt_write.save(eng.world, root, step, keep, pieces, meta, eng.tracer, after_write=after_write)


def save_checkpoint(eng, cfg, step: int, saver=None, after_write=None) -> None:
    t0 = time.perf_counter()
    path = save_state(eng, checkpoint_root(cfg), step, cfg.checkpoint.keep, saver, after_write)
    if path is not None:
        log.info("checkpoint step %d -> %s (%.2f s)", step, path, time.perf_counter() - t0)


def restore(eng, cfg, resume) -> int:
    """Load a checkpoint (--resume) or exported parameters (checkpoint.init_from); the first step to run."""
    if resume is None and not cfg.checkpoint.init_from:
        return 0
    t0 = time.perf_counter()
    if resume is not None:
        path = checkpoint_root(cfg) if resume == "latest" else resume

        def open_checkpoint():
            try:
                reader = checkpoint.Reader(path)         # checks the manifest's checksum and structure
                reader.check_shapes(eng.true_shapes(), to_toml(eng.cfg))
                check_same_tokenizer(reader.manifest.get("data"), eng.data)     # same inputs on every rank
                islands = int(reader.manifest.get("layout", {}).get("replica", 1))
                if islands > 1 and eng.outer is None:    # its optimizer state is the islands', one per island
                    raise checkpoint.CheckpointError(
                        f"it was written by {islands} DiLoCo islands: resume it with strategy.diloco.enable = true, "
                        "or start a run from its outer parameters (hpengine ckpt export, then checkpoint.init_from)")
            except checkpoint.CheckpointError as exc:
                raise checkpoint.CheckpointError(f"--resume {resume}: {exc}") from None
            return reader
        reader = agree_or_raise(eng.world, open_checkpoint, checkpoint.CheckpointError, (checkpoint.CheckpointError,))
        load_together(eng, reader)
        start, what = reader.step, f"resumed from {reader.dir} at step {reader.step}"
    else:
        src = cfg.checkpoint.init_from

        def open_export():
            if src.startswith(hf_import.PREFIX):
                return hf_import.HFReader(src[len(hf_import.PREFIX):], cfg.model, eng.true_shapes())
            reader = checkpoint.ExportReader(src)
            reader.check_shapes(eng.true_shapes())      # never crop or pad a tensor of another shape
            return reader
        reader = agree_or_raise(eng.world, open_export, checkpoint.CheckpointError, (checkpoint.CheckpointError,))
        load_together(eng, reader, params_only=True)
        start, what = 0, f"parameters initialised from {cfg.checkpoint.init_from}"
    reader.close()
    log.info("%s (%.2f s)", what, time.perf_counter() - t0)
    return start


def summarize(eng, history, wall, out, stopped=None, launched=None) -> dict:
    """The run's summary (summary.json, written by rank 0): losses, speed, memory, how it was launched
    (`launched`, as launch.json has it) and, when it stopped early, the command that continues it."""
    toks = [m["tokens_per_s"] for m in history[1:]] or [history[0]["tokens_per_s"]]
    vals = [m["val_loss"] for m in history if "val_loss" in m]
    summary = {"steps": len(history), "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
               "final_val_loss": vals[-1] if vals else None, "wall_s": wall,
               "median_tokens_per_s": sorted(toks)[len(toks) // 2], **eng.memory(), "out_dir": str(out),
               "tokenizer_sha256": eng.data.tokenizer_sha256, "optimizer": eng.cfg.optim.name,
               "stopped_early": stopped, "launch": launched,
               "continue": continue_command(out, launched) if stopped else None}
    log.info("done: %d steps in %.1f s | loss %.4f -> %.4f | val %s | median %s tok/s | peak RSS %.0f MiB",
             summary["steps"], wall, summary["first_loss"], summary["final_loss"],
             f"{summary['final_val_loss']:.4f}" if vals else "-",
             f"{summary['median_tokens_per_s']:,.0f}", summary["peak_rss_bytes"] / 2**20)
    if eng.mesh.rank == 0:
        write_file(Path(out) / "summary.json", json.dumps(summary, indent=1))
    return summary
