"""launch/sensitivity.py: the nudge it gives the weights, and (slow) one measurement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import sensitivity


def test_the_nudge_is_a_relative_change_of_at_most_the_perturbation_on_every_weight():
    params = {"a": jnp.linspace(-3.0, 3.0, 1001), "b": {"c": jnp.full((7, 5), 0.25)}}
    nudged = sensitivity.nudge(params, jax.random.key(0))
    before = np.concatenate([np.ravel(a) for a in jax.tree.leaves(params)]).astype(np.float64)
    after = np.concatenate([np.ravel(a) for a in jax.tree.leaves(nudged)]).astype(np.float64)
    relative = np.abs(after[before != 0] / before[before != 0] - 1)
    # float32 rounds 1 + 1e-6 u and the product: up to about two ulps more.
    assert relative.max() <= sensitivity.PERTURBATION + 2 * np.finfo(np.float32).eps
    # Most weights move (not all: where |u| < 0.06, 1 + 1e-6 u rounds to 1 in float32).
    assert (relative > 0).mean() > 0.8
    assert not np.array_equal(nudged["a"], sensitivity.nudge(params, jax.random.key(1))["a"])


@pytest.mark.slow  # compiles a ResNet-18 Flow update: about 4 minutes on 2 cores
def test_one_batch_amplifies_the_nudge_on_flowjaxs_resnet():
    start, end = sensitivity.divergence("ours", 1)
    assert 0 < start <= 2 * sensitivity.PERTURBATION
    assert end > start
