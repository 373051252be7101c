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
between two global routes only; the split is still drawn, so ``zeta_l`` goes unused and the
weight stays ``|zeta_g|``), ``global_step="global_only"`` (the authors' code: the
global step runs the global branch alone), ``momentum`` (their SGD momentum 0.9), and the
other departures of the authors' code, each alone or all at once (``halves``,
``frozen_momentum``, ``regularizer``, ``local_init``, ``policy_eval_dropout``,
``hard_tie``, ``evaluation``, ``policy_last``; see ``flowjax.algorithms.flow_reference``; on the
LSTMs and the CIFAR ResNet, ``semantics="reference"`` is their network and procedure whole,
``flowjax.algorithms.flow_reference_networks``).
pc-Flow is FedAvgFT (``flowjax.algorithms.fedavg``).

Optimizer: one SGD momentum buffer per parameter group (global, local, policy), kept for
the whole client procedure; a group's buffer only moves while the group trains, unless
``frozen_momentum="zero_grad"`` (PyTorch < 2.0 semantics of the authors' shared
optimizer). With the default that is exactly a fresh optimizer per phase, as the paper
describes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions, SGDConfig,
                                     group_sgd_step, instance_weights, plain_loss_sums,
                                     valid_examples)
from flowjax.algorithms.flow_reference import (DEPARTURES, SEMANTICS, check_hard_tie,
                                               reference_regularizer_mean,
                                               resolve, route_key_for_test_batch,
                                               shard_batches_fn, shard_member)
from flowjax.algorithms.flow_reference_networks import NETWORKS
from flowjax.core.checks import (FieldError, Interval, check_fields, integer, non_negative,
                                 one_of, widths)
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.losses import weighted_cross_entropy
from flowjax.models.base import RoutableModel, forward
from flowjax.routing.policy import build_policy
from flowjax.routing.routed import routed_forward

