"""Local training: the server never moves; each client's model is its own SGD run."""

import jax
import ml_collections
import numpy as np
import optax
import pytest

from flowjax import config as run_config
from flowjax import experiment
from flowjax.algorithms.base import SGDConfig, client_optimizer, train_plain, valid_examples
from flowjax.algorithms.local import LocalConfig, local
from flowjax.experiment import RunSettings, Simulation
from flowjax.models.base import forward
from tests.helpers import one_client, small_config

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))



def _client(task, index, padded_examples, batch_size=4):
    return one_client(task, index, padded_examples, batch_size)


def test_server_params_never_move(cnn, images_small):
    algorithm = local(cnn, LocalConfig(**CONFIG))
    settings = RunSettings(seed=0, num_rounds=3, clients_per_round=4, batch_size=4,
                           max_examples_per_client=8)
    # A server optimizer with momentum: any nonzero pseudo-gradient would move it.
    simulation = Simulation(algorithm, images_small, settings,
                            server_optimizer=optax.sgd(1.0, momentum=0.9))
    state = simulation.init_state()
    initial = jax.tree.map(np.array, state)
    for round_index in range(3):
        state, metrics = simulation.run_round(state, round_index)
        assert float(metrics["weight"]) == 0.0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(a, b)


def test_personal_model_is_local_sgd_from_the_initial_params(cnn, images_small):
    algorithm = local(cnn, LocalConfig(**CONFIG))
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small, 1, padded_examples=16)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(3))
    expected, _ = jax.jit(lambda p, c, k: train_plain(
        cnn, p, client_optimizer(0.05), c, valid_examples(c), epochs=2, batch_size=4, key=k))(
        params, client, jax.random.key(3))
    for a, b in zip(jax.tree.leaves(personal), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    x = client.x[0]
    predictions = algorithm.predict(params, personal, x)
    np.testing.assert_array_equal(predictions.global_logits, forward(cnn, params, x))
    np.testing.assert_array_equal(predictions.personal_hard, forward(cnn, personal, x))


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^epochs=0: expected an integer >= 1$"):
        LocalConfig(sgd=SGDConfig(**{**SGD, "epochs": 0}))
    with pytest.raises(ValueError, match=r"^learning_rate=0.0: expected a finite number > 0$"):
        LocalConfig(sgd=SGDConfig(**{**SGD, "learning_rate": 0.0}))


def test_local_run_keeps_the_initial_model_and_personalizes():
    config = small_config(algorithm="local", num_rounds=2)
    config.model_options = ml_collections.ConfigDict({"hidden": 32})
    config.methods.local.sgd.epochs = 3
    config.methods.local.sgd.learning_rate = 1.0
    simulation = run_config.build_simulation(config)
    result = experiment.run(simulation)
    fresh = simulation.init_state().params  # the round-0 params, recomputed from the seed
    for a, b in zip(jax.tree.leaves(result.final_state.params), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(a, b)
    summary = result.summaries["train_clients"]
    assert summary.acc_p > summary.acc_g  # local SGD beats the untrained model
