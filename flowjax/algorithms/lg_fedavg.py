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
(their client objects are rebuilt each round and load only the ``linear`` layers); here
they start from the client's stored ones.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, SGDConfig,
                                     layer_names_or_none, split_layers, top_layer_names,
                                     train_part, train_part_with_snapshot, train_plain,
                                     unrouted_predict, valid_examples)
from flowjax.core.checks import check_fields, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.core.server_opt import ClientMean
from flowjax.models.base import Params, RoutableModel, forward


@dataclasses.dataclass(frozen=True)
class LGFedAvgConfig:
    """LG-FedAvg's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD (its epochs are also those of the evaluation's local training).
      global_layers: names of the top layers the server averages (None = the model's
        ``head_layers``); which names fit is the model's business (``global_layer_names``).
      client_snapshot: also score the local layers after the first evaluation epoch, the
        authors' LG-FedAvg Acc_g (module docstring; None = off).
    """

    sgd: SGDConfig
    global_layers: tuple[str, ...] | None = None
    client_snapshot: bool | None = None

    def __post_init__(self):
        if self.global_layers is not None:  # a config file's list reads as a tuple
            object.__setattr__(self, "global_layers", tuple(self.global_layers))
        check_fields(self, {"global_layers": layer_names_or_none,
                            "client_snapshot": one_of((None, False, True))})


def global_layer_names(model: RoutableModel, requested: Sequence[str] | None) -> tuple[str, ...]:
    """The global layers for ``model``, validated: a proper, non-empty suffix of its layers."""
    return top_layer_names(model, requested, option="LG-FedAvg global_layers", below="local")


def lg_fedavg(model: RoutableModel, config: LGFedAvgConfig) -> FederatedAlgorithm:
    """LG-FedAvg for ``model`` with ``config.global_layers`` averaged by the server."""
    global_names = global_layer_names(model, config.global_layers)
    optimizer = config.sgd.optimizer()

    def init(key) -> Params:
        global_part, local_part = split_layers(model.init(key), global_names)
        return {"global": global_part, "initial_local": local_part,
                # A copy: the engine donates the server state (no buffer donated twice).
                "mean_local": ClientMean(jax.tree.map(jnp.copy, local_part))}

    def local_train(global_part, local_part, examples: ClientExamples, key):
        trained, sums = train_plain(model, {**local_part, **global_part}, optimizer, examples,
                                    valid_examples(examples), epochs=config.sgd.epochs,
                                    batch_size=config.sgd.batch_size, key=key,
                                    **config.sgd.loop)
        global_part, local_part = split_layers(trained, global_names)
        return global_part, local_part, sums

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        global_part, local_part, sums = local_train(params["global"], client_state, examples, key)
        weight = examples.num_examples.astype(jnp.float32)
        return ClientResult(
            params={"global": global_part, "initial_local": params["initial_local"],
                    # A copy: the engine donates the server state (no buffer donated twice).
                "mean_local": ClientMean(jax.tree.map(jnp.copy, local_part))},
            weight={"global": weight, "initial_local": jnp.zeros_like(weight),
                    "mean_local": weight},
            metrics={"loss_sum": sums[0], "loss_count": sums[1]},
            client_state=local_part)

    def personalize(params, examples: ClientExamples, key, client_state) -> Params:
        train = dict(epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                     **config.sgd.loop)
        if not config.client_snapshot:
            local_part, _ = train_part(model, client_state, params["global"], optimizer,
                                       examples, valid_examples(examples), **train)
            return {**local_part, **params["global"]}
        local_part, snapshot = train_part_with_snapshot(
            model, client_state, params["global"], optimizer, examples, valid_examples(examples),
            **train)
        return {"personal": {**local_part, **params["global"]},
                "snapshot": {**snapshot, **params["global"]}}

    predict = unrouted_predict(
        lambda params, x: forward(model, {**params["mean_local"].value, **params["global"]}, x),
        lambda params, personal, x: forward(model, personal, x), config.client_snapshot)

    def init_client_state(params) -> Params:
        return params["initial_local"]

    return FederatedAlgorithm(name="lg_fedavg", model=model, init=init,
                              client_update=client_update, personalize=personalize,
                              predict=predict, init_client_state=init_client_state)
