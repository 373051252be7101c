r"""How much the authors' kNN-Per vote moves their scores, on a cell of the client_snapshot grid.

  python launch/knn_votes.py --datasets=fashion_mnist_0.1,fashion_mnist_0.6 --seeds=0,44,56

Their kNN-Per Acc_p (``methods.knn_per.reference_acc_p``, ``flowjax/algorithms/knn_per.py``)
adds ``lam sum_j exp(-d_j) onehot(label_j)`` over the k nearest datastore entries to
``(1 - lam)`` times the logits, with ``d`` the Euclidean distance between the input of
the first linear layer (9,216 values for the EMNIST CNN). For each cell of the
``knn_per_snapshot`` row this retrains it (the same config and seed as
``launch/reproduce.py --table=client_snapshot``: the same model, run for run), then for
every evaluated client (personalized with the final evaluation's key, so a
``client_snapshot`` copy is the one the run scored) and each of its test examples reports the distance to its nearest
entry, the largest vote, and how many predictions the vote changes (argmax of the scores
against argmax of the logits). It prints the run's Acc_g and their Acc_p, to be set beside
the table's.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from launch import cli


def client_votes(simulation, config, params) -> dict[str, np.ndarray]:
    """Per test example of every evaluated train client of ``simulation`` (kNN-Per with
    ``config``, its ``KnnPerConfig``, at server ``params``): the nearest entry's distance,
    the largest vote, whether the vote changed the prediction, whether their scores'
    prediction is right, and the client's index."""
    import jax
    import jax.numpy as jnp

    from flowjax.algorithms.knn_per import (embed_and_logits, nearest, reference_key_layer,
                                            reference_scores)
    from flowjax.core import prng
    from flowjax.core.cohort import assemble_cohort, client_at
    from flowjax.engine.round import eval_round_key

    algorithm, settings = simulation.algorithm, simulation.settings
    model = algorithm.model
    # The final evaluation's keys (its round index is the rounds done), so a
    # client_snapshot copy is the one the run scored.
    key_of_round = eval_round_key(simulation.seed_words,
                                  list(simulation.eval_populations()).index("train_clients"),
                                  settings.num_rounds)
    layer = reference_key_layer(model)
    data = simulation.eval_populations()["train_clients"]
    personalize = jax.jit(algorithm.personalize)

    @jax.jit
    def measure(personal, x, y):
        scored = personal.get("snapshot", params)
        queries, logits = embed_and_logits(model, scored, x, layer)
        store = personal["reference_store"]
        scores = reference_scores(store, queries, logits, config.neighbours, config.lam)
        neg_distance, _ = nearest(store, queries, config.neighbours)
        votes = scores - (1.0 - config.lam) * logits
        return (-neg_distance[:, 0], jnp.max(votes, axis=-1),
                jnp.argmax(scores, -1) != jnp.argmax(logits, -1),
                jnp.argmax(scores, -1) == y)

    rows: dict[str, list[np.ndarray]] = {"distance": [], "vote": [], "changed": [],
                                         "correct": [], "client": []}
    for index in simulation.eval_client_indices("train_clients"):
        cohort = {split: client_at(jax.tree.map(jnp.asarray, assemble_cohort(
            data, split, [index], num_clients=1, batch_size=settings.batch_size,
            padded_examples=padded, max_examples=settings.max_eval_examples)), 0)
            for split, padded in (("train", simulation.eval_train_examples),
                                  ("test", simulation.eval_test_examples))}
        personal = personalize(params, cohort["train"],
                               prng.client_key(key_of_round, cohort["train"].client_id))
        test = cohort["test"]
        for x, y, mask in zip(test.x, test.y, np.asarray(test.mask)):
            measured = [np.asarray(a)[mask] for a in measure(personal, x, y)]
            for name, value in zip(("distance", "vote", "changed", "correct"), measured):
                rows[name].append(value)
            rows["client"].append(np.full(int(mask.sum()), index))
    return {name: np.concatenate(values) for name, values in rows.items()}


def cell_votes(dataset: str, seed: str, scale: str) -> dict[str, Any]:
    """Retrains ``dataset``'s ``knn_per_snapshot`` cell at ``seed`` and measures it."""
    from flowjax import config as run_config
    from flowjax import experiment
    from launch import reproduce

    request = reproduce.build_request("client_snapshot", "unused", [seed], [dataset], scale,
                                      ["knn_per_snapshot"], [])
    config = reproduce.cell_config(request.cells[0], request)
    if not config.methods.knn_per.reference_acc_p:
        raise ValueError(f"--datasets={dataset}: its kNN-Per row has no reference Acc_p "
                         f"(model {config.model}); expected an image dataset")
    run = run_config.resolve(config)
    simulation = run_config.simulation_for(run)
    result = experiment.run(simulation)
    summary = result.summaries["train_clients"]
    return dict(summary=summary, **client_votes(simulation, run.method,
                                                result.final_state.params))


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="fashion_mnist_0.1,fashion_mnist_0.6",
                        help="comma-separated plan datasets with an image model")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--scale", default="mini", help="the grid's scale (mini or paper)")
    args = parser.parse_args(argv)
    print("dataset | seed | Acc_g | their Acc_p | test examples | nearest entry: min / "
          "median distance | largest vote | predictions the vote changed")
    for dataset in [d for d in args.datasets.split(",") if d]:
        for seed in [s for s in args.seeds.split(",") if s]:
            try:
                measured = cell_votes(dataset, seed, args.scale)
            except ValueError as error:
                parser.error(str(error))
            summary, distance = measured["summary"], measured["distance"]
            print(f"{dataset} | {seed} | {100 * summary.acc_g:.2f} | "
                  f"{100 * summary.acc_p_client_snapshot:.2f} | {distance.size} | "
                  f"{distance.min():.2f} / {np.median(distance):.2f} | "
                  f"{measured['vote'].max():.3e} | {int(measured['changed'].sum())}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
