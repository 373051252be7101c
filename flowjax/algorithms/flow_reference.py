"""The authors' Flow procedure (github.com/Astuary/Flow, ``trainers/client_flow.py``) as
options of ``flowjax.algorithms.flow``: the pieces that differ from the paper's text.

Each piece is one ``FlowConfig`` field, so each departure can be switched on alone
(README, "Reference mode: the authors' code, step for step"):

* ``halves``: ``"random"`` (paper: a seeded random split) or the authors' ``shard(2, i)``
  of the batched client dataset: ``"shard"`` (even batches train the local branch, odd
  batches the policy and global branch, batches of consecutive examples in the client's
  order, the same every epoch: their EMNIST loader does not shuffle), ``"shard_reshuffled"``
  (a fresh permutation per epoch before batching, then even/odd batches: their Stack
  Overflow and Shakespeare loaders reshuffle on every pass, so a phase's half changes every
  epoch), or ``"none"`` (their CIFAR code: both phases use every example);
* ``frozen_momentum``: their one ``optim.SGD(net.parameters(), momentum=0.9)`` is shared by
  all phases. Under PyTorch < 2.0 ``zero_grad()`` zeroed the gradients of frozen groups, so
  every group that has a momentum buffer keeps stepping by it (``"zero_grad"``); from 2.0
  ``zero_grad()`` sets them to None and frozen groups are skipped (``"set_to_none"``, which
  is exactly one momentum state per group, the paper-mode behaviour);
* ``regularizer``: ``"paper"`` (``-gamma/L sum_j log q0_j``) or ``"reference"``
  (``gamma * mean(-log(q^2 + 1e-6))`` over the entries their code indexes, per model,
  see ``REFERENCE_REGULARIZER_ENTRIES``);
* ``global_step="global_only"`` (already a ``FlowConfig`` option): the global branch alone;
* ``local_init``: ``"global"`` (paper: the local branch starts from the received global
  model) or ``"server"`` (theirs: global and local branches have separate random inits and
  the server averages every weight, local and policy included);
* ``policy_eval_dropout``: their LSTM policies call ``F.dropout`` (always on), so routing is
  random at evaluation too, with new masks at every call: each test batch routes with its
  own key (``route_key_for_test_batch``);
* ``hard_tie``: ``"global"`` (paper: ``round(q)``, an exact ``q0 = 1/2`` rounds up to
  the global branch) or ``"zeroed"`` (theirs: ``torch.round`` of both softmax entries
  rounds half to even, so an exact tie weighs both branches 0 and zeroes the layer;
  flowjax's policy heads, raw logits, tie almost never, ``fixed_q0=0.5`` at every layer,
  and their LSTM policies' ReLU head whenever it cuts both logits to 0);
* ``evaluation``: ``"paper"``, ``"reference"`` or ``"reference_policy"``
  (``*_generalized_test``: a fresh SGD state; the local branch trained K epochs on half 0,
  then K epochs on half 1 of one step on routed loss + regularizer, which trains the policy
  and the global branch jointly in their EMNIST code (``"reference"``) and the policy
  alone in their CIFAR code (``"reference_policy"``: ``requires_grad = False`` on every
  ``local`` and ``global`` parameter, so the global branch stays the server's); a copy of
  the global branch taken after the first of those epochs gives
  ``acc_g_client_snapshot``, reported beside the server model's Acc_g).

``semantics="reference"`` (``config.methods.flow.semantics``) sets all of them to the
values of the authors' code for the model (``reference_options``). For the LSTMs and the
CIFAR ResNet their code is another network (the LSTM policies read the cells' states; the
ResNet has an ImageNet stem, a norm shared by both branches and their GroupNorm), which
``flowjax.algorithms.flow_reference_lstm`` and ``flow_reference_resnet`` run whole; the
fields above then apply to ``emnist_cnn`` in reference mode, and to any model one field
at a time under ``semantics="paper"``. A client with one batch has an empty
``shard(2, 1)``. Where their code then crashes (training that weighs the client by that
half's size: EMNIST, Stack Overflow) the tiny-client rule of ``flow.py`` applies: both
phases use all examples. Where it runs on (every ``*_generalized_test`` evaluation that
shards, and Shakespeare's training, weighed by its every-batch global epochs) the half
stays empty, as theirs: no step trains on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import FROZEN_MOMENTUM
from flowjax.core.checks import FieldError
from flowjax.core.local_training import packed_batches, run_epochs
from flowjax.routing.policy import LAST_KINDS
from flowjax.routing.routed import HARD_TIES, RECURRENCES

HALVES = ("random", "shard", "shard_reshuffled", "none")
REGULARIZERS = ("paper", "reference")
LOCAL_INITS = ("global", "server")
EVALUATIONS = ("paper", "reference", "reference_policy")
GLOBAL_STEPS = ("routed", "global_only")
SEMANTICS = ("paper", "reference")
REFERENCE_EPSILON = 1e-6

# Which softmax entries of ``q [*instance, L, 2]`` (index 0 = global) their regularizer
# averages: ``(layers, entries)``. EMNIST: ``probs[:, 1]`` of ``probs [B, L, 2]`` is layer 1,
# both entries; CIFAR: ``probs[:, 1, :]`` of ``probs [B, 2, L]`` is the local entry of
# every layer.
REFERENCE_REGULARIZER_ENTRIES: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...]]] = {
    "emnist_cnn": ((1,), (0, 1)),
    "resnet18_gn": (None, (1,)),
}

# semantics="reference": the authors' choices per model (see the module docstring).
_REFERENCE = {
    "emnist_cnn": dict(halves="shard", policy_eval_dropout=False, policy_last="dense",
                       policy_hidden=(350, 150, 50, 2)),
    # Their CIFAR network is another network than resnet18_gn: semantics="reference" runs
    # it whole (``flow_reference_resnet``), with these fields (their policy has no dropout).
    "resnet18_gn": dict(halves="none", policy_eval_dropout=False, policy_last="dense",
                        policy_hidden=(1000, 750, 350, 150, 50, 2), policy_dropout=0.0,
                        evaluation="reference_policy"),
    # Their LSTMs are other networks (their policies read the cells' states): semantics=
    # "reference" runs them whole (``flow_reference_lstm``), with these fields.
    # (Their policy's dropout, 0.3, is FlowConfig's default policy_dropout.)
    "shakespeare_lstm": dict(halves="shard_reshuffled", policy_eval_dropout=True,
                             policy_hidden=(500, 250, 100, 50)),
    "stackoverflow_lstm": dict(halves="shard_reshuffled", policy_eval_dropout=True,
                               policy_hidden=(500, 250, 100, 50)),
}
REFERENCE_MODELS = tuple(sorted(_REFERENCE))
REFERENCE_MOMENTUM = 0.9  # their SGD's, for every phase
_COMMON_REFERENCE = dict(frozen_momentum="zero_grad", regularizer="reference",
                         global_step="global_only", local_init="server",
                         evaluation="reference", momentum=REFERENCE_MOMENTUM,
                         hard_tie="zeroed")


def reference_options(model_name: str) -> dict[str, Any]:
    """The ``FlowConfig`` fields that reproduce the authors' code for ``model_name``."""
    if model_name not in _REFERENCE:
        raise ValueError(f"semantics='reference' is not available for model "
                         f"{model_name!r}; expected one of {sorted(_REFERENCE)}")
    return {**_COMMON_REFERENCE, **_REFERENCE[model_name]}


