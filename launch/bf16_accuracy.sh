#!/usr/bin/env bash
# The accuracy effect of compute_dtype=bfloat16 (issue 16): FedAvg, FedAvgFT and Flow on the
# CPU mini-reproduction's Fashion-MNIST Dirichlet 0.1 grid (configs/fashion_mnist.py:mini_0.1,
# seeds 0, 44, 56), once in float32 and once in bf16, then the side-by-side table with the
# bf16 - float32 difference paired by seed.
#
#   apt-get install dataset-fashion-mnist      # once: the IDX files, offline
#   bash launch/bf16_accuracy.sh [FLOAT32_WORKDIR] [BFLOAT16_WORKDIR] [DOCS_DIR]
#
# The float32 workdir defaults to launch/mini_reproduction.sh's, whose finished cells are
# reused. On CPU bf16 products run as float32 products of bf16-rounded operands, the same
# arithmetic as a GPU's bf16 GEMMs with float32 accumulation (flowjax/models/layers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
float32="${1:-runs/mini}"
bfloat16="${2:-runs/mini_bf16}"
docs="${3:-docs/results/bf16-accuracy}"
methods=fedavg,fedavg_ft,flow
grid=(--table=table2 --datasets=fashion_mnist_0.1 --scale=mini --seeds=0,44,56
      --methods="$methods")

python launch/reproduce.py "${grid[@]}" --workdir="$float32"
python launch/reproduce.py "${grid[@]}" --workdir="$bfloat16" --override=compute_dtype=bfloat16
python launch/precision_effect.py --float32_workdir="$float32" --bfloat16_workdir="$bfloat16" \
    --dataset=fashion_mnist_0.1 --methods="$methods" --seeds=0,44,56 --out="$docs/mini-dir0.1"
