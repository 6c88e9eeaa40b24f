"""The flash kernels' segment ids without a GPU: every entry of attention.cu and attention_mma.cu, compiled by nvcc
for sm_80 and sm_90, ends its parameters with the document-id pointer seg; nn/flash_cuda.py hands it a null
pointer when no documents are packed and the (B, T) ids as one contiguous int32 array when they are, to the
SIMT and the tensor-core entries alike."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from emulated_rawkernel import signatures
from launch_args import check_args

from hpengine.device import kernels
from hpengine.nn import flash_cuda

SOURCES = ("attention", "attention_mma")


def _sig(entry):
    name = "attention_mma" if entry.startswith("flash_mma_") else "attention"
    return [ctype + ("*" if ptr else "") for ctype, ptr, _ in
            signatures(kernels.source_path(name).read_text())[entry]]


@pytest.mark.timeout(600)
@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", kernels.ARCHS)
@pytest.mark.parametrize("name", SOURCES)
def test_every_entry_compiles_with_the_segment_pointer_last(name, arch):
    src = kernels.source_path(name).read_text()
    sigs = signatures(src)
    assert len(sigs) == (9 if name == "attention" else 12)
    r = subprocess.run([kernels.find_nvcc(), "-ptx", f"-arch={arch}", "-o", "-", str(kernels.source_path(name))],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    entries = dict(re.findall(r"^\.visible \.entry (\w+)\(\s*(.*?)\)", r.stdout, re.M | re.S))
    assert set(entries) == set(sigs)
    for entry, params in entries.items():
        ptx = re.findall(r"\.param \.(\w+) (\w+)", params)
        assert len(ptx) == len(sigs[entry]), entry
        assert sigs[entry][-1] == ("int", True, True) and ptx[-1][0] == "u64", entry      # const int* seg
        body = r.stdout.split(f".entry {entry}(", 1)[1].split(".entry ", 1)[0]
        assert re.search(rf"ld\.param\.u64\s+%rd\d+, \[{ptx[-1][1]}\]", body), entry            # seg is read


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "function", lambda name, entry, path=None:
                        lambda grid, block, args, shared_mem=0: calls.append((entry, args)))
    return calls


@pytest.mark.parametrize("mma", [False, True])
def test_segments_reach_every_launch_as_int32_ids(launches, mma):
    B, H, K, T, hd = 2, 4, 2, 37, 16
    q, k = np.zeros((B, H, T, hd), np.float32), np.zeros((B, K, T, hd), np.float32)
    o, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(k)
    seg = np.repeat(np.arange(4), [10, 1, 20, 6])[None].repeat(B, 0)           # int64, as the Batch holds them
    lse = flash_cuda.forward(np, q, k, k, o, 1.0, mma=mma, segments=seg)
    flash_cuda.backward(np, q, k, k, o, o, lse, dq, dk, dv, 1.0, mma=mma, segments=seg)
    lse = flash_cuda.forward(np, q, k, k, o, 1.0, mma=mma)
    flash_cuda.backward(np, q, k, k, o, o, lse, dq, dk, dv, 1.0, mma=mma)
    assert len(launches) == 6 and all(e.startswith("flash_mma_" if mma else "flash_") for e, _ in launches)
    for n, (entry, args) in enumerate(launches):
        check_args(entry, args, _sig(entry), same_dtype=True)
        last = args[-1]
        if n < 3:
            assert last.dtype == np.int32 and last.flags.c_contiguous and (last == seg).all(), entry
        else:
            assert last is flash_cuda.NULL and isinstance(last, np.uint64) and last == 0, entry


def test_segments_of_the_wrong_shape_are_refused(launches):
    z = np.zeros((1, 2, 8, 4), np.float32)
    with pytest.raises(ValueError, match=r"segments must be \(B, T\) = \(1, 8\)"):
        flash_cuda.forward(np, z, z, z, z.copy(), 1.0, segments=np.zeros((1, 7), np.int64))
    assert not launches
