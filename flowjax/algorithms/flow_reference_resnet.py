"""The authors' Flow for CIFAR, as their code runs it: the reference mode
(``semantics="reference"``) of ``flowjax.algorithms.flow`` for ``resnet18_gn``.

Their CIFAR network (``models/cifar100_resnet_dynamic_v4.py``, ``resnet18``; the same file
serves CIFAR-10 and CIFAR-100) is another network than flowjax's ``resnet18_gn``, so this
module builds it whole, in NHWC:

* per branch, the ImageNet ResNet-18 stem ``conv7x7/2`` (padding 3, no bias); the two
  stems' outputs are mixed by route 1 and then go through **one** GroupNorm shared by both
  branches (``bn1``, in every phase's graph, so it trains in every phase), relu and
  ``maxpool 3x3/2`` (padding 1); then per branch four stages of two BasicBlocks (64, 128,
  256, 512 channels; strides 1, 2, 2, 2; a ``conv1x1/s`` + norm projection where the
  shape changes), each stage's two outputs mixed by routes 2-5; their ``AvgPool2d(1)`` is
  the identity (a 32x32 image is 1x1 after stage 4), so the 512 features go straight to
  both branches' ``fc``, mixed by route 6;
* their GroupNorm (``models/group_normalization.py``, ``GroupNorm2d(C, 2)``) normalizes
  groups of **2 consecutive channels** (its second argument is the channels per group)
  over each example's ``2 x H x W`` values (biased variance, eps 1e-5), and its affine
  weight and bias have one entry **per group** (``C / 2``), not per channel;
* their init: convolutions ``N(0, 2 / (k * k * C_out))``; norms weight 1, bias 0, except
  the second norm of every BasicBlock, whose weight starts at 0; ``Linear`` layers (fc
  and the policy) PyTorch's default ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weight
  and bias;
* the policy reads the input image flattened in PyTorch's ``C, H, W`` order: ``3072 ->
  1000 -> 750 -> 350 -> 150 -> 50`` (``policy_hidden[:-1]``), route ``j < 6`` from an exit
  head on base layer ``j``'s **pre-activation** (no relu), route 6 from ``50 -> 2`` after
  the last relu; softmax entry 0 weights the global branch; no dropout; hard routing is
  ``torch.round`` of both entries (round half to even);
* their input (``dataloaders/cifar10/cifar10_dataloader.py``): each training image is
  flipped left-right with probability 1/2 on every pass (``tf.image.random_flip_left_right``;
  their ``random_crop`` to 32x32 is the identity), test images are not; then every image is
  standardized on its own (``tf.image.per_image_standardization``). flowjax's CIFAR data
  holds per-channel standardized images, so the network first maps them back to pixel
  values (``flowjax.data.cifar.CHANNEL_MEAN``, ``CHANNEL_STD``).

Their client procedure (``trainers/client_flow.py``, ``cifar10_train`` and
``cifar100_train``), which this module runs: one SGD (momentum 0.9) for the whole update;
their loader does not shuffle (``shuffle(1)``), so every pass is the client's examples in
order, in batches of ``batch_size``; K epochs of the local mode (local branch and the
shared norm) on every batch, then K epochs in which each batch takes a policy step (policy
and shared norm, on routed CE plus ``gamma * mean(-log(q_local^2 + 1e-6))`` over the six
local entries) and then a global step (global branch and shared norm); the client's
weight is its number of examples; the server averages every weight. Their evaluation
(``cifar*_generalized_test``, ``evaluation="reference_policy"``): a fresh SGD, K local
epochs, then K epochs training the policy and the shared norm on the routed loss; Acc_g's
client snapshot is the net after the first of those epochs in global mode (the server's
global branch under the client's shared norm), Acc_p the hard-routed net.

Which parameters move follows PyTorch as in ``flow_reference_lstm``: one optimizer group
per part (``shared``, ``global``, ``local``, ``policy``), each of whose parameters is either
wholly in a phase's graph or wholly out of it, so ``frozen_momentum`` holds part by part
(``base.group_sgd_step``).

Not theirs: the random draws (flowjax's keys; the flips from the client's key), and the
batch size, ``config.sgd.batch_size`` (their loader's default is 20, Appendix B's
batch; their hyperparameter file's 16 is never passed to it). Single departures cannot be
switched on alone here: the network itself is theirs (``check_config``); on
``resnet18_gn`` with ``semantics="paper"`` each departure field still runs alone on
flowjax's network.
"""

