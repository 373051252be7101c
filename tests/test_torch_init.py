"""``models.torch_init``: layers drawn as the Flow authors' PyTorch networks draw theirs,
the fresh personal layers (``personal_init="fresh_torch"``) and whole runs
(``model_init="torch"``). The distributions against their nets' own init are
``tests/test_parity.py``'s (a fixture PyTorch wrote); here the rules' exact parts: the
supports, the zeros and ones, their ResNet's own init, bad layers, and which parts of a
run the run config's ``model_init`` draws."""

import math

import jax
import numpy as np
import pytest

from flowjax import config as run_config
from flowjax.algorithms.base import fresh_layers
from flowjax.core import prng
from flowjax.models import get_model
from flowjax.models.torch_init import TORCH_STYLES, torch_init, with_torch_init
from tests.helpers import assert_trees_equal, small_config, small_synthetic_config


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


def _initial_params(config) -> dict:
    return run_config.build_simulation(config).init_state().params


def _dense_within_torch_bounds(layers: dict) -> None:
    """Every ``{kernel [in, out], bias}`` layer of ``layers`` (nested) on
    ``+-1/sqrt(in)``."""
    for name, layer in layers.items():
        if set(layer) == {"kernel", "bias"}:
            bound = 1 / math.sqrt(layer["kernel"].shape[0])
            _within(layer["kernel"], bound)
            _within(layer["bias"], bound)
        else:
            _dense_within_torch_bounds(layer)


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto", "lg_fedavg"])
def test_model_init_torch_draws_the_run_start_as_pytorch_for_every_method(algorithm):
    """``model_init="torch"``: a run's round-0 model is ``torch_init`` of the model's
    shapes from the run's init key, bit for bit, for any method (each builds its params
    from ``model.init``); the default ``None`` keeps Flax's init (zero biases)."""
    config = small_synthetic_config(algorithm=algorithm, model_init="torch")
    params = _initial_params(config)
    model = get_model("mlp")
    drawn = with_torch_init(model).init(prng.base_key(config.seed, prng.Purpose.INIT))
    if algorithm == "lg_fedavg":  # the model split into its shared and local layers
        params = {**params["global"], **params["initial_local"]}
    assert_trees_equal(params, drawn)
    _dense_within_torch_bounds(params)
    own = _initial_params(small_synthetic_config(algorithm=algorithm))
    own = {**own["global"], **own["initial_local"]} if algorithm == "lg_fedavg" else own
    assert all(np.all(np.asarray(layer["bias"]) == 0) for layer in own.values())


def test_model_init_torch_draws_flows_policy_as_nn_linear():
    """Flow's model and its routing policy (``nn.Linear`` layers in the authors' code)
    both drawn as PyTorch's; with the default, the policy keeps Flax's zero biases."""
    params = _initial_params(small_synthetic_config(algorithm="flow", model_init="torch"))
    _dense_within_torch_bounds(params["global"])
    _dense_within_torch_bounds(params["policy"])
    own = _initial_params(small_synthetic_config(algorithm="flow"))
    assert all(np.all(np.asarray(layer["bias"]) == 0) for layer in own["policy"].values())


def test_model_init_torch_keeps_the_token_policys_own_embedding():
    """The token policy's embedding is flowjax's own (the authors' policy reads the
    LSTMs' states): it keeps its Flax draw, the same bit for bit as without the option,
    while the policy's dense layers are redrawn."""
    torch_policy = _initial_params(small_config(algorithm="flow", model_init="torch"))["policy"]
    own_policy = _initial_params(small_config(algorithm="flow"))["policy"]
    assert_trees_equal(torch_policy["embed"], own_policy["embed"])
    _dense_within_torch_bounds({k: v for k, v in torch_policy.items() if k != "embed"})


def test_one_factor_styles_change_only_dense_and_conv_weights_scale_or_biases():
    """``model_init="torch_lecun_variance"``: every dense layer's weights (the policy's
    too) are ``sqrt(3)`` times ``"torch"``'s from the same run key, variance 1/fan_in as
    flowjax's LeCun normal, with the biases ``"torch"``'s bit for bit;
    ``"torch_zero_biases"``: ``"torch"``'s weights bit for bit, biases zero;
    ``"torch_lecun_variance_zero_biases"``: the scaled weights with zero biases."""
    def drawn(style):
        return _initial_params(small_synthetic_config(algorithm="flow", model_init=style))

    torch, lecun, zero, both = map(drawn, TORCH_STYLES)
    layers = 0
    for part in ("global", "policy"):
        for name, layer in torch[part].items():
            scaled = np.float32(math.sqrt(3)) * np.asarray(layer["kernel"])
            assert np.array_equal(lecun[part][name]["kernel"], scaled)
            assert np.array_equal(lecun[part][name]["bias"], layer["bias"])
            assert np.array_equal(zero[part][name]["kernel"], layer["kernel"])
            assert np.all(np.asarray(zero[part][name]["bias"]) == 0)
            assert np.array_equal(both[part][name]["kernel"], scaled)
            assert np.all(np.asarray(both[part][name]["bias"]) == 0)
            assert np.any(np.asarray(layer["bias"]) != 0)
            layers += 1
    assert layers >= 4
    # On the 1.2M weights of the CNN's fc1: LeCun's variance, 1 / fan_in.
    fc1 = with_torch_init(get_model("emnist_cnn"), "torch_lecun_variance").init(
        jax.random.key(0))["fc1"]["kernel"]
    _within(fc1, math.sqrt(3 / 9216))
    assert np.var(fc1) == pytest.approx(1 / 9216, rel=0.01)


def test_one_factor_styles_leave_lstms_and_embeddings_as_torchs():
    """The styles change dense and convolution layers only: an LSTM's weights and biases
    and the embedding are ``"torch"``'s bit for bit."""
    model = get_model("shakespeare_lstm", hidden=16)
    key = jax.random.key(1)
    torch = with_torch_init(model).init(key)
    for style in TORCH_STYLES[1:]:
        params = with_torch_init(model, style).init(key)
        for name, layer in params.items():
            if set(layer) != {"kernel", "bias"}:
                assert_trees_equal(layer, torch[name])
    with pytest.raises(ValueError, match="init style 'torch_small': expected one of"):
        with_torch_init(model, "torch_small")


def test_model_init_torch_draws_the_lstm_reference_network_as_theirs():
    """Flow's Shakespeare reference network (their ``ShakespeareNet`` and policy):
    LSTM weights on ``+-1/sqrt(H)``, the embedding standard normal with the padding row
    zero, every dense layer (their policy's too) as ``nn.Linear``."""
    config = small_config(algorithm="flow", model_init="torch",
                          **{"methods.flow.semantics": "reference"})
    params = _initial_params(config)
    hidden = config.model_options["hidden"]
    for branch in ("global", "local"):
        for name, layer in params[branch].items():
            if "recurrent_kernel" in layer:
                _within(layer["kernel"], 1 / math.sqrt(hidden))
                _within(layer["recurrent_kernel"], 1 / math.sqrt(hidden))
            else:
                _dense_within_torch_bounds({name: layer})
    table = np.asarray(params["embedding"]["embedding"])
    assert np.all(table[0] == 0) and np.std(table[1:]) == pytest.approx(1.0, rel=0.1)
    _dense_within_torch_bounds(params["policy"])
