"""Routed forward pass: exactness at q0 in {0, 1}, hard routing, the policy's outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.models import get_model
from flowjax.models.base import forward
from flowjax.routing import build_policy, routed_forward


def _inputs(model_name, key):
    if model_name == "emnist_cnn":
        return jax.random.normal(key, (5, 28, 28), jnp.float32)
    return jax.random.randint(key, (3, 80), 0, 90)


@pytest.fixture(params=["emnist_cnn", "shakespeare_lstm"])
def routed_setup(request):
    model = get_model(request.param)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    global_params, local_params = model.init(k1), model.init(k2)
    x = _inputs(request.param, k3)
    instance_shape = x.shape[: model.instance_ndim]
    return model, global_params, local_params, x, instance_shape


@pytest.mark.parametrize("hard", [False, True])
def test_q0_one_is_global_and_zero_is_local_exactly(routed_setup, hard):
    model, global_params, local_params, x, instance_shape = routed_setup
    ones = jnp.ones(instance_shape + (model.num_layers,))
    # Both sides jitted with params as arguments, as in training (params closed over as
    # constants let XLA pre-transform the weights differently in each program).
    routed = jax.jit(lambda g, l, q0: routed_forward(model, g, l, q0, x, hard=hard))
    plain = jax.jit(lambda params: forward(model, params, x))
    np.testing.assert_array_equal(routed(global_params, local_params, ones), plain(global_params))
    np.testing.assert_array_equal(routed(global_params, local_params, ones * 0),
                                  plain(local_params))


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
