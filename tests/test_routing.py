"""Routed forward pass: exactness at q0 in {0, 1}, hard routing, the policy's outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.models import get_model
from flowjax.models.base import forward
from flowjax.routing import build_policy, routed_forward
from tests.helpers import loops, products


def _inputs(model_name, key):
    if model_name == "emnist_cnn":
        return jax.random.normal(key, (5, 28, 28), jnp.float32)
    if model_name == "stackoverflow_lstm_small":
        return jax.random.randint(key, (3, 20), 0, 60)
    return jax.random.randint(key, (3, 80), 0, 90)


def _model(name):
    if name == "stackoverflow_lstm_small":
        return get_model("stackoverflow_lstm", vocab_size=60, embed_dim=8, hidden=16, dense=8)
    return get_model(name)


@pytest.fixture(params=["emnist_cnn", "shakespeare_lstm", "stackoverflow_lstm_small"])
def routed_setup(request):
    model = _model(request.param)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    global_params, local_params = model.init(k1), model.init(k2)
    x = _inputs(request.param, k3)
    instance_shape = x.shape[: model.instance_ndim]
    return model, global_params, local_params, x, instance_shape


@pytest.mark.parametrize("hard", [False, True])
def test_q0_one_is_global_and_zero_is_local_exactly(routed_setup, hard, recurrence="separate"):
    model, global_params, local_params, x, instance_shape = routed_setup
    ones = jnp.ones(instance_shape + (model.num_layers,))
    # Both sides jitted with params as arguments, as in training (params closed over as
    # constants let XLA pre-transform the weights differently in each program).
    routed = jax.jit(lambda g, l, q0: routed_forward(model, g, l, q0, x, hard=hard,
                                                     recurrence=recurrence))
    plain = jax.jit(lambda params: forward(model, params, x))
    np.testing.assert_array_equal(routed(global_params, local_params, ones), plain(global_params))
    np.testing.assert_array_equal(routed(global_params, local_params, ones * 0),
                                  plain(local_params))


@pytest.mark.parametrize("hard", [False, True])
def test_mixed_state_at_q0_one_is_global_and_zero_is_local(routed_setup, hard):
    """To float32 rounding: XLA fuses the routed loop differently (``routed_lstm``)."""
    model, global_params, local_params, x, instance_shape = routed_setup
    ones = jnp.ones(instance_shape + (model.num_layers,))
    routed = jax.jit(lambda g, l, q0: routed_forward(model, g, l, q0, x, hard=hard,
                                                     recurrence="mixed_state"))
    plain = jax.jit(lambda params: forward(model, params, x))
    for q0, params in ((ones, global_params), (ones * 0, local_params)):
        np.testing.assert_allclose(routed(global_params, local_params, q0), plain(params),
                                   rtol=0, atol=1e-6)


def test_hard_routing_picks_one_branch_per_layer_per_instance(routed_setup):
    model, global_params, local_params, x, instance_shape = routed_setup
    q0 = jax.random.uniform(jax.random.key(3), instance_shape + (model.num_layers,))
    hard = routed_forward(model, global_params, local_params, q0, x, hard=True)
    # The same pass with q0 rounded to exactly 0/1 and *soft* mixing: 1*g + 0*l == g.
    rounded = (q0 >= 0.5).astype(jnp.float32)
    soft_on_rounded = routed_forward(model, global_params, local_params, rounded, x, hard=False)
    np.testing.assert_array_equal(hard, soft_on_rounded)
    # And instance by instance, against a plain model whose layers are each either copy.
    if model.instance_ndim == 1:
        for i in range(x.shape[0]):
            chosen = {name: (global_params if rounded[i, j] else local_params)[name]
                      for j, name in enumerate(model.layer_names)}
            np.testing.assert_allclose(hard[i], forward(model, chosen, x)[i], rtol=1e-5, atol=1e-5)
    # Soft routing with fractional q0 differs from both pure branches.
    soft = routed_forward(model, global_params, local_params, q0, x)
    assert not np.allclose(soft, forward(model, global_params, x))


def test_policy_gives_one_distribution_per_instance_and_layer(routed_setup):
    model, _, _, x, instance_shape = routed_setup
    hidden = (16,) * model.num_layers
    policy = build_policy(model, x, hidden)
    params = policy.init(jax.random.key(0))
    log_q = policy.log_probs(params, x)
    assert log_q.shape == instance_shape + (model.num_layers, 2)
    np.testing.assert_allclose(jnp.exp(log_q).sum(-1), 1.0, rtol=1e-6)
    # Dropout only in training.
    train_a = policy.log_probs(params, x, train=True, key=jax.random.key(1))
    train_b = policy.log_probs(params, x, train=True, key=jax.random.key(2))
    assert not np.array_equal(train_a, train_b)
    np.testing.assert_array_equal(policy.log_probs(params, x), log_q)


def test_token_policy_is_causal():
    model = get_model("shakespeare_lstm")
    x = jax.random.randint(jax.random.key(0), (2, 80), 1, 87)
    policy = build_policy(model, x, (8, 8, 8, 8))
    params = policy.init(jax.random.key(1))
    changed = x.at[:, 50:].set(5)
    before, after = policy.log_probs(params, x), policy.log_probs(params, changed)
    np.testing.assert_array_equal(before[:, :50], after[:, :50])
    assert not np.array_equal(before[:, 50:], after[:, 50:])


def test_policy_needs_one_width_per_layer():
    model = get_model("emnist_cnn")
    with pytest.raises(ValueError, match="one entry per routed layer"):
        build_policy(model, jnp.zeros((1, 28, 28)), (350, 150, 50))


def _cell(x_t, h, c, weights):
    """One LSTM step written out (gates i, f, g, o), independent of flowjax.models.layers."""
    w_x, w_h, b = weights
    z = x_t @ w_x + h @ w_h + b
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


@pytest.mark.parametrize("name", ["emnist_cnn", "shakespeare_lstm", "stackoverflow_lstm"])
def test_the_models_recurrent_layers_are_its_lstms(name):
    """``mixed_state`` routes a layer's recurrence where the model says it is an LSTM:
    exactly the layers whose params are an LSTM's, and no other layer takes it."""
    model = get_model(name)
    params = jax.eval_shape(model.init, jax.random.key(0))
    lstm_shaped = tuple(layer for layer in model.layer_names
                        if set(params[layer]) == {"kernel", "recurrent_kernel", "bias"})
    assert model.recurrent_layers == lstm_shaped
    assert bool(lstm_shaped) == (name != "emnist_cnn")
    other = next(j for j, layer in enumerate(model.layer_names)
                 if layer not in model.recurrent_layers)
    with pytest.raises(ValueError, match=f"^layer '{model.layer_names[other]}' is a "
                                         r"\w+: only an LSTM layer routes a recurrence$"):
        model.routed_recurrence(other, None, None, None, None, False)


