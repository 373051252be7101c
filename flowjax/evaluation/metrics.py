"""Evaluation as the paper defines it (Sec. 5, Appendix E.1, E.4-E.6).

For each evaluated client: personalize from the current server params on the client's
train split, then on its test split count, per instance, whether the global model and the
(hard-routed) personalized model are correct, and the soft-routed accuracy. The counts
are fixed-size arrays, so many clients are evaluated in one mapped, jitted call; the
host turns them into the paper's aggregates.

Groups of the 2x2 breakdown, in this order everywhere: both correct, global only,
personalized only, neither.

Two averages, never mixed in one figure: ``acc_*`` and ``breakdown_client_mean`` are
means over clients of per-client fractions (the paper's accuracy formula, and Figure 3's
breakdown "averaged over the test splits of all clients", which ``launch/plot.py`` draws),
so ``both_correct + global_only = acc_g`` and ``both_correct + personalized_only = acc_p``;
``acc_*_weighted`` and ``breakdown`` pool the instances of all clients, with the same
identities against ``acc_*_weighted`` (``results.json``'s top-level ``breakdown`` is this
pooled one, beside the client-mean ``acc_g`` / ``acc_p``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flowjax.core.cohort import ClientExamples
from flowjax.core.losses import correct, finite_rows, weighted_cross_entropy
from flowjax.engine.protocol import FederatedAlgorithm
from flowjax.models.base import instance_weights

GROUPS = ("both_correct", "global_only", "personalized_only", "neither")
# Equal-width bins of q0 on [0, 1]: a histogram sums over clients (quantiles do not), so the
# routing box plots come from one fixed-size array per client.
Q0_BINS = 20


@flax.struct.dataclass
class ClientCounts:
    """Weighted instance counts of one client's test split.

    Attributes:
      instances: number of counted instances (examples, or non-pad tokens).
      correct_global, correct_personal, correct_personal_soft: correct instances.
      groups: ``[4]`` instances per breakdown group (see ``GROUPS``).
      q0_sums: ``[4, L]`` summed ``q0`` per group and routed layer (L = 0 without routing).
      q0_histogram: ``[4, L, Q0_BINS]`` weighted instances per group, layer and q0 bin.
      correct_global_snapshot, snapshot_instances: correct and counted instances of the
        method's client-side global snapshot (``Predictions.global_snapshot``); both 0
        for methods without one.
      correct_personal_snapshot, personal_snapshot_instances: the same of the method's
        personalized model of the authors' evaluation (``Predictions.personal_snapshot``).
      loss_global, loss_personal: summed cross-entropy of the global and the (hard-routed)
        personalized model; they pick the client of the paper's single-client routing
        figure (``routing_client``). Both 0 for methods without routing.
      nonfinite: counted instances whose global, personalized, soft-routed or snapshot
        prediction has a NaN or no finite largest logit (a diverged personalization,
        ``losses.finite_rows``); they count as wrong.
    """

    instances: jax.Array
    correct_global: jax.Array
    correct_personal: jax.Array
    correct_personal_soft: jax.Array
    groups: jax.Array
    q0_sums: jax.Array
    q0_histogram: jax.Array
    correct_global_snapshot: jax.Array
    snapshot_instances: jax.Array
    correct_personal_snapshot: jax.Array
    personal_snapshot_instances: jax.Array
    loss_global: jax.Array
    loss_personal: jax.Array
    nonfinite: jax.Array


def _scored(logits: jax.Array | None, y: jax.Array,
            weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(correct, counted) instances of a model's ``logits`` (zeros for a model the
    method does not have)."""
    if logits is None:
        return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    return jnp.sum(correct(logits, y) * weights), jnp.sum(weights)


