"""Synthetic federated image data with per-client label skew and style.

Not a benchmark dataset: it exists so the EMNIST-shaped pipeline (model, routing,
cohorts, evaluation) can be tested and benchmarked offline with controlled sizes.
Each client has its own label distribution (Dirichlet) and its own pixel offset, so
personalization has something to learn.
"""

from __future__ import annotations

import numpy as np

from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit


def synthetic_images(*, num_clients: int = 20, num_classes: int = 62, image_shape=(28, 28),
                     examples: tuple[int, int] = (20, 60), test_fraction: float = 0.25,
                     alpha: float = 0.5, seed: int = 0, held_out: int = 0) -> FederatedTask:
    """A task of ``num_clients`` training clients (+ ``held_out`` held-out clients).

    Args:
      examples: inclusive range of train+test examples per client.
      alpha: Dirichlet concentration of each client's label distribution.
    """
    if num_clients < 1 or held_out < 0:
        raise ValueError(f"need num_clients >= 1 and held_out >= 0, got {num_clients}, {held_out}")
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(num_classes,) + tuple(image_shape)).astype(np.float32)

    def one_client():
        n = int(rng.integers(examples[0], examples[1] + 1))
        label_probs = rng.dirichlet(np.full(num_classes, alpha))
        labels = rng.choice(num_classes, size=n, p=label_probs).astype(np.int32)
        style = rng.normal(scale=0.5, size=image_shape).astype(np.float32)
        noise = rng.normal(scale=0.8, size=(n,) + tuple(image_shape)).astype(np.float32)
        pixels = prototypes[labels] + style + noise
        n_test = max(1, int(round(n * test_fraction)))
        return ({"x": pixels[n_test:], "y": labels[n_test:]},
                {"x": pixels[:n_test], "y": labels[:n_test]})

    spec = {"x": (tuple(image_shape), np.float32), "y": ((), np.int32)}

    def population(count, prefix):
        clients = [one_client() for _ in range(count)]
        splits = {"train": RaggedSplit.from_clients([c[0] for c in clients], spec),
                  "test": RaggedSplit.from_clients([c[1] for c in clients], spec)}
        return ArrayFederatedData(tuple(f"{prefix}{i}" for i in range(count)), splits)

    train = population(num_clients, "client")
    held = population(held_out, "new") if held_out else None
    return FederatedTask(train=train, held_out=held, name="synthetic_images")
