#!/usr/bin/env bash
# 07 - two models in one job (configs/two_models.toml, seed claim 6): both share one sharding partition
# and one set of collectives; each trains exactly as it would alone. metrics.jsonl has one line per
# model per step (a "model" field).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 2 hpengine train configs/two_models.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/07_two_models_one_partition" "$@"
