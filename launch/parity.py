r"""Parity of flowjax's reference-mode Flow with the authors' PyTorch code, step for step.

  pip install -e '.[parity]'                                  # torch==2.13.0, CPU
  git clone https://github.com/Astuary/Flow authors-flow      # their one commit, 0df6b97
  python launch/parity.py --reference_dir=authors-flow
  python launch/parity.py --reference_dir=authors-flow --model=stackoverflow
  python launch/parity.py --reference_dir=authors-flow --model=cifar
  python launch/parity.py --reference_dir=authors-flow --write_fixture   # CI figures

Imports the authors' ``EMNISTNet`` (``models/emnist_cnn_dynamic_v4.py``) and their client
loops ``emnist_train`` / ``emnist_generalized_test`` (``trainers/client_flow.py``) from the
checkout given by ``--reference_dir`` (their repository has no licence: nothing of it is
copied here; the modules their trainer imports but one client update does not use --
flwr, TensorFlow, TFF data loaders, their server -- are replaced by empty stand-ins at
runtime). Both sides start from the same weights (flowjax's init, converted to PyTorch
layouts) and see the same minibatches (a synthetic EMNIST-shaped client whose batches
their ``shard(2, i)`` takes); then the script prints, per frozen-group rule, the
``max abs diff`` over every parameter after one client update (``emnist_train``) and
over the evaluation's logits and metrics (``emnist_generalized_test``).

What is switched off on both sides, and why: dropout (the CNN's 0.25/0.5 and the policy's
0.3). PyTorch and JAX draw different masks, so with dropout on no two runs agree even in
distribution-free terms; everything else -- shared SGD momentum 0.9, frozen groups,
even/odd batches, their regularizer, the global-only step, the joint evaluation phase and
its snapshot -- runs as in their code. The EMNIST and LSTM checks then run once more
with dropout on: flowjax's masks are recorded as its programs draw them (``recorded_dropout_masks``)
and their ``F.dropout`` multiplies by them instead of drawing its own
(``_replayed_dropout``), so where the masks apply, with what scale, in which phases and
how their gradient flows is compared too; a control reruns their side with one phase's
masks one example off (rows rolled by one), which must move the figures beyond the target
(the LSTMs' is 1e-5 for it). ``--zero_grad=both`` runs their optimizer under
PyTorch 2.x ``zero_grad()`` (frozen groups skipped; flowjax ``frozen_momentum=set_to_none``)
and under ``zero_grad(set_to_none=False)`` (the pre-2.0 default their code was written for:
frozen groups keep moving by momentum; flowjax ``frozen_momentum=zero_grad``).

The LSTMs (``--model=shakespeare``, ``--model=stackoverflow``): their ``ShakespeareNet``
(``models/shakespeare_rnn_dynamic_v4.py``) with ``shakespeare_train`` /
``shakespeare_generalized_test``, and their ``StackoverflowNet``
(``models/stackoverflow_nwp_rnn_dynamic_v4.py``) with ``stackoverflow_nwp_train`` /
``stackoverflow_nwp_generalized_test``, against flowjax's reference mode for
``shakespeare_lstm`` and ``stackoverflow_lstm`` (``flowjax.algorithms.flow_reference_lstm``),
each on a synthetic client. Their loaders reshuffle on every pass; here each pass their
loop asks for (``.shard(2, i)`` or every batch) is the next pass of flowjax's own plan for
the client's key, checked to be of the same kind, so both sides see the same batches in
the same order. With dropout off, their policies' ``F.dropout`` (on even in evaluation)
is swapped for the identity in their model module's globals; with it on, it takes
flowjax's masks in training and in evaluation (flowjax's evaluation routes hard and soft
with one key, so draws each mask twice: checked equal, their hard routing takes one). The
test their ``*_train`` runs at its end for its log changes no weight and has no flowjax
counterpart: it runs with their policies' dropout off.

The CIFAR ResNet (``--model=cifar``): their ``resnet18`` (``models/cifar100_resnet_dynamic_v4.py``)
with ``cifar10_train`` / ``cifar10_generalized_test`` against flowjax's reference mode for
``resnet18_gn`` (``flowjax.algorithms.flow_reference_resnet``), on a synthetic CIFAR-shaped
client whose images (flipped where flowjax's plan flips them, standardized per image) their
loop is fed pass by pass. It runs in float64 on both sides and on a one-batch client:
their network is chaotic under SGD (a last-bit difference grows by orders of magnitude
per step, in float64 too), so float32, or many steps, compare rounding, not procedures
(``--cifar_dtype=float32`` shows it).

The ``*flowjax_side`` functions need no PyTorch: ``tests/test_parity.py``
recomputes them and compares them with the committed figures of the PyTorch side
(``tests/fixtures/parity_{emnist,shakespeare,stackoverflow,cifar}.json``; CIFAR's with
``-m slow``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import types
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "parity_emnist.json")
TOLERANCE = 1e-4
# The LSTMs' target: their rows agree to 1.9e-06, and a dropout mask one example off
# moves their figures by as little as ~1e-05 (the script's controls print it), which
# 1e-4 would let pass.
LSTM_TOLERANCE = 1e-5
ZERO_GRAD_MODES = ("set_to_none", "zero_grad")
# Their emnist_flowv4 hyperparameters (configs/hyperparameters.py): K = 3, batch 20,
# lr 0.01, lambda 0.01, epsilon 1e-6; 62 classes.
SETTINGS = dict(seed=0, train_examples=90, test_examples=40, epochs=3, batch_size=20,
                learning_rate=0.01, gamma=0.01, num_classes=62)
SAMPLED_VALUES = 64  # per tensor in the fixture, at evenly spaced flat indices

SHAKESPEARE_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "parity_shakespeare.json")
# Their shakespeare_flowv4 hyperparameters (configs/hyperparameters.py): embedding 8,
# vocabulary 90, LSTM 256, batch 4, lr 0.11, epsilon 1e-6; K = 2 epochs (theirs 5) and 11
# sequences of 80 tokens (batches of 4, 4, 3: two even, one odd) keep it short; 5 test
# sequences in batches of 3 and 2, each routed with its own dropout masks. lambda is
# 0.1, not their 0.001: at 0.001 the regularizer moves no weight by the 1e-4 tolerance in
# one update, so the check could not see which routes it reads.
SHAKESPEARE_SETTINGS = dict(model="shakespeare_lstm", seed=0, train_examples=11,
                            test_examples=5, test_batch_size=3, epochs=2, batch_size=4,
                            learning_rate=0.11,
                            gamma=0.1, vocab_size=90, embed_dim=8, hidden=256,
                            sequence_length=80)
STACKOVERFLOW_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "parity_stackoverflow.json")
# Their stackoverflow_nwp_flowv4 hyperparameters: embedding 96 (their policy's second path
# reads 2 x 96 inputs, written in), sequence length 20 (also written in), batch 16, lr 0.1,
# K = 2 epochs (theirs 3); a 200-word vocabulary and an LSTM of 64 (theirs 10,004 and 670)
# keep it short; 37 sequences are batches of 16, 16, 5, and 6 test sequences batches of
# 4 and 2. lambda 0.1 as for Shakespeare.
STACKOVERFLOW_SETTINGS = dict(model="stackoverflow_lstm", seed=0, train_examples=37,
                              test_examples=6, test_batch_size=4, epochs=2, batch_size=16,
                              learning_rate=0.1,
                              gamma=0.1, vocab_size=200, embed_dim=96, hidden=64,
                              sequence_length=20)
CIFAR_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "parity_cifar.json")
# Their cifar10_flowv4 hyperparameters: batch 20 (their loader's), lr 0.05, epsilon 1e-6,
# 10 classes; K = 2 epochs (theirs 3); lambda 0.1, not their 0.001, as for the LSTMs.
# float64 on both sides and 15 images (one batch, padded to 20: 2 local steps, 2 policy
# and 2 global steps): their network is chaotic under SGD -- a difference in the last bits
# grows by orders of magnitude per step, in float64 too -- so only a short update can be
# compared at all (README).
CIFAR_SETTINGS = dict(model="resnet18_gn", seed=0, train_examples=15, test_examples=20,
                      epochs=2, batch_size=20, learning_rate=0.05, gamma=0.1, num_classes=10,
                      dtype="float64")
# Their policies' LSTM-state path (``lstm=True``), the same in both models.
_THEIR_STATE_POLICY = {"dense0": "lstm_linear_1", "dense1": "lstm_linear_2",
                       "dense2": "lstm_linear_3", "dense3": "lstm_linear_4",
                       "exit": "lstm_linear_exit"}
# Per model: their class (an attribute of their trainer), its state-dict names for
# flowjax's layers, the policy's, and the client functions.
THEIR_LSTM = {
    "shakespeare_lstm": dict(
        net="ShakespeareNet", embedding="embeddings", train="shakespeare_train",
        test="shakespeare_test",
        evaluate="shakespeare_generalized_test", total_clients=715,
        layers={"lstm1": "{}_lstm_1", "lstm2": "{}_lstm_2", "dense": "{}_fc"},
        policy={"states": _THEIR_STATE_POLICY}),
    "stackoverflow_lstm": dict(
        net="StackoverflowNWPNet", embedding="embedding", train="stackoverflow_nwp_train",
        test="stackoverflow_nwp_test",
        evaluate="stackoverflow_nwp_generalized_test", total_clients=195303,
        layers={"lstm": "{}_lstm", "dense1": "{}_linear_1", "dense2": "{}_linear_2"},
        policy={"states": _THEIR_STATE_POLICY,
                "outputs": {"linear1": "linear_1", "linear2": "linear_2",
                            "exit2": "linear_2_exit", "linear3": "linear_3",
                            "exit3": "linear_3_exit"}}),
}


# ----------------------------------------------------------------------------- data


def client_data(seed: int, train_examples: int, test_examples: int, num_classes: int,
                **_: Any) -> dict[str, np.ndarray]:
    """A synthetic EMNIST-shaped client: pixels in [0, 1), labels with a class skew."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(8, size=train_examples + test_examples) * (num_classes // 8)
    x = rng.random((train_examples + test_examples, 28, 28), dtype=np.float32)
    x[np.arange(len(labels)), labels % 28, :] += 1.0  # a label-dependent stripe
    x = np.clip(x, 0.0, 1.0)
    return dict(train_x=x[:train_examples], train_y=labels[:train_examples].astype(np.int32),
                test_x=x[train_examples:], test_y=labels[train_examples:].astype(np.int32))


