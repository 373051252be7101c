"""Up-front checks of a run config and of loaded data, each failing with one line.

``validate_config`` runs before any data is loaded and ``validate_task`` before the
algorithm is built, so a bad input costs no compilation and nothing gets written.
Messages name the bad value and what is expected:
``config.<field>=<value!r>: expected ...`` and ``data <population>/<split>/<feature>...``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from flowjax import distributed
from flowjax.algorithms import METHODS, algorithm_names, method_config
from flowjax.algorithms import flow_reference, flow_reference_resnet
from flowjax.algorithms.flow_reference_networks import NETWORKS
from flowjax.algorithms.ditto import unstable_lam
from flowjax.algorithms.fedrep import head_layer_names
from flowjax.algorithms.knn_per import reference_key_layer
from flowjax.algorithms.lg_fedavg import global_layer_names
from flowjax.core.checks import (FieldError, Interval, integer, is_int, one_of, optional_cap,
                                 optional_integer, plain, positive)
from flowjax.core.mapping import STRATEGIES, num_devices_problem
from flowjax.core.prng import SEED_LIMIT
from flowjax.core.server_opt import SERVER_OPTIMIZERS
from flowjax.data import DATASETS
from flowjax.data.federated import FederatedTask
from flowjax.data.tff_tasks import TRAIN_CLIENTS
from flowjax.paper.plan import ABLATIONS, variant_overrides
from flowjax.models import MODELS, get_model, model_takes
from flowjax.models.base import RoutableModel
from flowjax.models.layers import COMPUTE_DTYPES, CONV_IMPLS
from flowjax.models.torch_init import INIT_STYLES, with_torch_init
from flowjax.models.emnist_cnn import IMAGE_SHAPE
from flowjax.models.resnet_gn import IMAGE_SHAPE as CIFAR_IMAGE_SHAPE
from flowjax.models.shakespeare_lstm import SEQUENCE_LENGTH
from flowjax.models.stackoverflow_lstm import SEQUENCE_LENGTH as SO_SEQUENCE_LENGTH

Check = Callable[[Any], "str | None"]  # value -> what is expected, or None when fine
_MISSING = object()
# experiment.run's choices; checked here too so a typo fails before the workdir is written.
ON_DIVERGENCE = ("stop", "skip_clients")
# Rows scanned per numpy call: bounds the temporary masks on very large populations.
_BLOCK_ROWS = 1 << 16


# ---------------------------------------------------------------- value checks


def _algorithm(value: Any) -> str | None:
    if value in METHODS:
        return None
    if value in ABLATIONS:  # a compare.py / reproduce.py variant, not an algorithm
        flags = " ".join(f"--config.{k}={v}" for k, v in variant_overrides(value).items())
        return (f"expected an algorithm; {value!r} is an ablation of flow: run it with "
                f"launch/compare.py --methods={value}, or train.py with {flags}")
    return f"expected one of {list(algorithm_names())}"


def _seed(value: Any) -> str | None:
    if not is_int(value) or value < 0:
        return "expected an integer >= 0"
    # flowjax.core.prng gives every seed below 2**64 its own key; none wraps around.
    return None if value < SEED_LIMIT else "expected an integer in [0, 2**64)"


def _data_seed(value: Any) -> str | None:
    # The loaders seed NumPy with the data seed alone, and NumPy splits a larger int into
    # 32-bit words: 7 + 3 * 2**32 would draw seed 7's round-0 client-sampling stream
    # ([7, 3], flowjax.core.prng.host_rng). Below 2**32 no such stream is a data stream.
    if not is_int(value) or value < 0:
        return "expected an integer >= 0"
    return None if value < 2 ** 32 else "expected an integer in [0, 2**32)"


def _devices_visible(value: Any) -> str | None:
    if value == 1 and is_int(value) and not distributed.joined():
        return None  # there is always one device; asking jax would start its backend
    return num_devices_problem(value)


# The run's own fields (engine, data, evaluation). A method's fields (config.methods.<name>)
# and the clients' SGD (config.sgd) are checked by their dataclasses (``method_config``).
# Names first: an unknown algorithm or model makes every other message moot.
_RULES: tuple[tuple[str, Check], ...] = (
    ("algorithm", _algorithm),
    ("model", one_of(MODELS)),
    ("dataset", one_of(DATASETS)),
    ("server.optimizer", one_of(SERVER_OPTIMIZERS)),
    ("mapping.strategy", one_of(("auto",) + STRATEGIES)),
    ("conv_impl", one_of(CONV_IMPLS)),
    ("compute_dtype", one_of(tuple(COMPUTE_DTYPES))),
    ("client_states", one_of(("memory", "disk"))),
    ("lstm_unroll", optional_integer(1)),
    ("model_init", one_of((None,) + INIT_STYLES)),
    ("seed", _seed),
    ("num_rounds", integer(1)),
    ("clients_per_round", integer(1)),
    ("log_every", integer(1)),
    ("checkpoint_every", integer(0)),
    ("on_divergence", one_of(ON_DIVERGENCE)),
    ("eval.chunk", integer(1)),
    ("eval.every", integer(0)),
    ("mapping.chunk_size", integer(1)),
    ("mapping.num_devices", _devices_visible),
    ("max_examples_per_client", optional_cap),
    ("eval.clients", optional_cap),
    ("eval.held_out_clients", optional_cap),
    ("eval.max_examples", optional_cap),
    ("data.train_fraction", Interval(0, 1, closed_low=False)),
    ("data.held_out_fraction", Interval(0, 1, optional=True)),
    ("data.min_sequences", integer(2)),
    ("data.seed", _data_seed),
    ("data.max_train_examples", optional_cap),
    ("data.max_test_examples", optional_cap),
    ("data.train_clients", one_of((None,) + TRAIN_CLIENTS)),
    ("server.learning_rate", positive),
    ("server.momentum", Interval(0, 1)),
    ("server.b1", Interval(0, 1)),
    ("server.b2", Interval(0, 1)),
    ("server.eps", positive),
)


# ---------------------------------------------------------------- config


def _field(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            return _MISSING
        node = node[part]
    return node


def _fail(path: str, value: Any, expected: str) -> None:
    raise ValueError(f"config.{path}={plain(value)!r}: {expected}")


# Top-level fields passed to the model factory when set off their defaults (only models
# whose layers implement them take them).
_MODEL_FIELDS = {"conv_impl": "auto", "compute_dtype": "float32", "lstm_unroll": None}


def model_options(config: Any) -> dict[str, Any]:
    """The model factory's keyword arguments: ``config.model_options`` plus
    ``conv_impl`` / ``compute_dtype`` / ``lstm_unroll`` where the config sets them off
    their defaults."""
    options = dict(config.get("model_options", None) or {})
    for name, default in _MODEL_FIELDS.items():
        value = config.get(name, default)
        if value != default:
            options[name] = value
    return options


def build_model(config: Any) -> RoutableModel:
    """The configured model, drawn as PyTorch draws its layers where ``model_init`` is
    ``"torch"``; a bad ``model_options`` (or a layer option the model does not implement)
    fails with one line."""
    options = model_options(config)
    for name, default in _MODEL_FIELDS.items():
        if name in options and not model_takes(config.model, name):
            _fail(name, options[name], f"expected {default!r}: {config.model} does not "
                  f"implement {name}")
    for name, value in options.items():
        # Every integer option of the models is a size (classes, widths, vocabulary,
        # groups): 0 or less fails deep in a layer's initializer otherwise.
        sizes = value if isinstance(value, (tuple, list)) else (value,)
        if any(is_int(size) and size < 1 for size in sizes):
            _fail(f"model_options.{name}", value, "expected sizes >= 1")
    try:
        model = get_model(config.model, **options)
    except TypeError as error:
        _fail("model_options", options, f"expected keyword arguments of {config.model} ({error})")
    style = config.get("model_init", None)
    return model if style in (None, "flax") else with_torch_init(model, style)


def _check_flow_departures(flow: Any, model: RoutableModel) -> None:
    """Flow's reference options that exist only for some models, or only together."""
    if flow.semantics == "reference":
        try:
            flow_reference.reference_options(model.name)
        except ValueError:
            _fail("methods.flow.semantics", "reference", "expected 'paper' for model "
                  f"{model.name}: the reference mode covers "
                  f"{list(flow_reference.REFERENCE_MODELS)}")
    try:
        resolved = flow_reference.resolve(flow, model.name)
        network = NETWORKS.get(model.name)
        if resolved.semantics == "reference" and network is not None:
            network.check_unused(flow, model.name)
            network.check_config(resolved, model)
            return  # their procedure indexes its own regularizer
        flow_reference.check_hard_tie(resolved, model)
    except FieldError as error:  # a departure the reference mode sets clashes with a field
        raise error.at("methods.flow.") from None
    if (resolved.regularizer == "reference"
            and model.name not in flow_reference.REFERENCE_REGULARIZER_ENTRIES):
        _fail("methods.flow.regularizer", "reference", "expected 'paper' for model "
              f"{model.name}: its reference indexing is defined for "
              f"{sorted(flow_reference.REFERENCE_REGULARIZER_ENTRIES)}")