def test_mixed_state_recurrence_feeds_the_mixed_state_back_at_every_step():
    """Eq. 3 per time step, written as a loop: both cells step from the mixed (h, c)."""
    model = _model("stackoverflow_lstm_small")
    k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
    g, l = model.init(k1), model.init(k2)
    x = jax.random.randint(k3, (2, 20), 1, 60)
    q0 = jax.random.uniform(k4, (2, 20, model.num_layers))
    routed = routed_forward(model, g, l, q0, x, recurrence="mixed_state")
    # By hand: the embedding layer is routed on its outputs, then the recurrence.
    h_in = (q0[..., 0, None] * model.layer_apply(0, g["embedding"], x)
            + (1 - q0[..., 0, None]) * model.layer_apply(0, l["embedding"], x))
    wg = tuple(g["lstm"][k] for k in ("kernel", "recurrent_kernel", "bias"))
    wl = tuple(l["lstm"][k] for k in ("kernel", "recurrent_kernel", "bias"))
    h = c = jnp.zeros((2, 16))
    outputs = []
    for t in range(20):
        h_g, c_g = _cell(h_in[:, t], h, c, wg)
        h_l, c_l = _cell(h_in[:, t], h, c, wl)
        q = q0[:, t, 1, None]
        h, c = q * h_g + (1 - q) * h_l, q * c_g + (1 - q) * c_l
        outputs.append(h)
    h = jnp.stack(outputs, axis=1)
    for j in (2, 3):
        name = model.layer_names[j]
        h = (q0[..., j, None] * model.layer_apply(j, g[name], h)
             + (1 - q0[..., j, None]) * model.layer_apply(j, l[name], h))
    np.testing.assert_allclose(routed, h, rtol=1e-5, atol=1e-5)
    separate = routed_forward(model, g, l, q0, x)  # the default, "separate"
    assert not np.allclose(routed, separate, atol=1e-4)  # the two recurrences differ


