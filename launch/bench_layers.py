"""Client-steps/s of one SGD step with the custom-VJP layers vs plain autodiff.

A round is ``lax.map`` over clients of a ``lax.scan(unroll=1)`` over SGD steps, in one jit,
as the engine runs it on CPU; ``vmap`` over clients is timed too. XLA flags are
process-wide, so compare flags by running this script once per setting, e.g.::

  python launch/bench_layers.py
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot python launch/bench_layers.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from flowjax.models import get_model
from flowjax.models.base import Params, RoutableModel, forward


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow_clients", type=int, default=2,
                        help="clients for the slow autodiff-conv baseline")
    args = parser.parse_args()
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
