"""Fields shared by every dataset config; each dataset file sets the paper's values.

Dataset configs call ``base_config()`` and then set their dataset, model and the paper's
Appendix B hyperparameters. Every field can be overridden from the command line
(``--config.sgd.learning_rate=0.05``, ``--config.methods.flow.gamma=0``,
``--config.methods.ditto.lam=0.01``, ``--config.methods.partialfed.sgd.epochs=5``).
"""

import ml_collections
from ml_collections import config_dict


def base_config(variant: str) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.variant = variant
    config.seed = 0
    config.algorithm = "flow"

    config.num_rounds = 1500
    config.clients_per_round = 10
    config.max_examples_per_client = config_dict.placeholder(int)
    # The clients' SGD, shared by every method; the dataset config sets the paper's values.
    # steps_per_loop: how the steps run, not what they compute (None: one step per loop
    # iteration; more: fewer loop conditions for a GPU's host to read, values equal to
    # float32 rounding; algorithms.base.SGDConfig). Not a per-method field.
    config.sgd = ml_collections.ConfigDict(dict(
        learning_rate=0.01, epochs=3, batch_size=20, momentum=0.0,
        steps_per_loop=config_dict.placeholder(int)))

    # Each method's own fields (the paper's Appendix B; datasets override), passed straight
    # to its config dataclass (flowjax.algorithms.method_config). methods.<name>.sgd: the
    # SGD fields the paper sets for that method alone (None = as config.sgd).
    methods = dict(
        # True: also score the server model trained one epoch on the client's train split,
        # the authors' CIFAR FedAvg (and kNN-Per) Acc_g (acc_g_client_snapshot), on the
        # test split (None) or, as their CIFAR-10 FedAvg, snapshot_split="train".
        fedavg=dict(client_snapshot=config_dict.placeholder(bool),
                    snapshot_split=config_dict.placeholder(str)),
        # True: also score the fine-tuned copy after the first of E epochs, the paper's
        # FedAvgFT Acc_g (acc_g_client_snapshot; flowjax.algorithms.fedavg). None: off.
        fedavg_ft=dict(client_snapshot=config_dict.placeholder(bool)),
        flow=dict(
            gamma=1e-3, split_ratio=0.5, order="alternating",
            policy_dropout=0.3, policy_hidden=config_dict.placeholder(tuple),  # dataset's
            fixed_q0=config_dict.placeholder(float),  # fixed-policy ablation
            local_route="local",  # "global" = pi-Flow
            # "reference": the authors' code (flowjax/algorithms/flow_reference.py); each
            # field below switches one of its departures on alone (None = as semantics says).
            semantics="paper",
            halves=config_dict.placeholder(str),  # shard / shard_reshuffled / none
            frozen_momentum=config_dict.placeholder(str),  # zero_grad / set_to_none
            regularizer=config_dict.placeholder(str),  # reference / paper
            local_init=config_dict.placeholder(str),  # server / global
            policy_eval_dropout=config_dict.placeholder(bool),
            hard_tie=config_dict.placeholder(str),  # zeroed / global (an exact q0 = 1/2)
            evaluation=config_dict.placeholder(str),  # reference / paper
            policy_last=config_dict.placeholder(str),  # dense / exit
            global_step=config_dict.placeholder(str),  # global_only / routed (Eq. 4)
            # LSTM routing, Eq. 3 with the LSTM layer as layer j ("separate", None) or
            # with each cell application as the layer ("mixed_state"; routing/routed.py).
            recurrence=config_dict.placeholder(str),
            # True: a layer's two branches in one product where its input outweighs its
            # weights (the same model to float32 rounding; routing/routed.py). None: off.
            fuse_branches=config_dict.placeholder(bool)),
        # client_snapshot (APFL, Ditto as FedAvgFT's): True also scores the global model
        # after E epochs of local training, the authors' Acc_g of these methods (FedRep,
        # LG-FedAvg, HypCluster: their copies after one fine-tuning epoch, and HypCluster's
        # Acc_p model fine-tuned E epochs, acc_p_client_snapshot; each module).
        # APFL's snapshot_momentum: that copy's own SGD momentum (None: sgd.momentum).
        apfl=dict(alpha=0.25, client_snapshot=config_dict.placeholder(bool),
                  snapshot_momentum=config_dict.placeholder(float)),
        # step: None (or "gradient"), the paper's gradient step on the penalized objective;
        # "proximal", its exact proximal form, stable for any lr * lam (algorithms/ditto.py).
        ditto=dict(lam=0.1, step=config_dict.placeholder(str),
                   client_snapshot=config_dict.placeholder(bool)),
        # None: derived from E, (E - 1) head + 1 body epochs (E = 1: 0 + 1; algorithms/fedrep.py).
        fedrep=dict(head_epochs=config_dict.placeholder(int),
                    body_epochs=config_dict.placeholder(int),
                    client_snapshot=config_dict.placeholder(bool),
                    head_layers=config_dict.placeholder(tuple),  # None = the model's head
                    # None: "stored" / "budget"; "fresh" (or "fresh_torch": their
                    # PyTorch init) / "each": the authors' code.
                    personal_init=config_dict.placeholder(str),
                    phase_epochs=config_dict.placeholder(str),
                    frozen_momentum=config_dict.placeholder(str),  # None: "set_to_none"
                    torch_layers=config_dict.placeholder(bool)),  # True: the authors'
        lg_fedavg=dict(global_layers=config_dict.placeholder(tuple),  # None = the head
                       client_snapshot=config_dict.placeholder(bool),
                       # None: "stored" / "joint"; "fresh" (or "fresh_torch") /
                       # "alternating": the authors'.
                       personal_init=config_dict.placeholder(str),
                       local_update=config_dict.placeholder(str),
                       frozen_momentum=config_dict.placeholder(str),  # as fedrep's
                       torch_layers=config_dict.placeholder(bool)),
        hypcluster=dict(clusters=2, warmup_rounds=10, perturbation=0.01,
                        init=config_dict.placeholder(str),  # None or kmeans
                        client_snapshot=config_dict.placeholder(bool)),
        knn_per=dict(neighbours=5, lam=0.5, max_datastore=4096,
                     client_snapshot=config_dict.placeholder(bool),  # as fedavg's
                     # The authors' kNN-Per Acc_p (flowjax/algorithms/knn_per.py).
                     reference_acc_p=config_dict.placeholder(bool)),
        local=dict(),
        partialfed=dict(temperature=1.0, strategy_learning_rate=0.11),
    )
    config.methods = ml_collections.ConfigDict(
        {name: dict(fields, sgd=sgd_override()) for name, fields in methods.items()})

    # bias_correction False: Reddi et al.'s Algorithm 2 as published (v_{-1} = tau^2, no
    # correction); True: Adam's own correction of both moments (core/server_opt.py).
    config.server = ml_collections.ConfigDict(dict(
        optimizer="sgd", learning_rate=1.0, momentum=0.0, b1=0.9, b2=0.99, eps=1e-3,
        bias_correction=False))
    config.eval = ml_collections.ConfigDict(dict(
        every=100, clients=config_dict.placeholder(int), held_out=True,
        held_out_clients=config_dict.placeholder(int), chunk=16,
        max_examples=config_dict.placeholder(int)))
    config.mapping = ml_collections.ConfigDict(dict(strategy="auto", chunk_size=1, num_devices=1))
    # Per-client layer formulation (emnist_cnn) and precision (emnist_cnn and the LSTMs).
    # conv_impl "auto" = "xla" on CPU, "im2col_slices" (batched GEMMs on patches cut by
    # slices) on GPU, each measured fastest there (docs/benchmarks/roofline.md);
    # compute_dtype "bfloat16" multiplies in bf16 (the LSTMs' recurrent weight as a bf16
    # copy made once per sequence) with float32 accumulation, params, gradients and
    # optimizer state.
    config.conv_impl = "auto"
    config.compute_dtype = "float32"
    # The LSTMs' time steps per loop iteration, forward and backward (None: one, a loop
    # iteration per time step; the sequence length: no loop). Values equal to float32
    # rounding. On one H100 Stack Overflow with no time loop (20) ran 1.16x (FedAvg) /
    # 1.19x (Flow) faster; on the 2-core CPU Shakespeare with none (80) compiled 35x longer
    # and ran 6.8x slower (docs/benchmarks/cpu-2core.md): measure before unrolling.
    # (None rather than 1 so that runs stored before the field existed still resume.)
    config.lstm_unroll = config_dict.placeholder(int)
    # How every method draws the model (and Flow its policy) at the start of the run:
    # None / "flax", the layers' own init (Flax's LeCun normal with zero biases, Keras'
    # LSTM); "torch", PyTorch's defaults as the authors' networks draw theirs
    # (flowjax/models/torch_init.py); "torch_lecun_variance" / "torch_zero_biases" /
    # "torch_lecun_variance_zero_biases", PyTorch's with flowjax's weight variance / zero
    # biases / both on dense and convolution layers (which factor of the init moves a
    # result). Flow's CIFAR reference network always draws its own.
    config.model_init = config_dict.placeholder(str)
    config.log_every = 10
    # Where stateful methods keep their client states: "memory" (host RAM), or "disk"
    # (memory-mapped files in <workdir>/client_states/, for runs whose states outgrow the
    # host: each run prints its forecast; exact resume through an undo log,
    # flowjax/core/client_state_disk.py). Same numbers either way.
    config.client_states = "memory"
    config.checkpoint_every = 100  # rounds; 0 disables checkpoints (and resuming)
    config.on_divergence = "stop"  # or "skip_clients"
    # Also write metrics.jsonl's records as TensorBoard scalars to <workdir>/tensorboard/
    # (needs tensorboardX: pip install 'flowjax[tensorboard]').
    config.tensorboard = False
    return config


