"""Synthetic federated image data with per-client label skew and style.

Not a benchmark dataset: it exists so the EMNIST-shaped pipeline (model, routing,
cohorts, evaluation) can be tested and benchmarked offline with controlled sizes.
Each client has its own label distribution (Dirichlet) and its own pixel offset, so
personalization has something to learn.
"""

from __future__ import annotations

import numpy as np

from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit


# Stack Overflow's TFF training split: 135,818,730 examples over 342,477 clients (mean
# 397), a heavy right tail, at most 1,000 sentences kept per client (as the converter
# keeps them, ``tff_h5.MAX_SENTENCES``). A log-normal with sigma 1.5 and that mean
# (median 129) stands in for its histogram, which no file here holds; it is a model of
# the skew, not the data.
STACKOVERFLOW_MEAN = 135_818_730 / 342_477
STACKOVERFLOW_SIGMA = 1.5
STACKOVERFLOW_CAP = 1_000


def stackoverflow_like_sizes(num_clients: int, seed: int = 0,
                             cap: int = STACKOVERFLOW_CAP) -> np.ndarray:
    """Examples per client drawn like Stack Overflow's (see above), clipped to ``[1, cap]``.

    Example:
      >>> sizes = stackoverflow_like_sizes(10_000)
      >>> int(np.median(sizes)), int(sizes.max())
      (127, 1000)
    """
    median = STACKOVERFLOW_MEAN / np.exp(STACKOVERFLOW_SIGMA ** 2 / 2)
    draws = np.random.default_rng(seed).lognormal(np.log(median), STACKOVERFLOW_SIGMA, num_clients)
    return np.clip(np.round(draws), 1, cap).astype(np.int64)


def synthetic_images(*, num_clients: int = 20, num_classes: int = 62, image_shape=(28, 28),
                     examples: tuple[int, int] = (20, 60), test_fraction: float = 0.25,
                     alpha: float = 0.5, seed: int = 0, held_out: int = 0,
                     sizes: np.ndarray | None = None) -> FederatedTask:
    """A task of ``num_clients`` training clients (+ ``held_out`` held-out clients).

    Args:
      examples: inclusive range of train+test examples per client.
      alpha: Dirichlet concentration of each client's label distribution.
      sizes: train+test examples of each training client (overrides ``examples``), e.g.
        ``stackoverflow_like_sizes(num_clients)``.
    """
    if num_clients < 1 or held_out < 0:
        raise ValueError(f"need num_clients >= 1 and held_out >= 0, got {num_clients}, {held_out}")
    if sizes is not None and (len(sizes) != num_clients or np.min(sizes) < 2):
        raise ValueError(f"sizes must hold num_clients={num_clients} counts >= 2 (a train and "
                         f"a test example each), got {len(sizes)} with minimum {np.min(sizes)}")
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(num_classes,) + tuple(image_shape)).astype(np.float32)
    fixed_sizes = iter(sizes if sizes is not None else ())

    def one_client():
        n = int(next(fixed_sizes, None) or rng.integers(examples[0], examples[1] + 1))
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
