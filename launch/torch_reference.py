r"""The PyTorch eager baseline of ``launch/benchmark.py --compare_torch`` (optional).

``torch`` is NOT a flowjax dependency; install it only to run this comparison, e.g.
``pip install torch==2.13.0`` (the CPU build measured in ``docs/benchmarks/cpu-2core.md``). This
module is imported only when the flag is given, so the benchmark runs without it.

It times a FedAvg round the way the PyTorch simulators (and the Flow authors' code) run
one: for each client in turn, load the global weights into one model, take its SGD steps
in eager mode, then average the clients' state dicts weighted by their example counts.
The model is the EMNIST CNN of ``flowjax/models/emnist_cnn.py`` with the same init scale
(LeCun-normal kernels, zero biases), in channels_last memory format, the faster of the two
layouts for this CNN on the project's 2-core CPU when this benchmark was written (that
timing is not kept here; the comparison against flowjax is in README, "Speed").
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Sequence

import numpy as np
import torch
from torch import nn


def emnist_cnn(num_classes: int = 62) -> nn.Module:
    """conv3x3-32 VALID, relu, conv3x3-64 VALID, relu, maxpool2, dropout .25, flatten,
    dense 128, relu, dropout .5, dense ``num_classes``: the flowjax CNN, layer for layer."""
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(12 * 12 * 64, 128), nn.ReLU(),
        nn.Dropout(0.5), nn.Linear(128, num_classes))
    _lecun_normal_(model)
    return model.to(memory_format=torch.channels_last)


def _lecun_normal_(model: nn.Module) -> None:
    """Flax's default init (truncated normal, variance 1/fan_in; zero bias), not torch's
    kaiming-uniform, so both sides start from weights of the same scale."""
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            fan_in = layer.weight[0].numel()
            # Flax truncates at 2 sigma and rescales so the variance stays 1/fan_in.
            std = (1.0 / fan_in) ** 0.5 / 0.87962566103423978
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
            nn.init.zeros_(layer.bias)


def client_batches(x: np.ndarray, y: np.ndarray, batch: int,
                   steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A client's first ``steps`` minibatches as NCHW channels_last tensors.

    Built once outside the timed region, as the JAX side places its cohort on the device
    before timing. Eager PyTorch has no fixed shapes, so a small client takes only its real
    steps and a last partial batch stays partial: no padding.
    """
    x = torch.from_numpy(np.ascontiguousarray(x[: steps * batch], np.float32))
    x = x.reshape(-1, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.from_numpy(np.asarray(y[: steps * batch], np.int64))
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]


def fedavg_round(model: nn.Module, global_state: dict[str, torch.Tensor],
                 clients: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
                 learning_rate: float) -> dict[str, torch.Tensor]:
    """One FedAvg round: every client trains a copy of the global weights, one after the
    other; returns the example-weighted mean of their state dicts."""
    total = sum(sum(len(yb) for _, yb in batches) for batches in clients)
    mean = {name: torch.zeros_like(value) for name, value in global_state.items()}
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for batches in clients:
        model.load_state_dict(global_state)  # copies into the existing tensors
        optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
        for xb, yb in batches:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(xb), yb).backward()
            optimizer.step()
        weight = sum(len(yb) for _, yb in batches) / total
        with torch.no_grad():
            for name, value in model.state_dict().items():
                mean[name].add_(value, alpha=weight)
    return mean


def time_fedavg_round(client_data: Sequence[tuple[np.ndarray, np.ndarray]], *, steps: int,
                      batch: int, learning_rate: float, repeats: int,
                      seed: int = 0) -> dict[str, float]:
    """Median seconds of an eager FedAvg round over ``client_data`` ``[(x, y), ...]``.

    Returns ``round_s``, ``client_steps`` (minibatches actually taken) and the threads used.
    """
    # All cores, as the JAX side gets them; torch's default may be fewer. On cores other
    # processes keep busy its OpenMP threads wait on each other: a tiny round measured 15x
    # slower with 2 threads than with 1 on a loaded 2-core machine, so time on an idle one.
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(seed)
    model = emnist_cnn()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [client_batches(x, y, batch, steps) for x, y in client_data]

    def one_round():
        return fedavg_round(model, global_state, clients, learning_rate)

    one_round()  # warm up the allocator and kernels' caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - start)
    return {"round_s": statistics.median(times),
            "client_steps": sum(len(batches) for batches in clients),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