def _check_reference_momentum(config: Any) -> None:
    """``semantics="reference"`` runs their SGD momentum, 0.9 (``flow_reference.resolve``):
    a Flow momentum set to another value would be replaced without a word. The global
    ``sgd.momentum`` at its default 0 cannot be told from one set to 0; the README says so.
    """
    own = config.methods.flow.get("sgd", {}).get("momentum")
    field, value = (("methods.flow.sgd.momentum", own) if own is not None
                    else ("sgd.momentum", config.get("sgd", {}).get("momentum")))
    theirs = flow_reference.REFERENCE_MOMENTUM
    if value is None or value == theirs or (own is None and value == 0.0):
        return
    _fail(field, value, f"expected {theirs} (their code's) or unset with "
          "methods.flow.semantics='reference'; for their code with another momentum, run "
          "semantics='paper' with the departure fields (README, Reference mode)")


def _check_model_fields(config: Any, method: Any, model: RoutableModel) -> None:
    """Fields whose valid values depend on the model; only the configured method's
    (``method``, its config dataclass), since other methods' defaults need not fit every
    model."""
    layers = list(model.layer_names)
    if config.algorithm == "flow":
        if len(method.policy_hidden) != model.num_layers:
            _fail("methods.flow.policy_hidden", method.policy_hidden,
                  f"expected {model.num_layers} widths, one per routed layer of {model.name} "
                  f"{layers}")
        _check_flow_departures(method, model)
        if method.semantics == "reference":
            _check_reference_momentum(config)
        options = config.get("model_options") or {}
        if (method.semantics == "reference" and model.name in flow_reference_resnet.MODELS
                and "groups" in options):
            _fail("model_options.groups", options["groups"],
                  "expected it unset with methods.flow.semantics='reference': the authors' "
                  "CIFAR network has its own GroupNorm (2 channels per group)")
        if (method.semantics == "reference" and model.name in flow_reference_resnet.MODELS
                and config.get("model_init", None) not in (None, "torch")):
            _fail("model_init", config.model_init, "expected None or 'torch' with methods."
                  "flow.semantics='reference': the authors' CIFAR network draws its own "
                  "PyTorch init")
    if config.algorithm == "knn_per" and method.reference_acc_p:
        try:
            reference_key_layer(model)
        except ValueError as error:
            _fail("methods.knn_per.reference_acc_p", True, str(error))
    if config.algorithm == "hypcluster" and method.warmup_rounds >= config.num_rounds:
        _fail("methods.hypcluster.warmup_rounds", method.warmup_rounds,
              f"expected fewer than num_rounds={config.num_rounds}: the warm-up's FedAvg "
              "rounds are the run's first rounds, before HypCluster's own")
    expected = unstable_lam(method) if config.algorithm == "ditto" else None
    if expected is not None:
        _fail("methods.ditto.lam", method.lam, expected)
    if config.algorithm in _TOP_LAYER_OPTIONS:
        field, names_for, default, below = _TOP_LAYER_OPTIONS[config.algorithm]
        requested = getattr(method, field)
        try:
            names_for(model, requested)
        except ValueError:
            _fail(f"methods.{config.algorithm}.{field}", requested,
                  f"expected None ({default}) or distinct top layers of {model.name} {layers}, "
                  f"leaving at least one layer {below}")