# ----------------------------------------------------------------------------- flowjax


def _flowjax_algorithm(frozen_momentum: str, settings: dict, dropout: bool = False):
    import jax.numpy as jnp
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.flow import FlowConfig, flow
    from flowjax.algorithms.flow_reference import reference_options
    from flowjax.models import get_model

    model = get_model("emnist_cnn", num_classes=settings["num_classes"])
    if not dropout:  # off (module docstring)
        model = without_dropout(model)
    options = {**reference_options("emnist_cnn"), "frozen_momentum": frozen_momentum}
    sgd = SGDConfig(learning_rate=settings["learning_rate"], epochs=settings["epochs"],
                    batch_size=settings["batch_size"], momentum=options.pop("momentum"))
    off = {} if dropout else {"policy_dropout": 0.0}  # on: the exits' 0.3, theirs too
    config = FlowConfig(sgd=sgd, gamma=settings["gamma"], **off, **options)
    return flow(model, config, jnp.zeros((2, 28, 28), jnp.float32))


def without_dropout(model):
    """``model`` whose glue runs as at inference (``train=False``): the CNN's dropout off."""
    glue = model.glue_apply
    return dataclasses.replace(model, glue_apply=lambda j, h, train, key: glue(j, h, False, key))


@contextlib.contextmanager
def recorded_dropout_masks():
    """Collects every mask ``jax.random.bernoulli`` draws in the programs traced inside
    (flowjax's dropout and flax's ``nn.Dropout`` both draw theirs with it): a list of
    ``(keep probability, bool mask)`` in the order the programs draw them when they run
    (ordered callbacks), which is the order of the steps."""
    import jax
    masks = []
    draw = jax.random.bernoulli

    def recording(key, p=0.5, shape=None, *args, **kwargs):
        mask = draw(key, p, shape, *args, **kwargs)
        keep = float(p)  # a Python number in both callers: fixed per call site
        jax.debug.callback(lambda m: masks.append((keep, np.asarray(m))), mask, ordered=True)
        return mask

    jax.random.bernoulli = recording
    try:
        yield masks
    finally:
        jax.random.bernoulli = draw


def masks_digest(masks: dict[str, list]) -> str:
    """SHA-256 of the recorded masks (keep probabilities, shapes, bits), phase by phase:
    the fixture's record of the masks their code was fed."""
    import hashlib
    digest = hashlib.sha256()
    for phase in sorted(masks):
        for keep, mask in masks[phase]:
            digest.update(f"{phase}:{keep!r}:{mask.shape}:".encode())
            digest.update(np.packbits(mask.astype(bool)).tobytes())
    return digest.hexdigest()