# ----------------------------------------------------------------------------- halves


def route_key_for_test_batch(personal: dict[str, Any], index: jax.Array) -> dict[str, Any]:
    """``FederatedAlgorithm.for_test_batch`` of Flow: where the policy's dropout stays on
    at evaluation (``personal["route_key"]``), test batch ``index`` routes with its own
    key, folded from the client's, as their ``F.dropout`` draws new masks at every call;
    otherwise ``personal`` is every batch's."""
    if "route_key" not in personal:
        return personal
    key = jax.random.fold_in(jax.random.wrap_key_data(personal["route_key"]), index)
    return dict(personal, route_key=jax.random.key_data(key))


def batch_index(valid: jax.Array, batch_size: int, sort_key: jax.Array | None = None) -> jax.Array:
    """int ``[N]``: the batch of each valid example when the valid examples are batched in
    ``sort_key`` order (index order if None); ``-1`` for padding."""
    n = valid.shape[0]
    keys = jnp.arange(n, dtype=jnp.float32) if sort_key is None else sort_key
    order = jnp.argsort(jnp.where(valid, keys, jnp.inf), stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return jnp.where(valid, rank // batch_size, -1)


def shard_member(valid: jax.Array, batch_size: int, index: int,
                 sort_key: jax.Array | None = None, *,
                 single_batch_uses_all: bool = True) -> jax.Array:
    """bool ``[N]``: the examples of ``dataset.batch(B).shard(2, index)``.

    A client with a single batch leaves half 1 empty. With ``single_batch_uses_all`` (for
    training that their code would end in a division by zero) both halves are then every
    valid example (the tiny-client rule); without, half 1 stays empty, as theirs.
    """
    batch = batch_index(valid, batch_size, sort_key)
    if not single_batch_uses_all:
        return valid & (batch % 2 == index)
    single = jnp.sum(valid) <= batch_size
    return valid & ((batch % 2 == index) | single)


def shard_batches_fn(valid: jax.Array, batch_size: int, index: int, reshuffle: bool,
                     max_members: int, *, single_batch_uses_all: bool = True
                     ) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """A ``run_epochs`` ``batches_fn`` giving half ``index`` of ``shard(2, index)``, batch
    for batch as the authors' loop sees it (members packed in order: every batch but the
    dataset's last is full, so packing the even or odd batches reproduces them exactly);
    ``single_batch_uses_all`` as in ``shard_member``."""
    n = valid.shape[0]

    def half(sort_key: jax.Array | None):
        member = shard_member(valid, batch_size, index, sort_key,
                              single_batch_uses_all=single_batch_uses_all)
        order = jnp.arange(n, dtype=jnp.float32) if sort_key is None else sort_key
        return packed_batches(order, member, batch_size, max_members)

    if not reshuffle:  # the same batches every epoch: built once, outside the epoch loop
        fixed = half(None)
        return lambda epoch_key, epoch_index: fixed

    def batches(epoch_key, epoch_index):
        del epoch_index
        return half(jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(epoch_key, i)))(
            jnp.arange(n)))

    return batches


