"""The data pipeline: `hpengine data build` against tokenizers' own batch encoder on the same files with
the same worker count, the build's peak memory at two corpus sizes, and the data memory of a training
rank on the larger corpus.

The corpora are generated text (the 20,000 commonest words of the Python standard library's sources,
Zipf-distributed, in ~4 MB files, 10 a folder), written once under --work and reused. Speed: a byte-level
BPE tokenizer (vocab --vocab), trained with tokenizers itself on the first files, encodes the
--speed-gb corpus on both sides, --repeats interleaved runs each. Memory: `hpengine data build` of the
two --sizes-gb corpora (tokenizer --memory-tokenizer: "bytes", or "bpe" for the trained one, which
tokenizes at a few MB/s per core on this VM), and one training rank's data memory on the larger.

    .venv/bin/python benchmarks/bench_data.py --speed-gb 0.2 --sizes-gb 1.25 5 --workers 2 --repeats 3

Peak memory is the largest sum of VmRSS over the build's process tree, sampled every 50 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FILE_MB = 4


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed-gb", type=float, default=0.2, help="corpus size of the speed comparison (GB)")
    p.add_argument("--sizes-gb", type=float, nargs=2, default=[1.25, 5.0], help="the two corpus sizes (GB)")
    p.add_argument("--memory-tokenizer", choices=("bytes", "bpe"), default="bytes")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side on the smaller corpus")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--work", default=str(ROOT / "runs" / "bench-data"), help="where corpora and outputs go")
    p.add_argument("--json", default=None)
    p.add_argument("--speed-only", action="store_true", help="the speed comparison alone")
    p.add_argument("--baseline", nargs=4, metavar=("CORPUS", "TOKENIZER", "WORKERS", "PIECES"), help=argparse.SUPPRESS)
    p.add_argument("--rank-memory", nargs=2, metavar=("FILE", "VOCAB"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- corpus ------------------------------------------------------------------------------------------

def words(n=20000):
    """The n commonest words of the standard library's top-level sources, commonest first."""
    import collections
    import re
    import sysconfig
    count = collections.Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        count.update(re.findall(r"[A-Za-z]+", path.read_text(errors="ignore")))
    return [w for w, _ in count.most_common(n)]


def generate(folder: Path, gb: float) -> Path:
    """~gb GB of text in FILE_MB files (10 files a folder), deterministic; kept for the next run."""
    import numpy as np
    done = folder.with_name(folder.name + ".complete")     # beside it: a file inside would be a document
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vocab = np.array(words(), dtype=object)
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    n_files = max(1, int(gb * 1000 / FILE_MB))
    for i in range(n_files):
        rng = np.random.default_rng(i)
        path = folder / f"d{i // 10:04d}" / f"f{i:06d}.txt"
        path.parent.mkdir(exist_ok=True)
        out, size = [], 0
        while size < FILE_MB * 10**6:
            w = vocab[rng.choice(len(vocab), size=12000, p=zipf)]
            text = " ".join(w).replace(" the ", ". The ") + ".\n"
            out.append(text)
            size += len(text)
        path.write_text("".join(out))
    done.write_text(str(gb))
    return folder


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> Path:
    if out.exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files = sorted(str(p) for p in corpus.rglob("*.txt"))[:4]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(out))
    return out


# ---- measuring a process tree ------------------------------------------------------------------------

def _tree_rss(pid: int) -> int:
    """Sum of VmRSS (bytes) of pid and its descendants."""
    children, total = {}, 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def measure(cmd: list[str], env=None) -> dict:
    """Wall seconds and the peak RSS of the whole process tree of one command (which must exit 0)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0]

    def poll():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.05)
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    th.join()
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out}{err}")
    return {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak[0], "stdout": out.strip()[-400:]}


# ---- the two sides -----------------------------------------------------------------------------------

def hpengine_build(corpus: Path, tok, out: Path, workers: int) -> dict:
    out.unlink(missing_ok=True)
    r = measure([str(Path(sys.executable).parent / "hpengine"), "data", "build", str(corpus), "--tokenizer",
                 str(tok), "--workers", str(workers), "--out", str(out)])
    from hpengine.data import TokenFile
    with TokenFile(out) as f:
        r["tokens"] = f.n_tokens
    return r


def _pieces(text: str, size: int = 2**16) -> list[str]:
    """text cut after line breaks into pieces of about `size` characters (the last line of a piece
    keeps its newline, as hpengine's builder cuts)."""
    out, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + size)
        stop = len(text) if cut < 0 else cut + 1
        out.append(text[start:stop])
        start = stop
    return out


