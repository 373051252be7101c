#!/usr/bin/env bash
# One reproduce.py table with its rows spread over parallel processes, then tabulated once.
# For a machine with many cores (an accelerator host): each process compiles its own cells on
# one core, so N processes compile N cells at a time. Every cell is its own seeded run in its
# own folder, so the order and grouping of cells change no number; the table is the one
#   python launch/reproduce.py --table=TABLE --methods=ROWS ARGS...
# writes (same cells, same files). A process's table of its own rows goes to
# <table>-subset.md where a wider table is already there; the last call writes <table>.md.
#
#   bash launch/parallel_rows.sh JOBS TABLE ROWS [ARGS...]
#
# JOBS: number of processes; ROWS: the table's rows, comma-separated, dealt round-robin to the
# processes; ARGS go to every reproduce.py call (--datasets, --scale, --seeds, --workdir, ...).
# Each process's output goes to <workdir>/parallel_<table>_<i>.log. Exits non-zero when a
# process failed (its cells are missing from the table, which is still written).
set -uo pipefail
cd "$(dirname "$0")/.."
if (($# < 3)); then
  echo "usage: bash launch/parallel_rows.sh JOBS TABLE ROWS [ARGS...]" >&2
  exit 2
fi
jobs=$1 table=$2 rows=$3
shift 3
if ! [[ $jobs =~ ^[1-9][0-9]*$ ]]; then
  echo "error: JOBS=$jobs: expected a positive integer" >&2
  exit 2
fi
workdir=""
for arg in "$@"; do
  [[ $arg == --workdir=* ]] && workdir=${arg#--workdir=}
done
if [[ -z $workdir ]]; then
  echo "error: no --workdir=DIR among the arguments: the processes must share one" >&2
  exit 2
fi
mkdir -p "$workdir"
IFS=, read -r -a names <<<"$rows"
groups=()
for i in "${!names[@]}"; do
  slot=$((i % jobs))
  groups[slot]="${groups[slot]:+${groups[slot]},}${names[i]}"
done
pids=()
for slot in "${!groups[@]}"; do
  python launch/reproduce.py --table="$table" --methods="${groups[slot]}" "$@" \
    >"$workdir/parallel_${table}_${slot}.log" 2>&1 &
  pids+=($!)
  echo "process $slot (pid $!): ${groups[slot]}"
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
python launch/reproduce.py --table="$table" --methods="$rows" --aggregate_only "$@" || status=1
exit $status
