"""kNN-Per (Marfoq et al. 2022, "Personalized Federated Learning through Local
Memorization", Sec. 3-4).

Training is FedAvg exactly (``flowjax.algorithms.fedavg``). Personalization at
evaluation, from the current global model ``w``:

1. datastore: for every instance of the client's train split, the key
   ``phi(x)``, the global model's penultimate embedding (the output of the layer before
   the last routable layer, after its glue, in eval mode), and the instance's TRUE
   label (the reference code stores predicted labels: a pitfall not repeated here);
2. for a test instance with embedding ``phi(x)``, its ``k`` nearest datastore entries by
   Euclidean distance ``d`` (not squared) and
   ``p_kNN(c) = sum_{neighbours j with y_j = c} exp(-d_j) / sum_{neighbours j} exp(-d_j)``
   (the spec's kernel, ``baselines.md``, and the Flow authors': their
   ``trainers/client_knnper.py`` adds ``exp(-d)`` per neighbour; Marfoq et al.'s own code
   weighs by ``exp(-d^2 / dim)`` with faiss's squared L2 distances, not offered here);
3. ``p(c) = lam * p_kNN(c) + (1 - lam) * softmax(w(x))_c``.

``predict`` returns ``log p`` as the personalized logits (computed in log space, so
``lam = 0`` gives ``log_softmax(w(x))``, the global model's predictions exactly); the
global logits are ``w(x)``. Everything is vectorized with fixed shapes: the datastore is
padded to a static size and padding entries get an infinite distance, so they are never
neighbours (``jax.lax.top_k`` of negative distances).

Choices where the paper is silent:

* Instances: an example for image models; for next-token models every non-pad token
  position (the instances the evaluation counts), queried position by position too.
* Datastore size: at most ``max_datastore`` entries (static). A client with more valid
  train instances keeps a uniformly random subset of ``max_datastore`` of them, drawn
  from the personalize key (one uniform priority per instance, the highest kept); a
  client with fewer keeps all of them. The store always has ``max_datastore`` slots,
  whatever the padded size of the client's split: a padding-dependent size would change
  the shape of the distance matmul, and XLA may then sum a distance in another order
  (measured: 4.8e-7 on the logits), so padding would change results.
* A client with an empty datastore (no train instances), or with fewer than ``k``
  entries, uses the neighbours it has; with none at all it falls back to the global
  model's probabilities.

``client_snapshot=True`` also scores, as ``acc_g_client_snapshot``, what the Flow authors'
CIFAR evaluation reports as kNN-Per's Acc_g: the server model trained one epoch on the
client's train split, scored on its test split (``client_knnper.py``,
``cifar*_generalized_test``: FedAvg's ``client_snapshot``, the same copy).

``reference_acc_p=True`` also scores, as ``acc_p_client_snapshot``, what the Flow authors'
image evaluation reports as kNN-Per's Acc_p (``client_knnper.py``,
``emnist_generalized_test``, ``cifar*_generalized_test``), beside the method's ``acc_p``,
and as ``acc_g_client_snapshot`` the model their evaluation scores as Acc_g, ``m`` (the
``client_snapshot`` copy where that is on, as their CIFAR code, trained with the method's
``sgd``: their copy's SGD has momentum 0.9, which the plan's ``knn_per_snapshot`` row
sets; the server model otherwise, as their EMNIST code, so then it equals ``acc_g``);
``clients_benefiting_snapshot`` counts their Acc_p against ``m``. From ``m``:

1. datastore: for every train instance, the key is the embedding their memoization
   networks return, the input of their first linear layer (``REFERENCE_KEY_LAYERS``: the
   EMNIST CNN's ``fc1``, 9,216 values; the ResNet's ``fc``), and the value is ``m``'s
   PREDICTED label ``argmax m(x)``;
2. a test instance's score is ``(1 - lam) m(x) + lam sum_j exp(-d_j) onehot(value_j)``
   over its k nearest entries (Euclidean ``d``): raw logits plus an unnormalized vote,
   its argmax the prediction (their test loader has batch 1, so their ``knn_logits[0]``
   is every instance's).

Where theirs would fail, this gives an answer: a store with fewer than ``k`` entries
votes with those it has (their ``topk`` raises), an empty one leaves ``(1 - lam) m(x)``.
The store is ``max_datastore`` slots as the method's, the same kept instances (theirs
keeps every train instance: equal up to 4,096). It holds ``max_datastore x D`` floats per
evaluated client (151 MB for the EMNIST CNN at 4,096): lower ``max_datastore`` or
``eval.chunk`` where that is too much. Their text models key a whole sequence (every
position's LSTM output, flattened) and store per sequence, from logits laid out
``[vocabulary, positions]``, the argmax over positions for each token; their vote then
goes to every class alike at those positions (Shakespeare: no prediction can change) or
to token ``t`` at position ``t`` (Stack Overflow), as ``launch/their_text_knn.py`` shows
on their code: not offered, the option is refused there (README, "Baselines as
implemented").
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (FederatedAlgorithm, Predictions, SGDConfig,
                                     instance_weights, unrouted_predictions)
from flowjax.core.checks import FieldError, Interval, check_fields, integer, one_of
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.cohort import ClientExamples
from flowjax.models.base import Params, RoutableModel, forward, layer_key


@dataclasses.dataclass(frozen=True)
class KnnPerConfig:
    """kNN-Per's hyperparameters.

    Attributes:
      sgd: the clients' SGD (FedAvg training).
      neighbours: k, the neighbours of a test instance.
      lam: weight of ``p_kNN`` in the mixture, in [0, 1].
      max_datastore: static datastore capacity per client (instances), >= neighbours.
      client_snapshot: also score the authors' CIFAR Acc_g copy (module docstring;
        None = off).
      reference_acc_p: also score the authors' kNN-Per Acc_p (module docstring; None =
        off); for the models of ``REFERENCE_KEY_LAYERS`` only.
    """

    sgd: SGDConfig
    neighbours: int  # no default: the paper sets k and lam per dataset (configs/)
    lam: float
    max_datastore: int = 4096
    client_snapshot: bool | None = None
    reference_acc_p: bool | None = None

    def __post_init__(self):
        check_fields(self, {"neighbours": integer(1), "lam": Interval(0, 1, closed_high=True),
                            "max_datastore": integer(1),
                            "client_snapshot": one_of((None, False, True)),
                            "reference_acc_p": one_of((None, False, True))})
        if self.max_datastore < self.neighbours:
            raise FieldError("max_datastore", self.max_datastore,
                             f"expected an integer >= neighbours ({self.neighbours})")


# The layer whose input keys the authors' kNN-Per datastore: the embedding their
# memoization networks return (models/emnist_cnn_memoization.py: the flattened pooled
# convolutions, before linear_1; models/cifar100_resnet_memoization.py: the pooled
# features, before fc).
REFERENCE_KEY_LAYERS = {"emnist_cnn": "fc1", "resnet18_gn": "fc"}


@flax.struct.dataclass
class Datastore:
    """A client's memorized train instances, padded to a static capacity M.

    Attributes:
      keys: ``[M, D]`` penultimate embeddings.
      labels: int32 ``[M]`` labels (true ones; predicted ones for the authors' Acc_p).
      valid: bool ``[M]``; False for padding entries.
    """

    keys: jax.Array
    labels: jax.Array
    valid: jax.Array


def embed_and_logits(model: RoutableModel, params: Params, x: jax.Array,
                     key_layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(phi(x) [*instance, D], logits [*instance, C])`` of the plain model in eval mode.

    ``phi`` is the input of layer ``key_layer`` (default: the last routable layer),
    flattened past the instance axes; the logits equal ``forward``'s.
    """
    key = jax.random.key(0)  # eval mode: glue never draws from it
    last = model.num_layers - 1
    key_layer = last if key_layer is None else key_layer
    h = model.embed_input(x)
    phi = None
    for j, name in enumerate(model.layer_names[:last]):
        if j == key_layer:
            phi = h
        h = model.glue_apply(j, model.layer_apply(j, params[name], h), False, layer_key(key, j))
    phi = h if phi is None else phi
    logits = model.layer_apply(last, params[model.layer_names[last]], h)
    logits = model.glue_apply(last, logits, False, layer_key(key, last))
    return phi.reshape(logits.shape[:-1] + (-1,)), logits


def _kept_instances(priority: jax.Array, capacity: int) -> jax.Array:
    """bool mask of the (at most ``capacity``) highest-priority valid instances.

    Invalid instances have priority -1 and valid ones a uniform draw in [0, 1).
    """
    valid = priority >= 0
    if capacity >= priority.shape[0]:  # static: every valid instance fits
        return valid
    _, top = jax.lax.top_k(priority, capacity)
    return jnp.zeros(priority.shape, bool).at[top].set(True) & valid


def build_datastore(model: RoutableModel, params: Params, examples: ClientExamples,
                    key: jax.Array, max_size: int, key_layer: int | None = None,
                    predicted_labels: bool = False) -> Datastore:
    """The client's datastore: embeddings and true labels of its valid train instances.

    Entries are written in the split's order (example, then position); when there are
    more than the capacity, a seeded uniformly random subset is kept (module docstring).
    ``key_layer`` picks the embedding (``embed_and_logits``); ``predicted_labels`` stores
    the model's argmax instead of the true label (the authors' evaluation); neither
    changes which instances are kept.
    """
    steps = examples.mask.shape[0]
    weights = jax.vmap(lambda y, m: instance_weights(model, y, m.astype(jnp.float32)))(
        examples.y, examples.mask)
    per_step = math.prod(weights.shape[1:])
    capacity = max_size  # never the padded instance count (module docstring)
    # One draw per (step, slot) so padding steps appended later leave the draws unchanged.
    draws = jax.vmap(lambda s: jax.random.uniform(jax.random.fold_in(key, s), (per_step,)))(
        jnp.arange(steps))
    priority = jnp.where(weights.reshape(steps, per_step) > 0, draws, -1.0)
    kept = _kept_instances(priority.reshape(-1), capacity)
    slots = jnp.where(kept, jnp.cumsum(kept) - 1, capacity).reshape(steps, per_step)
    dim = jax.eval_shape(lambda x: embed_and_logits(model, params, x, key_layer)[0],
                         examples.x[0]).shape[-1]

    def write(store, inputs):
        x, y, slot = inputs

        def add(store):
            keys, labels = store
            phi, logits = embed_and_logits(model, params, x, key_layer)
            value = jnp.argmax(logits, axis=-1) if predicted_labels else y
            return (keys.at[slot].set(phi.reshape(per_step, dim), mode="drop"),
                    labels.at[slot].set(value.reshape(per_step).astype(jnp.int32),
                                        mode="drop"))

        # Steps with nothing kept (padding) skip the forward pass.
        return jax.lax.cond(jnp.any(slot < capacity), add, lambda s: s, store), None

    (keys, labels), _ = jax.lax.scan(
        write, (jnp.zeros((capacity, dim), jnp.float32), jnp.zeros((capacity,), jnp.int32)),
        (examples.x, examples.y, slots))
    return Datastore(keys=keys, labels=labels, valid=jnp.arange(capacity) < jnp.sum(kept))


def nearest(store: Datastore, queries: jax.Array,
            neighbours: int) -> tuple[jax.Array, jax.Array]:
    """``(-d [Q, k], index [Q, k])``: each query's k nearest valid entries by Euclidean
    distance ``d``, nearest first; ``-inf`` where the store has fewer valid entries."""
    # Full-precision products: TF32 matmuls would blur near-duplicate distances.
    cross = jnp.matmul(queries, store.keys.T, precision=jax.lax.Precision.HIGHEST)
    squared = (jnp.sum(queries ** 2, axis=-1, keepdims=True) - 2.0 * cross
               + jnp.sum(store.keys ** 2, axis=-1)[None, :])
    distance = jnp.where(store.valid[None, :], jnp.sqrt(jnp.maximum(squared, 0.0)), jnp.inf)
    return jax.lax.top_k(-distance, min(neighbours, store.labels.shape[0]))


def knn_log_probs(store: Datastore, queries: jax.Array, neighbours: int,
                  num_classes: int) -> tuple[jax.Array, jax.Array]:
    """``(log p_kNN [Q, C], has_neighbour [Q])`` for query embeddings ``[Q, D]``."""
    neg_distance, index = nearest(store, queries, neighbours)
    # exp(-d_j) / sum_j exp(-d_j) is a softmax of -d; absent neighbours (-inf) weigh 0.
    has_neighbour = jnp.isfinite(neg_distance[:, 0])
    weights = jax.nn.softmax(jnp.where(has_neighbour[:, None], neg_distance, 0.0), axis=-1)
    weights = jnp.where(jnp.isfinite(neg_distance), weights, 0.0)
    one_hot = jax.nn.one_hot(store.labels[index], num_classes, dtype=jnp.float32)
    return jnp.log(jnp.einsum("qk,qkc->qc", weights, one_hot)), has_neighbour


# Candidates ``nearest`` picks beyond k before ranking by the exact distance: its expanded
# form is off by up to 7e-5 on 9,216-value keys (measured), enough to swap near ties.
REFERENCE_CANDIDATES = 16


def reference_scores(store: Datastore, queries: jax.Array, logits: jax.Array,
                     neighbours: int, lam: float) -> jax.Array:
    """The authors' kNN-Per scores ``[Q, C]``: ``(1 - lam) logits + lam sum_j exp(-d_j)
    onehot(label_j)`` over each query's k nearest entries (absent ones add nothing).

    Distances are ``|q - key|``, as theirs (``torch.norm(embeddings - input_embeddings)``):
    ``nearest``'s expanded form only picks ``k + REFERENCE_CANDIDATES`` candidates, which
    are then ranked by the exact distance.
    """
    candidates = min(neighbours + REFERENCE_CANDIDATES, store.labels.shape[0])
    neg_approximate, index = nearest(store, queries, candidates)
    difference = queries[:, None, :] - store.keys[index]  # [Q, candidates, D]
    distance = jnp.where(jnp.isfinite(neg_approximate),
                         jnp.sqrt(jnp.sum(difference * difference, axis=-1)), jnp.inf)
    neg_distance, order = jax.lax.top_k(-distance, min(neighbours, candidates))
    index = jnp.take_along_axis(index, order, axis=1)
    weights = jnp.where(jnp.isfinite(neg_distance), jnp.exp(neg_distance), 0.0)
    one_hot = jax.nn.one_hot(store.labels[index], logits.shape[-1], dtype=jnp.float32)
    votes = jnp.einsum("qk,qkc->qc", weights, one_hot)
    return (1.0 - lam) * logits + lam * votes


def mix_log_probs(log_knn: jax.Array, logits: jax.Array, lam: float) -> jax.Array:
    """``log(lam * p_kNN + (1 - lam) * softmax(logits))``, in log space."""
    log_lam = math.log(lam) if lam > 0 else -jnp.inf
    log_rest = math.log1p(-lam) if lam < 1 else -jnp.inf
    return jnp.logaddexp(log_lam + log_knn, log_rest + jax.nn.log_softmax(logits, axis=-1))


def reference_key_layer(model: RoutableModel) -> int:
    """Index of the layer whose input keys the authors' datastore (``REFERENCE_KEY_LAYERS``).

    Raises:
      ValueError: their image evaluation has no network like ``model`` (one line).
    """
    if model.name not in REFERENCE_KEY_LAYERS:
        raise ValueError(f"expected a model of {sorted(REFERENCE_KEY_LAYERS)}: the authors' "
                         f"kNN-Per Acc_p is reproduced for their image networks, not "
                         f"{model.name}")
    return model.layer_names.index(REFERENCE_KEY_LAYERS[model.name])


def knn_per(model: RoutableModel, config: KnnPerConfig) -> FederatedAlgorithm:
    """kNN-Per for ``model``: FedAvg training, kNN-mixture personalization."""
    base = fedavg(model, FedAvgConfig(sgd=config.sgd, client_snapshot=config.client_snapshot))
    key_layer = reference_key_layer(model) if config.reference_acc_p else None
    extras = bool(config.client_snapshot or config.reference_acc_p)

    def personalize(params, examples: ClientExamples, key, client_state=None):
        del client_state  # stateless
        store = build_datastore(model, params, examples, key, config.max_datastore)
        if not extras:
            return store
        personal = {"store": store}
        theirs = params  # the model their evaluation scores as Acc_g (module docstring)
        if config.client_snapshot:
            # FedAvg's copy from the same key: kNN-Per trains and evaluates as FedAvg does.
            personal["snapshot"] = theirs = base.personalize(params, examples, key)["snapshot"]
        if config.reference_acc_p:
            personal["reference_store"] = build_datastore(
                model, theirs, examples, key, config.max_datastore, key_layer,
                predicted_labels=True)
        return personal

    def predict(params, personal, x) -> Predictions:
        if not extras:
            return knn_predict(params, personal, x)
        predictions = knn_predict(params, personal["store"], x)
        if not config.reference_acc_p:
            return predictions.replace(global_snapshot=forward(model, personal["snapshot"], x))
        # One pass of the model their evaluation scores as Acc_g, the global_snapshot: the
        # copy where client_snapshot is on, else the server model, whose logits are Acc_g's
        # own (so acc_g_client_snapshot equals acc_g exactly and their harmed flag is
        # counted against it as on every other row).
        phi, logits = embed_and_logits(model, personal.get("snapshot", params), x, key_layer)
        return predictions.replace(
            global_snapshot=logits if config.client_snapshot else predictions.global_logits,
            personal_snapshot=reference_scores(personal["reference_store"], phi, logits,
                                               config.neighbours, config.lam))

    def knn_predict(params, store: Datastore, x) -> Predictions:
        phi, logits = embed_and_logits(model, params, x)
        queries = phi.reshape(-1, phi.shape[-1])
        flat_logits = logits.reshape(-1, logits.shape[-1])
        log_knn, has_neighbour = knn_log_probs(store, queries, config.neighbours,
                                               model.num_classes)
        mixed = jnp.where(has_neighbour[:, None],
                          mix_log_probs(log_knn, flat_logits, config.lam),
                          jax.nn.log_softmax(flat_logits, axis=-1))
        personal = mixed.reshape(logits.shape)
        return unrouted_predictions(logits, personal)

    return FederatedAlgorithm(name="knn_per", model=model, init=base.init,
                              client_update=base.client_update, personalize=personalize,
                              predict=predict)
