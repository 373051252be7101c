"""FedRep's and LG-FedAvg's rounds as the Flow authors' code trains them: fresh personal
layers every round (``personal_init``), FedRep's E + E phase epochs (``phase_epochs``),
LG-FedAvg's alternating update (``local_update``) and PyTorch's two rules for a frozen
part (``frozen_momentum``). Their equality with the authors' ``emnist_train`` is
``tests/test_parity.py``'s; here each option is pinned to the method it modifies."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax import config as run_config
from flowjax import experiment
from flowjax.algorithms.base import (SGDConfig, fresh_layers, part_sgd_step, personal_start,
                                     split_layers)
from flowjax.algorithms.fedrep import FedRepConfig, fedrep
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, alternating_step, lg_fedavg
from flowjax.models.torch_init import torch_init
from flowjax.core.cohort import assemble_cohort, client_at
from tests.helpers import assert_trees_equal, differs, small_config

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
HEAD = ("fc1", "fc2")  # the authors' `linear` layers of the EMNIST CNN
LOCAL = ("conv1", "conv2")


def _client(task, index, padded_examples=32, batch_size=4):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def _fedrep(model, momentum=0.9, **options):
    return fedrep(model, FedRepConfig(sgd=SGDConfig(**SGD, momentum=momentum),
                                      head_layers=HEAD, **options))


def _lg_fedavg(model, momentum=0.9, **options):
    return lg_fedavg(model, LGFedAvgConfig(sgd=SGDConfig(**SGD, momentum=momentum),
                                           global_layers=HEAD, **options))


@pytest.mark.parametrize("rule", ["fresh", "fresh_torch"])
@pytest.mark.parametrize("method", ["fedrep", "lg_fedavg"])
def test_fresh_personal_layers_are_a_new_init_from_the_first_half_of_the_key(
        method, rule, cnn, images_small):
    """``personal_init="fresh"``: stateless; a round (and an evaluation) is the stored
    method's from the personal layers of ``model.init(split(key)[0])`` with key
    ``split(key)[1]``, bit for bit; another client key draws other layers.
    ``"fresh_torch"`` likewise, its layers ``torch_init``'s of that key."""
    build, names = ((_fedrep, HEAD) if method == "fedrep" else (_lg_fedavg, LOCAL))
    fresh, stored = build(cnn, personal_init=rule), build(cnn)
    assert fresh.init_client_state is None and stored.init_client_state is not None
    params = fresh.init(jax.random.key(0))
    client, key = _client(images_small, 1), jax.random.key(7)
    init_key, train_key = jax.random.split(key)
    part = split_layers(cnn.init(init_key), names)[0]
    if rule == "fresh_torch":
        part = torch_init(part, init_key)
    started, rest = personal_start(fresh_layers(cnn, names, rule), None, key)
    assert_trees_equal(started, part)
    assert_trees_equal(jax.random.key_data(rest), jax.random.key_data(train_key))
    result = jax.jit(fresh.client_update)(params, client, key, None)
    assert result.client_state is None
    same = jax.jit(stored.client_update)(params, client, train_key, part)
    assert_trees_equal(result.params, same.params)
    assert_trees_equal(result.metrics, same.metrics)
    assert_trees_equal(jax.jit(fresh.personalize)(params, client, key, None),
                       jax.jit(stored.personalize)(params, client, train_key, part))
    assert differs(personal_start(fresh_layers(cnn, names, rule), None,
                                  jax.random.key(8))[0], part)
    # The stored method is untouched by the option's existence: its own key, its state.
    assert differs(jax.jit(stored.client_update)(params, client, key, part).params,
                   same.params)


