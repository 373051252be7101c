"""launch/cluster_shares.py: HypCluster's client updates per cluster, from a run folder."""

import pytest

from flowjax import run_folder, runner
from launch import cluster_shares
from tests.helpers import small_synthetic_config


@pytest.fixture(scope="module")
def hypcluster_run(tmp_path_factory):
    """A finished 5-round HypCluster run (2 FedAvg warm-up rounds, 4 clients a round)."""
    workdir = str(tmp_path_factory.mktemp("hypcluster"))
    config = small_synthetic_config(algorithm="hypcluster", num_rounds=5)
    config.methods.hypcluster.warmup_rounds = 2
    runner.run_config_to_workdir(config, workdir, progress=False)
    return workdir


def test_counts_every_hypcluster_rounds_clients_once(hypcluster_run, capsys):
    rounds, updates = cluster_shares.cluster_updates(hypcluster_run)
    assert rounds == 3 and len(updates) == 2  # the warm-up's 2 rounds have no clusters
    assert sum(updates) == 3 * 4
    records = [r for r in run_folder.read_metrics(hypcluster_run)
               if r["kind"] == "train" and "clients_in_cluster0" in r]
    assert updates[0] == round(4 * sum(r["clients_in_cluster0"] for r in records))
    assert cluster_shares.main([hypcluster_run]) == 0
    larger = max(updates)
    assert capsys.readouterr().out.endswith(
        f"larger cluster {larger} of 12 ({100 * larger / 12:.0f}%)\n")


def test_a_folder_that_is_no_finished_hypcluster_run_is_one_line_and_exit_2(
        hypcluster_run, tmp_path, capsys):
    assert cluster_shares.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no config.json and results.json; "
                                       "expected a finished run folder of launch/train.py\n")
    other = tmp_path / "fedavg"
    other.mkdir()
    for name in (run_folder.CONFIG, run_folder.RESULTS):
        text = (open(run_folder.path(hypcluster_run, name)).read() if name == run_folder.RESULTS
                else open(run_folder.path(hypcluster_run, name)).read().replace(
                    '"algorithm": "hypcluster"', '"algorithm": "fedavg"'))
        (other / name).write_text(text)
    assert cluster_shares.main([str(other)]) == 2
    assert capsys.readouterr().err == (f"error: {other}: algorithm='fedavg'; expected a "
                                       "hypcluster run\n")
