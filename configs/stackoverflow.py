"""Stack Overflow next-word prediction (TFF's files, converted once with launch/convert.py).

  python launch/convert.py --dataset=stackoverflow --source=DIR_WITH_stackoverflow_h5 \
      --out=data/stackoverflow
  python launch/train.py --config=configs/stackoverflow.py:paper \
      --config.data.store_dir=data/stackoverflow --workdir=runs/so_flow

Variant ``paper``: Appendix B (2000 rounds, 10 clients/round, K = 3, batch 16, lr 0.1,
gamma 1e-3; kNN-Per k = 5, lambda 0.5; APFL alpha 0.25; Ditto lambda 0.1; HypCluster
k = 2). Accuracy excludes pad; ``--config.model_options.exclude_special=True`` also drops
oov/bos/eos from the accuracies (training is the same either way).
"""

import ml_collections

from configs.base import base_config, store_data


def get_config(variant: str = "paper") -> ml_collections.ConfigDict:
    if variant != "paper":
        raise ValueError(f"unknown stackoverflow config variant {variant!r}; expected 'paper'")
    config = base_config(variant)
    config.dataset = "stackoverflow_tff"
    config.data = store_data()
    config.model = "stackoverflow_lstm"
    # vocab_size: 10,000 words + pad, oov, bos, eos; a store converted with another
    # --vocab_size=V needs V + 4 here (a run checks it against the store's vocab.json).
    config.model_options = ml_collections.ConfigDict(dict(vocab_size=10004, exclude_special=False))
    config.num_rounds = 2000
    config.sgd.update(epochs=3, batch_size=16, learning_rate=0.1)
    config.methods.flow.gamma = 1e-3
    config.methods.flow.policy_hidden = (64, 64, 32, 16)
    config.methods.lg_fedavg.global_layers = ("dense2",)
    config.eval.clients = 1000  # of 342,477 train clients
    config.eval.held_out_clients = 1000  # of the held-out users
    return config
