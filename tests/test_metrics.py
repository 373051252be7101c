"""The evaluation's two averages: per-client means (Acc_g, Acc_p, breakdown_client_mean)
and instance-pooled figures (acc_*_weighted, breakdown), each consistent with itself."""

import numpy as np
import pytest

from flowjax.evaluation.metrics import GROUPS, ClientCounts, summarize
from flowjax.reporting import comparison_csv, results_table

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
        correct_global_snapshot=zeros, snapshot_instances=zeros)


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


def test_results_written_before_the_client_mean_still_print():
    s = summarize(_counts(GROUP_COUNTS)).to_dict()
    del s["breakdown_client_mean"]
    row = results_table({"fedavg": {"populations": {"train_clients": s}}}).splitlines()[2]
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
