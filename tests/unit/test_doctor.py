"""`hpengine doctor`: on this GPU-less machine (MPI ok naming the library, the GPU checks skipped with the reason,
the kernels compiled where nvcc or NVRTC is found, exit status 0; under mpiexec -n 2 one report); each check's
verdicts (library names, NCCL versions, CUDA-aware answers, a broken kernel, no compiler); and the device branch
on the CuPy stand-in (emulated_cupy.py): device, NCCL, parity of every kernel file and speed lines, a kernel
that disagrees with its twin and a missing NCCL failing with exit status 1."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import emulated_cupy
import pytest
from mpi4py import MPI

from hpengine.cli.commands import main
from hpengine.device import backend, kernels
from hpengine.doctor import bandwidth, checks, parity
from hpengine.doctor.report import line, run_checks

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(\S.*?)\s+(ok|FAILED|skipped)\s{2,}(.*)$")
COMPILER = kernels.find_nvcc() or kernels.find_nvrtc()


def _lines(text: str) -> dict[str, tuple[str, str]]:
    return {m.group(1): (m.group(2), m.group(3)) for m in map(LINE.match, text.splitlines()) if m}


def _doctor(*args, launcher=()):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([*launcher, sys.executable, "-m", "hpengine", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280, check=False)


@pytest.mark.timeout(300)
def test_doctor_on_this_machine_without_a_gpu():
    if backend.cupy_usable():
        pytest.skip("this machine has a GPU: the device branch runs instead")
    p = _doctor("--kernels", "adamw,pack")
    assert p.returncode == 0, p.stdout + p.stderr
    got = _lines(p.stdout)
    assert list(got) == ["hpengine", "MPI", "CUDA-aware MPI", "CUDA device", "NCCL", "MPI device buffers",
                         "kernels compile", "kernel parity", "kernel speed"], p.stdout
    status, detail = got["MPI"]
    assert status == "ok" and checks.library_name(MPI.Get_library_version()) in detail and "1 rank" in detail
    assert got["CUDA-aware MPI"][0] in ("ok", "skipped")
    assert got["CUDA device"][0] == "skipped" and "pip install 'hpengine[gpu]'" in got["CUDA device"][1]
    assert got["MPI device buffers"] == ("skipped", "needs a CUDA device")
    for name in ("kernel parity", "kernel speed"):
        assert got[name][0] == "skipped" and got[name][1].startswith("no CUDA device: "), got[name]
    status, detail = got["kernels compile"]
    if COMPILER:
        assert status == "ok" and detail.startswith("adamw, pack for sm_90 with "), detail
    else:
        assert status == "skipped" and "neither nvcc nor NVRTC" in detail
    assert p.stdout.strip().splitlines()[-1].startswith("hpengine doctor: ") and " 0 failed" in p.stdout


@pytest.mark.timeout(120)
def test_doctor_under_mpiexec_reports_once():
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    p = _doctor("--kernels", "none", launcher=(mpiexec, "-n", "2"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("answered an allreduce") == 1 and "2 ranks on 1 node" in p.stdout
    assert _lines(p.stdout)["MPI device buffers"][0] == "skipped"
    assert _lines(p.stdout)["kernels compile"] == ("skipped", "--kernels named none")


def test_bad_arguments_name_what_is_valid(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--kernels", "adamw,nosuch"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "nosuch: not a kernel; valid: a comma-separated subset of adamw," in err
    with pytest.raises(SystemExit):
        main(["doctor", "--arch", "90"])
    assert "expected a CUDA architecture such as sm_80" in capsys.readouterr().err


# ------------------------------------------------------------------------------- single checks

@pytest.mark.parametrize("text,want", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25\n", "MPICH 5.0.2"),
    ("Open MPI v5.0.3, package: Open MPI builder Distribution, ident: 5.0.3\n", "Open MPI v5.0.3"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", "Intel(R) MPI Library 2021.10 for Linux* OS"),
    ("MVAPICH2 Version      :\t2.3.7\n", "MVAPICH2 2.3.7"),
    ("", "unknown"),
])
def test_library_names(text, want):
    assert checks.library_name(text) == want


def test_nccl_versions():
    assert checks.nccl_version(22703) == "2.27.3" and checks.nccl_version(2708) == "2.7.8"


@pytest.mark.parametrize("answer,status,words", [
    ((True, "MPIX_Query_cuda_support()"), "ok", "yes (MPIX_Query_cuda_support() says so)"),
    ((False, "MPIX_Query_cuda_support()"), "ok", "no (MPIX_Query_cuda_support() = 0): device buffers go through"),
    ((None, "the library offers neither"), "skipped", "cannot be asked: the library offers neither"),
])
def test_cuda_aware_answers(monkeypatch, answer, status, words):
    monkeypatch.setattr(checks, "cuda_support", lambda: answer)
    c = checks.cuda_aware()
    assert c.status == status and c.detail.startswith(words), c


def test_cuda_support_asks_this_library():
    says, how = checks.cuda_support()
    assert says in (True, False, None) and how


def test_no_compiler_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernels, "find_nvcc", lambda: None)
    monkeypatch.setattr(kernels, "find_nvrtc", lambda: None)
    c = checks.kernels_compile(("adamw",), "sm_90")
    assert c.status == "skipped" and "neither nvcc nor NVRTC found" in c.detail


@pytest.mark.timeout(120)
@pytest.mark.skipif(COMPILER is None, reason="neither nvcc nor NVRTC found")
def test_a_broken_kernel_fails_at_its_cu_line(tmp_path, monkeypatch):
    for cu in kernels.source_path("adamw").parent.glob("*.cu"):
        shutil.copy(cu, tmp_path)
    (tmp_path / "adamw.cu").write_text('extern "C" __global__ void adamw_f32(float* p) {\n  p[0] = missing;\n}\n')
    monkeypatch.setenv("HPENGINE_KERNELS", str(tmp_path))
    c = checks.kernels_compile(("adamw", "pack"), "sm_90")
    assert c.failed and c.detail.startswith("1 of 2 failed for sm_90") and "adamw.cu" in c.detail
    assert "missing" in c.detail and "pack:" not in c.detail


def test_missing_kernel_sources_fail_the_installation_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HPENGINE_KERNELS", str(tmp_path))
    monkeypatch.setattr(kernels, "_HERE", tmp_path)                  # nor the package's, nor the checkout's
    c = checks.installation()
    assert c.failed and "adamw.cu not found" in c.detail and "HPENGINE_KERNELS" in c.detail


# ------------------------------------------------------------------------- the device branch

@pytest.fixture
def device(monkeypatch):
    """The CuPy stand-in as the device, NCCL 2.27.3, parity at small sizes, speed judged against 0."""
    mod = emulated_cupy.install(monkeypatch)
    monkeypatch.setattr(backend, "nccl_module", lambda: types.SimpleNamespace(get_version=lambda: 22703))
    monkeypatch.setattr(parity, "ADAMW_SIZES", ((5, 0), (4099, 1)))
    monkeypatch.setattr(bandwidth, "TARGET", 0.0)
    return mod


@pytest.mark.timeout(300)
def test_the_device_branch_on_the_stand_in(device, capsys):
    rc = main(["doctor", "--kernels", "none", "--speed-params", "4096"])
    out = capsys.readouterr().out
    got = _lines(out)
    assert rc == 0, out
    assert got["CUDA device"][0] == "ok" and "CuPy stand-in (sm_90)" in got["CUDA device"][1]
    assert got["NCCL"] == ("ok", "cupy.cuda.nccl, NCCL 2.27.3: runtime.collectives = 'nccl' can use it")
    assert got["MPI device buffers"][0] == "skipped" and got["MPI device buffers"][1].startswith("one rank: ")
    names = [n for n in got if n.startswith(("parity", "speed"))]
    assert names == ["parity: adamw.cu", "parity: pack.cu", "parity: fused.cu", "parity: attention.cu",
                     "speed: adamw kernel", "speed: pack kernel"], out
    assert all(got[n][0] == "ok" for n in names), out
    assert got["parity: adamw.cu"][1].startswith("bit for bit")
    assert "of a copy's" in got["speed: adamw kernel"][1] and "unpack" in got["speed: pack kernel"][1]
    assert {"adamw_f32", "pack_f32", "layernorm_fwd_f64", "flash_fwd_f32"} <= set(device.launches)
    assert out.strip().splitlines()[-1] == "hpengine doctor: 11 ok, 0 failed, 2 skipped"


def test_a_kernel_that_disagrees_with_its_twin_fails(device, monkeypatch):
    twin = kernels.pack_numpy

    def off_by_one(buf, src, offsets, sizes):
        twin(buf, src, offsets, sizes)
        buf[0] += 1
        return buf
    monkeypatch.setattr(kernels, "pack_numpy", off_by_one)
    c = next(c for c in parity.run(device) if c.name == "parity: pack.cu")
    assert c.failed and c.detail.startswith("pack float32: ") and "differ from the NumPy twin's" in c.detail


def test_slow_kernels_and_missing_nccl_fail_with_exit_status_1(device, monkeypatch, capsys):
    def no_nccl():
        raise backend.BackendError("CuPy found no NCCL library (libnccl.so.2); pip install nvidia-nccl-cu13")
    monkeypatch.setattr(backend, "nccl_module", no_nccl)
    monkeypatch.setattr(bandwidth, "TARGET", 1e9)
    monkeypatch.setattr(parity, "CASES", ())
    assert main(["doctor", "--kernels", "none", "--speed-params", "4k"]) == 1
    got = _lines(capsys.readouterr().out)
    assert got["NCCL"][0] == "FAILED" and "falls back to MPI" in got["NCCL"][1]
    assert got["speed: adamw kernel"][0] == "FAILED" and "target >= 100000000000%" in got["speed: adamw kernel"][1]


def test_a_device_cupy_cannot_see_is_skipped(monkeypatch):
    mod = emulated_cupy.install(monkeypatch)
    mod.cuda.runtime.getDeviceCount = lambda: 0
    dev, cp = checks.device()
    assert cp is None and dev.status == "skipped" and "sees no CUDA device" in dev.detail
    got = [line(c) for c in run_checks(MPI.COMM_SELF, ())]
    assert any(s.startswith("kernel parity") and "no CUDA device: CuPy" in s for s in got), got