def test_fedrep_phase_epochs_each_trains_e_head_and_e_body_epochs(cnn, images_small):
    """``phase_epochs="each"``: E head epochs, then E body epochs (the authors' code), and
    E head epochs at evaluation; set phases still win."""
    sgd = SGDConfig(**SGD)
    each = FedRepConfig(sgd=sgd, phase_epochs="each")
    assert (each.head_epochs, each.body_epochs) == (2, 2)
    assert (FedRepConfig(sgd=sgd).head_epochs, FedRepConfig(sgd=sgd).body_epochs) == (1, 1)
    set_ = FedRepConfig(sgd=sgd, phase_epochs="each", body_epochs=1)
    assert (set_.head_epochs, set_.body_epochs) == (2, 1)
    algorithm = fedrep(cnn, each)
    params, client = algorithm.init(jax.random.key(0)), _client(images_small, 1)
    result = jax.jit(algorithm.client_update)(params, client, jax.random.key(1),
                                              algorithm.init_client_state(params))
    n = float(client.num_examples)
    assert (float(result.metrics["head_loss_count"]),
            float(result.metrics["body_loss_count"])) == (2 * n, 2 * n)


def test_fedrep_zero_grad_moves_the_head_by_momentum_through_the_body_phase(cnn, images_small):
    """``frozen_momentum="zero_grad"``: one optimizer state over the round, so through the
    body phase the head steps by its velocity (the authors' code under PyTorch 1.11); the
    head phase is the default's exactly; without momentum nothing differs at all."""
    params, client, key = None, _client(images_small, 1), jax.random.key(1)
    runs = {}
    for rule in ("set_to_none", "zero_grad"):
        for momentum in (0.0, 0.9):
            algorithm = _fedrep(cnn, momentum, frozen_momentum=rule, phase_epochs="each")
            params = algorithm.init(jax.random.key(0)) if params is None else params
            runs[rule, momentum] = jax.jit(algorithm.client_update)(
                params, client, key, algorithm.init_client_state(params))
    assert_trees_equal(runs["zero_grad", 0.0].params, runs["set_to_none", 0.0].params)
    head_only = _fedrep(cnn, 0.9, head_epochs=2, body_epochs=0)
    after_head = jax.jit(head_only.client_update)(params, client, key,
                                                  head_only.init_client_state(params))
    # The default leaves the head as its phase left it; zero_grad moves it on.
    assert_trees_equal(runs["set_to_none", 0.9].client_state, after_head.client_state)
    assert differs(runs["zero_grad", 0.9].client_state, after_head.client_state)
    assert_trees_equal(runs["zero_grad", 0.9].metrics["head_loss_sum"],
                       runs["set_to_none", 0.9].metrics["head_loss_sum"])


