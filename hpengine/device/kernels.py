"""CUDA kernels (kernels/*.cu) and their NumPy twins. On a GPU each .cu file becomes one CuPy RawModule
per device, its source prefixed with a `#line` directive so compiler errors name the .cu file and line;
on the CPU the twins run the same arithmetic in the same order, so both paths give the same bits.
`compile_check` compiles a kernel without any GPU (nvcc, or NVRTC through ctypes) for the tests.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hpengine.device import backend
from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
from hpengine.device.precision import round_bf16_

KERNELS = ("adamw", "pack", "fused")
ARCHS = ("sm_80", "sm_90")          # A100, H100/H200
THREADS = 256                       # block size of every launch
BLOCKS_PER_SM = 8                   # grid-stride loops need only enough blocks to fill the device
CHUNK = 1 << 16                     # NumPy twins work in chunks this long (the scratch stays in L2)
_HERE = Path(__file__).resolve().parent.parent      # the package root: hpengine/_kernels beside it
_MODULES: dict = {}
_FUNCS: dict = {}
_TABLES: dict = {}
_SMS: dict = {}


class KernelError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ sources

def kernel_dirs() -> list[Path]:
    """Folders searched for <name>.cu: $HPENGINE_KERNELS, the package data hpengine/_kernels (a link
    to ../kernels in a source checkout, a copy once installed), then the checkout's kernels/."""
    env = os.environ.get("HPENGINE_KERNELS")
    return ([Path(env)] if env else []) + [_HERE / "_kernels", _HERE.parent / "kernels"]


def source_path(name: str) -> Path:
    """The .cu file of kernel `name` ('adamw', 'pack')."""
    for d in kernel_dirs():
        p = d / f"{name}.cu"
        if p.is_file():
            return p
    raise KernelError(f"kernel source {name}.cu not found in {', '.join(map(str, kernel_dirs()))}; "
                      "reinstall hpengine (`pip install .` ships kernels/*.cu as hpengine/_kernels/) or "
                      "point HPENGINE_KERNELS at the folder that holds the .cu files")


def load_source(name: str, path=None) -> str:
    """The source to compile: the file, after a #line directive naming it (errors then point at it)."""
    path = Path(path) if path is not None else source_path(name)
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{quoted}"\n' + path.read_text()


# ------------------------------------------------------------------------ compiling without a GPU

def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def find_nvrtc() -> str | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel, a CUDA toolkit, or the loader's search path."""
    spec = importlib.util.find_spec("nvidia")             # namespace package of NVIDIA's wheels
    roots = list(spec.submodule_search_locations or []) if spec else []
    cands = [f for r in roots for f in sorted(glob.glob(os.path.join(r, "**", "libnvrtc.so*"), recursive=True))]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    cands = [c for c in cands if "builtins" not in os.path.basename(c)]
    return cands[0] if cands else ctypes.util.find_library("nvrtc")


def compile_check(name: str, archs=ARCHS, path=None, compiler: str = "auto") -> dict[str, str]:
    """Compile kernel `name` (or the file `path`) to SASS for each arch; returns {arch: compiler log}.
    compiler: 'nvcc', 'nvrtc' (what CuPy uses, through ctypes) or 'auto' (nvcc when found). Raises
    KernelError carrying the compiler's log, whose messages name the .cu file and line."""
    src = load_source(name, path)
    if compiler == "auto":
        compiler = "nvcc" if find_nvcc() else "nvrtc"
    run = {"nvcc": _nvcc_compile, "nvrtc": _nvrtc_compile}.get(compiler)
    if run is None:
        raise KernelError(f"compiler = {compiler!r}: valid values are 'auto', 'nvcc', 'nvrtc'")
    return {arch: run(src, arch, Path(path).stem if path else name) for arch in archs}


def _nvcc_compile(src: str, arch: str, name: str) -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelError("nvcc not found (looked in $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH)")
    with tempfile.TemporaryDirectory(prefix="hpengine-nvcc-") as tmp:
        cu = Path(tmp) / f"{name}.cu"
        cu.write_text(src)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-Xptxas=-v", "-o", str(cu.with_suffix(".cubin")), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise KernelError(f"kernel {name}: nvcc failed for {arch} (exit {r.returncode}):\n{out}")
    return out