# ----------------------------------------------------------------------------- optimizer


# ----------------------------------------------------------------------------- regularizer


def reference_terms(q: jax.Array) -> jax.Array:
    """Their regularizer's per-entry term, ``-log(q^2 + 1e-6)``."""
    return -jnp.log(q ** 2 + REFERENCE_EPSILON)


def reference_regularizer_mean(model_name: str, q: jax.Array, weights: jax.Array) -> jax.Array:
    """``mean(-log(q^2 + 1e-6))`` over the entries the authors index for ``model_name``,
    averaged over instances with weight (padding excluded)."""
    if model_name not in REFERENCE_REGULARIZER_ENTRIES:
        raise ValueError(f"the reference regularizer is not defined for model {model_name!r}; "
                         f"expected one of {sorted(REFERENCE_REGULARIZER_ENTRIES)}")
    layers, entries = REFERENCE_REGULARIZER_ENTRIES[model_name]
    if layers is not None:
        q = q[..., jnp.asarray(layers), :]
    q = q[..., jnp.asarray(entries)]  # [*instance, layers, entries]
    terms = reference_terms(q)
    per_instance = jnp.mean(terms.reshape(terms.shape[: weights.ndim] + (-1,)), axis=-1)
    return instance_mean(per_instance, weights)


def instance_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """Their regularizer's batch mean: ``values`` averaged over the instances with weight
    (padding excluded)."""
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1e-12)


def run_planned(step: Callable, state: Any, x: jax.Array, y: jax.Array, batches: Any,
                batch_size: int, key: jax.Array, steps_per_loop: int = 1) -> tuple[Any, jax.Array]:
    """``run_epochs`` of ``step`` over batches planned up front, ``(indices [E, S, B],
    mask [E, S, B])`` into ``x`` and ``y``: one epoch per leading entry."""
    indices, mask = batches
    member = jnp.ones(x.shape[:1], bool)  # unused: the batches are planned
    return run_epochs(step, state, x, y, member, num_epochs=indices.shape[0],
                      batch_size=batch_size, key=key,
                      batches_fn=lambda _, e: (indices[e], mask[e]), steps_per_loop=steps_per_loop)


