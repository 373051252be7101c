"""PartialFed-Adaptive: the straight-through choice, partial loading, and client state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.base import SGDConfig, client_optimizer
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.partialfed import (_STRATEGY_NOISE, PartialFedConfig,
                                           keep_unloaded_state, load_layers, loaded_copies,
                                           partialfed, sample_use_global,
                                           straight_through_choice)
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.routing.routed import routed_forward
from tests.helpers import assert_trees_equal, check_state_round_trip, differs

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD), strategy_learning_rate=0.5, temperature=1.0)
PIN = 1e4  # logits so far apart that the Gumbel noise never flips the choice



@pytest.fixture(scope="module")
def algorithm(cnn):
    return partialfed(cnn, PartialFedConfig(**CONFIG))


@pytest.fixture(scope="module")
def update(algorithm):
    """One jitted client update shared by the tests (same shapes: one compilation)."""
    return jax.jit(algorithm.client_update)


def _client(task, index, padded_examples, batch_size=4):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def _pinned(num_layers, use_global):
    row = [PIN, -PIN] if use_global else [-PIN, PIN]
    return jnp.tile(jnp.asarray(row, jnp.float32), (num_layers, 1))


def test_straight_through_is_one_hot_forward_with_the_soft_gradient():
    logits = jnp.asarray([[0.3, -0.2], [1.0, 1.5], [-0.4, 0.0], [2.0, -1.0]])
    key, tau = jax.random.key(3), 0.7
    weights = jnp.asarray([[1.0, -2.0], [0.5, 3.0], [-1.0, 1.0], [2.0, 0.25]])
    gumbel = jax.random.gumbel(key, logits.shape)
    noisy = logits + gumbel

    choice = straight_through_choice(logits, key, tau)
    np.testing.assert_array_equal(choice, jax.nn.one_hot(jnp.argmax(noisy, -1), 2))

    def through(f):
        return jax.grad(lambda a: jnp.sum(weights * f(a)))(logits)

    st_grad = through(lambda a: straight_through_choice(a, key, tau))
    soft_grad = through(lambda a: jax.nn.softmax((a + gumbel) / tau, axis=-1))
    np.testing.assert_allclose(st_grad, soft_grad, rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(st_grad) > 1e-3)
    # The pitfall: a plain argmax after the noise sends the strategy nothing.
    hard_grad = through(lambda a: jax.nn.one_hot(jnp.argmax(a + gumbel, -1), 2))
    np.testing.assert_array_equal(hard_grad, 0.0)


def test_strategy_pinned_to_global_loads_the_received_model_and_trains_as_fedavg(
        cnn, algorithm, update, images_small):
    reference = fedavg(cnn, FedAvgConfig(sgd=SGDConfig(**SGD)))
    received = algorithm.init(jax.random.key(0))
    previous = cnn.init(jax.random.key(7))
    pinned = _pinned(cnn.num_layers, use_global=True)

    use_global = sample_use_global(pinned, jax.random.key(11))
    assert bool(jnp.all(use_global))
    assert_trees_equal(load_layers(cnn, received, previous, use_global), received)

    client = _client(images_small, 1, padded_examples=32)
    state = {"layers": previous, "logits": pinned, "visited": jnp.asarray(True)}
    result = update(received, client, jax.random.key(1), state)
    expected = jax.jit(reference.client_update)(received, client, jax.random.key(1))
    assert_trees_equal(result.params, expected.params)
    np.testing.assert_array_equal(result.client_state["logits"], pinned)
    assert_trees_equal(result.client_state["layers"], result.params)
    assert float(result.metrics["global_layer_share_sum"]) == cnn.num_layers


def test_a_copy_left_unloaded_keeps_its_momentum_bit_for_bit(mlp):
    """The weight step updates the optimizer over both copies; a copy this step does not
    load gets a zero gradient, under which SGD momentum would still decay (0.9 x buffer).
    Its buffer stays as it was; the loaded copies' are this step's."""
    copies = {"global": mlp.init(jax.random.key(0)), "previous": mlp.init(jax.random.key(1))}
    optimizer = client_optimizer(0.1, momentum=0.9)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), copies)
    _, before = optimizer.update(grads, optimizer.init(copies), copies)
    _, after = optimizer.update(jax.tree.map(jnp.zeros_like, copies), before, copies)
    use_global = jnp.arange(mlp.num_layers) % 2 == 0
    kept = keep_unloaded_state(optimizer, after, before, loaded_copies(mlp, copies, use_global))
    for j, name in enumerate(mlp.layer_names):
        for copy, loaded in (("global", bool(use_global[j])), ("previous", not use_global[j])):
            source = after if loaded else before
            assert_trees_equal(kept[0].trace[copy][name], source[0].trace[copy][name])
            assert differs(before[0].trace[copy][name], after[0].trace[copy][name])


def test_strategy_pinned_to_previous_ignores_the_received_model(cnn, update, images_small):
    previous = cnn.init(jax.random.key(7))
    state = {"layers": previous, "logits": _pinned(cnn.num_layers, use_global=False),
             "visited": jnp.asarray(True)}
    client = _client(images_small, 1, padded_examples=32)
    a = update(cnn.init(jax.random.key(0)), client, jax.random.key(1), state)
    b = update(cnn.init(jax.random.key(5)), client, jax.random.key(1), state)
    assert_trees_equal(a.params, b.params)
    assert differs(a.params, previous)  # it trained the previous layers
    assert float(a.metrics["global_layer_share_sum"]) == 0.0


def test_a_round_moves_the_strategy_and_stores_the_sent_model(cnn, algorithm, update, images_small):
    params = algorithm.init(jax.random.key(0))
    state = algorithm.init_client_state(params)
    assert_trees_equal(state["layers"], params)
    np.testing.assert_array_equal(state["logits"], np.zeros((cnn.num_layers, 2)))
    # A previous model unlike the global one, so the two choices differ in loss.
    state = {**state, "layers": cnn.init(jax.random.key(7)), "visited": jnp.asarray(True)}
    client = _client(images_small, 2, padded_examples=32)
    result = update(params, client, jax.random.key(1), state)
    assert np.all(np.abs(np.asarray(result.client_state["logits"])) > 0)
    assert_trees_equal(result.client_state["layers"], result.params)
    assert float(result.weight) == float(client.num_examples)
    assert np.isfinite(float(result.metrics["loss_sum"]))


def test_a_first_time_client_has_the_received_model_as_its_previous_one(
        cnn, algorithm, update, images_small):
    """Before its first round a client has no model of its own: both copies start at the
    received params (not the template ``init_client_state`` holds), so no untrained layer
    can be loaded and sent; an empty client keeps its state bit for bit."""
    received = algorithm.init(jax.random.key(0))
    fresh = algorithm.init_client_state(cnn.init(jax.random.key(7)))  # a template unlike it
    assert not bool(fresh["visited"])
    client = _client(images_small, 2, padded_examples=32)
    first = update(received, client, jax.random.key(1), fresh)
    as_if_received = update(received, client, jax.random.key(1),
                            {**fresh, "layers": received, "visited": jnp.asarray(True)})
    assert_trees_equal(first.params, as_if_received.params)
    assert_trees_equal(first.client_state["layers"], first.params)
    assert bool(first.client_state["visited"])
    # Against the template as the previous model, the same client trains otherwise.
    templated = update(received, client, jax.random.key(1), {**fresh, "visited": jnp.asarray(True)})
    assert differs(templated.params, first.params)
    empty = client.replace(mask=jnp.zeros_like(client.mask),
                           num_examples=jnp.zeros_like(client.num_examples))
    for state in (fresh, first.client_state):
        kept = update(received, empty, jax.random.key(1), state).client_state
        assert_trees_equal(kept, state)


def test_strategy_step_is_sgd_on_the_straight_through_routed_loss(mlp, images_small):
    """One batch, one epoch: the stored logits are a0 - lr_s grad_a CE(routed) where layer
    j's output mixes global (choice index 0) and previous by the straight-through sample
    drawn with the step's noise key (run_epochs' step 0 of epoch 0), recomputed here."""
    config = dict(CONFIG, sgd=SGDConfig(learning_rate=0.05, epochs=1, batch_size=4))
    algorithm = partialfed(mlp, PartialFedConfig(**config))
    params = algorithm.init(jax.random.key(0))
    previous = mlp.init(jax.random.key(7))
    a0 = jax.random.normal(jax.random.key(3), (mlp.num_layers, 2))
    state = {**algorithm.init_client_state(params), "layers": previous, "logits": a0,
             "visited": jnp.asarray(True)}
    client = _client(images_small, 2, padded_examples=4)
    key = jax.random.key(1)
    result = jax.jit(algorithm.client_update)(params, client, key, state)

    step_key = jax.random.fold_in(jax.random.fold_in(key, 0), 0)
    x, y = client.x[0], client.y[0]

    def loss(a):
        choice = straight_through_choice(a, jax.random.fold_in(step_key, _STRATEGY_NOISE), 1.0)
        q0 = jnp.broadcast_to(choice[:, 0], (x.shape[0], mlp.num_layers))
        logits = routed_forward(mlp, params, previous, q0, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))

    expected = a0 - CONFIG["strategy_learning_rate"] * jax.grad(loss)(a0)
    np.testing.assert_allclose(result.client_state["logits"], expected, rtol=2e-6, atol=1e-7)
    assert not np.array_equal(expected, a0)


def test_personal_model_is_the_argmax_mix_of_the_trained_copies(cnn, algorithm, update,
                                                                images_small):
    params = algorithm.init(jax.random.key(0))
    state = {**algorithm.init_client_state(params), "layers": cnn.init(jax.random.key(7)),
             "visited": jnp.asarray(True)}
    client = _client(images_small, 2, padded_examples=32)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), state)
    trained = update(params, client, jax.random.key(2), state)
    assert_trees_equal(personal["params"], trained.params)
    expected_choice = jnp.argmax(trained.client_state["logits"], -1) == 0
    np.testing.assert_array_equal(personal["use_global"], expected_choice.astype(jnp.float32))
    x = client.x[0]
    predictions = algorithm.predict(params, personal, x)
    assert predictions.q0.shape == (x.shape[0], cnn.num_layers)
    np.testing.assert_array_equal(predictions.personal_hard, predictions.personal_soft)


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^temperature=0.0: expected a finite number > 0$"):
        PartialFedConfig(**{**CONFIG, "temperature": 0.0})
    with pytest.raises(ValueError,
                       match=r"^strategy_learning_rate=-1: expected a finite number > 0$"):
        PartialFedConfig(**{**CONFIG, "strategy_learning_rate": -1})
    with pytest.raises(ValueError, match=r"^epochs=0: expected an integer >= 1$"):
        SGDConfig(**{**SGD, "epochs": 0})
    with pytest.raises(ValueError, match=r"^momentum=1.0: expected a number in \[0, 1\)$"):
        SGDConfig(**SGD, momentum=1.0)


def test_run_trains_evaluates_and_returns_each_client_its_layers_and_strategy():
    result = check_state_round_trip("partialfed")
    train = [h for h in result.history if h["kind"] == "train"]
    assert all(np.isfinite(h["loss"]) for h in train)
    assert all(0 <= h["global_layer_share"] <= 1 for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    assert set(result.summaries) == {"train_clients", "held_out_clients"}
