"""calibrate.physical_cores counts physical cores: hyperthreads of one core once, cores of different
sockets apart, only the CPUs the process may run on; with no core ids it falls back to the logical CPUs."""
import os
import shutil
import subprocess

import pytest

from hpengine.planner.calibrate import physical_cores


def fake_cpuinfo(sockets: int, cores: int, threads: int) -> str:
    """Linux's /proc/cpuinfo layout for a machine of sockets x cores x threads, numbered as Linux numbers
    them: every core's first thread, socket by socket, then the second threads, and so on. Core ids
    restart at 0 on every socket, so core ids alone do not tell cores apart."""
    blocks, cpu = [], 0
    for _thread in range(threads):
        for socket in range(sockets):
            for core in range(cores):
                blocks.append(f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\nmodel name\t: Fake CPU @ 2.00GHz\n"
                              f"physical id\t: {socket}\nsiblings\t: {cores * threads}\ncore id\t\t: {core}\n"
                              f"cpu cores\t: {cores}\napicid\t\t: {2 * cpu}\nflags\t\t: fpu sse2 avx2 ht\n")
                cpu += 1
    return "\n".join(blocks) + "\n"


@pytest.fixture
def two_by_two_by_two(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(fake_cpuinfo(2, 2, 2))
    return str(path)


def test_hyperthreads_count_once_and_sockets_apart(two_by_two_by_two):
    assert physical_cores(two_by_two_by_two, allowed=range(8)) == 4       # 2 sockets x 2 cores


def test_only_the_allowed_cpus(two_by_two_by_two):
    # cpu 0 and 4 are the two threads of socket 0's core 0; cpu 2 is socket 1's core 0
    assert physical_cores(two_by_two_by_two, allowed={0, 4}) == 1
    assert physical_cores(two_by_two_by_two, allowed={0, 2}) == 2
    assert physical_cores(two_by_two_by_two, allowed={0, 1, 4, 5}) == 2


def test_without_core_ids_the_logical_cpus(tmp_path):
    arm = tmp_path / "cpuinfo"                   # an ARM-style file: processors, no topology
    arm.write_text("".join(f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n\n" for i in range(4)))
    assert physical_cores(str(arm), allowed=range(4)) == 4
    assert physical_cores(str(tmp_path / "missing"), allowed={0, 1, 2}) == 3


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo") or shutil.which("lscpu") is None
                    or not hasattr(os, "sched_getaffinity"), reason="needs Linux's /proc/cpuinfo and lscpu")
def test_this_machine_agrees_with_lscpu():
    out = subprocess.run(["lscpu", "-p=cpu,core,socket"], capture_output=True, text=True, check=True).stdout
    mine = os.sched_getaffinity(0)
    rows = [ln.split(",") for ln in out.splitlines() if ln and not ln.startswith("#")]
    pairs = {(socket, core) for cpu, core, socket in rows if core and int(cpu) in mine}
    if not pairs:
        pytest.skip("lscpu gives no core ids here")
    assert physical_cores() == len(pairs)