def epochs_with_snapshot(run: Callable, step: Callable, state: Any, x: jax.Array,
                         y: jax.Array, batches: Any, first_key: jax.Array,
                         rest_key: jax.Array) -> tuple[Any, Any]:
    """Their evaluation's routed epochs, keeping a copy of the params after the first (Acc_g's
    client snapshot): ``run(step, state, x, y, batches, key)`` over the first epoch of
    ``batches`` (leading axis: epochs), then over the rest. Returns ``(state, snapshot)``."""
    first = jax.tree.map(lambda a: a[:1], batches)
    state, _ = run(step, state, x, y, first, first_key)
    snapshot = state[0]
    if jax.tree.leaves(batches)[0].shape[0] > 1:
        state, _ = run(step, state, x, y, jax.tree.map(lambda a: a[1:], batches), rest_key)
    return state, snapshot


# ----------------------------------------------------------------------------- whole networks


def refuse_set_fields(config: Any, fields: tuple[str, ...], model_name: str,
                      network: str) -> None:
    """For a reference mode that runs the authors' ``network`` whole: refuses any of
    ``fields`` that ``config`` (as given) sets, which that network would silently ignore."""
    for name in fields:
        if getattr(config, name) is not None:
            raise FieldError(name, getattr(config, name), f"expected None with "
                             f"semantics='reference' on {model_name}: the authors' {network} "
                             f"network has no such option")


def refuse_other_values(config: Any, fixed: dict[str, Any], model_name: str,
                        network: str) -> None:
    """Refuses a resolved ``config`` whose field differs from the only value (``fixed``)
    the authors' ``network`` procedure runs."""
    for name, value in fixed.items():
        if getattr(config, name) != value:
            raise FieldError(name, getattr(config, name), f"expected {value!r} with "
                             f"semantics='reference' on {model_name}: the authors' {network} "
                             f"procedure runs as one unit")


# ----------------------------------------------------------------------------- config

# Each departure field of ``FlowConfig``: its choices, and the paper's value (what a field
# left None takes under ``semantics="paper"``). The paper says nothing of LSTMs: its
# ``recurrence`` is this project's reading of Eq. 3 with the whole LSTM layer as layer j
# (``routing.routed``'s docstring gives both readings).
DEPARTURES: dict[str, tuple[Any, ...]] = {
    "halves": HALVES, "frozen_momentum": FROZEN_MOMENTUM, "regularizer": REGULARIZERS,
    "local_init": LOCAL_INITS, "policy_eval_dropout": (False, True),
    "evaluation": EVALUATIONS, "policy_last": LAST_KINDS, "recurrence": RECURRENCES,
    "global_step": GLOBAL_STEPS, "hard_tie": HARD_TIES,
}
PAPER = dict(halves="random", frozen_momentum="set_to_none", regularizer="paper",
             local_init="global", policy_eval_dropout=False, evaluation="paper",
             policy_last="exit", recurrence="separate", global_step="routed",
             hard_tie="global")


def check_hard_tie(config: Any, model: Any) -> None:
    """Refuses ``hard_tie="zeroed"`` where the resolved ``config`` routes LSTM cells with
    ``recurrence="mixed_state"``: their hard routes pick a cell's state per step.

    Raises:
      FieldError: naming ``hard_tie``.
    """
    if (config.hard_tie != "global" and config.recurrence == "mixed_state"
            and model.recurrent_layers):
        raise FieldError("hard_tie", config.hard_tie, "expected 'global' with "
                         "recurrence='mixed_state' (its cells mix their state per step)")


def resolve(config: Any, model_name: str) -> Any:
    """A ``FlowConfig`` with its departures set for ``model_name``.

    ``semantics="paper"``: each departure field left None takes the paper's value, and one
    that is set switches its departure on alone; ``"reference"``: every departure takes the
    authors' value for the model (``reference_options``; ``global_step="global_only"``
    among them), and a departure field that is set still wins. ``"reference"`` also sets
    what is no departure field: SGD momentum 0.9 (``flowjax.validation`` refuses another
    momentum set for Flow) and the authors' policy widths, part of their policy.
    """
    chosen = reference_options(model_name) if config.semantics == "reference" else {}
    fields = {**PAPER, **{name: value for name, value in chosen.items() if name in DEPARTURES}}
    fields.update({name: getattr(config, name) for name in DEPARTURES
                   if getattr(config, name) is not None})
    others = {name: value for name, value in chosen.items() if name not in DEPARTURES}
    sgd = config.sgd
    if "momentum" in others:
        sgd = dataclasses.replace(sgd, momentum=others.pop("momentum"))
    return dataclasses.replace(config, sgd=sgd, **others, **fields)
