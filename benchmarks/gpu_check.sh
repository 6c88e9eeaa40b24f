#!/usr/bin/env bash
# GPU check of hpengine, for one GPU machine without network access: the GPU tests, the
# AdamW and pack kernels' bandwidth against a device-to-device copy, the planner's GPU calibration, tokens/s of the reference GPT and of a
# GPT-2-small-sized model next to PyTorch eager, and a 2-rank host-staged run on the one GPU. Prints a
# table last; with $OUT set, writes gpu_check.json, gpu_check.md and gpu_check.log there. Under 8 minutes:
# setup <= ~30 s, then the parts inside a 440 s deadline, each with its own limit (benchmarks/gpu_check.py).
#
# Device tool invocation (nvidia-h200; the MPICH wheel travels in the git-ignored folder benchmarks/wheels):
#   run  command:   bash benchmarks/gpu_check.sh
#        timeout_s: 540
#        carry:     ["benchmarks/wheels"]
# Prepare benchmarks/wheels here once (13 MB, kept out of git). The H200 image lists mpi4py, but nobody has
# seen an MPI library or mpiexec there, so the wheel is shipped and installed only when MPI does not work:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d benchmarks/wheels mpich==5.0.2
#   grep -qx '/benchmarks/wheels/' .git/info/exclude || echo /benchmarks/wheels/ >> .git/info/exclude
#
# Here, without a GPU:  bash benchmarks/gpu_check.sh --cpu-smoke    (NumPy stand-ins, tiny sizes, ~30 s)
# Other arguments go to gpu_check.py, e.g. --parts bandwidth,dp2 or --torch-attn explicit.
#
# Environment: PYTHON (interpreter; default .venv/bin/python when present, else python3), MPIEXEC,
# GPU_CHECK_WHEELS (folder holding mpich-*.whl), HPENGINE_MPICH_PREFIX (where to install that wheel when the
# interpreter's own folders are read-only; default a new folder from mktemp -d), TORCH_PYTHON (interpreter
# with torch), OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
SMOKE=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && SMOKE=1; done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python
else PY=$(command -v python3); fi
# the repository on the path: no install needed (kernels are found in the checkout's kernels/)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
say() { echo "gpu_check.sh: $*"; }
START=$(date +%s)

# the folder where pip puts a wheel's data files (bin/mpiexec, lib/libmpi.so.12) for this interpreter
DATA=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("data"))' 2>/dev/null)

mpi_import() { "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>&1; }
pick_mpiexec() {
  if [ -n "${MPIEXEC:-}" ]; then echo "$MPIEXEC"
  elif [ -x "$DATA/bin/mpiexec" ]; then echo "$DATA/bin/mpiexec"
  elif [ -x "$(dirname "$PY")/mpiexec" ]; then echo "$(dirname "$PY")/mpiexec"
  else command -v mpiexec; fi
}
world2() {   # 2 ranks under mpiexec $1 (with the environment words after it) see one world of 2
  local mpx=$1; shift
  env "$@" timeout 30 "$mpx" -n 2 "$PY" -c 'from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier(); assert c.Get_size() == 2, c.Get_size()' >/dev/null 2>&1
}
mpi_world2() {   # as world2, trying MPICH's other network modules when the default one fails; exports the one that works
  local opts
  for opts in "" "MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp" "MPICH_CH4_NETMOD=ucx" "MPICH_CH4_NETMOD=ofi FI_PROVIDER=shm"; do
    # shellcheck disable=SC2086
    if world2 "$1" $opts; then
      [ -n "$opts" ] && { say "MPI works with $opts"; export $opts; }
      return 0
    fi
  done
  return 1
}
install_mpich() {
  local dir whl=""
  for dir in ${GPU_CHECK_WHEELS:-} "$ROOT/benchmarks/wheels" "$ROOT/.whl"; do
    ls "$dir"/mpich-*.whl >/dev/null 2>&1 && { whl=$dir; break; }
  done
  if [ -z "$whl" ]; then
    say "no mpich-*.whl in \$GPU_CHECK_WHEELS, benchmarks/wheels or .whl: carry benchmarks/wheels (see the top of this file)"
    return 1
  fi
  say "installing MPICH from $whl (no network)"
  if "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --find-links "$whl" mpich; then
    hash -r; return 0
  fi
  local prefix=${HPENGINE_MPICH_PREFIX:-}
  if [ -z "$prefix" ]; then
    prefix=$(mktemp -d) || { say "cannot install into $DATA and mktemp -d failed: set HPENGINE_MPICH_PREFIX"; return 1; }
  fi
  say "cannot install into $DATA; installing under $prefix (HPENGINE_MPICH_PREFIX)"
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --prefix "$prefix" --find-links "$whl" mpich || return 1
  export PATH=$prefix/bin:$PATH
  export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export MPI4PY_LIBMPI=$prefix/lib/libmpi.so.12
  export MPIEXEC=$prefix/bin/mpiexec
  hash -r
}

say "python $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | head -4
LIB=$(mpi_import); LIBOK=$?; MPX=$(pick_mpiexec)
if [ -n "$MPX" ] && [ "$LIBOK" = 0 ] && mpi_world2 "$MPX"; then
  say "MPI: $LIB; mpiexec $MPX"
elif [ "$SMOKE" = 1 ]; then
  say "MPI not usable here (mpi4py: ${LIB##*$'\n'}; mpiexec: ${MPX:-none}); the smoke run skips the 2-rank part"
  MPX=""
else
  say "MPI not usable as found (mpi4py: ${LIB##*$'\n'}; mpiexec: ${MPX:-none})"
  if install_mpich; then
    LIB=$(mpi_import); LIBOK=$?; MPX=$(pick_mpiexec)
    if [ -n "$MPX" ] && [ "$LIBOK" = 0 ] && mpi_world2 "$MPX"; then
      say "MPI: $LIB; mpiexec $MPX"
    else
      say "MPI still not usable after installing the wheel (mpi4py: ${LIB##*$'\n'}; mpiexec: ${MPX:-none})"
      MPX=""
    fi
  else
    MPX=""
  fi
fi
say "setup took $(( $(date +%s) - START )) s"

# the backstop: gpu_check.py keeps its own 440 s deadline and prints the table even when stopped
timeout -k 10 470 "$PY" benchmarks/gpu_check.py --mpiexec "$MPX" "$@"
exit $?
