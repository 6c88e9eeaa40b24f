"""Packed documents against fully causal flash attention on the CPU: the NumPy twin (hpengine/nn/flash.py),
forward and backward, one row of seq_len tokens cut from a token file of seeded random documents (geometric
lengths of mean --mean, written with the project's token file writer into a temporary folder), with the row's
document segments against the same row without them, each at the twin's default tiles. Reports ratio =
t_docs / (t_causal x sum(len^2) / T^2): the documents' time over the causal time scaled to the work their mask
leaves (1: no overhead). Times are the process's CPU seconds (time.process_time: one thread, so a machine
shared with other jobs disturbs them less than wall time), the median of interleaved repeats after a warm-up.
--compare FILE also times the documents through another copy of flash.py (e.g. an older commit's).

    .venv/bin/python benchmarks/bench_packed.py                      # T 4096, mean 512, 4 heads of 64, float32
    git show main:hpengine/nn/flash.py > /tmp/flash_main.py
    .venv/bin/python benchmarks/bench_packed.py --compare /tmp/flash_main.py --repeats 7
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_name
from _threads import ensure_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def token_file(folder: Path, n_docs: int, mean: int, seed: int) -> Path:
    """A token file of n_docs documents of geometric lengths (mean `mean`), random byte tokens, eos 0 ending each."""
    import numpy as np

    from hpengine.data.format import BYTES, sha256_text, write_token_file
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1.0 / mean, n_docs)
    ends = np.cumsum(lengths)
    tokens = rng.integers(1, 256, int(ends[-1])).astype(np.uint8)
    tokens[ends - 1] = 0
    raw = folder / "tokens.raw"
    tokens.tofile(raw)
    out = folder / "packed.h5"
    write_token_file(out, raw, np.uint8, np.concatenate([[0], ends]),
                     {"vocab_size": 256, "eos_id": 0, "tokenizer": BYTES, "tokenizer_sha256": sha256_text(BYTES)})
    return out


def row_segments(path: Path, T: int, seed: int):
    """(segments (1, T), piece lengths) of a window of T tokens starting at a seeded random token of the file."""
    import numpy as np

    from hpengine.data.documents import offsets_of, window_documents
    from hpengine.data.format import TokenFile
    with TokenFile(path) as tf:
        offsets = offsets_of(tf)
        start = int(np.random.default_rng(seed + 1).integers(0, tf.n_tokens - T - 1))
    segments = window_documents(offsets, [start], T)[0]
    return segments, np.bincount(segments[0])


def step(mod, q, k, v, do, segments, tiles=(None, None)) -> float:
    """CPU seconds of one forward and backward of the blocked core of flash module `mod`, at its default tiles
    (or `tiles`)."""
    import numpy as np
    t = time.process_time()
    o, lse = mod.flash_forward_core(np, q, k, v, 1, *tiles, segments=segments)
    mod.flash_backward_core(np, q, k, v, o, do, lse, 1, *tiles, segments=segments)
    return time.process_time() - t


def load_module(path: str):
    """A flash.py from a file, as its own module (its imports resolve in this checkout)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("flash_compared", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mean", type=int, default=512, help="mean document length of the token file")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings of each side, after one warm-up")
    ap.add_argument("--compare", metavar="FILE", help="also time the documents through this flash.py")
    ap.add_argument("--doc-tiles", nargs="*", default=[], metavar="BQxBK",
                    help="also time the documents at these tiles (nn/flash.py's BQ_DOCS x BK_DOCS set for them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    ensure_threads(a.threads, __file__)
    import numpy as np
    from threadpoolctl import threadpool_info

    from hpengine.nn import flash
    T, H, hd = a.seq, a.heads, a.head_dim
    with tempfile.TemporaryDirectory(prefix="hpengine-bench-packed-") as d:
        path = token_file(Path(d), 4 * T // a.mean + 64, a.mean, a.seed)
        segments, lengths = row_segments(path, T, a.seed)
    work = float((lengths.astype(np.float64) ** 2).sum() / T ** 2)
    rng = np.random.default_rng(a.seed + 2)
    q, k, v, do = (rng.standard_normal((1, H, T, hd)).astype(a.dtype) for _ in range(4))
    q *= 1 / np.sqrt(hd)
    blas = ", ".join(sorted({f"{i.get('internal_api')} {i.get('architecture', '')}".strip() for i in threadpool_info()}))
    print(f"{datetime.date.today()}, {cpu_name()}, {a.threads} thread(s), BLAS {blas}; `benchmarks/bench_packed.py "
          f"{' '.join(sys.argv[1:])}`")
    print(f"one row of T {T}: {lengths.size} document pieces (lengths {', '.join(map(str, lengths))}), "
          f"sum(len^2)/T^2 = {work:.4f}; {H} heads of {hd}, {a.dtype}, forward + backward; median of {a.repeats}\n")
    sides = {"causal": (flash, None, (None, None)), "documents": (flash, segments, (None, None))}
    for tiles in a.doc_tiles:
        sides[f"documents at {tiles}"] = (flash, segments, tuple(int(n) for n in tiles.split("x")))
    if a.compare:
        sides[f"documents, {Path(a.compare).name}"] = (load_module(a.compare), segments, (None, None))
    for mod, seg, tiles in sides.values():
        step(mod, q, k, v, do, seg, tiles)                # warm-up
    times = {name: [] for name in sides}
    for _ in range(a.repeats):
        for name, (mod, seg, tiles) in sides.items():
            times[name].append(step(mod, q, k, v, do, seg, tiles))
    tc = statistics.median(times["causal"])
    print(f"causal at tiles {flash.BQ} x {flash.BK}, documents at {flash.BQ_DOCS} x {flash.BK_DOCS}\n")
    print("| side | CPU s, each repeat | median | / causal | ratio (1 = no overhead) |")
    print("|---|---|---:|---:|---:|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {' / '.join(f'{x:.3f}' for x in ts)} | {t:.3f} | {t / tc:.3f} | "
              + ("-" if name == "causal" else f"{t / (tc * work):.3f}") + " |")


if __name__ == "__main__":
    main()
