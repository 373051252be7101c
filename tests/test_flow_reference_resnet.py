"""The authors' Flow for CIFAR (``flow_reference_resnet``), through ``flow()`` and the
config. Parity with their PyTorch code: ``tests/test_parity.py``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import cifar
from flowjax.algorithms import build_algorithm, flow_reference_resnet as reference
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.models import get_model
from flowjax.validation import validate_config
from launch.parity import client_examples, image_client_data
from tests.helpers import cifar_round_in_child

CONFIG = dict(sgd=SGDConfig(learning_rate=0.05, epochs=2, batch_size=4, momentum=0.9),
              gamma=0.1, policy_hidden=(1000, 750, 350, 150, 50, 2), semantics="reference")


@pytest.fixture(scope="module")
def model():
    return get_model("resnet18_gn", num_classes=10)


@pytest.fixture(scope="module")
def algorithm(model):
    return flow(model, FlowConfig(**CONFIG), jnp.zeros((2, 32, 32, 3)))


@pytest.fixture(scope="module")
def params(algorithm):
    return algorithm.init(jax.random.key(0))


@pytest.fixture(scope="module")
def client():
    # 3 images: one batch of 4 with a padded slot, so an epoch is one step (at the suite's
    # optimization level 0 their network runs 12x slower than in a default build).
    data = image_client_data(seed=0, train_examples=3, test_examples=4, num_classes=10)
    return client_examples(data["train_x"], data["train_y"], 4), jnp.asarray(data["test_x"])


def test_per_image_standardization_is_tensorflows():
    """The example of ``tf.image.per_image_standardization``'s docstring (TensorFlow's
    ``image_ops_impl.py``): the integers 1..12 as one 2 x 2 x 3 image."""
    image = jnp.arange(1, 13, dtype=jnp.float32).reshape(1, 2, 2, 3)
    expected = [-1.593255, -1.3035723, -1.0138896, -0.7242068, -0.4345241, -0.14484136,
                0.14484136, 0.4345241, 0.7242068, 1.0138896, 1.3035723, 1.593255]
    np.testing.assert_allclose(reference.per_image_standardization(image).reshape(-1),
                               expected, rtol=1e-6)
    # A uniform image: the std is capped at 1 / sqrt(N), so it maps to zeros, not NaN.
    flat = reference.per_image_standardization(jnp.full((1, 2, 2, 3), 7.0))
    np.testing.assert_array_equal(flat, 0.0)


def test_their_input_undoes_flowjaxs_channel_statistics():
    from flowjax.data.cifar import CHANNEL_MEAN, CHANNEL_STD
    pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.float32)
    x = (pixels - CHANNEL_MEAN) / CHANNEL_STD  # as flowjax.data.cifar stores them
    np.testing.assert_allclose(reference.their_pixels(jnp.asarray(x)), pixels, atol=1e-4)
    np.testing.assert_allclose(reference.their_input(jnp.asarray(x.reshape(2, -1))),
                               reference.per_image_standardization(jnp.asarray(pixels)),
                               atol=1e-5)


def test_their_group_norm_normalizes_pairs_of_channels_with_one_affine_per_pair():
    """``GroupNorm2d(C, 2)``: 2 consecutive channels per group over H x W, population
    variance, eps 1e-5, weight and bias per group (their F.batch_norm on the
    ``[1, B * C / 2, 2, H, W]`` view), here in float64 numpy from that definition."""
    x = np.random.default_rng(1).normal(size=(2, 3, 3, 6)) * [1, 2, 3, 4, 5, 6]
    weight, bias = np.array([0.5, -1.0, 2.0]), np.array([0.1, 0.2, -0.3])
    out = reference.GroupNorm().apply({"params": {"weight": weight, "bias": bias}},
                                      jnp.asarray(x, jnp.float32))
    expected = np.empty_like(x)
    for b in range(2):
        for g in range(3):
            values = x[b, :, :, 2 * g: 2 * g + 2]
            normal = (values - values.mean()) / np.sqrt(values.var() + 1e-5)
            expected[b, :, :, 2 * g: 2 * g + 2] = normal * weight[g] + bias[g]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_semantics_reference_builds_their_network_from_the_config(model):
    config = cifar.get_config("cifar10_0.1")
    config.methods.flow.semantics = "reference"
    validate_config(config)
    algorithm = build_algorithm("flow", model, config, jnp.zeros((2, 32, 32, 3)))
    shapes = jax.tree.map(lambda a: a.shape, jax.eval_shape(algorithm.init, jax.random.key(0)))
    assert set(shapes) == {"shared", "global", "local", "policy"}
    assert shapes["shared"] == {"weight": (32,), "bias": (32,)}  # one per pair of 64 channels
    assert shapes["global"] == shapes["local"]
    assert set(shapes["global"]) == {"conv1", "layer1", "layer2", "layer3", "layer4", "fc"}
    assert shapes["global"]["conv1"]["kernel"] == (7, 7, 3, 64)
    assert "downsample_conv" not in shapes["global"]["layer1"]["block0"]
    assert shapes["global"]["layer2"]["block0"]["downsample_conv"]["kernel"] == (1, 1, 64, 128)
    assert shapes["global"]["layer4"]["block1"]["bn2"]["weight"] == (256,)
    assert shapes["global"]["fc"]["kernel"] == (512, 10)
    policy = shapes["policy"]
    assert [policy[f"base{j}"]["kernel"] for j in range(5)] == [
        (3072, 1000), (1000, 750), (750, 350), (350, 150), (150, 50)]
    assert all(policy[f"exit{j}"]["kernel"][1] == 2 for j in range(5))
    assert policy["last"]["kernel"] == (50, 2)


def test_init_is_theirs(params):
    conv = np.asarray(params["global"]["conv1"]["kernel"])  # N(0, 2 / (7 * 7 * 64))
    assert abs(conv.std() / math.sqrt(2 / (49 * 64)) - 1) < 0.03 and abs(conv.mean()) < 1e-3
    block = params["local"]["layer3"]["block0"]
    assert not np.any(block["bn2"]["weight"])  # the block's last norm starts at 0
    assert np.all(block["bn1"]["weight"] == 1) and np.all(block["downsample_norm"]["weight"] == 1)
    assert np.all(params["shared"]["weight"] == 1) and not np.any(params["shared"]["bias"])
    for layer, fan_in in ((params["policy"]["base0"], 3072), (params["global"]["fc"], 512)):
        for value in (layer["kernel"], layer["bias"]):  # nn.Linear: U(+-1/sqrt(fan_in))
            assert np.abs(value).max() <= 1 / math.sqrt(fan_in)
            assert np.abs(value).max() > 0.9 / math.sqrt(fan_in)
    # Separate random inits of the two branches (their local_init="server").
    assert not np.array_equal(params["global"]["fc"]["kernel"], params["local"]["fc"]["kernel"])


FIXED_BY_THEM = ("expected {} with semantics='reference' on resnet18_gn: the authors' CIFAR "
                 "procedure runs as one unit")
NOT_IN_THEIR_NETWORK = ("expected None with semantics='reference' on resnet18_gn: the authors' "
                        "CIFAR network has no such option")


@pytest.mark.parametrize("field, value, expected", [
    ("halves", "shard", FIXED_BY_THEM.format("'none'")),
    ("evaluation", "reference", FIXED_BY_THEM.format("'reference_policy'")),
    ("order", "policy_first", FIXED_BY_THEM.format("'alternating'")),
    ("policy_eval_dropout", True, FIXED_BY_THEM.format("False")),
    ("hard_tie", "global", FIXED_BY_THEM.format("'zeroed'")),
    # Options of the paper's routed model, which their network would silently ignore.
    ("recurrence", "mixed_state", NOT_IN_THEIR_NETWORK),
    ("fuse_branches", True, NOT_IN_THEIR_NETWORK)])
def test_what_their_procedure_does_not_run_is_refused_in_one_line(model, field, value, expected):
    config = cifar.get_config("cifar10_0.1")
    config.methods.flow.semantics = "reference"
    config.methods.flow[field] = value
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value) == f"config.methods.flow.{field}={value!r}: {expected}"
    if expected == NOT_IN_THEIR_NETWORK:  # refused by flow() itself, before any resolving
        with pytest.raises(ValueError, match=f"^{field}={value!r}: expected None"):
            flow(model, FlowConfig(**{**CONFIG, field: value}), jnp.zeros((2, 32, 32, 3)))


def test_flowjaxs_group_count_is_refused_not_ignored():
    config = cifar.get_config("cifar10_0.1")
    config.methods.flow.semantics = "reference"
    config.model_options.groups = 32
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value) == (
        "config.model_options.groups=32: expected it unset with methods.flow.semantics="
        "'reference': the authors' CIFAR network has its own GroupNorm (2 channels per group)")
    config.methods.flow.semantics = "paper"
    validate_config(config)  # flowjax's resnet18_gn takes it


def test_each_pass_flips_about_half_and_padding_changes_no_flip():
    key = jax.random.key(3)
    valid = jnp.arange(40) < 37
    indices, mask = reference.plan_passes(key, valid, 20, 4)
    assert indices.shape == mask.shape == (4, 2, 20)
    flipped = np.asarray(indices)[np.asarray(mask)] >= 40
    assert 0.3 < flipped.mean() < 0.7
    originals = np.asarray(indices) % 40
    np.testing.assert_array_equal(originals[0][np.asarray(mask[0])], np.arange(37))  # in order
    assert not np.array_equal(flipped.reshape(4, -1)[0], flipped.reshape(4, -1)[1])
    # The same 37 examples padded to 60: the same batches, the same flips.
    wide, wide_mask = reference.plan_passes(key, jnp.arange(60) < 37, 20, 4)
    np.testing.assert_array_equal(np.asarray(wide_mask)[:, :2], mask)
    np.testing.assert_array_equal(np.asarray(wide)[:, :2][np.asarray(mask)] % 60,
                                  originals[np.asarray(mask)])
    np.testing.assert_array_equal(np.asarray(wide)[:, :2][np.asarray(mask)] >= 60, flipped)


def _forced_policy(params, towards: str):
    """Zero exit kernels and biases of +-1000 on every route: softmax gives exactly
    (1, 0) or (0, 1) in float32."""
    bias = jnp.asarray([1000.0, -1000.0] if towards == "global" else [-1000.0, 1000.0])
    policy = dict(params["policy"])
    for name in [f"exit{j}" for j in range(5)] + ["last"]:
        policy[name] = {"kernel": jnp.zeros_like(policy[name]["kernel"]), "bias": bias}
    return {**params, "policy": policy}


@pytest.mark.parametrize("towards", ["global", "local"])
def test_routes_of_one_branch_are_that_branch(algorithm, params, client, towards):
    """q0 = 1 (0) on every route: the routed net is their global (local) mode bit for
    bit, soft and hard."""
    forced = _forced_policy(params, towards)
    branch = forced if towards == "global" else {**forced, "global": forced["local"]}
    _, x = client
    predictions = jax.jit(algorithm.predict)(
        branch, {"params": forced, "snapshot": forced}, x)
    np.testing.assert_array_equal(predictions.q0, 1.0 if towards == "global" else 0.0)
    np.testing.assert_array_equal(predictions.personal_soft, predictions.global_logits)
    np.testing.assert_array_equal(predictions.personal_hard, predictions.global_logits)


@pytest.fixture(scope="module")
def updated(algorithm, params, client):
    return jax.jit(algorithm.client_update)(params, client[0], jax.random.key(1))


# About 40 s alone at the suite's flags (their network runs 12x slower at XLA's optimization
# level 0 than by default). CI keeps the parts: the plan's padding
# (test_each_pass_flips_about_half_and_padding_changes_no_flip) and the engine's
# (test_conformance's padded cases).
@pytest.mark.slow
def test_padded_examples_and_steps_change_no_result(algorithm, params, client, updated):
    """The same 3 images padded to 12 (3 batches of 4, two of them empty) instead of 4."""
    examples, _ = client
    x, y, mask = examples.flat()
    wide = client_examples(
        np.concatenate([np.asarray(x), np.zeros((8,) + x.shape[1:], x.dtype)]),
        np.concatenate([np.asarray(y), np.zeros((8,), y.dtype)]), 4)
    wide = wide.replace(mask=(jnp.arange(12) < 3).reshape(3, 4), num_examples=jnp.int32(3))
    assert not np.array_equal(np.asarray(mask), np.ones(4, bool))  # 4 holds padding too
    result = jax.jit(algorithm.client_update)(params, wide, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(updated), strict=True):
        np.testing.assert_array_equal(a, b)


# About 75 s of CI's 2 cores (a client update and an evaluation's training of their network
# at XLA's optimization level 0), so with -m slow, beside this network's parity
# (test_parity's CIFAR) and padding checks. CI keeps its init, routes, plan and layers; the
# phases' steps are flow_reference's, which test_flow_reference and test_conformance run.
@pytest.mark.slow
def test_client_update_trains_what_their_phases_train(algorithm, params, client, updated):
    """Every part moves; the weight is the client's number of examples; the evaluation's
    training leaves the global branch as the server sent it (their policy-only phase)."""
    examples, x = client
    result = updated
    assert float(result.weight) == 3.0
    for part in reference.GROUPS:
        assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(result.params[part]),
                                                  jax.tree.leaves(params[part]))), part
    personal = jax.jit(algorithm.personalize)(params, examples, jax.random.key(1))
    for tree in (personal["params"], personal["snapshot"]):
        for a, b in zip(jax.tree.leaves(tree["global"]), jax.tree.leaves(params["global"])):
            np.testing.assert_array_equal(a, b)
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(personal["params"]["policy"]),
                                              jax.tree.leaves(personal["snapshot"]["policy"])))


@pytest.mark.slow  # a child process compiling their network's phases (tests/helpers.py)
def test_a_reference_run_reports_their_snapshot_beside_acc_g():
    """Through the config and the experiment on mock CIFAR (TFDS's mock_data)."""
    summary = cifar_round_in_child("reference")
    assert 0 <= summary["acc_p"] <= 1 and summary["snapshot"] is not None