def client_examples(x: np.ndarray, y: np.ndarray, batch_size: int):
    import jax.numpy as jnp
    from flowjax.core.cohort import ClientExamples
    n = len(x)
    steps = -(-n // batch_size)
    pad = steps * batch_size - n
    xs = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    ys = np.concatenate([y, np.zeros((pad,) + y.shape[1:], y.dtype)])
    mask = np.arange(steps * batch_size) < n
    return ClientExamples(x=jnp.asarray(xs.reshape((steps, batch_size) + x.shape[1:])),
                          y=jnp.asarray(ys.reshape((steps, batch_size) + y.shape[1:])),
                          mask=jnp.asarray(mask.reshape(steps, batch_size)),
                          num_examples=jnp.int32(n), client_id=jnp.int32(0))


def cnn_to_torch_layout(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """flowjax's ``emnist_cnn`` params as the state dict of the authors' EMNIST CNN layers
    (numpy), named ``<prefix>conv2d_1`` ... ``<prefix>linear_2``: OIHW kernels, ``[out, in]``
    dense weights, and ``fc1``'s input axis reordered from flowjax's NHWC flatten to
    PyTorch's NCHW flatten."""
    p = {k: {n: np.asarray(v) for n, v in layer.items()} for k, layer in params.items()}
    state = {}
    for ours, theirs in (("conv1", "conv2d_1"), ("conv2", "conv2d_2")):
        state[f"{prefix}{theirs}.weight"] = p[ours]["kernel"].transpose(3, 2, 0, 1)
        state[f"{prefix}{theirs}.bias"] = p[ours]["bias"]
    fc1 = p["fc1"]["kernel"].reshape(12, 12, 64, -1).transpose(2, 0, 1, 3).reshape(9216, -1)
    state[f"{prefix}linear_1.weight"] = fc1.T
    state[f"{prefix}linear_1.bias"] = p["fc1"]["bias"]
    state[f"{prefix}linear_2.weight"] = p["fc2"]["kernel"].T
    state[f"{prefix}linear_2.bias"] = p["fc2"]["bias"]
    return state


def to_torch_layout(params: dict) -> dict[str, np.ndarray]:
    """flowjax's ``{global, local, policy}`` params as the authors' ``EMNISTNet`` state
    dict (numpy; the two branches as ``cnn_to_torch_layout``)."""
    state = {}
    for branch in ("global", "local"):
        state.update(cnn_to_torch_layout(params[branch], f"{branch}_"))
    policy = params["policy"]
    names = {"base0": "fc1", "exit0": "fc1_exit.2", "base1": "fc2", "exit1": "fc2_exit.2",
             "base2": "fc3", "exit2": "fc3_exit.2", "base3": "fc4"}
    for ours, theirs in names.items():
        state[f"prob_policy_net.{theirs}.weight"] = np.asarray(policy[ours]["kernel"]).T
        state[f"prob_policy_net.{theirs}.bias"] = np.asarray(policy[ours]["bias"])
    return state


def flowjax_side(frozen_momentum: str, settings: dict = SETTINGS,
                 dropout: bool = False) -> dict[str, Any]:
    """Initial weights, weights after one client update, and the reference evaluation's
    logits and metrics, all in the authors' layouts (numpy); no PyTorch needed. With
    ``dropout``, the CNN's and the policy's dropout are on, and ``dropout_masks`` holds
    the masks drawn, per phase, for the PyTorch side to replay."""
    import jax
    import jax.numpy as jnp

    algorithm = _flowjax_algorithm(frozen_momentum, settings, dropout)
    data = client_data(**settings)
    params = algorithm.init(jax.random.key(settings["seed"]))
    train = client_examples(data["train_x"], data["train_y"], settings["batch_size"])
    # Drawn from by dropout only (the shard halves are fixed).
    key = jax.random.key(settings["seed"] + 1)
    result, predictions, mask_fields = _recorded_client_run(
        algorithm, params, train, jnp.asarray(data["test_x"]), key, dropout)
    snapshot = np.asarray(predictions.global_snapshot)
    personal_logits = np.asarray(predictions.personal_hard)
    return dict(initial=to_torch_layout(params), updated=to_torch_layout(result.params),
                eval_snapshot_logits=snapshot, eval_personal_logits=personal_logits,
                metrics=generalized_test_metrics(snapshot, personal_logits, data["test_y"]),
                **mask_fields)


def _recorded_client_run(algorithm, params, train, test_x, key, dropout: bool,
                         test_batch_size=None):
    """A client update, the evaluation's personalization and its predictions on
    ``test_x`` in consecutive batches of ``test_batch_size`` (default: one batch), each
    jitted, and the dropout masks they drew: ``(client result, predictions, mask
    fields)``. With ``dropout`` the fields are ``dropout_masks``, per phase (``train``,
    ``evaluation``) what their code takes: the evaluation's are the personalization's
    ``personalization_masks`` and then the hard routing's of each test batch in turn
    (``_hard_routes_masks``); without it there are none, and a mask drawn fails. Each
    batch is predicted with its own personal state (``for_test_batch``), as the
    evaluation does."""
    import jax
    masks = {}
    with recorded_dropout_masks() as masks["train"]:
        result = jax.jit(algorithm.client_update)(params, train, key)
        jax.effects_barrier()
    with recorded_dropout_masks() as masks["evaluation"]:
        personal = jax.jit(algorithm.personalize)(params, train, key)
        jax.effects_barrier()
    count = len(masks["evaluation"])
    size = len(test_x) if test_batch_size is None else test_batch_size
    predict, batches, first = jax.jit(algorithm.predict), [], None
    for index, start in enumerate(range(0, len(test_x), size)):
        batch_personal = algorithm.for_test_batch(personal, np.int32(index))
        with recorded_dropout_masks() as routed:
            batches.append(predict(params, batch_personal, test_x[start:start + size]))
            jax.effects_barrier()
        routes = _hard_routes_masks(routed)
        first = routes if first is None else first
        if index and routes and all(np.array_equal(mask, earlier[:len(mask)])
                                    for (_, mask), (_, earlier) in zip(routes, first)):
            # With one key, a shorter batch's masks are the first rows of a longer one's:
            # replayed, those would match their code's figures as well as fresh ones do.
            raise AssertionError(f"flowjax routed test batch {index} with the first batch's "
                                 "dropout masks, not its own")
        masks["evaluation"] += routes
    predictions = jax.tree.map(lambda *parts: np.concatenate(parts), *batches)
    if not dropout:
        if any(masks.values()):
            raise AssertionError("flowjax drew dropout masks with dropout off")
        return result, predictions, {}
    # The personalization's masks come first; the rest route the test batches.
    return result, predictions, dict(dropout_masks=masks, personalization_masks=count)


def _hard_routes_masks(masks: list[tuple[float, np.ndarray]]) -> list[tuple[float, np.ndarray]]:
    """The masks of ``predict``'s hard routing, which their evaluation runs: ``predict``
    routes hard and then soft with one key, so it draws every mask twice; the second
    half must repeat the first."""
    half = len(masks) // 2
    repeated = len(masks) == 2 * half and all(
        a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(masks[:half], masks[half:]))
    if not repeated:
        raise AssertionError(f"flowjax's soft routing drew other masks than its hard routing "
                             f"({len(masks)} masks in all)")
    return masks[:half]


def generalized_test_metrics(before_logits: np.ndarray, after_logits: np.ndarray, y: np.ndarray,
             real: np.ndarray | None = None) -> dict:
    """Their ``*_generalized_test``'s figures from the two models' logits; labels outside
    ``real`` (their LSTMs' padding, 0) count nowhere."""
    real = np.ones(y.shape, bool) if real is None else real
    before = (before_logits.argmax(-1) == y) & real
    after = (after_logits.argmax(-1) == y) & real
    wrong_before, wrong_after = real & ~before, real & ~after
    return dict(before_accuracy=float(before.sum() / real.sum()),
                after_accuracy=float(after.sum() / real.sum()),
                w_g_true_w_p_true=int(np.sum(before & after)),
                w_g_true_w_p_false=int(np.sum(before & wrong_after)),
                w_g_false_w_p_true=int(np.sum(wrong_before & after)),
                w_g_false_w_p_false=int(np.sum(wrong_before & wrong_after)))


# ----------------------------------------------------------------------------- LSTMs


def token_client_data(seed: int, train_examples: int, test_examples: int, vocab_size: int,
                      sequence_length: int, **_: Any) -> dict:
    """A synthetic next-token client: int64 tokens ``[N, T]`` and next tokens, skewed to a
    few ids, with trailing padding (id 0) in some sequences, as TFF's last chunk of a
    Shakespeare snippet and Stack Overflow's short sentences have."""
    rng = np.random.default_rng(seed)
    n = train_examples + test_examples
    weights = rng.dirichlet(np.full(vocab_size - 1, 0.3))
    tokens = 1 + rng.choice(vocab_size - 1, size=(n, sequence_length + 1), p=weights)
    for row, length in zip(range(0, n, 3), rng.integers(2, sequence_length, size=n)):
        tokens[row, length:] = 0
    x, y = tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)
    return dict(train_x=x[:train_examples], train_y=y[:train_examples],
                test_x=x[train_examples:], test_y=y[train_examples:])


def _flowjax_lstm_algorithm(frozen_momentum: str, settings: dict, dropout: bool = False):
    import jax.numpy as jnp
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.flow import FlowConfig, flow
    from flowjax.models import get_model

    sizes = dict(vocab_size=settings["vocab_size"], embed_dim=settings["embed_dim"],
                 hidden=settings["hidden"])
    if settings["model"] == "stackoverflow_lstm":
        sizes["dense"] = settings["embed_dim"]  # their linear_1 maps to the embedding width
    model = get_model(settings["model"], **sizes)
    sgd = SGDConfig(learning_rate=settings["learning_rate"], epochs=settings["epochs"],
                    batch_size=settings["batch_size"])
    # Policy dropout off (module docstring); on: their 0.3, in evaluation too.
    config = FlowConfig(sgd=sgd, gamma=settings["gamma"], policy_hidden=(500, 250, 100, 50),
                        policy_dropout=0.3 if dropout else 0.0, semantics="reference",
                        frozen_momentum=frozen_momentum)
    algorithm = flow(model, config, jnp.zeros((2, settings["sequence_length"]), jnp.int32))
    return algorithm, model


def lstm_to_torch_layout(params: dict, model_name: str) -> dict[str, np.ndarray]:
    """flowjax's reference LSTM params as the authors' state dict (numpy): ``[out, in]``
    weights; flowjax's one LSTM bias as ``bias_ih``, ``bias_hh = 0`` (the cell adds both)."""
    names = THEIR_LSTM[model_name]
    state = {f"{names['embedding']}.weight": np.asarray(params["embedding"]["embedding"])}
    for branch in ("global", "local"):
        for ours, theirs in names["layers"].items():
            layer, prefix = params[branch][ours], theirs.format(branch)
            if "recurrent_kernel" in layer:
                state[f"{prefix}.weight_ih"] = np.asarray(layer["kernel"]).T
                state[f"{prefix}.weight_hh"] = np.asarray(layer["recurrent_kernel"]).T
                state[f"{prefix}.bias_ih"] = np.asarray(layer["bias"])
                state[f"{prefix}.bias_hh"] = np.zeros_like(state[f"{prefix}.bias_ih"])
            else:
                state[f"{prefix}.weight"] = np.asarray(layer["kernel"]).T
                state[f"{prefix}.bias"] = np.asarray(layer["bias"])
    for path, layers in names["policy"].items():
        for ours, theirs in layers.items():
            policy = params["policy"][path][ours]
            state[f"policy_net.{theirs}.weight"] = np.asarray(policy["kernel"]).T
            state[f"policy_net.{theirs}.bias"] = np.asarray(policy["bias"])
    return state


def lstm_effective(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict with each cell's ``bias_ih + bias_hh`` (what the cell adds) as
    ``bias`` (an ``nn.LSTM``'s ``bias_ih_l0`` as ``bias_l0``): what both sides have, for
    comparison."""
    out = {}
    for name, value in state.items():
        if "bias_hh" in name:
            continue
        if "bias_ih" in name:
            value = value + state[name.replace("bias_ih", "bias_hh")]
            name = name.replace("bias_ih", "bias")
        out[name] = np.asarray(value)
    return out


def planned_passes(plan: dict, order: list[tuple[str, str, int]]) -> list[tuple[str, list]]:
    """The example indices of every batch of every pass, in the order their loop asks for
    them: ``order`` lists ``(phase, kind, epoch)``."""
    passes = []
    for phase, kind, epoch in order:
        indices, mask = (np.asarray(a[epoch]) for a in plan[phase])
        passes.append((kind, [row[keep] for row, keep in zip(indices, mask) if keep.any()]))
    return passes


def lstm_flowjax_side(frozen_momentum: str, settings: dict,
                      dropout: bool = False) -> dict[str, Any]:
    """flowjax's reference LSTM: initial and updated weights (their layout, effective
    biases), the evaluation's logits and metrics, and the batches it trained on; no
    PyTorch needed. With ``dropout``, the policies' dropout is on (their 0.3, on in
    evaluation too) and ``dropout_masks`` holds the masks drawn, per phase, in flowjax's
    order (their code takes them per rate and shape in that order; a wrong order
    would show in the figures)."""
    import jax
    import jax.numpy as jnp
    from flowjax.algorithms import flow_reference_lstm as reference

    algorithm, model = _flowjax_lstm_algorithm(frozen_momentum, settings, dropout)
    data = token_client_data(**settings)
    params = algorithm.init(jax.random.key(settings["seed"]))
    train = client_examples(data["train_x"].astype(np.int32), data["train_y"].astype(np.int32),
                      settings["batch_size"])
    key = jax.random.key(settings["seed"] + 1)
    result, predictions, mask_fields = _recorded_client_run(
        algorithm, params, train, jnp.asarray(data["test_x"].astype(np.int32)), key, dropout,
        settings["test_batch_size"])
    snapshot = np.asarray(predictions.global_snapshot)
    personal_logits = np.asarray(predictions.personal_hard)
    valid = train.flat()[2]
    k1 = k2 = settings["epochs"]
    batch = settings["batch_size"]
    net = reference.NETS[model.name]
    train_plan = reference.train_plan(net, key, valid, batch, k1, k2)
    eval_plan = reference.evaluation_plan(net, key, valid, batch, k1, k2)
    routing = [("policy", "shard1", e) for e in range(k2)]
    if net.global_epoch_on_every_batch:
        routing = [step for e in range(k2) for step in (("policy", "shard1", e),
                                                        ("global", "all", e))]
    train_order = [("local", "shard0", e) for e in range(k1)] + routing
    every = net.evaluation_on_every_batch
    eval_order = ([("local", "all" if every else "shard0", e) for e in range(k1)]
                  + [("joint", "all" if every else "shard1", e) for e in range(k2)])
    layout = lambda p: lstm_to_torch_layout(p, model.name)  # noqa: E731
    return dict(initial=lstm_effective(layout(params)), torch_state=layout(params),
                updated=lstm_effective(layout(result.params)),
                eval_snapshot_logits=snapshot, eval_personal_logits=personal_logits,
                metrics=generalized_test_metrics(snapshot, personal_logits, data["test_y"],
                                 real=data["test_y"] != 0),
                train_passes=planned_passes(train_plan, train_order),
                eval_passes=planned_passes(eval_plan, eval_order), **mask_fields)


# ----------------------------------------------------------------------------- CIFAR ResNet


def image_client_data(seed: int, train_examples: int, test_examples: int, num_classes: int,
                      **_: Any) -> dict[str, np.ndarray]:
    """A synthetic CIFAR-shaped client as flowjax's CIFAR data holds it: pixel values
    with a label-dependent stripe and tint, per-channel standardized
    (``flowjax.data.cifar``), labels with a class skew."""
    from flowjax.data.cifar import CHANNEL_MEAN, CHANNEL_STD
    rng = np.random.default_rng(seed)
    n = train_examples + test_examples
    labels = rng.choice(min(num_classes, 4), size=n) * max(1, num_classes // 4)
    pixels = rng.integers(0, 256, size=(n, 32, 32, 3)).astype(np.float32)
    pixels[np.arange(n), labels % 32, :, labels % 3] = 255.0
    band = np.arange(32)[None, :] < (8 + labels % 8)[:, None]  # [N, W], left-aligned
    pixels *= np.where(band, 0.5, 1.0)[:, None, :, None]  # asymmetric: flips matter
    x = (pixels - CHANNEL_MEAN) / CHANNEL_STD
    return dict(train_x=x[:train_examples], train_y=labels[:train_examples].astype(np.int32),
                test_x=x[train_examples:], test_y=labels[train_examples:].astype(np.int32))


def _flowjax_resnet_algorithm(frozen_momentum: str, settings: dict):
    import jax.numpy as jnp
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.flow import FlowConfig, flow
    from flowjax.models import get_model

    model = get_model("resnet18_gn", num_classes=settings["num_classes"])
    sgd = SGDConfig(learning_rate=settings["learning_rate"], epochs=settings["epochs"],
                    batch_size=settings["batch_size"])
    config = FlowConfig(sgd=sgd, gamma=settings["gamma"],
                        policy_hidden=(1000, 750, 350, 150, 50, 2), semantics="reference",
                        frozen_momentum=frozen_momentum)
    return flow(model, config, jnp.zeros((2, 32, 32, 3), jnp.float32))


def _oihw(kernel) -> np.ndarray:
    return np.asarray(kernel).transpose(3, 2, 0, 1)


def resnet_to_torch_layout(params: dict) -> dict[str, np.ndarray]:
    """flowjax's reference ResNet params as the authors' state dict (numpy): OIHW
    kernels, ``[out, in]`` linear weights; the names are theirs but for the prefixes."""
    state = {"bn1.weight": np.asarray(params["shared"]["weight"]),
             "bn1.bias": np.asarray(params["shared"]["bias"])}
    for branch in ("global", "local"):
        p = params[branch]
        state[f"{branch}_conv1.weight"] = _oihw(p["conv1"]["kernel"])
        for stage in range(1, 5):
            for block in range(2):
                ours = p[f"layer{stage}"][f"block{block}"]
                prefix = f"{branch}_layer{stage}.{block}"
                names = {"conv1": "conv1", "bn1": "bn1", "conv2": "conv2", "bn2": "bn2",
                         "downsample_conv": "downsample.0", "downsample_norm": "downsample.1"}
                for mine, theirs in names.items():
                    if mine not in ours:
                        continue
                    if "kernel" in ours[mine]:
                        state[f"{prefix}.{theirs}.weight"] = _oihw(ours[mine]["kernel"])
                    else:
                        state[f"{prefix}.{theirs}.weight"] = np.asarray(ours[mine]["weight"])
                        state[f"{prefix}.{theirs}.bias"] = np.asarray(ours[mine]["bias"])
        state[f"{branch}_fc.weight"] = np.asarray(p["fc"]["kernel"]).T
        state[f"{branch}_fc.bias"] = np.asarray(p["fc"]["bias"])
    names = {f"base{j}": f"linear_{j + 1}" for j in range(5)}
    names.update({f"exit{j}": f"linear_{j + 1}_exit" for j in range(5)}, last="linear_6")
    for ours, theirs in names.items():
        state[f"prob_policy_net.{theirs}.weight"] = np.asarray(params["policy"][ours]["kernel"]).T
        state[f"prob_policy_net.{theirs}.bias"] = np.asarray(params["policy"][ours]["bias"])
    return state


def resnet_flowjax_side(frozen_momentum: str, settings: dict) -> dict[str, Any]:
    """flowjax's reference ResNet in float64 (``CIFAR_SETTINGS``): initial and updated
    weights (their layout), the evaluation's logits and metrics, the batches it trained on
    (indices into the client's images followed by their flips) and those images as their
    network reads them; no PyTorch needed."""
    import jax

    with jax.enable_x64(True):
        return _resnet_flowjax_side(frozen_momentum, settings)


def _resnet_flowjax_side(frozen_momentum: str, settings: dict) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flowjax.algorithms import flow_reference_resnet as reference

    dtype = np.dtype(settings["dtype"])
    algorithm = _flowjax_resnet_algorithm(frozen_momentum, settings)
    data = image_client_data(**settings)
    params = jax.tree.map(lambda a: a.astype(dtype), algorithm.init(jax.random.key(settings["seed"])))
    train = client_examples(data["train_x"].astype(dtype), data["train_y"], settings["batch_size"])
    key = jax.random.key(settings["seed"] + 1)
    result = jax.jit(algorithm.client_update)(params, train, key)
    personal = jax.jit(algorithm.personalize)(params, train, key)
    test_x = jnp.asarray(data["test_x"].astype(dtype))
    predictions = jax.jit(algorithm.predict)(params, personal, test_x)
    snapshot = np.asarray(predictions.global_snapshot)
    personal_logits = np.asarray(predictions.personal_hard)
    x, y, valid = train.flat()
    k = settings["epochs"]
    plan = reference.train_plan(key, valid, settings["batch_size"], k, k)
    order = [("local", "all", e) for e in range(k)] + [("routing", "all", e) for e in range(k)]
    passes = planned_passes(plan, order)
    images = reference.per_image_standardization(reference.with_flips(reference.their_pixels(x)))
    return dict(initial=resnet_to_torch_layout(params), torch_state=resnet_to_torch_layout(params),
                updated=resnet_to_torch_layout(result.params),
                eval_snapshot_logits=snapshot, eval_personal_logits=personal_logits,
                metrics=generalized_test_metrics(snapshot, personal_logits, data["test_y"]),
                train_passes=passes, eval_passes=passes,  # the same key: the same batches
                their_images=np.asarray(images),
                their_labels=np.concatenate([np.asarray(y), np.asarray(y)]).astype(np.int64),
                their_test_images=np.asarray(reference.their_input(test_x)))


def resnet_torch_side(reference_dir: str, ours: dict[str, Any], mode: str,
                      settings: dict) -> dict[str, Any]:
    """Their ``cifar10_train`` and ``cifar10_generalized_test`` with their ``resnet18``
    from flowjax's initial weights, on flowjax's batches and flips."""
    import torch
    trainer = _their_trainer(reference_dir, settings, total_clients=500, total_rounds=4000)
    data = image_client_data(**settings)
    labels = ours["their_labels"]
    test = BatchedDataset(ours["their_test_images"], data["test_y"].astype(np.int64),
                    len(data["test_y"]))  # one batch (their test batch is 100)

    def their_net():
        net = trainer.CifarResNet(num_classes=settings["num_classes"])
        mine = {k: torch.from_numpy(np.array(v)) for k, v in ours["torch_state"].items()}
        net.load_state_dict(mine, strict=True)
        return net.to(getattr(torch, settings["dtype"]))

    with _zero_grad(mode):
        train = ScriptedDataset(ours["their_images"], labels, ours["train_passes"])
        net = their_net()
        trainer.cifar10_train(net, train, test)
        assert train.exhausted(), "their loop left passes of flowjax's plan unread"
        updated = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}

        train = ScriptedDataset(ours["their_images"], labels, ours["eval_passes"])
        figures, snapshot, personal = _their_evaluation(
            their_net(), lambda net: trainer.cifar10_generalized_test(net, train, test))
        assert train.exhausted(), "their evaluation left passes of flowjax's plan unread"
    return dict(updated=updated, eval_snapshot_logits=snapshot, eval_personal_logits=personal,
                metrics=reported_metrics(figures))


# ----------------------------------------------------------------------------- theirs


def _stand_in(name: str, **attributes: Any) -> types.ModuleType:
    import importlib.machinery
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() asks for it
    module.__dict__.update(attributes)
    return module


def import_their_trainer(reference_dir: str, module_name: str = "trainers.client_flow"):
    """Their client module (``trainers.client_flow``, or another of their ``trainers``)
    from ``reference_dir``, with empty stand-ins for the modules it imports that one
    client update never calls (flwr, TensorFlow, their data loaders and server), so
    neither needs installing."""
    # Absolute: it goes on sys.path and the import runs from inside it (their code opens
    # files relative to its root), where a relative path would name another folder.
    reference_dir = os.path.abspath(reference_dir)
    source = os.path.join(*module_name.split(".")) + ".py"
    if not os.path.isfile(os.path.join(reference_dir, source)):
        raise SystemExit(f"--reference_dir={reference_dir!r}: expected a checkout of "
                         f"github.com/Astuary/Flow ({source} not found)")
    stand_ins = {
        "flwr": _stand_in("flwr"),
        "flwr.client": _stand_in("flwr.client", NumPyClient=object),
        "flwr.common": _stand_in("flwr.common"),
        "flwr.common.logger": _stand_in("flwr.common.logger", FLOWER_LOGGER=None),
        "flwr.server": _stand_in("flwr.server"),
        "flwr.server.app": _stand_in("flwr.server.app", ServerConfig=object),
        "tensorflow": _stand_in("tensorflow"),
        "torchviz": _stand_in("torchviz", make_dot=None),  # client_fedavg.py's graph drawing
        "colorama": _stand_in("colorama", Fore=types.SimpleNamespace(
            RED="", BLUE="", WHITE="", YELLOW="", GREEN="")),
        "trainers.server_fedavg": _stand_in("trainers.server_fedavg", FedAvg=object),
        "dataloaders.synthetic.generate_synthetic_data": _stand_in(
            "dataloaders.synthetic.generate_synthetic_data", NUM_USER=0),
    }
    stand_ins["flwr"].client = stand_ins["flwr.client"]
    stand_ins["flwr"].common = stand_ins["flwr.common"]
    stand_ins["flwr"].server = stand_ins["flwr.server"]
    for loader in ("stackoverflow.stackoverflow_nwp_dataloader",
                   "stackoverflow.stackoverflow_lr_dataloader", "emnist.emnist_dataloader",
                   "cifar10.cifar10_dataloader", "cifar100.cifar100_dataloader",
                   "shakespeare.shakespeare_dataloader"):
        stand_ins[f"dataloaders.{loader}"] = _stand_in(f"dataloaders.{loader}")
    for name in list(stand_ins):  # `import a.b.c as m` needs the parents' attributes
        if name.startswith("dataloaders."):
            parts = name.split(".")
            for depth in range(1, len(parts)):
                parent = ".".join(parts[:depth])
                stand_ins.setdefault(parent, _stand_in(parent))
    for name in sorted(stand_ins, key=lambda n: n.count(".")):
        if "." in name:
            parent, child = name.rsplit(".", 1)
            if parent in stand_ins:
                setattr(stand_ins[parent], child, stand_ins[name])
    for name, module in stand_ins.items():
        sys.modules.setdefault(name, module)
    # Their top-level packages (configs, models, ...) share names with this repository's
    # configs package: import theirs first on the path, then give ours back.
    ours = {name: sys.modules.pop(name) for name in list(sys.modules)
            if name.split(".")[0] in _THEIR_PACKAGES and name not in stand_ins}
    # Their directories have no __init__.py (namespace packages), and a regular package
    # anywhere on the path wins over them: hide this repository's root while importing,
    # and run their sys.path.append(os.getcwd()) from their checkout.
    saved_path, saved_cwd = list(sys.path), os.getcwd()
    here = {os.path.realpath(p or os.curdir) for p in ("", ROOT)}
    sys.path[:] = [reference_dir] + [p for p in sys.path
                                     if os.path.realpath(p or os.curdir) not in here]
    os.chdir(reference_dir)
    try:
        import importlib
        return importlib.import_module(module_name)
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for name in [n for n in sys.modules if n.split(".")[0] == "configs"]:
            del sys.modules[name]
        # Give back this repository's configs; their modules of this import stay, so a
        # later import never finds an earlier import's (stale) module under a name.
        for name, module in ours.items():
            sys.modules.setdefault(name, module)


_THEIR_PACKAGES = ("configs", "models", "trainers", "dataloaders")


class _Tensorish:
    """What a tf.data element offers their loop: ``.numpy()`` and ``.shape``."""

    def __init__(self, array: np.ndarray):
        self._array = array
        self.shape = array.shape

    def numpy(self) -> np.ndarray:
        return self._array


class BatchedDataset:
    """``tf.data`` stand-in: batches of consecutive examples, ``.shard(n, i)`` as tf.data's
    (every n-th batch from the i-th) -- their EMNIST loader does not shuffle; every pass
    over the test examples of the other models."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int):
        self._batches = [(_Tensorish(x[i: i + batch_size]), _Tensorish(y[i: i + batch_size]))
                         for i in range(0, len(x), batch_size)]

    def shard(self, num_shards: int, index: int) -> list:
        return self._batches[index::num_shards]

    def __iter__(self):
        return iter(self._batches)


@contextlib.contextmanager
def _zero_grad(mode: str):
    """PyTorch 2.x ``zero_grad()`` or the pre-2.0 default ``set_to_none=False``."""
    import torch
    original = torch.optim.Optimizer.zero_grad
    if mode == "zero_grad":
        torch.optim.Optimizer.zero_grad = lambda self, set_to_none=False: original(self, False)
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad = original


class RecordedTorch:
    """Their module's ``torch`` recording what ``max`` is taken over (their scores) and
    what ``argmax`` gives (their datastore's labels)."""

    def __init__(self, torch):
        self._torch, self.max_inputs, self.argmax_results = torch, [], []

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def max(self, tensor, *args, **kwargs):
        self.max_inputs.append(tensor.detach().numpy().copy())
        return self._torch.max(tensor, *args, **kwargs)

    def argmax(self, tensor, *args, **kwargs):
        result = self._torch.argmax(tensor, *args, **kwargs)
        self.argmax_results.append(result.tolist())  # an int for one row's logits
        return result


def their_net(trainer, state: dict[str, np.ndarray], dropout: bool = False,
              float64: bool = False):
    """Their trainer module's ``EMNISTNet`` holding ``state``, its dropout off unless
    ``dropout``; with ``float64`` a float64 net (made so before ``state`` loads, which a
    float32 net would round)."""
    import torch
    net = trainer.EMNISTNet().double() if float64 else trainer.EMNISTNet()
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()},
                        strict=True)
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout) and not dropout:  # off (module docstring)
            module.p = 0.0
    return net


