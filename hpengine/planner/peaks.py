"""The peak FLOP/s that MFU is measured against: a GPU's datasheet figure, by device name and precision
column; on the CPU, the best GEMM rate ever measured on this machine, kept in the user's cache folder per
(CPU model, BLAS kernel, threads, dtype, size), so one start-up timed under load cannot lower it."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from threadpoolctl import threadpool_info

from hpengine.files.safe import UnsafeFile, read_text, write_file

log = logging.getLogger("hpengine")

CACHE_NAME = "gemm-peaks.json"
CACHE_FORMAT = "hpengine-gemm-peaks-1"
CACHE_LIMIT = 1 << 20          # bytes: a cache file larger than this is not read
# FLOP per cycle and thread no CPU core reaches (two 512-bit FMA units: 64 in float32) at a clock none runs
# at: a cached figure above threads x this is not a measurement of a CPU (a corrupt or edited file). A
# bound from the figure just timed would not do: under load a multi-threaded GEMM slows down 30-fold.
CPU_FLOP_PER_CYCLE, CPU_MAX_HZ = 128, 6e9

# Dense (no structured sparsity) peak TFLOP/s per GPU from NVIDIA's datasheets: the H100 datasheet
# (SXM5 and PCIe columns), the H200 datasheet (SXM and NVL), the A100 datasheet (SXM and PCIe agree).
# "16bit" = BF16/FP16 tensor cores (amp), "tf32" = runtime.matmul_precision = "tf32", "fp32" = plain
# FP32 (CUDA cores), "fp64" = FP64 tensor cores. The first entry whose name occurs in the device's name
# wins, so the PCIe/NVL variants come before their SXM sibling.
PEAK_TFLOPS = (
    ("H100 PCIe", {"16bit": 756.0, "tf32": 378.0, "fp32": 51.0, "fp64": 51.0}),
    ("H100", {"16bit": 989.0, "tf32": 494.7, "fp32": 67.0, "fp64": 67.0}),
    ("H200 NVL", {"16bit": 835.5, "tf32": 417.5, "fp32": 60.0, "fp64": 60.0}),
    ("H200", {"16bit": 989.0, "tf32": 494.7, "fp32": 67.0, "fp64": 67.0}),
    ("A100", {"16bit": 312.0, "tf32": 156.0, "fp32": 19.5, "fp64": 19.5}),
)


def precision_of(cfg) -> str:
    """Which column of PEAK_TFLOPS the run's GEMMs use."""
    if cfg.strategy.amp.enable:
        return "16bit"
    if cfg.model.dtype == "float64":
        return "fp64"
    return "tf32" if cfg.runtime.matmul_precision == "tf32" else "fp32"


def table_peak(device_name: str, precision: str) -> float | None:
    """Peak TFLOP/s of a GPU by its name (None for a GPU not in the table)."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks[precision]
    return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as Linux reports it ("unknown CPU" where the file has none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return "unknown CPU"


def blas_kernel() -> str:
    """The BLAS library and kernel NumPy's GEMMs run in, e.g. "openblas 0.3.27 SkylakeX"."""
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            return " ".join(str(info[k]) for k in ("internal_api", "version", "architecture") if info.get(k))
    return "no BLAS"


def peak_key(dtype: str, n: int, threads: int | None) -> str:
    """What a measured peak is filed under: the CPU model, the BLAS kernel, the threads and the GEMM timed."""
    return f"{cpu_model()} | {blas_kernel()} | {threads or '?'} thread(s) | {dtype} {n}^3"


def cache_file() -> Path:
    """The measured peaks' file: in $HPENGINE_CACHE or ~/.cache/hpengine, beside the built-in corpus."""
    root = os.environ.get("HPENGINE_CACHE") or Path.home() / ".cache" / "hpengine"
    return Path(root) / CACHE_NAME


def cached_peak(key: str, path: Path | None = None) -> float | None:
    """The figure cached for `key`, None without one (a faulty cache is said by best_peak)."""
    return _read_cache(cache_file() if path is None else path, lambda *_: None).get(key)


def _read_cache(path: Path, say=log.info) -> dict[str, float]:
    """The figures of the cache file, {key: FLOP/s}; {} for a missing file, and (with a log line naming the
    file and the fault) for one that is not a cache this version wrote. Entries that are not a finite
    positive number are dropped."""
    try:
        raw = json.loads(read_text(path, "the measured GEMM peaks", CACHE_LIMIT))
    except FileNotFoundError:
        return {}
    except UnsafeFile as exc:                 # a link or not a regular file: replaced by the next write
        say("measured GEMM peaks ignored: %s", exc)
        return {}
    except (OSError, ValueError) as exc:      # unreadable, not UTF-8, not JSON
        say("measured GEMM peaks ignored: '%s' is not readable JSON (%s); it is measured again", path, exc)
        return {}
    if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT or not isinstance(raw.get("peaks"), dict):
        say("measured GEMM peaks ignored: '%s' is not a %s file; it is measured again", path, CACHE_FORMAT)
        return {}
    return {k: float(v) for k, v in raw["peaks"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def cpu_bound(threads: int | None) -> float:
    """FLOP/s that `threads` threads (None: every CPU) cannot reach on any CPU."""
    return (threads or os.cpu_count() or 1) * CPU_FLOP_PER_CYCLE * CPU_MAX_HZ


def best_peak(key: str, measured: float, bound: float = math.inf, path: Path | None = None) -> tuple[float, str]:
    """(the peak to use for `key`, where it comes from): the larger of `measured` (FLOP/s, just timed) and
    the cached figure, which is trusted only below `bound` (cpu_bound). A new best is written back
    (write_file: a fresh temporary file renamed onto the cache); a cache that cannot be written only costs
    the next run a figure."""
    path = cache_file() if path is None else path
    known = _read_cache(path)
    cached = known.get(key)
    if cached is not None and cached > bound:
        log.info("measured GEMM peak of %.4g GFLOP/s in '%s' refused: above the %.4g GFLOP/s no CPU of these "
                 "threads reaches", cached / 1e9, path, bound / 1e9)
        cached = None
    if cached is not None and cached >= measured:
        return cached, f"the best measured on this machine, cached in {path}"
    known[key] = measured
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps({"format": CACHE_FORMAT, "peaks": known}, indent=1) + "\n", durable=False)
    except (OSError, UnsafeFile) as exc:
        log.info("measured GEMM peak not cached: cannot write '%s' (%s)", path, exc)
    return measured, "measured now" + ("" if cached is None else f" (above the {cached / 1e9:.4g} GFLOP/s cached)")
