"""The custom-VJP layers match plain autodiff references in values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flowjax.models import layers
from tests.helpers import loops

RTOL = 1e-5


def assert_close(actual, expected, rtol: float = RTOL) -> None:
    """Elementwise, with an absolute floor relative to each array's scale."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.abs(e).max())


def normal(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape)


# ----------------------------------------------------------------------------- conv


def reference_conv(x, w, padding):
    return lax.conv_general_dilated(x, w, (1, 1), padding,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_loss(conv, padding):
    # A non-linear loss so that the cotangent differs per output element.
    return lambda x, w: jnp.sum(jnp.sin(conv(x, w, padding)))


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("kernel", [(3, 3), (2, 3)])
def test_conv2d_matches_lax_conv(padding, kernel):
    x, w = normal(0, (3, 9, 8, 2)), normal(1, (*kernel, 2, 4))
    assert_close(layers.conv2d(x, w, padding), reference_conv(x, w, padding))
    grads = jax.jit(jax.grad(conv_loss(layers.conv2d, padding), argnums=(0, 1)))(x, w)
    assert_close(grads, jax.grad(conv_loss(reference_conv, padding), argnums=(0, 1))(x, w))


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None)])
def test_conv2d_under_vmap(in_axes):
    x, w = normal(0, (3, 2, 7, 7, 2)), normal(1, (3, 3, 3, 2, 4))
    x = x if in_axes[0] == 0 else x[0]
    w = w if in_axes[1] == 0 else w[0]
    for padding in ("VALID", "SAME"):
        grad = lambda conv: jax.vmap(jax.grad(conv_loss(conv, padding), argnums=(0, 1)),
                                     in_axes)
        assert_close(jax.vmap(lambda a, b: layers.conv2d(a, b, padding), in_axes)(x, w),
                     jax.vmap(lambda a, b: reference_conv(a, b, padding), in_axes)(x, w))
        assert_close(jax.jit(grad(layers.conv2d))(x, w), grad(reference_conv)(x, w))


def test_conv2d_nested_vmap():
    x, w = normal(0, (2, 3, 2, 6, 6, 2)), normal(1, (2, 3, 3, 3, 2, 4))
    grad = lambda conv: jax.vmap(jax.vmap(jax.grad(conv_loss(conv, "VALID"), argnums=(0, 1))))
    assert_close(jax.jit(grad(layers.conv2d))(x, w), grad(reference_conv)(x, w))


def sgd_scan(loss, params, batches, lr=0.1):
    """Plain SGD over ``batches`` in a ``lax.scan(unroll=1)``; returns the final params."""

    def step(p, batch):
        return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p, batch)), None

    return lax.scan(step, params, batches)[0]


def test_conv2d_in_scan_and_vmap_over_clients():
    xs, w = normal(0, (3, 4, 2, 7, 7, 2)), normal(1, (3, 3, 3, 2, 4))  # clients, steps, ...
    run = lambda conv: jax.vmap(
        lambda w, x: sgd_scan(lambda w, x: conv_loss(conv, "SAME")(x, w), w, x))
    assert_close(jax.jit(run(layers.conv2d))(w, xs), run(reference_conv)(w, xs))


def test_conv2d_module_custom_grad_switch():
    x = normal(0, (2, 8, 8, 3))
    fast, plain = layers.Conv2D(5, padding="SAME"), layers.Conv2D(5, padding="SAME",
                                                                   custom_grad=False)
    params = fast.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == {"params": {"kernel": (3, 3, 3, 5),
                                                          "bias": (5,)}}
    loss = lambda module: lambda p: jnp.sum(jnp.sin(module.apply(p, x)))
    assert_close(fast.apply(params, x), plain.apply(params, x))
    assert_close(jax.grad(loss(fast))(params), jax.grad(loss(plain))(params))


# ----------------------------------------------------------------------------- pooling


def reference_max_pool(h):
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


@pytest.mark.parametrize("size", [(8, 6), (7, 9)])
def test_max_pool_matches_reduce_window(size):
    h = normal(0, (2, *size, 3))  # continuous values: no ties, so one subgradient
    assert_close(layers.max_pool_2x2(h), reference_max_pool(h))
    loss = lambda pool: lambda h: jnp.sum(jnp.sin(pool(h)))
    assert_close(jax.grad(loss(layers.max_pool_2x2))(h), jax.grad(loss(reference_max_pool))(h))