def batch_counts(algorithm: FederatedAlgorithm, params: Any, personal: Any, x: jax.Array,
                 y: jax.Array, example_mask: jax.Array) -> ClientCounts:
    """Counts of one test batch."""
    predictions = algorithm.predict(params, personal, x)
    weights = instance_weights(algorithm.model, y, example_mask.astype(jnp.float32),
                               for_metrics=True)
    global_ok = correct(predictions.global_logits, y)
    personal_ok = correct(predictions.personal_hard, y)
    soft_ok = correct(predictions.personal_soft, y)
    finite = (finite_rows(predictions.global_logits) & finite_rows(predictions.personal_hard)
              & finite_rows(predictions.personal_soft))
    for snapshot in (predictions.global_snapshot, predictions.personal_snapshot):
        if snapshot is not None:  # scored too, so counted too
            finite &= finite_rows(snapshot)
    group_masks = jnp.stack([global_ok & personal_ok, global_ok & ~personal_ok,
                             ~global_ok & personal_ok, ~global_ok & ~personal_ok])
    group_weights = group_masks.astype(jnp.float32) * weights  # [4, *instance]
    q0 = predictions.q0  # [*instance, L]
    q0_sums = jnp.einsum("g...,...l->gl", group_weights, q0)
    bins = jnp.clip(jnp.floor(q0 * Q0_BINS).astype(jnp.int32), 0, Q0_BINS - 1)
    q0_histogram = jnp.einsum("g...,...lb->glb", group_weights,
                              jax.nn.one_hot(bins, Q0_BINS, dtype=jnp.float32))
    if q0.shape[-1]:  # only routing methods have a routing figure to pick a client for
        loss_global = weighted_cross_entropy(predictions.global_logits, y, weights)[0]
        loss_personal = weighted_cross_entropy(predictions.personal_hard, y, weights)[0]
    else:
        loss_global = loss_personal = jnp.zeros((), jnp.float32)

    snapshot_correct, snapshot_instances = _scored(predictions.global_snapshot, y, weights)
    personal_snapshot_correct, personal_snapshot_instances = _scored(
        predictions.personal_snapshot, y, weights)
    return ClientCounts(
        instances=jnp.sum(weights),
        correct_global=jnp.sum(global_ok * weights),
        correct_personal=jnp.sum(personal_ok * weights),
        correct_personal_soft=jnp.sum(soft_ok * weights),
        groups=jnp.sum(group_weights.reshape(4, -1), axis=1),
        q0_sums=q0_sums, q0_histogram=q0_histogram,
        correct_global_snapshot=snapshot_correct, snapshot_instances=snapshot_instances,
        correct_personal_snapshot=personal_snapshot_correct,
        personal_snapshot_instances=personal_snapshot_instances,
        loss_global=loss_global, loss_personal=loss_personal,
        nonfinite=jnp.sum(~finite * weights))


def _summed(counts: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], Any],
            split: ClientExamples) -> Any:
    """``counts(index, x, y, mask)`` of each batch of ``split``, summed over the batches."""

    def step(total, batch):
        return jax.tree.map(jnp.add, total, counts(*batch)), None

    batches = (jnp.arange(split.x.shape[0], dtype=jnp.int32), split.x, split.y, split.mask)
    zeros = jax.tree.map(jnp.zeros_like,
                         jax.eval_shape(lambda b: counts(*b),
                                        jax.tree.map(lambda a: a[0], batches)))
    total, _ = jax.lax.scan(step, zeros, batches)
    return total


def evaluate_client(algorithm: FederatedAlgorithm, params: Any, train: ClientExamples,
                    test: ClientExamples, key: jax.Array, client_state: Any = None) -> ClientCounts:
    """Personalize on ``train`` and count on ``test`` (one client; map it for many); the
    ``index``-th batch is predicted with ``algorithm.for_test_batch(personal, index)``.

    With ``algorithm.snapshot_split == "train"`` the client-side snapshot's counts are
    those of ``train`` instead (every other count stays the test split's); only the
    snapshot is scored there.
    """
    personal = algorithm.personalize(params, train, key, client_state)

    def personal_of(index):
        return algorithm.for_test_batch(personal, index)

    def test_counts(index, x, y, mask):
        return batch_counts(algorithm, params, personal_of(index), x, y, mask)

    total = _summed(test_counts, test)
    if algorithm.snapshot_split == "train":
        def snapshot_counts(index, x, y, mask):
            logits = algorithm.predict(params, personal_of(index), x).global_snapshot
            weights = instance_weights(algorithm.model, y, mask.astype(jnp.float32),
                                       for_metrics=True)
            return _scored(logits, y, weights)

        snapshot_correct, snapshot_instances = _summed(snapshot_counts, train)
        total = total.replace(correct_global_snapshot=snapshot_correct,
                              snapshot_instances=snapshot_instances)
    return total