def baseline(corpus: str, tok: str, workers: str, pieces: str) -> None:
    """tokenizers alone: every file read in order and encoded with encode_batch (whole, or cut into
    ~64 KiB pieces at line breaks when pieces == "1"), tokens counted (+1 per file for its end of
    document) and dropped; its own thread pool sized by RAYON_NUM_THREADS = workers (set by the caller)."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(tok)
    files = sorted(Path(corpus).rglob("*.txt"))
    n, batch = 0, []
    for i, path in enumerate(files):
        text = path.read_text()
        n += 1
        batch += _pieces(text) if pieces == "1" else [text]
        if len(batch) >= 8 or i == len(files) - 1:
            n += sum(len(e.ids) for e in t.encode_batch(batch, add_special_tokens=False))
            batch = []
    print(json.dumps({"tokens": n}))


def baseline_run(corpus: Path, tok: Path, workers: int, pieces: bool) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(workers), TOKENIZERS_PARALLELISM="true")
    r = measure([sys.executable, __file__, "--baseline", str(corpus), str(tok), str(workers), str(int(pieces))],
                env=env)
    r["tokens"] = json.loads(r["stdout"].splitlines()[-1])["tokens"]
    return r


def rank_memory(path: str, vocab: str) -> None:
    """One training rank's data memory: RSS before and after opening the corpus and drawing 200 batches of
    its 8 rows of 1024 tokens from a global batch of 512."""
    from hpengine.data import TokenDataset

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    before = rss()
    ds = TokenDataset(path, seq_len=1024, vocab_size=int(vocab), val_fraction=0.01)
    for step in range(200):
        ds.batch("train", step, 1234, 512, start=8 * (step % 64), count=8)
    print(json.dumps({"rss_before": before, "rss_after": rss(), "hwm_after": _hwm()}))


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(argv=None) -> int:
    a = parse(argv)
    if a.baseline:
        baseline(*a.baseline)
        return 0
    if a.rank_memory:
        rank_memory(*a.rank_memory)
        return 0
    work = Path(a.work)
    speed, small, big = (generate(work / f"corpus-{gb:g}gb", gb) for gb in (a.speed_gb, *a.sizes_gb))
    tok = train_tokenizer(speed, work / f"tokenizer-{a.vocab}.json", a.vocab)
    runs = {"hpengine": [], "tokenizers": [], "tokenizers-pieces": []}
    for i in range(a.repeats):
        runs["hpengine"].append(hpengine_build(speed, tok, work / "speed.h5", a.workers))
        runs["tokenizers"].append(baseline_run(speed, tok, a.workers, pieces=False))
        runs["tokenizers-pieces"].append(baseline_run(speed, tok, a.workers, pieces=True))
        for k in runs:
            r = runs[k][-1]
            print(f"run {i + 1}/{a.repeats} {k:<10} {r['seconds']:7.1f} s  {r['tokens'] / r['seconds']:>12,.0f} tok/s  "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:6.0f} MiB", flush=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    assert len({v[0]["tokens"] for v in runs.values()}) == 1, "the sides counted other tokens"
    print(f"\nbuild speed: hpengine {med['hpengine']:.1f} s; tokenizers alone {med['tokenizers']:.1f} s (whole "
          f"files, ratio {med['tokenizers'] / med['hpengine']:.2f}), {med['tokenizers-pieces']:.1f} s (64 KiB "
          f"pieces, ratio {med['tokenizers-pieces'] / med['hpengine']:.2f}); target >= 0.8", flush=True)
    if a.speed_only:
        return 0
    mem_tok, vocab = (tok, a.vocab) if a.memory_tokenizer == "bpe" else ("bytes", 256)
    sized = {}
    for gb, corpus in zip(a.sizes_gb, (small, big)):
        sized[f"{gb:g}"] = r = hpengine_build(corpus, mem_tok, work / f"mem-{gb:g}.h5", a.workers)
        print(f"{gb:g} GB corpus ({a.memory_tokenizer}): {r['seconds']:.1f} s, {r['tokens']:,} tokens, peak RSS "
              f"{r['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    rm = json.loads(subprocess.run([sys.executable, __file__, "--rank-memory", str(work / f"mem-{a.sizes_gb[1]:g}.h5"),
                                    str(vocab)], capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    res = {"workers": a.workers, "speed_gb": a.speed_gb, "sizes_gb": a.sizes_gb, "vocab": a.vocab,
           "median_seconds": med, "speed_ratio": med["tokenizers"] / med["hpengine"],
           "speed_ratio_pieces": med["tokenizers-pieces"] / med["hpengine"],
           "memory_tokenizer": a.memory_tokenizer,
           "build_peak_rss_mib": {k: r["peak_rss_bytes"] / 2**20 for k, r in sized.items()},
           "rank_data_mib": (rm["rss_after"] - rm["rss_before"]) / 2**20, "rank_rss_mib": rm["rss_after"] / 2**20,
           "runs": runs, "sized": sized}
    print("build peak RSS: " + ", ".join(f"{k} GB -> {v:.0f} MiB" for k, v in res["build_peak_rss_mib"].items())
          + " (target < 1024, flat)")
    print(f"training rank data memory: +{res['rank_data_mib']:.1f} MiB (RSS {res['rank_rss_mib']:.0f} MiB; "
          "target < 64)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
