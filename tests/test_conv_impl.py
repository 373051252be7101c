"""The accelerator formulations (im2col convolution, bf16 compute) against the CPU ones.

im2col must compute the same function as ``lax.conv_general_dilated`` (forward and
gradients, vmapped over clients with per-client kernels) to 1e-5; the float32 default must
be the model it was, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flowjax.models import get_model, layers
from flowjax.models.base import forward
from tests.helpers import loops

RTOL = 1e-5


def assert_close(actual, expected, rtol: float = RTOL) -> None:
    """Elementwise, with an absolute floor relative to each array's scale."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.abs(e).max())


def normal(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape)


def lax_conv(x, w, padding, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), padding,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss_of(conv, padding, stride=1):
    # Non-linear, so every output element gets its own cotangent.
    return lambda x, w: jnp.sum(jnp.sin(conv(x, w, padding, stride)))


IM2COLS = {"im2col": layers.conv2d_im2col, "im2col_slices": layers.conv2d_im2col_slices}


@pytest.mark.parametrize("impl", sorted(IM2COLS))
@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("kernel,stride", [((3, 3), 1), ((2, 3), 1), ((3, 3), 2)])
def test_im2col_matches_lax_conv_vmapped_over_clients(padding, kernel, stride, impl):
    clients = 3
    x = normal(0, (clients, 4, 9, 8, 5))  # per-client batches
    w = normal(1, (clients, *kernel, 5, 6))  # per-client kernels
    im2col = lambda a, b, p, s: IM2COLS[impl](a, b, p, s)  # noqa: E731
    assert_close(jax.jit(jax.vmap(lambda a, b: im2col(a, b, padding, stride)))(x, w),
                 jax.vmap(lambda a, b: lax_conv(a, b, padding, stride))(x, w))
    grads = lambda conv: jax.vmap(jax.grad(loss_of(conv, padding, stride), argnums=(0, 1)))
    assert_close(jax.jit(grads(im2col))(x, w), grads(lax_conv)(x, w))


@pytest.mark.parametrize("impl", sorted(IM2COLS))
def test_im2col_shared_kernel_and_shared_data(impl):
    x, w = normal(0, (3, 2, 7, 7, 2)), normal(1, (3, 3, 3, 2, 4))
    for in_axes, xs, ws in (((None, 0), x[0], w), ((0, None), x, w[0])):
        grads = lambda conv: jax.vmap(jax.grad(loss_of(conv, "SAME"), argnums=(0, 1)), in_axes)
        assert_close(jax.jit(grads(lambda a, b, p, s: IM2COLS[impl](a, b, p, s)))(xs, ws),
                     grads(lax_conv)(xs, ws))


def test_conv_impl_resolution():
    assert layers.resolve_conv_impl("auto", "cpu") == "xla"
    assert layers.resolve_conv_impl("auto", "gpu") == "im2col_slices"  # measured on an H100
    assert layers.resolve_conv_impl("auto", "tpu") == "xla"  # not measured: the default
    assert layers.resolve_conv_impl("auto") == "xla"  # this CPU
    assert layers.resolve_conv_impl("im2col", "cpu") == "im2col"
    with pytest.raises(ValueError, match="conv_impl 'fft'"):
        layers.resolve_conv_impl("fft")
    with pytest.raises(ValueError, match="compute_dtype 'float16'"):
        layers.compute_dtype_of("float16")


def emnist_sgd_round(model, params, x, y, lr=0.05):
    """Three SGD steps per client under vmap over clients; returns per-client params."""

    def loss(p, xb, yb):
        logits = forward(model, p, xb, train=False, key=jax.random.key(0))
        return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(yb.shape[0]), yb])

    def client(xs, ys):
        def step(p, batch):
            grads = jax.grad(loss)(p, *batch)
            return jax.tree.map(lambda a, g: a - lr * g, p, grads), None
        return lax.scan(step, params, (xs, ys))[0]

    return jax.jit(jax.vmap(client))(x, y)


def emnist_batches(clients=2, steps=3, batch=4):
    x = normal(2, (clients, steps, batch, 28, 28))
    y = jax.random.randint(jax.random.key(3), (clients, steps, batch), 0, 62)
    return x, y


@pytest.mark.parametrize("impl", sorted(IM2COLS))
def test_emnist_cnn_im2col_trains_like_xla(impl):
    """The whole model's client updates, vmapped over clients, agree to 1e-5."""
    xla, im2col = (get_model("emnist_cnn", conv_impl=i) for i in ("xla", impl))
    params = xla.init(jax.random.key(0))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, im2col.init(
        jax.random.key(0)))
    x, y = emnist_batches()
    assert_close(emnist_sgd_round(im2col, params, x, y), emnist_sgd_round(xla, params, x, y))