from __future__ import annotations

import math
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
                                               run_planned)
from flowjax.core.checks import FieldError
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import packed_batches
from flowjax.core.losses import weighted_cross_entropy
from flowjax.data.cifar import CHANNEL_MEAN, CHANNEL_STD
from flowjax.models.base import RoutableModel
# The same image, stages and convolution init as flowjax's ResNet-18.
from flowjax.models.resnet_gn import CONV_INIT, IMAGE_SHAPE, STAGE_STRIDES, STAGE_WIDTHS

MODELS = ("resnet18_gn",)
CHANNELS_PER_GROUP = 2
NORM_EPSILON = 1e-5
NUM_ROUTES = 6
GROUPS = ("shared", "global", "local", "policy")

# Fields of ``FlowConfig`` this procedure fixes, with the only value it runs; a field set
# to anything else is refused (``check_config``).
FIXED = dict(halves="none", regularizer="reference", global_step="global_only",
             local_init="server", evaluation="reference_policy", order="alternating",
             local_route="local", fixed_q0=None, policy_eval_dropout=False,
             policy_last="dense", policy_dropout=0.0, hard_tie="zeroed")
# Fields of the paper's routed model their network has no use for (``check_unused``).
UNUSED = ("recurrence", "fuse_branches")


# ----------------------------------------------------------------------------- network


def torch_linear_init(fan_in: int):
    """PyTorch's ``nn.Linear`` default for weight and bias: ``U(-1/sqrt(fan_in), ...)``."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class TorchDense(nn.Module):
    """``nn.Linear`` with PyTorch's default init (``kernel [in, out]``)."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = torch_linear_init(x.shape[-1])
        kernel = self.param("kernel", init, (x.shape[-1], self.features))
        bias = self.param("bias", init, (self.features,))
        return x @ kernel + bias


def conv(features: int, kernel: int, stride: int, padding: int, name: str | None = None
         ) -> nn.Conv:
    """Their bias-free ``nn.Conv2d`` with their ``normal_(0, sqrt(2 / (k * k * C_out)))``
    init; PyTorch's symmetric padding."""
    return nn.Conv(features, (kernel, kernel), strides=stride, name=name,
                   padding=((padding, padding), (padding, padding)), use_bias=False,
                   kernel_init=CONV_INIT)  # N(0, 2 / (k * k * C_out)), as resnet18_gn's


class GroupNorm(nn.Module):
    """Their ``GroupNorm2d(C, 2)``: groups of 2 consecutive channels, one affine weight
    and bias per group."""

    zero_weight: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        groups = x.shape[-1] // CHANNELS_PER_GROUP
        weight = self.param("weight", nn.initializers.zeros if self.zero_weight
                            else nn.initializers.ones, (groups,))
        bias = self.param("bias", nn.initializers.zeros, (groups,))
        g = x.reshape(x.shape[:-1] + (groups, CHANNELS_PER_GROUP))
        axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)  # H, W and the group's channels
        mean = jnp.mean(g, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=axes, keepdims=True)
        g = (g - mean) * lax.rsqrt(var + NORM_EPSILON)
        return (g * weight[:, None] + bias[:, None]).reshape(x.shape)


class BasicBlock(nn.Module):
    """Their ``BasicBlock``: conv3x3/s-GN-relu-conv3x3-GN(weight 0) plus the shortcut
    (a conv1x1/s-GN projection where the shape changes), then relu."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # Their submodules' names, so the parameter tree reads as their state dict.
        y = conv(self.features, 3, self.stride, 1, name="conv1")(x)
        y = jax.nn.relu(GroupNorm(name="bn1")(y))
        y = GroupNorm(zero_weight=True, name="bn2")(conv(self.features, 3, 1, 1, name="conv2")(y))
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.features:
            shortcut = conv(self.features, 1, self.stride, 0, name="downsample_conv")(x)
            shortcut = GroupNorm(name="downsample_norm")(shortcut)
        return jax.nn.relu(y + shortcut)


class Stage(nn.Module):
    """One of their ``layer1..4``: two BasicBlocks, the first strided."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = BasicBlock(self.features, self.stride, name="block0")(x)
        return BasicBlock(self.features, 1, name="block1")(x)