@contextlib.contextmanager
def _replayed_dropout(masks: list[tuple[float, np.ndarray]], padded_rows: int,
                      trained: int | None = None):
    """Their ``F.dropout`` (every ``nn.Dropout`` calls it) multiplies by flowjax's masks
    instead of drawing its own, as PyTorch does with its own (``input * mask / (1 - p)``):
    each call takes the next recorded mask of its keep probability and feature shape
    (NHWC masks as their NCHW). A mask has their batch's rows, or ``padded_rows`` (flowjax's
    padded training batch) for their shorter last batch, which takes its first rows; the
    masks from index ``trained`` on (the test batches' routing, not padded) only their
    batch's. A call with no mask left, a mask of other rows, or a mask never taken fails
    the run."""
    import collections

    import torch
    import torch.nn.functional as F

    queues = collections.defaultdict(collections.deque)
    for index, (keep, mask) in enumerate(masks):
        mask = mask.transpose(0, 3, 1, 2) if mask.ndim == 4 else mask
        padded = padded_rows if trained is None or index < trained else None
        queues[(round(keep, 9), mask.shape[1:])].append((mask, padded))
    original = F.dropout

    def replayed(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        queue = queues[(round(1.0 - p, 9), tuple(input.shape[1:]))]
        if not queue:
            raise AssertionError(f"their code drew a dropout mask (p={p}, input "
                                 f"{tuple(input.shape)}) that flowjax did not")
        mask, padded = queue.popleft()
        rows = input.shape[0]
        if mask.shape[0] != rows and not (padded is not None and mask.shape[0] == padded > rows):
            raise AssertionError(f"flowjax's mask {mask.shape} is neither for their batch "
                                 f"{tuple(input.shape)} nor a padded training batch of "
                                 f"{padded_rows}")
        noise = torch.from_numpy(mask[:input.shape[0]].astype(np.float32)).div_(1.0 - p)
        return input * noise

    F.dropout = replayed
    try:
        yield
    finally:
        F.dropout = original
    left = sum(len(queue) for queue in queues.values())
    if left:
        raise AssertionError(f"{left} of flowjax's dropout masks were never drawn by their code")


def _replay(ours: dict[str, Any], settings: dict, when_off: Callable[[], Any]
            ) -> Callable[[str], Any]:
    """``phase -> context`` for their run: with flowjax's masks recorded, their dropout
    replays those of ``phase`` (``_replayed_dropout``: training batches padded to
    ``settings["batch_size"]``, the evaluation's masks after its personalization's for
    unpadded test batches); without, ``when_off()``."""
    masks = ours.get("dropout_masks")
    if not masks:
        return lambda phase: when_off()
    return lambda phase: _replayed_dropout(
        masks[phase], settings["batch_size"],
        trained=ours["personalization_masks"] if phase == "evaluation" else None)


def _their_evaluation(net, evaluate, layout=None) -> tuple[tuple, np.ndarray, np.ndarray]:
    """Runs their ``*_generalized_test`` (``evaluate(net)``), capturing the logits their
    nets compute in eval mode: ``(figures, snapshot logits, routed logits)``, the snapshot
    from their deep copy's global mode and the routed ones from ``net``'s personalized
    mode; ``layout`` rearranges each captured array."""
    captured = []

    def hook(module, args, kwargs, output):
        if not module.training:
            logits = output[0].detach().numpy()
            captured.append((module, kwargs.get("mode"),
                             (logits if layout is None else layout(logits)).copy()))

    net.register_forward_hook(hook, with_kwargs=True)
    figures = evaluate(net)
    snapshot = np.concatenate([o for m, mode, o in captured if m is not net and mode == "global"])
    personal = np.concatenate([o for m, mode, o in captured
                               if m is net and mode == "personalized"])
    return figures, snapshot, personal


def _their_trainer(reference_dir: str, settings: dict, total_clients: int,
                   total_rounds: int):
    """Their ``trainers.client_flow`` with the module globals their ``__main__`` block
    would set for a ``*_flowv4`` run (one CPU thread)."""
    import torch
    torch.set_num_threads(1)
    trainer = import_their_trainer(reference_dir)
    workdir = tempfile.mkdtemp(prefix="flow_parity_")
    trainer.__dict__.update(lr=settings["learning_rate"], epochs=settings["epochs"],
                            lambda_=settings["gamma"], epsilon=1e-6, DEVICE="cpu",
                            checkpoint_dir=workdir + os.sep, METHOD="FlowV4", num_clients=10,
                            total_clients=total_clients, total_rounds=total_rounds)
    return trainer


def torch_side(reference_dir: str, ours: dict[str, Any], mode: str,
               settings: dict = SETTINGS) -> dict[str, Any]:
    """Their ``emnist_train`` and ``emnist_generalized_test`` from flowjax's initial
    weights (``ours["initial"]``)."""
    initial = ours["initial"]
    trainer = _their_trainer(reference_dir, settings, total_clients=3400, total_rounds=1500)
    data = client_data(**settings)
    train = BatchedDataset(data["train_x"][..., None], data["train_y"], settings["batch_size"])
    test = BatchedDataset(data["test_x"][..., None], data["test_y"], 100)

    masks = ours.get("dropout_masks")
    replay = _replay(ours, settings, contextlib.nullcontext)
    with _zero_grad(mode):
        net = their_net(trainer, initial, dropout=masks is not None)
        with replay("train"):
            trainer.emnist_train(net, train, test)
        updated = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}

        with replay("evaluation"):
            figures, snapshot, personal = _their_evaluation(
                their_net(trainer, initial, dropout=masks is not None),
                lambda net: trainer.emnist_generalized_test(net, train, test))
    return dict(updated=updated, eval_snapshot_logits=snapshot, eval_personal_logits=personal,
                metrics=reported_metrics(figures))


