"""Every registered algorithm against the engine's contract (``flowjax.algorithms.base``).

In the style of optax's ``alias_test`` (one list of optimizers, each common check
parametrized over all of it): every check below runs for each name in
``flowjax.algorithms.ALGORITHMS``, built through the public ``build_algorithm``, so a new
method gets them from its registry line alone. Per method:

(a) ``client_update`` jits and maps over a stacked cohort with the engine's own
    ``map_clients``: ``vmap`` equals the per-client loop (``loop``, ``lax.map``);
(b) padded examples and padded steps change no output, bit for bit;
(c) a fixed key gives identical bits, also from a freshly built algorithm, and another
    key gives other params (every method shuffles its batches with the key);
(d) stateless methods return no state; a stateful method's states survive the run's
    checkpoint code (``ClientStateStore`` + ``Checkpointer``) bit for bit and the next
    round continues from them;
(e) ``personalize`` + ``predict`` give finite logits of the right shapes, for clients
    that never trained and with trained states; they too map over clients with ``vmap``
    like the per-client loop, and padding changes none of their outputs;
(f) padding clients (no examples, id -1: a cohort filled up to the mapping's multiple)
    change no round of the engine, bit for bit: server params, server-optimizer state,
    metrics and the real clients' states.

Tiny model and data (a two-layer MLP, three clients of <= 30 examples) keep the file fast.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.base import base_config
from flowjax.algorithms import ALGORITHMS, build_algorithm
from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.checkpoint import Checkpointer
from flowjax.core import prng
from flowjax.core.client_state import ClientStateStore
from flowjax.core.client_state_disk import DiskClientStateStore
from flowjax.core.cohort import ClientExamples, assemble_cohort, examples_per_client
from flowjax.core.mapping import ClientMapping, map_clients
from flowjax.engine.round import ServerState, make_round
from tests.helpers import assert_trees_equal, differs, tiny_mlp

BATCH = 4
CLIENTS = (0, 1, 2)  # three train clients of different sizes
EXTRA_PADDING = 2 * BATCH  # padded examples appended for (b): two padded steps
# Variants with code paths the registry's defaults do not reach: Flow with every
# departure of the authors' code that a plain MLP allows (flow_reference.py), and the
# evaluations of the authors that train further models per client (HypCluster's two
# copies of E epochs each; APFL's copy in a run of its own momentum).
VARIANTS = {"flow-reference": "flow", "hypcluster-snapshot": "hypcluster",
            "apfl-snapshot-momentum": "apfl"}
CASES = ALGORITHMS + tuple(VARIANTS)

# vmap vs the per-client loop. XLA batches the per-client dots of a vmapped update into
# one batched dot whose float summation order may differ from the per-client dot's, so a
# trained parameter may move by a few ulps per step; everything else is bit-identical.
VMAP_RTOL, VMAP_ATOL = 1e-5, 1e-6


def make_config(case: str):
    """The one place that knows the run config's layout: tiny settings for ``case``."""
    config = base_config("conformance")
    config.algorithm = VARIANTS.get(case, case)
    config.sgd.update(learning_rate=0.05, epochs=2, batch_size=BATCH)
    config.methods.flow.policy_hidden = (8, 8)  # one width per routed layer of the MLP
    config.methods.local.sgd.update(epochs=2, learning_rate=0.05)
    config.methods.knn_per.max_datastore = 64
    config.methods.lg_fedavg.global_layers = ("fc2",)
    if case == "flow-reference":
        config.sgd.momentum = 0.9
        config.methods.flow.update(
            global_step="global_only", halves="shard_reshuffled", frozen_momentum="zero_grad",
            local_init="server", evaluation="reference", policy_eval_dropout=True)
    if case == "hypcluster-snapshot":  # E = 3: the copies' run has middle epochs
        config.sgd.epochs = 3
        config.methods.hypcluster.client_snapshot = True
    if case == "apfl-snapshot-momentum":
        config.methods.apfl.update(client_snapshot=True, snapshot_momentum=0.9)
    return config


