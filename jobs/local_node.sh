#!/bin/sh
# An ssh stand-in that lets one machine play several nodes (as root): it runs the command an MPI
# launcher would run on HOST through ssh, here, in a new UTS namespace whose hostname is HOST. The ranks
# a launcher starts through it see HOST as their node's name (socket.gethostname, MPI_Get_processor_name),
# and MPI counts one node per host name, so node-local decisions (local rank, ranks per node) can be
# tried without a cluster. Filesystem, network and memory stay the machine's.
#
#   Hydra:    mpiexec -hosts nodeA:2,nodeB:2 -launcher ssh -launcher-exec jobs/local_node.sh hpengine train ...
#   Open MPI: mpirun --host nodeA:2,nodeB:2 --mca plm_rsh_agent jobs/local_node.sh hpengine train ...
#
# Called as ssh is: local_node.sh [ssh options] HOST COMMAND...; the options (Hydra passes -x) are
# ignored, and, as ssh does, COMMAND's words are joined with spaces and run by sh. Needs root (unshare
# --uts); docs/cluster.md "Two nodes on one machine" shows what to look at.
set -eu

die() {
  echo "local_node.sh: error: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case $1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;    # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || die "usage: local_node.sh [ssh options] HOST COMMAND... (got ${#} argument(s) after the options)"
host=$1
shift
case $host in
  '' | -* | *[!A-Za-z0-9.-]*) die "host '$host' is not a host name (letters, digits, '.', '-')" ;;
esac
[ "$(id -u)" = 0 ] || die "needs root to set a host name in a new UTS namespace (unshare --uts); run as root"
command -v unshare >/dev/null || die "unshare not found (util-linux)"

# unshare without --fork execs in place: the launcher's child stays the process that becomes its proxy
# shellcheck disable=SC2016  # $1 and $2 are expanded by the inner sh
exec unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' local_node.sh "$host" "$*"
