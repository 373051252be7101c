"""The algorithm protocol (the one seam between the engine and the methods, defined in
``engine.protocol`` and re-exported here for the methods) and the client-side building
blocks several methods share.

An algorithm is a frozen dataclass of pure functions, in the spirit of FedJAX's
``FederatedAlgorithm`` and optax's ``GradientTransformation``:

* ``init(key) -> params``: what the server holds and aggregates (a pytree);
* ``client_update(params, examples, key, client_state) -> ClientResult``: one client,
  written as if alone; the engine maps it over the cohort (loop / vmap / shards), takes
  the weighted mean of ``ClientResult.params`` and applies the server optimizer;
* ``personalize(params, train_examples, key, client_state) -> personal``: what the
  evaluation builds for a client from the current server params and its train split;
* ``predict(params, personal, x) -> Predictions``: global and personalized logits;
* ``for_test_batch(personal, index) -> personal``: what ``predict`` gets for the
  client's ``index``-th test batch (an int32 scalar); a method whose prediction draws
  randomness gives each batch its own, the default is ``personal`` itself;
* ``init_client_state(params) -> state`` (stateful methods only): the state of a client
  that has not trained yet. The engine keeps each visited client's state in a host store
  (``core.client_state``), hands the cohort's states to ``client_update`` and stores the
  returned ``ClientResult.client_state``; stateless methods receive and return None.

Aggregation weights: ``ClientResult.weight`` is a scalar, or a dict with one scalar per
top-level key of the params (e.g. one per cluster), giving a separate weighted mean per
group; a group no client trained gets a zero pseudo-gradient, on which the server
optimizers of ``core.server_opt`` make no step and leave the group's state as it was.
A group wrapped in ``core.server_opt.ClientMean`` is not trained by the server optimizer:
it becomes the clients' weighted mean (FedRep and LG-FedAvg keep the mean of their
clients' personal layers this way, for the evaluation's global model only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from flowjax.core.checks import Interval, check_fields, integer, optional_integer, positive
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs, run_epochs_each
from flowjax.core.losses import mean_from_sums, weighted_cross_entropy
from flowjax.engine.protocol import ClientResult, FederatedAlgorithm, Predictions
from flowjax.models.base import Params, RoutableModel, forward, instance_weights
from flowjax.models.torch_init import torch_init

# The methods import the protocol and the instance weights from here too (re-exported).
__all__ = ["ClientResult", "FederatedAlgorithm", "Predictions", "SGDConfig", "client_optimizer",
           "FROZEN_MOMENTUM", "PERSONAL_INITS", "group_sgd_step", "instance_weights",
           "merged_loss_sums",
           "fresh_layers", "layer_names_or_none", "no_routing",
           "part_sgd_step", "personal_start",
           "plain_loss_sums", "plain_sgd_step", "run_with_copies", "separate_models_predict",
           "sgd_step", "split_layers",
           "top_layer_names", "train_part", "train_part_with_snapshot", "train_plain",
           "unrouted_predict", "unrouted_predictions", "valid_examples"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class SGDConfig:
    """The clients' SGD, one subtree for every method: ``config.sgd``, where a method's
    ``config.methods.<name>.sgd`` may override single fields (the paper's per-method rates).

    Attributes:
      learning_rate: client SGD learning rate.
      epochs: local epochs E per round.
      batch_size: client batch size.
      momentum: client SGD momentum (0 = plain SGD; 0.9 is the authors' code).
      steps_per_loop: how the steps run, not what they compute: steps per iteration of
        the step loop (``local_training.run_epochs``; None = 1). Equal values to float32
        rounding.
    """

    learning_rate: float
    epochs: int
    batch_size: int
    momentum: float = 0.0
    steps_per_loop: int | None = None

    def __post_init__(self):
        check_fields(self, {"learning_rate": positive, "epochs": integer(1),
                            "batch_size": integer(1), "momentum": Interval(0, 1),
                            "steps_per_loop": optional_integer(1)})

    @property
    def loop(self) -> dict[str, int]:
        """``run_epochs``'s keyword for the step loop's shape (``steps_per_loop``)."""
        return {"steps_per_loop": self.steps_per_loop or 1}

    def optimizer(self) -> optax.GradientTransformation:
        return client_optimizer(self.learning_rate, self.momentum)


def client_optimizer(learning_rate: float, momentum: float = 0.0) -> optax.GradientTransformation:
    """The clients' SGD (the paper's; momentum 0.9 is the authors' code, an option).

    Its values come checked from the config dataclasses (``SGDConfig``, PartialFed's
    strategy rate), the one place they are checked.
    """
    return optax.sgd(learning_rate, momentum=momentum or None)


def plain_loss_sums(model: RoutableModel, params: Params, batch, key: jax.Array,
                    train: bool = True) -> jax.Array:
    """``[loss_sum, weight_sum]`` of the plain model on a batch."""
    x, y, w = batch
    logits = forward(model, params, x, train=train, key=key)
    return jnp.stack(weighted_cross_entropy(logits, y, instance_weights(model, y, w)))


def sgd_step(loss_sums: Callable[[PyTree, Any, jax.Array], jax.Array],
             optimizer: optax.GradientTransformation,
             penalty_gradient: Callable[[PyTree], PyTree] | None = None):
    """A ``run_epochs`` step: one optimizer step on the batch mean of ``loss_sums``, plus
    ``penalty_gradient(params)`` added to its gradient where given (a penalty the
    reported loss leaves out, e.g. Ditto's ``lam / 2 ||v - w_t||^2``)."""

    def mean_loss(params, batch, key):
        sums = loss_sums(params, batch, key)
        return mean_from_sums(sums[0], sums[1]), sums

    def step(carry, batch, key):
        params, opt_state = carry
        grads, sums = jax.grad(mean_loss, has_aux=True)(params, batch, key)
        if penalty_gradient is not None:
            grads = jax.tree.map(jnp.add, grads, penalty_gradient(params))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), sums

    return step


def train_plain(model: RoutableModel, params: Params, optimizer: optax.GradientTransformation,
                examples: ClientExamples, member: jax.Array, *, epochs: int, batch_size: int,
                key: jax.Array, max_members: int | None = None,
                steps_per_loop: int = 1) -> tuple[Params, jax.Array]:
    """``epochs`` of minibatch SGD of the plain model on the member examples
    (``steps_per_loop``: ``run_epochs``'s).

    Returns the trained params and ``[loss_sum, weight_sum]`` over the steps.
    """
    x, y, _ = examples.flat()
    (params, _), sums = run_epochs(plain_sgd_step(model, optimizer),
                                   (params, optimizer.init(params)), x, y, member,
                                   num_epochs=epochs, batch_size=batch_size, key=key,
                                   max_members=max_members, steps_per_loop=steps_per_loop)
    return params, sums


def layer_names_or_none(value) -> str | None:
    """``check_fields`` rule of a method's layer-name option (FedRep's head, LG-FedAvg's
    global layers): None, or a non-empty sequence of names."""
    if value is None or (value and all(isinstance(name, str) for name in value)):
        return None
    return "expected None (the model's head) or a non-empty sequence of layer names"


def top_layer_names(model: RoutableModel, requested: Sequence[str] | None, *, option: str,
                    below: str) -> tuple[str, ...]:
    """``requested`` (None: the model's ``head_layers``), validated: distinct layers of
    ``model`` forming a non-empty top of it that leaves a layer below (``below`` names it
    in the error; ``option`` names the setting)."""
    names = tuple(model.head_layers if requested is None else requested)
    if not names:
        raise ValueError(f"model {model.name!r} declares no head_layers; set {option} to "
                         f"some of {list(model.layer_names)}")
    if len(set(names)) != len(names) or any(name not in model.layer_names for name in names):
        raise ValueError(f"{option} {list(names)} must be distinct layers of "
                         f"{model.name!r} ({list(model.layer_names)})")
    top = model.layer_names[model.num_layers - len(names):]
    if set(names) != set(top) or len(names) == model.num_layers:
        raise ValueError(f"{option} {list(names)} must be the top layers of {model.name!r} "
                         f"below which at least one layer stays {below}, e.g. "
                         f"{list(model.layer_names[-1:])}")
    return names


def split_layers(params: Params, names: Sequence[str]) -> tuple[Params, Params]:
    """``(layers named in names, every other layer)`` of a model's params dict."""
    chosen = {name: layer for name, layer in params.items() if name in names}
    rest = {name: layer for name, layer in params.items() if name not in names}
    return chosen, rest


# How PyTorch's one momentum SGD over parameter groups treats a group a phase freezes
# (``requires_grad = False``): "set_to_none", PyTorch >= 2.0's ``zero_grad()``, skips it
# (one momentum state per group); "zero_grad", the pre-2.0 default the Flow authors'
# code ran under (their environment: PyTorch 1.11), steps it with a zero gradient, so a
# group with velocity keeps moving by its momentum.
FROZEN_MOMENTUM = ("set_to_none", "zero_grad")


def merged_loss_sums(model: RoutableModel) -> Callable[[dict, Any, jax.Array], jax.Array]:
    """``group_sgd_step``'s ``loss_sums`` for groups that together are ``model``'s layers:
    ``plain_loss_sums`` of the groups merged."""
    def loss_sums(groups: dict, batch: Any, key: jax.Array) -> jax.Array:
        merged = {name: layer for group in groups.values() for name, layer in group.items()}
        return plain_loss_sums(model, merged, batch, key)

    return loss_sums


def group_sgd_step(loss_sums: Callable[[dict, Any, jax.Array], jax.Array],
                   active: tuple[str, ...], optimizer: optax.GradientTransformation,
                   frozen_momentum: str):
    """A ``run_epochs`` step of the clients' SGD (``base.client_optimizer``) over a dict of
    parameter groups, training the ``active`` groups on ``loss_sums(params, batch, key)``'s
    batch mean: PyTorch's one ``SGD(momentum)`` over parameter groups.

    Carry: ``(params, {group: optimizer.init(params[group])})``, one state per group (a
    zero momentum buffer with a zero gradient moves nothing, as PyTorch's missing buffer).
    ``frozen_momentum="zero_grad"``: frozen groups step with a zero gradient (momentum
    carries them on); ``"set_to_none"``: frozen groups and their states stay as they are.
    ``optax.sgd``'s trace is ``torch.optim.SGD``'s buffer (dampening 0, no Nesterov):
    ``buf <- momentum * buf + g``, ``p <- p - lr * buf``; with momentum 0, ``p - lr * g``.
    """

    def mean_loss(trained, params, batch, key):
        sums = loss_sums({**params, **trained}, batch, key)
        return mean_from_sums(sums[0], sums[1]), sums

    def step(carry, batch, key):
        params, states = carry
        grads, sums = jax.grad(mean_loss, has_aux=True)(
            {g: params[g] for g in active}, params, batch, key)
        new_params, new_states = dict(params), dict(states)
        for group in params:
            if group in active:
                grad = grads[group]
            elif frozen_momentum == "zero_grad" and jax.tree.leaves(states[group]):
                grad = jax.tree.map(jnp.zeros_like, params[group])  # momentum only
            else:  # a stateless SGD moves nothing on a zero gradient
                continue
            updates, new_states[group] = optimizer.update(grad, states[group], params[group])
            new_params[group] = optax.apply_updates(params[group], updates)
        return (new_params, new_states), sums

    return step


# How a method with personal layers (FedRep's head, LG-FedAvg's local layers) starts
# them: "stored", the client's own from its last round (the methods' papers), or a new
# random init every round and at every evaluation (the Flow authors' code, whose client
# objects are rebuilt each round and never load those layers): "fresh", the model's own
# init; "fresh_torch", drawn as their PyTorch networks draw those layers
# (``models.torch_init``).
PERSONAL_INITS = ("stored", "fresh", "fresh_torch")


def fresh_layers(model: RoutableModel, names: Sequence[str], personal_init: str | None = "fresh"
                 ) -> Callable[[jax.Array], Params] | None:
    """The random init of ``model``'s layers ``names`` from a key, for a method that starts
    them fresh: the model's own (``personal_init="fresh"``; PyTorch's as well where the run
    sets ``model_init="torch"``, whose model draws so) or their PyTorch networks'
    (``"fresh_torch"``, ``models.torch_init.torch_init``); None for ``"stored"`` (or None).

    On CPU, where that init calls LAPACK (the LSTMs' orthogonal recurrent kernels: a QR),
    it runs one client at a time under ``vmap`` (``jax.custom_batching.sequential_vmap``),
    the same numbers, because a batched LAPACK call can deadlock XLA's CPU runtime: jaxlib
    (0.10.2) splits the batch into tasks on XLA's intra-op thread pool from a thread of that
    pool and blocks until they are done, so two such calls at once on a pool of two threads
    (two cores) leave no thread to run the tasks. Seen on 2026-12-05 in every 2-round
    Shakespeare LG-FedAvg run with fresh local layers (the native stacks: both pool threads
    in ``jax::ParallelBatchMap``'s ``BlockingCounter::Wait`` under ``lapack_sgeqrf_ffi``);
    ``launch/lapack_pool_deadlock.py`` is the minimal program, and
    ``docs/upstream/jaxlib-lapack-pool-deadlock.md`` the report to file. An unbatched call
    runs inline. The CNN's and the ResNet's inits call no LAPACK and keep the batched
    program.
    """
    if personal_init in (None, "stored"):
        return None
    if personal_init == "fresh_torch":  # uniform and normal draws: no LAPACK
        shapes = split_layers(jax.eval_shape(model.init, jax.random.key(0)), names)[0]
        return functools.partial(torch_init, shapes)
    if personal_init != "fresh":
        raise ValueError(f"personal_init={personal_init!r}: expected one of "
                         f"{[None, *PERSONAL_INITS]}")

    def init(key: jax.Array) -> Params:
        return split_layers(model.init(key), names)[0]

    if jax.default_backend() != "cpu":
        return init
    program = jax.jit(init).lower(jax.random.key(0)).compile().as_text()
    if 'custom_call_target="lapack_' in program:
        return jax.custom_batching.sequential_vmap(init)
    return init


def personal_start(fresh_init: Callable[[jax.Array], Params] | None, stored: Params,
                   key: jax.Array) -> tuple[Params, jax.Array]:
    """The personal layers a client starts from and the key left for its training:
    ``stored`` and ``key`` itself, or with a ``fresh_init`` (``fresh_layers``) a new init
    from the first half of ``jax.random.split(key)`` and the second half (so no training
    key is reused for the init)."""
    if fresh_init is None:
        return stored, key
    init_key, key = jax.random.split(key)
    return fresh_init(init_key), key


def train_part(model: RoutableModel, trainable: Params, frozen: Params,
               optimizer: optax.GradientTransformation, examples: ClientExamples,
               member: jax.Array, *, epochs: int, batch_size: int,
               key: jax.Array, steps_per_loop: int = 1) -> tuple[Params, jax.Array]:
    """``epochs`` of minibatch SGD on the ``trainable`` layers, the ``frozen`` ones fixed.

    The frozen layers are constants of the loss, so they come out exactly as they went in.
    Returns the trained layers and ``[loss_sum, weight_sum]`` over the steps.
    """
    if epochs == 0:
        return trainable, jnp.zeros((2,), jnp.float32)
    x, y, _ = examples.flat()
    step = part_sgd_step(model, frozen, optimizer)
    (trainable, _), sums = run_epochs(step, (trainable, optimizer.init(trainable)), x, y,
                                      member, num_epochs=epochs, batch_size=batch_size, key=key,
                                      steps_per_loop=steps_per_loop)
    return trainable, sums


def train_part_with_snapshot(model: RoutableModel, trainable: Params, frozen: Params,
                             optimizer: optax.GradientTransformation, examples: ClientExamples,
                             member: jax.Array, *, epochs: int, batch_size: int, key: jax.Array,
                             steps_per_loop: int = 1) -> tuple[Params, Params]:
    """``epochs`` of minibatch SGD on the ``trainable`` layers, the ``frozen`` ones fixed
    (``{}``: the whole model, ``train_plain``'s run), copied after its first epoch.

    The copy is the model the Flow authors' evaluation scores as a fine-tuning baseline's
    Acc_g: their ``*_generalized_test`` copies ``before_net`` at ``epoch == 0`` of its E
    fine-tuning epochs (``client_fedavg_finetuning.py``; FedRep's head-only and
    LG-FedAvg's body-only fine-tuning in ``client_fedrep.py``, ``client_lgfedavg.py``).
    One run: the second part continues from the first's params, optimizer state and
    epoch index.

    Args:
      model, optimizer, examples, member, epochs, batch_size, key, steps_per_loop: as
        ``train_plain``'s.
      trainable: the layers trained; frozen: the model's other layers, constants of the loss.

    Returns:
      ``(trainable after all epochs, after the first)``; both ``trainable`` itself when
      ``epochs`` is 0.
    """
    if epochs == 0:
        return trainable, trainable
    x, y, _ = examples.flat()
    first, _, last, _ = run_with_copies(
        part_sgd_step(model, frozen, optimizer), (trainable, optimizer.init(trainable)), x, y,
        member, epochs=epochs, batch_size=batch_size, key=key, steps_per_loop=steps_per_loop)
    return last[0], first[0]


def run_with_copies(step: Callable[..., Any], carry: Any, x: jax.Array, y: jax.Array,
                    member: jax.Array, *, epochs: int, batch_size: int, key: jax.Array,
                    steps_per_loop: int = 1) -> tuple[Any, jax.Array, Any, jax.Array]:
    """``epochs`` (>= 1) of ``run_epochs`` in one run, split where the Flow authors'
    evaluation copies it: after the first epoch. The second part continues from the
    first's carry (optimizer state included) and epoch index, so the epochs, keys and
    steps are one call's.

    Returns:
      ``(carry after the first epoch, that epoch's [loss_sum, weight_sum], carry after
      all, the last epoch's sums)``.
    """
    common = dict(batch_size=batch_size, key=key, steps_per_loop=steps_per_loop)
    first, first_sums = run_epochs(step, carry, x, y, member, num_epochs=1, **common)
    if epochs == 1:
        return first, first_sums, first, first_sums
    last, each = run_epochs_each(step, first, x, y, member, num_epochs=epochs - 1,
                                 first_epoch=1, **common)
    return first, first_sums, last, each[-1]


def part_sgd_step(model: RoutableModel, frozen: Params, optimizer: optax.GradientTransformation
                  ) -> Callable[..., Any]:
    """A ``run_epochs`` step of SGD on some of ``model``'s layers, the ``frozen`` ones
    (a dict of the others) held as constants of the loss."""
    return sgd_step(lambda part, batch, k: plain_loss_sums(model, {**frozen, **part}, batch, k),
                    optimizer)


def plain_sgd_step(model: RoutableModel, optimizer: optax.GradientTransformation
                   ) -> Callable[..., Any]:
    """A ``run_epochs`` step of SGD on the whole plain model (``train_plain``'s)."""
    return sgd_step(lambda p, batch, k: plain_loss_sums(model, p, batch, k), optimizer)


def valid_examples(examples: ClientExamples) -> jax.Array:
    """bool ``[N]``: the client's real examples."""
    return examples.flat()[2]


def no_routing(logits: jax.Array) -> jax.Array:
    """The ``q0`` of a method without routing: shape ``[*instance, 0]``."""
    return jnp.zeros(logits.shape[:-1] + (0,), jnp.float32)


def unrouted_predictions(global_logits: jax.Array, personal_logits: jax.Array,
                         snapshot_logits: jax.Array | None = None,
                         personal_snapshot_logits: jax.Array | None = None) -> Predictions:
    """``Predictions`` of a method without routing: its personalized model's logits are
    both the hard- and the soft-routed ones; ``snapshot_logits`` and
    ``personal_snapshot_logits``, where given, those of the client-side copy of the global
    model and of the authors' personalized model (a method's ``client_snapshot``)."""
    return Predictions(global_logits, personal_logits, personal_logits, no_routing(global_logits),
                       global_snapshot=snapshot_logits,
                       personal_snapshot=personal_snapshot_logits)


def unrouted_predict(global_logits: Callable[[Params, jax.Array], jax.Array],
                     personal_logits: Callable[[Params, Params, jax.Array], jax.Array],
                     client_snapshot: bool | None = None
                     ) -> Callable[[Params, Params, jax.Array], Predictions]:
    """``predict`` of a method without routing, from ``global_logits(params, x)`` and
    ``personal_logits(params, personal, x)``.

    With ``client_snapshot`` (a method's option of that name) ``personal`` holds the
    personalized part under ``"personal"`` and the client-side copy of the global model,
    in the same form and scored by the same ``personal_logits``, under ``"snapshot"``
    (``Predictions.global_snapshot``), and, where the authors' evaluation scores another
    personalized model than the method's, that one under ``"personal_snapshot"``
    (``Predictions.personal_snapshot``).
    """

    def predict(params: Params, personal: Params, x: jax.Array) -> Predictions:
        if not client_snapshot:
            return unrouted_predictions(global_logits(params, x),
                                        personal_logits(params, personal, x))
        theirs = personal.get("personal_snapshot")
        return unrouted_predictions(
            global_logits(params, x), personal_logits(params, personal["personal"], x),
            personal_logits(params, personal["snapshot"], x),
            None if theirs is None else personal_logits(params, theirs, x))

    return predict


def separate_models_predict(model: RoutableModel, client_snapshot: bool | None = None
                            ) -> Callable[[Params, Params, jax.Array], Predictions]:
    """``unrouted_predict`` of a method whose personalized model is a whole second set of
    ``model``'s params: the server's params give the global logits, the client's the
    personal ones."""
    return unrouted_predict(lambda params, x: forward(model, params, x),
                            lambda params, personal, x: forward(model, personal, x),
                            client_snapshot)
