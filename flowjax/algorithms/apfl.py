"""APFL: a personal model mixed with the global one in parameter space.

Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", 2020, Algorithm 1
with a fixed mixing weight ``alpha``. Each client keeps a personal model ``v`` across
rounds (client state). A sampled client, from the broadcast global params ``w``, runs
E epochs of minibatches; on each minibatch ``xi``, with ``vbar = alpha v + (1 - alpha) w``
built from the values *before* the step (the paper's simultaneous update):

    w <- w - lr * grad f(w; xi)
    v <- v - lr * grad_v f(alpha v + (1 - alpha) w; xi) = v - alpha * lr * (grad f)(vbar; xi)

It sends ``w`` with weight = its number of examples; the server averages the ``w``'s.
The client stores its new ``v``; a client that is not sampled keeps its ``v`` untouched.

Choices where the paper is silent or offers options:

* ``alpha`` is fixed (Flow's Appendix B uses .25 / .3 / .2); the paper's adaptive-alpha
  variant is not implemented.
* ``v`` starts from ``w_t``, the global model the client receives at its first
  participation (the APFL paper initializes ``v_i`` with the global model; no random
  init ever enters ``vbar``); the state carries a ``visited`` flag for that, as Ditto's.
  A client with no training examples makes no step and stays unvisited.
* Personalized model at evaluation: ``vbar = alpha v + (1 - alpha) w_i`` where ``w_i`` is
  the current global model after E epochs of local SGD on the client's train split
  (FedAvgFT's fine-tuned model) and ``v`` is the client's stored personal model as is.
  Why: APFL's ``vbar`` mixes ``v`` with the client's *local* iterate of the global
  model, never with the raw server average, so the evaluation rebuilds that local
  iterate as a round would; a stored ``v`` is not trained further because it only
  learns in the rounds the client is sampled, and evaluation returns no state. With
  ``alpha = 0`` the personalized model is therefore exactly FedAvgFT's.
* A client that never trained (held-out clients, and train clients never sampled) is
  personalized as at a first participation, the same rule as Ditto's: the APFL update
  from ``w = v = w_t`` (the current global model) on its train split gives ``w_i`` and
  ``v``, and ``vbar = alpha v + (1 - alpha) w_i``.
* Randomness: the ``w`` steps use exactly FedAvg's keys and batches; the ``v`` step of a
  minibatch uses the same batch and a key folded from the step's key (its dropout).
* ``momentum`` > 0 gives each of ``w`` and ``v`` its own SGD momentum state.

``client_snapshot=True`` also scores the copy the Flow authors' evaluation reports as
APFL's Acc_g (``client_apfl.py``, the paper datasets' ``*_generalized_test``: ``net``
after the E epochs of its local update, their "before" model): ``w_i`` above, the
evaluation's locally trained global model (FedAvgFT's fine-tuned model), as
``acc_g_client_snapshot`` beside Eq. 11's ``acc_g``. Training, Acc_g and Acc_p are
unchanged. ``snapshot_momentum`` gives that copy's E epochs their own SGD momentum, a
separate run of the ``w`` steps (the same keys and batches): their Stack Overflow
evaluation trains ``net`` with momentum 0.9 where their Stack Overflow training uses
none (``stackoverflow_nwp_generalized_test``); None, or the training's momentum, takes
the copy from the personalized model's own run (a different momentum costs a second run
of E epochs per evaluated client).

As released, their code does not run: those functions name the file of the client's
``v`` with a global ``cid`` that nothing defines (``NameError`` at the first fit;
``launch/their_undefined_names.py``). The copy follows that code with ``cid`` read as the
client's id.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, SGDConfig,
                                     client_optimizer, plain_loss_sums, plain_sgd_step,
                                     separate_models_predict, sgd_step, train_plain,
                                     valid_examples)
from flowjax.core.checks import FieldError, Interval, check_fields, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.tree import select_tree
from flowjax.models.base import Params, RoutableModel


@dataclasses.dataclass(frozen=True)
class APFLConfig:
    """APFL's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD for ``w`` and ``v`` (its epochs per round are also those of
        the evaluation's local training of ``w``).
      alpha: mixing weight of the personal model in ``vbar``, in [0, 1].
      client_snapshot: also score ``w_i``, the global model after E epochs of local
        training, the authors' APFL Acc_g (module docstring; None = off).
      snapshot_momentum: with ``client_snapshot``, the SGD momentum of the copy's E
        epochs (None: ``sgd.momentum``, the personalized model's own run).
    """

    sgd: SGDConfig
    alpha: float
    client_snapshot: bool | None = None
    snapshot_momentum: float | None = None

    def __post_init__(self):
        check_fields(self, {"alpha": Interval(0, 1, closed_high=True),
                            "client_snapshot": one_of((None, False, True)),
                            "snapshot_momentum": Interval(0, 1, optional=True)})
        if self.snapshot_momentum is not None and not self.client_snapshot:
            raise FieldError("snapshot_momentum", self.snapshot_momentum,
                             "expected None: it sets the momentum of the client snapshot, "
                             "and client_snapshot is off")


def mix_params(alpha: float, personal: Params, global_params: Params) -> Params:
    """``alpha * personal + (1 - alpha) * global_params`` leafwise.

    With ``alpha == 0`` this is ``global_params`` bit for bit (``0 * v + 1 * w``) as
    long as ``personal`` is finite.
    """
    return jax.tree.map(lambda v, w: alpha * v + (1.0 - alpha) * w, personal, global_params)


def apfl(model: RoutableModel, config: APFLConfig) -> FederatedAlgorithm:
    """APFL with a fixed ``config.alpha`` for ``model``."""
    optimizer = config.sgd.optimizer()
    alpha = config.alpha

    def plain_sums(params, batch, key):
        return plain_loss_sums(model, params, batch, key)

    global_step = plain_sgd_step(model, optimizer)  # train_plain's step: the copy relies on it

    def apfl_step(carry, batch, key, personal_trains=None):
        """One minibatch: the ``w`` and ``v`` steps, both from the pre-step values; with
        ``personal_trains`` False the ``v`` step is skipped (``v`` and its sums stay)."""
        w_carry, v_carry, personal_total = carry
        w_before = w_carry[0]
        personal_step = sgd_step(
            lambda p, b, k: plain_sums(mix_params(alpha, p, w_before), b, k), optimizer)
        w_carry, sums = global_step(w_carry, batch, key)
        # Equal to the w step's layer-1 dropout key (``layer_key(key, 1)``): w's layer-1
        # mask element m is drawn from the key data of v's layer-m dropout key, which v
        # only uses as a key, so no bits are drawn twice. A tag above the layer indices
        # (as partialfed.py's) would be cleaner but would change every APFL result on
        # models with dropout.
        v_key = jax.random.fold_in(key, 1)
        if personal_trains is None:
            v_carry, personal_sums = personal_step(v_carry, batch, v_key)
        else:
            v_carry, personal_sums = jax.lax.cond(
                personal_trains, lambda c: personal_step(c, batch, v_key),
                lambda c: (c, jnp.zeros((2,), jnp.float32)), v_carry)
        # run_epochs sums one [loss, count] per step: the mixed model's ride in the carry.
        return (w_carry, v_carry, personal_total + personal_sums), sums

    def train_both(params, personal, examples: ClientExamples, key, personal_trains=None):
        """E epochs of the APFL update from ``(w, v) = (params, personal)``; ``v`` only
        trains where ``personal_trains`` (a traced bool; None = always)."""
        x, y, valid = examples.flat()
        carry = ((params, optimizer.init(params)), (personal, optimizer.init(personal)),
                 jnp.zeros((2,), jnp.float32))
        step = functools.partial(apfl_step, personal_trains=personal_trains)
        ((w, _), (v, _), personal_sums), sums = run_epochs(
            step, carry, x, y, valid, num_epochs=config.sgd.epochs,
            batch_size=config.sgd.batch_size, key=key, **config.sgd.loop)
        return w, v, sums, personal_sums

    def starting_point(params, client_state):
        """The stored ``v``, or ``w_t`` for a client that has not trained yet."""
        return select_tree(client_state["visited"], client_state["v"], params)

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        w, v, sums, personal_sums = train_both(params, starting_point(params, client_state),
                                               examples, key)
        visited = client_state["visited"] | (examples.num_examples > 0)
        # A client without examples keeps its state bit for bit (template included).
        state = {"v": select_tree(visited, v, client_state["v"]), "visited": visited}
        return ClientResult(
            params=w, weight=examples.num_examples.astype(jnp.float32),
            metrics={"loss_sum": sums[0], "loss_count": sums[1],
                     "personal_loss_sum": personal_sums[0],
                     "personal_loss_count": personal_sums[1]},
            client_state=state)

    def personalize(params, examples: ClientExamples, key, client_state):
        # One pass of the w steps serves both cases (they are FedAvgFT's on the same keys):
        # a visited client mixes its stored v in; a client that never trained gets its
        # first participation's v, trained alongside. The per-step cond skips the v steps
        # of a visited client, and under vmap (a select) w is still trained only once.
        visited = client_state["visited"]
        local_w, v, _, _ = train_both(params, starting_point(params, client_state), examples,
                                      key, personal_trains=jnp.logical_not(visited))
        if not config.client_snapshot:
            return mix_params(alpha, v, local_w)
        snapshot = local_w
        if config.snapshot_momentum not in (None, config.sgd.momentum):
            # The w steps alone, with the copy's momentum: train_plain's steps and keys
            # are the w steps' (global_step, the same key per step).
            snapshot = train_plain(
                model, params, client_optimizer(config.sgd.learning_rate,
                                                config.snapshot_momentum),
                examples, valid_examples(examples), epochs=config.sgd.epochs,
                batch_size=config.sgd.batch_size, key=key, **config.sgd.loop)[0]
        return {"personal": mix_params(alpha, v, local_w), "snapshot": snapshot}

    def init_client_state(params):
        # ``v`` is only a shape template until the first participation sets it to w_t.
        return {"v": jax.tree.map(jnp.zeros_like, params), "visited": jnp.asarray(False)}

    return FederatedAlgorithm(name="apfl", model=model, init=model.init,
                              client_update=client_update, personalize=personalize,
                              predict=separate_models_predict(model, config.client_snapshot),
                              init_client_state=init_client_state)

