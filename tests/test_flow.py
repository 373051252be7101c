"""Flow's client update through the public algorithm API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.flow import FlowConfig, flow, half_capacity, split_halves
from flowjax.models.base import forward
from flowjax.routing.policy import build_policy
from flowjax.routing.routed import routed_forward
from tests.helpers import one_client, products

CONFIG = dict(sgd=SGDConfig(learning_rate=0.05, epochs=1, batch_size=4), routing_epochs=2,
              gamma=0.01, policy_hidden=(16, 16, 16, 16))



def _client(task, index, padded_examples, batch_size=4):
    return one_client(task, index, padded_examples, batch_size)


def _algorithm(model, task, **overrides):
    # One policy width per routed layer: the CNN's four, the two-layer MLP's two.
    x = jnp.asarray(task.train.client(0, "train")["x"][:4])
    widths = {"policy_hidden": (16,) * model.num_layers}
    return flow(model, FlowConfig(**{**CONFIG, **widths, **overrides}), x)


def test_split_halves_are_disjoint_and_cover_the_client():
    valid = jnp.arange(20) < 13
    zeta_l, zeta_g = split_halves(jax.random.key(0), valid, 0.5)
    assert not np.any(zeta_l & zeta_g)
    np.testing.assert_array_equal(zeta_l | zeta_g, valid)
    assert int(zeta_l.sum()) == 6 and int(zeta_g.sum()) == 7
    other_l, _ = split_halves(jax.random.key(1), valid, 0.5)
    assert not np.array_equal(zeta_l, other_l)


@pytest.mark.parametrize("ratio, sizes", [(0.25, (1, 4, 8, 13)), (0.5, (1, 4, 8, 13)),
                                          (0.75, (1, 4, 8, 13)),
                                          (0.7, (90,))])  # float32's 90 x 0.7 floors to 63
def test_half_capacity_bounds_every_client_size(ratio, sizes):
    for padded in sizes:
        local_cap, global_cap = half_capacity(padded, ratio)
        for n in range(padded + 1):
            zeta_l, zeta_g = split_halves(jax.random.key(n), jnp.arange(padded) < n, ratio)
            assert int(zeta_l.sum()) <= local_cap and int(zeta_g.sum()) <= global_cap


def test_tiny_client_uses_all_its_data_for_both_halves():
    zeta_l, zeta_g = split_halves(jax.random.key(0), jnp.arange(8) < 1, 0.5)
    np.testing.assert_array_equal(zeta_l, zeta_g)
    assert int(zeta_g.sum()) == 1


# The Flow tests below use the two-layer MLP: what they check is Flow's update, not the
# model, and the CNN's compilations took most of this file's time. The padding test keeps
# the CNN, whose dropout draws must not depend on the padding either.
def test_one_example_client_trains_without_error(mlp, images_small):
    algorithm = _algorithm(mlp, images_small)
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small, 0, padded_examples=8)
    one = client.replace(mask=jnp.arange(8).reshape(2, 4) < 1, num_examples=jnp.int32(1))
    result = jax.jit(algorithm.client_update)(params, one, jax.random.key(1))
    assert float(result.weight) == 1.0
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), result.params["global"], params["global"])
    assert any(jax.tree.leaves(changed))


def _mean_q0(algorithm, params, client):
    personal = algorithm.personalize(params, client, jax.random.key(2))
    return float(jnp.mean(algorithm.predict(params, personal, client.x[0]).q0))


def test_regularizer_raises_q0(mlp, images_small):
    client = _client(images_small, 1, padded_examples=32)
    start = _algorithm(mlp, images_small).init(jax.random.key(0))
    q0 = {}
    for gamma in (0.0, 1.0):
        algorithm = _algorithm(mlp, images_small, gamma=gamma, routing_epochs=3)
        q0[gamma] = _mean_q0(algorithm, start, client)
    assert q0[1.0] > q0[0.0] + 0.01, q0


def test_policy_step_descends_the_papers_regularized_objective(mlp, images_small):
    # One batch of 4, no split, one routing epoch, no policy dropout: the trained policy is
    # psi - lr grad_psi [mean_i CE_i(routed) - gamma mean_i (1/L) sum_j log q0_ij], at the
    # received global branch and the local branch the K1 phase trained (personalize returns
    # that branch: it is frozen while routing). Recomputed here with the public pieces.
    gamma, lr = 0.5, CONFIG["sgd"].learning_rate
    x0 = jnp.asarray(images_small.train.client(0, "train")["x"][:4])
    algorithm = _algorithm(mlp, images_small, gamma=gamma, halves="none", routing_epochs=1,
                           policy_dropout=0.0)
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small, 1, padded_examples=4)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(1))
    policy = build_policy(mlp, x0, (16,) * mlp.num_layers, dropout_rate=0.0)
    x, y = client.x[0], client.y[0]

    def objective(psi):
        log_q0 = policy.log_probs(psi, x)[..., 0]
        logits = routed_forward(mlp, params["global"], personal["local"], jnp.exp(log_q0), x)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1)[:, 0]
        return jnp.mean(ce) - gamma * jnp.mean(jnp.sum(log_q0, axis=-1) / mlp.num_layers)

    grads = jax.grad(objective)(params["policy"])
    expected = jax.tree.map(lambda p, g: p - lr * g, params["policy"], grads)
    for got, want in zip(jax.tree.leaves(personal["policy"]), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(expected),
                                                        jax.tree.leaves(params["policy"])))


def test_global_step_routes_with_the_policy_just_updated(mlp, images_small):
    # Eq. 4 / Algorithm 1: on each batch the global branch steps on CE(routed) with the
    # policy psi^{r+1} of that batch's policy step, not the one it received. One batch of
    # 4, no split, one routing epoch, no policy dropout; recomputed with the public pieces.
    lr = CONFIG["sgd"].learning_rate
    x0 = jnp.asarray(images_small.train.client(0, "train")["x"][:4])
    algorithm = _algorithm(mlp, images_small, gamma=0.5, halves="none", routing_epochs=1,
                           policy_dropout=0.0)
    params = algorithm.init(jax.random.key(0))
    client, key = _client(images_small, 1, padded_examples=4), jax.random.key(1)
    personal = jax.jit(algorithm.personalize)(params, client, key)  # its local and policy
    sent = jax.jit(algorithm.client_update)(params, client, key).params
    for got, want in zip(jax.tree.leaves(sent["policy"]), jax.tree.leaves(personal["policy"])):
        np.testing.assert_array_equal(got, want)
    policy = build_policy(mlp, x0, (16,) * mlp.num_layers, dropout_rate=0.0)
    x, y = client.x[0], client.y[0]

    def global_after_step(psi):
        q0 = jnp.exp(policy.log_probs(psi, x)[..., 0])

        def mean_ce(global_params):
            logits = routed_forward(mlp, global_params, personal["local"], q0, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))
        grads = jax.grad(mean_ce)(params["global"])
        return jax.tree.map(lambda p, g: p - lr * g, params["global"], grads)

    expected, with_old_policy = (global_after_step(psi) for psi in (sent["policy"],
                                                                   params["policy"]))
    for got, want in zip(jax.tree.leaves(sent["global"]), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    # The check can tell the two policies apart: the received one gives another step.
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(expected), jax.tree.leaves(with_old_policy)))
    assert gap > 1e-4, gap


@pytest.mark.parametrize("order", ["alternating", "policy_first", "global_first"])
def test_each_training_order_moves_global_and_policy(mlp, images_small, order):
    algorithm = _algorithm(mlp, images_small, order=order)
    params = algorithm.init(jax.random.key(0))
    result = jax.jit(algorithm.client_update)(params, _client(images_small, 1, 32), jax.random.key(1))
    for part in ("global", "policy"):
        moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), result.params[part], params[part])
        assert any(jax.tree.leaves(moved)), (order, part)
    assert np.isfinite(float(result.metrics["loss_sum"]))


@pytest.mark.parametrize("order", ["policy_first", "global_first"])
def test_the_logged_loss_is_the_global_steps_under_every_order(mlp, images_small, order):
    # global_first's global phase runs before the policy moves, so its loss cannot depend
    # on gamma; it once logged the policy phase's objective, regularizer included.
    # policy_first's global phase follows a policy that gamma trained, so it does.
    client, key = _client(images_small, 1, 32), jax.random.key(1)
    losses = []
    for gamma in (0.01, 0.5):
        algorithm = _algorithm(mlp, images_small, order=order, gamma=gamma)
        metrics = jax.jit(algorithm.client_update)(algorithm.init(jax.random.key(0)), client,
                                                   key).metrics
        losses.append((float(metrics["loss_sum"]), float(metrics["loss_count"])))
    assert losses[0][1] == losses[1][1] > 0
    assert (losses[0][0] == losses[1][0]) == (order == "global_first"), losses


def test_phases_train_on_their_own_half_and_the_weight_is_zeta_g(mlp, images_small):
    # 13 real examples at ratio 0.3: |zeta_l| = floor(13 * 0.3) = 3, |zeta_g| = 10. The
    # loss counts are examples seen: K1 epochs over zeta_l, K2 over zeta_g.
    algorithm = _algorithm(mlp, images_small, split_ratio=0.3, local_epochs=2, routing_epochs=3)
    client = _client(images_small, 1, padded_examples=16)
    client = client.replace(mask=jnp.arange(16).reshape(4, 4) < 13, num_examples=jnp.int32(13))
    result = jax.jit(algorithm.client_update)(algorithm.init(jax.random.key(0)), client,
                                              jax.random.key(1))
    assert float(result.weight) == 10.0
    assert float(result.metrics["local_loss_count"]) == 2 * 3
    assert float(result.metrics["loss_count"]) == 3 * 10


def test_policy_first_trains_the_policy_before_the_global_branch_moves(mlp, images_small):
    # Under policy_first the policy's K2 epochs end before the global step runs, so how
    # the global branch is then trained cannot change the policy; under alternating it does.
    client, key = _client(images_small, 1, 32), jax.random.key(1)
    policies = {}
    for order in ("policy_first", "alternating", "global_first"):
        for global_step in ("routed", "global_only"):
            algorithm = _algorithm(mlp, images_small, order=order, global_step=global_step)
            params = algorithm.init(jax.random.key(0))
            policies[order, global_step] = jax.jit(algorithm.client_update)(
                params, client, key).params["policy"]

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    assert same(policies["policy_first", "routed"], policies["policy_first", "global_only"])
    assert not same(policies["alternating", "routed"], policies["alternating", "global_only"])
    orders = [policies[order, "routed"] for order in ("policy_first", "alternating",
                                                       "global_first")]
    assert not any(same(a, b) for i, a in enumerate(orders) for b in orders[i + 1:])


@pytest.mark.parametrize("fixed_q0", [0.3, 0.1])
def test_soft_prediction_mixes_at_q0_and_hard_takes_the_local_branch_below_one_half(
        mlp, images_small, fixed_q0):
    algorithm = _algorithm(mlp, images_small, fixed_q0=fixed_q0)
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small, 1, 32)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(1))
    x = client.x[0]
    predictions = jax.jit(algorithm.predict)(params, personal, x)
    # The q0 it routes with is the constant itself (float32 exp(log(0.1)) is 0.09999999).
    np.testing.assert_array_equal(predictions.q0, np.float32(fixed_q0))
    soft = jax.jit(lambda g, l, q0, x: routed_forward(mlp, g, l, q0, x))(
        personal["global"], personal["local"], predictions.q0, x)
    np.testing.assert_array_equal(predictions.personal_soft, soft)
    np.testing.assert_array_equal(predictions.personal_hard,
                                  jax.jit(lambda p, x: forward(mlp, p, x))(personal["local"], x))
    assert not np.array_equal(predictions.personal_soft, predictions.personal_hard)


def test_global_only_step_is_independent_of_the_policy(mlp, images_small):
    # The authors' global step trains the global branch alone, so the policy it starts
    # from cannot change the global update; the paper's routed step depends on it.
    client = _client(images_small, 1, 32)
    for global_step, independent in (("global_only", True), ("routed", False)):
        algorithm = _algorithm(mlp, images_small, global_step=global_step)
        params = algorithm.init(jax.random.key(0))
        other = {**params, "policy": algorithm.init(jax.random.key(9))["policy"]}
        update = jax.jit(algorithm.client_update)
        a = update(params, client, jax.random.key(1)).params["global"]["fc2"]["kernel"]
        b = update(other, client, jax.random.key(1)).params["global"]["fc2"]["kernel"]
        assert np.array_equal(a, b) == independent, global_step


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^split_ratio=1.0: expected a number in \(0, 1\)$"):
        FlowConfig(**{**CONFIG, "split_ratio": 1.0})
    with pytest.raises(ValueError, match=r"^order='random': expected one of \['alternating', "):
        FlowConfig(**{**CONFIG, "order": "random"})
    with pytest.raises(ValueError, match=r"^gamma=-1.0: expected a finite number >= 0$"):
        FlowConfig(**{**CONFIG, "gamma": -1.0})
    # K1 and K2 default to the SGD's epochs.
    assert FlowConfig(**{**CONFIG, "routing_epochs": None}).routing_epochs == 1


def test_fixed_q0_one_routes_everything_to_the_global_branch(mlp, images_small):
    algorithm = _algorithm(mlp, images_small, fixed_q0=1.0)
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small, 1, 32)
    personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(1))
    x = client.x[0]
    predict = jax.jit(algorithm.predict)
    plain = jax.jit(lambda p, x: forward(mlp, p, x))
    predictions = predict(params, personal, x)
    np.testing.assert_array_equal(predictions.q0, 1.0)
    expected = plain(personal["global"], x)
    np.testing.assert_array_equal(predictions.personal_hard, expected)
    np.testing.assert_array_equal(predictions.personal_soft, expected)
    # The policy is never trained under a fixed policy.
    for a, b in zip(jax.tree.leaves(personal["policy"]), jax.tree.leaves(params["policy"])):
        np.testing.assert_array_equal(a, b)


def test_pi_flow_routes_between_two_global_copies(mlp, images_small):
    algorithm = _algorithm(mlp, images_small, local_route="global")
    params = algorithm.init(jax.random.key(0))
    personal = jax.jit(algorithm.personalize)(params, _client(images_small, 1, 32), jax.random.key(1))
    for a, b in zip(jax.tree.leaves(personal["local"]), jax.tree.leaves(params["global"])):
        np.testing.assert_array_equal(a, b)


# -m slow (19 s): test_routing checks the fused routed model's logits and every gradient
# in CI; this one a whole client update and its predictions.
@pytest.mark.slow
def test_fused_branches_train_and_predict_the_same_model_to_float32_rounding(cnn, images_small):
    """``fuse_branches``: Flow's routed steps and predictions run the CNN's convolutions
    for both branches at once; one client update (a routed policy and global step after a
    local step) and its predictions agree with the unfused ones within 1e-5 of the largest
    entry of each parameter group (global, policy) and of each prediction (bit for bit
    under some XLA flags), while the update runs fewer matrix products (the convolutions'
    fused ones). Per group, not per array: the
    policy's gradient runs through the difference of two branches one local step apart,
    so its exit biases (about 7e-5 after the step) differ by 4e-5 of their own size."""
    config = dict(sgd=SGDConfig(learning_rate=0.05, epochs=1, batch_size=8), gamma=0.01,
                  policy_hidden=(16,) * cnn.num_layers)
    x = jnp.asarray(images_small.train.client(0, "train")["x"][:8])
    client = _client(images_small, 1, 16, batch_size=8)
    results = []
    for fuse in (False, True):
        algorithm = flow(cnn, FlowConfig(**config, fuse_branches=fuse), x)
        params = algorithm.init(jax.random.key(0))
        update = jax.jit(algorithm.client_update)(params, client, jax.random.key(1))
        personal = jax.jit(algorithm.personalize)(params, client, jax.random.key(1))
        predictions = jax.jit(algorithm.predict)(params, personal, x)
        results.append([*update.params.values(), *jax.tree.leaves(predictions)])
    separate, fused = results
    assert len(separate) == 2 + 4  # global and policy; four predictions (no snapshot)
    for tree_a, tree_b in zip(separate, fused, strict=True):
        scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(tree_a))
        for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale)
    counts = [products(flow(cnn, FlowConfig(**config, fuse_branches=fuse), x).client_update,
                       params, client, jax.random.key(1)) for fuse in (False, True)]
    assert counts[1] < counts[0], counts


def test_fuse_branches_is_a_boolean():
    with pytest.raises(ValueError, match=r"^fuse_branches='yes': expected one of \[None, False, True\]$"):
        FlowConfig(**{**CONFIG, "fuse_branches": "yes"})
