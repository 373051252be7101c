"""APFL's update rule, its personalized model, and its client state through the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.apfl import APFLConfig, apfl, mix_params
from flowjax.algorithms.base import plain_loss_sums
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.losses import mean_from_sums
from tests.helpers import assert_trees_equal, check_state_round_trip, one_client

CONFIG = dict(learning_rate=0.05, epochs=2, batch_size=4)




def test_alpha_zero_makes_the_personal_model_the_local_global_model(cnn, images_small):
    algorithm = apfl(cnn, APFLConfig(**CONFIG, alpha=0.0))
    fedavg_ft = fedavg(cnn, FedAvgConfig(**CONFIG, finetune=True))
    params = algorithm.init(jax.random.key(0))
    stored = {"v": cnn.init(jax.random.key(3))}
    client = one_client(images_small, 1, padded_examples=32)

    result = jax.jit(algorithm.client_update)(params, client, jax.random.key(1), stored)
    reference = jax.jit(fedavg_ft.client_update)(params, client, jax.random.key(1))
    assert_trees_equal(result.params, reference.params)
    assert_trees_equal(result.client_state, stored)  # no gradient reaches v

    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), stored)
    expected = jax.jit(fedavg_ft.personalize)(params, client, jax.random.key(2))
    assert_trees_equal(personal, expected)
    x = client.x[0]
    np.testing.assert_array_equal(algorithm.predict(params, personal, x).personal_hard,
                                  fedavg_ft.predict(params, expected, x).personal_hard)


def test_one_minibatch_is_the_simultaneous_update(mlp, images_small):
    alpha, lr = 0.3, 0.05
    algorithm = apfl(mlp, APFLConfig(learning_rate=lr, epochs=1, batch_size=32, alpha=alpha))
    w = mlp.init(jax.random.key(0))
    v = mlp.init(jax.random.key(1))
    client = one_client(images_small, 1, padded_examples=32, batch_size=32)  # one minibatch
    result = algorithm.client_update(w, client, jax.random.key(2), {"v": v})

    def loss(params):
        sums = plain_loss_sums(mlp, params, client.flat(), jax.random.key(0))
        return mean_from_sums(sums[0], sums[1])

    grad_w = jax.grad(loss)(w)
    grad_vbar = jax.grad(loss)(mix_params(alpha, v, w))  # vbar from the pre-step w
    expected_w = jax.tree.map(lambda p, g: p - lr * g, w, grad_w)
    expected_v = jax.tree.map(lambda p, g: p - alpha * lr * g, v, grad_vbar)
    for got, want in ((result.params, expected_w), (result.client_state["v"], expected_v)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_personal_model_mixes_the_stored_v_with_the_locally_trained_w(mlp, images_small):
    algorithm = apfl(mlp, APFLConfig(**CONFIG, alpha=0.3))
    fedavg_ft = fedavg(mlp, FedAvgConfig(**CONFIG, finetune=True))
    params = algorithm.init(jax.random.key(0))
    stored = {"v": mlp.init(jax.random.key(3))}
    client = one_client(images_small, 2, padded_examples=32)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), stored)
    local_w = jax.jit(fedavg_ft.personalize)(params, client, jax.random.key(2))
    for a, b in zip(jax.tree.leaves(personal),
                    jax.tree.leaves(mix_params(0.3, stored["v"], local_w))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_state_starts_at_the_initial_params_and_an_empty_client_keeps_it(mlp, images_small):
    algorithm = apfl(mlp, APFLConfig(**CONFIG, alpha=0.3))
    params = algorithm.init(jax.random.key(0))
    assert_trees_equal(algorithm.init_client_state(params)["v"], params)
    client = one_client(images_small, 1, padded_examples=8)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    stored = {"v": mlp.init(jax.random.key(3))}
    result = jax.jit(algorithm.client_update)(params, empty, jax.random.key(1), stored)
    assert_trees_equal(result.client_state, stored)
    assert float(result.weight) == 0.0


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match="APFL alpha must be in \\[0, 1\\], got 1.5"):
        APFLConfig(**CONFIG, alpha=1.5)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        APFLConfig(**{**CONFIG, "epochs": 0}, alpha=0.3)


def test_run_trains_evaluates_and_returns_each_client_its_own_state():
    result = check_state_round_trip("apfl")
    train = [h for h in result.history if h["kind"] == "train"]
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["personal_loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    assert set(result.summaries) == {"train_clients", "held_out_clients"}
