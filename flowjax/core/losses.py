"""Masked losses and accuracy counts, shared by every algorithm and the evaluation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def weighted_cross_entropy(logits: jax.Array, labels: jax.Array,
                           weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of weighted CE, sum of weights)`` over all instances.

    Returning both sums lets callers form a mean over valid instances only, so padded
    examples and padding tokens never change a loss.
    """
    # At least float32 (bf16 logits are upcast); float64 stays float64 (parity checks).
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(dtype), labels)
    return jnp.sum(ce * weights), jnp.sum(weights)


def mean_from_sums(total: jax.Array, count: jax.Array) -> jax.Array:
    """``total / count``, 0 when nothing counted."""
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def masked_mean_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
    """Mean CE over instances with positive weight."""
    return mean_from_sums(*weighted_cross_entropy(logits, labels, weights))


def correct(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-instance correctness (argmax; ties resolve to the lowest class id).

    A diverged prediction (``finite_rows``) is wrong: argmax would pick the first NaN's
    class, so a diverged model would score the share of that class.
    """
    return (jnp.argmax(logits, axis=-1) == labels) & finite_rows(logits)


def finite_rows(logits: jax.Array) -> jax.Array:
    """Per instance, whether its prediction is usable: no NaN and a finite largest logit.

    ``-inf`` beside a finite maximum is a log-probability of 0, not a divergence
    (kNN-Per at ``lam=1`` predicts ``log p_kNN``, ``-inf`` for classes no neighbour has).
    """
    return (~jnp.any(jnp.isnan(logits), axis=-1)) & jnp.isfinite(jnp.max(logits, axis=-1))