class ScriptedDataset:
    """``tf.data`` stand-in for their reshuffling LSTM loaders: every pass their loop
    asks for (``.shard(2, i)`` or iterating every batch) is the next pass of flowjax's
    plan, which must be of the same kind, so both sides see the same batches."""

    def __init__(self, x: np.ndarray, y: np.ndarray, passes: list):
        self._x, self._y, self._passes = x, y, list(passes)

    def _next(self, kind: str) -> list:
        if not self._passes:
            raise AssertionError(f"their loop asked for a {kind} pass after flowjax's last")
        planned, batches = self._passes.pop(0)
        if planned != kind:
            raise AssertionError(f"their loop asked for a {kind} pass where flowjax's plan "
                                 f"has {planned}")
        return [(_Tensorish(self._x[i]), _Tensorish(self._y[i])) for i in batches]

    def shard(self, num_shards: int, index: int) -> list:
        assert num_shards == 2, num_shards
        return self._next(f"shard{index}")

    def __iter__(self):
        return iter(self._next("all"))

    def exhausted(self) -> bool:
        return not self._passes


@contextlib.contextmanager
def _policy_dropout_off(net_class):
    """Their LSTM policies call ``F.dropout`` (on even in eval mode): the ``F`` of the
    globals their model's code runs with is swapped for one whose dropout is the
    identity, then given back."""
    import torch
    namespace = net_class.forward.__globals__
    functional = namespace["F"]
    namespace["F"] = types.SimpleNamespace(
        relu=torch.nn.functional.relu, dropout=lambda x, p=0.5, training=True, inplace=False: x)
    try:
        yield
    finally:
        namespace["F"] = functional


