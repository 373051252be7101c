"""The benchmark's helpers (the timed paths run in launch/benchmark.py itself)."""

import importlib.util

import numpy as np
import pytest

from launch import benchmark


def test_dashed_flag_names_become_absl_names():
    argv = ["benchmark.py", "--compare-torch", "--max-clients=4", "--models=a-b", "--", "--x-y"]
    assert benchmark.normalize_flag_spelling(argv) == [
        "benchmark.py", "--compare_torch", "--max_clients=4", "--models=a-b", "--", "--x-y"]


def test_skewed_sizes_are_the_stackoverflow_model():
    from flowjax.data.synthetic import stackoverflow_like_sizes
    np.testing.assert_array_equal(benchmark.client_sizes(50, 400, skewed=True),
                                  stackoverflow_like_sizes(50, 0))
    assert (benchmark.client_sizes(3, 400, skewed=False) == 400).all()


def test_padding_counts_what_each_mapping_executes():
    from flowjax.core.cohort import ClientExamples
    from flowjax.core.mapping import ClientMapping
    counts = np.array([40, 1, 20, 3])  # batch 10: 4, 1, 2, 1 steps
    cohort = ClientExamples(x=None, y=None, mask=None, num_examples=counts, client_id=None)
    loop = benchmark.mapping_padding(cohort, ClientMapping("loop"), 10)
    assert loop == {"useful_steps": 8, "executed_steps": 8, "step_efficiency": 1.0,
                    "example_efficiency": 64 / 80}
    vmap = benchmark.mapping_padding(cohort, ClientMapping("vmap"), 10)
    assert vmap["executed_steps"] == 16 and vmap["step_efficiency"] == 0.5
    chunked = benchmark.mapping_padding(cohort, ClientMapping("chunked", 2), 10)
    assert chunked["executed_steps"] == 4 + 4 + 1 + 1  # [4, 2] and [1, 1]


def test_cohort_sizes_double_up_to_the_maximum():
    assert benchmark.cohort_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert benchmark.cohort_sizes(6) == [1, 2, 4, 6]
    assert benchmark.cohort_sizes(1) == [1]


def test_torch_comparison_is_skipped_without_torch(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert benchmark.time_torch("emnist_cnn", None, 2, 1) is None
    assert "torch is not installed" in capsys.readouterr().out
    assert benchmark.time_torch("shakespeare_lstm", None, 2, 1) is None
    assert "only emnist_cnn" in capsys.readouterr().out


def test_torch_fedavg_round_is_the_weighted_mean_of_the_clients():
    torch = pytest.importorskip("torch")
    from launch import torch_reference
    rng = np.random.default_rng(0)
    model = torch_reference.emnist_cnn()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [torch_reference.client_batches(rng.normal(size=(n, 28, 28)).astype(np.float32),
                                              rng.integers(0, 62, n), 4, 2) for n in (8, 3)]
    assert [len(c) for c in clients] == [2, 1]  # no padding: 3 examples take one step
    for layer in model.modules():  # dropout off: the rounds below must be deterministic
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0
    alone = [torch_reference.fedavg_round(model, start, [batches], 0.1) for batches in clients]
    mean = torch_reference.fedavg_round(model, start, clients, 0.1)
    for name in start:
        expected = alone[0][name] * (8 / 11) + alone[1][name] * (3 / 11)
        assert torch.allclose(mean[name], expected, atol=1e-6)
    assert not torch.allclose(mean["0.weight"], start["0.weight"])  # it trained
