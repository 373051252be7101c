#!/usr/bin/env bash
# The accuracy effect of compute_dtype=bfloat16 (issue 16): FedAvg, FedAvgFT and Flow over
# seeds 0, 44, 56 of a CPU-sized grid, once in float32 and once in bf16, then the
# side-by-side table with the bf16 - float32 difference paired by seed.
#
#   bash launch/bf16_accuracy.sh [TASK] [FLOAT32_WORKDIR] [BFLOAT16_WORKDIR] [DOCS_DIR]
#
# DOCS_DIR defaults to BFLOAT16_WORKDIR/docs (docs/results/bf16-accuracy regenerates the
# committed copy).
# TASK:
#   fashion_mnist (default)  the EMNIST CNN on the CPU mini-reproduction's Fashion-MNIST
#                            Dirichlet 0.1 grid (configs/fashion_mnist.py:mini_0.1); once:
#                            apt-get install dataset-fashion-mnist (the IDX files, offline).
#                            The float32 workdir defaults to launch/mini_reproduction.sh's,
#                            whose finished cells are reused.
#   shakespeare              the Shakespeare LSTM on the embedded data
#                            (configs/shakespeare.py:mini) with the paper's K = 5 local
#                            epochs instead of mini's 1: with K = 1 the LSTM is still on the
#                            unigram plateau after 40 rounds, where precision cannot show.
# Finished cells of either grid are reused, so an interrupted run picks up where it stopped.
# On CPU bf16 products run as float32 products of bf16-rounded operands, the same
# arithmetic as a GPU's bf16 GEMMs with float32 accumulation (flowjax/models/layers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
task="${1:-fashion_mnist}"
methods=fedavg,fedavg_ft,flow
seeds=0,44,56
case "$task" in
  fashion_mnist)
    dataset=fashion_mnist_0.1
    float32="${2:-runs/mini}"
    bfloat16="${3:-runs/mini_bf16}"
    out="${4:-$bfloat16/docs}/mini-dir0.1"
    overrides=()
    ;;
  shakespeare)
    dataset=shakespeare
    float32="${2:-runs/shakespeare_k5}"
    bfloat16="${3:-runs/shakespeare_k5_bf16}"
    out="${4:-$bfloat16/docs}/shakespeare-mini-k5"
    overrides=(--override=sgd.epochs=5)
    ;;
  *)
    echo "bf16_accuracy.sh: unknown task '$task'; expected fashion_mnist or shakespeare" >&2
    exit 2
    ;;
esac
grid=(--table=table2 --datasets="$dataset" --scale=mini --seeds="$seeds"
      --methods="$methods" "${overrides[@]}")

python launch/reproduce.py "${grid[@]}" --workdir="$float32"
python launch/reproduce.py "${grid[@]}" --workdir="$bfloat16" --override=compute_dtype=bfloat16
python launch/precision_effect.py --float32_workdir="$float32" --bfloat16_workdir="$bfloat16" \
    --dataset="$dataset" --methods="$methods" --seeds="$seeds" --out="$out"
