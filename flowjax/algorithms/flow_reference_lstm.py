"""The authors' Flow for the Shakespeare LSTM, as their code runs it: the reference mode
(``semantics="reference"``) of ``flowjax.algorithms.flow`` for ``shakespeare_lstm``.

Their model (``models/shakespeare_rnn_dynamic_v4.py``, ``ShakespeareNet``) is another
network than the paper's routed model, so this module builds it from the plain model's
layers instead of routing every layer (``flowjax.routing``):

* one embedding **shared** by both branches (``padding_idx=0``: the pad row starts at zero
  and gets no gradient), trained in every phase and averaged by the server;
* two LSTM cells per branch and one dense head per branch; the routed ("personalized")
  model mixes the cells only, at every time step: after layer ``l``'s two cells step, one
  policy network (``ShakespearePolicyNet``, shared by both layers) reads
  ``[embedding_t, h_g, c_g, h_l, c_l]`` and gives ``p = softmax(...)``, ``p[0]`` weighting
  the local and ``p[1]`` the global cell; the mixed ``(h, c)`` becomes the **global**
  cell's state (it feeds the global cell of the next layer and the global cell's next
  step), while the local cells run on their own states; the output is the global head on
  the mixed last-layer state (the local head is trained but never routed);
* hard routing is ``torch.round(p)``, round half to even on both entries (so an exact
  ``p = (1/2, 1/2)`` zeroes the state, as theirs does);
* the policy: ``1032 -> 500 -> 250 -> 100 -> 50 -> 2`` (``policy_hidden`` gives the four
  hidden widths), relu then ``F.dropout(0.3)`` after each hidden layer; ``F.dropout``
  defaults to training mode, so it is on at evaluation too (``policy_eval_dropout``).

Their client procedure (``trainers/client_flow.py``), which this module runs:

* ``shakespeare_train``: one SGD (momentum 0.9) over every parameter for the whole
  update. K1 epochs of the local mode on the even batches (``shard(2, 0)`` of their
  reshuffled loader); then K2 times: an epoch of the routed model on the odd batches
  (``shard(2, 1)``) training the policy and the embedding on CE plus
  ``gamma * mean(-log(p ** 2 + 1e-6))`` over ``probs[:, 1]``, which is the second layer's
  two entries at **time step 1** (their ``probs`` stacks the last layer's ``p`` over time),
  followed by an epoch of the global mode on **every** batch training the global branch
  and the embedding. The client's weight is its number of sequences (their last epoch's
  ``sample_count``), and the server averages every weight.
* ``shakespeare_generalized_test`` (``evaluation="reference"``): a fresh SGD; K1 epochs of
  the local mode on every batch, then K2 epochs of the routed model on every batch with
  every parameter trainable (the local head, outside the routed graph, gets no gradient);
  Acc_g's client snapshot is the net after the first of those epochs, in global mode.

Which parameters move in each phase follows PyTorch: a parameter steps when it has a
gradient, i.e. it is trainable there *and* in the phase's graph. Under ``frozen_momentum``
``"zero_grad"`` (PyTorch < 2.0, which their code was written for) every parameter that
once had a gradient keeps stepping by its momentum; under ``"set_to_none"`` (PyTorch 2.x)
the others stand still. Each layer is its own optimizer group so both rules hold layer by
layer (``flow_reference.group_sgd_step``).

Not theirs: the initialization (flowjax's layers' and flax's ``Dense`` defaults; the pad row
zeroed as PyTorch does), and their ``shuffle(50)`` of snippets before tokenization, which
flowjax replaces by a fresh permutation of the client's sequences per pass
(``halves="shard_reshuffled"``). Single departures cannot be switched on alone here: the
network itself is theirs (``check_config``).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from flowjax.algorithms.base import ClientResult, FederatedAlgorithm, Predictions, instance_weights
from flowjax.algorithms.flow_reference import (REFERENCE_EPSILON, group_sgd_step,
                                               shard_batches_fn)
from flowjax.core.checks import FieldError
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import epoch_batches, run_epochs
from flowjax.core.losses import weighted_cross_entropy
from flowjax.models.base import RoutableModel
from flowjax.models.layers import dropout, lstm_cell, lstm_weights

MODELS = ("shakespeare_lstm",)
PAD_ID = 0
BRANCHES = ("global", "local")
LAYERS = ("lstm1", "lstm2", "dense")
CELLS = ("lstm1", "lstm2")
# The step of the sequence whose last-layer routes their regularizer reads (``probs[:, 1]``).
REGULARIZED_STEP = 1

# Fields of ``FlowConfig`` this procedure fixes, with the only value it runs; a field set to
# anything else is refused (``check_config``).
FIXED = dict(halves="shard_reshuffled", regularizer="reference", global_step="global_only",
             local_init="server", evaluation="reference", order="alternating",
             local_route="local", fixed_q0=None)


class StatePolicy(nn.Module):
    """Their ``ShakespearePolicyNet`` (``lstm=True`` path): route logits ``[..., 2]``,
    index 0 weighting the local cell, 1 the global one."""

    hidden: Sequence[int]
    dropout_rate: float

    @nn.compact
    def __call__(self, features: jax.Array, key: jax.Array | None) -> jax.Array:
        h = features
        for i, width in enumerate(self.hidden):
            h = nn.relu(nn.Dense(width, name=f"dense{i}")(h))
            if key is not None:  # F.dropout: on whenever a key is given
                h = dropout(h, self.dropout_rate, True, jax.random.fold_in(key, i))
        return nn.Dense(2, name="exit")(h)


def check_config(config: Any, model: RoutableModel) -> None:
    """Refuses a ``FlowConfig`` asking this procedure for what it does not run."""
    if model.layer_names != ("embedding",) + LAYERS:
        raise FieldError("semantics", "reference", f"expected a model with layers "
                         f"{('embedding',) + LAYERS}, got {model.layer_names}")
    for name, value in FIXED.items():
        if getattr(config, name) != value:
            raise FieldError(name, getattr(config, name), f"expected {value!r} with "
                             f"semantics='reference' on {model.name}: the authors' LSTM "
                             f"procedure runs as one unit")
    if len(config.policy_hidden) < 1:
        raise FieldError("policy_hidden", config.policy_hidden, "expected hidden widths")


def flat_groups(params: dict) -> dict:
    """``{embedding, global, local, policy}`` params as one optimizer group per layer."""
    groups = {"embedding": params["embedding"], "policy": params["policy"]}
    for branch in BRANCHES:
        groups.update({f"{branch}/{layer}": params[branch][layer] for layer in LAYERS})
    return groups


def nested_groups(groups: dict) -> dict:
    """The inverse of ``flat_groups``."""
    params = {"embedding": groups["embedding"], "policy": groups["policy"]}
    for branch in BRANCHES:
        params[branch] = {layer: groups[f"{branch}/{layer}"] for layer in LAYERS}
    return params


def branch_groups(branch: str) -> tuple[str, ...]:
    return ("embedding",) + tuple(f"{branch}/{layer}" for layer in LAYERS)


# Which groups have a gradient in each phase (trainable there and in its graph).
LOCAL_PHASE = branch_groups("local")
GLOBAL_PHASE = branch_groups("global")
POLICY_PHASE = ("embedding", "policy")
JOINT_PHASE = ("embedding", "policy", "global/lstm1", "global/lstm2", "global/dense",
               "local/lstm1", "local/lstm2")


def torch_bias(layer_params: dict) -> dict:
    """An LSTM layer's params whose bias learns as PyTorch's ``LSTMCell``'s.

    ``LSTMCell`` has two biases, ``b_ih`` and ``b_hh``, and both receive the gradient of
    their sum, so under SGD (with or without momentum, which is linear) the sum moves twice
    as far per step as one bias would. ``2 b - stop_gradient(b)`` has the value ``b``
    exactly (``2 b`` is exact and so is the subtraction) and twice its gradient.
    """
    b = layer_params["bias"]
    return {**layer_params, "bias": 2.0 * b - lax.stop_gradient(b)}


def plan_batches(key: jax.Array, valid: jax.Array, batch_size: int, epochs: int,
                 half: int | None) -> tuple[jax.Array, jax.Array]:
    """``epochs`` passes of their reshuffled loader: ``(indices [E, S, B], mask [E, S, B])``
    of every batch (``half`` None) or of ``shard(2, half)``; pass ``e`` draws from
    ``fold_in(key, e)``."""
    n = valid.shape[0]
    if half is None:
        one = lambda k: epoch_batches(k, valid, batch_size, n)  # noqa: E731
    else:
        shard = shard_batches_fn(valid, batch_size, half, True, n)
        one = lambda k: shard(k, 0)  # noqa: E731
    return jax.vmap(one)(jax.vmap(lambda e: jax.random.fold_in(key, e))(jnp.arange(epochs)))


def train_plan(key: jax.Array, valid: jax.Array, batch_size: int, local_epochs: int,
               routing_epochs: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The batches of ``shakespeare_train`` for a client update with ``key``: the local
    phase's even batches, and per routing epoch the policy's odd batches and the global
    phase's batches (``launch/parity.py`` feeds their loop the same)."""
    return {"local": plan_batches(jax.random.fold_in(key, 0), valid, batch_size,
                                  local_epochs, 0),
            "policy": plan_batches(jax.random.fold_in(key, 1), valid, batch_size,
                                   routing_epochs, 1),
            "global": plan_batches(jax.random.fold_in(key, 2), valid, batch_size,
                                   routing_epochs, None)}