@contextlib.contextmanager
def _logged_test_without_dropout(trainer, test_name: str, net_class):
    """Their ``*_train`` ends with their ``*_test`` on the test data, for their log only
    (it changes no weight; flowjax's update has no such test): here it runs with their
    policies' dropout off, so it takes none of the masks flowjax drew for the update."""
    test = getattr(trainer, test_name)

    def without_dropout(net, test_data):
        with _policy_dropout_off(net_class):
            return test(net, test_data)

    setattr(trainer, test_name, without_dropout)
    try:
        yield
    finally:
        setattr(trainer, test_name, test)


def _their_lstm_net(net_class, state: dict[str, np.ndarray], settings: dict,
                    float64: bool = False):
    import inspect

    import torch
    if settings["model"] == "shakespeare_lstm":
        net = net_class(settings["embed_dim"], settings["vocab_size"], settings["hidden"])
    else:  # their Flow net also takes the sequence length; their plain net does not
        sizes = dict(vocab_size=settings["vocab_size"], embedding_size=settings["embed_dim"],
                     hidden_size=settings["hidden"], num_layers=1)
        if "sequence_length" in inspect.signature(net_class).parameters:
            sizes["sequence_length"] = settings["sequence_length"]
        net = net_class(**sizes)
    if float64:  # before ``state`` loads, which a float32 net would round
        net = net.double()
    full = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    unknown = set(state) - set(full)
    assert not unknown, unknown
    full.update(state)  # Shakespeare's unused policy path (linear_1*) keeps its own init
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in full.items()}, strict=True)
    return net