def test_max_pool_gradient_of_a_routed_input_is_exact_under_the_suites_flags():
    """The pooled input as the routed CNN computes it: a per-instance mix of two branches.
    With ``c = q a + (1 - q) b > 0`` the pool is ``c`` times the pool of ``x``, so the
    gradient has a closed form. ``max`` over the window axes had it infinite under the
    suite's XLA flags (``conftest.TEST_XLA_FLAGS``: its gradient needs XLA to recompute
    the input bit for bit alike, ``layers.max_pool_2x2``); comparisons within each window
    need no such match."""
    x = normal(0, (8, 26, 26, 4))
    q = jax.random.uniform(jax.random.key(1), (8, 1, 1, 1))
    a, b = jnp.float32(1.1), jnp.float32(0.7)
    f = lambda a, b: jnp.sum(layers.max_pool_2x2(q * (x * a) + (1 - q) * (x * b)) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    c, q = q[:, 0, 0, 0] * a + (1 - q[:, 0, 0, 0]) * b, q[:, 0, 0, 0]
    pooled = jnp.sum(reference_max_pool(x) ** 2, axis=(1, 2, 3))
    assert_close(grads, (jnp.sum(2 * c * q * pooled), jnp.sum(2 * c * (1 - q) * pooled)))


def test_routed_cnn_gradient_under_the_launchers_flags_matches_float64():
    """The launchers compile with their own CPU flag (``launch/xla_env.CPU_FLAGS``, matmuls
    through YNNPACK). Under it ``max`` over the window axes gave the routed CNN's gradient
    54% off (``tests/routed_pool_gradient.py`` at 2bdc9b6, the last commit with that pool;
    1e-6 under a default build): every CPU Flow run the launchers made on a CNN before the
    fix trained on it. Checked in a child compiled with exactly those flags, against the
    same gradient in float64."""
    import os
    import subprocess
    import sys

    from launch import xla_env
    from tests.helpers import default_xla_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = default_xla_env()
    env["XLA_FLAGS"] = " ".join([*env["XLA_FLAGS"].split(), *xla_env.CPU_FLAGS])
    env["PYTHONPATH"] = root
    done = subprocess.run([sys.executable, os.path.join(root, "tests", "routed_pool_gradient.py")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    deviation = float(done.stdout.strip().rsplit(" ", 1)[-1])
    assert deviation < 1e-4, done.stdout


def test_max_pool_splits_a_tie_evenly_as_jnp_max_does():
    """Tied maxima (a constant image region) share the gradient evenly, bit for bit as
    ``jnp.max``'s gradient gives it; the forward value is the maximum itself."""
    h = jnp.asarray([[1.0, 3.0, 0.5, 0.5], [3.0, 2.0, 0.5, 0.5], [3.0, 3.0, 0.0, 1.0],
                     [3.0, 3.0, 2.0, 0.0]]).reshape(1, 4, 4, 1)
    np.testing.assert_array_equal(layers.max_pool_2x2(h)[0, ..., 0], [[3.0, 0.5], [3.0, 2.0]])
    grad = jax.grad(lambda h: layers.max_pool_2x2(h).sum())(h)[0, ..., 0]
    np.testing.assert_array_equal(grad, [[0.0, 0.5, 0.25, 0.25], [0.5, 0.0, 0.25, 0.25],
                                         [0.25, 0.25, 0.0, 0.0], [0.25, 0.25, 1.0, 0.0]])
    n, height, width, c = h.shape
    by_max = jax.grad(lambda h: h.reshape(n, height // 2, 2, width // 2, 2, c)
                      .max(axis=(2, 4)).sum())(h)[0, ..., 0]
    np.testing.assert_array_equal(grad, by_max)


def test_dropout():
    h, key = jnp.ones((1000,)), jax.random.key(0)
    assert layers.dropout(h, 0.5, False, key) is h
    dropped = layers.dropout(h, 0.25, True, key)
    np.testing.assert_allclose(np.unique(np.asarray(dropped)), [0.0, 1.0 / 0.75], rtol=1e-6)
    assert 0.2 < float(jnp.mean(dropped == 0)) < 0.3


# ----------------------------------------------------------------------------- LSTM


def reference_lstm(x, w_x, w_h, b):
    """A naive per-step LSTM cell in a scan, differentiated by autodiff."""
    hidden = w_h.shape[0]

    def cell(carry, x_t):
        h, c = carry
        z = x_t @ w_x + h @ w_h + b
        i, f, g, o = (z[:, k * hidden:(k + 1) * hidden] for k in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((x.shape[0], hidden))
    return jnp.swapaxes(lax.scan(cell, (zeros, zeros), jnp.swapaxes(x, 0, 1))[1], 0, 1)


def lstm_args(batch=(3,), time=6, features=5, hidden=7):
    scale = 0.5  # keeps gates away from saturation so every gradient term matters
    return (normal(0, (*batch, time, features)), scale * normal(1, (features, 4 * hidden)),
            scale * normal(2, (hidden, 4 * hidden)), scale * normal(3, (4 * hidden,)))


def lstm_loss(fn):
    return lambda *args: jnp.sum(jnp.sin(fn(*args)))


# The references run jitted: one compilation each instead of one per eager op, for CI time.
def test_lstm_matches_naive_scan():
    args = lstm_args()
    assert_close(layers.lstm(*args), jax.jit(reference_lstm)(*args))
    grads = jax.jit(jax.grad(lstm_loss(layers.lstm), argnums=(0, 1, 2, 3)))(*args)
    assert_close(grads, jax.jit(jax.grad(lstm_loss(reference_lstm), argnums=(0, 1, 2, 3)))(
        *args))


def test_lstm_under_vmap_and_in_scan():
    x, w_x, w_h, b = lstm_args(batch=(2, 3, 2))  # clients, steps, batch
    params = jax.tree.map(lambda a: jnp.stack([a, 1.1 * a]), (w_x, w_h, b))  # per client
    run = lambda fn: jax.vmap(lambda p, x: sgd_scan(lambda p, x: lstm_loss(fn)(x, *p), p, x))
    assert_close(jax.jit(run(layers.lstm))(params, x), jax.jit(run(reference_lstm))(params, x))
    grad = lambda fn: jax.vmap(jax.grad(lstm_loss(fn), argnums=(0, 1, 2, 3)))
    stacked = (x[:, 0],) + params
    assert_close(jax.jit(grad(layers.lstm))(*stacked), jax.jit(grad(reference_lstm))(*stacked))


def test_lstm_module():
    x = normal(0, (2, 5, 3))
    fast, plain = layers.LSTM(4), layers.LSTM(4, custom_grad=False)
    params = fast.init(jax.random.key(0), x)
    shapes = jax.tree.map(jnp.shape, params["params"])
    assert shapes == {"kernel": (3, 16), "recurrent_kernel": (4, 16), "bias": (16,)}
    np.testing.assert_array_equal(params["params"]["bias"], [0] * 4 + [1] * 4 + [0] * 8)
    assert fast.apply(params, x).shape == (2, 5, 4)
    loss = lambda module: lambda p: jnp.sum(jnp.sin(module.apply(p, x)))
    assert_close(jax.grad(loss(fast))(params), jax.grad(loss(plain))(params))


@pytest.mark.parametrize("custom_grad", [True, False])
def test_lstm_unroll_keeps_the_values_and_takes_the_loops_away(custom_grad):
    """``unroll`` time steps per loop iteration: the same outputs bit for bit (the cell's
    arithmetic per step is unchanged), gradients equal to float32 rounding (an unrolled
    backward body fuses differently), and at the full length no loop is left at all."""
    x = normal(0, (3, 6, 5))
    module = lambda unroll: layers.LSTM(7, custom_grad=custom_grad, unroll=unroll)  # noqa: E731
    params = module(1).init(jax.random.key(0), x)
    loss = lambda unroll: lambda p: jnp.sum(jnp.sin(module(unroll).apply(p, x)))  # noqa: E731
    looped = jax.jit(module(1).apply)(params, x)
    looped_grad = jax.jit(jax.grad(loss(1)))(params)
    for unroll in (4, 6):  # 4 does not divide the 6 steps: a remainder outside the loop
        np.testing.assert_array_equal(jax.jit(module(unroll).apply)(params, x), looped)
        assert relative_error(jax.jit(jax.grad(loss(unroll)))(params), looped_grad) < 1e-6
    # forward and backward loops; none
    assert (loops(jax.grad(loss(1)), params), loops(jax.grad(loss(6)), params)) == (2, 0)


def relative_error(actual, expected) -> float:
    """The largest ``|a - e| / |e|`` (Frobenius norms) over the leaves."""
    return max(float(jnp.linalg.norm(a - e) / jnp.linalg.norm(e))
               for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True))


def test_lstm_bf16_compute_stays_close_to_float32_and_keeps_float32_gradients():
    args = lstm_args(batch=(4,), time=8, features=6, hidden=16)
    bf16 = lambda *a: layers.lstm(*a, jnp.bfloat16)  # noqa: E731
    autodiff = lambda *a: layers._lstm_forward(*a, jnp.bfloat16, cast_once=False)[0]  # noqa: E731
    out = jax.jit(bf16)(*args)
    reference = jax.jit(reference_lstm)(*args)
    assert out.dtype == jnp.float32
    # bf16 operands (8-bit mantissa), float32 accumulation and cell: about 1e-2 relative.
    assert 0 < relative_error(out, reference) < 2e-2
    grad = lambda fn: jax.jit(jax.grad(lstm_loss(fn), argnums=(0, 1, 2, 3)))  # noqa: E731
    expected = grad(reference_lstm)(*args)
    for fn in (bf16, autodiff):  # the hand-written VJP and autodiff of the same forward
        grads = grad(fn)(*args)
        assert {g.dtype for g in grads} == {jnp.dtype(jnp.float32)}
        assert 0 < relative_error(grads, expected) < 3e-2
    assert relative_error(grad(bf16)(*args), grad(autodiff)(*args)) < 3e-2


def equations(jaxpr, in_loop: bool = False):
    """``(equation, inside a scan/while body)`` for every equation, nested ones included."""
    for eqn in jaxpr.eqns:
        yield eqn, in_loop
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, loop)


ROUTED = lambda x, w_x, w_h, b, dtype: layers.routed_lstm(  # noqa: E731
    x, (w_x, w_h, b), (0.5 * w_x, -w_h, b), jnp.full(x.shape[:2], 0.3), compute_dtype=dtype)


@pytest.mark.parametrize("float32_products", [True, False])
@pytest.mark.parametrize("layer, products", [(layers.lstm, 2), (ROUTED, 4)])
def test_lstm_bf16_casts_the_recurrent_weight_once_per_sequence_not_per_step(
        float32_products, layer, products, monkeypatch):
    """The recurrence reads ``w_h`` at every step, forward and backward: the hand-written
    VJPs' loops (``lstm``'s, and ``routed_lstm``'s with both branches' ``w_h``) multiply a
    copy made before the loop, not a float32 weight converted per step. Traced for CPU's
    form (bf16-rounded float32 operands) and, without compiling, for the accelerators'
    (bf16 operands)."""
    monkeypatch.setattr(layers, "_rounds_in_float32", lambda: float32_products)
    x, w_x, w_h, b = lstm_args(hidden=16)
    loss = lambda *a: jnp.sum(jnp.sin(layer(*a, jnp.bfloat16)))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w_x, w_h, b).jaxpr
    weight_shapes = (w_h.shape, w_h.T.shape)
    in_loop = [eqn for eqn, loop in equations(jaxpr) if loop]
    assert not [e for e in in_loop if e.primitive.name == "convert_element_type"
                and e.invars[0].aval.shape in weight_shapes]
    before_loop = [e for e, loop in equations(jaxpr) if not loop
                   and e.primitive.name == "convert_element_type"
                   and e.outvars[0].aval.dtype == jnp.bfloat16
                   and e.outvars[0].aval.shape in weight_shapes]
    assert {e.outvars[0].aval.shape for e in before_loop} == set(weight_shapes)
    # The forward's h @ w_h and the backward's dz @ w_h^T (per branch), on operands of the
    # form chosen.
    in_loop_products = [e for e in in_loop if e.primitive.name == "dot_general"]
    assert len(in_loop_products) == products
    operand = jnp.float32 if float32_products else jnp.bfloat16
    assert {v.aval.dtype for e in in_loop_products for v in e.invars} == {jnp.dtype(operand)}
    assert {v.aval.dtype for e in in_loop_products for v in e.outvars} == {
        jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------- routed LSTM


def reference_routed_lstm(x, weights_g, weights_l, q0, hard=False):
    """Both cells step from the routed (h, c), written out per step, by autodiff."""
    hidden = weights_g[1].shape[0]

    def cell(x_t, h, c, weights):
        w_x, w_h, b = weights
        z = x_t @ w_x + h @ w_h + b
        i, f, g, o = (z[:, k * hidden:(k + 1) * hidden] for k in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        return jax.nn.sigmoid(o) * jnp.tanh(c), c

    def step(carry, inputs):
        x_t, q_t = inputs
        (h_g, c_g), (h_l, c_l) = cell(x_t, *carry, weights_g), cell(x_t, *carry, weights_l)
        q = (q_t >= 0.5).astype(x_t.dtype)[:, None] if hard else q_t[:, None]
        h, c = q * h_g + (1 - q) * h_l, q * c_g + (1 - q) * c_l
        return (h, c), h

    zeros = jnp.zeros((x.shape[0], hidden))
    inputs = (jnp.swapaxes(x, 0, 1), jnp.swapaxes(q0, 0, 1))
    return jnp.swapaxes(lax.scan(step, (zeros, zeros), inputs)[1], 0, 1)


def routed_lstm_args(clients=2, batch=3, time=6, features=5, hidden=7):
    """Per-client ``(x, global weights, local weights, q0)``, stacked on a clients axis."""
    x, w_x, w_h, b = lstm_args(batch=(clients, batch), time=time, features=features,
                               hidden=hidden)
    per_client = lambda scale: tuple(jnp.stack([scale * a, -scale * a])  # noqa: E731
                                     for a in (w_x, w_h, b))
    q0 = jax.random.uniform(jax.random.key(4), (clients, batch, time))
    return x, per_client(1.0), per_client(0.8), q0


@pytest.mark.parametrize("hard", [False, True])
def test_routed_lstm_vjp_matches_a_naive_routed_scan_per_client(hard):
    """The hand-written VJP of the mixed-state recurrence, vmapped over clients with their
    own weights: the values and every gradient (input, both branches' weights, q0) of a
    per-step reference differentiated by autodiff; hard routing gives q0 no gradient."""
    args = routed_lstm_args()
    routed = lambda *a: layers.routed_lstm(*a, hard=hard)  # noqa: E731
    naive = lambda *a: reference_routed_lstm(*a, hard=hard)  # noqa: E731
    value = lambda fn: jax.jit(jax.vmap(fn))  # noqa: E731
    grad = lambda fn: jax.jit(jax.vmap(jax.grad(lstm_loss(fn), argnums=(0, 1, 2, 3))))  # noqa: E731
    assert_close(value(routed)(*args), value(naive)(*args))
    grads, expected = grad(routed)(*args), grad(naive)(*args)
    assert_close(grads, expected)
    if hard:
        np.testing.assert_array_equal(grads[3], 0.0)
    else:
        assert float(jnp.abs(grads[3]).min()) > 0  # every step's q0 moves the output
    # The same values as autodiff's forward, bit for bit: test_routing's
    # test_mixed_state_takes_the_lstm_layers_custom_grad, through the model.


def test_routed_lstm_bf16_keeps_float32_gradients_close_to_float32():
    args = jax.tree.map(lambda a: a[0], routed_lstm_args(hidden=16))  # one client
    grad = lambda fn: jax.jit(jax.grad(lstm_loss(fn), argnums=(0, 1, 2, 3)))  # noqa: E731
    expected = grad(reference_routed_lstm)(*args)
    for custom_grad in (True, False):
        bf16 = lambda *a: layers.routed_lstm(*a, compute_dtype=jnp.bfloat16,  # noqa: E731
                                             custom_grad=custom_grad)
        grads = grad(bf16)(*args)
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
        assert 0 < relative_error(grads, expected) < 3e-2