def _nvrtc_compile(src: str, arch: str, name: str) -> str:
    lib_path = find_nvrtc()
    if lib_path is None:
        raise KernelError("NVRTC not found: install nvidia-cuda-nvrtc (pip) or a CUDA toolkit")
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None):
        raise KernelError(f"kernel {name}: nvrtcCreateProgram failed")
    # -ftz=true: CuPy appends it to every RawModule compile; the kernels must be right under it
    opts = [f"--gpu-architecture={arch}".encode(), b"-ftz=true"]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    out = buf.value.decode(errors="replace")
    if rc != 0:
        raise KernelError(f"kernel {name}: NVRTC failed for {arch} (nvrtcResult {rc}):\n{out}")
    return out


# ---------------------------------------------------------------------------- loading on a GPU

def function(name: str, entry: str, path=None):
    """The RawKernel `entry` of kernel file `name` on the current device (compiled once per device)."""
    cupy = backend.cupy_module()
    dev = cupy.cuda.Device().id
    fkey = (name, entry, dev, path)
    if fkey not in _FUNCS:
        mkey = (name, dev, path)
        try:
            if mkey not in _MODULES:
                mod = cupy.RawModule(code=load_source(name, path))
                mod.compile()
                _MODULES[mkey] = mod
            _FUNCS[fkey] = _MODULES[mkey].get_function(entry)
        except KernelError:
            raise
        except Exception as e:  # noqa: BLE001 - CuPy's CompileException carries the NVRTC log
            raise KernelError(f"kernel {path or name}: building {entry} for device {dev} failed:\n{e}") from e
    return _FUNCS[fkey]


def _max_blocks() -> int:
    cupy = backend.cupy_module()
    dev = cupy.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return BLOCKS_PER_SM * _SMS[dev]


def blocks_for(items: int) -> int:
    """Blocks of THREADS for a grid-stride loop over `items` work items."""
    return max(1, min(math.ceil(items / THREADS), _max_blocks()))


# ----------------------------------------------------------------------------------- AdamW

class AdamWCoefs(NamedTuple):
    """The per-step scalars of the fused update (see kernels/adamw.cu), in the kernel's order."""
    b1: float
    c1: float
    b2: float
    c2: float
    step: float
    eps: float
    keep: float


def adamw_coefs(t: int, lr: float, betas, eps: float, weight_decay: float, grad_coef: float = 1.0):
    """Step t's coefficients, in double. grad_coef folds clipping and loss-scale undo into the moments;
    lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) == (lr*sqrt(bc2)/bc1) * m / (sqrt(v) + eps*sqrt(bc2))."""
    b1, b2 = betas
    sb2 = math.sqrt(1.0 - b2 ** t)
    return AdamWCoefs(b1, (1.0 - b1) * grad_coef, b2, (1.0 - b2) * grad_coef * grad_coef,
                      lr * sb2 / (1.0 - b1 ** t), eps * sb2, 1.0 - lr * weight_decay)


def mask_runs(mask) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs where mask is nonzero."""
    m = np.asarray(mask if backend.on_host(mask) else mask.get()).astype(bool).view(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], m, [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def chunk_plan(size: int, chunk: int, runs) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, stop, decay runs inside it, relative to start) for each chunk of [0, size)."""
    out = []
    for i in range(0, size, chunk):
        j = min(i + chunk, size)
        out.append((i, j, [(max(a, i) - i, min(b, j) - i) for a, b in runs if a < j and b > i]))
    return out


def adamw_numpy(p, g, m, v, mask, c: AdamWCoefs, copy=None, *, plan=None, scratch=None) -> None:
    """Twin of adamw_f32 / adamw_f32_half / adamw_f32_bf16 / adamw_f32_bf16bits / adamw_f64: updates p, m, v in
    place with the kernel's operations in the kernel's order and writes the compute copy when given: float16
    (rounded to nearest), float32 holding the nearest bfloat16 values (precision.round_bf16_) or uint16 holding
    their bits (bf16_bits.to_bf16_bits). plan (chunk_plan of
    mask's runs) may replace mask; scratch is two vectors as long as the plan's longest chunk. Works on
    CuPy arrays too."""
    xp = backend.array_module(p)
    dt = p.dtype.type
    b1, c1, b2, c2, step, eps, keep = (dt(x) for x in c)      # each rounded once, as in the kernel
    if plan is None:
        plan = chunk_plan(p.size, CHUNK, mask_runs(mask))
    if scratch is None:
        k = max((j - i for i, j, _ in plan), default=0)
        scratch = (xp.empty(k, dtype=dt), xp.empty(k, dtype=dt))
    s1, s2 = scratch
    for i, j, runs in plan:
        gc, mc, vc, pc, a, b = g[i:j], m[i:j], v[i:j], p[i:j], s1[:j - i], s2[:j - i]
        xp.multiply(gc, c1, out=a)
        mc *= b1
        mc += a
        xp.multiply(gc, gc, out=b)
        b *= c2
        vc *= b2
        vc += b
        xp.sqrt(vc, out=b)
        b += eps
        xp.divide(mc, b, out=b)
        b *= step
        if keep != 1:                                         # decoupled decay of the old weights
            for ra, rb in runs:
                pc[ra:rb] *= keep
        pc -= b
        if copy is not None and copy.dtype == np.uint16:
            copy[i:j] = to_bf16_bits(xp, pc)
        elif copy is not None:
            copy[i:j] = pc
            if copy.dtype == np.float32:
                round_bf16_(xp, copy[i:j])