def test_emnist_cnn_default_is_the_float32_xla_model_bit_for_bit():
    default = get_model("emnist_cnn")
    explicit = get_model("emnist_cnn", conv_impl="xla", compute_dtype="float32",
                         custom_grad=True)
    params = default.init(jax.random.key(0))
    np.testing.assert_array_equal(  # same init, same params
        np.concatenate([np.ravel(a) for a in jax.tree.leaves(params)]),
        np.concatenate([np.ravel(a) for a in jax.tree.leaves(explicit.init(jax.random.key(0)))]))
    x, y = emnist_batches()
    for a, b in zip(jax.tree.leaves(emnist_sgd_round(default, params, x, y)),
                    jax.tree.leaves(emnist_sgd_round(explicit, params, x, y)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # float32 compute adds no op: the dense layers are flax's own.
    assert type(layers.dense(8)) is layers.Dense
    assert type(layers.dense(8, jnp.bfloat16)) is layers.MixedDense


@pytest.mark.parametrize("impl", ["xla", "im2col", "im2col_slices"])
def test_bf16_compute_keeps_float32_params_and_stays_close(impl):
    f32 = get_model("emnist_cnn", conv_impl=impl)
    bf16 = get_model("emnist_cnn", conv_impl=impl, compute_dtype="bfloat16")
    params = f32.init(jax.random.key(0))
    x, y = emnist_batches()
    trained = emnist_sgd_round(bf16, params, x, y)
    assert {a.dtype for a in jax.tree.leaves(trained)} == {jnp.dtype(jnp.float32)}
    logits = forward(bf16, params, x[0, 0], train=False, key=jax.random.key(0))
    reference = forward(f32, params, x[0, 0], train=False, key=jax.random.key(0))
    assert logits.dtype == jnp.float32
    # bf16 operands (8-bit mantissa), float32 accumulation: about 1e-2 relative.
    error = float(jnp.linalg.norm(logits - reference) / jnp.linalg.norm(reference))
    assert 0 < error < 3e-2
    update_error = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b - p)) for a, b, p in zip(
        jax.tree.leaves(trained), jax.tree.leaves(emnist_sgd_round(f32, params, x, y)),
        jax.tree.leaves(jax.tree.map(lambda a: a[None], params))))
    # The updates (3 SGD steps) differ by about 5% of their size (measured 0.046-0.051
    # across processes: XLA CPU's threaded bf16 reductions); 0.1 leaves room for that.
    assert 0 < update_error < 0.1


def test_mixed_dense_matches_flax_dense_in_float32_compute():
    x = normal(0, (3, 5, 7))
    plain = layers.Dense(4)
    params = plain.init(jax.random.key(0), x)
    mixed = layers.MixedDense(4, compute_dtype=jnp.float32)
    assert jax.tree.map(jnp.shape, mixed.init(jax.random.key(0), x)) == jax.tree.map(
        jnp.shape, params)
    assert_close(mixed.apply(params, x), plain.apply(params, x))
    loss = lambda module: lambda p: jnp.sum(jnp.sin(module.apply(p, x)))  # noqa: E731
    assert_close(jax.grad(loss(mixed))(params), jax.grad(loss(plain))(params))


def test_config_fields_reach_the_model_and_bad_values_fail_in_one_line():
    from configs import emnist, stackoverflow
    from flowjax.validation import model_options, validate_config

    config = emnist.get_config("paper")
    assert (config.conv_impl, config.compute_dtype) == ("auto", "float32")
    assert "conv_impl" not in model_options(config)  # defaults: the factory's own
    config.conv_impl, config.compute_dtype = "im2col", "bfloat16"
    assert model_options(config) == {"conv_impl": "im2col", "compute_dtype": "bfloat16"}
    validate_config(config)
    config.conv_impl = "fft"
    with pytest.raises(ValueError, match=r"^config.conv_impl='fft': expected one of \["):
        validate_config(config)
    config = stackoverflow.get_config("paper")
    config.compute_dtype = "bfloat16"
    assert validate_config(config)[1].name == "stackoverflow_lstm"
    config = emnist.get_config("paper")
    config.model, config.compute_dtype = "resnet18_gn", "bfloat16"
    with pytest.raises(ValueError, match="config.compute_dtype='bfloat16': expected 'float32': "
                                         "resnet18_gn does not implement compute_dtype"):
        validate_config(config)


@pytest.mark.parametrize("name, lstms, length", [("stackoverflow", 1, 20),
                                                  ("shakespeare", 2, 80)])
def test_config_lstm_unroll_reaches_every_lstm_of_the_model(name, lstms, length):
    """``config.lstm_unroll`` at the sequence length leaves the model's training step no
    time loop; unset, each LSTM keeps its forward and backward loops."""
    import importlib
    from flowjax.models.base import forward
    from flowjax.validation import validate_config

    def time_loops(unroll):
        config = importlib.import_module(f"configs.{name}").get_config("paper")
        config.model_options = {"vocab_size": 60, "embed_dim": 8, "hidden": 16}
        config.lstm_unroll = unroll
        model = validate_config(config)[1]
        x = jax.random.randint(jax.random.key(1), (2, length), 1, model.num_classes)
        return loops(jax.grad(lambda p: jnp.sum(forward(model, p, x))),
                     model.init(jax.random.key(0)))

    assert (time_loops(None), time_loops(length)) == (2 * lstms, 0)


