"""The clients axis sharded over 2 emulated CPU devices gives the 1-device results."""

import os
import sys

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import sys
import jax, numpy as np
from flowjax import config as run_config, experiment
from flowjax.core.mapping import ClientMapping
from tests.helpers import small_synthetic_config

assert jax.device_count() == 2, jax.devices()
algorithm, clients, strategy, chunk = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
results = {}
for devices in (1, 2):
    # The synthetic MLP task (the clients axis is sharded the same whatever the model
    # is): its four programs compile in a fraction of the Shakespeare LSTM's time.
    # eval.chunk=3 of 4 clients: the last evaluation chunk is padded too.
    config = small_synthetic_config(algorithm=algorithm, num_rounds=2, clients_per_round=clients,
                                    **{"eval.clients": 4, "eval.chunk": 3})
    assert not config.eval.held_out
    simulation = run_config.build_simulation(config)
    mapping = ClientMapping("loop", 1, 1) if devices == 1 else ClientMapping(strategy, chunk, 2)
    simulation = experiment.Simulation(simulation.algorithm, simulation.task,
                                       simulation.settings, simulation.server_optimizer, mapping)
    outcome = experiment.run(simulation)
    # One compilation each, on two devices as on one.
    assert simulation.trace_counts == {"round": 1, "eval": 1}, simulation.trace_counts
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(outcome.final_state.params)]
    results[devices] = (leaves, outcome.summaries["train_clients"].acc_p)
one, two = results[1], results[2]
for a, b in zip(one[0], two[0]):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
assert abs(one[1] - two[1]) < 1e-6, (one[1], two[1])
print("sharded == single device")
'''


# FedAvg in CI (7 s alone): the clients axis is sharded and aggregated the same way for
# every method. Ditto's client states (sharded rows, written back per client) with a
# cohort of 5 that 2 devices split only with a padding client, 3 per device in chunks
# of 2 (the second a remainder), in CI too; Flow's routed programs (24 s) and full vmap
# with -m slow.
@pytest.mark.parametrize("algorithm,clients,strategy,chunk", [
    ("fedavg", 4, "loop", 1), ("ditto", 5, "chunked", 2),
    pytest.param("flow", 4, "loop", 1, marks=pytest.mark.slow),
    pytest.param("ditto", 4, "loop", 1, marks=pytest.mark.slow),
    pytest.param("flow", 3, "vmap", 1, marks=pytest.mark.slow)])
def test_two_emulated_devices_match_one_device(algorithm, clients, strategy, chunk):
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2",
               PYTHONPATH=ROOT)
    done = forkserver.run([sys.executable, "-c", SCRIPT, algorithm, str(clients), strategy,
                           str(chunk)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sharded == single device" in done.stdout


KMEANS_SCRIPT = r'''
import importlib
import jax, numpy as np
from flowjax import config as run_config
hypcluster = importlib.import_module("flowjax.algorithms.hypcluster")
from tests.helpers import small_synthetic_config

assert jax.device_count() == 2, jax.devices()
mapped, map_clients = [], hypcluster.map_clients
def recording_map_clients(fn, mapping, *args):
    mapped.append(mapping.num_devices)
    return map_clients(fn, mapping, *args)
hypcluster.map_clients = recording_map_clients
starts = {}
for devices in (1, 2):
    config = small_synthetic_config(algorithm="hypcluster", num_rounds=2,
                                    **{"mapping.num_devices": devices})
    config.methods.hypcluster.update(warmup_rounds=1, init="kmeans")
    starts[devices] = run_config.warm_up(run_config.resolve(config)).options["cluster_starts"]
for a, b in zip(jax.tree.leaves(starts[1]), jax.tree.leaves(starts[2])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
assert set(mapped) == {1, 2}, mapped  # the training and the losses, on 1 then 2 devices
print("kmeans starts: sharded == single device")
'''


def test_hypclusters_kmeans_init_shards_its_cohort_as_the_rounds_do():
    """Its clients train over the run's mapping, not in one vmap on one device (a cohort
    whose rounds fit only in chunks or over devices would not fit), with the same picks."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2",
               PYTHONPATH=ROOT)
    done = forkserver.run([sys.executable, "-c", KMEANS_SCRIPT], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "kmeans starts: sharded == single device" in done.stdout