def sgd_override() -> ml_collections.ConfigDict:
    """A method's ``sgd`` subtree: every field None (as ``config.sgd``) until set."""
    return ml_collections.ConfigDict(dict(
        learning_rate=config_dict.placeholder(float), epochs=config_dict.placeholder(int),
        batch_size=config_dict.placeholder(int), momentum=config_dict.placeholder(float)))


def store_data() -> ml_collections.ConfigDict:
    """``config.data`` of a dataset converted with launch/convert.py."""
    return ml_collections.ConfigDict(dict(
        store_dir=config_dict.placeholder(str),
        max_train_examples=config_dict.placeholder(int),
        max_test_examples=config_dict.placeholder(int),
        # None / "all": every train client; "with_test": only those with test rows (the
        # authors' Stack Overflow population; flowjax/data/tff_tasks.py).
        train_clients=config_dict.placeholder(str)))


def paired_store_data() -> ml_collections.ConfigDict:
    """``config.data`` of a converted EMNIST or Shakespeare store, whose clients each have a
    train and a test split: ``store_data`` and the share of clients held out ("newly
    joined", never trained; None or 0: none, as the paper evaluates EMNIST), drawn with
    seed 0 among the clients ``train_clients`` keeps. Stack Overflow's held-out users are
    a population of their own (``eval.held_out_clients``)."""
    data = store_data()
    data.held_out_fraction = config_dict.placeholder(float)
    return data