@dataclasses.dataclass(frozen=True)
class EvalSummary:
    """Aggregates over an evaluation population (what ``results.json`` reports)."""

    num_clients: int
    acc_g: float
    acc_p: float
    acc_p_soft: float
    acc_g_weighted: float
    acc_p_weighted: float
    acc_p_soft_weighted: float
    # Acc_p > Acc_g, ==, < (strictly): baselines.md's "hurt" (Acc_p <= Acc_g) is
    # clients_hurt + clients_tied, reported apart so ties show.
    clients_benefiting: float
    clients_tied: float
    clients_hurt: float
    breakdown: dict[str, float]
    q0_by_group: dict[str, list[float | None]]
    # The spread of per-client accuracy (population std, 10th and 90th percentile).
    acc_p_std: float
    acc_p_p10: float
    acc_p_p90: float
    # Acc_g's spread too; None in summaries saved before it was reported.
    acc_g_std: float | None = None
    acc_g_p10: float | None = None
    acc_g_p90: float | None = None
    # Default so summaries saved in checkpoints before the histogram existed still load.
    q0_histogram: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    # Flow's reference evaluation, the client_snapshot of the baselines that have one and
    # kNN-Per's reference_acc_p only: accuracy of the model the authors' evaluation scores
    # as Acc_g (their "before_accuracy": the client's copy of the global model; kNN-Per's
    # without client_snapshot, as their EMNIST code, the server model: acc_g), beside Acc_g.
    acc_g_client_snapshot: float | None = None
    acc_g_client_snapshot_weighted: float | None = None
    # Share of clients whose Acc_p (acc_p_client_snapshot where there is one) beats that
    # snapshot strictly (the authors' count: ``harmed = before_accuracy >=
    # after_accuracy``), beside ``clients_benefiting``.
    clients_benefiting_snapshot: float | None = None
    # The accuracy of the personalized model the authors' evaluation scores where it is
    # not the method's own (their "after_accuracy": HypCluster's client_snapshot, the
    # cluster fine-tuned E epochs; kNN-Per's reference_acc_p), beside Acc_p.
    acc_p_client_snapshot: float | None = None
    acc_p_client_snapshot_weighted: float | None = None
    # The breakdown as a mean over clients of each client's group fractions (pairs with
    # acc_g / acc_p; ``breakdown`` pools instances and pairs with acc_*_weighted). Empty
    # in summaries saved before it existed.
    breakdown_client_mean: dict[str, float] = dataclasses.field(default_factory=dict)
    # Routing methods only: the one client of the paper's routing figure (Appendix E),
    # ``routing_client``'s dict; None without routing and in summaries saved before it.
    routing_client: dict[str, Any] | None = None
    # Clients with a non-finite prediction on some test instance (a diverged
    # personalization; those predictions count as wrong), and the first of them by
    # evaluation order (None when there is none or no client names were given).
    clients_nonfinite: int = 0
    first_nonfinite_client: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def routing_client(counts: ClientCounts, client_ids: Sequence[str]) -> dict[str, Any] | None:
    """The client of the paper's routing figure (Appendix E: "the client which had the
    highest loss difference between its global and personalized models"), with its own
    q0 statistics per group and layer.

    The difference is read as the global model's mean test loss minus the personalized
    model's, so the client personalization helped most (the lowest position on a tie).
    None for methods without routing.

    Args:
      counts: stacked per-client counts (numpy), one row per evaluated client.
      client_ids: the evaluated clients' names, in the rows' order.

    Returns:
      ``client_id``, ``loss_g`` and ``loss_p`` (mean per instance), ``instances``,
      ``groups`` (instances per group), ``q0_by_group`` (``{group: [L]}``, None for an
      empty group) and ``q0_histogram`` (``{group: [L][bins]}``), as JSON values. None
      too when no client's loss difference is finite.
    """
    counts = jax.tree.map(np.asarray, counts)
    if counts.q0_sums.shape[-1] == 0:
        return None
    n = counts.instances.astype(np.float64)
    keep = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        gap = (counts.loss_global - counts.loss_personal) / n
    candidates = keep & np.isfinite(gap)  # a diverged client has no loss difference
    if not np.any(candidates):
        return None
    c = int(np.argmax(np.where(candidates, gap, -np.inf)))
    groups = counts.groups[c].astype(np.float64)
    return {
        "client_id": str(client_ids[c]),
        "loss_g": float(counts.loss_global[c] / n[c]),
        "loss_p": float(counts.loss_personal[c] / n[c]),
        "instances": float(n[c]),
        "groups": {group: float(groups[g]) for g, group in enumerate(GROUPS)},
        "q0_by_group": {group: (counts.q0_sums[c, g] / groups[g]).tolist() if groups[g] > 0
                        else [None] * counts.q0_sums.shape[-1]
                        for g, group in enumerate(GROUPS)},
        "q0_histogram": {group: counts.q0_histogram[c, g].tolist()
                         for g, group in enumerate(GROUPS)},
    }


def _spread(name: str, accuracies: np.ndarray) -> dict[str, float]:
    """``EvalSummary``'s spread fields of one accuracy over clients: population std and
    10th / 90th percentile."""
    return {f"{name}_std": float(np.std(accuracies)),
            f"{name}_p10": float(np.percentile(accuracies, 10)),
            f"{name}_p90": float(np.percentile(accuracies, 90))}


