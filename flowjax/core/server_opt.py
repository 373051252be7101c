"""Server optimizers on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

The pseudo-gradient of a round is ``g = params - weighted_mean(client params) = -Delta``;
plain SGD with learning rate 1 is FedAvg. The adaptive optimizers follow Algorithm 2 of
the paper, elementwise, with ``tau`` the adaptivity (``eps``):

    m_t = b1 m_{t-1} + (1 - b1) Delta_t                          (all three; m_{-1} = 0)
    v_t = v_{t-1} + Delta_t^2                                     (FedAdagrad)
    v_t = v_{t-1} - (1 - b2) Delta_t^2 sign(v_{t-1} - Delta_t^2)  (FedYogi)
    v_t = b2 v_{t-1} + (1 - b2) Delta_t^2                         (FedAdam)
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)

``bias_correction=False`` is the paper's algorithm exactly, with its initialization
``v_{-1} = tau^2`` (the paper requires ``v_{-1} >= tau^2``). ``bias_correction=True`` is
Adam's own correction instead (Kingma and Ba's Algorithm 1, as optax has it): both
moments start at 0 and the step uses ``m_t / (1 - b1^t)`` and ``v_t / (1 - b2^t)``;
FedAdagrad's ``v`` is a plain sum (no decay to correct), so only its ``m`` is corrected.
With it FedAdam is optax's Adam. ``eps`` stays outside the square root everywhere. TFF's
(and Keras's) Adam and Yogi correct differently: they scale the learning rate by
``sqrt(1 - b2^t) / (1 - b1^t)`` and add ``eps`` to the uncorrected ``sqrt(v_t)``, which
is this form with ``eps / sqrt(1 - b2^t)``, and their Yogi starts ``v`` at 1e-6; their
first steps are therefore smaller than these.

Groups. The optimizer treats each top-level key of a dict of params as its own group
with its own state (e.g. HypCluster's clusters, FedRep's body): a group whose
pseudo-gradient is exactly zero in every entry, which the engine gives a group no client
trained, makes no step and keeps its optimizer state, so momentum never moves a cluster
nobody chose. A group wrapped in ``ClientMean`` is not an optimizer variable at all:
``apply_server_update`` sets it to the clients' weighted mean (kept for reporting).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

PyTree = Any
SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")


@flax.struct.dataclass
class ClientMean:
    """A server params group set to the clients' weighted mean each round, bypassing the
    optimizer (e.g. a reporting-only average of personal layers). Its ``value`` is a
    pytree; a round in which no client sends it leaves it unchanged."""

    value: PyTree


def _is_client_mean(node: Any) -> bool:
    return isinstance(node, ClientMean)


class AdaptiveState(NamedTuple):
    """State of one group: step count ``t`` and the moments ``m`` and ``v``."""

    count: jax.Array
    m: PyTree
    v: PyTree


def scale_by_reddi(kind: str, b1: float, b2: float, tau: float,
                   bias_correction: bool) -> optax.GradientTransformation:
    """The direction ``m / (sqrt(v) + tau)`` of Reddi et al.'s Algorithm 2 on the gradient.

    ``kind`` is ``adam``, ``yogi`` or ``adagrad``; the moments run on the pseudo-gradient
    ``g = -Delta`` (``m`` changes sign with it, ``v`` does not), so ``-lr`` times this
    direction is the paper's step.
    """
    if kind not in ("adam", "yogi", "adagrad"):
        raise ValueError(f"unknown adaptive server optimizer {kind!r}")
    v_start = 0.0 if bias_correction else tau * tau

    def init(params):
        return AdaptiveState(count=jnp.zeros((), jnp.int32),
                             m=jax.tree.map(jnp.zeros_like, params),
                             v=jax.tree.map(lambda p: jnp.full_like(p, v_start), params))

    def second_moment(v, g):
        square = g * g
        if kind == "adam":
            return b2 * v + (1 - b2) * square
        if kind == "yogi":
            return v - (1 - b2) * square * jnp.sign(v - square)
        return v + square

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.m, grads)
        v = jax.tree.map(second_moment, state.v, grads)
        m_scale, v_scale = 1.0, 1.0
        if bias_correction:
            t = count.astype(jnp.float32)
            m_scale = 1 / (1 - b1 ** t)
            if kind != "adagrad":
                v_scale = 1 / (1 - b2 ** t)
        direction = jax.tree.map(
            lambda m, v: (m * m_scale) / (jnp.sqrt(v * v_scale) + tau), m, v)
        return direction, AdaptiveState(count, m, v)

    return optax.GradientTransformation(init, update)


def per_group(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied to each top-level group of a dict of params separately (a
    non-dict tree is one group); a group whose gradient is exactly zero everywhere makes
    no step and keeps its state. ``ClientMean`` groups get no state and a zero update."""

    def groups(tree):
        return tree if isinstance(tree, dict) else {"": tree}

    def ungroup(like, grouped):
        return grouped if isinstance(like, dict) else grouped[""]

    def init(params):
        return {name: optax.EmptyState() if _is_client_mean(group) else inner.init(group)
                for name, group in groups(params).items()}

    def update(grads, state, params=None):
        named_params = groups(params) if params is not None else None
        updates, new_state = {}, {}
        for name, group_grads in groups(grads).items():
            if _is_client_mean(group_grads):
                updates[name] = jax.tree.map(jnp.zeros_like, group_grads)
                new_state[name] = state[name]
                continue
            group_params = None if named_params is None else named_params[name]
            step, stepped_state = inner.update(group_grads, state[name], group_params)
            leaves = jax.tree.leaves(group_grads)
            moved = jnp.any(jnp.stack([jnp.any(g != 0) for g in leaves])) if leaves else False
            updates[name] = jax.tree.map(lambda u: jnp.where(moved, u, jnp.zeros_like(u)), step)
            new_state[name] = jax.tree.map(lambda new, old: jnp.where(moved, new, old),
                                           stepped_state, state[name])
        return ungroup(grads, updates), new_state

    return optax.GradientTransformation(init, update)


