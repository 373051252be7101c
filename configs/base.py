"""Fields shared by every dataset config; each dataset file sets the paper's values.

Dataset configs call ``base_config()`` and then set their dataset, model and the paper's
Appendix B hyperparameters. Every field can be overridden from the command line
(``--config.methods.ditto.lam=0.01``).
"""

import ml_collections
from ml_collections import config_dict


def base_config(variant: str) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.variant = variant
    config.seed = 0
    config.algorithm = "flow"

    # Client training; the dataset config sets the paper's values.
    config.num_rounds = 1500
    config.clients_per_round = 10
    config.epochs = 3
    config.batch_size = 20
    config.learning_rate = 0.01
    config.momentum = 0.0
    config.max_examples_per_client = config_dict.placeholder(int)

    # Flow (paper defaults; the ablations are these fields).
    config.gamma = 1e-3
    config.split_ratio = 0.5
    config.order = "alternating"
    config.global_step = "routed"
    config.policy_dropout = 0.3
    config.fixed_q0 = config_dict.placeholder(float)  # fixed-policy ablation
    config.local_route = "local"  # "global" = pi-Flow
    # "reference": the authors' code (flowjax/algorithms/flow_reference.py); each flow_*
    # field below switches one of its departures on alone (None = as flow_semantics says).
    config.flow_semantics = "paper"
    config.flow_halves = config_dict.placeholder(str)  # shard / shard_reshuffled / none
    config.flow_frozen_momentum = config_dict.placeholder(str)  # zero_grad / set_to_none
    config.flow_regularizer = config_dict.placeholder(str)  # reference / paper
    config.flow_local_init = config_dict.placeholder(str)  # server / global
    config.flow_policy_eval_dropout = config_dict.placeholder(bool)
    config.flow_evaluation = config_dict.placeholder(str)  # reference / paper
    config.flow_policy_last = config_dict.placeholder(str)  # dense / exit
    # LSTM routing: "mixed_state" (Eq. 3 per time step) or "separate" (None = separate).
    config.flow_recurrence = config_dict.placeholder(str)

    # Baselines' own hyperparameters (paper Appendix B; datasets override).
    config.methods = ml_collections.ConfigDict(dict(
        apfl=dict(alpha=0.25),
        ditto=dict(lam=0.1),
        # None: derived from E, (E - 1) head + 1 body epochs (E = 1: 0 + 1; algorithms/fedrep.py).
        fedrep=dict(head_epochs=config_dict.placeholder(int),
                    body_epochs=config_dict.placeholder(int)),
        lg_fedavg=dict(global_layers=config_dict.placeholder(tuple)),  # None = the head
        hypcluster=dict(clusters=2, warmup_rounds=10, perturbation=0.01),
        knn_per=dict(neighbours=5, lam=0.5, max_datastore=4096),
        local=dict(epochs=10, learning_rate=0.05),
        partialfed=dict(temperature=1.0, strategy_learning_rate=0.11),
    ))

    # Shared fields the paper sets per method: {algorithm: {field: value}}, applied by
    # flowjax.config.effective_config when that algorithm runs.
    config.per_method = ml_collections.ConfigDict()

    config.server = ml_collections.ConfigDict(dict(
        optimizer="sgd", learning_rate=1.0, momentum=0.0, b1=0.9, b2=0.99, eps=1e-3,
        bias_correction=True))
    config.eval = ml_collections.ConfigDict(dict(
        every=100, clients=config_dict.placeholder(int), held_out=True,
        held_out_clients=config_dict.placeholder(int), chunk=16,
        max_examples=config_dict.placeholder(int)))
    config.mapping = ml_collections.ConfigDict(dict(strategy="auto", chunk_size=1, num_devices=1))
    # Per-client layer formulation and precision (models that implement them: emnist_cnn).
    # conv_impl "auto" = "xla" (measured fastest on CPU and on an H100; "im2col": batched
    # GEMMs, docs/benchmarks/roofline.md); compute_dtype "bfloat16" multiplies in bf16 with
    # float32 params, gradients and optimizer state.
    config.conv_impl = "auto"
    config.compute_dtype = "float32"
    config.log_every = 10
    config.checkpoint_every = 100  # rounds; 0 disables checkpoints (and resuming)
    config.on_divergence = "stop"  # or "skip_clients"
    # Also write metrics.jsonl's records as TensorBoard scalars to <workdir>/tensorboard/
    # (needs tensorboardX: pip install 'flowjax[tensorboard]').
    config.tensorboard = False
    return config


def store_data() -> ml_collections.ConfigDict:
    """``config.data`` of a dataset converted with launch/convert.py."""
    return ml_collections.ConfigDict(dict(
        store_dir=config_dict.placeholder(str),
        max_train_examples=config_dict.placeholder(int),
        max_test_examples=config_dict.placeholder(int)))
