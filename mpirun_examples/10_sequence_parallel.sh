#!/usr/bin/env bash
# 10 - sequence parallel: tp=4 over all 4 ranks with the norms, residuals and their caches split along the
# sequence (configs/tensor_parallel.toml plus strategy.tensor_parallel.sequence_parallel); the same run as 01-05.
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 hpengine train configs/tensor_parallel.toml \
  --set strategy.tensor_parallel.degree=4 --set strategy.tensor_parallel.sequence_parallel=true \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/10_sequence_parallel" "$@"
