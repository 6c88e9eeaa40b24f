#!/usr/bin/env bash
# 00 - mesh hello: 4 ranks on a tp=2 x dp=2 mesh; every rank reports its coordinates and the
# world ranks of its tp and dp groups (what hpengine.topology.Mesh builds with Comm.Split).
set -euo pipefail
cd "$(dirname "$0")/.."                                       # repository root
if [ -x .venv/bin/mpiexec ]; then PATH="$PWD/.venv/bin:$PATH"; fi   # the MPICH that mpi4py is built on

mpiexec -n 4 python mpirun_examples/00_mesh_hello.py "$@"