# A method's option naming the model's top layers: (its field, the check, what None
# means, where the layers below stay).
_TOP_LAYER_OPTIONS = {
    "lg_fedavg": ("global_layers", global_layer_names, "the head", "local"),
    "fedrep": ("head_layers", head_layer_names, "the model's head", "in the body")}


def _check_run_fields(config: Any) -> None:
    """Checks the run's own fields (not a method's: ``method_config`` checks those)."""
    for path, check in _RULES:
        value = _field(config, path)
        if value is not _MISSING:
            expected = check(value)
            if expected is not None:
                _fail(path, value, expected)


def validate_config(config: Any) -> tuple[Any, RoutableModel]:
    """Checks every field of a run config before anything is loaded or compiled.

    Every method's config under ``config.methods`` is built (its dataclass checks its
    values), so a typo in any of them fails now, not when a later run reaches it.

    Args:
      config: an ``ml_collections.ConfigDict`` like ``configs/shakespeare.py``'s; run fields
        it lacks are not checked.

    Returns:
      The configured method's config dataclass and the model, built once for the checks
      and reused by the run (``flowjax.config.resolve``).

    Raises:
      ValueError: ``config.<field>=<value!r>: <what is expected>`` for the first bad field.
    """
    _check_run_fields(config)
    method = method_config(config)
    for name in config.get("methods", {}):
        if name in METHODS and name != config.algorithm:
            method_config(config, name)
    model = build_model(config)
    _check_model_fields(config, method, model)
    return method, model


