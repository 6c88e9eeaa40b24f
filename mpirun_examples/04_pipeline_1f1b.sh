#!/usr/bin/env bash
# 04 - pipeline, 1F1B schedule (configs/pipeline_1f1b.toml): 4 stages of one block each, 8 micro-batches
# per step; the log gives the measured bubble per stage next to the theory (p-1)/(m+p-1).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 hpengine train configs/pipeline_1f1b.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/04_pipeline_1f1b" "$@"