def lstm_torch_side(reference_dir: str, ours: dict[str, Any], mode: str,
                    settings: dict) -> dict[str, Any]:
    """Their ``*_train`` and ``*_generalized_test`` from flowjax's initial weights, on
    flowjax's batches (``ours["train_passes"]``, ``["eval_passes"]``)."""
    names = THEIR_LSTM[settings["model"]]
    trainer = _their_trainer(reference_dir, settings, total_clients=names["total_clients"],
                             total_rounds=1500)
    net_class = getattr(trainer, names["net"])
    data = token_client_data(**settings)
    test = BatchedDataset(data["test_x"], data["test_y"], settings["test_batch_size"])

    replay = _replay(ours, settings, lambda: _policy_dropout_off(net_class))
    with _zero_grad(mode):
        train = ScriptedDataset(data["train_x"], data["train_y"], ours["train_passes"])
        net = _their_lstm_net(net_class, ours["torch_state"], settings)
        with replay("train"), _logged_test_without_dropout(trainer, names["test"], net_class):
            getattr(trainer, names["train"])(net, train, test)
        assert train.exhausted(), "their loop left passes of flowjax's plan unread"
        updated = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}

        train = ScriptedDataset(data["train_x"], data["train_y"], ours["eval_passes"])
        evaluate = getattr(trainer, names["evaluate"])
        with replay("evaluation"):
            figures, snapshot, personal = _their_evaluation(  # [B, V, T] -> [B, T, V]
                _their_lstm_net(net_class, ours["torch_state"], settings),
                lambda net: evaluate(net, train, test), layout=lambda a: a.transpose(0, 2, 1))
        assert train.exhausted(), "their evaluation left passes of flowjax's plan unread"
    updated = lstm_effective(updated)
    assert set(ours["updated"]) <= set(updated), set(ours["updated"]) - set(updated)
    return dict(updated={k: updated[k] for k in ours["updated"]},  # both sides' tensors
                eval_snapshot_logits=snapshot, eval_personal_logits=personal,
                metrics=reported_metrics(figures))


def reported_metrics(figures: tuple) -> dict[str, Any]:
    """The figures of their ``*_generalized_test`` that ``generalized_test_metrics``
    recomputes."""
    names = ("before_loss", "before_accuracy", "after_loss", "after_accuracy", "correct",
             "total", "harmed", "w_g_true_w_p_true", "w_g_true_w_p_false", "w_g_false_w_p_true",
             "w_g_false_w_p_false")
    reported = dict(zip(names, figures))
    return {k: reported[k] for k in ("before_accuracy", "after_accuracy", "w_g_true_w_p_true",
                                     "w_g_true_w_p_false", "w_g_false_w_p_true",
                                     "w_g_false_w_p_false")}


# ----------------------------------------------------------------------------- compare


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """``max abs diff`` over every parameter, each evaluation logit and each metric."""
    params = max(float(np.max(np.abs(ours["updated"][k] - theirs["updated"][k])))
                 for k in theirs["updated"])
    moved = max(float(np.max(np.abs(ours["updated"][k] - ours["initial"][k])))
                for k in theirs["updated"])
    return dict(
        params=params, params_moved=moved,
        snapshot_logits=float(np.max(np.abs(ours["eval_snapshot_logits"]
                                            - theirs["eval_snapshot_logits"]))),
        personal_logits=float(np.max(np.abs(ours["eval_personal_logits"]
                                            - theirs["eval_personal_logits"]))),
        metrics=max(abs(float(ours["metrics"][k]) - float(theirs["metrics"][k]))
                    for k in theirs["metrics"]))


def fixture_entry(theirs: dict[str, Any]) -> dict[str, Any]:
    """The PyTorch side's figures, small: per tensor its sum, sum of squares and values
    at ``SAMPLED_VALUES`` evenly spaced flat indices; the evaluation logits and metrics."""
    return dict(tensors={name: _summary(value) for name, value in theirs["updated"].items()},
                eval_snapshot_logits=_summary(theirs["eval_snapshot_logits"], 4),
                eval_personal_logits=_summary(theirs["eval_personal_logits"], 4),
                metrics=theirs["metrics"])


def _summary(value: np.ndarray, scale: int = 1) -> dict[str, Any]:
    """Sum, sum of squares and ``scale * SAMPLED_VALUES`` values at evenly spaced flat
    indices of one array."""
    flat = np.asarray(value).reshape(-1).astype(np.float64)
    picks = np.linspace(0, flat.size - 1, min(scale * SAMPLED_VALUES, flat.size)).astype(int)
    return dict(size=int(flat.size), sum=float(flat.sum()), sum_sq=float(np.sum(flat ** 2)),
                indices=picks.tolist(), values=flat[picks].tolist())


@dataclasses.dataclass(frozen=True)
class Check:
    """One model's parity check: both sides, its settings and its fixture."""

    title: str
    settings: dict
    fixture: str
    flowjax_side: Any
    torch_side: Any
    # Which dropouts a second run turns on, their dropout fed flowjax's masks
    # (``flowjax_side`` takes ``dropout=True``); empty: no such run (CIFAR's network has
    # no dropout).
    dropout: str = ""
    tolerance: float = TOLERANCE


def _lstm_check(title: str, settings: dict, fixture: str) -> Check:
    return Check(title, settings, fixture,
                 lambda mode, dropout=False: lstm_flowjax_side(mode, settings, dropout),
                 lambda reference_dir, ours, mode: lstm_torch_side(reference_dir, ours, mode,
                                                                   settings),
                 dropout="the policies' 0.3, on in evaluation too", tolerance=LSTM_TOLERANCE)


def _cifar_check(settings: dict) -> Check:
    return Check("CIFAR ResNet-18", settings, CIFAR_FIXTURE,
                 lambda mode: resnet_flowjax_side(mode, settings),
                 lambda reference_dir, ours, mode: resnet_torch_side(reference_dir, ours, mode,
                                                                     settings))


CHECKS = {
    "emnist": Check("EMNIST CNN", SETTINGS, FIXTURE, flowjax_side, torch_side,
                    dropout="the CNN's 0.25 and 0.5, the policy exits' 0.3"),
    "cifar": _cifar_check(CIFAR_SETTINGS),
    "shakespeare": _lstm_check("Shakespeare LSTM", SHAKESPEARE_SETTINGS, SHAKESPEARE_FIXTURE),
    "stackoverflow": _lstm_check("Stack Overflow LSTM", STACKOVERFLOW_SETTINGS,
                                 STACKOVERFLOW_FIXTURE),
}