# ---------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class _InputRule:
    """What a model takes per example, as the user-facing text and the test."""

    x_kind: str  # "float" or "int"
    x_shapes: tuple[tuple[int, ...], ...]  # empty: any shape
    y_like_x: bool  # per-token labels (language models) instead of one label per example


# The models reshape whatever reaches them, so a wrong shape would only fail deep inside
# jit, or silently mean something else; the registered models' inputs are spelled out here.
_INPUT_SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "emnist_cnn": (IMAGE_SHAPE[:2], IMAGE_SHAPE),
    "resnet18_gn": (CIFAR_IMAGE_SHAPE,),
    "shakespeare_lstm": ((SEQUENCE_LENGTH,),),
    "stackoverflow_lstm": ((SO_SEQUENCE_LENGTH,),),
}


def input_shapes(model: RoutableModel) -> tuple[tuple[int, ...], ...]:
    """The per-example input shapes ``model`` takes (empty: any)."""
    if model.name == "mlp":  # its width comes from model_options: read it off the params
        first = jax.eval_shape(model.init, jax.random.key(0))[model.layer_names[0]]
        return ((first["kernel"].shape[0],),)
    return _INPUT_SHAPES.get(model.name, ())


def example_input(model: RoutableModel, batch: int) -> jax.ShapeDtypeStruct:
    """``batch`` examples of ``model``'s input (its first listed shape), as shapes only.

    Launchers that size or count a model without data use this, so that they read the same
    shapes the data checks enforce instead of keeping their own copy of them.
    """
    shapes = input_shapes(model)
    if not shapes:
        raise ValueError(f"model {model.name!r} lists no input shape; expected one of "
                         f"{sorted(_INPUT_SHAPES) + ['mlp']}")
    dtype = jax.numpy.int32 if model.policy_input == "tokens" else jax.numpy.float32
    return jax.ShapeDtypeStruct((batch, *shapes[0]), dtype)


def _input_rule(model: RoutableModel) -> _InputRule:
    tokens = model.policy_input == "tokens"
    return _InputRule("int" if tokens else "float", input_shapes(model), tokens)


def _shape_text(shape: Sequence[int]) -> str:
    return f"[{', '.join(str(d) for d in shape)}]" if len(shape) else "scalar"


def _kind_ok(dtype: np.dtype, kind: str) -> bool:
    return np.issubdtype(dtype, np.floating if kind == "float" else np.integer)


def _blocks(array: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, len(array), _BLOCK_ROWS):
        yield start, array[start:start + _BLOCK_ROWS]


def _first_bad(array: np.ndarray, is_bad: Callable[[np.ndarray], np.ndarray]):
    """``(row, value, count)`` of the first bad element and the number of bad elements,
    or None; vectorized over row blocks, never per client."""
    first, count = None, 0
    for start, block in _blocks(array):
        bad = is_bad(block)
        n = int(np.count_nonzero(bad))
        if n and first is None:
            flat = int(np.flatnonzero(bad.reshape(-1))[0])
            row = start + flat // max(1, int(np.prod(block.shape[1:])))
            first = (row, block.reshape(-1)[flat])
        count += n
    return None if first is None else (*first, count)


