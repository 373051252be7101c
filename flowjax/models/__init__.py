"""Model registry: ``get_model(name, **kwargs) -> RoutableModel``."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from flowjax.models.base import RoutableModel
from flowjax.models.emnist_cnn import emnist_cnn
from flowjax.models.mlp import mlp
from flowjax.models.resnet_gn import resnet18_gn
from flowjax.models.shakespeare_lstm import shakespeare_lstm
from flowjax.models.stackoverflow_lstm import stackoverflow_lstm

_MODELS: dict[str, Callable[..., RoutableModel]] = {
    "emnist_cnn": emnist_cnn,
    "mlp": mlp,
    "resnet18_gn": resnet18_gn,
    "shakespeare_lstm": shakespeare_lstm,
    "stackoverflow_lstm": stackoverflow_lstm,
}
MODELS = tuple(sorted(_MODELS))
# Raised when a fix changes a model's numbers, so that a run folder of the older model is
# refused instead of resumed or reused (``config.stored_config``); absent: revision 1.
# resnet18_gn 2: its stride-2 3x3 convolutions pad (1, 1), PyTorch's padding=1, not
# "SAME"'s (0, 1), which put the main path one pixel off the shortcut (2026-12-06).
_REVISIONS: dict[str, int] = {"resnet18_gn": 2}


def _factory(name: str) -> Callable[..., RoutableModel]:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(_MODELS)}")
    return _MODELS[name]


def model_takes(name: str, option: str) -> bool:
    """Whether the registered model ``name``'s factory has the keyword ``option``."""
    return option in inspect.signature(_factory(name)).parameters


def model_revision(name: str) -> int | None:
    """The code revision of model ``name`` where a fix raised it (None: the first)."""
    return _REVISIONS.get(name)


def get_model(name: str, **kwargs: Any) -> RoutableModel:
    """Builds the registered model ``name`` with its factory's keyword arguments."""
    return _factory(name)(**kwargs)


__all__ = ["MODELS", "RoutableModel", "get_model", "model_revision", "model_takes", "emnist_cnn", "mlp", "resnet18_gn",
           "shakespeare_lstm", "stackoverflow_lstm"]
