#!/usr/bin/env bash
# The CPU mini-reproduction: every method on Fashion-MNIST split into clients by Dirichlet
# label skew 0.1 and 0.6 (the paper's CIFAR design on an offline dataset; EMNIST CNN and the
# paper's EMNIST hyperparameters; configs/fashion_mnist.py:mini_0.1 / mini_0.6), seeds 0, 44,
# 56; then Tables 2 and 3, the soft-vs-hard table and the plots, copied into DOCS_DIR
# (default WORKDIR/docs; docs/reproduction/fashion-mnist-mini regenerates the committed copy).
#
#   apt-get install dataset-fashion-mnist      # once: the IDX files, offline
#   bash launch/mini_reproduction.sh [WORKDIR] [DOCS_DIR]
#
# Extra arguments after the two folders go to every reproduce.py call, e.g.
# --override=data.data_dir=/path/to/fashion-mnist. Finished cells in WORKDIR are reused (an
# interrupted run resumes), so running it again only rebuilds the tables and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${1:-runs/mini}"
docs="${2:-$workdir/docs}"
shift $(( $# < 2 ? $# : 2 ))
methods=local,fedavg,fedavg_ft,apfl,ditto,fedrep,lg_fedavg,hypcluster,knn_per,partialfed,flow
grid=(--datasets=fashion_mnist_0.1,fashion_mnist_0.6 --scale=mini --seeds=0,44,56
      --workdir="$workdir" "$@")

python launch/reproduce.py --table=table2 "${grid[@]}" --methods="$methods"
# Table 3 has no row for Local and FedAvg (no personalized model to compare).
python launch/reproduce.py --table=table3 "${grid[@]}" --aggregate_only \
    --methods="${methods#local,fedavg,}"
python launch/reproduce.py --table=soft_hard "${grid[@]}" --aggregate_only
# Only this grid's methods: launch/gain_source.sh's runs share the workdir. A fresh folder,
# so no PNG of an earlier plot is copied.
rm -rf "$workdir/plots_mini"
python launch/plot.py --workdir="$workdir" --plot_methods="$methods" --out_dir="$workdir/plots_mini"
mkdir -p "$docs"
cp "$workdir"/table2.{md,csv} "$workdir"/table3.{md,csv} "$workdir"/soft_hard.{md,csv} "$docs"/
cp "$workdir"/plots_mini/*.png "$docs"/
echo "wrote $docs"