class _SplitChecker:
    """Checks one split of one population against a model's input rule."""

    def __init__(self, name: str, data: Any, split: str, model: RoutableModel, rule: _InputRule):
        self.name, self.data, self.model, self.rule = f"{name}/{split}", data, model, rule
        self.ragged = data.splits[split]

    def fail(self, feature: str, text: str) -> None:
        raise ValueError(f"data {self.name}/{feature}{text}")

    def client_of(self, row: int) -> str:
        index = int(np.searchsorted(self.ragged.offsets, row, side="right")) - 1
        return str(self.data.client_ids[index])

    def check(self) -> None:
        for feature in ("x", "y"):
            if feature not in self.ragged.features:
                self.fail(feature, f": missing; expected features 'x' and 'y', got "
                                   f"{sorted(self.ragged.features)}")
        x, y = self.ragged.features["x"], self.ragged.features["y"]
        self.check_x_spec(x)
        self.check_y_spec(x, y)
        self.check_values("x", x)
        self.check_values("y", y)

    def check_example_spec(self) -> tuple[np.ndarray, np.ndarray]:
        """The data's ``example_spec`` against the model; empty ``x``, ``y`` of that spec."""
        spec = self.data.example_spec
        for feature in ("x", "y"):
            if feature not in spec:
                self.fail(feature, f": missing; expected features 'x' and 'y', got "
                                   f"{sorted(spec)}")
        x, y = (np.empty((0,) + tuple(spec[f][0]), spec[f][1]) for f in ("x", "y"))
        self.check_x_spec(x)
        self.check_y_spec(x, y)
        return x, y

    def expected_x(self) -> str:
        shapes = " or ".join(_shape_text(s) for s in self.rule.x_shapes) or "any shape"
        return f"expected {self.rule.x_kind} {shapes} per example for {self.model.name}"

    def check_x_spec(self, x: np.ndarray) -> None:
        shape_ok = not self.rule.x_shapes or tuple(x.shape[1:]) in self.rule.x_shapes
        if not (shape_ok and _kind_ok(x.dtype, self.rule.x_kind)):
            self.fail("x", f" is {x.dtype} {_shape_text(x.shape[1:])} per example: "
                           f"{self.expected_x()}")

    def check_y_spec(self, x: np.ndarray, y: np.ndarray) -> None:
        shape = tuple(x.shape[1:]) if self.rule.y_like_x else ()
        if tuple(y.shape[1:]) != shape or not _kind_ok(y.dtype, "int"):
            what = "one label per token" if self.rule.y_like_x else "one label per example"
            self.fail("y", f" is {y.dtype} {_shape_text(y.shape[1:])} per example: expected int "
                           f"{_shape_text(shape)} ({what})")

    def check_values(self, feature: str, array: np.ndarray) -> None:
        is_bad, expected = _value_rule(feature, array.dtype, self.model)
        bad = _first_bad(array, is_bad)
        if bad is not None:
            row, value, count = bad
            self.fail(feature, f"={value.item()!r} at client {self.client_of(row)!r} "
                               f"({count} bad value{'s' if count > 1 else ''}): {expected}")


def _value_rule(feature: str, dtype: np.dtype, model: RoutableModel
                ) -> tuple[Callable[[np.ndarray], np.ndarray], str]:
    """``(is_bad, what is expected)`` for the values of feature ``x`` or ``y``."""
    if np.issubdtype(dtype, np.floating):
        return (lambda b: ~np.isfinite(b)), "expected finite values"
    high = model.num_classes if feature == "y" else model.vocab_size
    what = "labels" if feature == "y" else "token ids"
    return ((lambda b: (b < 0) | (b >= high)),
            f"expected {what} in [0, {high}) for {model.name}")


def bad_values(feature: str, array: np.ndarray, model: RoutableModel) -> str | None:
    """``'<feature>=<first bad value> (<n> bad values): expected ...'``, or None when
    every value of ``array`` is one ``model`` takes (the rule ``validate_task`` applies).

    Example:
      >>> bad_values("y", np.array([3, 99]), get_model("emnist_cnn"))
      'y=99 (1 bad value): expected labels in [0, 62) for emnist_cnn'
    """
    if array.dtype.kind not in "fiu":  # a non-numeric feature; validate_task names it
        return None
    is_bad, expected = _value_rule(feature, array.dtype, model)
    bad = _first_bad(array, is_bad)
    if bad is None:
        return None
    _, value, count = bad
    return f"{feature}={value.item()!r} ({count} bad value{'s' if count > 1 else ''}): {expected}"


