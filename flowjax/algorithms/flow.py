"""Flow: per-instance personalization by routing between global and local layers.

Panchal et al., "Flow: Per-instance Personalized Federated Learning", NeurIPS 2023,
Algorithm 1/2. Each sampled client, from the broadcast global params ``w_g`` and policy
``psi``:

1. copies ``w_g,m <- w_g``, ``psi_m <- psi`` and ``w_l <- w_g`` (local starts from global);
2. splits its train examples into two disjoint halves with a seeded random draw:
   ``zeta_l`` (a ``split_ratio`` share) and ``zeta_g`` (the rest);
3. trains ``w_l`` for K1 epochs of SGD on ``zeta_l`` (the plain model);
4. for K2 epochs over ``zeta_g``, on each minibatch, takes a policy step on
   ``CE(routed) - gamma / L * sum_j mean log q0_j`` and then a global step on
   ``CE(routed)`` with the new policy (Eq. 3, 4; ``order="alternating"``);
5. sends ``(w_g,m, psi_m)`` with weight ``|zeta_g|``; the server averages both.

Rule for tiny clients: when a half would be empty (a client with fewer than two
examples, or a ``split_ratio`` that rounds a half to nothing) both phases use all of the
client's examples, so a one-example client trains and aggregates with weight 1 instead
of failing.

Options from the paper's ablations and the authors' code (defaults follow the paper):
``order`` (``alternating`` / ``policy_first`` / ``global_first``, App. E.2),
``split_ratio`` (App. E.3), ``gamma = 0`` (no regularizer), ``fixed_q0`` (a constant,
untrained policy: the fixed-policy ablation), ``local_route="global"`` (pi-Flow: "both
paths of the dynamic model are global models"; here the second path is the received
global model, frozen, and the K1 local phase is skipped, so routing chooses per instance
between two global routes only), ``global_step="global_only"`` (the authors' code: the
global step runs the global branch alone), ``momentum`` (their SGD momentum 0.9).
pc-Flow is FedAvgFT (``flowjax.algorithms.fedavg``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions,
                                     client_optimizer, instance_weights, plain_loss_sums,
                                     require_positive_ints, sgd_step, train_plain, valid_examples)
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.losses import mean_from_sums, weighted_cross_entropy
from flowjax.models.base import RoutableModel, forward
from flowjax.routing.policy import Policy, build_policy
from flowjax.routing.routed import routed_forward

ORDERS = ("alternating", "policy_first", "global_first")
GLOBAL_STEPS = ("routed", "global_only")
LOCAL_ROUTES = ("local", "global")


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    """Flow's client-side hyperparameters (paper Appendix B gives per-dataset values).

    Attributes:
      learning_rate: client SGD learning rate for all three parameter groups.
      local_epochs: K1, epochs of local fine-tuning on ``zeta_l``.
      routing_epochs: K2, epochs of policy/global training on ``zeta_g``.
      batch_size: client batch size.
      gamma: weight of the regularizer ``-gamma/L sum_j log q0_j`` (0 disables it).
      split_ratio: share of the client's examples in ``zeta_l``.
      policy_hidden: width of each policy base layer, one per routed layer.
      policy_dropout: dropout of the policy's exit heads during training.
      order: ``alternating`` (default), ``policy_first`` or ``global_first``.
      global_step: ``routed`` (paper Eq. 4) or ``global_only`` (authors' code).
      momentum: client SGD momentum, one optimizer state per parameter group.
      fixed_q0: if set, every instance and layer uses this ``q0`` and the policy is
        never trained (fixed-policy ablation).
      local_route: ``local`` (Flow) or ``global`` (pi-Flow: the second route is the
        received global model, no local fine-tuning).
    """

    learning_rate: float
    local_epochs: int
    routing_epochs: int
    batch_size: int
    gamma: float
    policy_hidden: Sequence[int]
    split_ratio: float = 0.5
    policy_dropout: float = 0.3
    order: str = "alternating"
    global_step: str = "routed"
    momentum: float = 0.0
    fixed_q0: float | None = None
    local_route: str = "local"

    def __post_init__(self):
        if self.fixed_q0 is not None and not 0.0 <= self.fixed_q0 <= 1.0:
            raise ValueError(f"fixed_q0 must be in [0, 1] or None, got {self.fixed_q0}")
        if self.local_route not in LOCAL_ROUTES:
            raise ValueError(f"unknown Flow local_route {self.local_route!r}; "
                             f"expected one of {LOCAL_ROUTES}")
        if not 0.0 < self.split_ratio < 1.0:
            raise ValueError(f"split_ratio must be in (0, 1), got {self.split_ratio}")
        if self.order not in ORDERS:
            raise ValueError(f"unknown Flow order {self.order!r}; expected one of {ORDERS}")
        if self.global_step not in GLOBAL_STEPS:
            raise ValueError(f"unknown Flow global_step {self.global_step!r}; "
                             f"expected one of {GLOBAL_STEPS}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")
        require_positive_ints(self, ("local_epochs", "routing_epochs", "batch_size"))


def split_halves(key: jax.Array, valid: jax.Array, split_ratio: float) -> tuple[jax.Array, jax.Array]:
    """Disjoint seeded halves ``(zeta_l, zeta_g)`` of the valid examples, as bool masks.

    A random rank per example index (padding-invariant, see ``local_training``) puts the
    ``floor(n * split_ratio)`` lowest-ranked valid examples in ``zeta_l``. If either half
    would be empty, both halves are all valid examples (the tiny-client rule).
    """
    draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(
        jnp.arange(valid.shape[0]))
    order = jnp.argsort(jnp.where(valid, draws, 2.0), stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    n = jnp.sum(valid)
    n_local = jnp.floor(n.astype(jnp.float32) * split_ratio).astype(n.dtype)
    degenerate = (n_local == 0) | (n_local == n)
    zeta_l = valid & ((rank < n_local) | degenerate)
    zeta_g = valid & ((rank >= n_local) | degenerate)
    return zeta_l, zeta_g


def half_capacity(num_slots: int, split_ratio: float) -> tuple[int, int]:
    """Static upper bounds of ``|zeta_l|`` and ``|zeta_g|`` for a padded client size.

    ``floor(n r)`` and ``n - floor(n r)`` both grow with ``n``; the tiny-client rule only
    applies when ``n <= 1/min(r, 1-r)``, where the whole client fits either bound + 1.
    """
    local = math.floor(num_slots * split_ratio)
    rest = num_slots - local
    tiny = math.ceil(1.0 / min(split_ratio, 1.0 - split_ratio))
    return max(local, min(tiny, num_slots)), max(rest, min(tiny, num_slots))


def flow(model: RoutableModel, config: FlowConfig, example_x: jax.Array) -> FederatedAlgorithm:
    """Flow for ``model``. ``example_x`` is one input batch (for the policy's shapes)."""
    policy = build_policy(model, example_x, config.policy_hidden,
                          dropout_rate=config.policy_dropout)
    optimizer = client_optimizer(config.learning_rate, config.momentum)
    num_layers = model.num_layers

    def init(key):
        model_key, policy_key = jax.random.split(key)
        return {"global": model.init(model_key), "policy": policy.init(policy_key)}

    def global_log_prob(policy_params, x, *, train: bool, key=None):
        """``log q0``, ``[*instance, L]``: the policy's, or the fixed-policy constant."""
        if config.fixed_q0 is not None:
            instances = x.shape[: model.instance_ndim]
            return jnp.full(instances + (num_layers,), jnp.log(config.fixed_q0), jnp.float32)
        return policy.log_probs(policy_params, x, train=train, key=key)[..., 0]

    def routed_sums(global_params, local_params, policy_params, batch, key, *,
                    regularize: bool):
        """``[objective_sum, weight_sum]``: weighted CE (+ regularizer) of the routed model."""
        x, y, w = batch
        policy_key, model_key = jax.random.split(key)
        log_q0 = global_log_prob(policy_params, x, train=True, key=policy_key)
        logits = routed_forward(model, global_params, local_params, jnp.exp(log_q0), x,
                                train=True, key=model_key)
        weights = instance_weights(model, y, w)
        ce_sum, count = weighted_cross_entropy(logits, y, weights)
        if regularize and config.gamma > 0:
            mean_log_q0 = jnp.sum(log_q0, axis=-1) / num_layers  # [*instance]
            ce_sum = ce_sum - config.gamma * jnp.sum(mean_log_q0 * weights)
        return jnp.stack([ce_sum, count])

    def policy_sums(policy_params, carry, batch, key):
        global_params, local_params = carry
        return routed_sums(global_params, local_params, policy_params, batch, key,
                           regularize=True)

    def global_sums(global_params, carry, batch, key):
        local_params, policy_params = carry
        if config.global_step == "global_only":
            return plain_loss_sums(model, global_params, batch, key)
        return routed_sums(global_params, local_params, policy_params, batch, key,
                           regularize=False)

    def policy_step(state, batch, key, local_params):
        (global_params, global_opt), (policy_params, policy_opt) = state
        step = sgd_step(lambda p, b, k: policy_sums(p, (global_params, local_params), b, k),
                        optimizer)
        (policy_params, policy_opt), sums = step((policy_params, policy_opt), batch, key)
        return ((global_params, global_opt), (policy_params, policy_opt)), sums

    def global_step(state, batch, key, local_params):
        (global_params, global_opt), (policy_params, policy_opt) = state
        step = sgd_step(lambda p, b, k: global_sums(p, (local_params, policy_params), b, k),
                        optimizer)
        (global_params, global_opt), sums = step((global_params, global_opt), batch, key)
        return ((global_params, global_opt), (policy_params, policy_opt)), sums

    def train_client(params, examples: ClientExamples, key):
        """Steps 1-4 of Algorithm 1: ``(w_g,m, w_l, psi_m, |zeta_g|, metrics)``."""
        split_key, local_key, routing_key = (jax.random.fold_in(key, i) for i in range(3))
        valid = valid_examples(examples)
        zeta_l, zeta_g = split_halves(split_key, valid, config.split_ratio)
        local_cap, global_cap = half_capacity(valid.shape[0], config.split_ratio)
        if config.local_route == "global":  # pi-Flow: the second route is global too
            local_params, local_sums = params["global"], jnp.zeros((2,), jnp.float32)
        else:
            local_params, local_sums = train_plain(
                model, params["global"], optimizer, examples, zeta_l,
                epochs=config.local_epochs, batch_size=config.batch_size, key=local_key,
                max_members=local_cap)

        x, y, _ = examples.flat()
        state = ((params["global"], optimizer.init(params["global"])),
                 (params["policy"], optimizer.init(params["policy"])))
        run = dict(num_epochs=config.routing_epochs, batch_size=config.batch_size,
                   max_members=global_cap)

        def with_local(step):
            return lambda s, b, k: step(s, b, k, local_params)

        if config.fixed_q0 is not None:  # nothing to learn in the policy
            state, routed = run_epochs(with_local(global_step), state, x, y, zeta_g,
                                       key=routing_key, **run)
        elif config.order == "alternating":
            def alternating(state, batch, key):
                state, _ = policy_step(state, batch, jax.random.fold_in(key, 0), local_params)
                return global_step(state, batch, jax.random.fold_in(key, 1), local_params)
            state, routed = run_epochs(alternating, state, x, y, zeta_g, key=routing_key, **run)
        else:
            phases = [policy_step, global_step]
            if config.order == "global_first":
                phases.reverse()
            for i, phase in enumerate(phases):
                state, routed = run_epochs(with_local(phase), state, x, y, zeta_g,
                                           key=jax.random.fold_in(routing_key, i), **run)
        (global_params, _), (policy_params, _) = state
        metrics = {"loss_sum": routed[0], "loss_count": routed[1],
                   "local_loss_sum": local_sums[0], "local_loss_count": local_sums[1]}
        return global_params, local_params, policy_params, jnp.sum(zeta_g), metrics

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        global_params, _, policy_params, weight, metrics = train_client(params, examples, key)
        return ClientResult(params={"global": global_params, "policy": policy_params},
                            weight=weight.astype(jnp.float32), metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        del client_state  # stateless
        global_params, local_params, policy_params, _, _ = train_client(params, examples, key)
        return {"global": global_params, "local": local_params, "policy": policy_params}

    def predict(params, personal, x) -> Predictions:
        q0 = jnp.exp(global_log_prob(personal["policy"], x, train=False))
        route = dict(model=model, global_params=personal["global"],
                     local_params=personal["local"], q0=q0, x=x)
        return Predictions(global_logits=forward(model, params["global"], x),
                           personal_hard=routed_forward(**route, hard=True),
                           personal_soft=routed_forward(**route, hard=False), q0=q0)

    return FederatedAlgorithm(name="flow", model=model, init=init, client_update=client_update,
                              personalize=personalize, predict=predict)
