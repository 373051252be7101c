"""FedProx's Synthetic(alpha, beta) generator, the routed MLP and the quick config on them."""

import os
import sys

import jax
import numpy as np
import pytest

from flowjax.data import load_task
from flowjax.data.leaf_synthetic import generate_synthetic
from flowjax.models import get_model
from flowjax.models.base import forward
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sizes_split_and_determinism():
    task = load_task("leaf_synthetic", dict(num_clients=30, train_fraction=0.8, seed=5))
    again = load_task("leaf_synthetic", dict(num_clients=30, train_fraction=0.8, seed=5))
    other = load_task("leaf_synthetic", dict(num_clients=30, train_fraction=0.8, seed=6))
    data = task.train
    assert task.name == "leaf_synthetic_1_1" and task.held_out is None
    assert data.client_ids[:2] == ("f_00000", "f_00001")
    # FedProx's sizes: floor(lognormal(4, 2)) + 50, drawn first from the seed's generator.
    sizes = np.random.default_rng(5).lognormal(4, 2, 30).astype(np.int64) + 50
    n_train, n_test = data.num_examples("train"), data.num_examples("test")
    np.testing.assert_array_equal(n_train + n_test, sizes)
    np.testing.assert_array_equal(n_train, (0.8 * sizes).astype(np.int64))
    for split in ("train", "test"):
        np.testing.assert_array_equal(data.splits[split].features["x"],
                                      again.train.splits[split].features["x"])
        assert data.splits[split].features["x"].dtype == np.float32
        assert data.splits[split].features["x"].shape[1:] == (60,)
        y = data.splits[split].features["y"]
        assert y.dtype == np.int32 and 0 <= y.min() and y.max() < 10
    assert not np.array_equal(data.splits["train"].features["x"][:50],
                              other.train.splits["train"].features["x"][:50])
    capped = load_task("leaf_synthetic", dict(num_clients=30, max_examples=80, seed=5))
    np.testing.assert_array_equal(capped.train.num_examples("train")
                                  + capped.train.num_examples("test"), np.minimum(sizes, 80))


def test_inputs_follow_the_generators_covariance_and_labels_a_linear_model():
    xs, ys = generate_synthetic(1.0, 1.0, 40, seed=0)
    k = int(np.argmax([len(x) for x in xs]))  # the largest client: tight variance estimates
    assert len(xs[k]) > 500
    variance = xs[k].var(axis=0, ddof=1)
    expected = np.arange(1, 61, dtype=np.float64) ** -1.2  # Sigma = diag(j^-1.2)
    np.testing.assert_allclose(variance, expected, rtol=0.25)
    # y = argmax(x W_k + b_k): each client's labels are a linear function of its inputs, so
    # least squares on one-hot targets (plus a bias) recovers most of what the majority
    # class misses, on every client with 200+ examples and a majority below 90%.
    mixed = [j for j in range(40) if len(ys[j]) >= 200
             and np.bincount(ys[j]).max() < 0.9 * len(ys[j])]
    assert len(mixed) >= 3
    for j in mixed:
        x = np.concatenate([xs[j], np.ones((len(xs[j]), 1))], axis=1)
        fit = np.linalg.lstsq(x, np.eye(10)[ys[j]], rcond=None)[0]
        accuracy = np.mean(np.argmax(x @ fit, axis=1) == ys[j])
        majority = np.bincount(ys[j]).max() / len(ys[j])
        assert accuracy > majority + 0.75 * (1 - majority), (j, accuracy, majority)


@pytest.mark.parametrize("bad, message", [
    (dict(alpha=-1.0), "alpha=-1.0 (config.data.alpha): expected a finite number >= 0"),
    (dict(train_fraction=1.0),
     "train_fraction=1.0 (config.data.train_fraction): expected a number in (0, 1)"),
    (dict(num_clients=0), "num_clients=0 (config.data.num_clients): expected an integer >= 1"),
    (dict(max_examples=1),
     "max_examples=1 (config.data.max_examples): expected None (no cap) or an integer >= 2")])
def test_bad_arguments_fail_in_one_line(bad, message):
    with pytest.raises(ValueError) as error:
        load_task("leaf_synthetic", bad)
    assert str(error.value) == f"leaf_synthetic {message}"


def test_mlp_is_routable_per_layer():
    model = get_model("mlp", input_dim=60, hidden=(64, 64), num_classes=10)
    assert model.layer_names == ("fc1", "fc2", "fc3") and model.head_layers == ("fc3",)
    assert model.policy_input == "flat" and model.instance_ndim == 1
    params = model.init(jax.random.key(0))
    counts = [sum(a.size for a in jax.tree.leaves(params[name])) for name in model.layer_names]
    assert counts == [60 * 64 + 64, 64 * 64 + 64, 64 * 10 + 10]
    x = np.ones((3, 60), np.float32)
    logits = forward(model, params, x)
    assert logits.shape == (3, 10)
    # The chain is dense, relu, dense, relu, dense.
    h = np.maximum(x @ params["fc1"]["kernel"] + params["fc1"]["bias"], 0)
    h = np.maximum(h @ params["fc2"]["kernel"] + params["fc2"]["bias"], 0)
    np.testing.assert_allclose(logits, h @ params["fc3"]["kernel"] + params["fc3"]["bias"],
                               rtol=1e-5, atol=1e-5)


# -m slow (13 s in CI): test_launch's test_compare_writes_one_table_and_resumes runs the same
# config and methods through compare.py in CI and checks both rows, the CSV and a resume.
@pytest.mark.slow
def test_quick_config_compares_fedavg_and_flow_through_compare_py(tmp_path):
    command = [sys.executable, "launch/compare.py", "--config=configs/synthetic.py:quick",
               "--methods=fedavg,flow", f"--workdir={tmp_path}", "--config.num_rounds=3",
               "--config.data.num_clients=12", "--config.checkpoint_every=0"]
    done = forkserver.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| fedavg")
            or line.startswith("| flow")]
    assert [row.split(" | ")[:3] for row in rows] == [["| fedavg", "train_clients", "12"],
                                                       ["| flow", "train_clients", "12"]]
    assert (tmp_path / "comparison.md").exists()


def test_features_of_another_width_than_the_mlp_fail_in_one_line():
    from configs import synthetic
    from flowjax import config as run_config

    config = synthetic.get_config("quick")
    config.data.update(dimension=30, num_clients=5)
    with pytest.raises(ValueError, match=r"data train/train/x is float32 \[30\] per example: "
                                         r"expected float \[60\] per example for mlp"):
        run_config.build_simulation(config)
