"""Ditto: a personal model pulled towards the global model by a squared-norm penalty.

Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1 with FedAvg as the global solver. A sampled
client receives the global params ``w_t`` and

1. (global update) runs E epochs of minibatch SGD on ``w`` from ``w_t`` (FedAvg's local
   update) and sends the result with weight = its number of examples; the server
   averages them;
2. (personal update) runs E epochs of minibatch steps on its personal model ``v``
   (client state) for the objective ``f(v) + lam / 2 * ||v - w_t||^2``, with ``w_t`` the
   params *received this round*, fixed during the whole update (not the moving local
   ``w``, and the squared norm, not the norm: the pitfalls of the public reference).

Each personal step is the paper's (Algorithm 1; ``step`` None or ``"gradient"``):

    v <- v - lr * (grad f(v; xi) + lam * (v - w_t))

with ``momentum`` > 0 applied to that whole gradient, as SGD on the objective. It
diverges once ``lr * lam > 2`` (the penalty alone multiplies ``v - w_t`` by
``1 - lr lam``), which the config refuses. ``step="proximal"`` takes the exact
proximal-gradient step instead, stable for any ``lr * lam``:

    z = v - lr * grad f(v; xi)          (z = v + the optimizer's update, with momentum)
    v <- prox(z) = (z + lr * lam * w_t) / (1 + lr * lam)

the minimiser of ``||v - z||^2 / (2 lr) + lam / 2 ||v - w_t||^2``, equal to the paper's
step to first order in ``lr lam`` (at lr 0.1, lam 0.1 they differ by about 3.5e-4 after
one step). Its two coefficients ``1 / (1 + lr lam)`` and ``lr lam / (1 + lr lam)`` are
computed in double precision. Under either step ``lam = 0`` is plain local SGD on ``v``
bit for bit.

Choices where the paper is silent:

* ``v`` starts from ``w_t`` at the client's first participation (the paper takes the
  initial ``v_k`` as an input); the state carries a ``visited`` flag for that. A client
  with no training examples makes no step and stays unvisited.
* Both updates see the same shuffled minibatches and dropout keys (the round's client
  key), so with ``lam = 0`` a first-time client's ``v`` equals its FedAvg update exactly.
* Personalized model at evaluation: the stored ``v``; for a client that never trained
  (including held-out clients), ``v`` trained from the current global params on its
  train split exactly as at a first participation (APFL follows the same rule). The
  state template of such a client is never read, so no random init enters its ``v``.
* ``w`` and ``v`` each have their own momentum state, reset every round as in FedAvg.

``client_snapshot=True`` also scores the copy the Flow authors' evaluation reports as
Ditto's Acc_g (``client_ditto.py``, the paper datasets' ``*_generalized_test``: ``net``
after the E epochs of its local update, their "before" model): the current global params
after E epochs of the global update on the client's train split, with the evaluation's key
(FedAvgFT's fine-tuned model), as ``acc_g_client_snapshot`` beside Eq. 11's ``acc_g``.
Training, Acc_g and Acc_p are unchanged (their evaluation also trains ``v`` further; this
one does not).

As released, their code does not run: those functions name the file of the client's
``v`` with a global ``cid`` that nothing defines (``NameError`` at the first fit;
``launch/their_undefined_names.py``). The copy follows that code with ``cid`` read as the
client's id.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, SGDConfig,
                                     plain_loss_sums, separate_models_predict, sgd_step,
                                     train_plain, valid_examples)
from flowjax.core.checks import FieldError, check_fields, non_negative, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.core.local_training import run_epochs
from flowjax.core.tree import select_tree
from flowjax.models.base import Params, RoutableModel


STEPS = (None, "gradient", "proximal")


@dataclasses.dataclass(frozen=True)
class DittoConfig:
    """Ditto's client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD for ``w`` and ``v`` (epochs E of each of the two updates).
      lam: weight ``lam`` of the penalty ``lam / 2 * ||v - w_t||^2`` (>= 0).
      step: ``"gradient"`` or None (the paper's personal step) or ``"proximal"`` (its
        exact proximal form, stable for any ``lr * lam``); see the module docstring.
      client_snapshot: also score the global model after E epochs of local training, the
        authors' Ditto Acc_g (module docstring; None = off).
    """

    sgd: SGDConfig
    lam: float
    step: str | None = None
    client_snapshot: bool | None = None

    def __post_init__(self):
        check_fields(self, {"lam": non_negative, "step": one_of(STEPS),
                            "client_snapshot": one_of((None, False, True))})

    @property
    def proximal(self) -> bool:
        return self.step == "proximal"


def unstable_lam(config: DittoConfig) -> str | None:
    """What ``lam`` must be when the configured personal step diverges with it, else None.

    Checked for a Ditto run only (``ditto`` and ``flowjax.validation``): the other methods'
    runs validate Ditto's fields too, with a learning rate Ditto never uses.
    """
    if not config.proximal and config.sgd.learning_rate * config.lam >= 2:
        return (f"expected lam < 2 / learning_rate ({2 / config.sgd.learning_rate:g}), beyond "
                f"which the paper's gradient step diverges; step='proximal' is stable for "
                f"any lam")
    return None


def proximal_pull(z: Params, anchor: Params, step_times_lam: float) -> Params:
    """``(z + s * anchor) / (1 + s)`` leafwise with ``s = lr * lam`` (the prox step).

    The coefficients are computed in double precision before they meet the params, so
    ``s = 0`` returns ``z`` exactly and a huge ``s`` returns ``anchor`` up to ``z / s``.
    """
    keep = 1.0 / (1.0 + step_times_lam)
    pull = step_times_lam / (1.0 + step_times_lam)
    return jax.tree.map(lambda a, b: keep * a + pull * b, z, anchor)


def ditto(model: RoutableModel, config: DittoConfig) -> FederatedAlgorithm:
    """Ditto with FedAvg as the global solver for ``model``.

    Raises:
      FieldError: ``lam`` with which the configured personal step diverges.
    """
    expected = unstable_lam(config)
    if expected is not None:
        raise FieldError("lam", config.lam, expected)
    optimizer = config.sgd.optimizer()
    loss_sums = lambda p, b, k: plain_loss_sums(model, p, b, k)  # noqa: E731
    loss_step = sgd_step(loss_sums, optimizer)
    step_times_lam = config.sgd.learning_rate * config.lam

    def train_global(params, examples: ClientExamples, key):
        return train_plain(model, params, optimizer, examples, valid_examples(examples),
                           epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                           **config.sgd.loop)

    def train_personal(personal, anchor, examples: ClientExamples, key):
        """E epochs of ``config.step`` steps on ``v`` towards the fixed ``anchor = w_t``."""
        if not config.proximal:
            step = sgd_step(loss_sums, optimizer, lambda v: jax.tree.map(
                lambda p, a: config.lam * (p - a), v, anchor))
        else:
            def step(carry, batch, step_key):
                (z, opt_state), sums = loss_step(carry, batch, step_key)
                return (proximal_pull(z, anchor, step_times_lam), opt_state), sums

        x, y, valid = examples.flat()
        (personal, _), sums = run_epochs(step, (personal, optimizer.init(personal)), x, y, valid,
                                         num_epochs=config.sgd.epochs,
                                         batch_size=config.sgd.batch_size, key=key,
                                         **config.sgd.loop)
        return personal, sums

    def starting_point(params, client_state):
        """The stored ``v``, or ``w_t`` for a client that has not trained yet."""
        return select_tree(client_state["visited"], client_state["v"], params)

    def client_update(params, examples: ClientExamples, key, client_state) -> ClientResult:
        trained, sums = train_global(params, examples, key)
        personal, personal_sums = train_personal(starting_point(params, client_state), params,
                                                 examples, key)
        state = {"v": personal, "visited": client_state["visited"] | (examples.num_examples > 0)}
        return ClientResult(params=trained, weight=examples.num_examples.astype(jnp.float32),
                            metrics={"loss_sum": sums[0], "loss_count": sums[1],
                                     "personal_loss_sum": personal_sums[0],
                                     "personal_loss_count": personal_sums[1]},
                            client_state=state)

    def personalize(params, examples: ClientExamples, key, client_state):
        personal = jax.lax.cond(client_state["visited"],
                                lambda: client_state["v"],
                                lambda: train_personal(params, params, examples, key)[0])
        if not config.client_snapshot:
            return personal
        return {"personal": personal, "snapshot": train_global(params, examples, key)[0]}

    def init_client_state(params):
        # ``v`` is only a shape template until the first participation sets it to w_t.
        return {"v": jax.tree.map(jnp.zeros_like, params), "visited": jnp.asarray(False)}

    return FederatedAlgorithm(name="ditto", model=model, init=model.init,
                              client_update=client_update, personalize=personalize,
                              predict=separate_models_predict(model, config.client_snapshot),
                              init_client_state=init_client_state)