def _model():
    """A dropout-free two-layer MLP whose last layer is the head (FedRep, LG-FedAvg)."""
    return dataclasses.replace(tiny_mlp(), head_layers=("fc2",))


def _build(case: str, example_x: jax.Array) -> FederatedAlgorithm:
    return build_algorithm(VARIANTS.get(case, case), _model(), make_config(case), example_x)


def _keys(round_index: int) -> jax.Array:
    """The clients' keys of a round, derived as the engine derives them."""
    stream = prng.round_key(prng.base_key(0, prng.Purpose.TRAIN), round_index)
    return jax.vmap(lambda c: prng.client_key(stream, c))(jnp.asarray(CLIENTS))


def _stack(task, split: str, padded_examples: int, padding_clients: int = 0) -> ClientExamples:
    cohort = assemble_cohort(task, split, list(CLIENTS),
                             num_clients=len(CLIENTS) + padding_clients,
                             padded_examples=padded_examples, batch_size=BATCH)
    return jax.tree.map(jnp.asarray, cohort)


def _mapped(algorithm: FederatedAlgorithm, params, strategy: str):
    """``(cohort, keys, states) -> stacked ClientResult``, jitted as the engine maps it."""
    return jax.jit(map_clients(functools.partial(algorithm.client_update, params),
                               ClientMapping(strategy)))


@dataclasses.dataclass(frozen=True)
class Case:
    """One algorithm with its server params, a tiny cohort and its mapped functions."""

    name: str
    algorithm: FederatedAlgorithm
    params: Any
    cohort: ClientExamples  # CLIENTS stacked, padded to whole batches of the largest
    padded: ClientExamples  # the same clients with EXTRA_PADDING more padded examples
    test_x: jax.Array  # one test batch per client, [clients, BATCH, ...]
    template: Any  # stacked never-trained client states (None: stateless)
    loop: Any  # the per-client loop of client_update over a cohort
    evaluate: Any  # (cohort, keys, states, x) -> Predictions, per client in a loop


# Every case in CI: the file in about 60 s on 2 cores, of which the authors' Flow
# (reference mode) about 13 s, hypcluster-snapshot 8 s, apfl-snapshot-momentum 7 s
# (2026-12-04, -n 0).
@pytest.fixture(scope="module", params=CASES)
def case(request, images_small) -> Case:
    return _case(request.param, images_small)


def _case(name: str, images_small) -> Case:
    train = images_small.train
    sizes = np.asarray(train.num_examples("train"))[list(CLIENTS)]
    assert len(set(sizes.tolist())) == len(CLIENTS)  # uneven sizes: uneven while loops
    tight = examples_per_client(sizes, BATCH)
    cohort = _stack(train, "train", tight)
    algorithm = _build(name, cohort.x[0, 0])
    params = algorithm.init(prng.base_key(0, prng.Purpose.INIT))
    template = None
    if algorithm.stateful:
        one = algorithm.init_client_state(params)
        template = jax.tree.map(lambda a: jnp.stack([a] * len(CLIENTS)), one)
    return Case(name, algorithm, params, cohort,
                _stack(train, "train", tight + EXTRA_PADDING), _stack(train, "test", BATCH).x[:, 0],
                template, _mapped(algorithm, params, "loop"),
                _evaluation(algorithm, params, "loop"))


def _evaluation(algorithm: FederatedAlgorithm, params, strategy: str):
    """What the evaluation runs per client: personalize, then predict on a test batch."""

    def evaluate(examples, key, state, x):
        return algorithm.predict(params, algorithm.personalize(params, examples, key, state), x)

    return jax.jit(map_clients(evaluate, ClientMapping(strategy)))


def _assert_close_trees(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=VMAP_RTOL, atol=VMAP_ATOL)


def _trained(case: Case):
    """Round 0 of the cohort from never-trained states."""
    return case.loop(case.cohort, _keys(0), case.template)


def _slot(stacked, i: int):
    return jax.tree.map(lambda a: a[i], stacked)


def _sends_nothing(result) -> bool:
    """A method without communication (Local): every aggregation weight is zero."""
    return all(not np.any(w) for w in jax.tree.leaves(result.weight))


