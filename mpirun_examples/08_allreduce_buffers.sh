#!/usr/bin/env bash
# 08 - all-reduce on NumPy and CuPy buffers: NumPy arrays go straight to MPI; CuPy arrays go
# straight too with a CUDA-aware MPI, else through a pinned host mirror (hpengine.backend staging).
set -euo pipefail
cd "$(dirname "$0")/.."                                       # repository root
if [ -x .venv/bin/mpiexec ]; then PATH="$PWD/.venv/bin:$PATH"; fi   # the MPICH that mpi4py is built on

mpiexec -n 2 python mpirun_examples/08_allreduce_buffers.py "$@"
