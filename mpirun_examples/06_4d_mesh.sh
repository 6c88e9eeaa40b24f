#!/usr/bin/env bash
# 06 - every axis at once on 8 ranks (configs/hybrid_4d.toml): tp=2 (innermost) x sharding=2 (stage 2)
# x pp=2 (1F1B), with recompute and gradient merge. Add data parallel with mpiexec -n 16 and
# --set strategy.data_parallel.enable=true (degree -1 = the ranks left over).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 8 hpengine train configs/hybrid_4d.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/06_4d_mesh" "$@"