# ----------------------------------------------------------------------------- (a)


def test_client_update_vmaps_over_the_cohort_like_the_per_client_loop(case):
    looped = _trained(case)
    for i in range(len(CLIENTS)):  # every client trained, or sent the server params back
        if _sends_nothing(looped):
            assert_trees_equal(_slot(looped.params, i), case.params)
        else:
            assert differs(_slot(looped.params, i), case.params), i
    vmapped = _mapped(case.algorithm, case.params, "vmap")(case.cohort, _keys(0), case.template)
    _assert_close_trees(vmapped, looped)
    # Weights and counts are sums of masks: exact under any batching.
    assert_trees_equal(vmapped.weight, looped.weight)
    for name in vmapped.metrics:
        if name.endswith("_count"):
            np.testing.assert_array_equal(vmapped.metrics[name], looped.metrics[name])


# ----------------------------------------------------------------------------- (b)


def test_padded_examples_and_steps_change_no_update(case):
    tight = _trained(case)
    assert_trees_equal(case.loop(case.padded, _keys(0), case.template), tight)


def test_padded_examples_and_steps_change_no_prediction(case):
    evaluated = case.evaluate(case.cohort, _keys(0), case.template, case.test_x)
    assert_trees_equal(case.evaluate(case.padded, _keys(0), case.template, case.test_x),
                       evaluated)


# ----------------------------------------------------------------------------- (c)


def test_a_fixed_key_gives_identical_bits_and_another_key_other_results(case):
    first = _trained(case)
    assert_trees_equal(_trained(case), first)
    # A fresh build of the same config is the same program with the same constants.
    rebuilt = _build(case.name, case.cohort.x[0, 0])
    assert_trees_equal(rebuilt.init(prng.base_key(0, prng.Purpose.INIT)), case.params)
    args = (case.cohort, _keys(0), case.template)
    assert (_mapped(rebuilt, case.params, "loop").lower(*args).as_text()
            == case.loop.lower(*args).as_text())

    # The evaluation too: the same bits for the same keys; the evaluations of the authors
    # that train copies (snapshots) draw their batches from the keys.
    evaluated = [case.evaluate(case.cohort, keys, case.template, case.test_x)
                 for keys in (_keys(0), _keys(0), _keys(1))]
    assert_trees_equal(evaluated[0], evaluated[1])
    for name in ("global_snapshot", "personal_snapshot"):
        if getattr(evaluated[0], name) is not None and case.name in VARIANTS:
            assert differs(getattr(evaluated[0], name), getattr(evaluated[2], name)), name

    other = case.loop(case.cohort, _keys(1), case.template)
    if _sends_nothing(first):  # Local: the randomness is all in the personalization
        assert_trees_equal(other, first)
        evaluated = [case.evaluate(case.cohort, keys, case.template, case.test_x)
                     for keys in (_keys(0), _keys(1))]
        assert differs(evaluated[0].personal_hard, evaluated[1].personal_hard)
        return
    for i in range(len(CLIENTS)):
        assert differs(_slot(other.params, i), _slot(first.params, i)), i


# ----------------------------------------------------------------------------- (d)


@pytest.mark.parametrize("store_kind", ["memory", "disk"])
def test_client_state_survives_a_checkpoint_and_the_next_round_continues_from_it(
        case, tmp_path, store_kind):
    first = _trained(case)
    if not case.algorithm.stateful:
        assert first.client_state is None
        return
    template = case.algorithm.init_client_state(case.params)

    def new_store():  # the disk store: a new process opening the same folder
        return (ClientStateStore(template) if store_kind == "memory"
                else DiskClientStateStore(template, str(tmp_path / "client_states")))

    ids = np.asarray(case.cohort.client_id)
    store = new_store()
    store.scatter(ids, first.client_state)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(1, case.params, store.state_dict(), {"round": 1})
    store.committed(1)
    params, rows, meta = checkpointer.restore(1, case.params, stateful=True)
    checkpointer.close()
    assert meta == {"round": 1}
    assert_trees_equal(params, case.params)
    restored = new_store()
    restored.load_state_dict(rows, 1)
    states = jax.tree.map(jnp.asarray, restored.gather(ids))
    assert jax.tree.structure(states) == jax.tree.structure(first.client_state)
    assert_trees_equal(states, first.client_state)
    for i in range(len(CLIENTS)):  # training changed every client's state
        assert differs(_slot(states, i), _slot(case.template, i)), i

    second = case.loop(case.cohort, _keys(1), states)
    assert_trees_equal(second, case.loop(case.cohort, _keys(1), first.client_state))
    from_scratch = case.loop(case.cohort, _keys(1), case.template)
    assert differs(second.client_state, from_scratch.client_state)  # the state is used
    assert differs(second.client_state, states)  # and trained further