def server_optimizer(name: str, learning_rate: float, *, momentum: float = 0.0, b1: float = 0.9,
                     b2: float = 0.99, eps: float = 1e-3,
                     bias_correction: bool = False) -> optax.GradientTransformation:
    """An optax transformation to apply to the pseudo-gradient, one state per group.

    Args:
      name: ``sgd`` (FedAvg / FedAvgM with momentum), ``adam``, ``yogi`` or ``adagrad``.
      learning_rate: server learning rate (1.0 with ``sgd`` is plain FedAvg).
      momentum: ``sgd`` only.
      b1, b2: the moments' decays (``b2`` unused by ``adagrad``).
      eps: the adaptivity ``tau`` of Reddi et al. (outside the square root).
      bias_correction: adaptive optimizers; False is the paper's Algorithm 2 exactly
        (``v_{-1} = tau^2``, no correction), True Adam's correction of both moments
        from 0, as optax's (not TFF's: see the module docstring).
    """
    if learning_rate <= 0:
        raise ValueError(f"server learning rate must be > 0, got {learning_rate}")
    if name == "sgd":
        return per_group(optax.sgd(learning_rate, momentum=momentum or None))
    if name in ("adam", "yogi", "adagrad"):
        return per_group(optax.chain(scale_by_reddi(name, b1, b2, eps, bias_correction),
                                     optax.scale(-learning_rate)))
    raise ValueError(f"unknown server optimizer {name!r}; expected one of {SERVER_OPTIMIZERS}")


def pseudo_gradient(params: PyTree, client_mean: PyTree) -> PyTree:
    """``params - mean of the clients' params``: the direction the server descends."""
    return jax.tree.map(lambda p, m: p - m, params, client_mean)


def apply_server_update(optimizer: optax.GradientTransformation, params: PyTree,
                        opt_state: PyTree, client_mean: PyTree) -> tuple[PyTree, PyTree]:
    """One server step; returns ``(new params, new optimizer state)``.

    ``ClientMean`` groups of a dict of params become ``client_mean``'s, bit for bit,
    whatever the optimizer.
    """
    grads = pseudo_gradient(params, client_mean)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if isinstance(params, dict):
        new_params = {name: client_mean[name] if _is_client_mean(group) else new_params[name]
                      for name, group in params.items()}
    return new_params, opt_state
