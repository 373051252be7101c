"""launch/cluster_shares.py: HypCluster's client updates per cluster, from a run folder."""

import json
import shutil

import pytest

from flowjax import run_folder, runner
from launch import cluster_shares
from tests.helpers import small_synthetic_config


@pytest.fixture(scope="module")
def hypcluster_run(tmp_path_factory):
    """A finished 5-round HypCluster run (2 FedAvg warm-up rounds, 4 clients a round; the
    synthetic clients hold 43 to 320 training examples, so every sampled client trains)."""
    workdir = str(tmp_path_factory.mktemp("hypcluster"))
    config = small_synthetic_config(algorithm="hypcluster", num_rounds=5)
    config.methods.hypcluster.warmup_rounds = 2
    runner.run_config_to_workdir(config, workdir, progress=False)
    return workdir


def _hypcluster_records(workdir):
    return [r for r in run_folder.read_metrics(workdir)
            if r["kind"] == "train" and "clients_in_cluster0" in r]


def test_counts_the_logged_updates_and_the_shares_agree(hypcluster_run, capsys, tmp_path):
    rounds, updates, from_shares = cluster_shares.cluster_updates(hypcluster_run)
    assert (rounds, len(updates), from_shares) == (3, 2, False)  # warm-up: no clusters
    assert sum(updates) == 3 * 4
    records = _hypcluster_records(hypcluster_run)
    assert updates == [round(sum(r[f"updates_to_cluster{i}"] for r in records))
                       for i in range(2)]
    assert cluster_shares.main([hypcluster_run]) == 0
    larger = max(updates)
    assert capsys.readouterr().out.endswith(
        f"larger cluster {larger} of 12 ({100 * larger / 12:.0f}%)\n")
    # A run made before updates_to_cluster was logged: its shares give the same counts
    # here (every sampled client trained), and the output says how they were read.
    older = _copy_with_records(hypcluster_run, tmp_path / "older", [
        {k: v for k, v in r.items() if not k.startswith("updates_to_")}
        for r in run_folder.read_metrics(hypcluster_run)])
    assert cluster_shares.cluster_updates(older) == (3, updates, True)
    assert cluster_shares.main([older]) == 0
    assert capsys.readouterr().out.endswith("[from shares x clients_per_round: exact if every "
                                            "sampled client had training examples]\n")


def _copy_with_records(source, target, records, algorithm=None):
    shutil.copytree(source, target)
    run_folder.write_metrics(str(target), records)
    if algorithm is not None:
        config = json.loads((target / run_folder.CONFIG).read_text())
        (target / run_folder.CONFIG).write_text(json.dumps({**config, "algorithm": algorithm}))
    return str(target)


def test_rounds_whose_shares_give_no_exact_count_are_refused_in_one_line(
        hypcluster_run, tmp_path, capsys):
    """Without updates_to_cluster records: a round that skipped clients (their shares'
    denominator is the clients kept), a round with no client counted, a share that is
    no whole number of the round's clients."""
    bare = [{k: v for k, v in r.items() if not k.startswith("updates_to_")}
            for r in run_folder.read_metrics(hypcluster_run)]
    first = next(i for i, r in enumerate(bare) if "clients_in_cluster0" in r)
    cases = {
        "skipped": ({"clients_skipped": 2.0}, "2 clients skipped and no updates_to_cluster "
                    "records; expected a run without skipped clients"),
        "none": ({"clients_in_cluster0": None, "clients_in_cluster1": None},
                 "clients_in_cluster0=None (no client counted); expected a share"),
        "third": ({"clients_in_cluster0": 1 / 3, "clients_in_cluster1": 2 / 3},
                  f"clients_in_cluster0={1 / 3} is no whole number of its 4 clients"),
    }
    for name, (edit, message) in cases.items():
        records = [dict(r, **edit) if i == first else r for i, r in enumerate(bare)]
        workdir = _copy_with_records(hypcluster_run, tmp_path / name, records)
        assert cluster_shares.main([workdir]) == 2
        assert capsys.readouterr().err == (f"error: {workdir}: round {bare[first]['round']}: "
                                           f"{message}\n")


def test_a_folder_that_is_no_finished_hypcluster_run_is_one_line_and_exit_2(
        hypcluster_run, tmp_path, capsys):
    assert cluster_shares.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no config.json and results.json; "
                                       "expected a finished run folder of launch/train.py\n")
    other = _copy_with_records(hypcluster_run, tmp_path / "fedavg",
                               run_folder.read_metrics(hypcluster_run), algorithm="fedavg")
    assert cluster_shares.main([other]) == 2
    assert capsys.readouterr().err == (f"error: {other}: algorithm='fedavg'; expected a "
                                       "hypcluster run\n")
