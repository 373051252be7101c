"""Pytree math used by aggregation and masking."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def weighted_mean(stacked: PyTree, weights: jax.Array) -> PyTree:
    """Example-weighted mean over the leading (clients) axis of every leaf.

    Clients with weight 0 (padding clients, empty clients) do not contribute. If every
    weight is 0 the result is all zeros; callers keep their previous value in that case
    (see ``select_tree``). Equal weights (zeros aside) give the unweighted mean of the
    clients they weight: the same bits whatever their value.

    Example:
      >>> weighted_mean({'w': jnp.array([[1.], [3.]])}, jnp.array([1., 3.]))['w']
      Array([2.5], dtype=float32)
    """
    weights = jnp.asarray(weights, jnp.float32)
    # Equal weights (every client of the same size) weight by 1 instead: the same mean,
    # but a weight of, say, 60 would round every client's term and the scale 1 / total
    # (60 n) again. Unequal weights are used as they are.
    largest = jnp.max(weights)
    equal = jnp.all((weights == largest) | (weights == 0))
    weights = jnp.where(equal, (weights > 0).astype(jnp.float32), weights)

    @functools.cache  # float32, or float64 for an x64 run's float64 leaves: once each
    def inverse_total(dtype):
        """``1 / total`` (0 for no weight) at ``dtype``."""
        total = jnp.sum(weights.astype(dtype))
        return jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)

    def leaf_mean(leaf):
        summed = jnp.tensordot(weights.astype(leaf.dtype), leaf, axes=1)
        scale = inverse_total(jnp.promote_types(leaf.dtype, jnp.float32))
        return summed * scale.astype(leaf.dtype)

    return jax.tree.map(leaf_mean, stacked)


def select_tree(condition: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leafwise ``where(condition, on_true, on_false)`` for a scalar condition."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


def tree_all_finite(tree: PyTree) -> jax.Array:
    """True iff every leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
