"""Datasheet peak FLOP/s of the GPUs the planner and the progress line know, by device name and
precision column."""
from __future__ import annotations

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