def evaluation_plan(key: jax.Array, valid: jax.Array, batch_size: int, local_epochs: int,
                    routing_epochs: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The batches of ``shakespeare_generalized_test`` (every batch in both phases)."""
    return {"local": plan_batches(jax.random.fold_in(key, 0), valid, batch_size,
                                  local_epochs, None),
            "joint": plan_batches(jax.random.fold_in(key, 1), valid, batch_size,
                                  routing_epochs, None)}


def reference_lstm(model: RoutableModel, config: Any) -> FederatedAlgorithm:
    """The authors' Flow procedure for ``model`` (``shakespeare_lstm``), with ``config``'s
    SGD, gamma, epochs, policy widths and dropout, ``frozen_momentum`` and
    ``policy_eval_dropout`` (module docstring)."""
    check_config(config, model)
    policy = StatePolicy(hidden=tuple(config.policy_hidden), dropout_rate=config.policy_dropout)
    batch_size = config.sgd.batch_size
    optimizer = config.sgd.optimizer()

    def embed(groups, x):
        table = groups["embedding"]["embedding"]
        e = jnp.take(table, x, axis=0)
        # padding_idx: the pad row's lookups pass their value but no gradient.
        return jnp.where((x == PAD_ID)[..., None], lax.stop_gradient(e), e)

    def branch_logits(groups, branch, x):
        """Their ``mode='global'`` / ``'local'``: the plain model of one branch."""
        h = embed(groups, x)
        for j, layer in enumerate(LAYERS, start=1):
            layer_params = groups[f"{branch}/{layer}"]
            if layer in CELLS:
                layer_params = torch_bias(layer_params)
            h = model.layer_apply(j, layer_params, h)
            h = model.glue_apply(j, h, False, jax.random.key(0))
        return h

    def routed(groups, x, *, hard: bool, key: jax.Array | None):
        """Their ``mode='personalized'``: ``(logits, p [B, T, L, 2])``, p[..., 0] local."""
        e = embed(groups, x)
        weights = {name: lstm_weights(torch_bias(groups[name])) for name in
                   (f"{branch}/{cell}" for branch in BRANCHES for cell in CELLS)}
        batch, steps = x.shape
        hidden = weights["global/lstm1"][1].shape[0]
        zeros = jnp.zeros((batch, hidden), e.dtype)

        def cell(name, inputs, h, c):
            w_x, w_h, b = weights[name]
            h, c, _ = lstm_cell(inputs @ w_x + b + h @ w_h, c)
            return h, c

        def route(e_t, state_g, state_l, step_key):
            features = jnp.concatenate([e_t, *state_g, *state_l], axis=-1)
            p = jax.nn.softmax(policy.apply({"params": groups["policy"]}, features, step_key),
                               axis=-1)
            return jnp.round(p) if hard else p

        def step(carry, inputs):
            e_t, t = inputs
            new_carry, probs = [], []
            below_g, below_l = e_t, e_t
            for layer, cell_name in enumerate(CELLS):
                (h_g, c_g), (h_l, c_l) = carry[2 * layer], carry[2 * layer + 1]
                h_g, c_g = cell(f"global/{cell_name}", below_g, h_g, c_g)
                h_l, c_l = cell(f"local/{cell_name}", below_l, h_l, c_l)
                step_key = None if key is None else jax.random.fold_in(
                    jax.random.fold_in(key, t), layer)
                p = route(e_t, (h_g, c_g), (h_l, c_l), step_key)
                # torch.bmm(p [B, 1, 2], [local, global] [B, 2, H])
                h_g = p[:, :1] * h_l + p[:, 1:] * h_g
                c_g = p[:, :1] * c_l + p[:, 1:] * c_g
                new_carry += [(h_g, c_g), (h_l, c_l)]
                probs.append(p)
                below_g, below_l = h_g, h_l
            return tuple(new_carry), (below_g, jnp.stack(probs, axis=1))

        start = tuple((zeros, zeros) for _ in range(2 * len(CELLS)))
        _, (hs, probs) = lax.scan(step, start, (jnp.swapaxes(e, 0, 1), jnp.arange(steps)))
        logits = model.layer_apply(len(LAYERS), groups["global/dense"], jnp.swapaxes(hs, 0, 1))
        return logits, jnp.swapaxes(probs, 0, 1)

    def branch_sums(branch):
        def sums(groups, batch, key):
            del key
            x, y, w = batch
            logits = branch_logits(groups, branch, x)
            return jnp.stack(weighted_cross_entropy(logits, y, instance_weights(model, y, w)))
        return sums

    def routed_sums(groups, batch, key):
        """CE of the routed model plus their regularizer, in ``[sum, count]`` form."""
        x, y, w = batch
        dropout_key = key if config.policy_dropout > 0 else None
        logits, probs = routed(groups, x, hard=False, key=dropout_key)
        ce_sum, count = weighted_cross_entropy(logits, y, instance_weights(model, y, w))
        if config.gamma > 0:
            entries = probs[:, REGULARIZED_STEP, -1, :]  # [B, 2]: both entries, last layer
            terms = jnp.mean(-jnp.log(entries ** 2 + REFERENCE_EPSILON), axis=-1)
            regularizer = jnp.sum(terms * w) / jnp.maximum(jnp.sum(w), 1e-12)
            ce_sum = ce_sum + config.gamma * count * regularizer  # a batch mean, as theirs
        return jnp.stack([ce_sum, count])

    def step_for(loss_sums, active):
        return group_sgd_step(loss_sums, active, optimizer, config.frozen_momentum)

    local_step = step_for(branch_sums("local"), LOCAL_PHASE)
    global_step = step_for(branch_sums("global"), GLOBAL_PHASE)
    policy_step = step_for(routed_sums, POLICY_PHASE)
    joint_step = step_for(routed_sums, JOINT_PHASE)

    def init(key):
        global_key, local_key, policy_key = jax.random.split(key, 3)
        global_params, local_params = model.init(global_key), model.init(local_key)
        table = global_params["embedding"]["embedding"]
        features = table.shape[1] + 4 * global_params["lstm1"]["recurrent_kernel"].shape[0]
        return {"embedding": {"embedding": table.at[PAD_ID].set(0.0)},  # as padding_idx
                "global": {layer: global_params[layer] for layer in LAYERS},
                "local": {layer: local_params[layer] for layer in LAYERS},
                "policy": policy.init(policy_key, jnp.zeros((1, features)), None)["params"]}

    def start_state(params):
        groups = flat_groups(params)
        return groups, {name: optimizer.init(p) for name, p in groups.items()}

    def run(step, state, x, y, batches, epoch_key):
        """Epochs of ``step`` over planned ``batches`` ``(indices [E, S, B], mask)``."""
        indices, mask = batches
        member = jnp.ones(x.shape[:1], bool)  # unused: the batches are planned
        return run_epochs(step, state, x, y, member, num_epochs=indices.shape[0],
                          batch_size=batch_size, key=epoch_key,
                          batches_fn=lambda _, e: (indices[e], mask[e]))

    def train(params, examples: ClientExamples, key):
        """``shakespeare_train``: ``(params, weight, metrics)``."""
        x, y, valid = examples.flat()
        plan = train_plan(key, valid, batch_size, config.local_epochs, config.routing_epochs)
        step_keys = jax.random.fold_in(key, 3)  # the steps' dropout keys
        state, local_stats = run(local_step, start_state(params), x, y, plan["local"],
                                 jax.random.fold_in(step_keys, 0))

        def epoch(state, inputs):
            index, policy_batches, global_batches = inputs
            epoch_key = jax.random.fold_in(jax.random.fold_in(step_keys, 1), index)
            state, _ = run(policy_step, state, x, y, jax.tree.map(lambda a: a[None],
                                                                   policy_batches),
                           jax.random.fold_in(epoch_key, 0))
            return run(global_step, state, x, y, jax.tree.map(lambda a: a[None], global_batches),
                       jax.random.fold_in(epoch_key, 1))

        state, stats = lax.scan(epoch, state, (jnp.arange(config.routing_epochs),
                                               plan["policy"], plan["global"]))
        metrics = {"loss_sum": stats[-1, 0], "loss_count": stats[-1, 1],
                   "local_loss_sum": local_stats[0], "local_loss_count": local_stats[1]}
        return nested_groups(state[0]), jnp.sum(valid).astype(jnp.float32), metrics

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        trained, weight, metrics = train(params, examples, key)
        return ClientResult(params=trained, weight=weight, metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        """``shakespeare_generalized_test``'s training: the personal net and the snapshot."""
        del client_state  # stateless
        x, y, valid = examples.flat()
        plan = evaluation_plan(key, valid, batch_size, config.local_epochs,
                               config.routing_epochs)
        step_keys = jax.random.fold_in(key, 3)
        state, _ = run(local_step, start_state(params), x, y, plan["local"],
                       jax.random.fold_in(step_keys, 0))
        first, rest = (jax.tree.map(lambda a: a[:1], plan["joint"]),
                       jax.tree.map(lambda a: a[1:], plan["joint"]))
        state, _ = run(joint_step, state, x, y, first, jax.random.fold_in(step_keys, 1))
        snapshot = state[0]
        if config.routing_epochs > 1:
            state, _ = run(joint_step, state, x, y, rest, jax.random.fold_in(step_keys, 2))
        personal = {"groups": state[0], "snapshot": snapshot}
        if config.policy_eval_dropout and config.policy_dropout > 0:
            personal["route_key"] = jax.random.key_data(jax.random.fold_in(key, 4))
        return personal

    def predict(params, personal, x) -> Predictions:
        route_key = personal.get("route_key")
        key = None if route_key is None else jax.random.wrap_key_data(route_key)
        hard, _ = routed(personal["groups"], x, hard=True, key=key)
        soft, probs = routed(personal["groups"], x, hard=False, key=key)
        return Predictions(global_logits=branch_logits(flat_groups(params), "global", x),
                           personal_hard=hard, personal_soft=soft, q0=probs[..., 1],
                           global_snapshot=branch_logits(personal["snapshot"], "global", x))

    return FederatedAlgorithm(name="flow", model=model, init=init, client_update=client_update,
                              personalize=personalize, predict=predict)
