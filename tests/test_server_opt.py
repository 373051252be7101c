"""Server optimizers against Reddi et al. (2021), Algorithm 2, recomputed by hand in numpy.

Each test runs two server steps with ``apply_server_update`` (the engine's call) and
compares with the paper's recursion written out below in float64:

    Delta = client mean - x;  m = b1 m + (1 - b1) Delta
    Adam: v = b2 v + (1 - b2) Delta^2;  Yogi: v = v - (1 - b2) Delta^2 sign(v - Delta^2)
    Adagrad: v = v + Delta^2;  x = x + lr m / (sqrt(v) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper), or, with bias correction, both
moments from 0 and ``m / (1 - b1^t)``, ``v / (1 - b2^t)`` (``v`` uncorrected for Adagrad).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax.core.server_opt import ClientMean, apply_server_update, server_optimizer

LR, B1, B2, TAU = 0.1, 0.9, 0.99, 1e-3
X0 = np.array([0.0, 0.5, -0.25, 2.0])
MEANS = [np.array([1.0, -1.0, 0.5, 2.0]), np.array([0.5, 0.0, -3.0, 1.0])]


def by_hand(kind: str, bias_correction: bool) -> list[np.ndarray]:
    """The server params after each step, following Algorithm 2 literally."""
    x = X0.copy()
    m = np.zeros_like(x)
    v = np.zeros_like(x) if bias_correction else np.full_like(x, TAU ** 2)
    out = []
    for t, mean in enumerate(MEANS, start=1):
        delta = mean - x
        m = B1 * m + (1 - B1) * delta
        if kind == "adam":
            v = B2 * v + (1 - B2) * delta ** 2
        elif kind == "yogi":
            v = v - (1 - B2) * delta ** 2 * np.sign(v - delta ** 2)
        else:
            v = v + delta ** 2
        m_hat, v_hat = m, v
        if bias_correction:
            m_hat = m / (1 - B1 ** t)
            if kind != "adagrad":
                v_hat = v / (1 - B2 ** t)
        x = x + LR * m_hat / (np.sqrt(v_hat) + TAU)
        out.append(x.copy())
    return out


def by_code(kind: str, bias_correction: bool, params_of=lambda x: {"w": x}, optimizer=None):
    if optimizer is None:
        optimizer = server_optimizer(kind, LR, b1=B1, b2=B2, eps=TAU,
                                     bias_correction=bias_correction)
    params = params_of(jnp.asarray(X0, jnp.float32))
    state = optimizer.init(params)
    out = []
    for mean in MEANS:
        params, state = apply_server_update(optimizer, params, state,
                                            params_of(jnp.asarray(mean, jnp.float32)))
        out.append(params)
    return out, state


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_two_steps_match_algorithm_2_by_hand(kind, bias_correction):
    got, _ = by_code(kind, bias_correction)
    for step, (params, want) in enumerate(zip(got, by_hand(kind, bias_correction))):
        np.testing.assert_allclose(params["w"], want, rtol=2e-6, atol=1e-6,
                                   err_msg=f"{kind} step {step + 1}")


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_a_configs_adaptive_server_is_algorithm_2_as_published(kind):
    """``config.server`` left at its defaults but for the optimizer (and the test's
    constants) runs the paper's recursion, without Adam's bias correction."""
    from configs import emnist
    from flowjax.config import build_server_optimizer
    config = emnist.get_config("paper")
    config.server.update(optimizer=kind, learning_rate=LR, b1=B1, b2=B2, eps=TAU)
    got, _ = by_code(kind, None, optimizer=build_server_optimizer(config))
    for step, (params, want) in enumerate(zip(got, by_hand(kind, bias_correction=False))):
        np.testing.assert_allclose(params["w"], want, rtol=2e-6, atol=1e-6,
                                   err_msg=f"{kind} step {step + 1}")


def test_the_papers_initialization_is_v_equal_tau_squared():
    # First Yogi step on a coordinate with Delta^2 < tau^2: sign(v - Delta^2) = +1, so v
    # shrinks from tau^2; from v = 0 (or optax's 1e-6) the step would differ.
    optimizer = server_optimizer("yogi", LR, b1=B1, b2=B2, eps=TAU, bias_correction=False)
    params = {"w": jnp.zeros(1)}
    delta = 5e-4
    new, state = apply_server_update(optimizer, params, optimizer.init(params),
                                     {"w": jnp.full(1, delta)})
    v = TAU ** 2 - (1 - B2) * delta ** 2
    m = (1 - B1) * delta
    np.testing.assert_allclose(state["w"][0].v, [v], rtol=1e-6)
    np.testing.assert_allclose(new["w"], [LR * m / (np.sqrt(v) + TAU)], rtol=1e-6)


def test_bias_corrected_adam_is_optax_adam():
    got, _ = by_code("adam", True)
    reference = optax.adam(LR, b1=B1, b2=B2, eps=TAU)
    params = {"w": jnp.asarray(X0, jnp.float32)}
    state = reference.init(params)
    for mean, ours in zip(MEANS, got):
        params, state = apply_server_update(reference, params, state,
                                            {"w": jnp.asarray(mean, jnp.float32)})
        np.testing.assert_allclose(ours["w"], params["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["sgd", "adam", "yogi", "adagrad"])
def test_a_group_without_clients_neither_moves_nor_changes_its_state(kind):
    # Group "b" gets a real step, then a round in which nobody trained it (the engine hands
    # it a zero pseudo-gradient): with momentum it would keep moving; here it stays put
    # and its optimizer state is exactly what it was, while group "a" steps as usual.
    optimizer = server_optimizer(kind, LR, momentum=0.9, b1=B1, b2=B2, eps=TAU)
    params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    state = optimizer.init(params)
    params, state = apply_server_update(optimizer, params, state,
                                        {"a": jnp.ones(3), "b": jnp.ones(2)})
    b_params, b_state = np.asarray(params["b"]), state["b"]
    params, state = apply_server_update(optimizer, params, state,
                                        {"a": jnp.full(3, 2.0), "b": params["b"]})
    np.testing.assert_array_equal(params["b"], b_params)
    for new, old in zip(jax.tree.leaves(state["b"]),
                        jax.tree.leaves(b_state)):
        np.testing.assert_array_equal(new, old)
    # The trained group's own optimizer counts its own steps.
    if kind != "sgd":
        assert int(state["a"][0].count) == 2 and int(state["b"][0].count) == 1


def test_a_client_mean_group_becomes_the_clients_mean_exactly_under_any_optimizer():
    optimizer = server_optimizer("adam", LR, b1=B1, b2=B2, eps=TAU)
    params = {"body": jnp.zeros(2), "report": ClientMean(jnp.array([0.3, 7.0]))}
    state = optimizer.init(params)
    mean = {"body": jnp.ones(2), "report": ClientMean(jnp.array([0.1, -2.5]))}
    for _ in range(2):
        params, state = apply_server_update(optimizer, params, state, mean)
        np.testing.assert_array_equal(params["report"].value, mean["report"].value)
    assert isinstance(state["report"], optax.EmptyState)