def adamw_cupy(p, g, m, v, mask, c: AdamWCoefs, copy=None) -> None:
    """Launch adamw_f32 / adamw_f32_half / adamw_f32_bf16 / adamw_f32_bf16bits / adamw_f64 on CuPy arrays (same
    contract as adamw_numpy)."""
    n = p.size
    for nm, a in (("g", g), ("m", m), ("v", v), ("mask", mask)) + ((("copy", copy),) if copy is not None else ()):
        if a.size != n or not a.flags.c_contiguous:
            raise ValueError(f"adamw: {nm} must be contiguous with {n} elements like p; got {a.shape}")
    if mask.dtype.itemsize != 1 or any(a.dtype != p.dtype for a in (g, m, v)):
        raise ValueError(f"adamw: p, g, m, v share one dtype and mask is bytes; got {p.dtype}, {g.dtype}, "
                         f"{m.dtype}, {v.dtype}, mask {mask.dtype}")
    copies = {None: "adamw_f32", np.dtype(np.float16): "adamw_f32_half", np.dtype(np.float32): "adamw_f32_bf16",
              np.dtype(np.uint16): "adamw_f32_bf16bits"}
    kind = None if copy is None else copy.dtype
    if p.dtype == np.float32 and kind in copies:
        entry, width = copies[kind], 4
    elif p.dtype == np.float64 and copy is None:
        entry, width = "adamw_f64", 2
    else:
        raise ValueError(f"adamw: no kernel for p.dtype = {p.dtype} (compute copy: {kind}); float32 (with no "
                         "copy, a float16 copy, a bfloat16-valued float32 copy or a uint16 copy of bfloat16 bits) "
                         "and float64 are supported")
    if n == 0:
        return
    args = (p, g, m, v, mask) + ((copy,) if copy is not None else ()) + (np.int64(n),)
    args += tuple(p.dtype.type(x) for x in c)                # RawKernel scalars must carry the C type
    function("adamw", entry)((blocks_for(-(-n // width)),), (THREADS,), args)


def adamw(p, g, m, v, mask, c: AdamWCoefs, copy=None) -> None:
    """The fused update on whichever device the arrays live."""
    (adamw_numpy if backend.on_host(p) else adamw_cupy)(p, g, m, v, mask, c, copy)


# ----------------------------------------------------------------------------- pack / unpack

def segment_starts(sizes) -> np.ndarray:
    """Where each segment begins in the packed message (exclusive prefix sum of sizes)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if sizes.size else sizes


def strided_segments(start: int, rows: int, cols: int, ld: int):
    """(offsets, sizes) of a rows x cols block at `start` of a row-major matrix with row stride ld."""
    return start + ld * np.arange(rows, dtype=np.int64), np.full(rows, cols, dtype=np.int64)


def _segments(buf, flat, offsets, sizes, what: str, dtypes=None):
    offsets, sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    if offsets.shape != sizes.shape or offsets.ndim != 1:
        raise ValueError(f"{what}: offsets and sizes must be 1-D of one length; got {offsets.shape}, {sizes.shape}")
    if sizes.size and (sizes.min() < 0 or offsets.min() < 0 or (offsets + sizes).max() > flat.size):
        raise ValueError(f"{what}: a segment falls outside the {flat.size}-element buffer")
    if int(sizes.sum()) > buf.size:
        raise ValueError(f"{what}: segments hold {int(sizes.sum())} elements; the message has {buf.size}")
    if dtypes is not None:
        if (buf.dtype, flat.dtype) != tuple(np.dtype(d) for d in dtypes) or buf.ndim != 1 or flat.ndim != 1:
            raise ValueError(f"{what}: a 1-D {np.dtype(dtypes[0])} message and a 1-D {np.dtype(dtypes[1])} buffer; got "
                             f"{buf.dtype} {buf.shape}, {flat.dtype} {flat.shape}")
    elif buf.dtype != flat.dtype or buf.ndim != 1 or flat.ndim != 1:
        raise ValueError(f"{what}: message and buffer must be 1-D of one dtype; got {buf.dtype}, {flat.dtype}")
    return offsets, segment_starts(sizes), sizes


def pack_numpy(buf, src, offsets, sizes):
    """Twin of pack_f32/pack_f64: buf[starts[k]:+sizes[k]] = src[offsets[k]:+sizes[k]]; returns buf."""
    for o, s, n in zip(*_segments(buf, src, offsets, sizes, "pack")):
        buf[s:s + n] = src[o:o + n]
    return buf


def unpack_numpy(buf, dst, offsets, sizes):
    """Twin of unpack_f32/unpack_f64: dst[offsets[k]:+sizes[k]] = buf[starts[k]:+sizes[k]]; returns dst."""
    for o, s, n in zip(*_segments(buf, dst, offsets, sizes, "unpack")):
        dst[o:o + n] = buf[s:s + n]
    return dst


BF16_PACK = (np.float32, np.uint16)        # pack_bf16: a float32 message from a buffer of bfloat16 bits


def pack_bf16_numpy(buf, src, offsets, sizes):
    """Twin of pack_bf16_f32: buf[starts[k]:+sizes[k]] = the float32 values of the bfloat16 bits
    src[offsets[k]:+sizes[k]] (exact); returns buf."""
    for o, s, n in zip(*_segments(buf, src, offsets, sizes, "pack_bf16", BF16_PACK)):
        buf[s:s + n] = from_bf16_bits(np, src[o:o + n])
    return buf


def _launch_copy(op: str, buf, flat, offsets, sizes):
    bits = op == "pack_bf16"
    offsets, starts, sizes = _segments(buf, flat, offsets, sizes, op, BF16_PACK if bits else None)
    if not (buf.flags.c_contiguous and flat.flags.c_contiguous):
        raise ValueError(f"{op}: message and buffer must be contiguous")
    if not sizes.size:
        return
    suffix = "f32" if bits else {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}.get(buf.dtype)
    if suffix is None:
        raise ValueError(f"{op}: no kernel for dtype {buf.dtype}; float32 and float64 are supported")
    cupy = backend.cupy_module()
    key = (offsets.tobytes(), sizes.tobytes(), cupy.cuda.Device().id)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 256:
            _TABLES.clear()
        table = _TABLES[key] = cupy.asarray(np.stack([offsets, starts, sizes]))
    nseg, width = sizes.size, 16 // buf.dtype.itemsize
    gy = min(nseg, 65535)
    gx = max(1, min(-(-int(sizes.max()) // (THREADS * width)), _max_blocks() // gy))
    args = (buf, flat, table[0], table[1], table[2], np.int32(nseg))
    function("pack", f"{op}_{suffix}")((gx, gy), (THREADS,), args)


def pack(buf, src, offsets, sizes):
    """Gather the segments of src into the contiguous message buf (kernel or twin); returns buf."""
    if backend.on_host(src):
        return pack_numpy(buf, src, offsets, sizes)
    _launch_copy("pack", buf, src, offsets, sizes)
    return buf


def pack_bf16(buf, src, offsets, sizes):
    """Gather the segments of src (bfloat16 bits, uint16) into the contiguous float32 message buf as their exact
    values (kernel or twin): one launch for many small tensors; returns buf."""
    if backend.on_host(src):
        return pack_bf16_numpy(buf, src, offsets, sizes)
    _launch_copy("pack_bf16", buf, src, offsets, sizes)
    return buf


def unpack(buf, dst, offsets, sizes):
    """Scatter the message buf back into the segments of dst (kernel or twin); returns dst."""
    if backend.on_host(dst):
        return unpack_numpy(buf, dst, offsets, sizes)
    _launch_copy("unpack", buf, dst, offsets, sizes)
    return dst