def run_check(check: Check, reference_dir: str, modes: tuple[str, ...], torch_version: str
              ) -> tuple[float, dict[str, Any]]:
    """Prints one model's figures; returns its worst max abs diff and its fixture."""
    fixture = dict(settings=check.settings, torch_version=torch_version,
                   tolerance=check.tolerance, modes={})
    worst = 0.0
    runs = {}
    print(f"{check.title}, one Flow client update + reference evaluation "
          f"(torch {torch_version}, {check.settings.get('dtype', 'float32')}, dropout off on "
          f"both sides{', then on' if check.dropout else ''})")
    for mode in modes:
        ours = check.flowjax_side(mode)
        theirs = check.torch_side(reference_dir, ours, mode)
        worst = max(worst, _print_diffs(mode, ours, theirs))
        fixture["modes"][mode] = fixture_entry(theirs)
        if "train_passes" in ours:  # the batches both sides trained on
            fixture["modes"][mode]["passes"] = _passes_json(ours)
        runs[mode] = ours, theirs
    if len(runs) == 2:  # the comparison can tell the two frozen-group rules apart
        control = compare(runs["set_to_none"][0], runs["zero_grad"][1])
        print(f"  control, flowjax set_to_none vs their set_to_none=False: max abs diff "
              f"{control['params']:.3e} (parameters), {control['personal_logits']:.3e} (logits)")
    if check.dropout:
        print(f"  dropout on on both sides ({check.dropout}), their dropout multiplying by "
              f"the masks flowjax drew")
        fixture["dropout"] = dict(modes={})
        for mode in modes:
            ours = check.flowjax_side(mode, dropout=True)
            theirs = check.torch_side(reference_dir, ours, mode)
            worst = max(worst, _print_diffs(mode, ours, theirs))
            digest = masks_digest(ours["dropout_masks"])
            if fixture["dropout"].setdefault("masks_sha256", digest) != digest:
                raise AssertionError("flowjax drew other dropout masks under another mode")
            fixture["dropout"]["modes"][mode] = fixture_entry(theirs)
            counts = {phase: len(m) for phase, m in ours["dropout_masks"].items()}
            dropped = np.mean([1 - m.mean() for _, m in ours["dropout_masks"]["train"]])
            print(f"    masks drawn and replayed: {counts} (mean share dropped in "
                  f"training {dropped:.3f})")
            if mode in runs:  # dropout moves the figures far beyond the target
                control = compare(runs[mode][0], theirs)
                print(f"    control, flowjax without dropout vs theirs with it: max abs diff "
                      f"{control['params']:.3e} (parameters), {control['personal_logits']:.3e} "
                      f"(routed logits)")
            if mode == modes[0]:
                _misplaced_masks_control(check, reference_dir, ours, mode)
    return worst, fixture


def _one_example_off(masks: dict[str, list], phase: str, start: int, stop: int | None
                     ) -> dict[str, list]:
    """flowjax's masks with those of ``phase`` from ``start`` to ``stop`` (None: the end)
    rolled by one row: what their code would take if its examples and flowjax's were one
    apart."""
    drawn = masks[phase]
    moved = [(keep, np.roll(mask, 1, axis=0)) for keep, mask in drawn[start:stop]]
    return {**masks, phase: drawn[:start] + moved + drawn[start + len(moved):]}


def _misplaced_masks_control(check: Check, reference_dir: str, ours: dict[str, Any],
                             mode: str) -> None:
    """Their run again with the masks of one part one example off (the client update's;
    the evaluation's training's; where the policy's dropout stays on at evaluation, the
    routing of its test batches): the figures must move beyond the check's target, or
    the check could not tell the masks' placement, and this fails."""
    trained = ours["personalization_masks"]
    parts = [("train", 0, None, "client update"),
             ("evaluation", 0, trained, "evaluation's training")]
    if len(ours["dropout_masks"]["evaluation"]) > trained:
        parts.append(("evaluation", trained, None, "evaluation's routing of the test batches"))
    for phase, start, stop, label in parts:
        off = dict(ours, dropout_masks=_one_example_off(ours["dropout_masks"], phase, start,
                                                        stop))
        diffs = compare(ours, check.torch_side(reference_dir, off, mode))
        print(f"    control, their {label} fed flowjax's masks one example off: max abs diff "
              f"{diffs['params']:.3e} (parameters), {diffs['personal_logits']:.3e} (routed "
              f"logits)")
        if worst_diff(diffs) <= check.tolerance:
            raise AssertionError(f"masks one example off in their {label} move their figures "
                                 f"by {worst_diff(diffs):.1e}, within the {check.tolerance:g} "
                                 f"target: the check cannot tell them from the right ones")


def worst_diff(diffs: dict[str, float]) -> float:
    """The largest of ``compare``'s differences (not the parameters' move)."""
    return max(diffs["params"], diffs["snapshot_logits"], diffs["personal_logits"],
               diffs["metrics"])


def _print_diffs(mode: str, ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """Prints one comparison's figures; returns its worst max abs diff."""
    diffs = compare(ours, theirs)
    torch_call = "zero_grad()" if mode == "set_to_none" else "zero_grad(set_to_none=False)"
    print(f"  their optimizer.{torch_call:<30} flowjax frozen_momentum={mode}")
    print(f"    max abs diff, every parameter after the update: {diffs['params']:.3e}"
          f"  (largest move from the init: {diffs['params_moved']:.3e})")
    print(f"    max abs diff, evaluation snapshot (Acc_g) logits: {diffs['snapshot_logits']:.3e}")
    print(f"    max abs diff, evaluation routed (Acc_p) logits:   {diffs['personal_logits']:.3e}")
    print(f"    max abs diff, evaluation metrics:                 {diffs['metrics']:.3e}"
          f"  (theirs: {theirs['metrics']})")
    return worst_diff(diffs)


def passes_json(passes: list[tuple[str, list]]) -> list:
    """``planned_passes``'s passes as JSON lists (the fixtures' ``passes``)."""
    return [[kind, [batch.tolist() for batch in batches]] for kind, batches in passes]


def _passes_json(ours: dict[str, Any]) -> dict[str, list]:
    return {name: passes_json(ours[name]) for name in ("train_passes", "eval_passes")}


def main(argv: list[str] | None = None) -> int:
    from launch import cli
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", required=True,
                        help="checkout of github.com/Astuary/Flow")
    parser.add_argument("--model", choices=tuple(CHECKS) + ("all",), default="all")
    parser.add_argument("--zero_grad", choices=ZERO_GRAD_MODES + ("both",), default="both")
    parser.add_argument("--cifar_dtype", choices=("float32", "float64"), default="float64",
                        help="the CIFAR check's precision on both sides (float32 shows "
                             "why it runs in float64; --write_fixture needs float64)")
    parser.add_argument("--write_fixture", action="store_true",
                        help="write the PyTorch side's figures to tests/fixtures/parity_*.json")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("launch/parity.py needs PyTorch: pip install -e '.[parity]' (torch==2.13.0)",
              file=sys.stderr)
        return 2
    modes = ZERO_GRAD_MODES if args.zero_grad == "both" else (args.zero_grad,)
    if args.write_fixture and args.cifar_dtype != CIFAR_SETTINGS["dtype"]:
        parser.error(f"--cifar_dtype={args.cifar_dtype} with --write_fixture: expected "
                     f"{CIFAR_SETTINGS['dtype']}, the precision the CIFAR fixture is checked in")
    checks = dict(CHECKS, cifar=_cifar_check(dict(CIFAR_SETTINGS, dtype=args.cifar_dtype)))
    names = tuple(CHECKS) if args.model == "all" else (args.model,)
    verdicts = []
    for name in names:
        worst, fixture = run_check(checks[name], args.reference_dir, modes, torch.__version__)
        verdicts.append((checks[name], worst))
        if args.write_fixture:
            from flowjax import run_folder
            # Atomically: a killed run leaves the committed fixture whole.
            run_folder.write_text_atomic(CHECKS[name].fixture, json.dumps(fixture))
            print(f"wrote {os.path.relpath(CHECKS[name].fixture, ROOT)}")
    for check, worst in verdicts:
        verdict = "within" if worst <= check.tolerance else "ABOVE"
        print(f"{check.title}: worst max abs diff {worst:.3e}, {verdict} its "
              f"{check.tolerance:g} target")
    return 0 if all(worst <= check.tolerance for check, worst in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
