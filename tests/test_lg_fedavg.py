"""LG-FedAvg's joint local update, its global-only mean, its personalized model and state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax import experiment
from flowjax.algorithms.base import SGDConfig, plain_loss_sums
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, global_layer_names, lg_fedavg
from flowjax.core import prng
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.core.losses import mean_from_sums
from flowjax.models.base import forward
from tests.helpers import (assert_trees_equal, check_state_round_trip, differs,
                           params_before_and_after_adam_rounds)

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))
LOCAL = ("conv1", "conv2", "fc1")



def _client(task, index, padded_examples=32, batch_size=4):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def _stored_local(model):
    """A client's stored local layers that differ from the initial ones."""
    params = model.init(jax.random.key(5))
    return {name: params[name] for name in LOCAL}


def test_params_split_into_global_top_layers_and_the_initial_local_layers(cnn):
    algorithm = lg_fedavg(cnn, LGFedAvgConfig(**CONFIG))
    params = algorithm.init(jax.random.key(0))
    assert set(params["global"]) == {"fc2"} and set(params["initial_local"]) == set(LOCAL)
    assert_trees_equal({**params["initial_local"], **params["global"]}, cnn.init(jax.random.key(0)))
    assert_trees_equal(algorithm.init_client_state(params), params["initial_local"])
    assert_trees_equal(params["mean_local"].value, params["initial_local"])  # until a round
    two = lg_fedavg(cnn, LGFedAvgConfig(**CONFIG, global_layers=("fc1", "fc2")))
    assert set(two.init(jax.random.key(0))["global"]) == {"fc1", "fc2"}


def test_a_round_trains_both_parts_jointly_and_sends_only_the_global_part(cnn, images_small):
    # The joint update of (local, global) is exactly FedAvg's on the merged model.
    algorithm = lg_fedavg(cnn, LGFedAvgConfig(**CONFIG))
    reference = fedavg(cnn, FedAvgConfig(**CONFIG))
    params = algorithm.init(jax.random.key(0))
    stored = _stored_local(cnn)
    client = _client(images_small, 1)
    result = jax.jit(algorithm.client_update)(params, client, jax.random.key(1), stored)
    merged = jax.jit(reference.client_update)({**stored, **params["global"]}, client,
                                              jax.random.key(1))
    assert_trees_equal(result.params["global"], {"fc2": merged.params["fc2"]})
    assert_trees_equal(result.client_state, {name: merged.params[name] for name in LOCAL})
    assert differs(result.client_state, stored)
    assert differs(result.params["global"], params["global"])
    assert_trees_equal(result.params["initial_local"], params["initial_local"])
    assert float(result.weight["initial_local"]) == 0.0
    assert float(result.weight["global"]) == float(client.num_examples)


