#!/usr/bin/env bash
# 02 - data parallel (configs/data_parallel.toml): 2 full replicas, each on half of every global
# batch; gradients averaged by a bucketed all-reduce that overlaps backward.
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 2 hpengine train configs/data_parallel.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/02_data_parallel" "$@"
