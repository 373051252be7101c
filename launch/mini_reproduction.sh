#!/usr/bin/env bash
# The CPU mini-reproduction: every method on the embedded Shakespeare data (the `mini`
# config: 40 rounds, evaluated every 10), seeds 0, 44, 56; then Tables 2 and 3, the
# soft-vs-hard table and the plots, copied into docs/.
#
#   bash launch/mini_reproduction.sh [WORKDIR] [DOCS_DIR]
#
# Finished cells in WORKDIR are reused (an interrupted run resumes), so running it again
# only rebuilds the tables and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${1:-runs/mini}"
docs="${2:-docs/reproduction/shakespeare-mini}"
methods=local,fedavg,fedavg_ft,apfl,ditto,fedrep,lg_fedavg,hypcluster,knn_per,partialfed,flow
grid=(--datasets=shakespeare --scale=mini --seeds=0,44,56 --workdir="$workdir")

python launch/reproduce.py --table=table2 "${grid[@]}" --methods="$methods"
# Table 3 has no row for Local and FedAvg (no personalized model to compare).
python launch/reproduce.py --table=table3 "${grid[@]}" --aggregate_only \
    --methods="${methods#local,fedavg,}"
python launch/reproduce.py --table=soft_hard "${grid[@]}" --aggregate_only
python launch/plot.py --workdir="$workdir"
mkdir -p "$docs"
cp "$workdir"/table2.{md,csv} "$workdir"/table3.{md,csv} "$workdir"/soft_hard.{md,csv} "$docs"/
cp "$workdir"/plots/*.png "$docs"/
echo "wrote $docs"
