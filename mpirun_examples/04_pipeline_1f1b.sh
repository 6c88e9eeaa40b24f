#!/usr/bin/env bash
# 04 - pipeline, 1F1B schedule (configs/pipeline_1f1b.toml): 4 stages of one block each, 8 micro-batches
# per step; the log gives the measured bubble per stage next to the theory (p-1)/(m+p-1).
set -euo pipefail
cd "$(dirname "$0")/.."                                       # repository root
if [ -x .venv/bin/mpiexec ]; then PATH="$PWD/.venv/bin:$PATH"; fi   # the MPICH that mpi4py is built on
OUT=${OUT:-runs/examples-$(date +%Y%m%d-%H%M%S)}              # run folders go under here

mpiexec -n 4 hpengine train configs/pipeline_1f1b.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/04_pipeline_1f1b" "$@"
