"""LG-FedAvg: local lower layers kept by each client, global top layers averaged.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", 2020, Algorithm 1.
The model's top layers named in ``global_layers`` (default: its ``head_layers``) are the
global part ``g``; the layers below are the local representation ``l``. A sampled client
``i``, from the broadcast ``g`` and its stored ``l_i``:

1. runs E epochs of minibatch SGD on the whole model ``(l_i, g_i)`` (``g_i`` starts at
   ``g``), both parts updated by the same loss:
   ``(l_i, g_i) <- (l_i, g_i) - lr grad f_i(l_i, g_i; xi)``;
2. sends ``g_i`` with weight ``n_i`` (its number of examples) and keeps ``l_i``.

The server averages the global layers only, ``g <- sum_i n_i g_i / sum_i n_i``, through
the engine's server optimizer (SGD with rate 1 applies this mean).

Server params: ``{"global": g, "initial_local": l_0, "mean_local": ClientMean(l_bar)}``.
``l_0`` is the local part drawn at initialization. Clients return it unchanged with
aggregation weight 0, so the engine's per-group mean gives that group a zero
pseudo-gradient: it stays ``l_0`` bit for bit under every server optimizer.
``init_client_state`` hands ``l_0`` to every client that has not trained yet (held-out
clients included). ``l_bar`` is for reporting only (see "Global model" below): each
client also sends its new local layers with weight ``n_i``, and the server sets ``l_bar``
to their example-weighted mean, bypassing the server optimizer
(``core.server_opt.ClientMean``); it starts at ``l_0``, no client update reads it, and it
is checkpointed with the rest of the server state.

Choices where the paper is silent or differs:

* ``global_layers`` must be a non-empty suffix of the model's layers that leaves at least
  one local layer (lower layers local, top layers global is the method's definition).
* Every part starts from the model's initialization (no FedAvg pre-training; a warm
  start, as the reference code offers, is the launcher's business).
* One optimizer state covers both parts, as in the paper's joint local update.
  ``local_update="alternating"`` runs the Flow authors' update instead
  (``client_lgfedavg.py``, ``*_train``): per batch an SGD step on the local layers with
  the global ones frozen, then a step on the global layers from the updated local ones,
  on the same batch; one momentum optimizer of theirs holds each part's velocity apart
  (a frozen part has no gradient, so no step touches it), which is one optimizer state
  per part here. The reported loss is the second forward's, as theirs. That is PyTorch
  >= 2's ``zero_grad()``; under the PyTorch 1.11 of their environment ``zero_grad()``
  zeroes a frozen part's gradient rather than dropping it, so each step also moves the
  frozen part by its velocity: ``frozen_momentum="zero_grad"`` (``base.group_sgd_step``).
* Where a client's local layers start: its stored ones (client state), or with
  ``personal_init="fresh"`` a new random init of the model every round and at every
  evaluation (the Flow authors' code: each round's client object is a new network whose
  ``set_parameters`` loads only the ``linear`` layers), drawn from the first half of
  ``jax.random.split`` of the client's key, the second half being the training's; no
  client state is kept then. ``"fresh_torch"`` draws that init as their PyTorch layers
  draw theirs (``models.torch_init``).
* Personalized model at evaluation: the client's local layers with the current global
  layers, frozen (the method's "client body + global head"), the local layers first
  trained for E epochs on the client's train split under that head, from the client's
  stored ones (``l_0`` for a client that never trained). The authors' LG-FedAvg
  evaluation likewise trains every layer but their ``linear`` layers (``requires_grad =
  False``; both dense layers on EMNIST and Stack Overflow, the classifier elsewhere)
  before testing. Evaluation never writes the state back.
* Global model (``Acc_g``): LG-FedAvg trains no global local layers, and ``l_0`` with
  ``g`` is near chance. The global logits are those of ``l_bar`` with ``g``, where
  ``l_bar`` is the example-weighted mean of the local layers the clients of the latest
  round trained (weights ``n_i``): a real global model, comparable with FedAvg's, that
  training never uses.

``client_snapshot=True`` also scores the copy the Flow authors' evaluation reports as
LG-FedAvg's Acc_g (``client_lgfedavg.py``, ``*_generalized_test``: ``before_net``, copied
after the first of the E epochs that train every layer but their ``linear`` ones): the
client's local layers after the first epoch of the evaluation's local training, with the
current global layers, as ``acc_g_client_snapshot`` beside ``acc_g``. Training, Acc_g and
Acc_p are unchanged. Their evaluation starts the local layers from a fresh random init
(their client objects are rebuilt each round and load only the ``linear`` layers):
``personal_init="fresh"``; by default they start from the client's stored ones.

On the LSTMs their layers are PyTorch's: ``nn.LSTM`` trains two biases per cell (``b_ih``
and ``b_hh``, each with the gradient of their sum, so the sum moves twice as far as one
bias would) and ``nn.Embedding(padding_idx=0)`` never trains the padding row;
``torch_layers=True`` trains flowjax's layers so (``models.layers.with_torch_layers``; the
outputs are the same; the CNN and the ResNet are unaffected). Their round is not reached
on the LSTMs without it (``launch/parity_fine_tuning.py``'s Shakespeare and Stack
Overflow checks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from flowjax.algorithms.base import (FROZEN_MOMENTUM, PERSONAL_INITS, ClientResult,
                                     FederatedAlgorithm, SGDConfig, fresh_layers,
                                     group_sgd_step, layer_names_or_none, personal_start,
                                     merged_loss_sums, split_layers, top_layer_names,
                                     train_part, train_part_with_snapshot, train_plain,
                                     unrouted_predict, valid_examples)
from flowjax.core.local_training import run_epochs
from flowjax.core.checks import FieldError, check_fields, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.core.server_opt import ClientMean
from flowjax.models.base import Params, RoutableModel, forward
from flowjax.models.layers import with_torch_layers


# ``LGFedAvgConfig.local_update``: both parts in one step, or one after the other.
LOCAL_UPDATES = ("joint", "alternating")


@dataclasses.dataclass(frozen=True)
class LGFedAvgConfig:
    """LG-FedAvg's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD (its epochs are also those of the evaluation's local training).
      global_layers: names of the top layers the server averages (None = the model's
        ``head_layers``); which names fit is the model's business (``global_layer_names``).
      client_snapshot: also score the local layers after the first evaluation epoch, the
        authors' LG-FedAvg Acc_g (module docstring; None = off).
      personal_init: where a client's local layers start, each round and at evaluation:
        "stored" (None), its own from its last round; "fresh", a new random init (the
        Flow authors' code; the method is then stateless): the model's own init, or
        "fresh_torch", drawn as their PyTorch networks draw those layers
        (``models.torch_init``). Module docstring.
      local_update: "joint" (None), one SGD step on both parts per batch (the paper's);
        "alternating", per batch a step on the local layers, then one on the global
        layers from the updated local ones (the Flow authors' code). Module docstring.
      frozen_momentum: with ``local_update="alternating"``, the part a step freezes:
        "set_to_none" (None), each part its own optimizer state, left as it is; "zero_grad",
        stepped by its momentum (the Flow authors' code under the PyTorch 1.11 of their
        environment; ``base.FROZEN_MOMENTUM``). Refused with the joint update, which
        freezes nothing.
      torch_layers: True: the layers learn as the Flow authors' PyTorch ones: each LSTM
        layer's bias as PyTorch's two (``b_ih``, ``b_hh``, both trained: twice the gradient
        on their sum), no gradient to the embedding's padding row (``padding_idx=0``)
        (``models.layers.with_torch_layers``; the outputs unchanged; None = off).
    """

    sgd: SGDConfig
    global_layers: tuple[str, ...] | None = None
    client_snapshot: bool | None = None
    personal_init: str | None = None
    local_update: str | None = None
    frozen_momentum: str | None = None
    torch_layers: bool | None = None

    def __post_init__(self):
        if self.global_layers is not None:  # a config file's list reads as a tuple
            object.__setattr__(self, "global_layers", tuple(self.global_layers))
        check_fields(self, {"global_layers": layer_names_or_none,
                            "client_snapshot": one_of((None, False, True)),
                            "personal_init": one_of((None, *PERSONAL_INITS)),
                            "local_update": one_of((None, *LOCAL_UPDATES)),
                            "frozen_momentum": one_of((None, *FROZEN_MOMENTUM)),
                            "torch_layers": one_of((None, False, True))})
        if self.frozen_momentum is not None and self.local_update != "alternating":
            raise FieldError("frozen_momentum", self.frozen_momentum,
                             "expected None with the joint local update, which freezes no "
                             "part (set local_update='alternating')")


def global_layer_names(model: RoutableModel, requested: Sequence[str] | None) -> tuple[str, ...]:
    """The global layers for ``model``, validated: a proper, non-empty suffix of its layers."""
    return top_layer_names(model, requested, option="LG-FedAvg global_layers", below="local")


def lg_fedavg(model: RoutableModel, config: LGFedAvgConfig) -> FederatedAlgorithm:
    """LG-FedAvg for ``model`` with ``config.global_layers`` averaged by the server."""
    if config.torch_layers:
        model = with_torch_layers(model)
    global_names = global_layer_names(model, config.global_layers)
    local_names = tuple(name for name in model.layer_names if name not in global_names)
    optimizer = config.sgd.optimizer()
    fresh_init = fresh_layers(model, local_names, config.personal_init)
    fresh = fresh_init is not None
    train = dict(batch_size=config.sgd.batch_size, **config.sgd.loop)

    def init(key) -> Params:
        global_part, local_part = split_layers(model.init(key), global_names)
        return {"global": global_part, "initial_local": local_part,
                # A copy: the engine donates the server state (no buffer donated twice).
                "mean_local": ClientMean(jax.tree.map(jnp.copy, local_part))}

    def local_train(global_part, local_part, examples: ClientExamples, key):
        member = valid_examples(examples)
        if config.local_update == "alternating":
            x, y, _ = examples.flat()
            parts = {"local": local_part, "global": global_part}
            states = {name: optimizer.init(part) for name, part in parts.items()}
            (parts, _), sums = run_epochs(
                alternating_step(model, optimizer, config.frozen_momentum or "set_to_none"),
                (parts, states), x, y, member, num_epochs=config.sgd.epochs, key=key, **train)
            return parts["global"], parts["local"], sums
        trained, sums = train_plain(model, {**local_part, **global_part}, optimizer, examples,
                                    member, epochs=config.sgd.epochs, key=key, **train)
        global_part, local_part = split_layers(trained, global_names)
        return global_part, local_part, sums

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        local_part, key = personal_start(fresh_init, client_state, key)
        global_part, local_part, sums = local_train(params["global"], local_part, examples, key)
        weight = examples.num_examples.astype(jnp.float32)
        return ClientResult(
            params={"global": global_part, "initial_local": params["initial_local"],
                    # A copy: the engine donates the server state (no buffer donated twice).
                "mean_local": ClientMean(jax.tree.map(jnp.copy, local_part))},
            weight={"global": weight, "initial_local": jnp.zeros_like(weight),
                    "mean_local": weight},
            metrics={"loss_sum": sums[0], "loss_count": sums[1]},
            client_state=None if fresh else local_part)

    def personalize(params, examples: ClientExamples, key, client_state) -> Params:
        local_part, key = personal_start(fresh_init, client_state, key)
        run = dict(epochs=config.sgd.epochs, key=key, **train)
        if not config.client_snapshot:
            local_part, _ = train_part(model, local_part, params["global"], optimizer,
                                       examples, valid_examples(examples), **run)
            return {**local_part, **params["global"]}
        local_part, snapshot = train_part_with_snapshot(
            model, local_part, params["global"], optimizer, examples, valid_examples(examples),
            **run)
        return {"personal": {**local_part, **params["global"]},
                "snapshot": {**snapshot, **params["global"]}}

    predict = unrouted_predict(
        lambda params, x: forward(model, {**params["mean_local"].value, **params["global"]}, x),
        lambda params, personal, x: forward(model, personal, x), config.client_snapshot)

    def init_client_state(params) -> Params:
        return params["initial_local"]

    return FederatedAlgorithm(name="lg_fedavg", model=model, init=init,
                              client_update=client_update, personalize=personalize,
                              predict=predict,
                              init_client_state=None if fresh else init_client_state)


def alternating_step(model: RoutableModel, optimizer: optax.GradientTransformation,
                     frozen_momentum: str) -> Callable[..., Any]:
    """A ``run_epochs`` step of ``local_update="alternating"`` on the carry ``({"local",
    "global"}: layers, {"local", "global"}: optimizer states)``: an SGD step on the local
    layers (the global ones frozen), then one on the global layers from the updated local
    ones, on the same batch, with the step key's ``fold_in`` 0 and 1 (dropout); a frozen
    part as ``frozen_momentum`` says (``base.group_sgd_step``). Returns the second
    forward's ``[loss_sum, weight_sum]``, the loss the authors' loop accumulates."""

    loss_sums = merged_loss_sums(model)
    local_step = group_sgd_step(loss_sums, ("local",), optimizer, frozen_momentum)
    global_step = group_sgd_step(loss_sums, ("global",), optimizer, frozen_momentum)

    def step(carry, batch, key):
        carry, _ = local_step(carry, batch, jax.random.fold_in(key, 0))
        return global_step(carry, batch, jax.random.fold_in(key, 1))

    return step
