# Sourced by every example: run from the repository root with the MPICH that mpi4py is built on first on
# PATH, and put run folders under $OUT.
# No thread variables are needed: every rank sizes its BLAS pool to its cores / the ranks on the node
# (logged as "BLAS threads per rank"); export OMP_NUM_THREADS or pass --set runtime.blas_threads=N to override.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/mpiexec ]; then PATH="$PWD/.venv/bin:$PATH"; fi
OUT=${OUT:-runs/examples-$(date +%Y%m%d-%H%M%S)}
