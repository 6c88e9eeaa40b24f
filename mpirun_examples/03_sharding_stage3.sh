#!/usr/bin/env bash
# 03 - sharding stage 3 (configs/sharding_stage3.toml) on 4 ranks: parameters, gradients and AdamW
# state split by element count; each rank updates only the tensors it owns; a block's parameters are
# gathered just before it runs.
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 hpengine train configs/sharding_stage3.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/03_sharding_stage3" "$@"
