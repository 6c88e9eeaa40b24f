#!/usr/bin/env bash
# 05 - tensor parallel (configs/tensor_parallel.toml): every weight matrix split over tp=2 ranks
# (Megatron column/row pairs, vocab-parallel embedding and loss), data parallel over the other 2.
set -euo pipefail
cd "$(dirname "$0")/.."                                       # repository root
if [ -x .venv/bin/mpiexec ]; then PATH="$PWD/.venv/bin:$PATH"; fi   # the MPICH that mpi4py is built on
OUT=${OUT:-runs/examples-$(date +%Y%m%d-%H%M%S)}              # run folders go under here

mpiexec -n 4 hpengine train configs/tensor_parallel.toml \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/05_tensor_parallel" "$@"
