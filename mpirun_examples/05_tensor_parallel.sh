#!/usr/bin/env bash
# 05 - tensor parallel (configs/tensor_parallel.toml): every weight matrix split over tp=2 ranks
# (Megatron column/row pairs, vocab-parallel embedding and loss), data parallel over the other 2.
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 hpengine train configs/tensor_parallel.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/05_tensor_parallel" "$@"
