"""The EMNIST CNN of Reddi et al. (2021), declared as four routable layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel, uniform_label_weights
from flowjax.models.layers import (Conv2D, chain_model, compute_dtype_of, dense, dropout,
                                   max_pool_2x2)

IMAGE_SHAPE = (28, 28, 1)


def _embed_input(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[:1] + IMAGE_SHAPE)


def _glue_apply(j: int, h: jax.Array, train: bool, key: jax.Array) -> jax.Array:
    if j == 0:
        return jax.nn.relu(h)
    if j == 1:
        h = dropout(max_pool_2x2(jax.nn.relu(h)), 0.25, train, key)
        return h.reshape(h.shape[0], -1)
    if j == 2:
        return dropout(jax.nn.relu(h), 0.5, train, key)
    return h


def emnist_cnn(num_classes: int = 62, custom_grad: bool | None = None, conv_impl: str = "auto",
               compute_dtype: str = "float32") -> RoutableModel:
    """conv3x3-32, relu, conv3x3-64, relu, maxpool2, dropout .25, dense 128, relu, dropout .5,
    dense ``num_classes`` (1,206,590 params for 62 classes).

    Args:
      num_classes: output classes.
      custom_grad: convolutions with the hand-written VJP or plain autodiff. ``None``
        picks by backend: the custom VJP on CPU (XLA CPU's backward convs in a loop are
        15-20x slower without it), autodiff elsewhere (on GPU the custom VJP's one-conv-
        per-client vmap rule measured no faster than a loop; cuDNN handles the grouped
        convolutions autodiff's vmap produces).
      conv_impl: ``"xla"``, ``"im2col"``, ``"im2col_slices"`` or ``"auto"``
        (``layers.resolve_conv_impl``: xla on CPU, im2col_slices on GPU, each measured
        fastest there).
      compute_dtype: ``"float32"`` (the default; exactly the float32 model) or
        ``"bfloat16"``: convolutions and dense layers multiply in bf16 with float32
        accumulation; params, gradients and optimizer state stay float32.

    Returns:
      A model taking ``x`` float32 ``[B, 28, 28]`` or ``[B, 28, 28, 1]``, routed at
      ``conv1, conv2, fc1, fc2`` (pre-activation outputs).
    """
    if custom_grad is None:
        custom_grad = jax.default_backend() == "cpu"
    dtype = compute_dtype_of(compute_dtype)
    conv = lambda features: Conv2D(features, custom_grad=custom_grad, impl=conv_impl,  # noqa: E731
                                   compute_dtype=dtype)
    modules = (conv(32), conv(64), dense(128, dtype), dense(num_classes, dtype))
    return chain_model(
        name="emnist_cnn", layer_names=("conv1", "conv2", "fc1", "fc2"), modules=modules,
        embed_input=_embed_input, glue_apply=_glue_apply,
        example_input=jax.ShapeDtypeStruct((1,) + IMAGE_SHAPE, jnp.float32),
        label_weights=uniform_label_weights, instance_ndim=1, num_classes=num_classes,
        policy_input="flat", head_layers=("fc2",))
