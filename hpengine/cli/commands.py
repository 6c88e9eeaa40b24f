"""Command line: `hpengine train | data | plan | ckpt | eval | generate | plot`: the parsers, each
command's handler, and `main`, which turns known problems into one line and exit status 2 and aborts
the whole MPI job on anything unexpected.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from mpi4py import MPI

from hpengine import __version__
from hpengine.apps.plot import PlotError, plot_run
from hpengine.apps.plot_compare import plot_compare
from hpengine.checkpoint import shards as checkpoint
from hpengine.checkpoint.export import export
from hpengine.checkpoint.shards import CheckpointError
from hpengine.cli.after import cmd_eval, cmd_generate, eval_parser, generate_parser
from hpengine.cli.plan_progress import PlanProgress
from hpengine.cli.doctor import cmd_doctor, doctor_parser
from hpengine.config.load import ConfigError, load_config, to_toml
from hpengine.config.reference import describe
from hpengine.data import DataError, build_corpus
from hpengine.data.build import summary_line
from hpengine.data.builtin import DEFAULT_MAX_BYTES, stdlib_files, stdlib_source
from hpengine.data.documents import length_summary, offsets_of
from hpengine.data.format import TokenFile, sha256_text
from hpengine.data.tokenizer import kind_of
from hpengine.device.backend import BackendError
from hpengine.dist.agree import say_once
from hpengine.dist.topology import TopologyError
from hpengine.dist.ulfm import JobEnds
from hpengine.dist.watchdog import where
from hpengine.engine.engine import NonFiniteError
from hpengine.files.safe import UnsafeFile
from hpengine.layout import resolve
from hpengine.layout.resolve import PipelineError
from hpengine.optim.base import KINDS as OPTIMIZERS
from hpengine.planner import search as plan
from hpengine.run import startguard
from hpengine.run.faults import EXIT_INTERRUPTED, EXIT_STOPPED, say
from hpengine.run.launch import LaunchError
from hpengine.run.run_dir import RunError
from hpengine.run.train import train


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpengine", description="MPI training engine with switchable "
                                "hybrid parallelism. Launch on N ranks with: mpiexec -n N hpengine train CFG")
    p.add_argument("--version", action="version", version=f"hpengine {__version__}")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    t = sub.add_parser("train", help="train a model from a TOML config")
    t.add_argument("config", nargs="?", default=None, help="TOML config (default: built-in defaults)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=1e-3 (repeatable)")
    t.add_argument("--resume", default=None, metavar="DIR|latest|auto",
                   help="continue from a checkpoint: a checkpoint folder; 'latest' (the newest under the run "
                   "folder's checkpoints/); or 'auto' (that one when it exists, else a fresh start; refused "
                   "when train.out_dir is empty, holds results without a checkpoint, or is already complete). "
                   "Batch jobs pass auto so a requeued job continues by itself")
    _data_parser(sub)
    c = sub.add_parser("config", help="print the config reference, a resolved config, or (--world N) check it "
                       "fully for N ranks without MPI and print the layout")
    c.add_argument("config", nargs="?", default=None)
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--reference", action="store_true", help="print the markdown reference of every key")
    c.add_argument("--world", type=int, help="validate for this many ranks and print the resolved layout")
    k = sub.add_parser("ckpt", help="inspect, verify and export checkpoints")
    ksub = k.add_subparsers(dest="ckpt_cmd", required=True)
    ksub.add_parser("info", help="step, layout, tensors, sizes").add_argument("dir")
    ksub.add_parser("verify", help="read every piece and check its checksum").add_argument("dir")
    e = ksub.add_parser("export", help="global tensors as one HDF5 or safetensors file, or a Hugging Face "
                        "transformers model folder (gpt, llama)")
    e.add_argument("dir", help="a checkpoint step folder, or a checkpoints root (its latest)")
    e.add_argument("out", help="the file (hdf5, safetensors) or folder (hf) to write")
    e.add_argument("--format", default="hdf5", choices=("hdf5", "safetensors", "hf"),
                   help="hdf5: parameters and Adam moments, for checkpoint.init_from (default); safetensors: "
                   "parameters under hpengine's names; hf: config.json, model.safetensors, generation_config.json "
                   "and the run's tokenizer files, loadable by AutoModelForCausalLM.from_pretrained")
    e.add_argument("--params-only", action="store_true", help="hdf5: leave out the optimizer state")
    e.add_argument("--force", action="store_true", help="replace an existing OUT")
    e.add_argument("--model", type=int, default=None, metavar="I",
                   help="hf: which model of a train.models > 1 checkpoint to export (0-based)")
    _plan_parser(sub)
    _plot_parser(sub)
    eval_parser(sub)
    generate_parser(sub)
    doctor_parser(sub)
    return p


def _data_parser(sub) -> None:
    d = sub.add_parser("data", help="build and inspect HDF5 token files")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    b = dsub.add_parser("build", help="tokenize text files, folders or JSON Lines into one HDF5 token file",
                        description="Every UTF-8 file below the given folders is a document (binary and "
                        "undecodable files are skipped and counted); .gz/.bz2/.xz are decompressed; .jsonl "
                        "holds one document per record. Each document ends with the tokenizer's eos.")
    b.add_argument("paths", nargs="*", help="files, folders, or - for standard input (none: the built-in "
                   "stdlib corpus)")
    b.add_argument("--out", required=True, help="output .h5 file")
    b.add_argument("--force", action="store_true", help="replace an existing OUT (and an existing trained "
                   "tokenizer file)")
    b.add_argument("--tokenizer", default="bytes", help="bytes (default: UTF-8 bytes, vocab 256, eos 0) or "
                   "the path of a Hugging Face tokenizer.json")
    b.add_argument("--eos-token", help="the token ending each document (default: the first the tokenizer has "
                   "of <|endoftext|>, </s>, <|end_of_text|>, <eos>, [SEP])")
    b.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE of --vocab-size ids "
                   "on the inputs, save it next to --out and tokenize with it")
    b.add_argument("--vocab-size", type=int, help="ids of the trained tokenizer (with --train-tokenizer)")
    b.add_argument("--tokenizer-sample", metavar="X", help="train on a fraction (0 < X <= 1) or a number of "
                   "documents only (default: all)")
    b.add_argument("--tokenizer-out", metavar="PATH", help="where to save the trained tokenizer.json "
                   "(default: OUT with the suffix .tokenizer.json)")
    b.add_argument("--text-field", default="text", help="the document field of JSON Lines records "
                   "(default: text)")
    b.add_argument("--jsonl", action="store_true", help="standard input is JSON Lines, not one document")
    b.add_argument("--include", action="append", default=[], metavar="GLOB", help="read only the files in "
                   "folders whose relative path or name matches (repeatable)")
    b.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip the files in folders "
                   "whose relative path or name matches (repeatable)")
    b.add_argument("--workers", type=int, default=1, help="tokenizer processes, each single-threaded (default "
                   "1: this process, with the tokenizer's own threads); the output is the same for any number")
    b.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a "
                   "terminal")
    dsub.add_parser("info", help="what a token file holds: counts, vocab, eos, tokenizer").add_argument("file")


def _plot_parser(sub) -> None:
    pl = sub.add_parser("plot", help="PNGs of a run folder: loss, throughput, pipeline Gantt; of several: their "
                        "losses compared (needs matplotlib)")
    pl.add_argument("run_dir", nargs="+", help="a run folder (train.out_dir; the Gantt chart needs runtime.trace = "
                    "true), or several to compare (compare.png in --out)")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots; needed for several)")


def _cmd_plot(a) -> int:
    try:
        if len(a.run_dir) > 1:
            written, notes = [plot_compare(a.run_dir, a.out)], []
        else:
            written, notes = plot_run(a.run_dir[0], a.out)
    except PlotError as exc:
        _say(f"hpengine: error: {exc}")
        return 2
    for n in notes:
        _say(f"hpengine: note: {n}")
    for path in written:
        print(f"wrote {path}")
    return 0


def _plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="choose the switches for a model on a cluster (memory and time model)",
                        description="Rank every legal layout of a model on a cluster by predicted step time "
                        "among those that fit; or --check one config; or --calibrate this machine.")
    pl.add_argument("config", nargs="?", default=None, help="TOML config whose [model] and [train] are planned")
    pl.add_argument("--model", help="size preset instead of [model]: gpt2-124m, 1.3b, 7b, 13b, 175b, llama3-8b, "
                    "llama3-70b, llama3.2-1b, mixtral-8x7b, deepseek-v3, kimi-k2")
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--global-batch", type=int, help="sequences per step (default: the config's or preset's)")
    pl.add_argument("--seq", type=int, help="tokens per sequence for the plan (sets model.seq_len; long sequences "
                    "bring context parallel layouts into the search)")
    pl.add_argument("--check", metavar="CFG", help="predict memory and step time of this config instead")
    pl.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="the optimizer to plan for (sets optim.name; "
                    "default: the config's): its state bytes, and Muon's Newton-Schulz GEMMs in the step time")
    pl.add_argument("--world", type=int, help="ranks for --check (default: nodes x gpus-per-node)")
    pl.add_argument("--mean-doc-len", type=float, metavar="N", help="packed documents of mean length N tokens "
                    "(geometric lengths): attention FLOPs counted for the work the document mask leaves (default: "
                    "--check of a config with data.document_mask measures its token files' documents)")
    pl.add_argument("--out", help="write the best layout as a config TOML")
    pl.add_argument("--force", action="store_true", help="replace an existing --out file")
    pl.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    pl.add_argument("--wide", action="store_true", help="every memory and time part in the table (default: at most "
                    "120 columns, memory and communication totalled)")
    pl.add_argument("--max-micro-batch", type=int, default=8, help="largest micro-batch in sequences (default 8)")
    pl.add_argument("--calibrate", action="store_true", help="measure this machine; print a [cluster] table")
    pl.add_argument("--cluster", help="TOML file with a [cluster] table (keys as the flags below)")
    for flag, tp, what in (("nodes", int, "nodes"), ("gpus-per-node", int, "devices per node"),
                           ("mem-gb", float, "memory per device, GB"),
                           ("intra-bw-gbs", float, "per-device bandwidth inside a node, GB/s"),
                           ("inter-bw-gbs", float, "per-device bandwidth between nodes, GB/s"),
                           ("intra-latency-us", float, "latency inside a node, microseconds"),
                           ("inter-latency-us", float, "latency between nodes, microseconds"),
                           ("tflops", float, "sustained 16-bit TFLOP/s per device (amp)"),
                           ("tflops-fp32", float, "sustained float32 TFLOP/s"), ("tflops-fp64", float, "float64"),
                           ("reserve-gb", float, "memory kept free per device, GB (default: min(4, 5 %% of "
                            "--mem-gb))"),
                           ("moe-imbalance", float, "MoE: the most-loaded expert's tokens over the mean (a run's "
                            "moe_load_max); expert parallel waits for it (default 1: balanced)")):
        pl.add_argument(f"--{flag}", type=tp, help=what)
    pl.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                    help="--calibrate: measure the CPU (NumPy) or the GPU (CuPy); auto: the GPU when CuPy sees one")
    pl.error = _plan_usage_error


def _plan_usage_error(message: str):
    """A bad `hpengine plan` argument: one stderr line (argparse's usage block left out), exit status 2."""
    _say_job("hpengine plan: ", f"error: {message} (hpengine plan --help lists the arguments)")
    raise SystemExit(2)


def _cmd_plan(a) -> int:
    progress = PlanProgress()
    try:
        text = plan.run(a, progress)
    finally:
        progress.close()
    if not a.calibrate and not a.check and (progress.searched or progress.pruned):
        sys.stderr.write(progress.summary() + "\n")     # the bar (a terminal) or nothing before it
    try:
        if text:
            print(text, flush=True)
    except BrokenPipeError:        # `hpengine plan | head`: the reader took what it wanted
        sys.stdout = open(__import__("os").devnull, "w")
    return 0


def _cmd_train(a) -> int:
    stopped = train(load_config(a.config, a.overrides), resume=a.resume).get("stopped_early")
    return 0 if not stopped else EXIT_INTERRUPTED if stopped == "SIGINT" else EXIT_STOPPED


def _cmd_ckpt(a) -> int:
    if a.ckpt_cmd == "info":
        i = checkpoint.info(a.dir)
        reader = checkpoint.Reader(a.dir)
        problems = reader.verify()
        print(f"{i['dir']}: step {i['step']}, written by {i['world']} ranks with degrees {i['layout']}\n"
              f"  {i['tensors']} tensors, {i['elements']:,} elements, {i['files']} shard files, "
              f"{i['bytes'] / 2**20:.2f} MiB\n  state {i['state']}\n"
              f"  checksums: {'ok' if not problems else f'{len(problems)} problem(s)'}; manifest {reader.sealed()}")
        return 0 if not problems else 1
    if a.ckpt_cmd == "verify":
        reader = checkpoint.Reader(a.dir)
        problems = reader.verify()
        for p in problems:
            _say(f"hpengine: error: {p}")
        print(f"{a.dir}: {'ok' if not problems else 'CORRUPTED'}")
        if not problems:          # what the checksums cannot catch, said beside the verdict
            print(f"  checksums catch corruption and truncation; manifest {reader.sealed()}")
        return 0 if not problems else 1
    info = export(a.dir, a.out, a.format, params_only=a.params_only, force=a.force, model=a.model)
    print(f"wrote {info['path']}: {info['tensors']} tensors at step {info['step']}"
          + ("" if a.format == "hdf5" else f" ({a.format})"))
    return 0


def _n(count: int, what: str) -> str:
    return f"{count:,} {what}" + ("" if count == 1 else "s")


def _data_info(path) -> str:
    """What `hpengine data info` prints about a token file."""
    with TokenFile(path) as f:
        at = f.attrs
        lines = [f"{f.path}: " + (f"{at['format']} version {f.version}" if f.version >= 2 else
                                  "version 1 (one document, no tokenizer recorded)"),
                 f"  {_n(f.n_tokens, 'token')} ({f.dtype}) in {_n(f.n_docs, 'document')}",
                 f"  document lengths: {length_summary(offsets_of(f))}",
                 f"  vocab {'unknown' if f.vocab_size is None else f.vocab_size}, "
                 f"eos {f.eos_id if f.eos_id >= 0 else 'none'}, tokenizer {kind_of(f.tokenizer)}"]
        if f.tokenizer is not None:
            ok = sha256_text(f.tokenizer) == f.tokenizer_sha256
            lines[-1] += f", sha256 {f.tokenizer_sha256}" + ("" if ok else " (DOES NOT MATCH the tokenizer text)")
        lines.append(f"  source: {at.get('source', 'unknown')}")
        if "n_files" in at:
            skipped = [f"{at[k]:,} {k.removeprefix('skipped_')}" for k in sorted(at) if k.startswith("skipped_")]
            lines.append(f"  built from {_n(at['n_files'], 'file')}; skipped {', '.join(skipped) or 'nothing'}")
    return "\n".join(lines)


def _cmd_data(a) -> int:
    if a.data_cmd == "info":
        print(_data_info(a.file))
        return 0
    source = None
    if not a.paths:
        a.paths, source = stdlib_files(DEFAULT_MAX_BYTES), stdlib_source()
    info = build_corpus(a.paths, a.out, a.vocab_size, source=source, tokenizer=a.tokenizer,
                        train_tokenizer=a.train_tokenizer, tokenizer_sample=a.tokenizer_sample,
                        tokenizer_out=a.tokenizer_out, eos_token=a.eos_token, text_field=a.text_field,
                        jsonl=a.jsonl, include=a.include, exclude=a.exclude, workers=a.workers,
                        progress=a.progress or sys.stderr.isatty(), overwrite=a.force)
    print(summary_line(info))
    return 0


def _cmd_config(a) -> int:
    if a.reference:
        print(describe(), end="")
        return 0
    cfg = load_config(a.config, a.overrides)
    if a.world is None:
        print(to_toml(cfg), end="")
        return 0
    if a.world < 1:
        raise ConfigError(f"--world {a.world}: must be >= 1 (the number of ranks, as in mpiexec -n)")
    print(resolve.describe(cfg, resolve.resolve(cfg, a.world)))
    return 0


def _known():
    """Exception types that mean 'the user asked for something wrong' (one line, exit 2); UnsafeFile: an
    output that exists, a link or a FIFO where a file is read or written."""
    return (CheckpointError, ConfigError, DataError, TopologyError, RunError, BackendError, PipelineError,
            NonFiniteError, LaunchError, UnsafeFile)


def main(argv=None) -> int:
    """Run one command; its exit status. A reader that closes stdout early (`hpengine ckpt info DIR | head
    -3`) ends the command quietly, as SIGPIPE ends a standard tool."""
    if startguard.under_launcher():     # a Ctrl-C during start-up waits for MPI, then aborts every rank
        startguard.arm()
    try:
        startguard.caught()
        rc = _main(argv)
        sys.stdout.flush()          # the last buffered lines go out here, not in the exit's flush
        return rc
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:       # before a command runs (the parser): end every rank, not this one alone
        return _interrupted()


def _closed_pipe() -> int:
    try:           # what is left in the buffer goes nowhere, so the interpreter's exit flush is silent too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141                      # 128 + SIGPIPE, the status a shell reports for `cat BIG | head -1`


# Known problems (bad config, data, mesh) end every rank with exit status 2 and one clear line for the job
# (printed once when every rank has the same, else once per rank with the rank named); they are detected
# identically on every rank before any collective. Anything unexpected on any rank prints that
# rank's traceback and aborts the whole MPI job, so nothing hangs.
def _main(argv) -> int:
    p = _parser()
    if list(sys.argv[1:] if argv is None else argv)[:1] == ["plan"]:    # unknown plan flags: one line too
        p.error = _plan_usage_error
    a = p.parse_args(argv)
    if a.cmd is None:               # bare `hpengine`: the commands, not argparse's "required: cmd"
        sys.stderr.write(p.format_help() + "\nhpengine: error: name a command; hpengine COMMAND --help "
                         "describes one\n")
        return 2
    try:
        if a.cmd == "train":
            return _cmd_train(a)
        if a.cmd == "data":
            return _cmd_data(a)
        if a.cmd == "config":
            return _cmd_config(a)
        if a.cmd == "ckpt":
            return _cmd_ckpt(a)
        if a.cmd == "plan":
            return _cmd_plan(a)
        if a.cmd == "eval":
            return cmd_eval(a)
        if a.cmd == "generate":
            return cmd_generate(a)
        if a.cmd == "doctor":
            return cmd_doctor(a)
        return _cmd_plot(a)
    except KeyboardInterrupt:       # first: _known() imports modules an interrupt may have cut short
        return _interrupted()
    except _known() as exc:
        _say_job("hpengine: ", f"error: {exc}")
        return 2
    except JobEnds as exc:          # the survivors of a failure leave together, the line already said
        return exc.code
    except BrokenPipeError:
        raise                       # main ends quietly
    except Exception:  # noqa: BLE001 - anything else must take the whole job down, not hang it
        return _abort()


def _say(line: str) -> None:
    """One stderr line in one write call, so the lines of several ranks never glue together."""
    say(line, sys.stderr)


def _say_job(prefix: str, message: str) -> None:
    """An error line for the whole job: printed once (by rank 0) when every rank has the same one, else
    by each rank with its rank named."""
    say_once(MPI.COMM_WORLD, prefix, message, _say)


def _interrupted() -> int:
    """Ctrl-C outside the training loop's agreed stop: a peer may wait in a collective, so end the job."""
    w = MPI.COMM_WORLD
    if w.Get_size() > 1:
        _say(f"hpengine: rank {w.Get_rank()} of {w.Get_size()}: interrupted; aborting the job")
        w.Abort(130)
    return 130


def _abort() -> int:
    w = MPI.COMM_WORLD
    who = f"rank {w.Get_rank()} of {w.Get_size()}" + (f" {where()}" if where() else "")
    sys.stderr.write(f"hpengine: {who} failed:\n{traceback.format_exc()}")
    sys.stderr.flush()
    if w.Get_size() > 1:
        # the launcher forwards this line through its proxies; Abort tears the job down at once, and on a
        # loaded node Hydra was seen to drop a dying rank's last output: give the forwarding a moment
        time.sleep(0.3)
        w.Abort(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
