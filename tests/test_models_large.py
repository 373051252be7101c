"""ResNet-18 GN and the Stackoverflow LSTM: sizes, shapes, routing exactness, one SGD step.

Inputs are tiny (two images; two sequences of 5 tokens) and each model's jitted programs are
built once per module, so the file stays cheap on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.models import get_model
from flowjax.models.base import RoutableModel, forward
from flowjax.models.layers import Conv2D
from flowjax.routing import build_policy, routed_forward

# Exact totals, each equal to the published count of the architecture.
RESNET18_GN_PARAMS = 11_173_962  # CIFAR ResNet-18, 10 classes; GN has BN's affine params
RESNET18_GN_LAYER_PARAMS = {"stem": 1_856, "stage1": 147_968, "stage2": 525_568,
                            "stage3": 2_099_712, "stage4": 8_393_728, "fc": 5_130}
SO_LSTM_PARAMS = 4_050_748  # 960,384 + 2,055,560 + 64,416 + 970,388
SO_LSTM_LAYER_PARAMS = {"embedding": 960_384, "lstm": 2_055_560, "dense1": 64_416,
                        "dense2": 970_388}


def _count(tree) -> int:
    return sum(int(leaf.size) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass
class Setup:
    """A model, two param copies, a fixed batch and its jitted programs."""

    model: RoutableModel
    global_params: dict
    local_params: dict
    x: jax.Array
    y: jax.Array
    plain: Callable
    routed_soft: Callable
    routed_hard: Callable

    @property
    def instance_shape(self) -> tuple[int, ...]:
        return self.x.shape[: self.model.instance_ndim]


def _inputs(name: str, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    if name == "resnet18_gn":
        return (jax.random.normal(kx, (2, 32, 32, 3), jnp.float32),
                jax.random.randint(ky, (2,), 0, 10))
    tokens = jax.random.randint(kx, (2, 6), 1, 10004)
    return tokens[:, :-1], tokens[:, 1:]  # next-token targets


@pytest.fixture(scope="module", params=["resnet18_gn", "stackoverflow_lstm"])
def setup(request) -> Setup:
    model = get_model(request.param)
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    x, y = _inputs(request.param, k3)
    init = jax.jit(model.init)  # one compiled init is much faster than eager init here
    # Params are jit arguments, as in training: closed-over constants could be folded
    # differently in each program and break bit-exactness.
    plain = jax.jit(lambda params, x: forward(model, params, x))
    routed_soft = jax.jit(lambda g, l, q0, x: routed_forward(model, g, l, q0, x))
    routed_hard = jax.jit(lambda g, l, q0, x: routed_forward(model, g, l, q0, x, hard=True))
    return Setup(model, init(k1), init(k2), x, y, plain, routed_soft, routed_hard)


def _param_shapes(name: str) -> dict:
    return jax.eval_shape(get_model(name).init, jax.random.key(0))


def test_param_counts():
    resnet = _param_shapes("resnet18_gn")
    assert {k: _count(v) for k, v in resnet.items()} == RESNET18_GN_LAYER_PARAMS
    assert _count(resnet) == RESNET18_GN_PARAMS
    lstm = _param_shapes("stackoverflow_lstm")
    assert {k: _count(v) for k, v in lstm.items()} == SO_LSTM_LAYER_PARAMS
    assert _count(lstm) == SO_LSTM_PARAMS


def test_declared_fields():
    resnet, lstm = get_model("resnet18_gn"), get_model("stackoverflow_lstm")
    assert resnet.layer_names == ("stem", "stage1", "stage2", "stage3", "stage4", "fc")
    assert (resnet.instance_ndim, resnet.policy_input, resnet.head_layers) == (1, "flat", ("fc",))
    assert lstm.layer_names == ("embedding", "lstm", "dense1", "dense2")
    assert (lstm.instance_ndim, lstm.policy_input, lstm.vocab_size, lstm.head_layers) == (
        2, "tokens", 10004, ("dense2",))
    assert get_model("resnet18_gn", num_classes=100).num_classes == 100


def test_output_shapes(setup):
    logits = setup.plain(setup.global_params, setup.x)
    assert logits.shape == setup.instance_shape + (setup.model.num_classes,)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("hard", [False, True])
def test_q0_one_is_global_and_zero_is_local_exactly(setup, hard):
    routed = setup.routed_hard if hard else setup.routed_soft
    ones = jnp.ones(setup.instance_shape + (setup.model.num_layers,))
    g, l = setup.global_params, setup.local_params
    np.testing.assert_array_equal(routed(g, l, ones, setup.x), setup.plain(g, setup.x))
    np.testing.assert_array_equal(routed(g, l, ones * 0, setup.x), setup.plain(l, setup.x))


def test_hard_routing_equals_soft_routing_on_rounded_q0(setup):
    q0 = jax.random.uniform(jax.random.key(5), setup.instance_shape + (setup.model.num_layers,))
    rounded = (q0 >= 0.5).astype(jnp.float32)
    g, l = setup.global_params, setup.local_params
    hard = setup.routed_hard(g, l, q0, setup.x)
    np.testing.assert_array_equal(hard, setup.routed_soft(g, l, rounded, setup.x))
    assert not np.allclose(setup.routed_soft(g, l, q0, setup.x), setup.plain(g, setup.x))


def _loss(model: RoutableModel, params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = forward(model, params, x)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1)[..., 0]
    w = model.label_weights(y)
    return (ce * w).sum() / w.sum()


# A ResNet-18 at init is sharp on a 2-example batch (gradient norm ~30: lr 1e-2 overshoots,
# training's momentum and larger batches are another matter), so its step is smaller.
SGD_LEARNING_RATES = {"resnet18_gn": 1e-3, "stackoverflow_lstm": 0.1}


def test_one_sgd_step_lowers_the_loss(setup):
    loss = jax.jit(lambda p: _loss(setup.model, p, setup.x, setup.y))
    before, grads = jax.jit(jax.value_and_grad(
        lambda p: _loss(setup.model, p, setup.x, setup.y)))(setup.global_params)
    lr = SGD_LEARNING_RATES[setup.model.name]
    stepped = jax.tree.map(lambda p, g: p - lr * g, setup.global_params, grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(loss(stepped)) < float(before)


def test_policy_shapes(setup):
    policy = build_policy(setup.model, setup.x, (8,) * setup.model.num_layers)
    log_q = policy.log_probs(policy.init(jax.random.key(0)), setup.x)
    assert log_q.shape == setup.instance_shape + (setup.model.num_layers, 2)


@pytest.mark.parametrize("exclude_special, counted", [
    (False, [0, 1, 1, 1, 1, 1, 1]),
    (True, [0, 1, 1, 1, 0, 0, 0]),
])
def test_stackoverflow_label_weights(exclude_special, counted):
    """Training fits every label but padding either way; exclude_special leaves
    oov/bos/eos out of the accuracies only (Reddi et al.'s second accuracy)."""
    from flowjax.algorithms.base import instance_weights
    # pad 0, words 1..10000, then oov 10001, bos 10002, eos 10003.
    y = jnp.array([[0, 1, 5000, 10000, 10001, 10002, 10003]])
    model = get_model("stackoverflow_lstm", exclude_special=exclude_special)
    mask = jnp.ones((1,), jnp.float32)
    for_loss = instance_weights(model, y, mask)
    for_metrics = instance_weights(model, y, mask, for_metrics=True)
    assert for_loss.dtype == for_metrics.dtype == jnp.float32
    np.testing.assert_array_equal(for_loss, np.array([[0, 1, 1, 1, 1, 1, 1]], np.float32))
    np.testing.assert_array_equal(for_metrics, np.array([counted], np.float32))


def test_strided_conv_needs_autodiff():
    x = jnp.ones((1, 8, 8, 3))
    conv = Conv2D(4, padding="SAME", stride=2, custom_grad=False, use_bias=False)
    params = conv.init(jax.random.key(0), x)["params"]
    assert set(params) == {"kernel"}
    assert conv.apply({"params": params}, x).shape == (1, 4, 4, 4)
    with pytest.raises(ValueError, match="custom_grad=False"):
        Conv2D(4, stride=2).init(jax.random.key(0), x)


def test_stackoverflow_accuracy_without_special_tokens_counts_only_words():
    """The evaluation's counts (``metrics.batch_counts``) follow the metric weights: with
    exclude_special the oov and eos labels are not counted instances."""
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.evaluation.metrics import batch_counts
    # vocab 8: pad 0, words 1..4, oov 5, bos 6, eos 7.
    y = jnp.array([[1, 4, 5, 7, 0, 0]])
    x = jnp.array([[6, 1, 4, 5, 7, 0]])
    counted = {}
    for exclude_special in (False, True):
        model = get_model("stackoverflow_lstm", vocab_size=8, embed_dim=4, hidden=4, dense=4,
                          exclude_special=exclude_special)
        algorithm = fedavg(model, FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                             batch_size=1)))
        params = algorithm.init(jax.random.key(0))
        # A model that predicts oov (id 5) everywhere: right at the oov label only.
        last = params["dense2"]
        params = {**params, "dense2": {**last, "bias": last["bias"].at[5].add(100.0)}}
        counts = batch_counts(algorithm, params, params, x, y, jnp.ones((1,), bool))
        counted[exclude_special] = (float(counts.instances), float(counts.correct_global),
                                    float(counts.correct_personal))
    # Instances, global hits, personal hits: with exclude_special the oov hit is not one.
    assert counted == {False: (4.0, 1.0, 1.0), True: (2.0, 0.0, 0.0)}
