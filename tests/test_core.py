"""Engine pieces: weighted mean, sampler, cohorts, epochs, mapping, server optimizers."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax.core.client_state import expected_clients, memory_forecast
from flowjax.core.cohort import assemble_cohort, examples_per_client, padding_efficiency
from flowjax.core.local_training import epoch_batches, run_epochs, run_epochs_each
from flowjax.core.mapping import ClientMapping, map_clients
from flowjax.core.sampler import ClientSampler
from flowjax.core.server_opt import apply_server_update, server_optimizer
from flowjax.core.tree import weighted_mean


def test_weighted_mean_matches_hand_computation():
    stacked = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "b": jnp.array([1.0, 2.0, 4.0])}
    weights = jnp.array([1.0, 0.0, 3.0])
    mean = weighted_mean(stacked, weights)
    np.testing.assert_allclose(mean["a"], [(1 + 15) / 4, (2 + 18) / 4], rtol=1e-7)
    np.testing.assert_allclose(mean["b"], (1 + 12) / 4, rtol=1e-7)


def test_weighted_mean_with_equal_weights_is_the_mean():
    # Eighths of small integers sum without rounding in any order, so the mean is exact
    # up to its one division, which jnp.mean's jitted form does as ours does (times 1/n).
    # Clients of 60 examples each must not round every term by 60 and the scale by 1/600.
    stacked = jax.random.randint(jax.random.key(0), (10, 7), -50, 50).astype(jnp.float32) / 8
    jit_mean = jax.jit(lambda x: jnp.mean(x, axis=0))
    for count in (3, 7, 10):
        for weight in (1.0, 60.0, 137.0, 0.1, 3e5):
            np.testing.assert_array_equal(
                weighted_mean(stacked[:count], jnp.full((count,), weight)),
                jit_mean(stacked[:count]))
    # Padding clients (weight 0) among equal weights: the mean of the others.
    weights = jnp.array([60.0, 60.0, 0.0, 60.0, 0.0])
    np.testing.assert_array_equal(weighted_mean(stacked[:5], weights),
                                  jit_mean(stacked[jnp.array([0, 1, 3])]))


def test_weighted_mean_keeps_float64_leaves_to_float64_precision():
    # With x64 on, the weights' sum and its inverse were float32: three clients equal to
    # 1.0 averaged to 1.0000000298.
    with jax.enable_x64(True):
        ones = jnp.ones((3, 2), jnp.float64)
        np.testing.assert_array_equal(weighted_mean(ones, jnp.array([1.0, 1.0, 1.0])), 1.0)
        np.testing.assert_array_equal(weighted_mean(ones, jnp.array([1.0, 2.0, 3.0])), 1.0)
        values = jnp.array([1.0, 2.0, 3.0], jnp.float64)
        got = weighted_mean(values, jnp.array([1.0, 2.0, 3.0]))
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, 14.0 / 6.0, rtol=2e-16)


def test_weighted_mean_with_equal_weights_does_not_depend_on_their_value():
    stacked = {"a": jax.random.normal(jax.random.key(1), (10, 33, 17)),
               "b": jax.random.normal(jax.random.key(2), (10,))}
    by_one = weighted_mean(stacked, jnp.ones(10))
    for weight in (60.0, 137.0, 0.1, 3e5):
        same = jax.tree.map(np.array_equal, by_one,
                                  weighted_mean(stacked, jnp.full((10,), weight)))
        assert all(jax.tree.leaves(same)), weight


def test_weighted_mean_of_nothing_is_zero_not_nan():
    assert np.all(weighted_mean(jnp.ones((2, 3)), jnp.zeros(2)) == 0)


def test_sampler_is_round_indexed_and_uniform():
    sampler = ClientSampler(num_clients=50, clients_per_round=10, seed=3)
    np.testing.assert_array_equal(sampler.sample(7), ClientSampler(50, 10, 3).sample(7))
    assert not np.array_equal(sampler.sample(7), sampler.sample(8))
    assert not np.array_equal(sampler.sample(7), ClientSampler(50, 10, 4).sample(7))
    draws = np.concatenate([sampler.sample(r) for r in range(500)])
    assert all(len(set(sampler.sample(r))) == 10 for r in range(20))
    counts = np.bincount(draws, minlength=50)
    assert counts.min() > 60 and counts.max() < 140  # expected 100 each


def test_sampler_rejects_more_clients_than_available():
    with pytest.raises(ValueError, match="clients_per_round must be in \\[1, 5\\]"):
        ClientSampler(num_clients=5, clients_per_round=6, seed=0)


def test_cohort_shapes_masks_and_cap(images_small):
    data = images_small.train
    sizes = data.num_examples("train")
    padded = examples_per_client(sizes, batch_size=4, cap=12)
    assert padded == 12
    cohort = assemble_cohort(data, "train", [0, 3], num_clients=3, padded_examples=padded,
                             batch_size=4)
    assert cohort.x.shape == (3, 3, 4, 28, 28) and cohort.mask.shape == (3, 3, 4)
    np.testing.assert_array_equal(cohort.num_examples, [min(sizes[0], 12), min(sizes[3], 12), 0])
    np.testing.assert_array_equal(cohort.client_id, [0, 3, -1])
    np.testing.assert_array_equal(cohort.mask.reshape(3, -1).sum(1), cohort.num_examples)
    first = data.client(3, "train")
    n = cohort.num_examples[1]
    np.testing.assert_array_equal(cohort.x[1].reshape(-1, 28, 28)[:n], first["x"][:n])
    assert 0 < padding_efficiency(cohort) <= 1


def test_a_cap_that_is_not_whole_batches_keeps_exactly_the_cap(images_small):
    """max_examples_per_client = 10 at batch 4: cohorts are padded to 12 slots, and every
    client keeps its first 10 examples, not 12 (as a cap of 1,000 sentences at batch 16
    must keep 1,000, not 1,008)."""
    from flowjax.experiment import RunSettings, Simulation
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from tests.helpers import tiny_mlp
    sizes = images_small.train.num_examples("train")
    assert sizes.max() > 12
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=len(sizes), batch_size=4,
                           max_examples_per_client=10)
    algorithm = fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                              batch_size=4)))
    simulation = Simulation(algorithm, images_small, settings, server_optimizer=optax.sgd(1.0))
    cohort = simulation.host_cohort(0)
    assert simulation.train_examples == 12 and cohort.mask.shape[1:] == (3, 4)
    np.testing.assert_array_equal(cohort.num_examples, np.minimum(sizes[cohort.client_id], 10))
    np.testing.assert_array_equal(cohort.mask.reshape(len(sizes), -1).sum(1), cohort.num_examples)


def test_epoch_batches_cover_each_member_once_and_ignore_padding():
    member = jnp.array([True, False, True, True, False, True, True])
    indices, mask = epoch_batches(jax.random.key(0), member, batch_size=2, max_members=5)
    picked = np.asarray(indices)[np.asarray(mask)]
    assert sorted(picked.tolist()) == [0, 2, 3, 5, 6]
    longer = jnp.concatenate([member, jnp.zeros(9, bool)])
    indices2, mask2 = epoch_batches(jax.random.key(0), longer, batch_size=2, max_members=5)
    np.testing.assert_array_equal(np.asarray(indices2)[np.asarray(mask2)], picked)


def test_run_epochs_skips_padded_steps():
    def step(total, batch, key):
        x, _, w = batch
        return total + jnp.sum(x * w), jnp.stack([jnp.sum(w), jnp.sum(w)])

    x = jnp.arange(10.0)
    member = x < 5
    total, sums = run_epochs(step, jnp.zeros(()), x, x, member, num_epochs=3, batch_size=2,
                             key=jax.random.key(1))
    assert float(total) == 3 * (0 + 1 + 2 + 3 + 4)
    assert float(sums[1]) == 15


def test_run_epochs_each_keeps_every_epochs_sums_and_run_with_copies_takes_first_and_last():
    """A step whose loss statistic is the running total seen so far: each epoch's sums
    differ, ``run_epochs`` is their sum, and ``run_with_copies`` returns the carry and sums
    of the first epoch and of the last, those of one uncut run."""
    from flowjax.algorithms.base import run_with_copies

    def step(total, batch, key):
        x, _, w = batch
        total = total + jnp.sum(x * w)
        return total, jnp.stack([total, jnp.sum(w)])

    x = jnp.arange(10.0)
    member = x < 5
    common = dict(batch_size=2, key=jax.random.key(1))
    total, each = run_epochs_each(step, jnp.zeros(()), x, x, member, num_epochs=4, **common)
    assert float(total) == 4 * 10.0
    assert each.shape == (4, 2)
    np.testing.assert_array_equal(each[:, 1], [5, 5, 5, 5])
    summed = run_epochs(step, jnp.zeros(()), x, x, member, num_epochs=4, **common)
    assert float(summed[0]) == float(total)
    np.testing.assert_array_equal(summed[1], np.sum(np.asarray(each), axis=0))
    for epochs in (1, 2, 4):
        first, first_sums, last, last_sums = run_with_copies(
            step, jnp.zeros(()), x, x, member, epochs=epochs, **common)
        whole, whole_each = run_epochs_each(step, jnp.zeros(()), x, x, member,
                                            num_epochs=epochs, **common)
        assert float(first) == 10.0 and float(last) == float(whole) == epochs * 10.0
        np.testing.assert_array_equal(first_sums, whole_each[0])
        np.testing.assert_array_equal(last_sums, whole_each[-1])


@pytest.mark.parametrize("steps_per_loop", [2, 3, 7])
def test_steps_per_loop_runs_the_same_steps_and_none_past_the_count(steps_per_loop):
    """Clients of 5, 2 and 0 members in batches of 2 (3, 1, 0 steps per epoch) under
    ``vmap``: a step that would add 1,000 on a padded batch shows that no client runs a
    step past its count, with 7 per loop (more than any client has) too."""
    def step(total, batch, key):
        x, _, w = batch
        padded = 1000.0 * (jnp.sum(w) == 0)
        return total + jnp.sum(x * w) + padded, jnp.stack([jnp.sum(w), jnp.sum(w)])

    x = jnp.arange(10.0)
    members = jnp.stack([x < 5, x < 2, x < 0])
    keys = jax.random.split(jax.random.key(1), 3)

    def run(per_loop):
        return jax.jit(jax.vmap(lambda member, key: run_epochs(
            step, jnp.zeros(()), x, x, member, num_epochs=3, batch_size=2, key=key,
            steps_per_loop=per_loop)))(members, keys)

    totals, sums = run(steps_per_loop)
    np.testing.assert_array_equal(totals, [3 * 10.0, 3 * 1.0, 0.0])
    np.testing.assert_array_equal(sums[:, 1], [15, 6, 0])
    expected = run(1)
    np.testing.assert_array_equal(totals, expected[0])
    np.testing.assert_array_equal(sums, expected[1])
    with pytest.raises(ValueError, match=r"^steps_per_loop=0: expected an integer >= 1$"):
        run_epochs(step, jnp.zeros(()), x, x, x < 5, num_epochs=1, batch_size=2,
                   key=keys[0], steps_per_loop=0)


def test_a_loop_of_steps_is_an_inner_loop_of_known_trip_count():
    """``steps_per_loop=k`` adds one loop to the compiled program: k steps with a trip count
    XLA knows (a GPU runs such a loop without reading its condition back to the host),
    inside the one loop whose trip count depends on the data; the step is compiled once,
    not k times (the first form unrolled k copies and compiled 4x longer for Flow)."""
    import collections
    import re

    def step(total, batch, key):
        x, _, w = batch
        return total + jnp.sum(x * w), jnp.stack([jnp.sum(w), jnp.sum(w)])

    x = jnp.arange(10.0)
    members = jnp.stack([x < 5, x < 2])

    def loops(per_loop):
        program = jax.jit(jax.vmap(lambda member: run_epochs(
            step, jnp.zeros(()), x, x, member, num_epochs=1, batch_size=2,
            key=jax.random.key(1), steps_per_loop=per_loop))).lower(members).compile().as_text()
        whiles = [line for line in program.splitlines()
                  if re.search(r"^\s*(ROOT )?%\S+ = .* while\(", line)]
        trip_count = r'"known_trip_count":\{"n":"(\d+)"\}'
        known = collections.Counter(int(n) for line in whiles
                                    for n in re.findall(trip_count, line))
        return known, len(whiles) - sum(known.values())

    (one_known, one_unknown), (six_known, six_unknown) = loops(1), loops(6)
    assert six_known - one_known == collections.Counter({6: 1}) and one_known <= six_known
    assert (one_unknown, six_unknown) == (1, 2)  # the step loop; the groups' and the rest's


def test_the_mapping_modules_examples_hold():
    import doctest
    from flowjax.core import mapping
    assert doctest.testmod(mapping).failed == 0


@pytest.mark.parametrize("strategy,chunk", [("loop", 1), ("vmap", 1), ("chunked", 2)])
def test_mapping_strategies_agree(strategy, chunk):
    w = jax.random.normal(jax.random.key(0), (5, 3, 3))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    fn = map_clients(lambda w, x: jnp.tanh(w @ x), ClientMapping(strategy, chunk))
    np.testing.assert_allclose(jax.jit(fn)(w, x), jnp.tanh(jnp.einsum("cij,cj->ci", w, x)),
                               rtol=1e-6)


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown client mapping strategy 'pmap'"):
        ClientMapping("pmap")


@pytest.mark.parametrize("fields,message", [
    ({"chunk_size": 2.5}, "chunk_size must be an integer >= 1, got 2.5"),
    ({"chunk_size": True}, "chunk_size must be an integer >= 1, got True"),
    ({"num_devices": 1.0}, f"num_devices=1.0: expected an integer in "
                           f"[1, {jax.device_count()}] (devices visible)")])
def test_a_mapping_of_non_integer_sizes_is_one_line(fields, message):
    """Through the Python API (the config path validates first): a float size passed the
    checks and failed later in a slice or a reshape."""
    with pytest.raises(ValueError) as raised:
        ClientMapping("chunked", **fields)
    assert str(raised.value) == message
    assert ClientMapping("chunked", np.int64(2)).chunk_size == 2


def test_a_hand_built_mapping_that_leaves_a_process_out_is_refused(monkeypatch):
    """The Python API checks what the config path checks (tests/test_multihost.py runs
    that one in two processes): here two processes of two devices each, seen as JAX
    lists them, process 0's first."""
    from flowjax.core import mapping as mapping_module
    devices = [types.SimpleNamespace(process_index=index // 2) for index in range(4)]
    monkeypatch.setattr(mapping_module.jax, "devices", lambda: devices)
    monkeypatch.setattr(mapping_module.jax, "device_count", lambda: 4)
    monkeypatch.setattr(mapping_module.jax, "process_count", lambda: 2)
    for num_devices in (1, 2):
        with pytest.raises(ValueError) as raised:
            ClientMapping("loop", num_devices=num_devices)
        assert str(raised.value) == (
            f"num_devices={num_devices}: expected an integer in [3, 4]: in a run of 2 "
            "processes the clients axis must reach a device of every process (it takes "
            "the first num_devices of the 4 devices)")
    assert ClientMapping("loop", num_devices=3).num_devices == 3


def test_fedavg_server_step_moves_to_the_client_mean():
    params = {"w": jnp.array([1.0, -2.0])}
    optimizer = server_optimizer("sgd", 1.0)
    mean = {"w": jnp.array([0.5, 0.25])}
    new, _ = apply_server_update(optimizer, params, optimizer.init(params), mean)
    np.testing.assert_allclose(new["w"], mean["w"], rtol=1e-7)


def test_adaptive_server_optimizers_follow_reddi_et_al():
    params = {"w": jnp.zeros(3)}
    mean = {"w": jnp.array([1.0, -1.0, 0.5])}  # pseudo-gradient params - mean = -delta
    delta = mean["w"]
    lr, b1, b2, eps = 0.1, 0.9, 0.99, 1e-3
    # Paper's Algorithm 2 without bias correction, first step, from v_{-1} = tau^2
    # (tests/test_server_opt.py checks every optimizer over two steps).
    m = (1 - b1) * delta
    v = b2 * eps ** 2 + (1 - b2) * delta ** 2
    optimizer = server_optimizer("adam", lr, b1=b1, b2=b2, eps=eps, bias_correction=False)
    new, _ = apply_server_update(optimizer, params, optimizer.init(params), mean)
    np.testing.assert_allclose(new["w"], lr * m / (np.sqrt(v) + eps), rtol=1e-5)
    # Every adaptive optimizer moves the server towards the clients on the first step.
    for name in ("yogi", "adagrad", "adam"):
        opt = server_optimizer(name, lr)
        moved, _ = apply_server_update(opt, params, opt.init(params), mean)
        assert np.all(np.sign(moved["w"]) == np.sign(delta)), name


def test_server_optimizer_rejects_unknown_names_and_bad_rates():
    with pytest.raises(ValueError, match="unknown server optimizer 'lamb'"):
        server_optimizer("lamb", 1.0)
    with pytest.raises(ValueError, match="server learning rate must be > 0, got 0"):
        server_optimizer("sgd", 0)


def test_the_engine_and_the_evaluation_import_no_method():
    """The engine runs whatever ``FederatedAlgorithm`` it is given (``engine.protocol``);
    importing ``flowjax.algorithms`` would load every method for its registry."""
    import subprocess
    import sys

    code = ("import sys; import flowjax.engine.loop, flowjax.engine.simulation, "
            "flowjax.evaluation.metrics; "
            "print(sorted(m for m in sys.modules if m.startswith('flowjax.algorithms')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_expected_clients_is_exact_at_the_edges_and_matches_the_sampler():
    assert expected_clients(4, 2, 0) == 0.0
    assert expected_clients(4, 2, 1) == 2.0
    assert expected_clients(7, 7, 3) == 7.0
    assert expected_clients(4, 2, 2) == 4 * (1 - 0.25)  # each client misses both rounds w.p. 1/4
    # The sampler the runs use, over many seeds: the mean count of distinct clients.
    counts = [len(np.unique(np.concatenate([ClientSampler(60, 5, seed).sample(r)
                                            for r in range(12)]))) for seed in range(400)]
    assert np.mean(counts) == pytest.approx(expected_clients(60, 5, 12), rel=0.01)


def test_memory_forecast_counts_every_leaf_of_a_client_state():
    shapes = {"v": jax.ShapeDtypeStruct((1000, 25), jnp.float32),
              "step": jax.ShapeDtypeStruct((), jnp.int32), "b": np.zeros(6, np.float64)}
    forecast = memory_forecast(shapes, population=400, per_round=10, rounds=2000,
                               available_bytes=2**30)
    assert forecast.per_client_bytes == 1000 * 25 * 4 + 4 + 6 * 8
    assert forecast.total_bytes == forecast.per_client_bytes * expected_clients(400, 10, 2000)
    assert not forecast.exceeds_available
    assert forecast.line().endswith(
        "0.10 MiB per client that trains, about 400 of the 400 training clients by the last "
        "round, so about 0.04 GiB of host memory (more while the store grows and a "
        "checkpoint is written); this host has 1.0 GiB")
    assert memory_forecast(shapes, 400, 10, 2000, available_bytes=10**6).exceeds_available
    assert not memory_forecast(shapes, 400, 10, 2000, available_bytes=None).exceeds_available
    # A disk-backed store's rows are weighed against the free space of its disk.
    on_disk = memory_forecast(shapes, 400, 10, 2000, 3 * 2**30, disk="runs/so/client_states")
    assert on_disk.line().endswith(
        "0.04 GiB of disk in runs/so/client_states (and the undo log's copies of the rows "
        "overwritten since the last checkpoint); 3.0 GiB free there")
    assert memory_forecast(shapes, 400, 10, 2000, 10**6, disk="x").exceeds_available
