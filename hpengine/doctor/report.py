"""The order `hpengine doctor` runs its checks in, and their lines: the installation first, then (on a device)
parity and speed. Under several ranks every rank joins the MPI checks (ranks.py too); rank 0 runs the rest. Lines are
returned, not printed: the command line prints them.
"""
from __future__ import annotations

from hpengine.doctor import checks, parity, ranks, speed
from hpengine.doctor.checks import FAILED, OK, SKIPPED, Check

NAME_WIDTH = 20


def run_checks(world, kernel_names=checks.ALL_KERNELS, arch: str | None = None,
               speed_params: int = speed.DEFAULT_PARAMS):
    """The checks as they finish (a generator): every rank joins the MPI check, rank 0 alone yields."""
    reached = checks.mpi(world)
    moved = ranks.device_allreduce(world) if not reached.failed else None
    if world.Get_rank() != 0:
        return
    yield checks.installation()
    yield reached
    yield checks.cuda_aware()
    dev, cp = checks.device()
    yield dev
    yield checks.nccl()
    if moved is not None:
        yield moved
    if kernel_names:
        yield checks.kernels_compile(kernel_names, arch or (checks.device_arch(cp) if cp is not None
                                                            else checks.DEFAULT_ARCH))
    else:
        yield Check("kernels compile", SKIPPED, "--kernels named none")
    if cp is None:
        why = dev.detail.split(": pip install")[0]
        yield Check("kernel parity", SKIPPED, f"no CUDA device: {why}")
        yield Check("kernel speed", SKIPPED, f"no CUDA device: {why}")
        return
    yield from parity.run(cp)
    yield from speed.run(cp, speed_params)


def line(c: Check) -> str:
    """'NAME   STATUS   detail', names and statuses padded so the details line up."""
    return f"{c.name:<{NAME_WIDTH}} {c.status:<7}  {c.detail}"


def summary(done: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in done) for s in (OK, FAILED, SKIPPED)}
    return f"hpengine doctor: {counts[OK]} ok, {counts[FAILED]} failed, {counts[SKIPPED]} skipped"