class Policy(nn.Module):
    """Their ``PolicyNet``: six route logits ``[B, 6, 2]`` (index 0 global)."""

    hidden: Sequence[int]

    @nn.compact
    def __call__(self, flat: jax.Array) -> jax.Array:
        h, logits = flat, []
        for j, width in enumerate(self.hidden):
            h = TorchDense(width, name=f"base{j}")(h)
            logits.append(TorchDense(2, name=f"exit{j}")(h))  # on the pre-activation
            h = jax.nn.relu(h)
        logits.append(TorchDense(2, name="last")(h))
        return jnp.stack(logits, axis=1)


def per_image_standardization(images: jax.Array) -> jax.Array:
    """``tf.image.per_image_standardization`` of ``[..., H, W, C]`` images:
    ``(x - mean) / max(std, 1 / sqrt(H * W * C))`` per image (population std)."""
    axes = (-3, -2, -1)
    count = math.prod(images.shape[-3:])
    mean = jnp.mean(images, axis=axes, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(images - mean), axis=axes, keepdims=True))
    return (images - mean) / jnp.maximum(std, 1.0 / math.sqrt(count))


def their_pixels(x: jax.Array) -> jax.Array:
    """flowjax's per-channel standardized CIFAR images (``[B, 32, 32, 3]`` or ``[B, 3072]``)
    as pixel values ``[B, 32, 32, 3]``, what their loader starts from."""
    return x.reshape(x.shape[:1] + IMAGE_SHAPE) * CHANNEL_STD + CHANNEL_MEAN


def their_input(x: jax.Array) -> jax.Array:
    """flowjax's CIFAR images as their loader gives them to their network: pixel values
    standardized per image (a flip before it changes nothing but the flip: the
    standardization is flip-invariant)."""
    return per_image_standardization(their_pixels(x))


def max_pool(x: jax.Array) -> jax.Array:
    """``nn.MaxPool2d(3, stride=2, padding=1)`` (the padding never wins: -inf)."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                             ((0, 0), (1, 1), (1, 1), (0, 0)))


def branch_modules(num_classes: int) -> dict[str, nn.Module]:
    """One branch's routed layers, in order (their ``conv1``, ``layer1..4``, ``fc``)."""
    modules = {"conv1": conv(STAGE_WIDTHS[0], 7, 2, 3)}
    for j, (width, stride) in enumerate(zip(STAGE_WIDTHS, STAGE_STRIDES)):
        modules[f"layer{j + 1}"] = Stage(width, stride)
    modules["fc"] = TorchDense(num_classes)
    return modules


# ----------------------------------------------------------------------------- checks


def check_unused(config: Any, model_name: str) -> None:
    """Refuses a field ``config`` sets that their network would silently ignore."""
    refuse_set_fields(config, UNUSED, model_name, "CIFAR")


def check_config(config: Any, model: RoutableModel) -> None:
    """Refuses a resolved ``FlowConfig`` asking this procedure for what it does not run."""
    if model.name not in MODELS:
        raise FieldError("semantics", "reference", f"expected one of {list(MODELS)}, got "
                         f"{model.name}")
    refuse_other_values(config, FIXED, model.name, "CIFAR")


# ----------------------------------------------------------------------------- batches


def plan_passes(key: jax.Array, valid: jax.Array, batch_size: int, passes: int
                ) -> tuple[jax.Array, jax.Array]:
    """``passes`` passes of their loader: ``(indices [P, S, B], mask [P, S, B])``.

    Every pass is the valid examples in order; an index ``i + N`` (``N`` examples) is
    example ``i`` flipped left-right (``with_flips``), with probability 1/2 drawn from
    ``fold_in(fold_in(key, pass), i)``.
    """
    n = valid.shape[0]
    indices, mask = packed_batches(jnp.arange(n, dtype=jnp.float32), valid, batch_size, n)

    def one(p):
        pass_key = jax.random.fold_in(key, p)
        # One draw per example index, so padding the client changes no example's flip.
        flip = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(pass_key, i)))(
            jnp.arange(n))
        return indices + n * flip[indices].astype(indices.dtype), mask

    return jax.vmap(one)(jnp.arange(passes))


