"""Tasks over converted TFF datasets (``emnist_tff``, ``shakespeare_tff``, ``stackoverflow_tff``).

Populations are :class:`~flowjax.data.client_store.ClientStore` views: nothing but the
index is read when a task is loaded. Evaluation follows the paper: EMNIST and
Shakespeare evaluate the training clients on their own test splits (optionally holding
out a seeded share of clients as "newly joined"); Stack Overflow's held-out users form the
held-out population.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from flowjax.data.client_store import ClientStore, StoreError, StoreView
from flowjax.data.federated import FederatedTask, held_out_mask
from flowjax.data.tff_h5 import TASK_FORMAT, TASK_VERSION


def _convert_hint(dataset: str, store_dir: Any) -> str:
    return (f"convert it first: python launch/convert.py --dataset={dataset} "
            f"--source=DIR_WITH_TFF_FILES --out={store_dir}")


def open_task_dir(dataset: str, store_dir: Any) -> tuple[dict[str, Any], dict[str, ClientStore]]:
    """``(task.json, {population: ClientStore})``; one-line ``ValueError`` if not converted."""
    if store_dir is None:
        raise ValueError(f"{dataset}_tff needs the option store_dir; {_convert_hint(dataset, 'DIR')}")
    root = pathlib.Path(store_dir)
    try:
        if not root.is_dir():
            raise StoreError("no such directory")
        try:
            task = json.loads((root / "task.json").read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"unreadable task.json ({type(e).__name__})") from None
        if task.get("format") != TASK_FORMAT or task.get("version") != TASK_VERSION:
            raise StoreError(f"task.json is not a {TASK_FORMAT} v{TASK_VERSION}")
        if task.get("dataset") != dataset:
            raise StoreError(f"it holds {task.get('dataset')!r}, not {dataset!r}")
        stores = {p: ClientStore(root / p) for p in task["populations"]}
    except (StoreError, KeyError, TypeError) as e:
        raise ValueError(f"{dataset}_tff: store_dir {str(root)!r} is not a converted store "
                         f"({str(e).splitlines()[0]}); {_convert_hint(dataset, root)}") from None
    return task, stores


# Which of a store's train clients a task keeps: every one (the paper's counts, e.g.
# Stack Overflow's 342,477), or those with test rows (the authors' code trains and
# evaluates Stack Overflow's 195,303 users present in both splits: their
# dataloaders/stackoverflow/pick_clients.py writes available_clients.txt, which
# trainers/client_*.py sample from).
TRAIN_CLIENTS = ("all", "with_test")


def _kept_clients(store: ClientStore, train_clients: str | None) -> np.ndarray:
    """Store indices of the clients ``train_clients`` keeps (None: all), in store order."""
    if train_clients not in (None,) + TRAIN_CLIENTS:
        raise ValueError(f"train_clients={train_clients!r}: expected one of {list(TRAIN_CLIENTS)}")
    if train_clients == "with_test":
        return np.flatnonzero(store.num_examples("test") > 0)
    return np.arange(len(store), dtype=np.int64)


def _check_cap(name: str, cap: int | None) -> None:
    if cap is not None and cap < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {cap}")


def _load_paired(dataset: str, store_dir: Any, *, held_out_fraction: float | None = None,
                 seed: int = 0, max_train_examples: int | None = None,
                 max_test_examples: int | None = None,
                 train_clients: str | None = None) -> FederatedTask:
    _check_cap("max_train_examples", max_train_examples)
    _check_cap("max_test_examples", max_test_examples)
    _, stores = open_task_dir(dataset, store_dir)
    store = stores["train"]
    kept = _kept_clients(store, train_clients)
    caps = {"train": max_train_examples, "test": max_test_examples}
    held = held_out_mask(len(kept), held_out_fraction, seed)
    train = StoreView(store, kept[~held], caps)
    held_out = StoreView(store, kept[held], caps) if held.any() else None
    return FederatedTask(train=train, held_out=held_out, name=f"{dataset}_tff")


def load_emnist_tff(*, store_dir: Any = None, **options: Any) -> FederatedTask:
    """Federated EMNIST from a converted store.

    Args:
      store_dir: the directory written by ``launch/convert.py --dataset=emnist``.
      **options: ``held_out_fraction`` (None or 0, the default: evaluate the training
        clients' test splits, as in the paper), ``seed`` (of that draw, default 0),
        ``max_train_examples``, ``max_test_examples``, ``train_clients`` (``"all"``, the
        default, or ``"with_test"``: only the clients with test rows, held-out ones
        included).
    """
    return _load_paired("emnist", store_dir, **options)


def load_shakespeare_tff(*, store_dir: Any = None, **options: Any) -> FederatedTask:
    """TFF Shakespeare from a converted store; options as :func:`load_emnist_tff`."""
    return _load_paired("shakespeare", store_dir, **options)


def load_stackoverflow_tff(*, store_dir: Any = None, max_train_examples: int | None = None,
                           max_test_examples: int | None = None, held_out: bool = True,
                           train_clients: str | None = None) -> FederatedTask:
    """Stack Overflow next-word prediction from a converted store.

    Args:
      store_dir: the directory written by ``launch/convert.py --dataset=stackoverflow``.
      max_train_examples: keep each client's first train sentences (the conversion
        already keeps at most 1,000).
      max_test_examples: keep each client's first test sentences.
      held_out: include the held-out users as the held-out population (a run evaluates
        ``eval.held_out_clients`` of them, drawn from its seed's evaluation stream).
      train_clients: ``"all"`` (None; the paper's 342,477 train users, about 147k of them
        without test rows, which train but are never evaluated) or ``"with_test"``: the
        users with test rows only (the authors' code: 195,303).
    """
    _check_cap("max_train_examples", max_train_examples)
    _check_cap("max_test_examples", max_test_examples)
    _, stores = open_task_dir("stackoverflow", store_dir)
    token_ids = _token_ids(pathlib.Path(store_dir))
    caps = {"train": max_train_examples, "test": max_test_examples}
    train = StoreView(stores["train"], _kept_clients(stores["train"], train_clients), caps)
    population = None
    if held_out and "held_out" in stores and len(stores["held_out"]):
        population = StoreView(stores["held_out"], None, caps)
    return FederatedTask(train=train, held_out=population, name="stackoverflow_tff",
                         token_ids=token_ids)


def _token_ids(root: pathlib.Path) -> int:
    """The number of token ids of a converted Stack Overflow store (``vocab.json``'s
    ``size``: its words, then pad, oov, bos, eos)."""
    try:
        size = json.loads((root / "vocab.json").read_text())["size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"stackoverflow_tff: store_dir {str(root)!r} has no readable "
                         f"vocab.json size ({type(e).__name__}); "
                         f"{_convert_hint('stackoverflow', root)}") from None
    if not isinstance(size, int) or size < 5:
        raise ValueError(f"stackoverflow_tff: {root / 'vocab.json'} says size={size!r}; "
                         f"expected an integer >= 5; {_convert_hint('stackoverflow', root)}")
    return size
