"""Federated CIFAR-10/100 with Dirichlet label skew (paper Appendix B), ResNet-18 GN.

Variants: ``cifar10_0.1``, ``cifar10_0.6``, ``cifar100_0.1``, ``cifar100_0.6`` (dataset and
Dirichlet alpha). Prepare TFDS's CIFAR once as array_record on a machine with internet:

  python -c "import tensorflow_datasets as tfds; tfds.builder('cifar10', file_format='array_record').download_and_prepare()"
  python launch/train.py --config=configs/cifar.py:cifar10_0.1 --workdir=runs/c10_flow

Appendix B: 4000 rounds, 10 clients/round, K = 3, batch 20, lr 0.05, gamma 1e-3; Local
20 epochs at lr 0.1; kNN-Per k = 5 with lambda 0.5 (CIFAR-10) / 0.4 (CIFAR-100); APFL
alpha 0.2 / 0.25; Ditto lambda 0.01; PartialFed 5 epochs at lr 0.11 (``methods.partialfed.sgd``);
HypCluster k = 2.

The partition is seeded by ``data.seed`` (0), not by the run's seed, so the seeds 0, 44, 56
vary training on the same clients. The authors' code draws it from the run's seed, so
their spread across seeds includes the partition's; ``--config.data.seed=<seed>`` per run
does the same here.
"""

import ml_collections
from ml_collections import config_dict

from configs.base import base_config


def get_config(variant: str = "cifar10_0.1") -> ml_collections.ConfigDict:
    try:
        name, alpha = variant.split("_")
        alpha = float(alpha)
    except ValueError:
        name, alpha = None, None
    if name not in ("cifar10", "cifar100") or alpha not in (0.1, 0.6):
        raise ValueError(f"unknown cifar config variant {variant!r}; expected one of "
                         "cifar10_0.1, cifar10_0.6, cifar100_0.1, cifar100_0.6")
    config = base_config(variant)
    config.dataset = f"{name}_dirichlet"
    config.data = ml_collections.ConfigDict(dict(
        alpha=alpha, num_clients=500, train_per_client=100, test_per_client=20, seed=0,
        data_dir=config_dict.placeholder(str)))
    config.model = "resnet18_gn"
    config.model_options = ml_collections.ConfigDict(dict(num_classes=10 if name == "cifar10" else 100))
    config.num_rounds = 4000
    config.sgd.update(epochs=3, batch_size=20, learning_rate=0.05)
    config.methods.flow.gamma = 1e-3
    # The authors' policy widths 3072-1000-750-350-150-50, one base layer per routed layer.
    config.methods.flow.policy_hidden = (1000, 750, 350, 150, 50, 50)
    config.methods.local.sgd.update(epochs=20, learning_rate=0.1)
    config.methods.knn_per.update(neighbours=5, lam=0.5 if name == "cifar10" else 0.4)
    config.methods.apfl.alpha = 0.2 if name == "cifar10" else 0.25
    config.methods.ditto.lam = 0.01
    config.methods.partialfed.strategy_learning_rate = 0.11
    config.methods.partialfed.sgd.update(epochs=5, learning_rate=0.11)
    config.eval.held_out = False  # every client's test split is the evaluation population
    return config
