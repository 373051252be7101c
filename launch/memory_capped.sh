#!/usr/bin/env bash
# Runs a command in a memory cgroup of at most LIMIT_GB GiB (page cache included), then
# prints whether the kernel killed it for memory and the cgroup's peak usage.
#
#   sudo bash launch/memory_capped.sh 4 python launch/client_state_memory.py --store=disk ...
#
# For measuring what a run needs against a host smaller than its data (this machine's
# 23 GB cannot be shrunk otherwise): Linux, root, cgroup v1 (memory.limit_in_bytes) or
# v2 (memory.max). The cgroup is made under this shell's own and removed after.
set -u
if (($# < 2)); then
  echo "usage: memory_capped.sh LIMIT_GB COMMAND [ARGS...]" >&2
  exit 2
fi
LIMIT_GB=$1
shift
if ! [[ $LIMIT_GB =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  echo "memory_capped.sh: LIMIT_GB=$LIMIT_GB; expected a number of GiB, e.g. 4" >&2
  exit 2
fi
BYTES=$(awk -v g="$LIMIT_GB" 'BEGIN { printf "%.0f", g * 1073741824 }')
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # v2: one tree
  PARENT=/sys/fs/cgroup$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)
  LIMIT_FILE=memory.max PEAK_FILE=memory.peak EVENTS="grep -w oom_kill memory.events"
else  # v1: the memory controller's own tree
  PARENT=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" { print $3 }' /proc/self/cgroup)
  LIMIT_FILE=memory.limit_in_bytes PEAK_FILE=memory.max_usage_in_bytes
  EVENTS="grep -w oom_kill memory.oom_control"
fi
GROUP=$PARENT/flowjax_capped_$$
if ! mkdir "$GROUP" 2>/dev/null; then
  echo "memory_capped.sh: cannot make a cgroup in $PARENT; expected root and cgroup memory control" >&2
  exit 2
fi
trap 'rmdir "$GROUP" 2>/dev/null' EXIT
echo "$BYTES" >"$GROUP/$LIMIT_FILE"
# The command runs in a child shell moved into the cgroup; this shell stays out of it.
bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' capped "$GROUP" "$@"
RC=$?
cd "$GROUP" || exit "$RC"
gib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1073741824 }'; }
# The cap as the kernel holds it (it may round), not as asked.
echo "memory_capped.sh: exit status $RC under a cap of $(gib "$(cat "$LIMIT_FILE")") GiB; peak usage $(gib "$(cat "$PEAK_FILE")") GiB (page cache included); $($EVENTS 2>/dev/null || echo 'oom_kill not reported')"
exit "$RC"
