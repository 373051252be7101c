"""Client-steps/s of one SGD step with the custom-VJP layers vs plain autodiff.

A round is ``lax.map`` over clients of a ``lax.scan(unroll=1)`` over SGD steps, in one jit,
as the engine runs it on CPU; ``vmap`` over clients is timed too. XLA flags are
process-wide, so compare flags by running this script once per setting, e.g.::

  python launch/bench_layers.py
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot python launch/bench_layers.py

``--compute_dtype_accuracy`` instead trains the EMNIST CNN with FedAvg on synthetic
EMNIST-shaped clients (``flowjax.data.synthetic.synthetic_images``: class prototypes,
per-client style and noise, Dirichlet labels) once with float32 and once with bf16
compute (``config.compute_dtype``), same seed, and prints each run's test accuracy::

  python launch/bench_layers.py --compute_dtype_accuracy --rounds=3

``--torch_convs`` instead times each EMNIST CNN convolution at batch 20, forward and
forward plus backward (input and kernel gradients), as flowjax runs it on CPU
(``Conv2D`` with the hand-written VJP, one jit) and as PyTorch eager runs it
(``conv2d``, channels_last; ``torch`` is optional, ``pip install torch==2.13.0``), one
after the other in one process, to locate where a CPU round loses to PyTorch's::

  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot \
      python launch/bench_layers.py --torch_convs
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from flowjax.models import get_model
from flowjax.models.base import Params, RoutableModel, forward
from launch import cli


def client_batches(model: RoutableModel, key: jax.Array, clients: int, steps: int,
                   batch: int) -> tuple[jax.Array, jax.Array]:
    """Random ``(x, y)`` shaped ``[clients, steps, batch, ...]`` for ``model``."""
    shape = (clients, steps, batch)
    if model.policy_input == "tokens":
        x = jax.random.randint(key, shape + (80,), 1, model.vocab_size)
        return x, jnp.roll(x, -1, axis=-1)
    x = jax.random.uniform(key, shape + (28, 28))
    return x, jax.random.randint(jax.random.fold_in(key, 1), shape, 0, model.num_classes)


def make_round(model: RoutableModel, client_map: str, lr: float = 0.01) -> Callable:
    """``round(params, x, y) -> per-client params`` of plain SGD over each client's steps."""

    def loss(params: Params, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
        logits = forward(model, params, x, train=True, key=key)
        weights = model.label_weights(y)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    def client(params: Params, x: jax.Array, y: jax.Array) -> Params:
        def step(p, inputs):
            x, y, key = inputs
            grads = jax.grad(loss)(p, x, y, key)
            return jax.tree.map(lambda a, g: a - lr * g, p, grads), None

        keys = jax.random.split(jax.random.key(0), x.shape[0])
        return lax.scan(step, params, (x, y, keys))[0]

    if client_map == "map":
        return jax.jit(lambda p, x, y: lax.map(lambda xy: client(p, *xy), (x, y)))
    return jax.jit(jax.vmap(client, in_axes=(None, 0, 0)))


def client_steps_per_s(model: RoutableModel, client_map: str, clients: int, steps: int,
                       batch: int, repeats: int) -> float:
    """Median over ``repeats`` timed rounds, after one compiling round."""
    params = model.init(jax.random.key(0))
    x, y = client_batches(model, jax.random.key(1), clients, steps, batch)
    run = make_round(model, client_map)
    jax.block_until_ready(run(params, x, y))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(params, x, y))
        times.append(time.perf_counter() - start)
    return clients * steps / statistics.median(times)


def compute_dtype_accuracy(rounds: int, conv_impl: str = "auto") -> dict[str, dict]:
    """Test accuracy and loss of the global model after ``rounds`` FedAvg rounds (10 of
    50 synthetic clients per round, 3 epochs of batch 20, lr 0.01, the EMNIST settings),
    with float32 and with bf16 compute."""
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.core.server_opt import server_optimizer
    from flowjax.data.synthetic import synthetic_images
    from flowjax.experiment import RunSettings, Simulation

    task = synthetic_images(num_clients=50, num_classes=62, examples=(40, 120), seed=0)
    test = [task.train.client(i, "test") for i in range(len(task.train.client_ids))]
    x = jnp.asarray(np.concatenate([t["x"] for t in test]))
    y = jnp.asarray(np.concatenate([t["y"] for t in test]))
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = get_model("emnist_cnn", conv_impl=conv_impl, compute_dtype=dtype)
        algorithm = fedavg(model, FedAvgConfig(sgd=SGDConfig(learning_rate=0.01, epochs=3,
                                                             batch_size=20)))
        settings = RunSettings(seed=0, num_rounds=rounds, clients_per_round=10,
                               batch_size=20, eval_held_out=False)
        simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0))
        state = simulation.init_state()
        for round_index in range(rounds):
            state, _ = simulation.run_round(state, round_index)
        logits = forward(model, state.params, x, train=False, key=jax.random.key(0))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        out[dtype] = {"accuracy": float(jnp.mean(jnp.argmax(logits, -1) == y)),
                      "loss": float(jnp.mean(loss))}
        print(f"emnist_cnn FedAvg, {rounds} rounds, compute_dtype={dtype}: test accuracy "
              f"{out[dtype]['accuracy']:.4f}, loss {out[dtype]['loss']:.4f} on {y.shape[0]} "
              "examples", flush=True)
    return out


