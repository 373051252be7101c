"""Run as a child (``tests/test_layers.py``): the routed EMNIST CNN's gradient, compiled
with the XLA flags this process was started with, against the same gradient in float64.
Prints the largest deviation relative to each array's largest entry.

An optional argument sets ``jax_default_matmul_precision`` (e.g. ``highest``): on NVIDIA
GPUs the default lets float32 products run in TF32, which this separates from the pool."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from flowjax.models import get_model
from flowjax.routing.routed import routed_forward


def main() -> None:
    if len(sys.argv) > 1:
        jax.config.update("jax_default_matmul_precision", sys.argv[1])
    model = get_model("emnist_cnn", num_classes=10)
    global_params, local_params = model.init(jax.random.key(1)), model.init(jax.random.key(2))
    # Images with a constant background, like Fashion-MNIST's: tied maxima in the pool.
    x = jax.random.uniform(jax.random.key(0), (8, 28, 28, 1))
    x = x * (jnp.arange(28)[:, None, None] > 8) * (jnp.arange(28)[None, :, None] < 20)
    y = jnp.arange(8) % 10
    q0 = jax.random.uniform(jax.random.key(3), (8, model.num_layers))

    def loss(global_params, local_params, q0, x):
        logits = routed_forward(model, global_params, local_params, q0, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    single = grad(global_params, local_params, q0, x)
    jax.config.update("jax_enable_x64", True)  # after init: the model initializes in float32
    wide = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float64), tree)  # noqa: E731
    double = grad(wide(global_params), wide(local_params), wide(q0), wide(x))
    worst = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(double)))
    precision = jax.config.jax_default_matmul_precision or "default"
    print(f"largest relative deviation from float64 (matmul precision {precision}): {worst:.3e}")


if __name__ == "__main__":
    main()