def summarize(counts: ClientCounts, client_ids: Sequence[str] | None = None,
              snapshot_split: str = "test") -> EvalSummary:
    """The paper's aggregates from stacked per-client counts (numpy on the host).

    Per-client accuracy is averaged over clients with at least one counted instance (the
    paper's formula), and so is ``breakdown_client_mean``; ``*_weighted`` and
    ``breakdown`` pool instances. A client benefits when ``Acc_p > Acc_g`` strictly; ties
    are reported separately. A diverged prediction (``losses.finite_rows``) counts as
    wrong, and ``clients_nonfinite`` counts the clients that had one. With ``client_ids``
    (the rows' clients) a routing method's summary also holds ``routing_client``. A
    snapshot counted on the train split (``snapshot_split``, the algorithm's) has its
    accuracies but no ``clients_benefiting_snapshot``: Acc_p is the test split's.
    """
    counts = jax.tree.map(np.asarray, counts)
    keep = counts.instances > 0
    if not np.any(keep):
        raise ValueError("no evaluation client has a test instance; cannot summarize")
    n = counts.instances[keep].astype(np.float64)  # float64: the identities above hold to 1e-15
    acc = {name: getattr(counts, f"correct_{name}")[keep] / n
           for name in ("global", "personal", "personal_soft")}
    total = float(np.sum(n))
    groups = counts.groups[keep].sum(axis=0, dtype=np.float64)
    group_fractions = counts.groups[keep] / n[:, None]  # [clients, 4]
    # float64 over clients, as the other sums: numpy adds along axis 0 one row at a time,
    # and float32 counts stop being exact past 2^24 instances (Stack Overflow's).
    q0_sums = counts.q0_sums[keep].sum(axis=0, dtype=np.float64)  # [4, L]
    q0_histogram = counts.q0_histogram[keep].sum(axis=0, dtype=np.float64)  # [4, L, bins]
    # None (JSON null) marks a group without instances, so results compare and serialize.
    q0_by_group = {group: (q0_sums[g] / groups[g]).tolist() if groups[g] > 0
                   else [None] * q0_sums.shape[1]
                   for g, group in enumerate(GROUPS)}
    difference = acc["personal"] - acc["global"]
    diverged = np.flatnonzero(keep & (counts.nonfinite > 0))
    snapshot = {}
    # Over the clients whose snapshot counted an instance: all of ``keep`` on the test
    # split, on the train split (``FederatedAlgorithm.snapshot_split``) those with one.
    scored = counts.snapshot_instances[keep] > 0
    if np.sum(counts.personal_snapshot_instances[keep]) > 0:
        acc["personal_snapshot"] = counts.correct_personal_snapshot[keep] / n
        snapshot.update(
            acc_p_client_snapshot=float(np.mean(acc["personal_snapshot"])),
            acc_p_client_snapshot_weighted=float(
                np.sum(counts.correct_personal_snapshot[keep], dtype=np.float64) / total))
    if np.any(scored):
        snapshot_n = counts.snapshot_instances[keep][scored].astype(np.float64)
        snapshot_correct = counts.correct_global_snapshot[keep][scored]
        snapshot_acc = snapshot_correct / snapshot_n
        their_personal = acc.get("personal_snapshot", acc["personal"])[scored]
        snapshot.update(
            acc_g_client_snapshot=float(np.mean(snapshot_acc)),
            acc_g_client_snapshot_weighted=float(
                np.sum(snapshot_correct, dtype=np.float64) / np.sum(snapshot_n)),
            clients_benefiting_snapshot=(float(np.mean(their_personal > snapshot_acc))
                                         if snapshot_split == "test" else None))
    return EvalSummary(
        num_clients=int(np.sum(keep)),
        acc_g=float(np.mean(acc["global"])),
        acc_p=float(np.mean(acc["personal"])),
        acc_p_soft=float(np.mean(acc["personal_soft"])),
        acc_g_weighted=float(np.sum(counts.correct_global[keep], dtype=np.float64) / total),
        acc_p_weighted=float(np.sum(counts.correct_personal[keep], dtype=np.float64) / total),
        acc_p_soft_weighted=float(np.sum(counts.correct_personal_soft[keep], dtype=np.float64)
                                  / total),
        clients_benefiting=float(np.mean(difference > 0)),
        clients_tied=float(np.mean(difference == 0)),
        clients_hurt=float(np.mean(difference < 0)),
        breakdown={group: float(groups[g] / total) for g, group in enumerate(GROUPS)},
        breakdown_client_mean={group: float(np.mean(group_fractions[:, g]))
                               for g, group in enumerate(GROUPS)},
        q0_by_group=q0_by_group,
        **_spread("acc_p", acc["personal"]), **_spread("acc_g", acc["global"]),
        q0_histogram={group: q0_histogram[g].tolist()
                      for g, group in enumerate(GROUPS)},
        routing_client=None if client_ids is None else routing_client(counts, client_ids),
        clients_nonfinite=len(diverged),
        first_nonfinite_client=(str(client_ids[diverged[0]]) if len(diverged)
                                and client_ids is not None else None),
        **snapshot)
