"""Whole runs through the public entry points: reproducibility, compilation, learning."""

import numpy as np
import pytest

from flowjax import config as run_config
from flowjax import experiment
from tests.helpers import small_config


def run(config):
    simulation = run_config.build_simulation(config)
    return simulation, experiment.run(simulation)


def test_same_seed_same_results_and_one_compilation_per_kind():
    config = small_config(**{"eval.every": 2, "num_rounds": 4})
    simulation, first = run(config)
    _, second = run(config)
    assert first.results_dict() == second.results_dict()
    def without_time(history):
        return [{k: v for k, v in h.items() if k != "elapsed_s"} for h in history]
    assert without_time(first.history) == without_time(second.history)
    # 4 rounds and 2 evaluations, each compiled exactly once.
    assert simulation.trace_counts == {"round": 1, "eval": 1}
    _, other_seed = run(small_config(**{"eval.every": 2, "num_rounds": 4, "seed": 1}))
    assert other_seed.results_dict() != first.results_dict()


def test_results_have_the_paper_fields():
    _, result = run(small_config(num_rounds=1))
    results = result.results_dict()
    for field in ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting", "num_eval_clients"):
        assert field in results
    assert set(results["breakdown"]) == {"both_correct", "global_only", "personalized_only", "neither"}
    assert sum(results["breakdown"].values()) == pytest.approx(1.0)
    assert results["num_eval_clients"] == 6
    assert set(results["populations"]) == {"train_clients", "held_out_clients"}
    summary = results["populations"]["train_clients"]
    assert summary["clients_benefiting"] + summary["clients_tied"] + summary["clients_hurt"] == pytest.approx(1)
    assert len(summary["q0_by_group"]["both_correct"]) == 4
    # The q0 histogram holds every instance of its group once per layer, and its bins
    # bracket the group's mean q0.
    from flowjax.evaluation.metrics import GROUPS, Q0_BINS
    centers = (np.arange(Q0_BINS) + 0.5) / Q0_BINS
    histograms = {g: np.asarray(summary["q0_histogram"][g]) for g in GROUPS}
    instances = sum(h[0].sum() for h in histograms.values())
    for group, histogram in histograms.items():
        assert histogram.shape == (4, Q0_BINS)
        totals = histogram.sum(axis=1)
        np.testing.assert_allclose(totals, totals[0], rtol=1e-5)
        assert totals[0] / instances == pytest.approx(summary["breakdown"][group], abs=1e-6)
        if totals[0] > 0:
            binned_mean = histogram @ centers / totals
            np.testing.assert_allclose(binned_mean, summary["q0_by_group"][group],
                                       atol=0.5 / Q0_BINS + 1e-6)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedavg_ft"])
def test_baselines_run_on_the_same_engine(algorithm):
    _, result = run(small_config(algorithm=algorithm, num_rounds=2))
    summary = result.summaries["train_clients"]
    if algorithm == "fedavg":
        assert summary.acc_p == summary.acc_g and summary.clients_tied == 1.0
    assert 0 < summary.acc_g < 1


def test_flow_training_loss_falls_on_the_default_data():
    config = small_config(num_rounds=12, clients_per_round=5, learning_rate=0.5)
    config.eval.held_out = False
    _, result = run(config)
    losses = [h["loss"] for h in result.history if h["kind"] == "train"]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses


def test_bad_values_fail_with_one_line_errors():
    with pytest.raises(ValueError, match="clients_per_round must be in \\[1, "):
        run_config.build_simulation(small_config(clients_per_round=10_000))
    with pytest.raises(ValueError, match="config.algorithm='flwo': expected one of"):
        run_config.build_simulation(small_config(algorithm="flwo"))
    with pytest.raises(ValueError, match="config.model='resnet': expected one of"):
        run_config.build_simulation(small_config(model="resnet"))


def test_per_method_rows_apply_only_to_their_method():
    from configs import shakespeare
    config = shakespeare.get_config("paper")
    config.algorithm = "ditto"
    assert run_config.effective_config(config).learning_rate == 0.1  # paper: baselines
    config.algorithm = "flow"
    assert run_config.effective_config(config).learning_rate == 0.11  # paper: Flow
    config.per_method = {"flow": {"no_such_field": 1}}
    with pytest.raises(ValueError, match="config.per_method.flow.no_such_field: no such field"):
        run_config.effective_config(config)


def test_held_out_evaluation_can_be_capped():
    config = small_config(num_rounds=1, **{"eval.held_out_clients": 3})
    simulation, result = run(config)
    held_out = simulation.eval_client_indices("held_out_clients")
    assert len(held_out) == 3 and len(set(held_out.tolist())) == 3
    assert result.summaries["held_out_clients"].num_clients <= 3
    np.testing.assert_array_equal(held_out, simulation.eval_client_indices("held_out_clients"))
