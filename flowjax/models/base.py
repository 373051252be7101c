"""The routable model protocol shared by every model, the routing package and algorithms.

A model is an ordered chain of *routable layers*. Every parameter belongs to exactly one
routable layer, so "a local copy of the model" and "a local copy of every routable layer"
are the same thing. Layer ``j`` is split into:

* ``layer_apply(j, layer_params, h) -> h``: the parameterised op (conv, dense, LSTM, ...)
  whose *output* the router mixes between the global and the local copy;
* ``glue_apply(j, h, train, key) -> h``: what follows it without parameters (activation,
  pooling, dropout, flatten). Both copies see the same mixed input.

``forward`` below composes them into the plain model; ``flowjax.routing`` composes them
into the routed model. Models never know about algorithms.

Instance axes: the router produces one routing probability per *instance*. For image
classifiers an instance is an example (``instance_shape = [batch]``); for next-token
language models an instance is a token position (``[batch, time]``), which keeps routing
causal. ``mix`` broadcasts ``q0`` of shape ``[*instance]`` against a layer output of shape
``[*instance, ...]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

PyTree = Any
Params = dict[str, PyTree]  # {layer_name: layer params}


@dataclasses.dataclass(frozen=True)
class RoutableModel:
    """A model declared once as a chain of routable layers.

    Attributes:
      name: registry name, e.g. ``"emnist_cnn"``.
      layer_names: routable layers in forward order; keys of the params dict.
      init: ``init(key) -> Params``.
      embed_input: ``embed_input(x) -> h0``; parameter-free input preprocessing.
      layer_apply: ``layer_apply(j, layer_params, h) -> h``.
      glue_apply: ``glue_apply(j, h, train, key) -> h``; parameter-free.
      label_weights: ``label_weights(y) -> float array [*instance]``; 0 where a label
        must not count (padding tokens), 1 elsewhere: the training losses' weights.
      metric_weights: the same for the accuracies only (None: ``label_weights``), for a
        metric that leaves out labels training still fits (Stack Overflow's accuracy
        without oov/eos).
      instance_ndim: 1 for ``[batch]`` instances, 2 for ``[batch, time]``.
      num_classes: size of the output distribution.
      policy_input: how ``flowjax.routing`` turns ``x`` into per-instance policy
        features: ``"flat"`` (flattened example) or ``"tokens"`` (causal token features).
      vocab_size: number of token ids when ``policy_input == "tokens"``.
      head_layers: trailing layers treated as the classifier head by head/body methods.
      routed_recurrence: ``routed_recurrence(j, global_layer, local_layer, h, q0, hard)``:
        recurrent layer ``j`` routed at every time step on the mixed state (``flowjax.routing``'s
        ``"mixed_state"``), with the layer's own options; None for a model without one.
      recurrent_layers: the layers ``routed_recurrence`` takes (the model's LSTMs).
      init_style: how ``init`` draws the params: ``"flax"``, the layers' own (Flax's
        LeCun normal with zero biases, Keras' LSTM), or ``"torch"``, PyTorch's, as the
        Flow authors' networks draw theirs (``models.torch_init.with_torch_init``; also
        ``"torch_lecun_variance"``, ``"torch_zero_biases"`` and both: factors of it
        undone). Parts an algorithm builds beside the model (Flow's policy) are drawn in
        the same style.
    """

    name: str
    layer_names: tuple[str, ...]
    init: Callable[[jax.Array], Params]
    embed_input: Callable[[jax.Array], jax.Array]
    layer_apply: Callable[[int, PyTree, jax.Array], jax.Array]
    glue_apply: Callable[[int, jax.Array, bool, jax.Array], jax.Array]
    label_weights: Callable[[jax.Array], jax.Array]
    instance_ndim: int
    num_classes: int
    policy_input: str = "flat"
    vocab_size: int = 0
    head_layers: tuple[str, ...] = ()
    metric_weights: Callable[[jax.Array], jax.Array] | None = None
    routed_recurrence: Callable[[int, PyTree, PyTree, jax.Array, jax.Array, bool],
                                jax.Array] | None = None
    recurrent_layers: tuple[str, ...] = ()
    init_style: str = "flax"

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


def uniform_label_weights(y: jax.Array) -> jax.Array:
    """Weight 1 for every label: models whose labels have no padding value."""
    return jnp.ones(y.shape, jnp.float32)


def layer_key(key: jax.Array, j: int) -> jax.Array:
    """The dropout key of layer ``j``; the plain and the routed model use the same one."""
    return jax.random.fold_in(key, j)


def forward(model: RoutableModel, params: Params, x: jax.Array, *, train: bool = False,
            key: jax.Array | None = None) -> jax.Array:
    """Plain (unrouted) forward pass: logits of shape ``[*instance, num_classes]``."""
    if key is None:
        key = jax.random.key(0)
    h = model.embed_input(x)
    for j, name in enumerate(model.layer_names):
        h = model.layer_apply(j, params[name], h)
        h = model.glue_apply(j, h, train, layer_key(key, j))
    return h


def mix(q0: jax.Array, global_out: jax.Array, local_out: jax.Array) -> jax.Array:
    """``q0 * global_out + (1 - q0) * local_out`` with ``q0`` broadcast over feature axes.

    With ``q0 == 1`` the result equals ``global_out`` bit for bit (``1 * g + 0 * l``), and
    with ``q0 == 0`` it equals ``local_out``, as long as both outputs are finite.
    """
    q0 = q0.reshape(q0.shape + (1,) * (global_out.ndim - q0.ndim)).astype(global_out.dtype)
    return q0 * global_out + (1.0 - q0) * local_out


def select(use_global: jax.Array, global_out: jax.Array, local_out: jax.Array) -> jax.Array:
    """Hard routing: per instance, one branch's output exactly."""
    use_global = use_global.reshape(use_global.shape + (1,) * (global_out.ndim - use_global.ndim))
    return jnp.where(use_global, global_out, local_out)


def instance_weights(model: RoutableModel, y: jax.Array, example_weights: jax.Array,
                     for_metrics: bool = False) -> jax.Array:
    """Per-instance loss weights: the example mask times the model's label weights
    (``for_metrics``: its metric weights, where it has its own)."""
    extra = y.ndim - example_weights.ndim
    weights = (model.metric_weights if for_metrics and model.metric_weights is not None
               else model.label_weights)
    return weights(y) * example_weights.reshape(example_weights.shape + (1,) * extra)
