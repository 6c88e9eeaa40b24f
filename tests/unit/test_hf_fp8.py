"""`checkpoint.init_from = "hf:DIR"` from an fp8 block-quantised folder (DeepSeek-V3's scheme), written here: a tiny
llama whose linear weights are quantised by this file from the equations (per 128 x 128 block, edge blocks smaller:
scale = amax / 448, q = e4m3(w / scale), with ml_dtypes' float8_e4m3fn as the cast), raw safetensors bytes. The
import equals q x scale exactly, stays within e4m3's rounding of the original weights, consumes the scale tensors,
and refuses other schemes and broken pairs in one line."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from hpengine.checkpoint import hf_fp8
from hpengine.checkpoint.hf_import import HFReader
from hpengine.checkpoint.shards import CheckpointError
from hpengine.config.load import load_config
from hpengine.models import hf_llama
from hpengine.run.build import build
from hpengine.run.train import restore

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn

# widths that are not multiples of 128: q and o are 200 x 200, k and v 100 x 200, gate and up 130 x 200, down
# 200 x 130, so the matrices have full blocks, edge blocks (72 and 2 wide) and single partial blocks
TINY = ["model.kind='llama'", "model.seq_len=8", "model.d_model=200", "model.n_layers=2", "model.n_heads=2",
        "model.n_kv_heads=1", "model.ffn_hidden=130", "train.global_batch=4", "runtime.backend='numpy'",
        "train.log_every=1000"]
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CODE = {np.dtype(np.float32): "F32", np.dtype(E4M3): "F8_E4M3"}


def quantise(w: np.ndarray):
    """(e4m3 array, float32 scales) of a float32 (out, in) matrix, DeepSeek-V3's way: one scale per 128 x 128
    block, scale = amax / 448 (448: e4m3's largest finite value), q = w / scale rounded to e4m3."""
    R, C = w.shape
    q = np.empty(w.shape, E4M3)
    s = np.empty((-(-R // 128), -(-C // 128)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = np.abs(blk).max() / np.float32(448)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).astype(E4M3)
    return q, s


def dequantised(q, s) -> np.ndarray:
    """q x its block's scale in float64 (each element and its block found by index, not by reshaping)."""
    i, j = np.indices(q.shape)
    return q.astype(np.float64) * s[i // 128, j // 128].astype(np.float64)


def st_bytes(tensors: dict) -> bytes:
    """A safetensors file (u64 header length, JSON header, data) of float32 and e4m3 arrays."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": CODE[a.dtype], "shape": list(a.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture(scope="module")
def model(small_corpus):
    """(config, the run's true shapes, its float32 HF tensors, the fp8 ones' (q, scale) by HF name)."""
    cfg = load_config(None, [*TINY, f"data.path={small_corpus}"])
    eng = build(cfg)
    r = np.random.default_rng(3)
    hf = {}
    for k, v in hf_llama.to_hf(eng.named_params(), cfg.model).items():
        w = r.standard_normal(v.shape).astype(np.float32)
        if k.endswith("_proj.weight"):               # rows of very different sizes: the blocks get other scales
            w *= np.float32(2.0) ** r.integers(-12, 3, (v.shape[0], 1))
        hf[k] = w
    quant = {k: quantise(w) for k, w in hf.items() if k.endswith("_proj.weight")}
    return cfg, eng.true_shapes(), hf, quant


def write(folder: Path, model, quant_config=QUANT, edit=None) -> Path:
    cfg, _, hf, quant = model
    tensors = dict(hf)
    for k, (q, s) in quant.items():
        tensors[k], tensors[k + "_scale_inv"] = q, s
    if edit is not None:
        edit(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    hc = hf_llama.hf_config(cfg.model, "bfloat16", None)
    if quant_config is not None:
        hc["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(hc))
    (folder / "model.safetensors").write_bytes(st_bytes(tensors))
    return folder


def expected(model) -> dict:
    """hpengine name -> float64 values the import must give: the HF tensors with every fp8 one dequantised here."""
    cfg, _, hf, quant = model
    values = {k: hf[k].astype(np.float64) for k in hf}
    values.update({k: dequantised(q, s) for k, (q, s) in quant.items()})
    return {n: fn(values[h]) for n, (h, fn) in hf_llama.from_hf_map(cfg.model).items()}


def test_e4m3_values_equal_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    assert np.array_equal(hf_fp8.E4M3, want, equal_nan=True)
    assert np.isnan(want).sum() == 2 and hf_fp8.E4M3[0x7E] == 448 and hf_fp8.E4M3[1] == 2.0 ** -9


def test_import_equals_dequantised(tmp_path, model):
    cfg, shapes, hf, quant = model
    folder = write(tmp_path / "fp8", model)
    r = HFReader(folder, cfg.model, shapes)
    assert not any(k.endswith("_scale_inv") for k in r.st.entries)       # consumed, not left over
    want = expected(model)
    assert len(r.map) == len(want) == len(shapes)
    for name, shape in shapes.items():
        got = r.read("param", name, tuple(slice(0, d) for d in shape))
        assert got.dtype == np.float64 and np.array_equal(got, want[name]), name


def test_dequantised_within_e4m3_rounding(model):
    # e4m3 keeps 3 fraction bits: rounding to nearest errs by at most half a unit in the last place, 2^-4 of the
    # value's power of two (so <= 2^-4 |w|) for normal numbers (|w / scale| >= 2^-6), and half the subnormal
    # step, 2^-10, in units of the scale below that. The float32 division w / scale adds 2^-24 relative.
    _, _, hf, quant = model
    worst = 0.0
    for k, (q, s) in quant.items():
        w, d = hf[k].astype(np.float64), dequantised(q, s)
        i, j = np.indices(w.shape)
        bound = np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * s[i // 128, j // 128]) * (1 + 2.0 ** -20)
        assert (np.abs(d - w) <= bound).all(), k
        worst = max(worst, float((np.abs(d - w) / bound).max()))
    assert worst > 0.9                                 # the bound is reached: a coarser rounding would fail it


def test_run_starts_from_fp8_folder(tmp_path, small_corpus, model):
    """Through the engine: a float32 run holds float32(q x scale), the one rounding of the exact product."""
    folder = write(tmp_path / "fp8", model)
    cfg = load_config(None, [*TINY, f"data.path={small_corpus}", f"checkpoint.init_from=hf:{folder}"])
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    want = expected(model)
    for name, arr in eng.named_params().items():
        assert arr.dtype == np.float32 and np.array_equal(arr, want[name].astype(np.float32)), name


GATE = "model.layers.0.mlp.gate_proj.weight"


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.update({name: value})


@pytest.mark.parametrize("quant_config, edit, message", [
    ({**QUANT, "quant_method": "bitsandbytes"}, None, "quantization_config.quant_method 'bitsandbytes'; only 'fp8'"),
    ({**QUANT, "weight_block_size": [64, 64]}, None, r"weight_block_size \[64, 64\]; only \[128, 128\]"),
    ({**QUANT, "fmt": "e5m2"}, None, "quantization_config.fmt 'e5m2'; only 'e4m3'"),
    ("fp8", None, "quantization_config 'fp8'; it must be an object"),
    (None, None, r"tensor model\.layers\.\S+_scale_inv holds block scales but config.json has no quantization_config"),
    (QUANT, _drop(GATE + "_scale_inv"), f"tensor {GATE} has dtype 'F8_E4M3', which cannot be read"),
    (QUANT, _drop(GATE), f"{GATE}_scale_inv holds the block scales of {GATE}, which is missing"),
    (QUANT, _set(GATE + "_scale_inv", np.ones((1, 2), np.float32)),
     rf"{GATE}_scale_inv has shape \[1, 2\]; {GATE} \[130, 200\] in 128 x 128 blocks needs \[2, 2\]"),
    (QUANT, _set(GATE, np.ones((130, 200), np.float32)), f"tensor {GATE} is F32 of shape"),
])
def test_refused(tmp_path, model, quant_config, edit, message):
    cfg, shapes, _, _ = model
    folder = write(tmp_path / "bad", model, quant_config, edit)
    with pytest.raises(CheckpointError, match=message) as exc:
        HFReader(folder, cfg.model, shapes)
    assert "\n" not in str(exc.value)
