"""FedRep's two phases, its never-averaged head, its personalized model and its state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax import config as run_config
from flowjax import experiment
from configs import cifar, emnist, shakespeare, stackoverflow
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms import build_algorithm
from flowjax.algorithms.base import split_layers
from flowjax.algorithms.fedrep import FedRepConfig, epochs_for_budget, fedrep
from flowjax.core import prng
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.models.base import forward
from tests.helpers import (assert_trees_equal, differs, params_before_and_after_adam_rounds,
                           small_config)

CONFIG = dict(sgd=SGDConfig(learning_rate=0.05, epochs=1, batch_size=4))



def _client(task, index, padded_examples=32, batch_size=4):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def _update(model, head_epochs, body_epochs):
    algorithm = fedrep(model, FedRepConfig(**CONFIG, head_epochs=head_epochs,
                                           body_epochs=body_epochs))
    return algorithm, jax.jit(algorithm.client_update)


def test_params_split_into_body_and_the_initial_head(cnn):
    algorithm, _ = _update(cnn, 1, 1)
    params = algorithm.init(jax.random.key(0))
    assert set(params["initial_head"]) == {"fc2"}
    assert set(params["body"]) == {"conv1", "conv2", "fc1"}
    assert_trees_equal({**params["body"], **params["initial_head"]}, cnn.init(jax.random.key(0)))
    assert_trees_equal(algorithm.init_client_state(params), params["initial_head"])
    assert_trees_equal(params["mean_head"].value, params["initial_head"])  # until a round


def test_head_epochs_leave_the_body_exactly_and_train_the_head(cnn, images_small):
    algorithm, update = _update(cnn, head_epochs=2, body_epochs=0)
    params = algorithm.init(jax.random.key(0))
    head = algorithm.init_client_state(params)
    result = update(params, _client(images_small, 1), jax.random.key(1), head)
    assert_trees_equal(result.params["body"], params["body"])
    assert differs(result.client_state, head)
    assert float(result.metrics["body_loss_count"]) == 0.0


def test_body_epochs_leave_the_head_exactly_and_train_the_body(cnn, images_small):
    algorithm, update = _update(cnn, head_epochs=0, body_epochs=2)
    params = algorithm.init(jax.random.key(0))
    head = split_layers(cnn.init(jax.random.key(5)), ("fc2",))[0]  # any stored head
    result = update(params, _client(images_small, 1), jax.random.key(1), head)
    assert_trees_equal(result.client_state, head)
    assert differs(result.params["body"], params["body"])
    assert float(result.metrics["head_loss_count"]) == 0.0


def test_a_round_is_the_head_phase_then_the_body_phase_on_the_new_head(cnn, images_small):
    # The head phase of a (2, 1) round is exactly a (2, 0) round (the body phase never
    # touches the head); its body phase is exactly a (0, 1) round started from that head.
    client = _client(images_small, 2, padded_examples=16)
    algorithm, both = _update(cnn, head_epochs=2, body_epochs=1)
    _, head_only = _update(cnn, head_epochs=2, body_epochs=0)
    _, body_only = _update(cnn, head_epochs=0, body_epochs=1)
    params = algorithm.init(jax.random.key(0))
    head = algorithm.init_client_state(params)
    key = jax.random.key(3)

    result = both(params, client, key, head)
    new_head = head_only(params, client, key, head).client_state
    assert_trees_equal(result.client_state, new_head)
    body_after_new_head = body_only(params, client, key, new_head).params["body"]
    assert_trees_equal(result.params["body"], body_after_new_head)
    assert differs(result.params["body"], body_only(params, client, key, head).params["body"])


def test_the_head_is_never_sent_for_averaging(cnn, images_small):
    algorithm, update = _update(cnn, 1, 1)
    params = algorithm.init(jax.random.key(0))
    stored = split_layers(cnn.init(jax.random.key(5)), ("fc2",))[0]
    client = _client(images_small, 1)
    result = update(params, client, jax.random.key(1), stored)
    assert_trees_equal(result.params["initial_head"], params["initial_head"])
    assert float(result.weight["initial_head"]) == 0.0
    assert float(result.weight["body"]) == float(client.num_examples)


def test_personalized_model_is_the_body_with_the_clients_adapted_head(cnn, images_small):
    algorithm, _ = _update(cnn, head_epochs=2, body_epochs=1)
    _, head_only = _update(cnn, head_epochs=2, body_epochs=0)
    params = algorithm.init(jax.random.key(0))
    stored = split_layers(cnn.init(jax.random.key(5)), ("fc2",))[0]
    client = _client(images_small, 1)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), stored)
    assert_trees_equal(personal, head_only(params, client, jax.random.key(2), stored).client_state)

    x = client.x[0]
    predictions = algorithm.predict(params, personal, x)
    np.testing.assert_array_equal(predictions.personal_hard, predictions.personal_soft)
    np.testing.assert_array_equal(predictions.personal_hard,
                                  forward(cnn, {**params["body"], **personal}, x))
    np.testing.assert_array_equal(predictions.global_logits,
                                  forward(cnn, {**params["body"], **params["mean_head"].value}, x))
    assert predictions.q0.shape == (x.shape[0], 0)


def test_an_empty_client_keeps_its_head_and_weighs_nothing(cnn, images_small):
    algorithm, update = _update(cnn, 1, 1)
    params = algorithm.init(jax.random.key(0))
    stored = split_layers(cnn.init(jax.random.key(5)), ("fc2",))[0]
    client = _client(images_small, 1, padded_examples=8)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    result = update(params, empty, jax.random.key(1), stored)
    assert_trees_equal(result.client_state, stored)
    assert_trees_equal(result.params["body"], params["body"])
    assert float(result.weight["body"]) == 0.0


def test_the_server_never_moves_the_initial_head_even_with_adam(cnn, images_small):
    algorithm, _ = _update(cnn, 1, 1)
    initial, final = params_before_and_after_adam_rounds(algorithm, images_small)
    assert_trees_equal(final["initial_head"], initial["initial_head"])
    assert differs(final["body"], initial["body"])


def test_a_clients_head_comes_back_to_it_the_next_time_it_is_sampled(cnn, images_small):
    # Round 0 trains clients {1, 2}, round 1 clients {2, 3}: client 2's round-1 update must
    # start from the head it left in round 0, not from the initial head.
    algorithm, update = _update(cnn, 1, 1)
    settings = experiment.RunSettings(seed=0, num_rounds=2, clients_per_round=2, batch_size=4)
    simulation = experiment.Simulation(algorithm, images_small, settings,
                                       server_optimizer=optax.sgd(1.0))

    def cohort(clients):
        return jax.tree.map(jnp.asarray, assemble_cohort(
            images_small.train, "train", clients, num_clients=2,
            padded_examples=simulation.train_examples, batch_size=4))

    def stored_head(client):
        return jax.tree.map(lambda a: a[0], simulation.client_states.gather(np.array([client])))

    state = simulation.init_state()
    # Copies: the round function donates the server state it is given.
    initial_head = jax.tree.map(np.array, algorithm.init_client_state(state.params))
    state, _ = simulation.run_round(state, 0, cohort([1, 2]))
    left, untouched = stored_head(2), stored_head(1)
    assert differs(left, initial_head)
    params_after_round_0 = jax.tree.map(np.array, state.params)
    state, _ = simulation.run_round(state, 1, cohort([2, 3]))

    key = prng.client_key(prng.round_key(prng.base_key(0, prng.Purpose.TRAIN), 1), 2)
    client = client_at(cohort([2, 3]), 0)
    expected = update(params_after_round_0, client, key, left).client_state
    restarted = update(params_after_round_0, client, key, initial_head).client_state
    for got, want, wrong in zip(jax.tree.leaves(stored_head(2)), jax.tree.leaves(expected),
                                jax.tree.leaves(restarted)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.max(np.abs(got - wrong)) > 1e-3
    assert_trees_equal(stored_head(1), untouched)  # not sampled in round 1


def test_epochs_for_budget_is_e_minus_one_head_epochs_and_one_body_epoch():
    assert epochs_for_budget(3) == (2, 1)
    assert epochs_for_budget(5) == (4, 1)
    assert epochs_for_budget(1) == (0, 1)  # the same formula (module docstring)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        epochs_for_budget(0)


@pytest.mark.parametrize("module,variant,epochs", [
    (cifar, "cifar10_0.1", 3), (emnist, "paper", 3), (stackoverflow, "paper", 3),
    (shakespeare, "paper", 5), (shakespeare, "quick", 1)])
def test_dataset_configs_leave_fedrep_epochs_to_the_budget(module, variant, epochs):
    config = module.get_config(variant)
    assert config.sgd.epochs == epochs
    assert config.methods.fedrep.head_epochs is None
    assert config.methods.fedrep.body_epochs is None


def test_a_run_config_trains_e_minus_one_head_epochs_then_one_body_epoch(cnn, images_small):
    # The EMNIST config (E = 3) through the run-config builder: 2 head epochs and 1 body
    # epoch, seen in the per-phase instance counts of one client's round.
    config = emnist.get_config("paper")
    config.sgd.batch_size = 4
    client = _client(images_small, 1)
    algorithm = build_algorithm("fedrep", cnn, config, client.x[0])
    params = algorithm.init(jax.random.key(0))
    result = jax.jit(algorithm.client_update)(params, client, jax.random.key(1),
                                              algorithm.init_client_state(params))
    n = float(client.num_examples)
    assert float(result.metrics["head_loss_count"]) == 2 * n
    assert float(result.metrics["body_loss_count"]) == n


def test_bad_config_values_name_the_field(cnn):
    with pytest.raises(ValueError, match=r"^head_epochs=-1: expected None or an integer >= 0$"):
        FedRepConfig(**CONFIG, head_epochs=-1, body_epochs=1)
    with pytest.raises(ValueError, match=r"^body_epochs=0: expected head_epochs \+ "
                       r"body_epochs >= 1 \(head_epochs=0\)$"):
        FedRepConfig(**CONFIG, head_epochs=0, body_epochs=0)
    # Unset phases follow the budget E: (E - 1) head epochs and 1 body epoch.
    derived = FedRepConfig(sgd=SGDConfig(learning_rate=0.05, epochs=3, batch_size=4))
    assert (derived.head_epochs, derived.body_epochs) == (2, 1)
    headless = dataclasses.replace(cnn, head_layers=())
    with pytest.raises(ValueError, match="declares no head_layers"):
        fedrep(headless, FedRepConfig(**CONFIG, head_epochs=1, body_epochs=1))


def test_head_layers_choose_the_head_among_the_top_layers(cnn):
    """``head_layers``: the Flow authors' EMNIST FedRep heads both dense layers (their
    ``linear`` layers); any top layers leaving a body are accepted, nothing else."""
    both = fedrep(cnn, FedRepConfig(**CONFIG, head_layers=["fc1", "fc2"]))
    params = both.init(jax.random.key(0))
    assert set(params["initial_head"]) == {"fc1", "fc2"}
    assert set(params["body"]) == {"conv1", "conv2"}
    assert_trees_equal({**params["body"], **params["initial_head"]}, cnn.init(jax.random.key(0)))
    for bad, message in ((("fc1",), "must be the top layers"),
                         (cnn.layer_names, "must be the top layers"),
                         (("fc2", "fc2"), "must be distinct layers of 'emnist_cnn'")):
        with pytest.raises(ValueError, match=message):
            fedrep(cnn, FedRepConfig(**CONFIG, head_layers=bad))
    with pytest.raises(ValueError, match=r"^head_layers=\(\): expected None \(the model's "
                       r"head\) or a non-empty sequence of layer names$"):
        FedRepConfig(**CONFIG, head_layers=())


def test_run_trains_and_evaluates_through_the_engine():
    config = small_config(algorithm="fedrep", num_rounds=2, **{"methods.fedrep.head_epochs": 1})
    simulation = run_config.build_simulation(config)
    result = experiment.run(simulation)
    train = [h for h in result.history if h["kind"] == "train"]
    assert len(train) == 2
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["body_loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_p < 1 and summary.acc_p_soft == summary.acc_p
    assert len(simulation.client_states) > 0
    assert set(result.summaries) == {"train_clients", "held_out_clients"}
