"""Federated EMNIST-62 (TFF's files, converted once with launch/convert.py).

  python launch/convert.py --dataset=emnist --source=DIR_WITH_fed_emnist_h5 --out=data/emnist
  python launch/train.py --config=configs/emnist.py:paper --config.data.store_dir=data/emnist \
      --workdir=runs/emnist_flow

Variant ``paper``: Appendix B (1500 rounds, 10 clients/round, K = 3, batch 20, lr 0.01,
gamma 1e-2; Local 10 epochs at lr 0.05; kNN-Per k = 10, lambda 0.4; APFL alpha 0.25;
Ditto lambda 0.1; HypCluster k = 2), evaluated on 1,000 of the 3,400 clients (App. E.1).
"""

import ml_collections

from configs.base import base_config, paired_store_data


def get_config(variant: str = "paper") -> ml_collections.ConfigDict:
    if variant != "paper":
        raise ValueError(f"unknown emnist config variant {variant!r}; expected 'paper'")
    config = base_config(variant)
    config.dataset = "emnist_tff"
    config.data = paired_store_data()
    config.model = "emnist_cnn"
    # Appendix E.1: Acc_g and Acc_p "averaged across 1000 clients" (of the 3,400 writers).
    config.eval.clients = 1000
    return appendix_b_emnist(config)


def appendix_b_emnist(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Appendix B's EMNIST settings, shared by every config that runs the EMNIST CNN."""
    config.num_rounds = 1500
    config.clients_per_round = 10
    config.sgd.update(epochs=3, batch_size=20, learning_rate=0.01)
    config.methods.flow.gamma = 1e-2
    # Eq. 2 has one base layer per routed layer; the authors' widths 350-150-50 plus one.
    config.methods.flow.policy_hidden = (350, 150, 50, 50)
    config.methods.knn_per.update(neighbours=10, lam=0.4)
    config.methods.local.sgd.update(epochs=10, learning_rate=0.05)
    return config
