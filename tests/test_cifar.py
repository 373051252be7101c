"""CIFAR Dirichlet partitions through TFDS's data_source, on tfds.testing.mock_data."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from flowjax.data import load_task
from flowjax.data.cifar import dirichlet_partition, label_skew
from tests.helpers import cifar_round_in_child


def test_partition_sizes_disjointness_and_renormalization():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 10)  # 10 examples per class
    probs = np.array([[1.0, 0, 0, 0]] * 4)  # everyone wants class 0, which runs out
    chosen = dirichlet_partition(labels, probs, per_client=10, rng=rng)
    assert chosen.shape == (4, 10)
    assert len(np.unique(chosen)) == 40  # disjoint, and the pool is used up exactly
    assert np.all(labels[chosen[0]] == 0)  # the first client gets its class
    with pytest.raises(ValueError, match="need 50 examples; the pool has 40"):
        dirichlet_partition(labels, np.full((5, 4), 0.25), per_client=10, rng=rng)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_dirichlet_tasks_from_tfds_mock(name):
    skew = {}
    with tfds.testing.mock_data(num_examples=600):
        for alpha in (0.1, 0.6):
            task = load_task(f"{name}_dirichlet", {"alpha": alpha, "num_clients": 20,
                                                   "train_per_client": 25, "test_per_client": 5})
            data = task.train
            np.testing.assert_array_equal(data.num_examples("train"), 25)
            np.testing.assert_array_equal(data.num_examples("test"), 5)
            x = data.client(3, "train")["x"]
            assert x.shape == (25, 32, 32, 3) and x.dtype == np.float32
            assert abs(float(data.splits["train"].features["x"].mean())) < 1.5  # standardized
            skew[alpha] = label_skew(task)
            assert task.name == f"{name}_dirichlet_{alpha:g}"
    assert skew[0.1] > skew[0.6], skew  # smaller alpha, more skewed clients


def test_config_partition_seed_is_data_seed():
    """configs/cifar.py's partition follows data.seed (default 0), not the run's seed."""
    from configs import cifar
    config = cifar.get_config("cifar10_0.1")
    assert config.data.seed == 0
    config.data.update(num_clients=20, train_per_client=25, test_per_client=5)

    def labels(seed):
        with tfds.testing.mock_data(num_examples=600):
            task = load_task(config.dataset, dict(config.data, seed=seed))
        return [task.train.client(i, "train")["y"].tolist() for i in range(20)]
    assert labels(0) == labels(0) != labels(1)


@pytest.mark.slow  # a child process, about 2.5 min on 2 cores (tests/helpers.py)
def test_cifar_config_trains_a_round_on_mock_data():
    assert 0 <= cifar_round_in_child("paper")["acc_p"] <= 1


@pytest.mark.parametrize("left_behind", [False, True])
@pytest.mark.parametrize("default_dir", [False, True])
def test_cifar_not_prepared_is_one_line_naming_the_preparation_command(tmp_path, monkeypatch,
                                                                      left_behind, default_dir):
    """A run reads prepared files only: no download started by a run, and one line saying
    how to prepare them (the README's command): in a given data_dir or TFDS's default one,
    also after a preparation that failed offline and left TFDS's ``incomplete.*`` folder
    (in the default folder TFDS then raises KeyError)."""
    if left_behind:
        (tmp_path / "cifar10" / "incomplete.K2J3QQ_3.0.2").mkdir(parents=True)
    options = {"data_dir": str(tmp_path)}
    if default_dir:
        from tensorflow_datasets.core import constants  # read at import, and per call
        monkeypatch.setattr(constants, "DATA_DIR", str(tmp_path))
        monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
        options = {}
    with pytest.raises(ValueError) as error:
        load_task("cifar10_dirichlet", options)
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"cifar10 is not prepared in {tmp_path}/cifar10/")
    assert ("tfds.builder('cifar10', file_format='array_record').download_and_prepare()"
            in message)
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "cifar10"])  # nothing downloaded
    if left_behind:
        assert list((tmp_path / "cifar10").iterdir()) == [tmp_path / "cifar10" / "incomplete.K2J3QQ_3.0.2"]

