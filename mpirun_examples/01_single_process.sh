#!/usr/bin/env bash
# 01 - single process: the reference run every parallel layout reproduces (docs/architecture.md, the equivalence contract): the
# loss column of 02-06 matches this one. Extra arguments go to hpengine (e.g. --set data.path=my.h5).
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 1 hpengine train configs/default.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set strategy.data_parallel.enable=false --set strategy.sharding.enable=false \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/01_single_process" "$@"
