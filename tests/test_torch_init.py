"""``models.torch_init``: fresh layers drawn as the Flow authors' PyTorch networks draw
theirs (``personal_init="fresh_torch"``). The distributions against their nets' own
init are ``tests/test_parity.py``'s (a fixture PyTorch wrote); here the rules' exact
parts: the supports, the zeros and ones, their ResNet's own init, and bad layers."""

import math

import jax
import numpy as np
import pytest

from flowjax.algorithms.base import fresh_layers
from flowjax.models import get_model
from flowjax.models.torch_init import torch_init


def _draw(model_name: str, **sizes) -> dict:
    model = get_model(model_name, **sizes)
    return jax.jit(fresh_layers(model, model.layer_names, "fresh_torch"))(jax.random.key(0))


def _within(array, bound: float) -> None:
    """Inside ``[-bound, bound]`` and, with 1,000 draws or more, reaching past 0.9 of it
    at both ends (a uniform's support, not a narrower one: 1,000 uniform draws all miss
    the last tenth at one end with probability 0.9^1000, about 2e-46)."""
    a = np.asarray(array)
    assert a.min() >= -bound and a.max() <= bound, (a.min(), a.max(), bound)
    if a.size >= 1000:
        assert a.min() < -0.9 * bound and a.max() > 0.9 * bound, (a.min(), a.max(), bound)


def test_dense_and_conv_layers_are_uniform_on_one_over_root_fan_in():
    """``nn.Linear`` / ``nn.Conv2d``: weight and bias on ``+-1/sqrt(fan_in)``, ``fan_in``
    the inputs times the kernel's area."""
    params = _draw("emnist_cnn")
    for name, fan_in in (("conv1", 3 * 3 * 1), ("conv2", 3 * 3 * 32), ("fc1", 9216),
                         ("fc2", 128)):
        for part in ("kernel", "bias"):
            _within(params[name][part], 1 / math.sqrt(fan_in))
    # The uniform's standard deviation, bound / sqrt(3), on the 1.2M weights of fc1:
    # Flax's LeCun normal (the model's own init) has sqrt(3) times it.
    assert np.std(params["fc1"]["kernel"]) == pytest.approx(1 / math.sqrt(3 * 9216), rel=0.01)


def test_lstm_weights_are_uniform_on_one_over_root_hidden_and_the_bias_is_two_such():
    """``nn.LSTM(H)``: every weight on ``+-1/sqrt(H)``; flowjax's one bias is their
    ``b_ih + b_hh``, a sum of two such uniforms (support ``+-2/sqrt(H)``, variance
    ``2/(3H)``); the embedding standard normal with the padding row 0 zero."""
    params = _draw("shakespeare_lstm", hidden=256)
    bound = 1 / math.sqrt(256)
    for name in ("lstm1", "lstm2"):
        _within(params[name]["kernel"], bound)
        _within(params[name]["recurrent_kernel"], bound)
        bias = np.asarray(params[name]["bias"])
        assert np.abs(bias).max() <= 2 * bound and np.abs(bias).max() > bound
        assert np.var(bias) == pytest.approx(2 * bound ** 2 / 3, rel=0.15)
    table = np.asarray(params["embedding"]["embedding"])
    assert np.all(table[0] == 0) and np.all(table[1:] != 0)
    assert np.std(table[1:]) == pytest.approx(1.0, rel=0.1)


def test_their_resnet_init_zeroes_each_blocks_second_norm():
    """Their ResNet (``models/cifar100_resnet.py``): convolutions normal with variance
    ``2 / (k * k * out)``, norms weight 1 bias 0, then ``bn2.weight`` 0 in each
    BasicBlock: flowjax's ``GroupNorm_1``; the projection shortcut's norm (their
    ``downsample``'s, ``GroupNorm_2``) and the stem's keep weight 1."""
    params = _draw("resnet18_gn", num_classes=10)
    zeroed, ones = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [p.key for p in path]
        leaf = np.asarray(leaf)
        if names[-1] == "scale":
            second = names[-2] == "GroupNorm_1" and names[-3].startswith("BasicBlock_")
            assert np.all(leaf == (0.0 if second else 1.0)), names
            zeroed, ones = zeroed + second, ones + (not second)
        elif names[-2].startswith("GroupNorm_"):
            assert np.all(leaf == 0.0), names
        elif names[-2].startswith("Conv2D_"):
            k, _, _, out = leaf.shape
            assert np.std(leaf) == pytest.approx(math.sqrt(2 / (k * k * out)), rel=0.1), names
    assert zeroed == 8 and ones == 1 + 8 + 3  # stem; first norms; three projections
    _within(params["fc"]["kernel"], 1 / math.sqrt(512))


def test_draws_follow_the_key_and_a_layer_of_unknown_kind_is_named():
    shapes = {"fc": {"kernel": jax.ShapeDtypeStruct((4, 3), "float32"),
                     "bias": jax.ShapeDtypeStruct((3,), "float32")}}
    same = torch_init(shapes, jax.random.key(1))
    np.testing.assert_array_equal(same["fc"]["kernel"],
                                  torch_init(shapes, jax.random.key(1))["fc"]["kernel"])
    assert not np.array_equal(same["fc"]["kernel"],
                              torch_init(shapes, jax.random.key(2))["fc"]["kernel"])
    odd = {"block": {"gate": {"w": jax.ShapeDtypeStruct((2, 2), "float32")}}}
    with pytest.raises(ValueError, match=r"^layer part 'block/gate' with params \['w'\]: "
                                         "expected a dense, convolution, LSTM, embedding "
                                         "or norm layer$"):
        torch_init(odd, jax.random.key(0))


def test_bad_personal_init_names_the_value():
    with pytest.raises(ValueError, match=r"^personal_init='sometimes': expected one of "):
        fresh_layers(get_model("mlp"), ("fc1",), "sometimes")
