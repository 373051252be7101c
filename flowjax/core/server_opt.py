"""Server optimizers on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

The pseudo-gradient of a round is ``params - weighted_mean(client params)``; plain SGD with
learning rate 1 is FedAvg. Adam, Yogi and Adagrad are optax's transforms; the paper's
algorithm has no bias correction while optax's Adam has it, so ``bias_correction=False``
builds the uncorrected moments from optax's primitives.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any
SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")


def _uncorrected_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's moments without bias correction (Reddi et al. 2021, Algorithm 2)."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (zeros, zeros)

    def update(grads, state, params=None):
        del params
        mu, nu = state
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, (mu, nu)

    return optax.GradientTransformation(init, update)


def server_optimizer(name: str, learning_rate: float, *, momentum: float = 0.0, b1: float = 0.9,
                     b2: float = 0.99, eps: float = 1e-3,
                     bias_correction: bool = True) -> optax.GradientTransformation:
    """An optax transformation to apply to the pseudo-gradient.

    Args:
      name: ``sgd`` (FedAvg / FedAvgM with momentum), ``adam``, ``yogi`` or ``adagrad``.
      learning_rate: server learning rate (1.0 with ``sgd`` is plain FedAvg).
      eps: the adaptivity ``tau`` of Reddi et al.
      bias_correction: Adam only; False follows the paper's Algorithm 2 exactly.
    """
    if learning_rate <= 0:
        raise ValueError(f"server learning rate must be > 0, got {learning_rate}")
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=momentum or None)
    if name == "adam":
        if bias_correction:
            return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
        return optax.chain(_uncorrected_adam(b1, b2, eps), optax.scale(-learning_rate))
    if name == "yogi":
        return optax.yogi(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "adagrad":
        return optax.adagrad(learning_rate, eps=eps)
    raise ValueError(f"unknown server optimizer {name!r}; expected one of {SERVER_OPTIMIZERS}")


def pseudo_gradient(params: PyTree, client_mean: PyTree) -> PyTree:
    """``params - mean of the clients' params``: the direction the server descends."""
    return jax.tree.map(lambda p, m: p - m, params, client_mean)


def apply_server_update(optimizer: optax.GradientTransformation, params: PyTree,
                        opt_state: PyTree, client_mean: PyTree) -> tuple[PyTree, PyTree]:
    """One server step; returns ``(new params, new optimizer state)``."""
    grads = pseudo_gradient(params, client_mean)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