@pytest.mark.parametrize("rule", ["set_to_none", "zero_grad"])
def test_lg_fedavg_alternating_step_is_a_local_step_then_a_global_step(rule, cnn,
                                                                       images_small):
    """One batch, both parts starting with velocity: the local layers step (the global
    ones frozen), then the global layers from the new local ones; under ``zero_grad``
    each frozen part also moves by its momentum (its velocity times lr, here
    ``0.9 * v``), under ``set_to_none`` it does not move at all."""
    optimizer = SGDConfig(**SGD, momentum=0.9).optimizer()
    whole = cnn.init(jax.random.key(0))
    parts = {"local": {n: whole[n] for n in LOCAL}, "global": {n: whole[n] for n in HEAD}}
    client = _client(images_small, 1)
    x, y, mask = client.flat()
    batch = (x[:4], y[:4], mask[:4].astype(jnp.float32))
    # Velocities from one earlier plain step of each part.
    states = {}
    for name, other in (("local", "global"), ("global", "local")):
        (_, states[name]), _ = part_sgd_step(cnn, parts[other], optimizer)(
            (parts[name], optimizer.init(parts[name])), batch, jax.random.key(3))
    key = jax.random.key(4)
    (got, got_states), sums = jax.jit(alternating_step(cnn, optimizer, rule))(
        (parts, states), batch, key)

    def coast(part, state):  # a zero gradient's step: p - lr * momentum * v
        updates, state = optimizer.update(jax.tree.map(jnp.zeros_like, part), state, part)
        return jax.tree.map(jnp.add, part, updates), state

    local, global_ = parts["local"], parts["global"]
    local_state, global_state = states["local"], states["global"]
    (local, local_state), _ = part_sgd_step(cnn, global_, optimizer)(
        (local, local_state), batch, jax.random.fold_in(key, 0))
    if rule == "zero_grad":
        global_, global_state = coast(global_, global_state)
    (global_, global_state), expected_sums = part_sgd_step(cnn, local, optimizer)(
        (global_, global_state), batch, jax.random.fold_in(key, 1))
    if rule == "zero_grad":
        local, local_state = coast(local, local_state)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(expected_sums), rtol=1e-6)
    for name, expected in (("local", local), ("global", global_)):
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_lg_fedavg_alternating_update_differs_from_the_joint_one(cnn, images_small):
    """The alternating round is another round than the paper's joint one (same start,
    key and batches), and ``frozen_momentum`` only means something with it."""
    params, client = None, _client(images_small, 1)
    sent = {}
    for update in ("joint", "alternating"):
        algorithm = _lg_fedavg(cnn, local_update=update)
        params = algorithm.init(jax.random.key(0)) if params is None else params
        sent[update] = jax.jit(algorithm.client_update)(
            params, client, jax.random.key(1), algorithm.init_client_state(params)).params
    assert differs(sent["joint"]["global"], sent["alternating"]["global"])
    with pytest.raises(ValueError, match=r"^frozen_momentum='zero_grad': expected None with "
                       r"the joint local update, which freezes no part \(set "
                       r"local_update='alternating'\)$"):
        LGFedAvgConfig(sgd=SGDConfig(**SGD), frozen_momentum="zero_grad")


@pytest.mark.parametrize("cls,field", [(FedRepConfig, "personal_init"),
                                       (FedRepConfig, "phase_epochs"),
                                       (FedRepConfig, "frozen_momentum"),
                                       (FedRepConfig, "torch_layers"),
                                       (LGFedAvgConfig, "personal_init"),
                                       (LGFedAvgConfig, "local_update"),
                                       (LGFedAvgConfig, "torch_layers")])
def test_bad_option_values_name_the_field_and_the_choices(cls, field):
    with pytest.raises(ValueError, match=rf"^{field}='sometimes': expected one of "):
        cls(sgd=SGDConfig(**SGD), **{field: "sometimes"})


@pytest.mark.parametrize("method,options", [
    ("fedrep", {"personal_init": "fresh", "phase_epochs": "each",
                "frozen_momentum": "zero_grad", "client_snapshot": True,
                "head_layers": HEAD}),
    ("lg_fedavg", {"personal_init": "fresh_torch", "local_update": "alternating",
                   "frozen_momentum": "zero_grad", "client_snapshot": True,
                   "global_layers": HEAD})])
