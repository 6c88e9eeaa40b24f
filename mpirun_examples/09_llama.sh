#!/usr/bin/env bash
# 09 - the Llama model kind (configs/llama_small.toml: RMSNorm, SwiGLU, rotary embedding, 8 query heads
# sharing 2 key/value heads) on 4 ranks: tp=2 (each rank 4 query heads and 1 key/value head) x dp=2.
# configs/llama_hybrid_4d.toml puts every axis on 8 ranks at once.
set -euo pipefail
source "$(dirname "$0")/_env.sh"                             # repo root, venv MPICH on PATH, $OUT

mpiexec -n 4 hpengine train configs/llama_small.toml \
  --set strategy.tensor_parallel.enable=true --set strategy.tensor_parallel.degree=2 \
  --set strategy.data_parallel.enable=true \
  --set model.d_model=64 --set model.seq_len=32 --set optim.warmup_steps=5 \
  --set train.steps=20 --set train.eval_every=20 --set train.out_dir="$OUT/09_llama" "$@"
