"""How many client updates each HypCluster cluster trained, from finished runs' records.

  python launch/cluster_shares.py runs/cmp/hypcluster runs/mini/fashion_mnist_0.1/hypcluster/seed_0

For each run folder: its HypCluster rounds (those after the FedAvg warm-up), the client
updates each cluster took over them (``clients_in_cluster{i}``, the share of a round's
real clients that chose cluster ``i``, times ``clients_per_round``), and the larger
cluster's share of them (README, "Baselines as implemented"). A round's clients are all
real (the sampler draws ``clients_per_round`` of the training clients), so the products
are whole numbers; one that is not means another sampler, and the script says so.
"""

from __future__ import annotations

import os
import re
import sys

from flowjax import run_folder
from launch import cli

_SHARE = re.compile(r"^clients_in_cluster(\d+)$")


def cluster_updates(workdir: str) -> tuple[int, list[int]]:
    """``(HypCluster rounds, client updates per cluster)`` of one finished run folder.

    Raises:
      ValueError: not a finished HypCluster run, or a share that is no whole number of
        the round's clients (one line).
    """
    remedy = "expected a finished run folder of launch/train.py"
    config = run_folder.read_config(workdir, remedy)
    if config is None or run_folder.read_results(workdir, remedy) is None:
        raise ValueError(f"{workdir}: no config.json and results.json; {remedy}")
    if config.get("algorithm") != "hypcluster":
        raise ValueError(f"{workdir}: algorithm={config.get('algorithm')!r}; expected a "
                         "hypcluster run")
    clients = config["clients_per_round"]
    rounds, updates = 0, {}
    for record in run_folder.read_metrics(workdir):
        shares = {int(m.group(1)): value for key, value in record.items()
                  if (m := _SHARE.match(key))}
        if record.get("kind") != "train" or not shares:
            continue  # an evaluation, or a warm-up round (FedAvg: no clusters yet)
        rounds += 1
        for cluster, share in shares.items():
            count = share * clients
            if abs(count - round(count)) > 1e-6:
                raise ValueError(f"{workdir}: round {record['round']}: clients_in_cluster"
                                 f"{cluster}={share} is no whole number of its {clients} "
                                 "clients")
            updates[cluster] = updates.get(cluster, 0) + round(count)
    return rounds, [updates.get(i, 0) for i in range(max(updates, default=-1) + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+", help="finished HypCluster run folders")
    args = parser.parse_args(argv)
    for workdir in args.workdirs:
        try:
            rounds, updates = cluster_updates(workdir)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        total = sum(updates)
        larger = max(updates, default=0)
        per_cluster = ", ".join(f"cluster {i}: {n}" for i, n in enumerate(updates))
        print(f"{os.path.normpath(workdir)}: {rounds} HypCluster rounds, {total} client updates "
              f"({per_cluster}); larger cluster {larger} of {total}"
              f" ({100 * larger / total:.0f}%)" if total else
              f"{os.path.normpath(workdir)}: no HypCluster round recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