@pytest.mark.parametrize("mapping", ["vmap", "loop"])
def test_their_training_runs_through_the_engine_keeping_no_client_state(method, options,
                                                                        mapping):
    """The authors' round on the EMNIST CNN through ``experiment.run``, clients vmapped
    or looped: it trains and evaluates (their copy included), keeps no client state, and
    (vmapped) the same config and seed give the same numbers."""
    from tests.bad_input_cases import base_config, images

    def run():
        config = base_config({"model": "emnist_cnn", "algorithm": method, "num_rounds": 2,
                              "mapping.strategy": mapping, "sgd.learning_rate": 0.01,
                              f"methods.{method}.sgd.momentum": 0.9,
                              **{f"methods.{method}.{k}": v for k, v in options.items()}})
        data = images(sizes=(6, 9, 12), test_sizes=(3, 4, 5))
        simulation = run_config.simulation_for(run_config.resolve(config, data))
        return simulation, experiment.run(simulation)

    simulation, result = run()
    assert simulation.client_states is None  # no store at all: the method is stateless
    train = [h for h in result.history if h["kind"] == "train"]
    assert len(train) == 2 and all(np.isfinite(h["loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 <= summary.acc_p <= 1 and summary.acc_g_client_snapshot is not None
    if mapping == "vmap":  # once is enough to show the fresh draws repeat
        _, again = run()
        assert again.history == result.history
        assert again.summaries["train_clients"] == summary


def test_torch_layers_learn_as_pytorch_two_lstm_biases_and_padding_row(cnn, images_small):
    """``torch_layers`` (``models.layers.with_torch_layers``): the same logits bit for bit;
    each LSTM bias gets twice its gradient (PyTorch's ``b_ih`` and ``b_hh`` both learn),
    the embedding's row 0 none (``padding_idx=0``), every other gradient unchanged; on the
    CNN (no LSTM, no embedding) an LG-FedAvg round is the same bit for bit."""
    from flowjax.models import get_model
    from flowjax.models.base import forward
    from flowjax.models.layers import with_torch_layers

    lstm = get_model("shakespeare_lstm", vocab_size=20, embed_dim=4, hidden=8)
    torch_like = with_torch_layers(lstm)
    params = lstm.init(jax.random.key(0))
    x = jnp.array([[3, 4, 0, 0], [5, 0, 6, 7]])
    assert_trees_equal(forward(torch_like, params, x), forward(lstm, params, x))

    def grads(model):
        return jax.grad(lambda p: jnp.sum(forward(model, p, x) ** 2))(params)

    ours, theirs = grads(lstm), grads(torch_like)
    for layer in ("lstm1", "lstm2"):
        assert_trees_equal(theirs[layer]["bias"], 2.0 * ours[layer]["bias"])
        for weight in ("kernel", "recurrent_kernel"):
            assert_trees_equal(theirs[layer][weight], ours[layer][weight])
    table, table_ours = theirs["embedding"]["embedding"], ours["embedding"]["embedding"]
    assert not np.any(table[0]) and np.any(table_ours[0])
    assert_trees_equal(table[1:], table_ours[1:])
    assert_trees_equal(theirs["dense"], ours["dense"])
    # Routed on the mixed state the LSTMs bypass layer_apply (routed_recurrence): both
    # copies' biases learn twice as fast there too, nothing else changes.
    from flowjax.routing.routed import routed_forward
    local = jax.tree.map(lambda a: 0.5 * a, params)
    q0 = jnp.full(x.shape + (lstm.num_layers,), 0.25)

    def routed_grads(model):
        return jax.grad(lambda g, l: jnp.sum(routed_forward(
            model, g, l, q0, x, recurrence="mixed_state") ** 2), argnums=(0, 1))(params, local)

    assert_trees_equal(routed_forward(torch_like, params, local, q0, x, recurrence="mixed_state"),
                       routed_forward(lstm, params, local, q0, x, recurrence="mixed_state"))
    for ours_copy, theirs_copy in zip(routed_grads(lstm), routed_grads(torch_like)):
        for layer in ("lstm1", "lstm2"):
            assert_trees_equal(theirs_copy[layer]["bias"], 2.0 * ours_copy[layer]["bias"])
            assert_trees_equal(theirs_copy[layer]["kernel"], ours_copy[layer]["kernel"])
    plain, torch_cnn = _lg_fedavg(cnn), _lg_fedavg(cnn, torch_layers=True)
    params, client = plain.init(jax.random.key(0)), _client(images_small, 1)
    state = plain.init_client_state(params)
    assert_trees_equal(jax.jit(torch_cnn.client_update)(params, client, jax.random.key(2), state),
                       jax.jit(plain.client_update)(params, client, jax.random.key(2), state))


def _lapack_operand_shapes(program: str) -> list[str]:
    """The operand shapes of the LAPACK calls in a compiled CPU ``program``."""
    return re.findall(r"custom-call\(.*\), custom_call_target=\"lapack_\w+\", "
                      r"operand_layout_constraints=\{(\w+\[[\d,]*\])", program)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU runtime's workaround")
def test_a_fresh_init_calling_lapack_runs_one_client_at_a_time_with_the_same_numbers(cnn):
    """``base.fresh_layers``: on CPU the LSTMs' fresh init (a QR per orthogonal kernel)
    makes only unbatched LAPACK calls under ``vmap`` (a batched call can deadlock XLA's
    CPU runtime, ``launch/lapack_pool_deadlock.py``), and its numbers are each client's
    own init's, bit for bit; the CNN's init, which calls no LAPACK, keeps its batched
    program. The unwrapped init's batched program is compiled here, never run: it hung
    this test on a 2-core machine on 2026-12-06 (three runs of three)."""
    lstm = run_config.build_simulation(small_config(algorithm="lg_fedavg")).algorithm.model
    names = ("embedding", "lstm1", "lstm2")
    keys = jax.random.split(jax.random.key(3), 3)
    fresh = jax.jit(jax.vmap(fresh_layers(lstm, names)))
    batched = jax.jit(jax.vmap(lambda key: split_layers(lstm.init(key), names)[0]))
    shapes = _lapack_operand_shapes(fresh.lower(keys).compile().as_text())
    assert shapes and all(shape.count(",") == 1 for shape in shapes)  # matrices, no batch
    assert all(shape.startswith("f32[3,")  # the unwrapped init: batched calls
               for shape in _lapack_operand_shapes(batched.lower(keys).compile().as_text()))
    one_client = jax.jit(lambda key: split_layers(lstm.init(key), names)[0])
    assert_trees_equal(fresh(keys), jax.tree.map(lambda *leaves: jnp.stack(leaves),
                                                 *[one_client(key) for key in keys]))
    assert_trees_equal(jax.tree.map(lambda leaf: leaf[1], fresh(keys)),
                       jax.jit(fresh_layers(lstm, names))(keys[1]))
    cnn_fresh = str(jax.make_jaxpr(jax.vmap(fresh_layers(cnn, LOCAL)))(keys))
    assert "scan" not in cnn_fresh  # batched, not one client at a time
    assert "scan" in str(jax.make_jaxpr(jax.vmap(fresh_layers(lstm, names)))(keys))


THEIR_TEXT_LG_FEDAVG = """
import json
from flowjax import config as run_config, experiment
from tests.helpers import small_config
config = small_config(algorithm="lg_fedavg", num_rounds=2, **{
    "methods.lg_fedavg.personal_init": "fresh", "methods.lg_fedavg.local_update": "alternating",
    "methods.lg_fedavg.torch_layers": True})
simulation = run_config.build_simulation(config)
result = experiment.run(simulation)
print(json.dumps({"stateless": simulation.client_states is None,
                  "losses": [h["loss"] for h in result.history if h["kind"] == "train"],
                  "acc_p": result.summaries["train_clients"].acc_p}))
"""


def test_their_text_lg_fedavg_trains_with_fresh_lstm_layers():
    """Their Shakespeare LG-FedAvg (fresh local LSTM layers every round, the alternating
    update, PyTorch's layers: ``torch_layers``) runs two rounds through ``experiment.run``, in a fresh process (a deadlock
    fails the test instead of hanging the suite): before ``base.fresh_layers`` ran such an
    init one client at a time, this run hung in every try on a 2-core CPU."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run([sys.executable, "-c", THEIR_TEXT_LG_FEDAVG], cwd=root, env=env,
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("their text LG-FedAvg with fresh LSTM layers hung (killed after 240 s)")
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["stateless"] and len(outcome["losses"]) == 2
    assert all(np.isfinite(outcome["losses"])) and 0 <= outcome["acc_p"] <= 1
