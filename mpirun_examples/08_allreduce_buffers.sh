#!/usr/bin/env bash
# 08 - all-reduce on NumPy and CuPy buffers: NumPy arrays go straight to MPI; CuPy arrays go
# straight too with a CUDA-aware MPI, else through a pinned host mirror (hpengine.device.backend staging).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 2 python mpirun_examples/08_allreduce_buffers.py "$@"
