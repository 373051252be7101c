"""PyTorch's initialization of flowjax's layers, as the Flow authors' networks draw theirs.

The authors' FedRep and LG-FedAvg start their personal layers from a fresh init every
round (their client objects are rebuilt and never load them), and that init is their
PyTorch modules' own, not flowjax's (Flax's LeCun normal, Keras' LSTM):

* ``nn.Linear(in, out)`` and ``nn.Conv2d`` with a bias: weight and bias each uniform on
  ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` (``kaiming_uniform_(a=sqrt(5))`` and the bias
  rule of ``reset_parameters``), ``fan_in`` the input features (times the kernel's area);
* ``nn.LSTM(hidden)``: every weight and both biases uniform on ``[-1/sqrt(hidden),
  1/sqrt(hidden)]``; flowjax's one bias is their sum (the cell adds ``b_ih + b_hh``),
  drawn as the sum of two such draws;
* ``nn.Embedding(padding_idx=0)`` (their Shakespeare and Stack Overflow nets): standard
  normal, row 0 zero;
* their ResNet (``models/cifar100_resnet.py``) sets its own: every (bias-free) convolution
  normal with variance ``2 / (k * k * out_channels)``, each norm's weight 1 and bias 0,
  and then each BasicBlock's second norm weight 0 (``bn2.weight.data.fill_(0)``).

Only the distributions are theirs: the draws come from JAX's keys, not PyTorch's
generator.

Three styles change factors of theirs back to flowjax's, on dense and convolution layers
only (LSTMs, embeddings, norms and the ResNet's convolutions drawn as in ``"torch"``), to
tell which one moves a result: ``"torch_lecun_variance"`` draws the weights uniform on
``[-sqrt(3/fan_in), sqrt(3/fan_in)]``, variance ``1/fan_in`` as flowjax's LeCun normal
(theirs is a third of it), each value ``sqrt(3)`` times the ``"torch"`` draw of the same
key; ``"torch_zero_biases"`` keeps the ``"torch"`` weights bit for bit and zeroes the
biases, as flowjax's; ``"torch_lecun_variance_zero_biases"`` does both (on those layers
Flax's ``lecun_uniform``: only the weights' distribution, uniform against flowjax's
truncated normal, is left of theirs).

Their code draws every network so, for every method, at the start of a run too:
``with_torch_init`` gives a model whose whole ``init`` follows these rules (the run
config's ``model_init="torch"``), and ``drawn_in_style`` draws a part built beside the
model (Flow's routing policy: ``nn.Linear`` layers in their code) in the model's style.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from flowjax.models.base import Params, RoutableModel
from flowjax.models.layers import TORCH_PADDING_IDX, is_embedding, lstm_weights

# PyTorch's styles: what each does to a dense or convolution layer's draw, (the factor
# its weights are scaled by, whether its biases are drawn or zero).
_DENSE_AND_CONV = {"torch": (1.0, True),
                   "torch_lecun_variance": (math.sqrt(3.0), True),
                   "torch_zero_biases": (1.0, False),
                   "torch_lecun_variance_zero_biases": (math.sqrt(3.0), False)}
TORCH_STYLES = tuple(_DENSE_AND_CONV)
# A model's ``init_style`` (``RoutableModel``): its layers' own init, PyTorch's, or
# PyTorch's with factors of it on dense and convolution layers made flowjax's.
INIT_STYLES = ("flax", *TORCH_STYLES)

# flowjax's BasicBlock names its norms in call order: after the first convolution, after
# the second (their ``bn2``), on the projection shortcut (their ``downsample``'s).
_SECOND_BLOCK_NORM = "GroupNorm_1"


def _uniform(key: jax.Array, shape: tuple[int, ...], bound: float) -> jax.Array:
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _linear_or_conv(node: dict, key: jax.Array, style: str) -> dict:
    kernel = node["kernel"]
    bound = 1.0 / math.sqrt(math.prod(kernel.shape[:-1]))  # fan_in: all but out
    k_kernel, k_bias = jax.random.split(key)
    scale, biases = _DENSE_AND_CONV[style]
    weights = _uniform(k_kernel, kernel.shape, bound)
    if scale != 1.0:
        weights = scale * weights
    bias = (_uniform(k_bias, node["bias"].shape, bound) if biases
            else jnp.zeros(node["bias"].shape, jnp.float32))
    return {"kernel": weights, "bias": bias}


def _lstm(node: dict, key: jax.Array) -> dict:
    bound = 1.0 / math.sqrt(node["recurrent_kernel"].shape[0])
    k_x, k_h, k_ih, k_hh = jax.random.split(key, 4)
    shape = node["bias"].shape
    return {"kernel": _uniform(k_x, node["kernel"].shape, bound),
            "recurrent_kernel": _uniform(k_h, node["recurrent_kernel"].shape, bound),
            "bias": _uniform(k_ih, shape, bound) + _uniform(k_hh, shape, bound)}


def _embedding(node: dict, key: jax.Array) -> dict:
    table = jax.random.normal(key, node["embedding"].shape, jnp.float32)
    return {"embedding": table.at[TORCH_PADDING_IDX].set(0.0)}


def _resnet_conv(node: dict, key: jax.Array) -> dict:
    kernel = node["kernel"]  # [k, k, in, out]
    std = math.sqrt(2.0 / (kernel.shape[0] * kernel.shape[1] * kernel.shape[-1]))
    return {"kernel": std * jax.random.normal(key, kernel.shape, jnp.float32)}


def _norm(node: dict, zero_scale: bool) -> dict:
    scale = jnp.zeros if zero_scale else jnp.ones
    return {"scale": scale(node["scale"].shape, jnp.float32),
            "bias": jnp.zeros(node["bias"].shape, jnp.float32)}


def _draw(node: Any, key: jax.Array, path: tuple[str, ...], style: str) -> Any:
    if not isinstance(node, dict):
        raise ValueError(f"layer part {'/'.join(path)!r}: expected a dict of params")
    keys = set(node)
    if lstm_weights(node) is not None:
        return _lstm(node, key)
    if keys == {"kernel", "bias"} and node["kernel"].ndim in (2, 4):
        return _linear_or_conv(node, key, style)
    if is_embedding(node):
        return _embedding(node, key)
    if keys == {"kernel"} and node["kernel"].ndim == 4:
        return _resnet_conv(node, key)
    if keys == {"scale", "bias"}:
        return _norm(node, zero_scale=len(path) >= 2 and path[-1] == _SECOND_BLOCK_NORM
                     and path[-2].startswith("BasicBlock_"))
    if any(isinstance(value, dict) for value in node.values()):
        return {name: _draw(child, jax.random.fold_in(key, i), (*path, name), style)
                for i, (name, child) in enumerate(sorted(node.items()))}
    raise ValueError(f"layer part {'/'.join(path)!r} with params {sorted(keys)}: expected "
                     "a dense, convolution, LSTM, embedding or norm layer")


def _check_torch_style(style: str) -> None:
    if style not in TORCH_STYLES:
        raise ValueError(f"init style {style!r}: expected one of {TORCH_STYLES}")


def torch_init(layers: Params, key: jax.Array, style: str = "torch") -> Params:
    """Fresh params of ``layers``' shapes (``{layer name: params}``, arrays or
    ``jax.ShapeDtypeStruct``) drawn as the authors' PyTorch networks draw the same layers
    (module docstring), or with factors made flowjax's (``style``, one of
    ``TORCH_STYLES``); each layer from ``fold_in(key, i)``, ``i`` its index in sorted
    order. Raises ``ValueError`` naming a part of no known kind, or an unknown style."""
    _check_torch_style(style)
    return {name: _draw(layers[name], jax.random.fold_in(key, i), (name,), style)
            for i, name in enumerate(sorted(layers))}


def with_torch_init(model: RoutableModel, style: str = "torch") -> RoutableModel:
    """``model`` whose ``init(key)`` draws every layer as the authors' PyTorch networks
    draw it (``torch_init`` of the model's own shapes in ``style``, from the same key);
    the forward pass and everything else unchanged. Raises ``ValueError`` for an unknown
    style, and at ``init`` for a layer of no known kind."""
    _check_torch_style(style)

    def init(key: jax.Array) -> Params:
        return torch_init(jax.eval_shape(model.init, key), key, style)

    return dataclasses.replace(model, init=init, init_style=style)


def drawn_in_style(style: str, params: Params, key: jax.Array) -> Params:
    """``params`` of a part built beside a model (a Flax module's ``{layer name: params}``)
    drawn in the model's ``style``: as given for ``"flax"``; for the PyTorch styles every
    layer redrawn by ``torch_init`` in that style from ``key`` except embedding tables,
    which keep theirs (the token policy's own embedding has no counterpart in the
    authors' code to follow)."""
    if style == "flax":
        return params
    if style not in TORCH_STYLES:
        raise ValueError(f"init style {style!r}: expected one of {INIT_STYLES}")
    return {**params, **torch_init({name: layer for name, layer in params.items()
                                    if not is_embedding(layer)}, key, style)}
