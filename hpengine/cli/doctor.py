"""`hpengine doctor`: its arguments, and the lines rank 0 prints, one per check (ok, FAILED, or skipped and why),
then a count. Exit status 0 when no check failed, else 1, on every rank (`mpiexec -n N hpengine doctor` checks
that all N ranks reach each other).
"""
from __future__ import annotations

import argparse
import re
import sys

from mpi4py import MPI

from hpengine.doctor import line, run_checks, summary
from hpengine.doctor.checks import ALL_KERNELS
from hpengine.doctor.speed import DEFAULT_PARAMS


def _kernel_list(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in ALL_KERNELS]
    if bad:
        raise argparse.ArgumentTypeError(f"{','.join(bad)}: not a kernel; valid: a comma-separated subset of "
                                         f"{','.join(ALL_KERNELS)}, or 'none'")
    return items


def _kernels(text: str) -> tuple[str, ...]:
    return () if text.strip() == "none" else _kernel_list(text)


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}a?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a CUDA architecture such as sm_80 or sm_90")
    return text


def _count(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count of at least 1024 such as 4096, 64k, 64M or 1G")
    n = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    if n < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1024 parameters are needed")
    return n


def doctor_parser(sub) -> None:
    d = sub.add_parser("doctor", help="check the installation: MPI, CUDA-aware MPI, NCCL, the CUDA kernels; on a "
                       "GPU, the kernels against their NumPy twins and their speed",
                       description="One line per check: ok, FAILED, or skipped and why. Exit status 0 when "
                       "nothing failed, else 1. Under mpiexec every rank joins the MPI checks and rank 0 reports.")
    d.add_argument("--kernels", type=_kernels, default=ALL_KERNELS, metavar="LIST",
                   help=f"kernel files to compile (default all: {','.join(ALL_KERNELS)}; 'none' skips compiling)")
    d.add_argument("--arch", type=_arch, default=None,
                   help="architecture to compile for (default: the device's; without one sm_90)")
    d.add_argument("--speed-params", type=_count, default=DEFAULT_PARAMS, metavar="N",
                   help=f"AdamW parameters the speed check times on a GPU (default {DEFAULT_PARAMS >> 20}M)")


def cmd_doctor(a) -> int:
    world = MPI.COMM_WORLD
    done = []
    for c in run_checks(world, a.kernels, a.arch, a.speed_params):
        done.append(c)
        print(line(c), flush=True)
    failed = any(c.failed for c in done)
    if world.Get_rank() == 0:
        print(summary(done), flush=True)
    sys.stdout.flush()
    return world.bcast(1 if failed else 0, root=0)
