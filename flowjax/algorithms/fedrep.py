"""FedRep: a shared body averaged by the server, a personal head kept by each client.

Collins, Hassani, Mokhtari and Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021, Algorithm 1. The top layers named in
``head_layers`` (default: the model's ``head_layers``, its last layer) are the head ``h``;
every other layer is the body ``phi``. A sampled
client ``i``, from the broadcast body ``phi`` and its stored head ``h_i``:

1. runs ``head_epochs`` epochs of minibatch SGD on the head with the body frozen:
   ``h_i <- h_i - lr grad_h f_i(phi, h_i; xi)``;
2. then ``body_epochs`` epochs on the body with the new head frozen:
   ``phi_i <- phi_i - lr grad_phi f_i(phi_i, h_i; xi)`` (``phi_i`` starts at ``phi``);
3. sends ``phi_i`` with weight ``n_i`` (its number of examples) and keeps ``h_i``.

The server averages the bodies only, ``phi <- sum_i n_i phi_i / sum_i n_i``, through the
engine's server optimizer (SGD with rate 1 applies this mean).

Server params: ``{"body": phi, "initial_head": h_0, "mean_head": ClientMean(h_bar)}``.
``h_0`` is the head drawn at initialization. Clients return it unchanged with aggregation
weight 0, so the engine's per-group mean gives that group a zero pseudo-gradient: it stays
``h_0`` bit for bit under every server optimizer. ``init_client_state`` hands ``h_0`` to
every client that has not trained yet (held-out clients included). ``h_bar`` is for
reporting only (see "Global model" below): each client also sends its new head with
weight ``n_i``, and the server sets ``h_bar`` to their example-weighted mean, bypassing
the server optimizer (``core.server_opt.ClientMean``); it starts at ``h_0``, no client
update reads it, and it is checkpointed with the rest of the server state.

Epochs. The Flow paper gives every method the same E local epochs per round; for FedRep
(README, "Baselines as implemented") that is ``E - 1`` head epochs and then 1 body epoch, which
``epochs_for_budget(E)`` returns and the run config uses unless
``methods.fedrep.head_epochs`` / ``body_epochs`` are set. It is also the rule of the
FedRep authors' code (head epochs = local epochs - representation epochs, default 1 body
epoch). The Flow authors' code trains E head epochs and then E body epochs a round, and E
head epochs at evaluation: ``phase_epochs="each"``. ``E = 1`` follows the budget's
formula: 0 head epochs + 1 body epoch, as their code
does with one local epoch. FedRep then trains no head, neither in a round nor at
evaluation, so its personalized model is its global model up to float rounding: Acc_g's
head is the example-weighted mean of identical copies of it (``Acc_p = Acc_g`` for every
client, ties only, but for an argmax within that rounding) and it reduces to FedAvg of the body under the fixed initial head; the
quick Shakespeare config (E = 1) shows that, the paper's configs (E = 3 or 5) do not.

Choices where the paper is silent or the reference code differs:

* A client's head persists across the rounds in which it is sampled (client state); it
  is never re-initialized at the start of a round. ``personal_init="fresh"`` runs the
  Flow authors' code instead (``client_fedrep.py``: each round's client object is a new
  network whose ``set_parameters`` loads every layer but the ``linear`` ones): every
  round and every evaluation starts the head from a new random init of the model, drawn
  from the first half of ``jax.random.split`` of the client's key (the second half is the
  key of the phases below); no client state is kept, and the server's mean of the trained
  heads (``h_bar``) is their server's mean of those layers. ``"fresh_torch"`` draws that
  init as their PyTorch layers draw theirs (``models.torch_init``: ``nn.Linear``'s
  uniform weights and biases, where the model's own init is Flax's LeCun normal with zero
  biases).
* The server mean is example-weighted (the FedAvg convention used by every method here);
  the paper's Algorithm 1 writes a uniform mean over the sampled clients.
* Each phase starts a fresh optimizer state, so with momentum > 0 no velocity of one
  phase moves the group the other phase freezes. ``frozen_momentum="zero_grad"`` runs the
  Flow authors' code as their environment ran it instead: their one ``optim.SGD(momentum
  =0.9)`` covers both phases, and PyTorch 1.11's ``zero_grad()`` zeroes the frozen head's
  gradient rather than dropping it, so through the body phase the head keeps stepping by
  the momentum it built (``base.group_sgd_step``; under PyTorch >= 2, "set_to_none",
  frozen groups are skipped, which is the default here). Evaluation is unaffected (its
  body never has a gradient).
* Randomness: the head phase uses ``fold_in(key, 0)``, the body phase ``fold_in(key, 1)``;
  each epoch reshuffles the client's examples.
* Personalized model at evaluation: the current body ``phi`` with the client's stored head
  after ``head_epochs`` head-only epochs on its train split (body frozen). Evaluation never
  writes the state back.
* Global model (``Acc_g``): FedRep trains no global head, and ``phi`` with the random
  ``h_0`` is near chance. The global logits are those of ``phi`` with ``h_bar``, the
  example-weighted mean of the heads the clients of the latest round trained (weights
  ``n_i``): a real global model, comparable with FedAvg's, that training never uses
  (the authors' code averages every layer, heads included, on the server).

``client_snapshot=True`` also scores the copy the Flow authors' evaluation reports as
FedRep's Acc_g (``client_fedrep.py``, ``*_generalized_test``: ``before_net``, copied after
the first of the E head-only epochs of its fine-tuning): the current body with the
client's head after the first of the evaluation's head epochs, as
``acc_g_client_snapshot`` beside ``acc_g`` (with ``head_epochs = 0``, the stored head:
the personalized model itself). Training, Acc_g and Acc_p are unchanged. Their
evaluation starts that head from a fresh random init (their client objects are rebuilt
each round and never load the head) and trains it E epochs: ``personal_init="fresh"``
and ``phase_epochs="each"``; by default it starts from the client's stored head and
Acc_p's run has ``head_epochs`` epochs.

On the LSTMs their body trains as PyTorch's layers do (two LSTM biases, the embedding's
padding row frozen): ``torch_layers=True``, as for LG-FedAvg (``algorithms.lg_fedavg``;
checked against their ``shakespeare_train`` and ``stackoverflow_nwp_train`` by
``launch/parity_fine_tuning.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (FROZEN_MOMENTUM, PERSONAL_INITS, ClientResult,
                                     FederatedAlgorithm, SGDConfig, fresh_layers,
                                     group_sgd_step, layer_names_or_none, personal_start,
                                     merged_loss_sums, split_layers, top_layer_names,
                                     train_part, train_part_with_snapshot, unrouted_predict,
                                     valid_examples)
from flowjax.core.checks import FieldError, check_fields, one_of, optional_integer
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.server_opt import ClientMean
from flowjax.models.base import Params, RoutableModel, forward
from flowjax.models.layers import with_torch_layers


# ``FedRepConfig.phase_epochs``: E - 1 head + 1 body epoch, or E of each.
PHASE_EPOCHS = ("budget", "each")


@dataclasses.dataclass(frozen=True)
class FedRepConfig:
    """FedRep's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD of both phases; its epochs E set the phases left None.
      head_epochs: epochs of head-only training per round (and at evaluation);
        None: ``epochs_for_budget(E)``'s ``E - 1``.
      body_epochs: epochs of body-only training per round (None: the paper's 1).
      client_snapshot: also score the head after the first evaluation epoch, the
        authors' FedRep Acc_g (module docstring; None = off).
      head_layers: names of the top layers that form the head (None = the model's
        ``head_layers``, its last layer; the Flow authors' EMNIST and Stack Overflow
        FedRep takes both dense layers); validated against the model by
        ``head_layer_names``.
      personal_init: where a client's head starts, each round and at evaluation:
        "stored" (None), its own from its last round; "fresh", a new random init (the
        Flow authors' code; the method is then stateless): the model's own init, or
        "fresh_torch", drawn as their PyTorch networks draw those layers
        (``models.torch_init``). Module docstring.
      phase_epochs: how E splits into the phases left None: "budget" (None), E - 1 head
        epochs and 1 body epoch (``epochs_for_budget``); "each", E head epochs and E body
        epochs, as the Flow authors' code trains (``epochs_each_phase``).
      frozen_momentum: the round's optimizer state: "set_to_none" (None), each phase its
        own; "zero_grad", one over the model, so in the body phase the head keeps moving
        by the velocity of the head phase (the Flow authors' code under the PyTorch 1.11
        of their environment; ``base.FROZEN_MOMENTUM``). Module docstring.
      torch_layers: True: the layers learn as the Flow authors' PyTorch ones: each LSTM
        layer's bias as PyTorch's two (``b_ih``, ``b_hh``, both trained: twice the gradient
        on their sum), no gradient to the embedding's padding row (``padding_idx=0``)
        (``models.layers.with_torch_layers``; the outputs unchanged; None = off).
    """

    sgd: SGDConfig
    head_epochs: int | None = None
    body_epochs: int | None = None
    client_snapshot: bool | None = None
    head_layers: tuple[str, ...] | None = None
    personal_init: str | None = None
    phase_epochs: str | None = None
    frozen_momentum: str | None = None
    torch_layers: bool | None = None

    def __post_init__(self):
        if self.head_layers is not None:  # a config file's list reads as a tuple
            object.__setattr__(self, "head_layers", tuple(self.head_layers))
        check_fields(self, {"head_epochs": optional_integer(0),
                            "body_epochs": optional_integer(0),
                            "client_snapshot": one_of((None, False, True)),
                            "head_layers": layer_names_or_none,
                            "personal_init": one_of((None, *PERSONAL_INITS)),
                            "phase_epochs": one_of((None, *PHASE_EPOCHS)),
                            "frozen_momentum": one_of((None, *FROZEN_MOMENTUM)),
                            "torch_layers": one_of((None, False, True))})
        head, body = (epochs_each_phase if self.phase_epochs == "each"
                      else epochs_for_budget)(self.sgd.epochs)
        for name, derived in (("head_epochs", head), ("body_epochs", body)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, derived)
        if self.head_epochs + self.body_epochs < 1:
            raise FieldError("body_epochs", self.body_epochs,
                             f"expected head_epochs + body_epochs >= 1 (head_epochs="
                             f"{self.head_epochs})")


def epochs_for_budget(epochs: int) -> tuple[int, int]:
    """``(head_epochs, body_epochs) = (E - 1, 1)`` for E local epochs (``E = 1``: no
    head epoch; see the module docstring)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    return epochs - 1, 1


def epochs_each_phase(epochs: int) -> tuple[int, int]:
    """``(head_epochs, body_epochs) = (E, E)``: the Flow authors' FedRep (``client_fedrep.py``,
    ``*_train``: E epochs on their ``linear`` layers, then E on the others)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    return epochs, epochs


def head_layer_names(model: RoutableModel, requested: Sequence[str] | None = None
                     ) -> tuple[str, ...]:
    """FedRep's head for ``model``: ``requested`` or the model's ``head_layers``, validated
    as the top layers leaving a body."""
    return top_layer_names(model, requested, option="FedRep head_layers", below="in the body")


def fedrep(model: RoutableModel, config: FedRepConfig) -> FederatedAlgorithm:
    """FedRep for ``model`` with ``config.head_layers`` as the personal head."""
    if config.torch_layers:
        model = with_torch_layers(model)
    head_names = head_layer_names(model, config.head_layers)
    optimizer = config.sgd.optimizer()
    fresh_init = fresh_layers(model, head_names, config.personal_init)
    fresh = fresh_init is not None
    train = dict(batch_size=config.sgd.batch_size, **config.sgd.loop)

    def init(key) -> Params:
        head, body = split_layers(model.init(key), head_names)
        # A copy: the engine donates the server state, and one buffer cannot be donated twice.
        return {"body": body, "initial_head": head,
                "mean_head": ClientMean(jax.tree.map(jnp.copy, head))}

    def train_head(body, head, examples: ClientExamples, key):
        return train_part(model, head, body, optimizer, examples, valid_examples(examples),
                          epochs=config.head_epochs, key=jax.random.fold_in(key, 0), **train)

    def train_phases(body, head, examples: ClientExamples, key):
        """The head phase, then the body phase: ``(body, head, head_sums, body_sums)``.

        One SGD state per part over both phases, as their one SGD: under ``set_to_none``
        (the default) the frozen part and its state stay as they are, so each phase
        starts the part it trains from a fresh state; under ``zero_grad`` (PyTorch < 2,
        module docstring) the head's velocity keeps moving it in the body phase."""
        carry = ({"head": head, "body": body},
                 {"head": optimizer.init(head), "body": optimizer.init(body)})
        x, y, _ = examples.flat()
        sums = []
        for phase, (part, epochs) in enumerate((("head", config.head_epochs),
                                                ("body", config.body_epochs))):
            if epochs == 0:
                sums.append(jnp.zeros((2,), jnp.float32))
                continue
            carry, phase_sums = run_epochs(
                group_sgd_step(merged_loss_sums(model), (part,), optimizer,
                               config.frozen_momentum or "set_to_none"),
                carry, x, y, valid_examples(examples), num_epochs=epochs,
                key=jax.random.fold_in(key, phase), **train)
            sums.append(phase_sums)
        return carry[0]["body"], carry[0]["head"], *sums

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        head, key = personal_start(fresh_init, client_state, key)
        body, head, head_sums, body_sums = train_phases(params["body"], head, examples, key)
        sums = head_sums + body_sums
        weight = examples.num_examples.astype(jnp.float32)
        return ClientResult(
            params={"body": body, "initial_head": params["initial_head"],
                    "mean_head": ClientMean(head)},
            weight={"body": weight, "initial_head": jnp.zeros_like(weight), "mean_head": weight},
            metrics={"loss_sum": sums[0], "loss_count": sums[1],
                     "head_loss_sum": head_sums[0], "head_loss_count": head_sums[1],
                     "body_loss_sum": body_sums[0], "body_loss_count": body_sums[1]},
            client_state=None if fresh else head)

    def personalize(params, examples: ClientExamples, key, client_state) -> Params:
        head, key = personal_start(fresh_init, client_state, key)
        if not config.client_snapshot:
            return train_head(params["body"], head, examples, key)[0]
        head, snapshot = train_part_with_snapshot(
            model, head, params["body"], optimizer, examples, valid_examples(examples),
            epochs=config.head_epochs, key=jax.random.fold_in(key, 0), **train)
        return {"personal": head, "snapshot": snapshot}

    predict = unrouted_predict(
        lambda params, x: forward(model, {**params["body"], **params["mean_head"].value}, x),
        lambda params, head, x: forward(model, {**params["body"], **head}, x),
        config.client_snapshot)

    def init_client_state(params) -> Params:
        return params["initial_head"]

    return FederatedAlgorithm(name="fedrep", model=model, init=init,
                              client_update=client_update, personalize=personalize,
                              predict=predict,
                              init_client_state=None if fresh else init_client_state)
