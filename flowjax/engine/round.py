"""The pure, jittable steps of a simulation: one training round and one evaluation chunk.

A round is DrJAX's shape: map ``client_update`` over the cohort's clients (vmapped and
sharded by ``flowjax.core.mapping``), reduce with an example-weighted mean, apply the
server optimizer to the mean. Nothing here touches the host: sampling, padding,
placement and the per-client state store are ``flowjax.engine.simulation``'s.

Example:
  >>> round_fn = jax.jit(make_round(algorithm, optax.sgd(1.0), ClientMapping()))
  >>> state, metrics, client_states = round_fn(state, cohort, np.int32(0), None,
  ...                                          prng.seed_words(0))
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from flowjax.core import prng
from flowjax.core.cohort import ClientExamples
from flowjax.core.mapping import ClientMapping, map_clients
from flowjax.core.server_opt import apply_server_update
from flowjax.core.tree import select_tree, tree_all_finite, weighted_mean
from flowjax.engine.protocol import FederatedAlgorithm
from flowjax.evaluation.metrics import ClientCounts, evaluate_client

PyTree = Any


@flax.struct.dataclass
class ServerState:
    """Everything the server carries between rounds."""

    params: PyTree
    opt_state: PyTree


RoundFn = Callable[[ServerState, ClientExamples, jax.Array, PyTree, jax.Array],
                   tuple[ServerState, dict[str, jax.Array], PyTree]]
EvalChunkFn = Callable[[PyTree, ClientExamples, ClientExamples, jax.Array, jax.Array, PyTree,
                        jax.Array], ClientCounts]


def _sum_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: jnp.sum(value) for name, value in metrics.items()}


def make_round(algorithm: FederatedAlgorithm, server_optimizer: optax.GradientTransformation,
               mapping: ClientMapping) -> RoundFn:
    """The pure round ``(state, cohort, round_index, client_states, seed_words) -> (state,
    metrics, client_states)``.

    The seed comes in as ``prng.seed_words(seed)``, an argument rather than a constant, so
    runs that differ only in their seed share one compiled program.

    ``metrics`` holds the clients' summed metrics, ``weight`` (total example weight, a
    client's counted once however many parameter groups it trains) and ``clients_skipped``
    (clients whose params or new client state went non-finite: they are dropped from the
    mean and keep the state they came with; the run loop decides to stop or go on) and
    ``server_nonfinite`` (the server's new params are not all finite: the run stops).
    ``client_states`` is None for a stateless algorithm.
    """

    def round_fn(state: ServerState, cohort: ClientExamples, round_index: jax.Array,
                 client_states: PyTree,
                 seed_words: jax.Array) -> tuple[ServerState, dict[str, jax.Array], PyTree]:
        key_of_round = prng.round_key(prng.stream_key(seed_words, prng.Purpose.TRAIN),
                                      round_index)

        def one_client(examples: ClientExamples, client_state):
            key = prng.client_key(key_of_round, examples.client_id)
            return algorithm.client_update(state.params, examples, key, client_state)

        by_size = lambda examples, _: examples.num_examples  # noqa: E731
        results = map_clients(one_client, mapping, cost=by_size)(cohort, client_states)
        # A client whose update went non-finite is dropped from the mean (its params are
        # zeroed, since 0 * nan is nan) and counted. Its new state counts too: APFL's and
        # Ditto's personal v lives only there and can diverge while w stays finite.
        finite = jax.vmap(tree_all_finite)(results.params)
        if client_states is not None:
            finite = finite & jax.vmap(tree_all_finite)(results.client_state)
        results = results.replace(
            params=jax.tree.map(lambda p: jnp.where(
                finite.reshape((-1,) + (1,) * (p.ndim - 1)), p, jnp.zeros_like(p)), results.params),
            weight=jax.tree.map(lambda w: jnp.where(finite, w, 0.0), results.weight),
            metrics=jax.tree.map(lambda m: jnp.where(finite, m, 0.0), results.metrics))
        if isinstance(results.weight, dict):
            # One weighted mean per parameter group (e.g. per cluster); a group nobody
            # trained keeps its params (zero pseudo-gradient).
            # A client counts its examples once, whatever number of groups it sends them
            # to (FedRep and LG-FedAvg send n to two groups).
            total_weight = jnp.sum(functools.reduce(jnp.maximum, results.weight.values()))
            client_mean = {
                group: select_tree(jnp.sum(results.weight[group]) > 0,
                                   weighted_mean(results.params[group], results.weight[group]),
                                   state.params[group])
                for group in state.params}
        else:
            total_weight = jnp.sum(results.weight)
            client_mean = weighted_mean(results.params, results.weight)
        params, opt_state = apply_server_update(server_optimizer, state.params,
                                                state.opt_state, client_mean)
        # A round whose clients all had nothing to train on leaves the server unchanged.
        trained = total_weight > 0
        new_state = ServerState(params=select_tree(trained, params, state.params),
                                opt_state=select_tree(trained, opt_state, state.opt_state))
        metrics = _sum_metrics(results.metrics)
        metrics["weight"] = total_weight
        metrics["clients_skipped"] = jnp.sum(~finite)
        # The server's own step can diverge from finite client updates (a server learning
        # rate too large): flagged in the round's record, so a run stops before saving it.
        metrics["server_nonfinite"] = jnp.logical_not(tree_all_finite(new_state.params))
        new_client_states = results.client_state
        if client_states is not None:  # a dropped client keeps the state it came with
            new_client_states = jax.tree.map(
                lambda new, old: jnp.where(finite.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
                results.client_state, client_states)
        return new_state, metrics, new_client_states

    return round_fn


def eval_round_key(seed_words: jax.Array, population: jax.Array | int,
                   round_index: jax.Array | int) -> jax.Array:
    """The evaluation's key of ``round_index`` for population number ``population`` (the
    order of ``Simulation.eval_populations``); ``prng.client_key`` of it is a client's."""
    stream = jax.random.fold_in(prng.stream_key(seed_words, prng.Purpose.EVAL), population)
    return prng.round_key(stream, round_index)


def make_eval_chunk(algorithm: FederatedAlgorithm, mapping: ClientMapping) -> EvalChunkFn:
    """The pure evaluation of a chunk of clients ``(params, train, test, round_index,
    population, client_states, seed_words) -> ClientCounts``: each client is personalized
    on its train split and evaluated on its test split, with keys from (seed, population,
    round, client)."""

    def eval_chunk(params: PyTree, train: ClientExamples, test: ClientExamples,
                   round_index: jax.Array, population: jax.Array,
                   client_states: PyTree, seed_words: jax.Array) -> ClientCounts:
        key_of_round = eval_round_key(seed_words, population, round_index)

        def one_client(train_examples, test_examples, client_state):
            key = prng.client_key(key_of_round, train_examples.client_id)
            return evaluate_client(algorithm, params, train_examples, test_examples, key,
                                   client_state)

        # Personalization trains on the train split: its size sets a client's run length.
        by_size = lambda train, test, _: train.num_examples  # noqa: E731
        return map_clients(one_client, mapping, cost=by_size)(train, test, client_states)

    return eval_chunk
