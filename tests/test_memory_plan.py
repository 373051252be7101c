"""The memory planner: the chunk it picks compiles under the budget, the next one would not."""

import numpy as np
import pytest

from flowjax.algorithms.ditto import DittoConfig, ditto
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.memory_plan import compiled_peak_bytes, plan_chunk_size
from tests.helpers import tiny_mlp

SPEC = {"x": ((28, 28), np.float32), "y": ((), np.int32)}


@pytest.fixture(scope="module")
def algorithm():
    return fedavg(tiny_mlp(), FedAvgConfig(learning_rate=0.1, epochs=1, batch_size=8))


def test_planned_chunk_fits_and_one_more_does_not(algorithm):
    per_client_data = 64 * (28 * 28 * 4 + 4 + 1)  # x, y and mask of 64 examples
    budget = 200 * per_client_data
    plan = plan_chunk_size(algorithm, SPEC, padded_examples=64, batch_size=8,
                           device_bytes=budget, headroom=1.0)
    assert plan.per_client_bytes >= per_client_data  # a client holds at least its data
    assert 1 < plan.clients_per_chunk < 200
    assert plan.checked_peak_bytes <= budget
    assert compiled_peak_bytes(algorithm, SPEC, 64, 8, plan.clients_per_chunk) <= budget
    assert compiled_peak_bytes(algorithm, SPEC, 64, 8, plan.clients_per_chunk + 1) > budget
    assert "clients per chunk" in plan.describe()


def test_plan_grows_with_memory_and_shrinks_with_data(algorithm):
    def chunk(budget, examples=64):
        return plan_chunk_size(algorithm, SPEC, padded_examples=examples, batch_size=8,
                               device_bytes=budget).clients_per_chunk
    assert chunk(64 * 2**20) > chunk(16 * 2**20)
    assert chunk(16 * 2**20, examples=256) < chunk(16 * 2**20)
    assert chunk(1000) == 0  # not even one client fits
    assert plan_chunk_size(algorithm, SPEC, padded_examples=64, batch_size=8,
                           device_bytes=2**30, max_clients=10).clients_per_chunk == 10


def test_stateful_methods_plan_their_client_state():
    method = ditto(tiny_mlp(), DittoConfig(learning_rate=0.1, epochs=1, batch_size=8, lam=0.1))
    plan = plan_chunk_size(method, SPEC, padded_examples=64, batch_size=8, device_bytes=2**26)
    assert plan.clients_per_chunk > 0


def test_bad_budget_is_a_one_line_error(algorithm):
    with pytest.raises(ValueError, match="headroom must be in \\(0, 1\\], got 1.5"):
        plan_chunk_size(algorithm, SPEC, padded_examples=64, batch_size=8, device_bytes=10,
                        headroom=1.5)
