#!/usr/bin/env bash
# Runs a command in a memory cgroup of at most LIMIT_GB GiB (page cache included, swap
# excluded), then prints whether the kernel killed it for memory and the cgroup's peak.
#
#   sudo bash launch/memory_capped.sh 4 python launch/client_state_memory.py --store=disk ...
#
# For measuring what a run needs against a host smaller than its data (this machine's
# 23 GB cannot be shrunk otherwise): Linux, root, cgroup v1 (memory.limit_in_bytes) or
# v2 (memory.max, with the memory controller enabled for this shell's cgroup's children).
# The cgroup is made under this shell's own and removed after; Ctrl-C or SIGTERM is
# passed on to the command, which is then waited for.
set -u
fail() { echo "memory_capped.sh: $*" >&2; exit 2; }
(($# >= 2)) || fail "usage: memory_capped.sh LIMIT_GB COMMAND [ARGS...]"
LIMIT_GB=$1
shift
[[ $LIMIT_GB =~ ^[0-9]+([.][0-9]+)?$ ]] || fail "LIMIT_GB=$LIMIT_GB; expected a number of GiB, e.g. 4"
BYTES=$(awk -v g="$LIMIT_GB" 'BEGIN { printf "%.0f", g * 1073741824 }')
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # v2: one tree
  PARENT=/sys/fs/cgroup$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)
  LIMIT_FILE=memory.max PEAK_FILE=memory.peak SWAP_FILE=memory.swap.max SWAP_VALUE=0
  EVENTS="grep -w oom_kill memory.events"
else  # v1: the memory controller's own tree
  PARENT=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" { print $3 }' /proc/self/cgroup)
  LIMIT_FILE=memory.limit_in_bytes PEAK_FILE=memory.max_usage_in_bytes
  SWAP_FILE=memory.memsw.limit_in_bytes SWAP_VALUE=$BYTES  # memory + swap: no swap
  EVENTS="grep -w oom_kill memory.oom_control"
fi
GROUP=$PARENT/flowjax_capped_$$
mkdir "$GROUP" 2>/dev/null || fail "cannot make a cgroup in $PARENT; expected root and cgroup memory control"
CHILD=
cleanup() {
  [[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
  rmdir "$GROUP" 2>/dev/null || echo "memory_capped.sh: $GROUP is left (processes still in it)" >&2
}
trap cleanup EXIT
# A limit that did not take (v2 without the memory controller for children) would run
# the command uncapped and report it as capped: refuse instead.
{ echo "$BYTES" >"$GROUP/$LIMIT_FILE"; } 2>/dev/null && [[ $(cat "$GROUP/$LIMIT_FILE") -le $BYTES ]] ||
  fail "cannot cap memory in $GROUP ($LIMIT_FILE); expected cgroup memory control for $PARENT's children"
# Swap would let a capped command page out instead of being killed.
if awk 'NR > 1 { found = 1 } END { exit !found }' /proc/swaps 2>/dev/null; then
  { echo "$SWAP_VALUE" >"$GROUP/$SWAP_FILE"; } 2>/dev/null ||
    fail "this host swaps and $GROUP/$SWAP_FILE cannot be set; expected swap accounting"
fi
# A signal is passed on to the command, also one that arrives before it has started.
STOP=
pass_on() { STOP=$1; [[ -n $CHILD ]] && kill "-$1" "$CHILD" 2>/dev/null; }
trap 'pass_on INT' INT
trap 'pass_on TERM' TERM HUP
# The command runs in a child shell moved into the cgroup; this shell stays out of it.
bash -c 'echo $$ > "$1/cgroup.procs" || exit 125; shift; exec "$@"' capped "$GROUP" "$@" &
CHILD=$!
[[ -n $STOP ]] && kill "-$STOP" "$CHILD" 2>/dev/null
while :; do  # a trapped signal interrupts wait; the command's own end does not repeat
  wait "$CHILD"
  RC=$?
  kill -0 "$CHILD" 2>/dev/null || break
done
CHILD=
((RC == 125)) && fail "cannot move the command into $GROUP"
gib() { [[ $1 =~ ^[0-9]+$ ]] && awk -v b="$1" 'BEGIN { printf "%.2f GiB", b / 1073741824 }' || echo "unknown"; }
# The cap as the kernel holds it (it may round), not as asked; memory.peak needs Linux 5.19.
echo "memory_capped.sh: exit status $RC under a cap of $(gib "$(cat "$GROUP/$LIMIT_FILE")"); peak usage $(gib "$(cat "$GROUP/$PEAK_FILE" 2>/dev/null)") (page cache included); $(cd "$GROUP" && $EVENTS 2>/dev/null || echo 'oom_kill not reported')"
exit "$RC"
