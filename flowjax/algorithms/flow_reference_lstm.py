"""The authors' Flow for the LSTMs, as their code runs it: the reference mode
(``semantics="reference"``) of ``flowjax.algorithms.flow`` for ``shakespeare_lstm`` and
``stackoverflow_lstm``.

Their LSTM models are other networks than the paper's routed model, so this module builds
them from the plain model's layers instead of routing every layer (``flowjax.routing``).
Common to both:

* one embedding **shared** by both branches (``padding_idx=0``: the pad row starts at zero
  and gets no gradient), trained in every phase and averaged by the server;
* per branch the LSTM cells and dense layers of the plain model; at every time step, after
  an LSTM layer's two cells step, a policy reads the step's embedding and the cells'
  states and gives ``p = softmax(...)``, ``p[0]`` weighting the local and ``p[1]`` the
  global cell; the mixed ``(h, c)`` becomes the **global** cell's state (it feeds the
  global cell's next step and the layer above), while the local cells run on their own;
* hard routing is ``torch.round(p)``, round half to even on both entries (so an exact
  ``p = (1/2, 1/2)`` zeroes what it mixes, as theirs does);
* the policy's state path is ``in -> 500 -> 250 -> 100 -> 50 -> 2`` (``policy_hidden``
  gives the four hidden widths), relu then ``F.dropout(0.3)`` after each hidden layer;
  ``F.dropout`` defaults to training mode, so it is on at evaluation too
  (``policy_eval_dropout``);
* their regularizer is ``gamma * mean(-log(e ** 2 + 1e-6))`` over the entries they index.

Shakespeare (``models/shakespeare_rnn_dynamic_v4.py``, ``ShakespeareNet``): two LSTM layers
and one policy shared by both, reading ``[embedding_t, h_g, c_g, h_l, c_l]``; the output is
the global head on the mixed last state (the local head is trained but never routed); the
regularizer reads ``probs[:, 1]``, the last layer's two entries at **time step 1**.

Stack Overflow (``models/stackoverflow_nwp_rnn_dynamic_v4.py``, ``StackoverflowNet``): one
LSTM layer, its policy reading ``[embedding_t, h_g, h_l]``; then both branches' first dense
layer read the **mixed** hidden states, and a second policy path (``2 * dense -> 75 -> 30``,
exit ``30 -> 2``, and ``30 -> 10``, exit ``10 -> 2``; relu on both exits' logits, dropout
after each hidden layer) reads ``[global_x, local_x]`` per position and gives two routes
whose ``[0]`` weights the **global** branch: one mixes the first dense layers' outputs,
which both second dense layers read, the other mixes the logits. The regularizer is their
mean over ``probs[:, :, :, 1]`` of a ``[B, T + 2, T, 2]`` stack: each LSTM route repeated
``T`` times, then the two dense routes (their model writes ``T = 20`` in).

Their client procedures (``trainers/client_flow.py``), which this module runs: one SGD
(momentum 0.9) over every parameter for the whole update; K1 epochs of the local mode on
the even batches (``shard(2, 0)`` of their reshuffled loader), then

* ``shakespeare_train``: K2 times an epoch of the routed model on the odd batches
  (``shard(2, 1)``) training the policy and the embedding on CE plus the regularizer,
  then an epoch of the global mode on **every** batch training the global branch and the
  embedding; the client's weight is its number of sequences;
* ``stackoverflow_nwp_train``: K2 epochs over the odd batches, each batch a policy step
  (policy and embedding) and then a global step (global branch and embedding), as their
  EMNIST code; the weight is the number of sequences in the odd batches.

The server averages every weight. Their evaluation (``*_generalized_test``,
``evaluation="reference"``) starts a fresh SGD: Shakespeare trains the local mode K1
epochs and then every parameter jointly K2 epochs on the routed loss, both on **every**
batch; Stack Overflow trains the local mode on the even and then the policy and embedding
on the odd batches. Acc_g's client snapshot is the net after the first routed epoch, in
global mode (its embedding fine-tuned on the client).

Which parameters move in each phase follows PyTorch: a parameter steps when it has a
gradient, i.e. it is trainable there *and* in the phase's graph. Under ``frozen_momentum``
``"zero_grad"`` (PyTorch < 2.0, which their code was written for) every parameter that
once had a gradient keeps stepping by its momentum; under ``"set_to_none"`` (PyTorch 2.x)
the others stand still. Each layer is its own optimizer group so both rules hold layer by
layer (``base.group_sgd_step``).

A client with one batch: its odd batches are empty. Shakespeare's training and Stack
Overflow's evaluation loop over them and go on, and so does this module (no policy or
joint step); Stack Overflow's training would divide by their size, and there the
tiny-client rule gives both halves every sequence (``flow_reference``).

Not theirs: a batch whose targets are all padding (possible in Shakespeare only, a
snippet's last chunks) has a mean loss of 0 here, where their ``CrossEntropyLoss(
ignore_index=0)`` gives NaN; the initialization unless the run sets
``model_init="torch"`` (by default flowjax's layers' and flax's ``Dense`` defaults, the
pad row zeroed as PyTorch does; with it PyTorch's, policies included:
``models.torch_init``), and Shakespeare's ``shuffle(50)`` of
snippets before tokenization,
which flowjax replaces by a fresh permutation of the client's sequences per pass
(``halves="shard_reshuffled"``; their Stack Overflow buffer holds the whole client, so
there it is the same). Single departures cannot be switched on alone here: the network
itself is theirs (``check_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions,
                                     group_sgd_step, instance_weights)
from flowjax.algorithms.flow_reference import (epochs_with_snapshot,
                                               instance_mean, reference_terms,
                                               refuse_other_values, refuse_set_fields,
                                               route_key_for_test_batch, run_planned,
                                               shard_batches_fn)
from flowjax.core.checks import FieldError
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import epoch_batches
from flowjax.core.losses import weighted_cross_entropy
from flowjax.models.base import RoutableModel
from flowjax.models.layers import (dropout, lstm_cell, lstm_weights, torch_lstm_bias,
                                   torch_padding_lookups)
from flowjax.models.torch_init import drawn_in_style

PAD_ID = 0
BRANCHES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class Net:
    """What differs between their two LSTM networks and procedures.

    Attributes:
      layers: the plain model's layers after the embedding (its ``layer_names[1:]``).
      cells: those that are LSTMs, routed at every step by the state policy.
      cell_states: the policy reads each cell's ``(h, c)`` (Shakespeare) or ``h`` only.
      global_epoch_on_every_batch: the global phase is an epoch of its own over every
        batch after each policy epoch (Shakespeare), not a step after each policy step
        on the same odd batch (Stack Overflow).
      evaluation_on_every_batch: their evaluation trains on every batch in both phases
        (Shakespeare) or on the even, then the odd batches.
      evaluation_trains_branches: their evaluation's routed phase trains the branches
        too (Shakespeare), not only the policy and the embedding.
    """

    layers: tuple[str, ...]
    cells: tuple[str, ...]
    cell_states: bool
    global_epoch_on_every_batch: bool
    evaluation_on_every_batch: bool
    evaluation_trains_branches: bool


NETS = {
    "shakespeare_lstm": Net(layers=("lstm1", "lstm2", "dense"), cells=("lstm1", "lstm2"),
                            cell_states=True, global_epoch_on_every_batch=True,
                            evaluation_on_every_batch=True, evaluation_trains_branches=True),
    "stackoverflow_lstm": Net(layers=("lstm", "dense1", "dense2"), cells=("lstm",),
                              cell_states=False, global_epoch_on_every_batch=False,
                              evaluation_on_every_batch=False,
                              evaluation_trains_branches=False),
}
MODELS = tuple(NETS)
# The step of the sequence whose last-layer routes Shakespeare's regularizer reads
# (``probs[:, 1]``).
REGULARIZED_STEP = 1
# Stack Overflow's second policy path (``linear_1``, ``linear_2``, ``linear_3``).
OUTPUT_POLICY_HIDDEN = (75, 30, 10)

# Fields of ``FlowConfig`` these procedures fix, with the only value they run; a field set
# to anything else is refused (``check_config``).
FIXED = dict(halves="shard_reshuffled", regularizer="reference", global_step="global_only",
             local_init="server", evaluation="reference", order="alternating",
             local_route="local", fixed_q0=None, hard_tie="zeroed")


class StatePolicy(nn.Module):
    """Their policy's ``lstm=True`` path: route logits ``[..., 2]``, index 0 weighting the
    local cell, 1 the global one."""

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


class OutputPolicy(nn.Module):
    """``StackoverflowPolicyNet``'s ``lstm=False`` path: two route logits ``[..., 2]`` (the
    first dense layers' mix, the logits' mix), index 0 weighting the global branch."""

    dropout_rate: float

    @nn.compact
    def __call__(self, features: jax.Array, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        def drop(h, i):
            if key is None:
                return h
            return dropout(h, self.dropout_rate, True, jax.random.fold_in(key, i))

        first, second, third = OUTPUT_POLICY_HIDDEN
        h = drop(nn.relu(nn.Dense(first, name="linear1")(features)), 0)
        h = drop(nn.relu(nn.Dense(second, name="linear2")(h)), 1)
        mix_dense = nn.relu(nn.Dense(2, name="exit2")(h))
        h = drop(nn.relu(nn.Dense(third, name="linear3")(h)), 2)
        return mix_dense, nn.relu(nn.Dense(2, name="exit3")(h))


# Fields of the paper's routed model that their networks have no use for: set, they are
# refused rather than ignored (``check_unused``, on the config as given).
UNUSED = ("recurrence", "policy_last", "fuse_branches")


def check_unused(config: Any, model_name: str) -> None:
    """Refuses a field ``config`` sets that the reference LSTMs would silently ignore."""
    refuse_set_fields(config, UNUSED, model_name, "LSTM")


def check_config(config: Any, model: RoutableModel) -> None:
    """Refuses a resolved ``FlowConfig`` asking these procedures for what they do not
    run."""
    net = NETS.get(model.name)
    if net is None or model.layer_names != ("embedding",) + net.layers:
        raise FieldError("semantics", "reference", f"expected one of the authors' LSTM "
                         f"models {list(MODELS)}, got {model.name} {model.layer_names}")
    refuse_other_values(config, FIXED, model.name, "LSTM")


def flat_groups(params: dict, net: Net) -> dict:
    """``{embedding, global, local, policy}`` params as one optimizer group per layer."""
    groups = {"embedding": params["embedding"], "policy": params["policy"]}
    for branch in BRANCHES:
        groups.update({f"{branch}/{layer}": params[branch][layer] for layer in net.layers})
    return groups


def nested_groups(groups: dict, net: Net) -> dict:
    """The inverse of ``flat_groups``."""
    params = {"embedding": groups["embedding"], "policy": groups["policy"]}
    for branch in BRANCHES:
        params[branch] = {layer: groups[f"{branch}/{layer}"] for layer in net.layers}
    return params


def branch_groups(branch: str, net: Net) -> tuple[str, ...]:
    return ("embedding",) + tuple(f"{branch}/{layer}" for layer in net.layers)


def plan_batches(key: jax.Array, valid: jax.Array, batch_size: int, epochs: int,
                 half: int | None, single_batch_uses_all: bool = True
                 ) -> tuple[jax.Array, jax.Array]:
    """``epochs`` passes of their reshuffled loader: ``(indices [E, S, B], mask [E, S, B])``
    of every batch (``half`` None) or of ``shard(2, half)``; pass ``e`` draws from
    ``fold_in(key, e)``; ``single_batch_uses_all``: ``flow_reference.shard_member``'s."""
    n = valid.shape[0]
    if half is None:
        one = lambda k: epoch_batches(k, valid, batch_size, n)  # noqa: E731
    else:
        shard = shard_batches_fn(valid, batch_size, half, True, n,
                                 single_batch_uses_all=single_batch_uses_all)
        one = lambda k: shard(k, 0)  # noqa: E731
    return jax.vmap(one)(jax.vmap(lambda e: jax.random.fold_in(key, e))(jnp.arange(epochs)))