@pytest.mark.parametrize("unroll, compute_dtype, time_loops", [
    (None, "float32", 1), (20, "float32", 0), (20, "bfloat16", 0)])
def test_config_lstm_options_reach_flows_mixed_state_recurrence(unroll, compute_dtype,
                                                                  time_loops):
    """With ``methods.flow.recurrence='mixed_state'`` the config's ``lstm_unroll`` and
    ``compute_dtype`` validate and reach the routed recurrence: the Flow built from the
    config predicts with the time loop unrolled, and in bf16 unlike in float32."""
    from configs import stackoverflow
    from flowjax.algorithms import build_algorithm
    from flowjax.validation import validate_config

    def personal_predictions(compute_dtype, unroll):
        config = stackoverflow.get_config("paper")
        config.model_options = {"vocab_size": 60, "embed_dim": 8, "hidden": 16, "dense": 8}
        config.methods.flow.recurrence = "mixed_state"
        config.methods.flow.policy_hidden = (8, 8, 8, 8)
        config.lstm_unroll, config.compute_dtype = unroll, compute_dtype
        model = validate_config(config)[1]
        x = jax.random.randint(jax.random.key(1), (2, 20), 1, model.num_classes)
        flow = build_algorithm("flow", model, config, x)
        params = flow.init(jax.random.key(0))
        personal = {**params, "local": model.init(jax.random.key(2))}
        predict = lambda p: flow.predict(params, p, x).personal_soft  # noqa: E731
        return predict(personal), loops(predict, personal)

    predictions, loop_count = personal_predictions(compute_dtype, unroll)
    assert loop_count == time_loops
    float32 = personal_predictions("float32", None)[0]
    if compute_dtype == "float32":
        np.testing.assert_allclose(predictions, float32, rtol=1e-5, atol=1e-6)
    else:
        assert not np.allclose(predictions, float32, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, options, length", [
    ("stackoverflow_lstm", dict(vocab_size=60, embed_dim=8, hidden=16, dense=8), 20),
    ("shakespeare_lstm", dict(hidden=16), 80)])
def test_lstm_models_in_bf16_keep_float32_params_and_stay_close(name, options, length):
    f32 = get_model(name, **options)
    bf16 = get_model(name, compute_dtype="bfloat16", **options)
    params = f32.init(jax.random.key(0))
    assert jax.tree.map(jnp.shape, bf16.init(jax.random.key(0))) == jax.tree.map(
        jnp.shape, params)
    x = jax.random.randint(jax.random.key(1), (3, length), 1, f32.num_classes)

    def loss(model):
        return lambda p: jnp.mean(jax.nn.log_softmax(forward(model, p, x))[..., 1])

    def relative(a, b):
        return max(float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    logits = jax.jit(lambda p: forward(bf16, p, x))(params)
    assert logits.dtype == jnp.float32
    assert 0 < relative(logits, jax.jit(lambda p: forward(f32, p, x))(params)) < 2e-2
    grads = jax.jit(jax.grad(loss(bf16)))(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert 0 < relative(grads, jax.jit(jax.grad(loss(f32)))(params)) < 5e-2


@pytest.mark.parametrize("impl", ["xla", "im2col_slices"])
def test_cpus_bf16_rounded_float32_products_equal_bf16_products(impl, monkeypatch):
    """On CPU a bf16 product runs as a float32 product of bf16-rounded operands
    (``layers._rounds_in_float32``); forcing the native bf16 products on this CPU gives
    the same numbers up to the order of float32 sums (forward), and gradients rounded to
    bf16 alike: a few bf16 units (2**-8 relative) apart after one rounding per layer they
    pass back through (measured 0.5%; bf16 and float32 updates differ by about 5%)."""
    model = get_model("emnist_cnn", conv_impl=impl, compute_dtype="bfloat16")
    params = model.init(jax.random.key(0))
    x = normal(4, (4, 28, 28))
    y = jnp.arange(4)

    def outputs():
        def loss(p):
            logits = forward(model, p, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
        return forward(model, params, x), jax.grad(loss)(params)

    assert layers._rounds_in_float32()
    rounded = outputs()
    monkeypatch.setattr(layers, "_rounds_in_float32", lambda: False)
    native = outputs()
    np.testing.assert_allclose(rounded[0], native[0], rtol=1e-5, atol=1e-5 * float(
        jnp.abs(native[0]).max()))
    for a, b in zip(jax.tree.leaves(rounded[1]), jax.tree.leaves(native[1]), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 2 ** -6