def test_unknown_recurrence_is_refused():
    model = _model("stackoverflow_lstm_small")
    params = model.init(jax.random.key(0))
    with pytest.raises(ValueError, match="unknown recurrence 'mixed'"):
        routed_forward(model, params, params, jnp.ones((1, 20, 4)), jnp.ones((1, 20), jnp.int32),
                       recurrence="mixed")


# ----------------------------------------------------------------- fuse_branches


def _layer_inputs(model, params, x):
    """Each routed layer's input for ``x`` (the plain model's, layer by layer)."""
    h, inputs = model.embed_input(x), []
    for j, name in enumerate(model.layer_names):
        inputs.append(h)
        h = model.glue_apply(j, model.layer_apply(j, params[name], h), False, jax.random.key(0))
    return inputs


def test_branches_fuse_where_the_input_outweighs_the_weights():
    """The EMNIST CNN's convolutions (inputs 20x28x28 and 20x26x26x32 against 320 and
    18,496 weights), none of its dense layers; of the Stack Overflow LSTM's, only dense1
    (the LSTM's 16x20x670 outputs against 64,416 weights)."""
    from flowjax.routing.routed import shares_input
    for name, x, fused in (("emnist_cnn", jnp.zeros((20, 28, 28)), [True, True, False, False]),
                           ("stackoverflow_lstm", jnp.zeros((16, 20), jnp.int32),
                            [False, False, True, False])):
        model = get_model(name)
        params = jax.eval_shape(model.init, jax.random.key(0))
        inputs = jax.eval_shape(lambda p: _layer_inputs(model, p, x), params)
        assert [shares_input(params[layer], h)
                for layer, h in zip(model.layer_names, inputs)] == fused, name


@pytest.mark.parametrize("conv_impl", ["xla", "im2col_slices"])
@pytest.mark.parametrize("hard", [False, True])
def test_fused_branches_are_the_same_model_to_float32_rounding(conv_impl, hard):
    """Logits and every gradient within 1e-5 of the largest entry (bit for bit under some
    XLA flags); each convolution's forward product runs once for both branches instead of
    once per branch."""
    model = get_model("emnist_cnn", conv_impl=conv_impl)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    global_params, local_params = model.init(k1), model.init(k2)
    x = jax.random.uniform(k3, (20, 28, 28))
    q0 = jax.random.uniform(k4, (20, model.num_layers))

    def loss(g, l, q0, fuse):
        logits = routed_forward(model, g, l, q0, x, hard=hard, fuse_branches=fuse)
        return jnp.mean(jax.nn.log_softmax(logits)[:, 0]), logits

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                    static_argnums=3)
    (_, separate), separate_grads = grads(global_params, local_params, q0, False)
    (_, fused), fused_grads = grads(global_params, local_params, q0, True)
    for a, b in zip(jax.tree.leaves((separate, separate_grads)),
                    jax.tree.leaves((fused, fused_grads)), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(a))))
    forward_products = [products(lambda g, l: routed_forward(model, g, l, q0, x, hard=hard,
                                                               fuse_branches=fuse),
                                  global_params, local_params) for fuse in (False, True)]
    assert forward_products == [8, 6]  # conv1, conv2: one product each; fc1, fc2: two


def _relative_error(actual, expected) -> float:
    return max(float(jnp.linalg.norm(a - e) / jnp.linalg.norm(e))
               for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True))