class _StoreChecker(_SplitChecker):
    """One split of an on-disk store, checked in O(1) from the value ranges its writer
    recorded (``flowjax.data.client_store``: min, max, non-finite count per feature)."""

    def __init__(self, name: str, data: Any, split: str, model: RoutableModel,
                 rule: _InputRule, ranges: dict[str, Any]):
        self.name, self.data, self.model, self.rule = f"{name}/{split}", data, model, rule
        self.ranges = ranges.get(split, {})

    def check(self) -> None:
        x, y = self.check_example_spec()
        self.check_range("x", x.dtype)
        self.check_range("y", y.dtype)

    def check_range(self, feature: str, dtype: np.dtype) -> None:
        recorded = self.ranges.get(feature)
        if recorded is None:
            self.fail(feature, ": no value range in the store's meta.json: reconvert it "
                               "with launch/convert.py --overwrite")
        where = "recorded in the store's meta.json"
        if np.issubdtype(dtype, np.floating):
            if recorded["nonfinite"]:
                self.fail(feature, f" has {recorded['nonfinite']} NaN or inf value(s) ({where}):"
                                   " expected finite values")
            return
        high = self.model.num_classes if feature == "y" else self.model.vocab_size
        what = "labels" if feature == "y" else "token ids"
        low_seen, high_seen = recorded["min"], recorded["max"]
        if low_seen is not None and (low_seen < 0 or high_seen >= high):
            self.fail(feature, f" spans [{low_seen}, {high_seen}] ({where}): expected {what} "
                               f"in [0, {high}) for {self.model.name}")


class _ClientChecker(_SplitChecker):
    """One split of data known only through the ``FederatedData`` protocol (neither
    in-memory splits nor a store's recorded value ranges): its ``example_spec``, then
    every client's rows, read once, against that spec and the model's value rules."""

    def __init__(self, name: str, data: Any, split: str, model: RoutableModel,
                 rule: _InputRule):
        self.name, self.data, self.model, self.rule = f"{name}/{split}", data, model, rule
        self.split, self.client = split, None

    def check(self) -> None:
        spec = dict(zip(("x", "y"), self.check_example_spec()))
        counts = np.asarray(self.data.num_examples(self.split))
        for index, client in enumerate(self.data.client_ids):
            if counts[index] == 0:
                continue  # nothing of it is ever read
            rows = self.data.client(index, self.split)
            for feature, empty in spec.items():
                array = np.asarray(rows[feature]) if feature in rows else None
                # The cohort casts to the spec's dtype: a kind that casts losslessly in
                # range (int64 labels for int32) is fine; the values are checked below.
                if (array is None or array.shape[1:] != empty.shape[1:]
                        or array.dtype.kind != empty.dtype.kind
                        or len(array) != counts[index]):
                    got = ("no such feature" if array is None else
                           f"{len(array)} rows of {array.dtype} "
                           f"{_shape_text(array.shape[1:])}")
                    self.fail(feature, f" of client {client!r}: {got}; expected "
                                       f"{counts[index]} rows (num_examples) of "
                                       f"{empty.dtype} {_shape_text(empty.shape[1:])}, its "
                                       f"example_spec")
                self.client = client
                self.check_values(feature, array)

    def client_of(self, row: int) -> str:
        return str(self.client)


def _check_store(name: str, data: Any, model: RoutableModel, rule: _InputRule) -> None:
    ranges = data.value_ranges
    if ranges is None:
        raise ValueError(f"data {name}: its store records no value ranges in meta.json "
                         "(converted by an older launch/convert.py): reconvert data.store_dir "
                         "with launch/convert.py --overwrite")
    for split in ("train", "test"):
        _StoreChecker(name, data, split, model, rule, ranges).check()
    if sum(int(np.sum(data.num_examples(split))) for split in ("train", "test")) == 0:
        raise ValueError(f"data {name}: every one of its {len(data.client_ids)} clients has 0 "
                         f"examples: expected at least one example")