def torch_convs(batch: int, repeats: int) -> dict[str, dict[str, float]]:
    """ms per call of the EMNIST CNN's two convolutions (``conv1`` 28x28x1 -> 32,
    ``conv2`` 26x26x32 -> 64, 3x3 VALID), forward and forward + backward, in flowjax
    (``Conv2D``, hand-written VJP; the backward with XLA's autodiff too) and in PyTorch
    eager, each the median of ``repeats`` calls; prints one line per layer."""
    import torch

    from flowjax.models.layers import Conv2D
    from launch.bench_common import median_seconds

    torch.set_num_threads(os.cpu_count() or 1)  # as launch/torch_reference.py times a round

    def ms(call: Callable[[], object]) -> float:
        return 1e3 * median_seconds(call, repeats)

    out = {}
    for name, (size, cin, cout) in (("conv1", (28, 1, 32)), ("conv2", (26, 32, 64))):
        layer = Conv2D(cout, custom_grad=True, impl="xla")
        x = jax.random.uniform(jax.random.key(0), (batch, size, size, cin))
        params = layer.init(jax.random.key(1), x)
        forward_jax = jax.jit(layer.apply)

        def grads_of(module):
            return jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x) ** 2),
                                    argnums=(0, 1)))

        grads_jax = grads_of(layer)
        # Outside a loop, as here, XLA's own convolution gradients are not the slow path
        # they are inside lax.scan (the reason for the hand-written VJP): timed beside it.
        grads_autodiff = grads_of(Conv2D(cout, custom_grad=False, impl="xla"))
        x_torch = torch.rand(batch, cin, size, size).contiguous(
            memory_format=torch.channels_last).requires_grad_(True)
        conv_torch = torch.nn.Conv2d(cin, cout, 3)

        def forward_torch():
            with torch.no_grad():
                return conv_torch(x_torch)

        def grads_torch():
            x_torch.grad = None
            conv_torch.zero_grad(set_to_none=True)
            (conv_torch(x_torch) ** 2).sum().backward()

        out[name] = {"forward_jax": ms(lambda: forward_jax(params, x)),
                     "forward_torch": ms(forward_torch),
                     "backward_jax": ms(lambda: grads_jax(params, x)),
                     "backward_jax_autodiff": ms(lambda: grads_autodiff(params, x)),
                     "backward_torch": ms(grads_torch)}
        r = out[name]
        print(f"{name} batch {batch}: forward flowjax {r['forward_jax']:.3f} ms, PyTorch "
              f"{r['forward_torch']:.3f} ms ({r['forward_torch'] / r['forward_jax']:.2f}x); "
              f"forward+backward flowjax {r['backward_jax']:.3f} ms, PyTorch "
              f"{r['backward_torch']:.3f} ms "
              f"({r['backward_torch'] / r['backward_jax']:.2f}x); flowjax with XLA's "
              f"autodiff {r['backward_jax_autodiff']:.3f} ms "
              f"({r['backward_torch'] / r['backward_jax_autodiff']:.2f}x)", flush=True)
    return out


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=cli.integer_at_least(1), default=10)
    parser.add_argument("--steps", type=cli.integer_at_least(1), default=20)
    parser.add_argument("--repeats", type=cli.integer_at_least(1), default=3)
    parser.add_argument("--slow_clients", type=cli.integer_at_least(1), default=2,
                        help="clients for the slow autodiff-conv baseline")
    parser.add_argument("--compute_dtype_accuracy", action="store_true",
                        help="train with float32 and bf16 compute; print test accuracies")
    parser.add_argument("--rounds", type=cli.integer_at_least(1), default=30)
    parser.add_argument("--torch_convs", action="store_true",
                        help="time the CNN's convolutions in flowjax and in PyTorch eager")
    args = parser.parse_args()
    if args.torch_convs:
        calls = 100 * args.repeats  # sub-millisecond calls: many, for a stable median
        print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; ms per call, median of "
              f"{calls} calls; flowjax / PyTorch speed in brackets")
        torch_convs(batch=20, repeats=calls)
        return
    if args.compute_dtype_accuracy:
        print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
        compute_dtype_accuracy(args.rounds)
        return
    cases = [  # model, batch, custom_grad, client map, clients
        ("emnist_cnn", 20, True, "map", args.clients),
        ("emnist_cnn", 20, True, "vmap", args.clients),
        ("emnist_cnn", 20, False, "map", args.slow_clients),
        ("shakespeare_lstm", 4, True, "map", args.clients),
        ("shakespeare_lstm", 4, True, "vmap", args.clients),
        ("shakespeare_lstm", 4, False, "map", args.clients),
    ]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"{args.steps} steps per client, median of {args.repeats}")
    for name, batch, custom_grad, client_map, clients in cases:
        model = get_model(name, custom_grad=custom_grad)
        rate = client_steps_per_s(model, client_map, clients, args.steps, batch, args.repeats)
        grad = "custom VJP" if custom_grad else "autodiff"
        print(f"{name:17s} batch {batch:2d} {grad:10s} {client_map:4s} x{clients:<3d} "
              f"{rate:7.1f} client-steps/s", flush=True)


if __name__ == "__main__":
    main()
