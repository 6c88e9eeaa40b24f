#!/usr/bin/env bash
# 00 - mesh hello: 4 ranks on a tp=2 x dp=2 mesh; every rank reports its coordinates and the
# world ranks of its tp and dp groups (what hpengine.dist.topology.Mesh builds with Comm.Split).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 python mpirun_examples/00_mesh_hello.py "$@"