def _mixed_state_setup(**model_options):
    model = get_model("stackoverflow_lstm", vocab_size=60, embed_dim=8, hidden=16, dense=8,
                      **model_options)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    x = jax.random.randint(k3, (3, 20), 1, 60)
    q0 = jax.random.uniform(k4, (3, 20, model.num_layers))
    return model, model.init(k1), model.init(k2), x, q0


def _mixed_state_pass(model, x):
    """Jitted logits and their gradient in both params and ``q0``, under ``mixed_state``."""
    logits = lambda g, l, q0: routed_forward(model, g, l, q0, x,  # noqa: E731
                                             recurrence="mixed_state")
    loss = lambda g, l, q0: jnp.sum(jnp.sin(logits(g, l, q0)))  # noqa: E731
    return jax.jit(logits), jax.jit(jax.grad(loss, argnums=(0, 1, 2))), loss


def test_mixed_state_takes_the_lstm_layers_custom_grad():
    """The model's ``custom_grad`` reaches the routed recurrence: its hand-written VJP
    (``routed_lstm``) by default, autodiff with ``custom_grad=False``; the same logits bit
    for bit and the same gradients in both params and ``q0`` to float32 rounding."""
    fast, g, l, x, q0 = _mixed_state_setup()
    plain = _mixed_state_setup(custom_grad=False)[0]
    fast_pass, plain_pass = _mixed_state_pass(fast, x), _mixed_state_pass(plain, x)

    def has_vjp(model):
        jaxpr = jax.make_jaxpr(lambda g, l, q0: routed_forward(
            model, g, l, q0, x, recurrence="mixed_state"))(g, l, q0)
        return "custom_vjp_call" in str(jaxpr)

    assert (has_vjp(fast), has_vjp(plain)) == (True, False)
    np.testing.assert_array_equal(fast_pass[0](g, l, q0), plain_pass[0](g, l, q0))
    assert _relative_error(fast_pass[1](g, l, q0), plain_pass[1](g, l, q0)) < 1e-5


# -m slow (15 s): test_conv_impl's test_config_lstm_options_reach_flows_mixed_state_recurrence
# checks in CI that the config's lstm_unroll reaches this recurrence.
@pytest.mark.slow
def test_mixed_state_takes_the_lstm_layers_unroll():
    """``lstm_unroll`` reaches the routed recurrence (the model's ``routed_recurrence``):
    the same logits and gradients to float32 rounding (XLA fuses the unrolled body
    differently, ``routed_lstm``), and no time loop left."""
    _, g, l, x, q0 = _mixed_state_setup()
    looped = _mixed_state_pass(_mixed_state_setup()[0], x)
    unrolled = _mixed_state_pass(_mixed_state_setup(lstm_unroll=20)[0], x)
    assert _relative_error(unrolled[0](g, l, q0), looped[0](g, l, q0)) < 1e-6
    assert _relative_error(unrolled[1](g, l, q0), looped[1](g, l, q0)) < 1e-6
    # forward and backward loops of the recurrence; none
    assert (loops(jax.grad(looped[2]), g, l, q0), loops(jax.grad(unrolled[2]), g, l, q0)) == (2, 0)


def test_mixed_state_takes_the_lstm_layers_compute_dtype():
    """``compute_dtype='bfloat16'`` reaches the routed recurrence: at q0 = 1 it is the plain
    bf16 model to float32 rounding (the same bf16 operands), not the float32 one, and its
    gradients stay float32 and close to the float32 model's."""
    bf16, g, l, x, q0 = _mixed_state_setup(compute_dtype="bfloat16")
    float32 = _mixed_state_setup()[0]
    ones = jnp.ones_like(q0)
    logits, grad, _ = _mixed_state_pass(bf16, x)
    plain = lambda model: jax.jit(lambda params: forward(model, params, x))  # noqa: E731
    np.testing.assert_allclose(logits(g, l, ones), plain(bf16)(g), rtol=0, atol=1e-6)
    assert _relative_error(logits(g, l, ones), plain(float32)(g)) > 1e-4
    grads, expected = grad(g, l, q0), _mixed_state_pass(float32, x)[1](g, l, q0)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert _relative_error(grads, expected) < 3e-2