# ----------------------------------------------------------------------------- (e)


def _check_predictions(case: Case, predictions) -> None:
    shape = case.test_x.shape[:2] + (case.algorithm.model.num_classes,)
    for name in ("global_logits", "personal_hard", "personal_soft"):
        logits = getattr(predictions, name)
        assert logits.shape == shape, (name, logits.shape)
        assert bool(jnp.all(jnp.isfinite(logits))), name
    q0 = predictions.q0
    assert q0.shape[:2] == shape[:2]
    assert q0.shape[2] in (0, case.algorithm.model.num_layers)
    assert bool(jnp.all((q0 >= 0) & (q0 <= 1)))
    for name in ("global_snapshot", "personal_snapshot"):
        logits = getattr(predictions, name)
        if logits is not None:
            assert logits.shape == shape, (name, logits.shape)
            assert bool(jnp.all(jnp.isfinite(logits))), name
    assert (predictions.global_snapshot is not None) == case.name.endswith(
        ("-reference", "-snapshot", "-snapshot-momentum"))
    assert (predictions.personal_snapshot is not None) == (case.name == "hypcluster-snapshot")


def test_personalize_and_predict_give_finite_logits_of_the_right_shape(case):
    states = [case.template]
    if case.algorithm.stateful:
        states.append(_trained(case).client_state)
    vmapped = _evaluation(case.algorithm, case.params, "vmap")
    for stacked in states:
        looped = case.evaluate(case.cohort, _keys(0), stacked, case.test_x)
        _check_predictions(case, looped)
        _assert_close_trees(vmapped(case.cohort, _keys(0), stacked, case.test_x), looped)


# ----------------------------------------------------------------------------- (f)

# In CI: one stateless method, the routed one, a stateful one and the clustered one
# (its cluster counts are metrics); every case with -m slow.
PADDING_CLIENTS_IN_CI = ("fedavg", "flow", "ditto", "hypcluster")


@pytest.mark.parametrize("name", [name if name in PADDING_CLIENTS_IN_CI
                                  else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CASES])
def test_padding_clients_change_no_round(name, images_small):
    case = _case(name, images_small)
    server_optimizer = optax.adam(0.1)  # moments would carry a padding client's leak
    state = ServerState(case.params, server_optimizer.init(case.params))
    run = jax.jit(make_round(case.algorithm, server_optimizer, ClientMapping("loop")))
    filled = _stack(images_small.train, "train", case.cohort.mask[0].size, padding_clients=2)
    assert np.asarray(filled.client_id).tolist() == [*CLIENTS, -1, -1]
    states = case.template
    if states is not None:  # the padding clients get never-trained rows, as the engine's
        states = jax.tree.map(lambda a: jnp.concatenate([a, a[:2]]), states)
    seed = prng.seed_words(0)
    want = run(state, case.cohort, np.int32(0), case.template, seed)
    got = run(state, filled, np.int32(0), states, seed)
    assert_trees_equal(got[0], want[0])
    assert_trees_equal(got[1], want[1])
    if states is not None:
        assert_trees_equal(jax.tree.map(lambda a: a[:len(CLIENTS)], got[2]), want[2])
    assert differs(want[0].params, case.params) or _sends_nothing(_trained(case))
