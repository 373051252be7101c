"""APFL's update rule, its personalized model, and its client state through the engine."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.apfl import APFLConfig, apfl, mix_params
from flowjax.algorithms.base import plain_loss_sums
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.losses import mean_from_sums
from tests.helpers import assert_trees_equal, check_state_round_trip, one_client

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))


def _visited(v):
    """The state of a client that has trained before, with personal model ``v``."""
    return {"v": v, "visited": jnp.asarray(True)}



def test_alpha_zero_makes_the_personal_model_the_local_global_model(cnn, images_small):
    algorithm = apfl(cnn, APFLConfig(**CONFIG, alpha=0.0))
    fedavg_ft = fedavg(cnn, FedAvgConfig(**CONFIG, finetune=True))
    params = algorithm.init(jax.random.key(0))
    stored = _visited(cnn.init(jax.random.key(3)))
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
    algorithm = apfl(mlp, APFLConfig(sgd=SGDConfig(learning_rate=lr, epochs=1, batch_size=32),
                                     alpha=alpha))
    w = mlp.init(jax.random.key(0))
    v = mlp.init(jax.random.key(1))
    client = one_client(images_small, 1, padded_examples=32, batch_size=32)  # one minibatch
    result = algorithm.client_update(w, client, jax.random.key(2), _visited(v))

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
    stored = _visited(mlp.init(jax.random.key(3)))
    client = one_client(images_small, 2, padded_examples=32)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(2), stored)
    local_w = jax.jit(fedavg_ft.personalize)(params, client, jax.random.key(2))
    for a, b in zip(jax.tree.leaves(personal),
                    jax.tree.leaves(mix_params(0.3, stored["v"], local_w))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_empty_client_keeps_its_state_and_stays_unvisited(mlp, images_small):
    algorithm = apfl(mlp, APFLConfig(**CONFIG, alpha=0.3))
    params = algorithm.init(jax.random.key(0))
    client = one_client(images_small, 1, padded_examples=8)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    for stored in (algorithm.init_client_state(params), _visited(mlp.init(jax.random.key(3)))):
        result = jax.jit(algorithm.client_update)(params, empty, jax.random.key(1), stored)
        assert_trees_equal(result.client_state, stored)
        assert float(result.weight) == 0.0


def test_a_client_that_never_trained_starts_v_from_the_current_global_model(mlp, images_small):
    # The engine creates every client's state from the *initial* server params; later,
    # with the server at w_t, neither the first update nor the personalized model of a
    # never-trained client may depend on that state's values (no random init in vbar).
    algorithm = apfl(mlp, APFLConfig(**CONFIG, alpha=0.3))
    fresh = algorithm.init_client_state(algorithm.init(jax.random.key(0)))
    assert not bool(fresh["visited"])
    w_t = mlp.init(jax.random.key(9))  # the current global model, not the initial one
    other = dict(fresh, v=mlp.init(jax.random.key(4)))  # same flag, other template values
    client = one_client(images_small, 2, padded_examples=32)
    update = jax.jit(algorithm.client_update)
    first = update(w_t, client, jax.random.key(1), fresh)
    assert_trees_equal(first.client_state["v"],
                       update(w_t, client, jax.random.key(1), _visited(w_t)).client_state["v"])
    assert_trees_equal(first.client_state, update(w_t, client, jax.random.key(1), other).client_state)
    assert bool(first.client_state["visited"])

    personalize = jax.jit(algorithm.personalize)
    personal = personalize(w_t, client, jax.random.key(2), fresh)
    assert_trees_equal(personal, personalize(w_t, client, jax.random.key(2), other))
    # ... as at a first participation: vbar of the APFL update from w = v = w_t.
    at_first = update(w_t, client, jax.random.key(2), fresh)
    expected = mix_params(0.3, at_first.client_state["v"], at_first.params)
    for a, b in zip(jax.tree.leaves(personal), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^alpha=1.5: expected a number in \[0, 1\]$"):
        APFLConfig(**CONFIG, alpha=1.5)
    with pytest.raises(ValueError, match=r"^epochs=0: expected an integer >= 1$"):
        SGDConfig(**{**SGD, "epochs": 0})


def test_run_trains_evaluates_and_returns_each_client_its_own_state():
    result = check_state_round_trip("apfl")
    train = [h for h in result.history if h["kind"] == "train"]
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["personal_loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    assert set(result.summaries) == {"train_clients", "held_out_clients"}


def test_personalize_costs_one_apfl_update_even_under_vmap(mlp, images_small):
    # The evaluation vmaps personalize on accelerators, where a lax.cond on "visited"
    # runs both branches: a FedAvgFT pass of w for visited clients and the APFL update
    # for the others trained w twice. One pass of the w steps serves both cases, so the
    # vmapped personalization has exactly the matmuls of one vmapped client update.
    algorithm = apfl(mlp, APFLConfig(**CONFIG, alpha=0.3))
    params = algorithm.init(jax.random.key(0))
    clients = [one_client(images_small, i, padded_examples=32) for i in (1, 2)]
    cohort = jax.tree.map(lambda *a: jnp.stack(a), *clients)
    keys = jax.random.split(jax.random.key(1), 2)
    states = jax.tree.map(lambda *a: jnp.stack(a), _visited(mlp.init(jax.random.key(3))),
                          algorithm.init_client_state(params))

    def matmuls(fn):
        vmapped = jax.jit(jax.vmap(lambda *a: fn(params, *a)))
        return vmapped.lower(cohort, keys, states).as_text().count("dot_general")

    assert matmuls(algorithm.personalize) == matmuls(algorithm.client_update)


def test_run_forecasts_its_client_state_memory_and_warns_past_the_host(tmp_path, capsys,
                                                                        monkeypatch):
    from flowjax import runner
    from flowjax.core import client_state
    from flowjax.core.client_state import expected_clients
    from tests.helpers import small_synthetic_config
    config = small_synthetic_config(algorithm="apfl", num_rounds=2, checkpoint_every=0)
    runner.run_config_to_workdir(config, str(tmp_path / "a"), progress=False)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("client states"))
    # APFL's state is v: one copy of the MLP's params (60-64-64-10, float32).
    params = 60 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    clients = expected_clients(12, 4, 2)
    assert line.startswith(f"client states: {params * 4 / 2**20:,.2f} MiB per client that "
                           f"trains, about {clients:,.0f} of the 12 training clients")
    # Past the host's memory it is a warning, kept in run.json.
    monkeypatch.setattr(client_state, "host_memory_bytes", lambda: params * 4 * 5)
    runner.run_config_to_workdir(config, str(tmp_path / "b"), progress=False)
    assert "the run may run out of memory before its last round" in capsys.readouterr().err
    info = json.loads((tmp_path / "b" / "run.json").read_text())
    assert any("this host has 0.0 GiB" in w for w in info["warnings"])