ORDERS = ("alternating", "policy_first", "global_first")
LOCAL_ROUTES = ("local", "global")


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    """Flow's client-side hyperparameters (paper Appendix B gives per-dataset values).

    Attributes:
      sgd: the clients' SGD for all three parameter groups (momentum: one state per
        group); its epochs are K1 and K2 unless ``local_epochs`` / ``routing_epochs`` say.
      gamma: weight of the regularizer ``-gamma/L sum_j log q0_j`` (0 disables it).
      split_ratio: share of the client's examples in ``zeta_l``.
      policy_hidden: width of each policy base layer, one per routed layer.
      policy_dropout: dropout of the policy's exit heads during training.
      order: ``alternating`` (default), ``policy_first`` or ``global_first``.
      global_step: ``routed`` (paper Eq. 4) or ``global_only`` (authors' code); None
        (the default) as ``semantics`` says, like the departure fields below.
      fixed_q0: if set, every instance and layer uses this ``q0`` and the policy is
        never trained (fixed-policy ablation).
      local_route: ``local`` (Flow) or ``global`` (pi-Flow: the second route is the
        received global model, no local fine-tuning).
      local_epochs: K1, epochs of local fine-tuning on ``zeta_l`` (None: ``sgd.epochs``).
      routing_epochs: K2, epochs of policy/global training on ``zeta_g`` (None:
        ``sgd.epochs``).
      semantics: ``paper`` or ``reference`` (the authors' code for the model:
        ``flow_reference.reference_options``); the fields below left None follow it.
      halves: ``random`` (paper) or the authors' ``shard`` / ``shard_reshuffled`` /
        ``none`` (``flow_reference``).
      frozen_momentum: ``set_to_none`` (frozen groups keep still) or ``zero_grad``
        (frozen groups step by their momentum buffer, PyTorch < 2.0).
      regularizer: ``paper`` or ``reference`` (``gamma * mean(-log(q^2 + 1e-6))``).
      local_init: ``global`` (paper) or ``server`` (separate random init of the local
        branch, averaged by the server with global and policy).
      policy_eval_dropout: keep the policy's dropout on when routing at evaluation, with
        new masks for every test batch (``for_test_batch``: each batch's key folded from
        the client's), as the authors' ``F.dropout`` draws anew at every call; another
        eval batch size therefore gives other routes, as it does in their code.
      hard_tie: hard routes at an exact ``q0 = 1/2``: ``global`` (paper) or ``zeroed``
        (the authors' ``torch.round`` of both entries; ``flow_reference``).
      evaluation: ``paper``, or the authors' ``*_generalized_test``: ``reference`` (their
        EMNIST code) or ``reference_policy`` (their CIFAR code).
      policy_last: ``exit`` or ``dense`` (the authors' EMNIST/CIFAR policy head).
      recurrence: LSTM layers' routing: Eq. 3 with the whole LSTM layer as layer j
        (``separate``) or with each cell application as the layer (``mixed_state``);
        ``flowjax.routing.routed``.
      fuse_branches: ``True`` runs a layer's two branches as one product over their
        stacked weights where its input outweighs its weights (the EMNIST CNN's
        convolutions): the same model to float32 rounding, with less memory traffic
        (``routing.routed``). ``None`` (the default) or ``False``: one product per branch.
    """

    sgd: SGDConfig
    gamma: float
    policy_hidden: Sequence[int]
    split_ratio: float = 0.5
    policy_dropout: float = 0.3
    order: str = "alternating"
    global_step: str | None = None
    fixed_q0: float | None = None
    local_route: str = "local"
    local_epochs: int | None = None
    routing_epochs: int | None = None
    semantics: str = "paper"
    halves: str | None = None
    frozen_momentum: str | None = None
    regularizer: str | None = None
    local_init: str | None = None
    policy_eval_dropout: bool | None = None
    hard_tie: str | None = None
    evaluation: str | None = None
    policy_last: str | None = None
    recurrence: str | None = None
    fuse_branches: bool | None = None

    def __post_init__(self):
        if isinstance(self.policy_hidden, list):  # a config file's list reads as a tuple
            object.__setattr__(self, "policy_hidden", tuple(self.policy_hidden))
        for name in ("local_epochs", "routing_epochs"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.sgd.epochs)
        check_fields(self, {
            "gamma": non_negative, "split_ratio": Interval(0, 1, closed_low=False),
            "policy_hidden": widths, "policy_dropout": Interval(0, 1),
            "order": one_of(ORDERS),
            "fixed_q0": Interval(0, 1, closed_high=True, optional=True),
            "local_route": one_of(LOCAL_ROUTES),
            "local_epochs": integer(1), "routing_epochs": integer(1),
            "semantics": one_of(SEMANTICS), "fuse_branches": one_of((None, False, True)),
            **{name: one_of((None,) + choices) for name, choices in DEPARTURES.items()}})
        if self.local_route == "global" and self.local_init not in (None, "global"):
            raise FieldError("local_init", self.local_init,
                             "expected 'global' with local_route='global' (pi-Flow)")


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
    ``floor(n r)`` is taken in float32 as ``split_halves`` takes it (in float64, 90 x 0.7
    floors to 62 where float32 gives 63).
    """
    local = int(np.floor(np.float32(num_slots) * np.float32(split_ratio)))
    rest = num_slots - local
    tiny = math.ceil(1.0 / min(split_ratio, 1.0 - split_ratio))
    return max(local, min(tiny, num_slots)), max(rest, min(tiny, num_slots))


def flow(model: RoutableModel, config: FlowConfig, example_x: jax.Array) -> FederatedAlgorithm:
    """Flow for ``model``. ``example_x`` is one input batch (for the policy's shapes).

    ``config``'s departures left None follow ``config.semantics`` for this model
    (``flow_reference.resolve``).
    """
    network = NETWORKS.get(model.name)
    if config.semantics == "reference" and network is not None:  # their network, whole
        network.check_unused(config, model.name)
        return network.build(model, resolve(config, model.name))
    config = resolve(config, model.name)
    check_hard_tie(config, model)  # validate_config checks it first, with its config path
    policy = build_policy(model, example_x, config.policy_hidden,
                          dropout_rate=config.policy_dropout, last=config.policy_last)
    num_layers = model.num_layers
    server_local = config.local_init == "server"
    if config.regularizer == "reference" and config.gamma > 0:
        # Fails now, with the model's name, rather than at the first traced step.
        reference_regularizer_mean(model.name, jnp.ones((1, num_layers, 2)), jnp.ones((1,)))

    def init(key):
        model_key, policy_key = jax.random.split(key)
        params = {"global": model.init(model_key), "policy": policy.init(policy_key)}
        if server_local:  # the authors' separate random init of the local branch
            params["local"] = model.init(jax.random.fold_in(key, 2))
        return params

    def route_log_probs(policy_params, x, *, train: bool, key=None):
        """``log q``, ``[*instance, L, 2]`` (index 0 = global): the policy's, or the
        fixed-policy constant."""
        if config.fixed_q0 is not None:
            instances = x.shape[: model.instance_ndim]
            fixed = jnp.asarray([config.fixed_q0, 1.0 - config.fixed_q0], jnp.float32)
            return jnp.broadcast_to(jnp.log(fixed), instances + (num_layers, 2))
        return policy.log_probs(policy_params, x, train=train, key=key)

    def route_q0(log_q):
        """``q0 [*instance, L]`` from ``log q``; the fixed-policy constant exactly, since
        ``exp(log q0)`` rounds some values off in float32 (0.1 -> 0.09999999)."""
        if config.fixed_q0 is not None:
            return jnp.full(log_q.shape[:-1], config.fixed_q0, jnp.float32)
        return jnp.exp(log_q[..., 0])

    def routed_sums(params, batch, key, *, regularize: bool):
        """``[objective_sum, weight_sum]``: weighted CE (+ regularizer) of the routed model."""
        x, y, w = batch
        policy_key, model_key = jax.random.split(key)
        log_q = route_log_probs(params["policy"], x, train=True, key=policy_key)
        log_q0 = log_q[..., 0]
        logits = routed_forward(model, params["global"], params["local"], route_q0(log_q), x,
                                train=True, key=model_key, recurrence=config.recurrence,
                                fuse_branches=bool(config.fuse_branches))
        weights = instance_weights(model, y, w)
        ce_sum, count = weighted_cross_entropy(logits, y, weights)
        if regularize and config.gamma > 0:
            if config.regularizer == "paper":
                mean_log_q0 = jnp.sum(log_q0, axis=-1) / num_layers  # [*instance]
                ce_sum = ce_sum - config.gamma * jnp.sum(mean_log_q0 * weights)
            else:  # a batch mean added to the mean CE: times count in sum form
                ce_sum = ce_sum + config.gamma * count * reference_regularizer_mean(
                    model.name, jnp.exp(log_q), weights)
        return jnp.stack([ce_sum, count])

    def local_sums(params, batch, key):
        return plain_loss_sums(model, params["local"], batch, key)

    def policy_sums(params, batch, key):
        return routed_sums(params, batch, key, regularize=True)

    def global_sums(params, batch, key):
        if config.global_step == "global_only":
            return plain_loss_sums(model, params["global"], batch, key)
        return routed_sums(params, batch, key, regularize=False)

    optimizer = config.sgd.optimizer()  # one state per parameter group (group_sgd_step)

    def step_for(loss_sums, *groups):
        return group_sgd_step(loss_sums, groups, optimizer, config.frozen_momentum)

    policy_step = step_for(policy_sums, "policy")
    global_step = step_for(global_sums, "global")

    def alternating(state, batch, key):
        state, _ = policy_step(state, batch, jax.random.fold_in(key, 0))
        return global_step(state, batch, jax.random.fold_in(key, 1))

    def phase_runs(valid, reference_evaluation: bool):
        """``run_epochs`` arguments of the local and the routing phase, and |zeta_g|.

        Under their evaluation a one-batch client's empty ``shard(2, 1)`` stays empty, as
        in their ``*_generalized_test`` (it runs on); their training would divide by its
        size, so there both halves take every example (``flow_reference``)."""
        n = valid.shape[0]
        if config.halves == "random":
            return None  # drawn per client key in train_client
        if config.halves == "none":
            run = dict(member=valid, max_members=n)
            return run, run, jnp.sum(valid)
        reshuffle = config.halves == "shard_reshuffled"
        local_run, global_run = (
            dict(member=valid, max_members=n,
                 batches_fn=shard_batches_fn(valid, config.sgd.batch_size, index, reshuffle, n,
                                             single_batch_uses_all=not reference_evaluation))
            for index in (0, 1))
        # |shard 1| depends only on the client's size, not on the order of the examples.
        return local_run, global_run, jnp.sum(shard_member(valid, config.sgd.batch_size, 1))

    def train_client(params, examples: ClientExamples, key, *, evaluating: bool = False):
        """Steps 1-4 of Algorithm 1: ``(params, snapshot, |zeta_g|, metrics)``.

        ``params`` holds the trained ``global``, ``local`` and ``policy``; ``snapshot`` is
        the global branch after the first routing epoch under the reference evaluation.
        """
        split_key, local_key, routing_key = (jax.random.fold_in(key, i) for i in range(3))
        valid = valid_examples(examples)
        reference_evaluation = evaluating and config.evaluation in ("reference",
                                                                    "reference_policy")
        runs = phase_runs(valid, reference_evaluation)
        if runs is None:
            zeta_l, zeta_g = split_halves(split_key, valid, config.split_ratio)
            local_cap, global_cap = half_capacity(valid.shape[0], config.split_ratio)
            runs = (dict(member=zeta_l, max_members=local_cap),
                    dict(member=zeta_g, max_members=global_cap), jnp.sum(zeta_g))
        local_run, global_run, weight = runs
        x, y, _ = examples.flat()
        start_local = params["local"] if server_local else params["global"]
        groups = {"global": params["global"], "local": start_local, "policy": params["policy"]}
        state = (groups, {group: optimizer.init(p) for group, p in groups.items()})
        common = dict(batch_size=config.sgd.batch_size, **config.sgd.loop)

        local_stats = jnp.zeros((2,), jnp.float32)
        if config.local_route != "global":  # pi-Flow: the second route is the global model
            state, local_stats = run_epochs(step_for(local_sums, "local"), state, x, y,
                                            num_epochs=config.local_epochs, key=local_key,
                                            **common, **local_run)
        run = dict(x=x, y=y, **common, **global_run)
        snapshot = None
        if reference_evaluation:
            # *_generalized_test: one step on the routed loss plus regularizer trains the
            # policy with the global branch (EMNIST) or alone (CIFAR); Acc_g's model is
            # the global branch after the first epoch.
            groups = ("global", "policy") if config.evaluation == "reference" else ("policy",)
            if config.fixed_q0 is not None:  # nothing to learn in the policy
                groups = tuple(group for group in groups if group != "policy")
            joint = step_for(policy_sums, *groups)
            state, routed = run_epochs(joint, state, num_epochs=1,
                                       key=jax.random.fold_in(routing_key, 0), **run)
            snapshot = state[0]["global"]
            if config.routing_epochs > 1:
                state, more = run_epochs(joint, state, num_epochs=config.routing_epochs - 1,
                                         key=jax.random.fold_in(routing_key, 1), **run)
                routed = routed + more
        elif config.fixed_q0 is not None:  # nothing to learn in the policy
            state, routed = run_epochs(global_step, state, num_epochs=config.routing_epochs,
                                       key=routing_key, **run)
        elif config.order == "alternating":
            state, routed = run_epochs(alternating, state, num_epochs=config.routing_epochs,
                                       key=routing_key, **run)
        else:
            phases = [policy_step, global_step]
            if config.order == "global_first":
                phases.reverse()
            for i, phase in enumerate(phases):
                state, stats = run_epochs(phase, state, num_epochs=config.routing_epochs,
                                          key=jax.random.fold_in(routing_key, i), **run)
                # The round's loss is the global step's under every order (alternating's
                # too), never the policy step's objective with its regularizer.
                if phase is global_step:
                    routed = stats
        metrics = {"loss_sum": routed[0], "loss_count": routed[1],
                   "local_loss_sum": local_stats[0], "local_loss_count": local_stats[1]}
        return state[0], snapshot, weight, metrics

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        trained, _, weight, metrics = train_client(params, examples, key)
        sent = ("global", "local", "policy") if server_local else ("global", "policy")
        return ClientResult(params={group: trained[group] for group in sent},
                            weight=weight.astype(jnp.float32), metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        del client_state  # stateless
        trained, snapshot, _, _ = train_client(params, examples, key, evaluating=True)
        personal = dict(trained)
        if snapshot is not None:
            personal["snapshot"] = snapshot
        if config.policy_eval_dropout:
            personal["route_key"] = jax.random.key_data(jax.random.fold_in(key, 3))
        return personal

    def predict(params, personal, x) -> Predictions:
        route_key = personal.get("route_key")
        if route_key is not None:  # the authors' LSTM policies keep dropout on
            q0 = route_q0(route_log_probs(personal["policy"], x, train=True,
                                          key=jax.random.wrap_key_data(route_key)))
        else:
            q0 = route_q0(route_log_probs(personal["policy"], x, train=False))
        route = dict(model=model, global_params=personal["global"],
                     local_params=personal["local"], q0=q0, x=x,
                     recurrence=config.recurrence, fuse_branches=bool(config.fuse_branches),
                     hard_tie=config.hard_tie)
        snapshot = personal.get("snapshot")
        return Predictions(global_logits=forward(model, params["global"], x),
                           personal_hard=routed_forward(**route, hard=True),
                           personal_soft=routed_forward(**route, hard=False), q0=q0,
                           global_snapshot=None if snapshot is None else
                           forward(model, snapshot, x))

    return FederatedAlgorithm(name="flow", model=model, init=init, client_update=client_update,
                              personalize=personalize, predict=predict,
                              for_test_batch=route_key_for_test_batch)
