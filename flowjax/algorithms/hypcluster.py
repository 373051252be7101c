"""HypCluster (Mansour et al. 2020, "Three Approaches for Personalization with
Applications to Federated Learning", Sec. 3 / Algorithm 2).

The server holds ``k`` cluster models ``{"cluster0": w_0, ..., "cluster{k-1}": w_{k-1}}``.
Each round every sampled client, from the broadcast cluster models:

1. evaluates every ``w_i`` on its whole train split: the masked mean cross-entropy of
   the plain model in evaluation mode (no dropout), ``L_i``;
2. picks ``c = argmin_i L_i`` (ties go to the lowest index; a non-finite ``L_i`` reads
   as +inf, so a cluster whose loss overflowed or is NaN is picked only when all are);
3. trains only ``w_c`` for E epochs of minibatch SGD on its train split (as FedAvg);
4. returns all k groups: the trained ``w_c`` and the untouched other clusters, with
   weight ``{"cluster{c}": n, others: 0}`` (n = its example count).

The engine takes one example-weighted mean per cluster over the clients that chose it
(a cluster nobody chose gets a zero pseudo-gradient) and applies the server optimizer to
the whole ``{cluster: params}`` tree. ``core.server_opt.server_optimizer`` keeps one state
per cluster and gives a cluster with a zero pseudo-gradient no step at all: a cluster
nobody chose keeps its params and its optimizer state (no momentum step with an adaptive
or momentum server optimizer).

Personalized model at evaluation: the cluster model with the lowest train loss for the
client (steps 1-2 with the current server params).

Choices where the paper is silent:

* Global model (Acc_g): the clusters' uniform ensemble, ``log(mean_i softmax(w_i(x)))``,
  the prediction available to a client that has not picked a cluster; with ``k = 1`` it
  is the one model's logits, so ``k = 1`` is FedAvg exactly (training and evaluation).
* Initialisation: without a warm start, cluster 0 is ``model.init(key)`` (the plain
  model's init, which makes ``k = 1`` FedAvg) and cluster i > 0 is
  ``model.init(fold_in(key, i))``. Independent random inits are known to collapse: one
  cluster fits every client better from the first round and the others never train.
* Warm start (the remedy): ``hypcluster(..., warm_start=w)`` initialises cluster i as
  ``w + perturbation * N(0, I)`` with noise drawn from ``fold_in(key, i)`` (an absolute
  standard deviation, on every parameter). The run launcher (``flowjax.config``) obtains
  ``w`` from a FedAvg run of the same config for ``config.methods.hypcluster.warmup_rounds``
  rounds W, the run's first W of its ``num_rounds`` (so HypCluster trains on as many
  cohorts as every other method), and HypCluster's rounds are then rounds W + 1 to
  ``num_rounds`` of the seed's streams (no cohort of the warm-up is drawn again); with
  ``perturbation = 0`` all clusters are equal and every client picks cluster 0.
* k-means init (``init="kmeans"``, FedJAX's ``kmeans_init``): instead of the
  perturbation, every client of HypCluster's first cohort trains E epochs from the warm
  start (the plain init without a warm-up); cluster 0 starts at a seeded random client's
  trained params, and each next cluster at those of the client whose lowest loss under
  the clusters chosen so far is largest (``kmeans_starts``). The warm start alone does
  not keep both clusters in use on every task (README, "Baselines as implemented").
* Metrics: ``clients_in_cluster{i}``, the share of the round's real clients that chose
  cluster i (collapse shows as a share of 1), and ``updates_to_cluster{i}``, how many of
  the round's clients with examples trained it (a skipped client counts in neither).

``client_snapshot=True`` also scores the two models the Flow authors' evaluation reports
as HypCluster's Acc_g and Acc_p (``client_hypcluster.py``, ``*_generalized_test``:
``before_net`` and ``net``). Their evaluation fine-tunes every cluster model for E epochs
on the client's train split (the same minibatches for each; SGD momentum 0.9 in their
code of the paper's datasets); after the first epoch it copies the cluster whose loss summed over
that epoch's steps is lower (Acc_g), after the last the one whose last epoch's was (Acc_p).
Here: every cluster model trained E epochs in one run (SGD as in training, the
evaluation's key for each, so the same batches), and of the clusters the one with the
lowest mean loss over the first epoch's steps, after it, as ``acc_g_client_snapshot``
beside ``acc_g``, and the one with the lowest over the last epoch's steps, after all E, as
``acc_p_client_snapshot`` beside ``acc_p`` (ties: the lowest index; theirs, between two,
the second; their sum of minibatch means weighs a short last minibatch fully; a cluster
whose loss is not finite is copied only when all are, where their ``<`` takes the second
of two whenever either is NaN). The authors' harmed flag compares those two, so
``clients_benefiting_snapshot`` does too. The option costs k x E epochs of training per
evaluated client; it returns three models per client and holds about 2k during the
evaluation. (The choice of the cluster to train and of Acc_p's stays a bare lowest loss,
as before: a cluster with a NaN train loss would be chosen there.)
Training, Acc_g and Acc_p are unchanged: the paper's HypCluster Acc_p (this module's) is
the chosen cluster, not fine-tuned.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, SGDConfig,
                                     plain_loss_sums, plain_sgd_step, run_with_copies,
                                     train_plain, unrouted_predict, valid_examples)
from flowjax.core.checks import check_fields, integer, non_negative, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.core.losses import mean_from_sums
from flowjax.core.mapping import ClientMapping, map_clients
from flowjax.core.tree import select_tree
from flowjax.models.base import Params, RoutableModel, forward


@dataclasses.dataclass(frozen=True)
class HypClusterConfig:
    """HypCluster's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD (epochs E of the chosen cluster per round).
      clusters: k, the number of cluster models (the paper's experiments use 2).
      perturbation: std of the Gaussian noise added to the warm start per cluster.
      warmup_rounds: FedAvg rounds run before HypCluster's own to warm-start every
        cluster (0: random init); a stage of the run (``flowjax.config.warm_up``), its
        first rounds, counted within ``num_rounds``.
      init: None: the clusters start at the warm start plus ``perturbation`` noise (or
        at random inits without a warm-up); ``"kmeans"``: at the k-means picks of
        ``kmeans_starts`` (the run's ``warm_up`` stage computes them).
      client_snapshot: also score the authors' evaluation's Acc_g copy and Acc_p model
        (module docstring; None = off).
    """

    sgd: SGDConfig
    clusters: int = 2
    perturbation: float = 0.01
    warmup_rounds: int = 0
    init: str | None = None
    client_snapshot: bool | None = None

    def __post_init__(self):
        check_fields(self, {"clusters": integer(1), "warmup_rounds": integer(0),
                            "perturbation": non_negative, "init": one_of((None, "kmeans")),
                            "client_snapshot": one_of((None, False, True))})


def cluster_names(clusters: int) -> tuple[str, ...]:
    """The top-level params keys: ``cluster0`` ... ``cluster{k-1}``."""
    return tuple(f"cluster{i}" for i in range(clusters))


def mean_train_loss(model: RoutableModel, params: Params, examples: ClientExamples) -> jax.Array:
    """Masked mean cross-entropy of the plain model (eval mode) over a client's examples.

    0 for a client without examples. Padded steps are skipped.
    """
    no_dropout = jax.random.key(0)  # eval mode: the key is never used

    def step(total, batch):
        x, y, mask = batch
        sums = jax.lax.cond(
            jnp.any(mask),
            lambda: plain_loss_sums(model, params, (x, y, mask.astype(jnp.float32)),
                                    no_dropout, train=False),
            lambda: jnp.zeros((2,), jnp.float32))
        return total + sums, None

    total, _ = jax.lax.scan(step, jnp.zeros((2,), jnp.float32),
                            (examples.x, examples.y, examples.mask))
    return mean_from_sums(total[0], total[1])


def perturb(params: Params, key: jax.Array, scale: float) -> Params:
    """``params + scale * N(0, I)``, one independent draw per leaf."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
             for leaf, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def kmeans_starts(model: RoutableModel, sgd: SGDConfig, start: Params,
                  examples: ClientExamples, keys: jax.Array, clusters: int,
                  first: int, mapping: ClientMapping | None = None) -> list[Params]:
    """FedJAX's k-means++ variant of HypCluster's init (``hyp_cluster.kmeans_init``).

    Every client of ``examples`` (a stacked cohort; padding clients have no examples)
    trains ``sgd.epochs`` epochs from ``start`` with its key of ``keys``. Cluster 0 starts
    at client ``first``'s trained params; each next cluster at those of the real client
    whose lowest mean train loss (``mean_train_loss``) under the clusters chosen so far
    is the largest. Clients are mapped as the run's rounds map them (``mapping``; None:
    one vmap), so a cohort whose rounds fit in memory in chunks or over several devices
    fits here too.

    Returns:
      ``clusters`` params pytrees, cluster 0 first.
    """
    # Built here, not as a default argument: a ClientMapping counts the devices, which
    # would start JAX's backend at import, before jax.distributed.initialize.
    mapping = mapping or ClientMapping("vmap")
    optimizer = sgd.optimizer()

    def train(client: ClientExamples, key: jax.Array) -> Params:
        return train_plain(model, start, optimizer, client, valid_examples(client),
                           epochs=sgd.epochs, batch_size=sgd.batch_size, key=key,
                           **sgd.loop)[0]

    trained = jax.jit(map_clients(train, mapping))(examples, keys)
    losses_under = jax.jit(lambda center, clients: map_clients(
        lambda client: mean_train_loss(model, center, client), mapping)(clients))
    real = np.asarray(examples.num_examples) > 0
    chosen, best = [first], np.full(len(real), np.inf)
    for _ in range(1, clusters):
        center = jax.tree.map(lambda leaf: leaf[chosen[-1]], trained)
        best = np.minimum(best, np.asarray(losses_under(center, examples)))
        chosen.append(int(np.argmax(np.where(real, best, -np.inf))))
    return [jax.tree.map(lambda leaf, c=c: leaf[c], trained) for c in chosen]


def _check_warm_start(model: RoutableModel, warm_start: Params,
                      name: str = "warm_start") -> None:
    expected = jax.eval_shape(model.init, jax.random.key(0))
    shapes = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), expected)
    try:
        given = jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.dtype(jnp.result_type(a))),
                             warm_start)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a params pytree of {model.name}: {error}") from None
    if jax.tree.structure(shapes) != jax.tree.structure(given) or shapes != given:
        raise ValueError(f"{name} does not match the params of {model.name}; "
                         f"expected the structure and shapes of model.init(key)")


