"""A multilayer perceptron on flat feature vectors, routed at every dense layer.

For tabular / generated benchmarks such as FedProx's Synthetic(alpha, beta)
(``flowjax.data.leaf_synthetic``). Flow's policy sees the raw features (``policy_input
= "flat"``), one routing decision per example and layer.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel, uniform_label_weights
from flowjax.models.layers import Dense, chain_model


def mlp(input_dim: int = 60, hidden: Sequence[int] = (64, 64),
        num_classes: int = 10) -> RoutableModel:
    """dense ``hidden[0]``, relu, ..., dense ``hidden[-1]``, relu, dense ``num_classes``.

    Args:
      input_dim: features per example; ``x`` is float32 ``[B, input_dim]``.
      hidden: widths of the hidden layers (may be empty: softmax regression).
      num_classes: output classes.

    Returns:
      A model routed at ``fc1 .. fc{len(hidden) + 1}`` (pre-activation outputs); the last
      layer is the head.
    """
    widths = tuple(int(w) for w in hidden) + (int(num_classes),)
    names = tuple(f"fc{j + 1}" for j in range(len(widths)))
    last = len(widths) - 1

    def glue_apply(j: int, h: jax.Array, train: bool, key: jax.Array) -> jax.Array:
        del train, key  # no dropout: the paper's small models on flat features have none
        return h if j == last else jax.nn.relu(h)

    return chain_model(
        name="mlp", layer_names=names, modules=tuple(Dense(w) for w in widths),
        embed_input=lambda x: x.reshape(x.shape[0], -1), glue_apply=glue_apply,
        example_input=jax.ShapeDtypeStruct((1, int(input_dim)), jnp.float32),
        label_weights=uniform_label_weights, instance_ndim=1, num_classes=int(num_classes),
        policy_input="flat", head_layers=(names[-1],))
