"""FP8 block-quantised Hugging Face weights (DeepSeek-V3, Kimi K2): config.json's quantization_config, each float8
e4m3 `<name>.weight` paired with its `<name>.weight_scale_inv` (one scale per 128 x 128 block, edge blocks
smaller), and their dequantisation: the fp8 value times its block's scale, exact in float64.
"""
from __future__ import annotations

import numpy as np

from hpengine.checkpoint.shards import CheckpointError

FP8 = "F8_E4M3"                          # the safetensors dtype code of float8 e4m3 (finite, no infinities)
SUFFIX = "_scale_inv"                    # `<name>.weight_scale_inv` scales `<name>.weight`
BLOCK = (128, 128)                       # (rows, columns) of the (out, in) matrix one scale covers
SCALE_FMTS = (None, "float", "ue8m0")    # ue8m0: the scales are powers of two, still stored as floats


def _e4m3_values() -> np.ndarray:
    """The float64 value of each of the 256 e4m3fn bit patterns (sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 is subnormal, all ones with mantissa 7 is NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7) / 8.0
    mag = np.where(e == 0, m * 2.0 ** -6, (1.0 + m) * 2.0 ** (e - 7))
    mag[(e == 15) & (b & 7 == 7)] = np.nan
    return np.where(b & 0x80, -mag, mag)


E4M3 = _e4m3_values()


def block_size(hc: dict, where: str) -> tuple | None:
    """The (rows, columns) block of config.json's quantization_config; None when the folder is not quantised.
    Only DeepSeek-V3's scheme is read: fp8, e4m3, 128 x 128 blocks."""
    q = hc.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: config.json has quantization_config {q!r}; it must be an object")
    checks = (("quant_method", q.get("quant_method"), ("fp8",), "'fp8' (block-quantised float8)"),
              ("fmt", q.get("fmt", "e4m3"), ("e4m3",), "'e4m3'"),
              ("weight_block_size", q.get("weight_block_size"), (list(BLOCK),), str(list(BLOCK))),
              ("scale_fmt", q.get("scale_fmt"), SCALE_FMTS, "'float' or 'ue8m0'"))
    for key, value, valid, say in checks:
        if value not in valid:
            raise CheckpointError(f"{where}: config.json has quantization_config.{key} {value!r}; only {say} can be "
                                  "read (DeepSeek-V3's fp8 e4m3 weights in 128 x 128 blocks)")
    return BLOCK


def fold(entries: dict, block: tuple | None, where: str) -> dict:
    """Take every `<name>_scale_inv` out of `entries` (HF name -> (path, dtype code, shape, start, end)) and return
    {entry of the scaled weight: entry of its scales}, each pair checked: an F8_E4M3 matrix, and one scale per
    block (ceil(rows / 128) x ceil(columns / 128))."""
    scales = {}
    for name in [n for n in entries if n.endswith(SUFFIX)]:
        weight = name[:-len(SUFFIX)]
        if block is None:
            raise CheckpointError(f"{where}: tensor {name} holds block scales but config.json has no "
                                  "quantization_config; an fp8 folder has {\"quant_method\": \"fp8\", ...}")
        if weight not in entries:
            raise CheckpointError(f"{where}: tensor {name} holds the block scales of {weight}, which is missing")
        w, s = entries[weight], entries.pop(name)
        if w[1] != FP8 or len(w[2]) != 2:
            raise CheckpointError(f"{where}: tensor {weight} is {w[1]} of shape {list(w[2])} but {name} gives it block "
                                  f"scales; only {FP8} matrices are scaled")
        want = tuple(-(-d // b) for d, b in zip(w[2], block))
        if s[2] != want:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(s[2])}; {weight} {list(w[2])} in "
                                  f"{block[0]} x {block[1]} blocks needs {list(want)}")
        scales[w] = s
    return scales


def dequantize(bits: np.ndarray, scale: np.ndarray, block: tuple) -> np.ndarray:
    """float64 weights from an (R, C) matrix of e4m3 bit patterns (uint8) and its (ceil(R / br), ceil(C / bc))
    scales. Exact: an e4m3 significand has 4 bits and a float32 scale 24, so their product fits float64's 53."""
    br, bc = block
    out = E4M3[bits]
    for r in range(scale.shape[0]):                      # one row of blocks at a time: no full-size scale array
        out[r * br:(r + 1) * br] *= np.repeat(scale[r], bc)[:out.shape[1]]
    return out