def with_flips(x: jax.Array) -> jax.Array:
    """``[2N, ...]``: the examples, then each flipped left-right (``plan_passes``)."""
    images = x.reshape(x.shape[:1] + IMAGE_SHAPE)
    return jnp.concatenate([images, images[:, :, ::-1, :]])


def train_plan(key: jax.Array, valid: jax.Array, batch_size: int, local_epochs: int,
               routing_epochs: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The batches of their client update (and of their evaluation's training) for
    ``key``: the local epochs', then the routing epochs' (``launch/parity.py`` feeds
    their loop the same)."""
    return {"local": plan_passes(jax.random.fold_in(key, 0), valid, batch_size, local_epochs),
            "routing": plan_passes(jax.random.fold_in(key, 1), valid, batch_size,
                                   routing_epochs)}


# ----------------------------------------------------------------------------- Flow


def build(model: RoutableModel, config: Any) -> FederatedAlgorithm:
    """The authors' Flow for CIFAR with ``config``'s SGD, gamma, epochs, policy widths and
    ``frozen_momentum`` (module docstring)."""
    check_config(config, model)
    modules = branch_modules(model.num_classes)
    layers = tuple(modules)
    shared_norm = GroupNorm()
    # semantics="reference" sets their widths, (1000, 750, 350, 150, 50, 2): five base
    # layers, then their 50 -> 2 (``Policy``'s "last").
    policy = Policy(hidden=tuple(config.policy_hidden)[:-1])
    batch_size = config.sgd.batch_size
    optimizer = config.sgd.optimizer()

    def apply(params, layer, h):
        return modules[layer].apply({"params": params[layer]}, h)

    def stem_out(groups, h):
        """The shared norm, relu and max pool after the (mixed) stems."""
        return max_pool(jax.nn.relu(shared_norm.apply({"params": groups["shared"]}, h)))

    def branch_logits(groups, branch, images):
        """Their ``mode='global'`` / ``'local'`` on standardized images."""
        params = groups[branch]
        h = stem_out(groups, apply(params, "conv1", images))
        for layer in layers[1:-1]:
            h = apply(params, layer, h)
        return apply(params, "fc", h.reshape(h.shape[0], -1))

    def routed(groups, images, *, hard: bool):
        """Their ``mode='personalized'``: ``(logits, p [B, 6, 2])``, ``p[..., 0]`` the
        global branch's weight."""
        flat = jnp.transpose(images, (0, 3, 1, 2)).reshape(images.shape[0], -1)  # C, H, W
        p = jax.nn.softmax(policy.apply({"params": groups["policy"]}, flat), axis=-1)
        if hard:
            p = jnp.round(p)  # torch.round on both entries

        def mix(j, out_g, out_l):
            shape = (-1,) + (1,) * (out_g.ndim - 1)
            return out_g * p[:, j, 0].reshape(shape) + out_l * p[:, j, 1].reshape(shape)

        g, l = groups["global"], groups["local"]
        h = stem_out(groups, mix(0, apply(g, "conv1", images), apply(l, "conv1", images)))
        for j, layer in enumerate(layers[1:-1], start=1):
            h = mix(j, apply(g, layer, h), apply(l, layer, h))
        h = h.reshape(h.shape[0], -1)
        return mix(NUM_ROUTES - 1, apply(g, "fc", h), apply(l, "fc", h)), p

    def branch_sums(branch):
        def sums(groups, batch, key):
            del key
            x, y, w = batch
            logits = branch_logits(groups, branch, per_image_standardization(x))
            return jnp.stack(weighted_cross_entropy(logits, y, instance_weights(model, y, w)))
        return sums

    def routed_sums(groups, batch, key):
        """Routed CE plus their regularizer (the local entry of all six routes)."""
        del key
        x, y, w = batch
        logits, p = routed(groups, per_image_standardization(x), hard=False)
        ce_sum, count = weighted_cross_entropy(logits, y, instance_weights(model, y, w))
        if config.gamma > 0:
            per_example = jnp.mean(reference_terms(p[..., 1]), axis=-1)
            ce_sum = ce_sum + config.gamma * count * instance_mean(per_example, w)
        return jnp.stack([ce_sum, count])

    def step_for(loss_sums, active):
        return group_sgd_step(loss_sums, active, optimizer, config.frozen_momentum)

    local_step = step_for(branch_sums("local"), ("shared", "local"))
    global_step = step_for(branch_sums("global"), ("shared", "global"))
    policy_step = step_for(routed_sums, ("shared", "policy"))

    def alternating(state, batch, key):
        state, _ = policy_step(state, batch, jax.random.fold_in(key, 0))
        return global_step(state, batch, jax.random.fold_in(key, 1))

    def init_branch(key):
        params, h = {}, jnp.zeros((1,) + IMAGE_SHAPE, jnp.float32)
        for j, (layer, module) in enumerate(modules.items()):
            if layer == "fc":
                h = h.reshape(1, -1)
            params[layer] = module.init(jax.random.fold_in(key, j), h)["params"]
            h = module.apply({"params": params[layer]}, h)
            if layer == "conv1":
                h = max_pool(h)
        return params

    def init(key):
        global_key, local_key, policy_key, norm_key = jax.random.split(key, 4)
        x = jnp.zeros((1, 32, 32, STAGE_WIDTHS[0]))
        return {"shared": shared_norm.init(norm_key, x)["params"],
                "global": init_branch(global_key), "local": init_branch(local_key),
                "policy": policy.init(policy_key, jnp.zeros((1, math.prod(IMAGE_SHAPE))))[
                    "params"]}

    def start_state(params):
        return params, {name: optimizer.init(params[name]) for name in GROUPS}

    def run(step, state, images, y, batches, epoch_key):
        """Epochs of ``step`` over planned ``batches`` of ``with_flips`` images."""
        return run_planned(step, state, images, jnp.concatenate([y, y]), batches, batch_size,
                           epoch_key, **config.sgd.loop)

    def local_phase(params, examples: ClientExamples, key):
        """A fresh SGD and their local epochs, the start of both their client functions:
        ``(state, local stats, images, y, plan, valid)``."""
        x, y, valid = examples.flat()
        images = with_flips(their_pixels(x))
        plan = train_plan(key, valid, batch_size, config.local_epochs, config.routing_epochs)
        state, stats = run(local_step, start_state(params), images, y, plan["local"],
                           jax.random.fold_in(key, 2))
        return state, stats, images, y, plan, valid

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        """Their ``cifar*_train``."""
        del client_state  # stateless
        state, local_stats, images, y, plan, valid = local_phase(params, examples, key)
        state, stats = run(alternating, state, images, y, plan["routing"],
                           jax.random.fold_in(key, 3))
        metrics = {"loss_sum": stats[0], "loss_count": stats[1],
                   "local_loss_sum": local_stats[0], "local_loss_count": local_stats[1]}
        weight = jnp.sum(valid).astype(jnp.float32)  # their last epoch's sample count
        return ClientResult(params=state[0], weight=weight, metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        """Their ``cifar*_generalized_test``'s training: the personal net and the snapshot."""
        del client_state  # stateless
        state, _, images, y, plan, _ = local_phase(params, examples, key)
        state, snapshot = epochs_with_snapshot(run, policy_step, state, images, y,
                                               plan["routing"], jax.random.fold_in(key, 3),
                                               jax.random.fold_in(key, 4))
        return {"params": state[0], "snapshot": snapshot}

    def predict(params, personal, x) -> Predictions:
        images = their_input(x)
        hard, _ = routed(personal["params"], images, hard=True)
        soft, p = routed(personal["params"], images, hard=False)
        return Predictions(global_logits=branch_logits(params, "global", images),
                           personal_hard=hard, personal_soft=soft, q0=p[..., 0],
                           global_snapshot=branch_logits(personal["snapshot"], "global",
                                                         images))

    return FederatedAlgorithm(name="flow", model=model, init=init, client_update=client_update,
                              personalize=personalize, predict=predict)