def hypcluster(model: RoutableModel, config: HypClusterConfig,
               warm_start: Params | None = None,
               cluster_starts: Sequence[Params] | None = None) -> FederatedAlgorithm:
    """HypCluster with ``config.clusters`` cluster models of ``model``.

    Args:
      model: the plain model every cluster uses.
      config: client hyperparameters.
      warm_start: optional params of the plain model (e.g. after a short FedAvg run);
        every cluster then starts at it plus seeded Gaussian noise of std
        ``config.perturbation``, which avoids the collapse of random inits.
      cluster_starts: optional params of each cluster, used as they are (k-means init:
        ``kmeans_starts``); instead of ``warm_start``.
    """
    if warm_start is not None:
        _check_warm_start(model, warm_start)
    if cluster_starts is not None:
        if len(cluster_starts) != config.clusters:
            raise ValueError(f"cluster_starts holds {len(cluster_starts)} params; expected "
                             f"one per cluster ({config.clusters})")
        for i, start in enumerate(cluster_starts):
            _check_warm_start(model, start, f"cluster_starts[{i}]")
    optimizer = config.sgd.optimizer()
    names = cluster_names(config.clusters)

    def init(key):
        if cluster_starts is not None:
            return {name: start for name, start in zip(names, cluster_starts)}
        if warm_start is None:
            return {name: model.init(key if i == 0 else jax.random.fold_in(key, i))
                    for i, name in enumerate(names)}
        return {name: perturb(warm_start, jax.random.fold_in(key, i), config.perturbation)
                for i, name in enumerate(names)}

    def lowest(losses: Sequence[jax.Array], clusters: Sequence[Params]):
        """(index of the lowest loss, ties to the lowest index; that cluster's params).
        A non-finite loss reads as +inf: such a cluster wins only when all are (a bare
        argmin would pick the first NaN); finite losses pass unchanged."""
        finite = [jnp.where(jnp.isfinite(loss), loss, jnp.inf) for loss in losses]
        chosen = jnp.argmin(jnp.stack(finite))
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *clusters)
        return chosen, jax.tree.map(lambda leaf: leaf[chosen], stacked)

    def choose(params, examples: ClientExamples):
        """(index of the lowest-loss cluster, that cluster's params)."""
        return lowest([mean_train_loss(model, params[name], examples) for name in names],
                      [params[name] for name in names])

    def authors_evaluation(params, examples: ClientExamples, key) -> tuple[Params, Params]:
        """The authors' evaluation copies (module docstring): every cluster fine-tuned E
        epochs on the same minibatches; ``(after the first epoch, the cluster whose first
        epoch had the lowest mean loss; after all E, the one whose last epoch had)``."""
        x, y, _ = examples.flat()
        step, member = plain_sgd_step(model, optimizer), valid_examples(examples)
        after_first, first_losses, after_all, last_losses = [], [], [], []
        for name in names:  # one run per cluster, split where the copies are taken
            first, first_sums, last, last_sums = run_with_copies(
                step, (params[name], optimizer.init(params[name])), x, y, member,
                epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                **config.sgd.loop)
            after_first.append(first[0])
            first_losses.append(mean_from_sums(*first_sums))
            after_all.append(last[0])
            last_losses.append(mean_from_sums(*last_sums))
        return lowest(first_losses, after_first)[1], lowest(last_losses, after_all)[1]

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        chosen, start = choose(params, examples)
        trained, sums = train_plain(model, start, optimizer, examples, valid_examples(examples),
                                    epochs=config.sgd.epochs, batch_size=config.sgd.batch_size,
                                    key=key, **config.sgd.loop)
        n = examples.num_examples.astype(jnp.float32)
        real = (n > 0).astype(jnp.float32)
        metrics = {"loss_sum": sums[0], "loss_count": sums[1]}
        for i, name in enumerate(names):
            metrics[f"clients_in_{name}_sum"] = real * (chosen == i)
            metrics[f"clients_in_{name}_count"] = real
            # Summed over the round's clients, not divided: launch/cluster_shares.py.
            metrics[f"updates_to_{name}"] = real * (chosen == i)
        return ClientResult(
            params={name: select_tree(chosen == i, trained, params[name])
                    for i, name in enumerate(names)},
            weight={name: jnp.where(chosen == i, n, 0.0) for i, name in enumerate(names)},
            metrics=metrics)

    def personalize(params, examples: ClientExamples, key, client_state=None) -> Params:
        del client_state  # stateless; the choice is deterministic, the snapshot's run is not
        if not config.client_snapshot:
            return choose(params, examples)[1]
        snapshot, fine_tuned = authors_evaluation(params, examples, key)
        return {"personal": choose(params, examples)[1], "snapshot": snapshot,
                "personal_snapshot": fine_tuned}

    def ensemble_logits(params, x):
        if len(names) == 1:
            return forward(model, params[names[0]], x)
        log_probs = jnp.stack([jax.nn.log_softmax(forward(model, params[name], x))
                               for name in names])
        return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(float(len(names)))

    predict = unrouted_predict(ensemble_logits,
                               lambda params, personal, x: forward(model, personal, x),
                               config.client_snapshot)

    return FederatedAlgorithm(name="hypcluster", model=model, init=init,
                              client_update=client_update, personalize=personalize,
                              predict=predict)
