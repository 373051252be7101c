r"""Client-steps/s of FedAvg and Flow rounds, per client-mapping strategy, side by side.

  python launch/benchmark.py                       # both models, every strategy
  python launch/benchmark.py --models=emnist_cnn --strategies=loop --repeats=5

For each model it times, in one process: a FedAvg round and a Flow round through the
engine (``Simulation.run_round``) for each strategy; the same clients trained by a Python
loop calling the same jitted ``client_update`` one client at a time (the FedJAX / PFLlib
way); and the centralized-equivalent work, ``steps`` SGD steps of the plain model on one
batch of ``clients x batch`` examples (the physical limit). A client-step is one minibatch
visited by one client: FedAvg visits ``steps`` per client (one epoch); Flow visits
``steps / 2`` in its local phase and ``steps / 2`` in its routing phase, where each
minibatch takes a policy step and a global step through both branches.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import xla_env  # noqa: E402

xla_env.apply()

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from flowjax.algorithms.base import plain_loss_sums, sgd_step  # noqa: E402
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg  # noqa: E402
from flowjax.algorithms.flow import FlowConfig, flow  # noqa: E402
from flowjax.core.cohort import client_at  # noqa: E402
from flowjax.core.mapping import ClientMapping  # noqa: E402
from flowjax.core.server_opt import server_optimizer  # noqa: E402
from flowjax.core.tree import weighted_mean  # noqa: E402
from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit  # noqa: E402
from flowjax.experiment import RunSettings, Simulation  # noqa: E402
from flowjax.models import get_model  # noqa: E402

_MODELS = flags.DEFINE_list("models", ["emnist_cnn", "shakespeare_lstm"], "Models to time.")
_STRATEGIES = flags.DEFINE_list("strategies", ["loop", "chunked", "vmap"], "Client mappings.")
_CLIENTS = flags.DEFINE_integer("clients", 10, "Clients per round.")
_STEPS = flags.DEFINE_integer("steps", 20, "Minibatches per client per round.")
_CHUNK = flags.DEFINE_integer("chunk_size", 5, "Clients per vmapped chunk for 'chunked'.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).")
_OUT = flags.DEFINE_string("out", None, "Optional JSON file for the measurements.")
_CUSTOM_GRAD = flags.DEFINE_enum("custom_grad", "auto", ["auto", "true", "false"],
                                 "Hand-written VJPs for convs/LSTMs (auto: the model's default).")

BATCH = {"emnist_cnn": 20, "shakespeare_lstm": 4}
POLICY = {"emnist_cnn": (350, 150, 50, 50), "shakespeare_lstm": (64, 64, 32, 16)}
LEARNING_RATE = {"emnist_cnn": 0.01, "shakespeare_lstm": 0.11}


def synthetic_task(model_name: str, clients: int, examples: int, seed: int = 0) -> FederatedTask:
    """Every client holds exactly ``examples`` examples, so no step is padding."""
    rng = np.random.default_rng(seed)
    if model_name == "emnist_cnn":
        x = rng.normal(size=(clients * examples, 28, 28)).astype(np.float32)
        y = rng.integers(0, 62, size=(clients * examples,)).astype(np.int32)
    else:
        tokens = rng.integers(1, 87, size=(clients * examples, 81)).astype(np.int32)
        x, y = tokens[:, :-1], tokens[:, 1:]
    offsets = np.arange(clients + 1, dtype=np.int64) * examples
    split = RaggedSplit({"x": x, "y": y}, offsets)
    data = ArrayFederatedData(tuple(f"c{i}" for i in range(clients)), {"train": split, "test": split})
    return FederatedTask(train=data, held_out=None, name=f"synthetic_{model_name}")


def algorithms(model_name: str, example_x):
    options = {} if _CUSTOM_GRAD.value == "auto" else {"custom_grad": _CUSTOM_GRAD.value == "true"}
    model = get_model(model_name, **options)
    batch, lr = BATCH[model_name], LEARNING_RATE[model_name]
    return model, {
        "fedavg": fedavg(model, FedAvgConfig(learning_rate=lr, epochs=1, batch_size=batch)),
        "flow": flow(model, FlowConfig(learning_rate=lr, local_epochs=1, routing_epochs=1,
                                       batch_size=batch, gamma=1e-3,
                                       policy_hidden=POLICY[model_name]), example_x),
    }


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_engine_round(algorithm, task, strategy, chunk_size, repeats):
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=len(task.train.client_ids),
                           batch_size=BATCH[algorithm.model.name], eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0),
                            ClientMapping(strategy, chunk_size))
    cohort = jax.device_put(simulation.cohort(0))
    state = simulation.init_state()

    def one_round():
        # The round donates its input state; hand it a fresh copy each time.
        fresh = jax.tree.map(jnp.copy, state)
        return simulation.run_round(fresh, 0, cohort)[0]

    seconds = median_seconds(one_round, repeats)
    return seconds, simulation.trace_counts["round"]


def time_sequential_loop(algorithm, task, repeats):
    """A Python loop over clients, each calling the same jitted client update."""
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=len(task.train.client_ids),
                           batch_size=BATCH[algorithm.model.name], eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0))
    cohort = jax.device_put(simulation.cohort(0))
    params = simulation.init_state().params
    update = jax.jit(algorithm.client_update)
    mean = jax.jit(weighted_mean)
    clients = [client_at(cohort, i) for i in range(len(task.train.client_ids))]

    def one_round():
        results = [update(params, c, jax.random.key(i)) for i, c in enumerate(clients)]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[r.params for r in results])
        return mean(stacked, jnp.stack([r.weight for r in results]))

    return median_seconds(one_round, repeats)


def time_centralized(model, task, clients, steps, repeats):
    """``steps`` SGD steps of the plain model on batches of ``clients x batch`` examples."""
    batch = BATCH[model.name] * clients
    x = jnp.asarray(task.train.splits["train"].features["x"][: steps * batch])
    y = jnp.asarray(task.train.splits["train"].features["y"][: steps * batch])
    x = x.reshape((steps, batch) + x.shape[1:])
    y = y.reshape((steps, batch) + y.shape[1:])
    optimizer = optax.sgd(LEARNING_RATE[model.name])
    step = sgd_step(lambda p, b, k: plain_loss_sums(model, p, b, k), optimizer)
    params = model.init(jax.random.key(0))

    @jax.jit
    def train(params):
        def body(carry, batch):
            return step(carry, (batch[0], batch[1], jnp.ones(batch[0].shape[0])), jax.random.key(0))
        return jax.lax.scan(body, (params, optimizer.init(params)), (x, y))[0]

    return median_seconds(lambda: train(params), repeats)


def main(argv):
    del argv
    clients, steps, repeats = _CLIENTS.value, _STEPS.value, _REPEATS.value
    client_steps = clients * steps
    report = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "jax": jax.__version__, "clients": clients, "steps": steps,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "custom_grad": _CUSTOM_GRAD.value,
              "models": {}}
    print(f"backend={report['backend']} device={report['device']} jax={report['jax']} "
          f"XLA_FLAGS='{report['xla_flags']}' custom_grad={_CUSTOM_GRAD.value}")
    for model_name in _MODELS.value:
        batch = BATCH[model_name]
        task = synthetic_task(model_name, clients, steps * batch)
        example_x = jnp.asarray(task.train.client(0, "train")["x"][:batch])
        model, methods = algorithms(model_name, example_x)
        rows = {}
        central = time_centralized(model, task, clients, steps, repeats)
        for method, algorithm in methods.items():
            sequential = time_sequential_loop(algorithm, task, repeats)
            rows[(method, "python loop (sequential)")] = (sequential, 1)
            for strategy in _STRATEGIES.value:
                rows[(method, strategy)] = time_engine_round(algorithm, task, strategy,
                                                             _CHUNK.value, repeats)
        print(f"\n{model_name}: {clients} clients x {steps} steps x batch {batch}; "
              f"centralized-equivalent {client_steps / central:.1f} client-steps/s "
              f"({central:.3f} s)")
        print("| method | mapping | round s | client-steps/s | vs python loop | "
              "vs centralized | compilations |")
        print("|---|---|---|---|---|---|---|")
        results = []
        for (method, strategy), (seconds, compiles) in rows.items():
            sequential = rows[(method, "python loop (sequential)")][0]
            results.append({"method": method, "mapping": strategy, "round_s": seconds,
                            "client_steps_per_s": client_steps / seconds,
                            "speedup_vs_python_loop": sequential / seconds,
                            "fraction_of_centralized": central / seconds,
                            "compilations": compiles})
            print(f"| {method} | {strategy} | {seconds:.3f} | {client_steps / seconds:.1f} | "
                  f"{sequential / seconds:.2f}x | {central / seconds:.2f} | {compiles} |")
        best = {m: min(s for (mm, _), (s, _) in rows.items() if mm == m) for m in methods}
        print(f"Flow round / FedAvg round (best mapping each): {best['flow'] / best['fedavg']:.2f}x")
        report["models"][model_name] = {"centralized_s": central, "rows": results,
                                        "flow_over_fedavg": best["flow"] / best["fedavg"]}
    if _OUT.value:
        with open(_OUT.value, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    app.run(main)
