r"""How far a last-bit change of the initial weights carries through one Flow client update,
per network: the authors' CIFAR ResNet-18 (``semantics=reference``) against flowjax's
``resnet18_gn`` running the same procedure of theirs (``semantics=paper`` with every
departure field set to their CIFAR choice), in float32, the precision runs use.

  python launch/sensitivity.py                 # about 5 minutes on 2 CPU cores

For each network and each client size (1, 2 and 4 batches of 20 synthetic CIFAR-shaped
images, one epoch per phase, lr 0.05, momentum 0.9, lambda 1e-3), it runs the client
update from the initial weights and from the same weights each multiplied by
``1 + 1e-6 * u`` (``u`` uniform in [-1, 1], one draw per weight: a few float32 ulps), and
prints the largest difference of any weight after the update, relative to the largest
change made to the initial weights. A ratio that grows by orders of magnitude per batch
is why ``launch/parity.py`` compares their CIFAR network in float64 and over one batch
only, and why two correct implementations of it part ways within a few steps.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from launch import cli  # noqa: E402

BATCH = 20
SIZES = (1, 2, 4)  # batches per client
PERTURBATION = 1e-6


def _algorithm(network: str):
    import jax.numpy as jnp
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.flow import FlowConfig, flow
    from flowjax.algorithms.flow_reference import reference_options
    from flowjax.models import get_model

    model = get_model("resnet18_gn", num_classes=10)
    sgd = SGDConfig(learning_rate=0.05, epochs=1, batch_size=BATCH, momentum=0.9)
    if network == "theirs":
        config = FlowConfig(sgd=sgd, gamma=1e-3, policy_hidden=(1000, 750, 350, 150, 50, 2),
                            semantics="reference")
    else:  # their procedure's fields, one by one, on flowjax's network
        options = {k: v for k, v in reference_options("resnet18_gn").items() if k != "momentum"}
        config = FlowConfig(sgd=sgd, gamma=1e-3, semantics="paper", **options)
    return flow(model, config, jnp.zeros((2, 32, 32, 3)))


def nudge(params, key):
    """Every weight times ``1 + PERTURBATION * u``, ``u ~ U[-1, 1]`` drawn per weight."""
    import jax

    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [
        a * (1 + PERTURBATION * jax.random.uniform(k, a.shape, a.dtype, -1, 1))
        for a, k in zip(leaves, keys)])


def divergence(network: str, batches: int, seed: int = 0) -> tuple[float, float]:
    """``(largest initial change, largest difference after the update)``."""
    import jax
    import jax.numpy as jnp

    from launch.parity import client_examples, image_client_data

    algorithm = _algorithm(network)
    params = algorithm.init(jax.random.key(seed))
    nudged = nudge(params, jax.random.key(seed + 1))
    data = image_client_data(seed=seed, train_examples=batches * BATCH, test_examples=1,
                             num_classes=10)
    client = client_examples(data["train_x"], data["train_y"], BATCH)
    update = jax.jit(algorithm.client_update)
    key = jax.random.key(seed + 2)
    a, b = update(params, client, key).params, update(nudged, client, key).params

    def largest(x, y):
        return max(float(jnp.max(jnp.abs(u - v))) for u, v in
                   zip(jax.tree.leaves(x), jax.tree.leaves(y)))

    return largest(params, nudged), largest(a, b)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=cli.integer_at_least(0), default=0)
    args = parser.parse_args(argv)
    import jax
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, float32; one Flow client "
          f"update (their CIFAR procedure), batches of {BATCH}, weights nudged by "
          f"{PERTURBATION:g} (relative)")
    print("| network | batches per epoch | largest initial change | largest difference after "
          "the update | ratio |")
    print("|---|---|---|---|---|")
    names = {"theirs": "authors' resnet18 (reference)", "ours": "flowjax resnet18_gn"}
    for network in ("theirs", "ours"):
        for batches in SIZES:
            start, end = divergence(network, batches, args.seed)
            print(f"| {names[network]} | {batches} | {start:.2e} | {end:.2e} | "
                  f"{end / start:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
