"""RawKernel launches on the CuPy stand-in (emulated_cupy.py): each entry's C signature read from its .cu source
with the macros expanded, every launch held against it and the launch limits, then run by an emulator of its C
code (emulated_fused.py, emulated_flash.py) or a NumPy twin (AdamW, pack/unpack).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import emulated_flash
import emulated_fused
import numpy as np
from emulated_arrays import LAUNCHES, MOVED, DevArray, _plain

from hpengine.device import kernels

SHARED_DEFAULT = 48 << 10

C_DTYPES = {"float": np.float32, "double": np.float64, "unsigned short": np.uint16, "__half": np.float16,
            "half": np.float16, "unsigned char": np.uint8, "long long": np.int64, "int": np.int32}


def _expand(src: str) -> str:
    """The source with its function-like macros expanded once (what the ENTRIES lines instantiate)."""
    lines = [re.sub(r"\s*//.*?(\\?)$", r" \1", ln) for ln in src.splitlines()]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    macros = {m.group(1): ([p.strip() for p in m.group(2).split(",")], m.group(3))
              for m in re.finditer(r"^#define (\w+)\(([^)]*)\)(.*)$", text, re.M)}
    out = []
    for ln in text.splitlines():
        if ln.startswith("#define"):
            continue
        m = re.match(r"^(\w+)\((.*)\)\s*;?\s*$", ln)
        if m and m.group(1) in macros:
            params, body = macros[m.group(1)]
            args = [a.strip() for a in m.group(2).split(",")]
            for p, a in zip(params, args):
                body = re.sub(rf"\b{p}\b", a, body)
            ln = re.sub(r"\s*##\s*", "", body)
        out.append(ln)
    return "\n".join(out)


def signatures(src: str) -> dict:
    """entry -> [(C type, is pointer, is const)] of every extern "C" __global__ entry of a .cu source."""
    sigs = {}
    for m in re.finditer(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)',
                         _expand(src)):
        params = []
        for decl in m.group(2).split(","):
            const = "const" in decl.split()
            words = decl.replace("*", " * ").replace("const", " ").replace("__restrict__", " ").split()[:-1]
            params.append((" ".join(w for w in words if w != "*"), "*" in words, const))
        sigs[m.group(1)] = params
    return sigs


def check_launch(entry, sig, grid, block, args, shared_mem) -> None:
    """One launch against the entry's signature and the launch limits (AssertionError naming what is wrong)."""
    assert len(args) == len(sig), f"{entry}: {len(args)} arguments for {len(sig)} parameters"
    for k, ((ctype, ptr, _), a) in enumerate(zip(sig, args)):
        want = np.dtype(C_DTYPES[ctype])
        if ptr and ctype == "int" and entry.startswith("flash_") and isinstance(a, np.uint64):     # seg: optional
            assert a == 0, f"{entry} argument {k} (int*): the integer {a} is no pointer (only 0, a null one)"
        elif ptr:
            assert isinstance(a, DevArray), f"{entry} argument {k} ({ctype}*): {type(a).__name__}, not a device array"
            ok = a.dtype == want or (ctype == "unsigned short" and a.dtype == np.float16)
            assert ok, f"{entry} argument {k} ({ctype}*): dtype {a.dtype}"
            strided = a.ndim == 4 and [t for t, p, _ in sig[k + 1:k + 4]] == ["long long"] * 3
            if k == 0 and entry.startswith("rope_"):        # read through the four strides that end the list
                assert a.ndim == 4 and tuple(args[-4:]) == tuple(s // a.itemsize for s in a.strides), \
                    f"{entry} argument 0: a {a.shape} view not read through its element strides"
            elif strided:
                assert a.strides[-1] == a.itemsize and \
                    tuple(args[k + 1:k + 4]) == tuple(s // a.itemsize for s in a.strides[:3]), \
                    f"{entry} argument {k}: a {a.shape} view not followed by its element strides"
            else:
                assert a.flags.c_contiguous, f"{entry} argument {k}: a strided {a.shape} array"
        else:
            assert isinstance(a, np.generic) and a.dtype == want, \
                f"{entry} argument {k} ({ctype}): {type(a).__name__} {getattr(a, 'dtype', '')}"
    assert all(isinstance(x, int) and x >= 1 for x in tuple(grid) + tuple(block)), (entry, grid, block)
    assert np.prod(block) <= 1024, (entry, block)
    assert grid[0] < 2**31 and all(g <= 65535 for g in tuple(grid)[1:]), (entry, grid)
    assert 0 <= shared_mem <= SHARED_DEFAULT, f"{entry}: {shared_mem} bytes of dynamic shared memory"


class Launch(NamedTuple):
    grid: tuple
    block: tuple
    shared_mem: int


def _adamw(args, launch):
    p, g, m, v, mask, *rest = args
    copy = rest.pop(0) if isinstance(rest[0], DevArray) else None
    coefs = kernels.AdamWCoefs(*(float(x) for x in rest[1:]))
    kernels.adamw_numpy(*(_plain(a) for a in (p, g, m, v, mask)), coefs, None if copy is None else _plain(copy))


def _copy(op):
    twin = {"pack": kernels.pack_numpy, "unpack": kernels.unpack_numpy, "pack_bf16": kernels.pack_bf16_numpy}[op]

    def run(args, launch):
        buf, flat, offsets, _, sizes, _ = (_plain(a) for a in args)
        twin(buf, flat, offsets, sizes)
        if op == "pack_bf16":             # a bfloat16 conversion: its bytes counted with the ElementwiseKernels'
            MOVED["raw:pack_bf16_f32"] += int(sizes.sum()) * (flat.itemsize + buf.itemsize)
    return run


# entry prefix -> emulator(args, launch) (the first that fits: longer prefixes first); the emulators of fused.cu,
# attention.cu and attention_mma.cu are keyed by their full entry names
PREFIXED = {"adamw_": _adamw, "pack_bf16_": _copy("pack_bf16"), "pack_": _copy("pack"), "unpack_": _copy("unpack")}
EMULATED = {**emulated_fused.EMULATED, **emulated_flash.EMULATED}


def emulator(entry):
    run = EMULATED.get(entry) or next((f for pre, f in PREFIXED.items() if entry.startswith(pre)), None)
    if run is None:
        raise NotImplementedError(f"the CuPy stand-in has no emulator for kernel entry {entry}")
    return run


def _overlap(entry, sig, args) -> None:
    """Outputs do not overlap inputs (the .cu's launch assumptions; in-place entries have no const input
    that is their output)."""
    ins = [a for (_, ptr, const), a in zip(sig, args) if ptr and const]
    for (_, ptr, const), a in zip(sig, args):
        if ptr and not const:
            assert not any(np.shares_memory(a, b) for b in ins), f"{entry}: an output overlaps an input"


class _Kernel:
    def __init__(self, mod, entry, sig):
        self.mod, self.entry, self.sig = mod, entry, sig

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        args = tuple(args)
        check_launch(self.entry, self.sig, tuple(grid), tuple(block), args, shared_mem)
        _overlap(self.entry, self.sig, args)
        self.mod.launches.append(self.entry)
        LAUNCHES[f"raw:{self.entry}"] += 1
        emulator(self.entry)(args, Launch(tuple(grid), tuple(block), shared_mem))


class _Module:
    def __init__(self, mod, code):
        self.mod, self.sigs = mod, signatures(code)

    def compile(self):
        pass

    def get_function(self, entry):
        if entry not in self.sigs:
            raise KeyError(f"no extern \"C\" __global__ {entry} in the module's source")
        return _Kernel(self.mod, entry, self.sigs[entry])


