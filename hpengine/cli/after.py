"""The command line's after-training commands: `hpengine generate` and `hpengine eval` (parsers and
commands; commands.py wires them in)."""
from __future__ import annotations

import sys

from mpi4py import MPI

from hpengine.apps.evaluate import check_json_out, evaluate, line, write_json
from hpengine.apps.generate import generate, stats_line
from hpengine.checkpoint.shards import CheckpointError
from hpengine.config.load import ConfigError
from hpengine.data import DataError
from hpengine.dist.agree import agree_or_raise
from hpengine.files.safe import UnsafeFile
from hpengine.run.faults import say


def generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a checkpoint's model (one process, kv cache)",
                       description="Prints the generated continuation (not the prompt) as it is produced, and "
                       "a stats line on stderr. Stops at the eos token, after --max-new-tokens, or at "
                       "model.seq_len tokens of context.")
    g.add_argument("checkpoint", help="a run folder (its checkpoints/latest), a checkpoints folder or a step folder")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="the text to continue (default: empty, start from eos)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    g.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    g.add_argument("--temperature", type=float, default=1.0, help="divides the logits: a finite number > 0; the "
                   "smaller, the closer to --greedy (default 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only")
    g.add_argument("--top-p", type=float, default=None, help="nucleus: the smallest set of most likely tokens "
                   "whose probability sums to >= P, 0 < P <= 1")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, an integer >= 0 (default 0)")
    g.add_argument("--greedy", action="store_true", help="always the most likely token")
    g.add_argument("--no-cache", action="store_true", help="re-run the whole context for every token "
                   "(no key/value cache; for checks and benchmarks)")
    g.add_argument("--device", default="auto", help="auto (the GPU when CuPy finds one, default), cpu or gpu")
    g.add_argument("--model", type=int, default=None, metavar="I",
                   help="which model of a train.models > 1 checkpoint to sample (0-based)")


def cmd_generate(a) -> int:
    prompt = a.prompt or ""
    if a.prompt_file is not None:   # opened as named: a pipe (<(cmd)) is a fine prompt source
        try:
            with open(a.prompt_file, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise DataError(f"--prompt-file '{a.prompt_file}': {exc.strerror or exc}") from None
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"--prompt-file '{a.prompt_file}' is not UTF-8 text (byte 0x{data[exc.start]:02x} "
                            f"at offset {exc.start}: {exc.reason}); give a UTF-8 file") from None
    r = generate(a.checkpoint, prompt, a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed, a.greedy,
                 cache=not a.no_cache, device=a.device, model_index=a.model)
    say(stats_line(r), sys.stderr)
    return 0


def eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="exact mean loss, perplexity and bits per byte of a checkpoint on a token file",
                        description="A deterministic pass over every token of FILE (windows of seq_len, each "
                        "token predicted once). The model comes from the checkpoint's saved config; the layout "
                        "from --config/--set (default: one process, or data parallel over every rank).")
    ev.add_argument("checkpoint", help="a run folder (its checkpoints/latest), a checkpoints folder or a step folder")
    ev.add_argument("--data", required=True, help="HDF5 token file to evaluate on")
    ev.add_argument("--config", default=None, help="TOML whose [strategy], [runtime] and [mesh] tables set the layout")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the checkpoint's config, e.g. --set strategy.sharding.enable=true")
    ev.add_argument("--json", default=None, metavar="OUT", help="also write the figures as JSON to this "
                    "file (an existing one is refused unless --force; never inside a checkpoint folder); - writes "
                    "them to standard output (the summary line then goes to standard error)")
    ev.add_argument("--force", action="store_true", help="replace an existing --json file")
    ev.add_argument("--batch", type=int, default=8, help="windows per pass and replica (default 8)")


def cmd_eval(a) -> int:
    world = MPI.COMM_WORLD
    lead = world.Get_rank() == 0
    out = a.json if a.json not in (None, "-") else None
    bad = (ConfigError, CheckpointError, UnsafeFile)
    if out is not None:             # before the evaluation: a file it may not write fails in seconds, not after
        agree_or_raise(world, lambda: check_json_out(out, a.checkpoint, a.data, a.force) if lead else None,
                       ConfigError, bad)
    r = evaluate(a.checkpoint, a.data, a.config, a.overrides, a.batch)
    if lead:
        if a.json == "-":           # stdout holds the JSON alone, so a pipe can parse it
            say(line(r, a.checkpoint), sys.stderr)
            write_json(r, sys.stdout)
        else:
            print(line(r, a.checkpoint), flush=True)
    if out is not None:             # every rank learns whether the file was written, so all end alike
        agree_or_raise(world, lambda: write_json(r, out, overwrite=a.force) if lead else None, ConfigError, bad)
    return 0
