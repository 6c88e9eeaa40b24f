#!/usr/bin/env bash
# GPU check of hpengine, for one GPU machine without network access, most important figures first: the GPU
# tests; tokens/s, MFU and peak device memory of a 1.07 B-parameter llama and of GPT-2 small under bf16 amp
# next to PyTorch (autocast bf16, sdpa attention) eager and under torch.compile; hpengine's flash attention
# kernels against torch's sdpa flash kernel; the AdamW and pack kernels' bandwidth against a device copy;
# 2 ranks on the GPU (staged MPI equal to 1 rank, then runtime.collectives mpi against nccl); hpengine doctor;
# the planner's GPU calibration if time is left. Each part's rows are printed when it finishes, the whole
# table last; with $OUT set, gpu_check.json, gpu_check.md and gpu_check.log are (re)written there after every
# part.
# Under 10 minutes in all: the parts get what GPU_CHECK_TOTAL_S (570 s) leaves after the setup, less 30 s
# for the backstop (benchmarks/gpu_check.py keeps that deadline and gives each part its own limit).
#
# Device tool invocation (nvidia-h200; the MPICH wheel travels in the git-ignored folder benchmarks/wheels):
#   run  command:   bash benchmarks/gpu_check.sh
#        timeout_s: 600
#        carry:     ["benchmarks/wheels"]
# Prepare benchmarks/wheels here once (13 MB, kept out of git). The H200 image lists mpi4py, but nobody has
# seen an MPI library or mpiexec there, so the wheel is shipped and installed only when MPI does not work:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d benchmarks/wheels mpich==5.0.2
#   grep -qx '/benchmarks/wheels/' .git/info/exclude || echo /benchmarks/wheels/ >> .git/info/exclude
#
# Here, without a GPU:  bash benchmarks/gpu_check.sh --cpu-smoke    (NumPy stand-ins, tiny sizes, ~1 min)
# Other arguments go to gpu_check.py, e.g. --parts llama,attention, --no-compile or --deadline-s 300.
#
# Environment: PYTHON (interpreter; default .venv/bin/python when present, else python3), MPIEXEC,
# GPU_CHECK_TOTAL_S (the whole run's seconds, setup included; default 570),
# GPU_CHECK_WHEELS (folder holding mpich-*.whl), HPENGINE_MPICH_PREFIX (where to install that wheel when the
# interpreter's own folders are read-only; default a new folder from mktemp -d), TORCH_PYTHON (interpreter
# with torch), OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
SMOKE=0
GIVEN_DEADLINE=""
prev=""
for arg in "$@"; do
  [ "$arg" = "--cpu-smoke" ] && SMOKE=1
  case "$arg" in --deadline-s=*) GIVEN_DEADLINE=${arg#*=} ;; esac
  [ "$prev" = "--deadline-s" ] && GIVEN_DEADLINE=$arg
  prev=$arg
done
TOTAL_S=${GPU_CHECK_TOTAL_S:-570}
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

# the parts' deadline: the one given, the smoke run's default, or what the total leaves after the setup;
# the backstop timeout lands 20 s after it (the table is printed even when gpu_check.py is stopped)
DEADLINE_ARGS=()
case "$GIVEN_DEADLINE" in
  "") if [ "$SMOKE" = 1 ]; then DEADLINE=240
      else
        DEADLINE=$(( TOTAL_S - ($(date +%s) - START) - 30 ))
        [ "$DEADLINE" -lt 60 ] && DEADLINE=60
        DEADLINE_ARGS=(--deadline-s "$DEADLINE")
        say "parts deadline ${DEADLINE} s (GPU_CHECK_TOTAL_S ${TOTAL_S} s less the setup and 30 s)"
      fi ;;
  *[!0-9.]*|.*) DEADLINE=$TOTAL_S ;;                 # gpu_check.py refuses it with the reason
  *) DEADLINE=${GIVEN_DEADLINE%.*} ;;
esac
timeout -k 10 $(( DEADLINE + 20 )) "$PY" benchmarks/gpu_check.py --mpiexec "$MPX" ${DEADLINE_ARGS[@]+"${DEADLINE_ARGS[@]}"} "$@"
exit $?
