"""PartialFed-Adaptive: a learned per-layer choice between global and the client's own layers.

Sun et al., "PartialFed: Cross-Domain Personalized Federated Learning via Partial
Initialization", NeurIPS 2021, adaptive variant. Client ``k`` keeps, between the rounds in
which it is sampled, its own model ``v_k`` (the model it trained and sent last time) and a
loading strategy: logits ``a_k [L, 2]`` over (global, previous) per routable layer (zeros,
i.e. 50/50, before its first round). In a round, from the received global params ``w``:

1. both copies of every layer are live: ``G <- w`` and ``P <- v_k``, or ``P <- w`` for a
   client that has not trained yet (it has no model of its own; the paper's clients all
   train from the first round on, when ``w`` is the initial model, so this is its rule
   there; the initial params instead would offer a first-time client untrained layers,
   which it may load and send to the server's mean);
2. for E epochs, on each minibatch, alternately (strategy first):

   a. strategy step: Gumbel noise ``g`` gives the straight-through choice
      ``s = onehot(argmax(a + g)) + (y - stop_gradient(y))``, ``y = softmax((a + g) / tau)``:
      one-hot forward, the soft sample's gradient backward (a plain argmax gives the
      strategy no gradient at all). Layer ``j``'s output is ``s_j0 G_j(h) + (1 - s_j0)
      P_j(h)`` (``routing.routed_forward`` with a per-layer ``q0 = s_j0`` shared by every
      instance), so ``dCE/ds_j0 = <dCE/dh_j, G_j(h) - P_j(h)>``; one SGD step on ``a`` with
      ``strategy_learning_rate`` on the batch-mean CE;
   b. weight step: a fresh hard sample ``c = argmax(a + g')`` of the updated strategy
      loads, per layer, ``W_j = G_j`` if ``c_j`` is global else ``P_j``; one SGD step of the
      plain model's batch-mean CE at ``W`` with ``learning_rate``, written back to the
      loaded copy of each layer only (the other copy does not move, momentum included).
      The loaded model of the first step is the round's partial initialization.

3. the final choice is ``argmax(a)`` per layer (a tie picks global); the trained model
   ``v_k <- load(G, P, argmax a)`` goes to the server with weight ``n_k`` (example-weighted
   mean, as FedAvg) and is stored with ``a`` for the client's next round.

Evaluation: the same training on the client's train split, from the current server params
and the client's stored state (``P <- w`` and zero logits for a client that never trained); the
personalized model is ``load(G, P, argmax a)``. PartialFed personalizes per client, not
per instance, so ``personal_soft = personal_hard`` and ``q0`` is the 0/1 choice per layer,
the same for every instance.

Choices this file makes where the paper's description (and the README's "Baselines as
implemented") does not fix them: the initial strategy (zero logits); strategy-first
alternation with fresh noise for each sample; the strategy gradient through the mixed layer
outputs (so the strategy step runs both copies of every layer, twice the forward cost; the
weight step runs the loaded model only); the final choice by argmax rather than a last
sample; copies not loaded stay put; the strategy's SGD uses the client momentum setting too;
a "layer" is one of the model's routable layers (``model.layer_names``, Flow's units), so on
ResNet-18 the choice is per stage (stem, 4 stages, fc: 6 choices), not per convolution.
With the strategy pinned to global (logits ``(+inf, -inf)`` in effect) a client trains
exactly as FedAvg: same shuffles, same dropout keys, same steps on ``G``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions,
                                     SGDConfig, client_optimizer, instance_weights,
                                     plain_loss_sums, valid_examples)
from flowjax.core.checks import check_fields, positive
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.losses import mean_from_sums, weighted_cross_entropy
from flowjax.core.tree import PyTree, select_tree
from flowjax.models.base import Params, RoutableModel, forward
from flowjax.routing.routed import routed_forward

CHOICES = ("global", "previous")  # the strategy logits' last axis, in this order
# Noise and strategy-dropout keys are folded into the step key with tags far above any
# layer index, so they never equal a layer's dropout key (``layer_key`` folds in j < L)
# and the weight step can use the step key itself, as FedAvg does.
_TAG = 1 << 20
_STRATEGY_NOISE, _STRATEGY_DROPOUT, _WEIGHT_NOISE = _TAG, _TAG + 1, _TAG + 2


@dataclasses.dataclass(frozen=True)
class PartialFedConfig:
    """Client-side hyperparameters.

    Attributes:
      sgd: the SGD of the model weights (epochs E per round and at personalization;
        its momentum also drives the strategy's SGD).
      strategy_learning_rate: SGD learning rate of the strategy logits.
      temperature: Gumbel-softmax temperature of the strategy's soft gradient.
    """

    sgd: SGDConfig
    strategy_learning_rate: float
    temperature: float

    def __post_init__(self):
        check_fields(self, {"strategy_learning_rate": positive, "temperature": positive})


def gumbel_noisy(logits: jax.Array, key: jax.Array) -> jax.Array:
    """``logits + g`` with ``g ~ Gumbel(0, 1)`` i.i.d.; its argmax samples softmax(logits)."""
    return logits + jax.random.gumbel(key, logits.shape, logits.dtype)


def straight_through_choice(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
    """A Gumbel-softmax sample over the last axis: exactly one-hot forward, soft gradient.

    Args:
      logits: ``[..., K]`` unnormalized log-probabilities.
      key: the Gumbel noise key.
      temperature: ``tau > 0`` of the soft sample ``softmax((logits + g) / tau)``.

    Returns:
      ``[..., K]`` whose value is ``onehot(argmax(logits + g))`` and whose gradient is the
      soft sample's.
    """
    noisy = gumbel_noisy(logits, key)
    soft = jax.nn.softmax(noisy / temperature, axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(noisy, axis=-1), logits.shape[-1], dtype=soft.dtype)
    # Adding (soft - soft) keeps the value exactly one-hot (x - x == 0 for finite x);
    # (hard + soft) - soft would round 1 to a neighbouring float.
    return hard + (soft - jax.lax.stop_gradient(soft))


def sample_use_global(logits: jax.Array, key: jax.Array) -> jax.Array:
    """bool ``[L]``: a hard Gumbel-max sample of the strategy; True loads the global layer."""
    return jnp.argmax(gumbel_noisy(logits, key), axis=-1) == 0


def final_use_global(logits: jax.Array) -> jax.Array:
    """bool ``[L]``: the strategy's most likely choice (a tie picks global)."""
    return jnp.argmax(logits, axis=-1) == 0


def load_layers(model: RoutableModel, global_params: Params, previous_params: Params,
                use_global: jax.Array) -> Params:
    """Per layer ``j``, the global copy if ``use_global[j]`` else the previous one, exactly."""
    return {name: jax.tree.map(lambda g, p, j=j: jnp.where(use_global[j], g, p),
                               global_params[name], previous_params[name])
            for j, name in enumerate(model.layer_names)}


def loaded_copies(model: RoutableModel, copies: dict[str, Params],
                  use_global: jax.Array) -> dict[str, Params]:
    """Per leaf of ``{"global": G, "previous": P}``, whether this step loads it: layer
    ``j``'s leaves of ``G`` where ``use_global[j]``, of ``P`` elsewhere."""
    def of_copy(params, loaded):
        return {name: jax.tree.map(lambda _, j=j: loaded[j], params[name])
                for j, name in enumerate(model.layer_names)}
    return {"global": of_copy(copies["global"], use_global),
            "previous": of_copy(copies["previous"], ~use_global)}


def keep_unloaded_state(optimizer: optax.GradientTransformation, new_state: optax.OptState,
                        old_state: optax.OptState, loaded: PyTree) -> optax.OptState:
    """``new_state`` for the parameters ``loaded`` marks, ``old_state`` for the others (a
    copy that is not loaded keeps its momentum: a zero-gradient step would decay it);
    fields that are no parameter's (a step count) come from ``new_state``."""
    keep = optax.tree_utils.tree_map_params(optimizer, lambda _, mask: mask, new_state, loaded,
                                            transform_non_params=lambda _: True)
    return jax.tree.map(lambda new, old, mask: jnp.where(mask, new, old),
                        new_state, old_state, keep)


def per_instance(model: RoutableModel, per_layer: jax.Array, x: jax.Array) -> jax.Array:
    """A per-layer ``[L]`` value as the routing's ``q0`` of shape ``[*instance, L]``."""
    return jnp.broadcast_to(per_layer, x.shape[: model.instance_ndim] + per_layer.shape)


def partialfed(model: RoutableModel, config: PartialFedConfig) -> FederatedAlgorithm:
    """PartialFed-Adaptive for ``model`` (see the module docstring)."""
    weight_optimizer = config.sgd.optimizer()
    strategy_optimizer = client_optimizer(config.strategy_learning_rate, config.sgd.momentum)
    num_layers = model.num_layers

    def init_client_state(params):
        # ``layers`` is only a shape template until the first participation stores v_k.
        return {"layers": params, "logits": jnp.zeros((num_layers, len(CHOICES)), jnp.float32),
                "visited": jnp.asarray(False)}

    def strategy_loss(logits, copies, batch, key):
        x, y, w = batch
        choice = straight_through_choice(logits, jax.random.fold_in(key, _STRATEGY_NOISE),
                                         config.temperature)
        out = routed_forward(model, copies["global"], copies["previous"],
                             per_instance(model, choice[:, 0], x), x, train=True,
                             key=jax.random.fold_in(key, _STRATEGY_DROPOUT))
        return mean_from_sums(*weighted_cross_entropy(out, y, instance_weights(model, y, w)))

    def weight_loss(copies, use_global, batch, key):
        loaded = load_layers(model, copies["global"], copies["previous"], use_global)
        sums = plain_loss_sums(model, loaded, batch, key)
        return mean_from_sums(sums[0], sums[1]), sums

    def step_loaded(copies, updates, loaded):
        """Applies the updates to the copies ``loaded`` (``loaded_copies``) marks; the
        others stay put.

        Selecting ``p + u`` (rather than adding a masked ``u``) keeps the loaded copy's
        update the same expression as FedAvg's, so XLA contracts it the same way and a
        strategy pinned to global reproduces FedAvg bit for bit.
        """
        return jax.tree.map(lambda p, u, m: jnp.where(m, p + u, p), copies, updates, loaded)

    def alternating_step(carry, batch, key):
        (copies, weight_state), (logits, strategy_state) = carry
        grads = jax.grad(strategy_loss)(logits, copies, batch, key)
        updates, strategy_state = strategy_optimizer.update(grads, strategy_state, logits)
        logits = optax.apply_updates(logits, updates)

        use_global = sample_use_global(logits, jax.random.fold_in(key, _WEIGHT_NOISE))
        grads, sums = jax.grad(weight_loss, has_aux=True)(copies, use_global, batch, key)
        updates, new_state = weight_optimizer.update(grads, weight_state, copies)
        loaded = loaded_copies(model, copies, use_global)  # one mask: params and state
        weight_state = keep_unloaded_state(weight_optimizer, new_state, weight_state, loaded)
        copies = step_loaded(copies, updates, loaded)
        return ((copies, weight_state), (logits, strategy_state)), sums

    def train_client(params, examples: ClientExamples, key, client_state):
        """Steps 1-3: ``(trained model, strategy logits, final use_global, loss sums)``."""
        copies = {"global": params,
                  "previous": select_tree(client_state["visited"], client_state["layers"],
                                          params)}
        logits = client_state["logits"]
        carry = ((copies, weight_optimizer.init(copies)),
                 (logits, strategy_optimizer.init(logits)))
        x, y, _ = examples.flat()
        # The shuffles use the client key itself, as FedAvg's local training does.
        carry, sums = run_epochs(alternating_step, carry, x, y, valid_examples(examples),
                                 num_epochs=config.sgd.epochs, batch_size=config.sgd.batch_size,
                                 key=key, **config.sgd.loop)
        (copies, _), (logits, _) = carry
        use_global = final_use_global(logits)
        trained = load_layers(model, copies["global"], copies["previous"], use_global)
        return trained, logits, use_global, sums

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        trained, logits, use_global, sums = train_client(params, examples, key, client_state)
        has_data = (examples.num_examples > 0).astype(jnp.float32)
        metrics = {"loss_sum": sums[0], "loss_count": sums[1],
                   "global_layer_share_sum": has_data * jnp.sum(use_global),
                   "global_layer_share_count": has_data * num_layers}
        # A client without examples keeps its state bit for bit (template included).
        state = select_tree(has_data > 0, {"layers": trained, "logits": logits},
                            {"layers": client_state["layers"], "logits": client_state["logits"]})
        state["visited"] = client_state["visited"] | (has_data > 0)
        return ClientResult(params=trained, weight=examples.num_examples.astype(jnp.float32),
                            metrics=metrics, client_state=state)

    def personalize(params, examples: ClientExamples, key, client_state):
        trained, _, use_global, _ = train_client(params, examples, key, client_state)
        return {"params": trained, "use_global": use_global.astype(jnp.float32)}

    def predict(params, personal, x) -> Predictions:
        personal_logits = forward(model, personal["params"], x)
        return Predictions(global_logits=forward(model, params, x),
                           personal_hard=personal_logits, personal_soft=personal_logits,
                           q0=per_instance(model, personal["use_global"], x))

    return FederatedAlgorithm(name="partialfed", model=model, init=model.init,
                              client_update=client_update, personalize=personalize,
                              predict=predict, init_client_state=init_client_state)