def train_plan(net: Net, key: jax.Array, valid: jax.Array, batch_size: int,
               local_epochs: int, routing_epochs: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The batches of their client update for ``key``: the local phase's even batches, the
    routing epochs' odd batches and, where the global phase has epochs of its own, theirs
    (``launch/parity.py`` feeds their loop the same)."""
    # A one-batch client's policy half is empty. Where their global phase has epochs of
    # its own (Shakespeare), which weigh the client, it stays empty, as theirs; where the
    # client is weighed by that half (Stack Overflow) theirs divides by zero, and the
    # tiny-client rule gives it every example.
    plan = {"local": plan_batches(jax.random.fold_in(key, 0), valid, batch_size,
                                  local_epochs, 0),
            "policy": plan_batches(jax.random.fold_in(key, 1), valid, batch_size,
                                   routing_epochs, 1,
                                   single_batch_uses_all=not net.global_epoch_on_every_batch)}
    if net.global_epoch_on_every_batch:
        plan["global"] = plan_batches(jax.random.fold_in(key, 2), valid, batch_size,
                                      routing_epochs, None)
    return plan


def evaluation_plan(net: Net, key: jax.Array, valid: jax.Array, batch_size: int,
                    local_epochs: int, routing_epochs: int
                    ) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The batches of their evaluation's training for ``key``."""
    every = net.evaluation_on_every_batch
    # Their evaluation runs on with a one-batch client's empty shard 1: no joint step.
    return {"local": plan_batches(jax.random.fold_in(key, 0), valid, batch_size,
                                  local_epochs, None if every else 0),
            "joint": plan_batches(jax.random.fold_in(key, 1), valid, batch_size,
                                  routing_epochs, None if every else 1,
                                  single_batch_uses_all=False)}


def build(model: RoutableModel, config: Any) -> FederatedAlgorithm:
    """The authors' Flow procedure for ``model`` (an LSTM of ``NETS``), with ``config``'s
    SGD, gamma, epochs, policy widths and dropout, ``frozen_momentum`` and
    ``policy_eval_dropout`` (module docstring)."""
    check_config(config, model)
    net = NETS[model.name]
    state_policy = StatePolicy(hidden=tuple(config.policy_hidden),
                               dropout_rate=config.policy_dropout)
    output_policy = None if net.cell_states else OutputPolicy(config.policy_dropout)
    batch_size = config.sgd.batch_size
    optimizer = config.sgd.optimizer()
    layer_index = {layer: j for j, layer in enumerate(model.layer_names)}

    def embed(groups, x):
        table = groups["embedding"]["embedding"]
        return torch_padding_lookups(jnp.take(table, x, axis=0), x)  # padding_idx=0

    def apply(groups, branch, layer, h):
        params = groups[f"{branch}/{layer}"]
        if layer in net.cells:
            params = torch_lstm_bias(params)
        j = layer_index[layer]
        return model.glue_apply(j, model.layer_apply(j, params, h), False, jax.random.key(0))

    def branch_logits(groups, branch, x):
        """Their ``mode='global'`` / ``'local'``: the plain model of one branch."""
        h = embed(groups, x)
        for layer in net.layers:
            h = apply(groups, branch, layer, h)
        return h

    def mixed_cells(groups, e, key, rounded):
        """The routed recurrence: the last cell's mixed hidden states ``[B, T, H]`` and the
        state policy's routes ``[B, T, cells, 2]`` (index 0 local)."""
        weights = {name: lstm_weights(torch_lstm_bias(groups[name])) for name in
                   (f"{branch}/{cell}" for branch in BRANCHES for cell in net.cells)}
        batch = e.shape[0]
        hidden = weights[f"global/{net.cells[0]}"][1].shape[0]
        zeros = jnp.zeros((batch, hidden), e.dtype)

        def cell(name, inputs, h, c):
            w_x, w_h, b = weights[name]
            h, c, _ = lstm_cell(inputs @ w_x + b + h @ w_h, c)
            return h, c

        def step(carry, inputs):
            e_t, t = inputs
            new_carry, probs = [], []
            below_g, below_l = e_t, e_t
            for layer, name in enumerate(net.cells):
                (h_g, c_g), (h_l, c_l) = carry[2 * layer], carry[2 * layer + 1]
                h_g, c_g = cell(f"global/{name}", below_g, h_g, c_g)
                h_l, c_l = cell(f"local/{name}", below_l, h_l, c_l)
                read = (h_g, c_g, h_l, c_l) if net.cell_states else (h_g, h_l)
                step_key = None if key is None else jax.random.fold_in(
                    jax.random.fold_in(key, t), layer)
                logits = state_policy.apply({"params": groups["policy"]["states"]},
                                            jnp.concatenate([e_t, *read], axis=-1), step_key)
                p = rounded(jax.nn.softmax(logits, axis=-1))
                # torch.bmm(p [B, 1, 2], [local, global] [B, 2, H])
                h_g = p[:, :1] * h_l + p[:, 1:] * h_g
                c_g = p[:, :1] * c_l + p[:, 1:] * c_g
                new_carry += [(h_g, c_g), (h_l, c_l)]
                probs.append(p)
                below_g, below_l = h_g, h_l
            return tuple(new_carry), (below_g, jnp.stack(probs, axis=1))

        start = tuple((zeros, zeros) for _ in range(2 * len(net.cells)))
        _, (hs, probs) = lax.scan(step, start, (jnp.swapaxes(e, 0, 1),
                                                jnp.arange(e.shape[1])))
        return jnp.swapaxes(hs, 0, 1), jnp.swapaxes(probs, 0, 1)

    def routed(groups, x, *, hard: bool, key: jax.Array | None):
        """Their ``mode='personalized'``: ``(logits, q0 [B, T, L], regularizer [B])``,
        ``q0`` the global branch's weight at each routed layer."""
        # torch.round(p) for hard routes, on both entries (round half to even).
        rounded = jnp.round if hard else (lambda p: p)
        cells_key = None if key is None else jax.random.fold_in(key, 0)
        hs, probs = mixed_cells(groups, embed(groups, x), cells_key, rounded)
        if net.cell_states:  # Shakespeare: the global head on the mixed last state
            logits = apply(groups, "global", net.layers[-1], hs)
            q0 = probs[..., 1]
            entries = probs[:, REGULARIZED_STEP, -1, :]  # [B, 2]
            return logits, q0, jnp.mean(reference_terms(entries), axis=-1)
        first, second = net.layers[1:]
        x_g, x_l = apply(groups, "global", first, hs), apply(groups, "local", first, hs)
        dense_key = None if key is None else jax.random.fold_in(key, 1)
        mix_dense, mix_logits = output_policy.apply(
            {"params": groups["policy"]["outputs"]}, jnp.concatenate([x_g, x_l], axis=-1),
            dense_key)
        p1 = rounded(jax.nn.softmax(mix_dense, axis=-1))  # index 0: global
        mixed = p1[..., :1] * x_g + p1[..., 1:] * x_l
        p2 = rounded(jax.nn.softmax(mix_logits, axis=-1))
        logits = (apply(groups, "global", second, mixed) * p2[..., :1]
                  + apply(groups, "local", second, mixed) * p2[..., 1:])
        q0 = jnp.concatenate([probs[..., 1], p1[..., :1], p2[..., :1]], axis=-1)
        # mean of their [B, T + 2, T] stack: each LSTM route T times, then p1's, p2's.
        steps = x.shape[1]
        total = (steps * jnp.sum(reference_terms(probs[..., 0, 1]), axis=-1)
                 + jnp.sum(reference_terms(p1[..., 1]), axis=-1)
                 + jnp.sum(reference_terms(p2[..., 1]), axis=-1))
        return logits, q0, total / ((steps + 2) * steps)

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
        logits, _, regularizer = routed(groups, x, hard=False, key=dropout_key)
        ce_sum, count = weighted_cross_entropy(logits, y, instance_weights(model, y, w))
        if config.gamma > 0:  # a batch mean, as theirs, over the batch's real sequences
            ce_sum = ce_sum + config.gamma * count * instance_mean(regularizer, w)
        return jnp.stack([ce_sum, count])

    def step_for(loss_sums, active):
        return group_sgd_step(loss_sums, active, optimizer, config.frozen_momentum)

    local_step = step_for(branch_sums("local"), branch_groups("local", net))
    global_step = step_for(branch_sums("global"), branch_groups("global", net))
    policy_step = step_for(routed_sums, ("embedding", "policy"))
    # Shakespeare's evaluation trains every parameter in the routed graph (the local head
    # is outside it); Stack Overflow's only the policy and the embedding.
    joint_groups = ("embedding", "policy")
    if net.evaluation_trains_branches:
        joint_groups += tuple(f"global/{layer}" for layer in net.layers) + tuple(
            f"local/{cell}" for cell in net.cells)
    joint_step = step_for(routed_sums, joint_groups)

    def alternating(state, batch, key):
        state, _ = policy_step(state, batch, jax.random.fold_in(key, 0))
        return global_step(state, batch, jax.random.fold_in(key, 1))

    def init(key):
        global_key, local_key, policy_key = jax.random.split(key, 3)
        global_params, local_params = model.init(global_key), model.init(local_key)
        table = global_params["embedding"]["embedding"]
        read = 4 if net.cell_states else 2
        hidden = global_params[net.cells[0]]["recurrent_kernel"].shape[0]
        states_key, outputs_key = policy_key, jax.random.fold_in(policy_key, 1)
        states = state_policy.init(states_key, jnp.zeros((1, table.shape[1] + read * hidden)),
                                   None)["params"]
        policy = {"states": drawn_in_style(model.init_style, states, states_key)}
        if output_policy is not None:
            width = global_params[net.layers[1]]["kernel"].shape[1]
            outputs = output_policy.init(outputs_key, jnp.zeros((1, 2 * width)), None)["params"]
            policy["outputs"] = drawn_in_style(model.init_style, outputs, outputs_key)
        return {"embedding": {"embedding": table.at[PAD_ID].set(0.0)},  # as padding_idx
                "global": {layer: global_params[layer] for layer in net.layers},
                "local": {layer: local_params[layer] for layer in net.layers},
                "policy": policy}

    def start_state(params):
        groups = flat_groups(params, net)
        return groups, {name: optimizer.init(p) for name, p in groups.items()}

    def run(step, state, x, y, batches, epoch_key):
        return run_planned(step, state, x, y, batches, batch_size, epoch_key, **config.sgd.loop)

    def one_pass(batches):
        return jax.tree.map(lambda a: a[None], batches)

    def train(params, examples: ClientExamples, key):
        """Their ``*_train``: ``(params, weight, metrics)``."""
        x, y, valid = examples.flat()
        plan = train_plan(net, key, valid, batch_size, config.local_epochs,
                          config.routing_epochs)
        step_keys = jax.random.fold_in(key, 3)  # the steps' dropout keys
        state, local_stats = run(local_step, start_state(params), x, y, plan["local"],
                                 jax.random.fold_in(step_keys, 0))
        if net.global_epoch_on_every_batch:
            def epoch(state, inputs):
                index, policy_batches, global_batches = inputs
                epoch_key = jax.random.fold_in(jax.random.fold_in(step_keys, 1), index)
                state, _ = run(policy_step, state, x, y, one_pass(policy_batches),
                               jax.random.fold_in(epoch_key, 0))
                return run(global_step, state, x, y, one_pass(global_batches),
                           jax.random.fold_in(epoch_key, 1))

            state, stats = lax.scan(epoch, state, (jnp.arange(config.routing_epochs),
                                                   plan["policy"], plan["global"]))
            weight = jnp.sum(valid)  # their last global epoch's sample count
            stats = stats[-1]
        else:
            state, stats = run(alternating, state, x, y, plan["policy"],
                               jax.random.fold_in(step_keys, 1))
            weight = jnp.sum(plan["policy"][1][-1])  # the odd batches' sequences
        metrics = {"loss_sum": stats[0], "loss_count": stats[1],
                   "local_loss_sum": local_stats[0], "local_loss_count": local_stats[1]}
        return nested_groups(state[0], net), weight.astype(jnp.float32), metrics

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        trained, weight, metrics = train(params, examples, key)
        return ClientResult(params=trained, weight=weight, metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        """Their ``*_generalized_test``'s training: the personal net and the snapshot."""
        del client_state  # stateless
        x, y, valid = examples.flat()
        plan = evaluation_plan(net, key, valid, batch_size, config.local_epochs,
                               config.routing_epochs)
        step_keys = jax.random.fold_in(key, 3)
        state, _ = run(local_step, start_state(params), x, y, plan["local"],
                       jax.random.fold_in(step_keys, 0))
        state, snapshot = epochs_with_snapshot(run, joint_step, state, x, y, plan["joint"],
                                               jax.random.fold_in(step_keys, 1),
                                               jax.random.fold_in(step_keys, 2))
        personal = {"groups": state[0], "snapshot": snapshot}
        if config.policy_eval_dropout and config.policy_dropout > 0:
            personal["route_key"] = jax.random.key_data(jax.random.fold_in(key, 4))
        return personal

    def predict(params, personal, x) -> Predictions:
        route_key = personal.get("route_key")
        key = None if route_key is None else jax.random.wrap_key_data(route_key)
        hard, _, _ = routed(personal["groups"], x, hard=True, key=key)
        soft, q0, _ = routed(personal["groups"], x, hard=False, key=key)
        return Predictions(global_logits=branch_logits(flat_groups(params, net), "global", x),
                           personal_hard=hard, personal_soft=soft, q0=q0,
                           global_snapshot=branch_logits(personal["snapshot"], "global", x))

    return FederatedAlgorithm(name="flow", model=model, init=init, client_update=client_update,
                              personalize=personalize, predict=predict,
                              for_test_batch=route_key_for_test_batch)
