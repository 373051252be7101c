"""The evaluation's two averages: per-client means (Acc_g, Acc_p, breakdown_client_mean)
and instance-pooled figures (acc_*_weighted, breakdown), each consistent with itself; and
the engine's evaluation against a client-by-client computation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.core import prng
from flowjax.evaluation.metrics import GROUPS, ClientCounts, summarize
from flowjax.experiment import RunSettings, Simulation
from flowjax.reporting import comparison_csv, results_table
from tests.helpers import one_client

# Three clients of unequal sizes; groups = [both, global only, personalized only, neither].
GROUP_COUNTS = np.array([[5, 3, 1, 1], [0, 0, 2, 0], [1, 0, 0, 3]], np.float32)


def _counts(groups: np.ndarray) -> ClientCounts:
    clients = groups.shape[0]
    zeros = np.zeros(clients, np.float32)
    return ClientCounts(
        instances=groups.sum(axis=1), correct_global=groups[:, 0] + groups[:, 1],
        correct_personal=groups[:, 0] + groups[:, 2],
        correct_personal_soft=groups[:, 0] + groups[:, 2], groups=groups,
        q0_sums=np.zeros((clients, 4, 0), np.float32),
        q0_histogram=np.zeros((clients, 4, 0, 20), np.float32),
        correct_global_snapshot=zeros, snapshot_instances=zeros,
        correct_personal_snapshot=zeros, personal_snapshot_instances=zeros, loss_global=zeros,
        loss_personal=zeros, nonfinite=zeros)


def test_breakdown_and_accuracies_agree_under_each_average():
    s = summarize(_counts(GROUP_COUNTS))
    # By hand: client sizes 10, 2, 4.
    assert s.acc_g == pytest.approx((8 / 10 + 0 / 2 + 1 / 4) / 3, rel=1e-15)
    assert s.acc_g_weighted == pytest.approx(9 / 16, rel=1e-15)
    mean = s.breakdown_client_mean
    assert mean["both_correct"] == pytest.approx((5 / 10 + 0 + 1 / 4) / 3, rel=1e-15)
    assert mean["personalized_only"] == pytest.approx((1 / 10 + 2 / 2 + 0) / 3, rel=1e-15)
    assert s.breakdown["both_correct"] == pytest.approx(6 / 16, rel=1e-15)
    # The identities, each under one average, to float64 rounding.
    assert mean["both_correct"] + mean["global_only"] == pytest.approx(s.acc_g, rel=1e-15)
    assert mean["both_correct"] + mean["personalized_only"] == pytest.approx(s.acc_p, rel=1e-15)
    pooled = s.breakdown
    assert pooled["both_correct"] + pooled["global_only"] == pytest.approx(s.acc_g_weighted,
                                                                           rel=1e-15)
    assert pooled["both_correct"] + pooled["personalized_only"] == pytest.approx(
        s.acc_p_weighted, rel=1e-15)
    assert sum(mean.values()) == pytest.approx(1.0, rel=1e-15)
    # ... and the two averages really differ here (mixing them breaks the identity).
    assert abs(pooled["both_correct"] + pooled["global_only"] - s.acc_g) > 0.1


def test_spread_of_per_client_accuracy_for_both_models():
    # Per-client accuracies by hand: global 8/10, 0/2, 1/4; personalized 6/10, 2/2, 1/4.
    s = summarize(_counts(GROUP_COUNTS))
    for name, accuracies in (("acc_g", [0.8, 0.0, 0.25]), ("acc_p", [0.6, 1.0, 0.25])):
        got = [getattr(s, f"{name}_{statistic}") for statistic in ("std", "p10", "p90")]
        want = [np.std(accuracies), np.percentile(accuracies, 10),
                np.percentile(accuracies, 90)]
        assert got == pytest.approx(want, rel=1e-15), name
    # A client without test instances is not in the spread (nor in any mean).
    padded = summarize(_counts(np.concatenate([GROUP_COUNTS, np.zeros((1, 4), np.float32)])))
    assert (padded.acc_g_std, padded.acc_p_p10) == (s.acc_g_std, s.acc_p_p10)


def test_table_rows_use_one_average_and_say_which():
    s = summarize(_counts(GROUP_COUNTS)).to_dict()
    results = {"apfl": {"populations": {"train_clients": s}}}
    header, _, row = results_table(results).splitlines()
    assert "Acc_g (client mean)" in header and "both correct (client mean)" in header
    assert "global only (client mean)" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    value = dict(zip(columns, cells))
    assert value["Acc_g (client mean)"] == f"{100 * s['acc_g']:.2f}"
    assert value["both correct (client mean)"] == (
        f"{100 * s['breakdown_client_mean']['both_correct']:.2f}")
    csv_header, csv_row = comparison_csv(results).splitlines()
    csv = dict(zip(csv_header.split(","), csv_row.split(",")))
    for g in GROUPS:
        assert float(csv[f"{g}_client_mean"]) == pytest.approx(s["breakdown_client_mean"][g],
                                                               abs=1e-6)
        assert float(csv[f"{g}_weighted"]) == pytest.approx(s["breakdown"][g], abs=1e-6)


def test_table_marks_the_numbers_of_a_model_the_method_lacks():
    """The paper's "-": FedAvg has no Acc_p, Local no trained Acc_g; neither has a
    comparison of the two (benefiting, ties, breakdown). The CSV keeps every number."""
    s = summarize(_counts(GROUP_COUNTS)).to_dict()
    results = {name: {"algorithm": algorithm, "populations": {"train_clients": s}}
               for name, algorithm in (("fedavg_momentum", "fedavg"), ("local", "local"),
                                       ("fedavg_ft", "fedavg_ft"))}
    lines = results_table(results).splitlines()
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(columns, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    compared = columns[6:]
    assert rows["fedavg_momentum"]["Acc_g (client mean)"] == f"{100 * s['acc_g']:.2f}"
    assert [rows["fedavg_momentum"][c] for c in columns[4:]] == ["—"] * len(columns[4:])
    assert rows["local"]["Acc_g (client mean)"] == "—"
    assert rows["local"]["Acc_p (client mean)"] == f"{100 * s['acc_p']:.2f}"
    assert rows["local"]["Acc_p soft (client mean)"] == f"{100 * s['acc_p_soft']:.2f}"
    assert [rows["local"][c] for c in compared] == ["—"] * len(compared)
    assert "—" not in rows["fedavg_ft"].values()
    assert rows["fedavg_ft"]["% clients Acc_p > Acc_g"] == f"{100 * s['clients_benefiting']:.2f}"
    csv_rows = comparison_csv(results).splitlines()[1:]
    assert all("—" not in row and ",," not in row for row in csv_rows)


def test_results_written_before_the_client_mean_still_print():
    s = summarize(_counts(GROUP_COUNTS)).to_dict()
    del s["breakdown_client_mean"]
    row = results_table({"fedavg_ft": {"populations": {"train_clients": s}}}).splitlines()[2]
    assert row.rstrip(" |").endswith("n/a | n/a | n/a | n/a")


def test_clients_benefiting_over_the_snapshot_counts_strict_gains_over_it():
    """Flow's reference evaluation: Acc_p against the client's global-branch snapshot,
    strictly (the authors' harmed = before >= after), beside the server-model count."""
    counts = _counts(GROUP_COUNTS)  # Acc_p per client: 6/10, 2/2, 1/4
    counts = counts.replace(
        correct_global_snapshot=np.array([5.0, 2.0, 2.0], np.float32),
        snapshot_instances=counts.instances.astype(np.float32))
    s = summarize(counts)
    assert s.clients_benefiting_snapshot == pytest.approx(1 / 3, rel=1e-15)  # 6/10 > 5/10 only
    assert summarize(_counts(GROUP_COUNTS)).clients_benefiting_snapshot is None
    assert s.acc_p_client_snapshot is None and s.acc_p_client_snapshot_weighted is None


def test_routing_sums_over_clients_stay_exact_past_float32s_integers():
    """q0 sums and histogram counts are summed over clients in float64: in float32,
    2^24 + 1 + 1 instances would read 2^24 (each + 1 rounds away)."""
    counts = _counts(GROUP_COUNTS)
    q0 = np.zeros((3, 4, 1), np.float32)
    q0[:, 0, 0] = [2.0 ** 24, 1.0, 1.0]
    histogram = np.zeros((3, 4, 1, 20), np.float32)
    histogram[:, 0, 0, 19] = [2.0 ** 24, 1.0, 1.0]
    s = summarize(counts.replace(q0_sums=q0, q0_histogram=histogram))
    assert s.q0_histogram["both_correct"][0][19] == 2.0 ** 24 + 2
    groups = GROUP_COUNTS[:, 0].sum()
    assert s.q0_by_group["both_correct"][0] == (2.0 ** 24 + 2) / groups


def test_a_train_split_snapshot_is_averaged_over_its_own_instances():
    """FedAvg's ``snapshot_split="train"`` (their CIFAR-10 evaluation): each client's copy
    scores its correct train instances over its train instances, a client without any
    is left out of the copy's means (not counted as 0), and no client is counted as
    benefiting over it: Acc_p is the test split's."""
    counts = _counts(GROUP_COUNTS)  # test instances per client: 10, 2, 4
    counts = counts.replace(correct_global_snapshot=np.array([30.0, 0.0, 3.0], np.float32),
                            snapshot_instances=np.array([40.0, 0.0, 4.0], np.float32))
    s = summarize(counts, snapshot_split="train")
    assert s.acc_g_client_snapshot == pytest.approx((30 / 40 + 3 / 4) / 2, rel=1e-15)
    assert s.acc_g_client_snapshot_weighted == pytest.approx(33 / 44, rel=1e-15)
    assert s.clients_benefiting_snapshot is None
    assert s.acc_g == summarize(_counts(GROUP_COUNTS)).acc_g  # the test split's, untouched


def test_the_authors_personalized_model_is_scored_and_counted_against_the_snapshot():
    """HypCluster's client_snapshot: their fine-tuned model's accuracy beside Acc_p, and
    their harmed flag compares it (not Acc_p) with the global copy."""
    counts = _counts(GROUP_COUNTS)  # Acc_p per client: 6/10, 2/2, 1/4
    counts = counts.replace(
        correct_global_snapshot=np.array([5.0, 2.0, 2.0], np.float32),
        snapshot_instances=counts.instances.astype(np.float32),
        correct_personal_snapshot=np.array([6.0, 2.0, 3.0], np.float32),
        personal_snapshot_instances=counts.instances.astype(np.float32))
    s = summarize(counts)
    assert s.acc_p_client_snapshot == pytest.approx((6 / 10 + 2 / 2 + 3 / 4) / 3, rel=1e-15)
    assert s.acc_p_client_snapshot_weighted == pytest.approx(11 / 16, rel=1e-15)
    # Theirs 6/10 > 5/10, 2/2 = 2/2, 3/4 > 2/4: two of three, where Acc_p (6/10, 2/2,
    # 1/4) would count one.
    assert s.clients_benefiting_snapshot == pytest.approx(2 / 3, rel=1e-15)
    assert s.acc_p == pytest.approx((6 / 10 + 2 / 2 + 1 / 4) / 3, rel=1e-15)  # untouched


def test_the_authors_personalized_model_is_counted_only_against_a_snapshot():
    """Their harmed flag compares their Acc_p model with the model they score as Acc_g
    (kNN-Per's reference_acc_p reports the server model's logits as that snapshot); a
    personalized snapshot with no global one to beat gets no count."""
    counts = _counts(GROUP_COUNTS)  # Acc_g per client: 8/10, 0/2, 1/4
    theirs = counts.replace(
        correct_personal_snapshot=np.array([8.0, 1.0, 3.0], np.float32),
        personal_snapshot_instances=counts.instances.astype(np.float32))
    alone = summarize(theirs)
    assert alone.acc_p_client_snapshot == pytest.approx((8 / 10 + 1 / 2 + 3 / 4) / 3,
                                                        rel=1e-15)
    assert alone.acc_g_client_snapshot is None and alone.clients_benefiting_snapshot is None
    server = summarize(theirs.replace(correct_global_snapshot=counts.correct_global,
                                      snapshot_instances=counts.instances))
    assert server.acc_g_client_snapshot == server.acc_g
    # Theirs 8/10 = 8/10, 1/2 > 0/2, 3/4 > 1/4: two of three.
    assert server.clients_benefiting_snapshot == pytest.approx(2 / 3, rel=1e-15)
    assert summarize(_counts(GROUP_COUNTS)).clients_benefiting_snapshot is None


def test_non_finite_predictions_count_as_wrong_and_are_reported():
    from flowjax.core.losses import correct
    inf = jnp.inf
    logits = jnp.array([[jnp.nan, 0.0, 1.0], [0.0, inf, 1.0], [-inf, -inf, -inf],
                        [0.0, 2.0, 1.0], [-inf, 0.0, -inf]])
    # argmax picks the NaN's class 0, the inf's class 1 and class 0 of an all -inf row:
    # all three count as wrong. -inf beside a finite maximum is a log-probability of 0
    # (kNN-Per at lam=1), a valid prediction.
    assert correct(logits, jnp.array([0, 1, 0, 1, 1])).tolist() == [False, False, False,
                                                                     True, True]
    counts = _counts(GROUP_COUNTS).replace(nonfinite=np.array([0, 2, 4], np.float32))
    s = summarize(counts, ["a", "b", "c"])
    assert (s.clients_nonfinite, s.first_nonfinite_client) == (2, "b")
    assert (summarize(_counts(GROUP_COUNTS)).clients_nonfinite,
            summarize(_counts(GROUP_COUNTS)).first_nonfinite_client) == (0, None)


def test_routing_client_skips_a_client_whose_loss_difference_is_not_finite():
    from flowjax.evaluation.metrics import routing_client
    clients = GROUP_COUNTS.shape[0]
    routed = _counts(GROUP_COUNTS).replace(
        q0_sums=np.zeros((clients, 4, 2), np.float32),
        q0_histogram=np.zeros((clients, 4, 2, 20), np.float32),
        loss_global=np.array([np.nan, 1.0, 3.0], np.float32),
        loss_personal=np.array([0.0, 0.5, 1.0], np.float32))
    # Gaps per instance: NaN, 0.25, 0.5; np.argmax would pick the NaN's client "a".
    assert routing_client(routed, ["a", "b", "c"])["client_id"] == "c"
    diverged = routed.replace(loss_personal=np.full(clients, np.nan, np.float32))
    assert routing_client(diverged, ["a", "b", "c"]) is None


@pytest.mark.parametrize("method", ["fedavg_ft", "flow_fixed_q0_0.3"])
def test_evaluation_counts_equal_a_client_by_client_computation(method, mlp, images_small):
    """Simulation.evaluate against the definition: each client personalized on its train
    split with its (seed, population, round, client) key, then Acc_g, Acc_p and soft
    Acc_p counted on its test split and averaged over clients."""
    sgd = SGDConfig(learning_rate=0.5, epochs=2, batch_size=4)
    x0 = jnp.asarray(images_small.train.client(0, "train")["x"][:4])
    algorithm = (fedavg(mlp, FedAvgConfig(sgd=sgd, finetune=True)) if method == "fedavg_ft"
                 else flow(mlp, FlowConfig(sgd=sgd, gamma=0.01, fixed_q0=0.3,
                                           policy_hidden=(16, 16)), x0))
    settings = RunSettings(seed=5, num_rounds=1, clients_per_round=3, batch_size=4,
                           eval_held_out=False)
    simulation = Simulation(algorithm, images_small, settings, server_optimizer=optax.sgd(1.0))
    params = simulation.init_state().params
    summary = simulation.evaluate(params, round_index=7)["train_clients"]

    stream = jax.random.fold_in(prng.base_key(5, prng.Purpose.EVAL), 0)  # population 0
    accuracies = {"g": [], "p": [], "soft": []}
    gaps = []
    # Jitted once for all clients (same padded shapes); op by op it took 10 s of CI.
    personalize, predict = jax.jit(algorithm.personalize), jax.jit(algorithm.predict)
    for index in range(len(images_small.train.client_ids)):
        train = one_client(images_small, index, simulation.eval_train_examples)
        key = prng.client_key(prng.round_key(stream, 7), train.client_id)
        personal = personalize(params, train, key, None)
        test = images_small.train.client(index, "test")
        predictions = predict(params, personal, jnp.asarray(test["x"]))
        y = np.asarray(test["y"])
        for name, logits in (("g", predictions.global_logits), ("p", predictions.personal_hard),
                             ("soft", predictions.personal_soft)):
            accuracies[name].append(np.mean(np.argmax(np.asarray(logits), -1) == y))
        losses = [float(np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)))
                  for logits in (predictions.global_logits, predictions.personal_hard)]
        gaps.append((losses[0] - losses[1], index, losses, len(y)))
    got = (summary.acc_g, summary.acc_p, summary.acc_p_soft)
    want = tuple(float(np.mean(accuracies[name])) for name in ("g", "p", "soft"))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    if method == "fedavg_ft":
        assert summary.routing_client is None  # no routing
        return
    assert summary.acc_p_soft != summary.acc_p  # soft and hard routing differ at q0 = 0.3
    # The routing figure's client: the largest loss gap, with its own instances only.
    gap, index, losses, instances = max(gaps, key=lambda g: g[0])
    assert sorted(g[0] for g in gaps)[-2] < gap  # one client, not a tie
    chosen = summary.routing_client
    assert chosen["client_id"] == images_small.train.client_ids[index]
    np.testing.assert_allclose([chosen["loss_g"], chosen["loss_p"]], losses, rtol=1e-5)
    assert chosen["instances"] == instances
    assert sum(chosen["groups"].values()) == instances
    layers = algorithm.model.num_layers
    for group in GROUPS:  # q0 = 0.3 everywhere: bin 6 of 20 holds each group whole
        want = np.zeros((layers, 20))
        want[:, 6] = chosen["groups"][group]
        assert np.array_equal(chosen["q0_histogram"][group], want)
        assert chosen["q0_by_group"][group] == ([pytest.approx(0.3)] * layers
                                                if chosen["groups"][group] else [None] * layers)
