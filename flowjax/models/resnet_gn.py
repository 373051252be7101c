"""ResNet-18 with GroupNorm for 32x32 images (CIFAR), declared as six routable layers.

The CIFAR variant of He et al. (2016): a 3x3 stem convolution and no max-pool, then four
stages of two BasicBlocks. BatchNorm is replaced by GroupNorm because batch statistics are
per-client state that federated averaging cannot merge sensibly (and small, non-IID client
batches make them noisy); GroupNorm normalizes each example on its own.

Group count: 2 by default. Hsieh et al. (2020) proposed GroupNorm as FL's replacement for
BatchNorm, and 2 groups is the common setting of GroupNorm ResNet-18s in FL code (e.g.
PyTorch ports of the FedPA baseline use ``num_groups=2``). With 2 groups each statistic
pools over half the channels, so it stays stable even in the 64-channel stages on
one-example batches. ``groups=32`` (Wu & He's default for ImageNet) is one argument away.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel, uniform_label_weights
from flowjax.models.layers import Conv2D, Dense, chain_model

IMAGE_SHAPE = (32, 32, 3)
STAGE_WIDTHS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)
LAYER_NAMES = ("stem", "stage1", "stage2", "stage3", "stage4", "fc")
# PyTorch's GroupNorm epsilon; Flax's default (1e-6) would work as well.
_GN_EPSILON = 1e-5
# torchvision's ResNet init for convolutions (kaiming normal, fan_out, relu gain).
CONV_INIT: Callable[..., jax.Array] = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def _conv(features: int, kernel: int, stride: int, custom_grad: bool) -> Conv2D:
    """A bias-free convolution (GroupNorm follows); strided ones use autodiff, since the
    hand-written VJP is stride-1 only, and take an input padded by ``_pad_strided``."""
    padding = "SAME" if kernel > 1 and stride == 1 else "VALID"
    return Conv2D(features, (kernel, kernel), padding=padding,
                  custom_grad=custom_grad and stride == 1, stride=stride, use_bias=False,
                  kernel_init=CONV_INIT)


def _pad_strided(x: jax.Array, kernel: int) -> jax.Array:
    """``kernel // 2`` zeros on each side, PyTorch's ``padding=1`` for a 3x3 window (He et
    al., torchvision, the authors' network). "SAME" would pad a stride-2 window (0, 1) on
    an even input, centring it on odd pixels while the stride-2 1x1 shortcut samples the
    even ones: the block would add two paths one pixel apart."""
    half = kernel // 2
    return jnp.pad(x, ((0, 0), (half, half), (half, half), (0, 0)))


def _norm(groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, epsilon=_GN_EPSILON)


class Stem(nn.Module):
    """conv3x3-64 and GroupNorm; the ReLU is glue, so routing mixes pre-activations."""

    features: int
    groups: int
    custom_grad: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _norm(self.groups)(_conv(self.features, 3, 1, self.custom_grad)(x))


class BasicBlock(nn.Module):
    """conv3x3-GN-relu-conv3x3-GN plus a shortcut, then relu.

    The shortcut is the identity when shapes match, else a strided conv1x1-GN projection.
    """

    features: int
    stride: int
    groups: int
    custom_grad: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        strided_input = x if self.stride == 1 else _pad_strided(x, 3)
        y = _conv(self.features, 3, self.stride, self.custom_grad)(strided_input)
        y = jax.nn.relu(_norm(self.groups)(y))
        y = _norm(self.groups)(_conv(self.features, 3, 1, self.custom_grad)(y))
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.features:
            shortcut = _conv(self.features, 1, self.stride, self.custom_grad)(x)
            shortcut = _norm(self.groups)(shortcut)
        return jax.nn.relu(y + shortcut)


class Stage(nn.Module):
    """Two BasicBlocks, the first one strided; one routable layer."""

    features: int
    stride: int
    groups: int
    custom_grad: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = BasicBlock(self.features, self.stride, self.groups, self.custom_grad)(x)
        return BasicBlock(self.features, 1, self.groups, self.custom_grad)(x)


def _embed_input(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[:1] + IMAGE_SHAPE)


def _glue_apply(j: int, h: jax.Array, train: bool, key: jax.Array) -> jax.Array:
    del train, key
    if j == 0:
        return jax.nn.relu(h)
    if j == 4:
        return h.mean(axis=(1, 2))  # global average pool before the classifier
    return h


def resnet18_gn(num_classes: int = 10, groups: int = 2,
                custom_grad: bool | None = None) -> RoutableModel:
    """ResNet-18 (CIFAR variant) with GroupNorm: 11,173,962 params for 10 classes.

    Args:
      num_classes: output classes (10 for CIFAR-10, 100 for CIFAR-100).
      groups: GroupNorm groups; must divide 64 (the narrowest stage).
      custom_grad: stride-1 convolutions with the hand-written VJP or plain autodiff;
        ``None`` picks the custom VJP on CPU only, as ``emnist_cnn`` does. Strided
        convolutions always use autodiff.

    Returns:
      A model taking standardized float32 images ``[B, 32, 32, 3]`` (or anything that
      reshapes to it, e.g. ``[B, 3072]``) to logits ``[B, num_classes]``, routed at
      ``stem, stage1..stage4, fc``: the stem's pre-activation output, each stage's output
      (after its last block's ReLU) and the logits.
    """
    if custom_grad is None:
        custom_grad = jax.default_backend() == "cpu"
    if STAGE_WIDTHS[0] % groups:
        raise ValueError(f"groups={groups} must divide {STAGE_WIDTHS[0]}")
    stages = tuple(Stage(width, stride, groups, custom_grad)
                   for width, stride in zip(STAGE_WIDTHS, STAGE_STRIDES))
    modules = (Stem(STAGE_WIDTHS[0], groups, custom_grad), *stages, Dense(num_classes))
    return chain_model(
        name="resnet18_gn", layer_names=LAYER_NAMES, modules=modules,
        embed_input=_embed_input, glue_apply=_glue_apply,
        example_input=jax.ShapeDtypeStruct((1,) + IMAGE_SHAPE, jnp.float32),
        label_weights=uniform_label_weights, instance_ndim=1, num_classes=num_classes,
        policy_input="flat", head_layers=("fc",))
