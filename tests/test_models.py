"""The registered models: shapes, parameter counts, train/eval behaviour, learnability."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from flowjax.models import get_model
from flowjax.models.base import RoutableModel, forward


def emnist_batch(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Random images with random labels (memorizable)."""
    return (jax.random.uniform(key, (n, 28, 28)),
            jax.random.randint(jax.random.fold_in(key, 1), (n,), 0, 62))


def shakespeare_batch(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Random non-pad tokens whose labels repeat them (a copy task, learnable)."""
    x = jax.random.randint(key, (n, 80), 1, 90)
    return x, x


BATCHES = {"emnist_cnn": emnist_batch, "shakespeare_lstm": shakespeare_batch}
# Plain SGD learning rates that make progress within 30 steps; the LSTM starts slowly.
LEARNING_RATES = {"emnist_cnn": 0.05, "shakespeare_lstm": 2.0}


@pytest.fixture(scope="module", params=sorted(BATCHES))
def model_and_params(request) -> tuple[RoutableModel, dict]:
    model = get_model(request.param)
    return model, model.init(jax.random.key(0))


def num_params(params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


def test_emnist_cnn_spec():
    model = get_model("emnist_cnn")
    assert model.layer_names == ("conv1", "conv2", "fc1", "fc2")
    assert (model.instance_ndim, model.num_classes, model.policy_input, model.head_layers) == (
        1, 62, "flat", ("fc2",))
    assert num_params(model.init(jax.random.key(0))) == 1_206_590
    assert num_params(get_model("emnist_cnn", num_classes=10).init(jax.random.key(0))) == (
        1_206_590 - 52 * 129)
    y = jnp.array([3, 0, 61])
    np.testing.assert_array_equal(model.label_weights(y), [1.0, 1.0, 1.0])


def test_shakespeare_lstm_spec():
    model = get_model("shakespeare_lstm")
    assert model.layer_names == ("embedding", "lstm1", "lstm2", "dense")
    assert (model.instance_ndim, model.num_classes, model.policy_input, model.vocab_size,
            model.head_layers) == (2, 90, "tokens", 90, ("dense",))
    # 90*8 + (8+256+1)*1024 + (256+256+1)*1024 + 257*90
    assert num_params(model.init(jax.random.key(0))) == 820_522
    y = jnp.array([[5, 0], [0, 89]])
    weights = model.label_weights(y)
    assert weights.dtype == jnp.float32
    np.testing.assert_array_equal(weights, [[1.0, 0.0], [0.0, 1.0]])


def test_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"unknown model 'transformer'; expected one of \["):
        get_model("transformer")


def test_emnist_accepts_images_with_or_without_channel():
    model = get_model("emnist_cnn")
    params = model.init(jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (3, 28, 28))
    np.testing.assert_array_equal(forward(model, params, x), forward(model, params, x[..., None]))


def test_init_is_jittable(model_and_params):
    model, params = model_and_params
    jitted = jax.jit(model.init)(jax.random.key(0))
    assert set(params) == set(model.layer_names)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                 params, jitted)


def test_forward_jits_with_expected_shape(model_and_params):
    model, params = model_and_params
    x, y = BATCHES[model.name](jax.random.key(1), 3)
    logits = jax.jit(lambda p, x: forward(model, p, x))(params, x)
    assert logits.shape == y.shape + (model.num_classes,)
    assert model.label_weights(y).shape == y.shape
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_dropout_only_in_train_mode(model_and_params):
    model, params = model_and_params
    x, _ = BATCHES[model.name](jax.random.key(1), 3)
    run = jax.jit(lambda key, train: forward(model, params, x, train=train, key=key),
                  static_argnums=1)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(run(k1, False), run(k2, False))
    np.testing.assert_array_equal(run(k1, True), run(k1, True))
    has_dropout = model.name == "emnist_cnn"
    assert bool(jnp.any(run(k1, True) != run(k2, True))) == has_dropout


def test_loss_decreases_under_sgd(model_and_params):
    model, params = model_and_params
    x, y = BATCHES[model.name](jax.random.key(1), 8)
    weights = model.label_weights(y)
    lr = LEARNING_RATES[model.name]

    def loss(p, key):
        logits = forward(model, p, x, train=True, key=key)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * weights) / jnp.sum(weights)

    def step(p, key):
        value, grads = jax.value_and_grad(loss)(p, key)
        return jax.tree.map(lambda a, g: a - lr * g, p, grads), value

    step_keys = jax.random.split(jax.random.key(2), 30)
    _, losses = jax.jit(lambda p: lax.scan(step, p, step_keys))(params)
    assert bool(jnp.all(jnp.isfinite(losses)))
    assert float(losses[-5:].mean()) < float(losses[:5].mean()) - 0.05


def _group_norm(v: np.ndarray) -> np.ndarray:
    """GroupNorm with one channel per group, unit scale and zero bias (NHWC)."""
    mean = v.mean(axis=(1, 2), keepdims=True)
    return (v - mean) / np.sqrt(v.var(axis=(1, 2), keepdims=True) + 1e-5)


@pytest.mark.parametrize("size", [8, 7])
def test_resnet_downsampling_adds_paths_of_the_same_pixels(size):
    """A stride-2 block's 3x3 main path and 1x1 shortcut must read the same input pixels,
    as PyTorch's padding=1 (He et al., torchvision, the authors) has them: with centre-tap
    identity kernels both carry pixel (2i, 2j) to (i, j). "SAME" padded an even input (0, 1)
    and put the main path on (2i + 1, 2j + 1)."""
    from flowjax.models.resnet_gn import BasicBlock
    block = BasicBlock(features=2, stride=2, groups=2, custom_grad=False)
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, size, size, 2)), np.float32)
    params = block.init(jax.random.key(1), x)

    def centre_tap(kernel):
        kh, kw, cin, cout = kernel.shape
        return jnp.zeros(kernel.shape).at[kh // 2, kw // 2].set(jnp.eye(cin, cout))

    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: centre_tap(leaf) if path[-1].key == "kernel" else leaf, params)
    sub = x[:, ::2, ::2, :]
    expected = np.maximum(_group_norm(np.maximum(_group_norm(sub), 0)) + _group_norm(sub), 0)
    np.testing.assert_allclose(block.apply(params, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,kwargs,x", [
    ("emnist_cnn", {}, jnp.zeros((2, 28, 28))),
    ("shakespeare_lstm", {"vocab_size": 20, "embed_dim": 4, "hidden": 8},
     jnp.zeros((2, 5), jnp.int32)),
    # The ResNet's convolutions are the CNN's Conv2D: 8 s of CI for no other layer.
    pytest.param("resnet18_gn", {"num_classes": 10}, jnp.zeros((1, 32, 32, 3)),
                 marks=pytest.mark.slow)])
def test_params_are_float32_whatever_jax_enable_x64_says(name, kwargs, x):
    """Flax's Dense and Embed fix float32 params; the convolutions and LSTMs drew float64
    under jax_enable_x64, and a convolution refused to mix them."""
    model = get_model(name, **kwargs)
    with jax.enable_x64(True):
        params = model.init(jax.random.key(0))
        assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
        assert forward(model, params, x).dtype == jnp.float32
    # The same draw as without x64, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, params, model.init(jax.random.key(0)))