def _check_population(name: str, data: Any, model: RoutableModel, rule: _InputRule) -> None:
    if len(data.client_ids) == 0:
        raise ValueError(f"data {name}: 0 clients: expected at least one client "
                         f"(a task without held-out clients has held_out=None)")
    splits = getattr(data, "splits", None)
    if splits is None:
        if hasattr(data, "value_ranges"):  # a store: checked from the ranges it recorded
            _check_store(name, data, model, rule)
        else:  # known only through the FederatedData protocol
            for split in ("train", "test"):
                _ClientChecker(name, data, split, model, rule).check()
        return
    for split in ("train", "test"):
        if split not in splits:
            raise ValueError(f"data {name}: missing split {split!r}; expected 'train' and "
                             f"'test', got {sorted(splits)}")
        _SplitChecker(name, data, split, model, rule).check()
    total = sum(int(splits[split].offsets[-1]) for split in ("train", "test"))
    if total == 0:
        raise ValueError(f"data {name}: every one of its {len(data.client_ids)} clients has 0 "
                         f"examples: expected at least one example")


def validate_cohort_size(config: Any, task: FederatedTask) -> None:
    """``clients_per_round`` against the training clients the data left after holding
    some out, naming the option that made them few.

    Raises:
      ValueError: more clients per round than training clients (one line).
    """
    available = len(task.train.client_ids)
    wanted = config.clients_per_round
    if wanted <= available:
        return
    cause = ""
    fraction = _field(config, "data.held_out_fraction")
    held = len(task.held_out.client_ids) if task.held_out is not None else 0
    if fraction is not _MISSING and fraction and held:
        cause = (f"; data.held_out_fraction={fraction!r} holds out {held} of "
                 f"{available + held} clients: lower it or clients_per_round")
    clients = f"{available} training client{'s' if available != 1 else ''}"
    _fail("clients_per_round", wanted, f"expected at most the {clients} of {task.name}{cause}")


def validate_task(task: FederatedTask, model: RoutableModel) -> None:
    """Checks loaded data against the model before anything is built or compiled.

    Labels must lie in ``[0, num_classes)``, float features must be finite, token ids
    must lie in ``[0, vocab_size)`` (and a store that records its number of token ids
    must have the model's ``vocab_size``), feature shapes and dtypes must be what the model
    takes, every population must have clients, and some training client must have
    training examples and some test examples (individual empty clients are fine: they
    weigh 0). In-memory data
    is checked as a whole, a store from the value ranges it recorded, and data known only
    through the ``FederatedData`` protocol by reading each client once.

    Raises:
      ValueError: one line naming the population, split, feature, value and client.
    """
    if task.token_ids is not None and task.token_ids != model.vocab_size:
        # Ids below both sizes would pass the range check, but oov/bos/eos would be
        # ordinary words to the model (its label weights place them by its own size).
        _fail("model_options.vocab_size", model.vocab_size,
              f"expected {task.token_ids}, the token ids {task.name} was converted with "
              f"({task.token_ids - 4} words + pad, oov, bos, eos), or convert again with "
              f"--vocab_size={model.vocab_size - 4}")
    rule = _input_rule(model)
    populations = {"train": task.train, "held_out": task.held_out}
    for name, data in populations.items():
        if data is not None:
            _check_population(name, data, model, rule)
    if int(np.sum(task.train.num_examples("train"))) == 0:
        raise ValueError(f"data train/train: all {len(task.train.client_ids)} training clients "
                         f"have 0 training examples: expected at least one")
    _check_some_test_example("train", task.train)


def _check_some_test_example(name: str, data: Any) -> None:
    # An evaluation scores the test split, and every run evaluates at its end: found here,
    # not after the run has trained.
    if int(np.sum(data.num_examples("test"))) == 0:
        raise ValueError(f"data {name}/test: all {len(data.client_ids)} clients have 0 test "
                         f"examples: expected at least one (evaluation scores the test split)")


def validate_evaluated_populations(config: Any, task: FederatedTask) -> None:
    """The held-out population, when the run evaluates it (``eval.held_out``), must have
    a test example (``validate_task`` checks the training clients').

    Raises:
      ValueError: one line naming the population.
    """
    held_out = _field(config, "eval.held_out")
    if task.held_out is not None and (held_out is _MISSING or held_out):
        _check_some_test_example("held_out", task.held_out)
