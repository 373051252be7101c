"""Where one vmapped client step of a chain model spends its time, part by part.

A round of sorted chunks costs a fixed time per chunk-step plus a time per client-step
slot (``launch/chunk_costs.py``); on the H100 the Stack Overflow LSTM's slot cost is
about three times what its fewest bytes allow, and bf16 weights did not lower it
(``docs/benchmarks/roofline.md``). This times the parts of one step of ``--clients``
clients with their own weights, each part alone in its own jitted program, vmapped over
the clients as the engine runs them (no step loop, so no loop overhead):

* ``step``: the whole FedAvg step (``algorithms.base.sgd_step`` on the plain loss).
* ``layer <name>``: one routable layer's forward and backward (its input and weights'
  gradients from a random cotangent), on an input of the shape the step gives it.
* ``loss``: the loss on the logits and its gradient (no layer).
* ``update``: the SGD update of every weight from a gradient tree.
* ``recurrent products x 2T, chained`` (LSTM layers): ``h @ W_h`` as many times as the
  recurrence runs it (T time steps forward and T backward), in sequence in one program
  with no loop.

It prints each part's ms per step and per client-step, and the parts' sum against the
whole step (the gap: the glue between layers, such as pooling, dropout and activations,
which only the whole step runs, and what fusing across parts saves or costs)::

  python launch/step_parts.py --model=stackoverflow_lstm --clients=19 \\
      --compute_dtypes=float32,bfloat16 --json_out=parts.json
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flowjax.algorithms.base import instance_weights, plain_loss_sums, sgd_step
from flowjax.core.losses import mean_from_sums, weighted_cross_entropy
from flowjax.models import get_model, model_takes
from flowjax.models.base import RoutableModel
from flowjax.models.layers import lstm_weights
from launch import cli
from launch.bench_common import BATCH, LEARNING_RATE, median_seconds, synthetic_examples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="stackoverflow_lstm", choices=sorted(BATCH))
    parser.add_argument("--clients", type=cli.integer_at_least(1), default=19, help="clients in the vmapped step")
    parser.add_argument("--repeats", type=cli.integer_at_least(1), default=10, help="timed calls per part (median)")
    parser.add_argument("--compute_dtypes", default="float32",
                        help="comma-separated config.compute_dtype values, one table each")
    parser.add_argument("--model_options", default="{}",
                        help="JSON keyword arguments of the model factory (smaller sizes)")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args(argv)
    if args.clients < 1 or args.repeats < 1:
        parser.error(f"--clients={args.clients} --repeats={args.repeats}: expected both >= 1")
    return args


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """``median_seconds`` in milliseconds."""
    return 1e3 * median_seconds(fn, repeats)


def stacked(tree, clients: int):
    """Each leaf repeated for ``clients`` clients, slightly apart (own weights each)."""
    scale = 1.0 + 1e-3 * jnp.arange(clients, dtype=jnp.float32)
    return jax.tree.map(lambda a: a[None] * scale.reshape((-1,) + (1,) * a.ndim).astype(a.dtype),
                        tree)


def layer_inputs(model: RoutableModel, params, x: jax.Array) -> list[jax.Array]:
    """The input of each routable layer on ``x`` (one client's)."""
    h, inputs = model.embed_input(x), []
    for j, name in enumerate(model.layer_names):
        inputs.append(h)
        h = model.glue_apply(j, model.layer_apply(j, params[name], h), False, jax.random.key(0))
    return inputs + [h]


def time_parts(model: RoutableModel, clients: int, repeats: int, dtype: str = "float32") -> dict:
    """ms per vmapped step of each part, for ``clients`` clients (``dtype``: the model's
    compute dtype, which the recurrent product alone is timed in too)."""
    batch = BATCH[model.name]
    x, y = synthetic_examples(model.name, batch, np.random.default_rng(0))
    x, y = jnp.asarray(x), jnp.asarray(y)
    one = model.init(jax.random.key(0))
    params = stacked(one, clients)
    xs, ys = stacked(x, clients), stacked(y, clients)
    weights = jnp.ones((clients, batch), jnp.float32)
    optimizer = optax.sgd(LEARNING_RATE[model.name])
    step = sgd_step(lambda p, b, k: plain_loss_sums(model, p, b, k), optimizer)
    opt_state = jax.vmap(optimizer.init)(params)
    keys = jax.random.split(jax.random.key(1), clients)
    parts: dict[str, float] = {}

    whole = jax.jit(jax.vmap(lambda p, s, x, y, w, k: step((p, s), (x, y, w), k)))
    parts["step"] = median_ms(lambda: whole(params, opt_state, xs, ys, weights, keys), repeats)

    inputs = jax.vmap(lambda p, x: layer_inputs(model, p, x))(params, xs)
    for j, name in enumerate(model.layer_names):
        def forward_backward(p, h, j=j):
            out, vjp = jax.vjp(lambda p, h: model.layer_apply(j, p, h), p, h)
            return vjp(jnp.ones_like(out) * 1e-3)
        layer = jax.jit(jax.vmap(forward_backward))
        parts[f"layer {name}"] = median_ms(
            lambda layer=layer, name=name, j=j: layer(params[name], inputs[j]), repeats)
        cell = lstm_weights(one[name])
        if cell is not None:  # the recurrence's own product, once per time step each way
            # As layers.lstm runs it: W_h (a copy made once per sequence in the compute
            # dtype) times h cast to it, accumulated in float32.
            # 2T of them in sequence in one program, each fed the last one's tanh (a
            # stand-in for the cell), with no loop: what the products cost by themselves.
            w_h = params[name]["recurrent_kernel"].astype(dtype)
            hidden, time_steps = w_h.shape[1], inputs[j].shape[2]
            h = jnp.ones(inputs[j].shape[:2] + (hidden,), jnp.float32)  # [C, B, H]

            def products(h, w, count=2 * time_steps, hidden=hidden):
                for _ in range(count):
                    z = jnp.matmul(h.astype(w.dtype), w, preferred_element_type=jnp.float32)
                    h = jnp.tanh(z[..., :hidden])
                return h
            chain = jax.jit(jax.vmap(products))
            parts[f"recurrent products x {2 * time_steps}, chained"] = median_ms(
                lambda chain=chain, h=h, w_h=w_h: chain(h, w_h), repeats)

    def loss(logits, y, w):
        return mean_from_sums(*weighted_cross_entropy(logits, y, instance_weights(model, y, w)))
    loss_grad = jax.jit(jax.vmap(jax.grad(loss)))
    parts["loss"] = median_ms(lambda: loss_grad(inputs[-1], ys, weights), repeats)

    grads = jax.tree.map(lambda a: 1e-3 * jnp.ones_like(a), params)
    update = jax.jit(jax.vmap(lambda p, g, s: optax.apply_updates(
        p, optimizer.update(g, s, p)[0])))
    parts["update"] = median_ms(lambda: update(params, grads, opt_state), repeats)
    return parts


def report(model_name: str, dtype: str, clients: int, parts: dict) -> dict:
    """Prints one table; returns its rows and the parts' sum against the whole step."""
    summed = sum(ms for name, ms in parts.items()
                 if name.startswith("layer ") or name in ("loss", "update"))
    # Each part is its own program: its launch and dispatch are in its time, once.
    print(f"\n{model_name} (compute_dtype={dtype}), {clients} clients, batch "
          f"{BATCH[model_name]}: ms per vmapped step")
    print("| part | ms per step | ms per client-step | share of the step |\n|---|---|---|---|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.3f} | {ms / clients:.4f} | {ms / parts['step']:.2f} |")
    print(f"layers + loss + update: {summed:.3f} ms, {summed / parts['step']:.2f} of the whole "
          "step (which also runs the glue between layers; above 1, fusing across parts "
          "saves more than that costs)")
    return {"compute_dtype": dtype, "clients": clients, "ms": parts, "parts_sum_ms": summed}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    options = json.loads(args.model_options)
    out = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "jax": jax.__version__, "model": args.model, "tables": []}
    print(f"backend={out['backend']} device={out['device']} jax={out['jax']}")
    for dtype in args.compute_dtypes.split(","):
        built = (get_model(args.model, compute_dtype=dtype, **options)
                 if model_takes(args.model, "compute_dtype") else get_model(args.model, **options))
        parts = time_parts(built, args.clients, args.repeats, dtype)
        out["tables"].append(report(args.model, dtype, args.clients, parts))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
