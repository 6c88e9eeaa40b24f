"""Packed documents against fully causal flash attention on the CPU: the NumPy twin (hpengine/nn/flash.py),
forward and backward, one row of seq_len tokens cut from a token file of seeded random documents (geometric
lengths of mean --mean, written with the project's token file writer into a temporary folder), with the row's
document segments against the same row without them. Reports ratio = t_docs / (t_causal x sum(len^2) / T^2):
the documents' time over the causal time scaled to the work their mask leaves (1: no overhead).

    .venv/bin/python benchmarks/bench_packed.py                      # T 4096, mean 512, 4 heads of 64, float32
    .venv/bin/python benchmarks/bench_packed.py --bq 64 128 --bk 64 128   # tile sizes, each timed in turn
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


def step(q, k, v, do, segments, bq, bk) -> float:
    """Seconds of one forward and backward of the blocked core."""
    import numpy as np

    from hpengine.nn.flash import flash_backward_core, flash_forward_core
    t = time.perf_counter()
    o, lse = flash_forward_core(np, q, k, v, 1, bq, bk, segments=segments)
    flash_backward_core(np, q, k, v, o, do, lse, 1, bq, bk, segments=segments)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mean", type=int, default=512, help="mean document length of the token file")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings of each side, after one warm-up")
    ap.add_argument("--bq", type=int, nargs="+", default=[None], help="query tile (default: nn/flash.py's)")
    ap.add_argument("--bk", type=int, nargs="+", default=[None], help="key tile (default: nn/flash.py's)")
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
    print("| bq | bk | causal s | documents s | documents / causal | ratio (1 = no overhead) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bq in a.bq:
        for bk in a.bk:
            step(q, k, v, do, None, bq, bk)
            step(q, k, v, do, segments, bq, bk)               # warm-up
            causal, docs = [], []
            for _ in range(a.repeats):
                causal.append(step(q, k, v, do, None, bq, bk))
                docs.append(step(q, k, v, do, segments, bq, bk))
            tc, td = statistics.median(causal), statistics.median(docs)
            print(f"| {bq or flash.BQ} | {bk or flash.BK} | {tc:.3f} | {td:.3f} | {td / tc:.3f} | "
                  f"{td / (tc * work):.3f} |", flush=True)


if __name__ == "__main__":
    main()
