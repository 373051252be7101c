r"""Flow's routing policy beside its global model, in parameters, against the paper's figures.

  python launch/policy_size.py [--reference_dir=<checkout of Astuary/Flow>]

The paper gives the policy's size only as a share of the global model's parameters
(Appendix C: 1.23% for the Stack Overflow RNN, 8.39% for the Shakespeare RNN, 27.86% for
the EMNIST CNN, 35.51% for the CIFAR ResNet-18; its storage table puts the Stack Overflow
policy at 0.891M). This prints, for each dataset's paper configuration, the parameters of
Flow's policy and of its global model ``w_g`` under ``semantics=paper`` and
``semantics=reference``, built from the configs as a run builds them (shapes only, nothing
is computed). ``w_g`` is every parameter but the local branch and the policy: with the
LSTMs' shared embedding and the reference ResNet's shared norm. With ``--reference_dir``
it also counts the authors' networks (PyTorch, their policy modules against the rest but
their ``local_*`` layers), which shows where the paper's figures come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any

import numpy as np

# (config module, variant, the paper's policy share of w_g in percent (Appendix C)).
DATASETS = (("emnist", "paper", 27.86), ("cifar", "cifar10_0.1", 35.51),
            ("shakespeare", "paper", 8.39), ("stackoverflow", "paper", 1.23))
# The authors' networks for each: module, constructor, its arguments (their trainers').
THEIR_NETS = {
    "emnist": ("models.emnist_cnn_dynamic_v4", "EMNISTNet", (), {}),
    "cifar": ("models.cifar100_resnet_dynamic_v4", "resnet18", (), {"num_classes": 10}),
    "shakespeare": ("models.shakespeare_rnn_dynamic_v4", "ShakespeareNet", (8, 90, 256), {}),
    "stackoverflow": ("models.stackoverflow_nwp_rnn_dynamic_v4", "StackoverflowNet",
                      (10004, 96, 670, 20, 1), {}),
}


@dataclasses.dataclass(frozen=True)
class PolicySize:
    """A policy's and a global model's parameter counts."""
    policy: int
    global_model: int

    @property
    def percent(self) -> float:
        return 100.0 * self.policy / self.global_model


def _count(tree: Any) -> int:
    import jax
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def flowjax_policy_size(dataset: str, variant: str, semantics: str) -> PolicySize:
    """Flow's policy and ``w_g`` for ``configs/<dataset>.py:<variant>`` under ``semantics``."""
    import jax

    from flowjax.algorithms import build_algorithm
    from flowjax.models import get_model
    from flowjax.validation import example_input

    config = importlib.import_module(f"configs.{dataset}").get_config(variant)
    config.methods.flow.semantics = semantics
    model = get_model(config.model, **dict(config.get("model_options") or {}))
    x = example_input(model, 2)
    algorithm = build_algorithm("flow", model, config, jax.numpy.zeros(x.shape, x.dtype))
    params = jax.eval_shape(algorithm.init, jax.random.key(0))
    return PolicySize(policy=_count(params["policy"]),
                      global_model=sum(_count(part) for name, part in params.items()
                                       if name not in ("policy", "local")))


def check_reference_dir(reference_dir: str) -> None:
    """Fails in one line unless ``reference_dir`` holds the authors' networks and PyTorch
    is installed to build them."""
    for module, *_ in THEIR_NETS.values():
        path = os.path.join(*module.split(".")) + ".py"
        if not os.path.isfile(os.path.join(reference_dir, path)):
            raise SystemExit(f"--reference_dir={reference_dir!r}: expected a checkout of "
                             f"github.com/Astuary/Flow ({path} not found)")
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("--reference_dir needs PyTorch to build the authors' networks: "
                         "pip install -e '.[parity]'")


def their_policy_size(reference_dir: str, dataset: str) -> PolicySize:
    """The authors' network for ``dataset``: its policy module(s) and the rest but its
    ``local_*`` layers."""
    check_reference_dir(reference_dir)
    module, constructor, args, kwargs = THEIR_NETS[dataset]
    sys.path.insert(0, reference_dir)
    try:
        net = getattr(importlib.import_module(module), constructor)(*args, **kwargs)
    finally:
        sys.path.remove(reference_dir)
    policy = global_model = 0
    for name, parameter in net.named_parameters():
        if "polic" in name.split(".")[0]:
            policy += parameter.numel()
        elif not name.startswith("local_"):
            global_model += parameter.numel()
    return PolicySize(policy=policy, global_model=global_model)


def rows(reference_dir: str | None = None) -> list[tuple[str, str, PolicySize | float]]:
    """``(dataset, whose, size)`` for every dataset: flowjax's paper and reference modes,
    the authors' network (with ``reference_dir``), and the paper's share (a float)."""
    found = []
    for dataset, variant, paper in DATASETS:
        for semantics in ("paper", "reference"):
            found.append((dataset, f"flowjax semantics={semantics}",
                          flowjax_policy_size(dataset, variant, semantics)))
        if reference_dir:
            found.append((dataset, "authors' code", their_policy_size(reference_dir, dataset)))
        found.append((dataset, "paper (Appendix C)", paper))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", help="checkout of github.com/Astuary/Flow")
    args = parser.parse_args(argv)
    if args.reference_dir:
        check_reference_dir(args.reference_dir)
    print(f"{'dataset':<14} {'whose':<28} {'policy':>10} {'w_g':>12} {'share':>8}")
    for dataset, whose, size in rows(args.reference_dir):
        if isinstance(size, float):
            print(f"{dataset:<14} {whose:<28} {'':>10} {'':>12} {size:>7.2f}%")
        else:
            print(f"{dataset:<14} {whose:<28} {size.policy:>10,} {size.global_model:>12,} "
                  f"{size.percent:>7.2f}%")


if __name__ == "__main__":
    main()
