"""How many client updates each HypCluster cluster trained, from finished runs' records.

  python launch/cluster_shares.py runs/cmp/hypcluster runs/mini/fashion_mnist_0.1/hypcluster/seed_0

For each run folder: its HypCluster rounds (those after the FedAvg warm-up), the client
updates each cluster took over them, and the larger cluster's share of them (README,
"Baselines as implemented"). A round's ``updates_to_cluster{i}`` record is that count. Runs
made before it was logged have only ``clients_in_cluster{i}``, the share of the round's
clients with examples (skipped ones left out) that chose cluster ``i``; their counts are
that share times ``clients_per_round``, exact when no client was skipped (else refused)
and every sampled client has training examples (which the records cannot show: the
output says when counts are read this way).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from flowjax import run_folder
from launch import cli

_COUNT = re.compile(r"^updates_to_cluster(\d+)$")
_SHARE = re.compile(r"^clients_in_cluster(\d+)$")


def _matching(record: dict[str, Any], pattern: re.Pattern) -> dict[int, Any]:
    return {int(m.group(1)): value for key, value in record.items() if (m := pattern.match(key))}


def cluster_updates(workdir: str) -> tuple[int, list[int], bool]:
    """``(HypCluster rounds, client updates per cluster, from shares)`` of one finished run
    folder; ``from shares``: some round had only the shares (an older run).

    Raises:
      ValueError: not a finished HypCluster run, or a round whose shares give no exact
        count (skipped clients, no client counted, a share that is no whole number of
        the round's clients) (one line).
    """
    remedy = "expected a finished run folder of launch/train.py"
    config = run_folder.read_config(workdir, remedy)
    if config is None or run_folder.read_results(workdir, remedy) is None:
        raise ValueError(f"{workdir}: no config.json and results.json; {remedy}")
    if config.get("algorithm") != "hypcluster":
        raise ValueError(f"{workdir}: algorithm={config.get('algorithm')!r}; expected a "
                         "hypcluster run")
    clients = config["clients_per_round"]
    rounds, updates, from_shares = 0, {}, False
    for record in run_folder.read_metrics(workdir):
        counts, shares = _matching(record, _COUNT), _matching(record, _SHARE)
        if record.get("kind") != "train" or not (counts or shares):
            continue  # an evaluation, or a warm-up round (FedAvg: no clusters yet)
        rounds += 1
        if not counts:
            counts, from_shares = _counts_from_shares(workdir, record, shares, clients), True
        for cluster, count in counts.items():
            updates[cluster] = updates.get(cluster, 0) + round(count)
    return rounds, [updates.get(i, 0) for i in range(max(updates, default=-1) + 1)], from_shares


def _counts_from_shares(workdir: str, record: dict[str, Any], shares: dict[int, Any],
                        clients: int) -> dict[int, float]:
    where = f"{workdir}: round {record['round']}"
    if record.get("clients_skipped"):
        raise ValueError(f"{where}: {record['clients_skipped']:g} clients skipped and no "
                         "updates_to_cluster records; expected a run without skipped clients")
    counts = {}
    for cluster, share in shares.items():
        if share is None:
            raise ValueError(f"{where}: clients_in_cluster{cluster}=None (no client "
                             "counted); expected a share")
        count = share * clients
        if abs(count - round(count)) > 1e-6:
            raise ValueError(f"{where}: clients_in_cluster{cluster}={share} is no whole "
                             f"number of its {clients} clients")
        counts[cluster] = count
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+", help="finished HypCluster run folders")
    args = parser.parse_args(argv)
    for workdir in args.workdirs:
        try:
            rounds, updates, from_shares = cluster_updates(workdir)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        name, total = os.path.normpath(workdir), sum(updates)
        if not total:
            print(f"{name}: no HypCluster round recorded")
            continue
        larger = max(updates)
        per_cluster = ", ".join(f"cluster {i}: {n}" for i, n in enumerate(updates))
        note = (" [from shares x clients_per_round: exact if every sampled client had "
                "training examples]" if from_shares else "")
        print(f"{name}: {rounds} HypCluster rounds, {total} client updates ({per_cluster}); "
              f"larger cluster {larger} of {total} ({100 * larger / total:.0f}%){note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