def test_server_global_part_is_the_weighted_mean_and_local_part_never_moves(cnn, images_small):
    algorithm = lg_fedavg(cnn, LGFedAvgConfig(**CONFIG))
    update = jax.jit(algorithm.client_update)
    settings = experiment.RunSettings(seed=0, num_rounds=2, clients_per_round=3, batch_size=4)
    simulation = experiment.Simulation(algorithm, images_small, settings,
                                       server_optimizer=optax.sgd(1.0))
    clients = [1, 4, 7]
    cohort = jax.tree.map(jnp.asarray, assemble_cohort(
        images_small.train, "train", clients, num_clients=3,
        padded_examples=simulation.train_examples, batch_size=4))
    state = simulation.init_state()
    initial = jax.tree.map(np.array, state.params)  # the round donates the server state
    state, _ = simulation.run_round(state, 0, cohort)

    key_of_round = prng.round_key(prng.base_key(0, prng.Purpose.TRAIN), 0)
    results = [update(initial, client_at(cohort, slot), prng.client_key(key_of_round, c),
                      initial["initial_local"]) for slot, c in enumerate(clients)]
    weights = np.array([float(r.weight["global"]) for r in results])
    assert len(set(weights)) > 1  # unequal clients: a uniform mean would not pass
    expected = jax.tree.map(lambda *leaves: sum(w * np.asarray(x) for w, x in zip(weights, leaves))
                            / weights.sum(), *[r.params["global"] for r in results])
    for got, want in zip(jax.tree.leaves(state.params["global"]), jax.tree.leaves(expected),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_equal(state.params["initial_local"], initial["initial_local"])
    state, _ = simulation.run_round(state, 1)
    assert_trees_equal(state.params["initial_local"], initial["initial_local"])


def test_adam_server_never_moves_the_local_part(cnn, images_small):
    algorithm = lg_fedavg(cnn, LGFedAvgConfig(sgd=SGDConfig(**{**SGD, "epochs": 1})))
    initial, final = params_before_and_after_adam_rounds(algorithm, images_small)
    assert_trees_equal(final["initial_local"], initial["initial_local"])
    assert differs(final["global"], initial["global"])


def test_personalized_model_is_the_clients_trained_local_part_with_the_global_head(
        mlp, images_small):
    """One epoch of one minibatch (a dropout-free model): the local layers take one SGD
    step through the frozen global head; the global layers are the server's, bit for bit."""
    lr = 0.05
    model = dataclasses.replace(mlp, head_layers=("fc2",))
    algorithm = lg_fedavg(model, LGFedAvgConfig(
        sgd=SGDConfig(learning_rate=lr, epochs=1, batch_size=32)))
    params = algorithm.init(jax.random.key(0))
    stored = {"fc1": model.init(jax.random.key(5))["fc1"]}
    client = _client(images_small, 1, padded_examples=32, batch_size=32)  # one minibatch
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), stored)
    assert_trees_equal(personal["fc2"], params["global"]["fc2"])

    def loss(local_part):
        sums = plain_loss_sums(model, {**local_part, **params["global"]}, client.flat(),
                               jax.random.key(0))
        return mean_from_sums(sums[0], sums[1])

    expected = jax.tree.map(lambda p, g: p - lr * g, stored, jax.grad(loss)(stored))
    for got, want in zip(jax.tree.leaves(personal["fc1"]), jax.tree.leaves(expected["fc1"]),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert differs(personal["fc1"], stored["fc1"])

    x = client.x[0]
    predictions = algorithm.predict(params, personal, x)
    np.testing.assert_array_equal(predictions.personal_hard, predictions.personal_soft)
    np.testing.assert_array_equal(predictions.personal_hard, forward(model, personal, x))
    np.testing.assert_array_equal(
        predictions.global_logits,
        forward(model, {**params["mean_local"].value, **params["global"]}, x))
    assert predictions.q0.shape == (x.shape[0], 0)


def test_global_layers_must_be_top_layers_leaving_a_local_one(cnn):
    assert global_layer_names(cnn, None) == ("fc2",)
    assert global_layer_names(cnn, ("fc2", "fc1")) == ("fc2", "fc1")
    with pytest.raises(ValueError, match="must be the top layers"):
        global_layer_names(cnn, ("fc1",))
    with pytest.raises(ValueError, match="must be the top layers"):
        global_layer_names(cnn, cnn.layer_names)
    with pytest.raises(ValueError, match="must be distinct layers of 'emnist_cnn'"):
        global_layer_names(cnn, ("dense",))
    with pytest.raises(ValueError, match=r"^global_layers=\(\): expected None \(the model's "
                       r"head\) or a non-empty sequence of layer names$"):
        LGFedAvgConfig(**CONFIG, global_layers=())


def test_run_trains_evaluates_and_returns_each_client_its_own_local_layers():
    result = check_state_round_trip("lg_fedavg")
    train = [h for h in result.history if h["kind"] == "train"]
    assert all(np.isfinite(h["loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_p < 1 and summary.acc_p_soft == summary.acc_p
    assert set(result.summaries) == {"train_clients", "held_out_clients"}


@pytest.mark.parametrize("method", ["fedavg", "fedrep", "lg_fedavg"])
def test_the_rounds_weight_counts_each_example_once(method, mlp, images_small):
    """FedRep and LG-FedAvg send a client's n to two parameter groups; the round's
    ``weight`` metric is still the cohort's number of examples."""
    from flowjax.algorithms.fedrep import FedRepConfig, fedrep

    model = dataclasses.replace(mlp, head_layers=("fc2",))
    sgd = SGDConfig(learning_rate=0.05, epochs=1, batch_size=4)
    algorithm = {"fedavg": lambda: fedavg(model, FedAvgConfig(sgd=sgd)),
                 "fedrep": lambda: fedrep(model, FedRepConfig(sgd=sgd)),
                 "lg_fedavg": lambda: lg_fedavg(model, LGFedAvgConfig(sgd=sgd))}[method]()
    settings = experiment.RunSettings(seed=0, num_rounds=1, clients_per_round=3, batch_size=4)
    simulation = experiment.Simulation(algorithm, images_small, settings,
                                       server_optimizer=optax.sgd(1.0))
    examples = int(np.sum(simulation.host_cohort(0).num_examples))
    _, metrics = simulation.run_round(simulation.init_state(), 0)
    assert float(metrics["weight"]) == examples
