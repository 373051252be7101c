r"""Parity of flowjax's fine-tuning evaluations, client snapshot included, with the authors' code.

  pip install -e '.[parity]'                                  # torch==2.13.0, CPU
  git clone https://github.com/Astuary/Flow authors-flow      # their one commit, 0df6b97
  python launch/parity_fine_tuning.py --reference_dir=authors-flow
  python launch/parity_fine_tuning.py --reference_dir=authors-flow --write_fixture

The paper's Acc_g of FedAvgFT, FedRep and LG-FedAvg is the ``before_net`` of the authors'
``emnist_generalized_test``: E epochs of SGD (momentum 0.9) on the client's train split,
a copy taken after the first; its Acc_p is the model after all E. FedAvgFT
(``trainers/client_fedavg_finetuning.py``) trains every layer; FedRep
(``client_fedrep.py``) only the layers named ``linear`` (both dense layers), the rest
frozen; LG-FedAvg (``client_lgfedavg.py``) every layer but those. flowjax computes both
from one run (``flowjax.algorithms.base.train_part_with_snapshot``) with
``client_snapshot=True`` and ``sgd.momentum=0.9``: FedAvgFT as it is, FedRep with
``head_layers=("fc1", "fc2")`` and E head epochs (their evaluation's count; flowjax's
default is E - 1), LG-FedAvg with ``global_layers=("fc1", "fc2")``. Both sides start from
the same weights (flowjax's init of the method, its client state included, converted to
their ``EMNISTNet``, ``models/emnist_cnn.py``; their evaluation would start FedRep's head
and LG-FedAvg's lower layers from a fresh random init, flowjax from the client's stored
ones) and see the same minibatches: each pass their loop asks for is the next epoch of
flowjax's plan for the client's key (a synthetic EMNIST-shaped client,
``launch/parity.py``'s). The script prints the ``max abs diff`` over every parameter
after the E epochs, over the copy's and the final model's logits on the test examples,
and over their reported accuracies and 2x2 counts. Dropout is off on both sides (PyTorch
and JAX draw different masks). Their modules are imported from ``--reference_dir`` as
``launch/parity.py`` imports theirs (no licence: nothing of them is copied here).

HypCluster (``client_hypcluster.py``) fine-tunes both cluster models E epochs on the
same minibatches and copies, after the first epoch, the one whose summed minibatch losses
were lower; its final model is the fine-tuned cluster with the lower last-epoch loss,
which flowjax's HypCluster Acc_p (the chosen cluster, not trained) is not. So only the
copy is compared: flowjax's ``client_snapshot`` from the same two clusters and batches,
its logits and accuracy, and which cluster it is (the other cluster after one epoch
must not match theirs). Its client has 80 train examples, whole minibatches of 20, where
their criterion and flowjax's mean loss over the epoch's examples rank alike.

``flowjax_side_of(method)`` needs no PyTorch: ``tests/test_parity.py`` recomputes it and
compares it with the committed figures of the PyTorch side
(``tests/fixtures/parity_<method>.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np

from launch import parity

ROOT = parity.ROOT

METHODS = ("fedavg_ft", "fedrep", "lg_fedavg", "hypcluster")
THEIR_MODULES = {"fedavg_ft": "trainers.client_fedavg_finetuning",
                 "fedrep": "trainers.client_fedrep", "lg_fedavg": "trainers.client_lgfedavg",
                 "hypcluster": "trainers.client_hypcluster"}
TITLES = {"fedavg_ft": "FedAvgFT (every layer)",
          "fedrep": "FedRep (head fc1, fc2; body frozen)",
          "lg_fedavg": "LG-FedAvg (local conv1, conv2; global fc1, fc2 frozen)"}
FIXTURES = {method: os.path.join(ROOT, "tests", "fixtures", f"parity_{method}.json")
            for method in METHODS}
# Their emnist hyperparameters (configs/hyperparameters.py): E = 3 epochs, batch 20, lr
# 0.01; momentum 0.9 is written in each emnist_generalized_test. 62 classes.
SETTINGS = dict(seed=0, train_examples=90, test_examples=40, epochs=3, batch_size=20,
                learning_rate=0.01, momentum=0.9, num_classes=62)
TOLERANCE = parity.TOLERANCE
# Their linear_1, linear_2: FedRep's head, LG-FedAvg's global layers.
THEIR_LINEAR = ("fc1", "fc2")


def _method(method: str, model, sgd):
    """(algorithm, the client state of a client that has not trained, the key whose
    epochs the fine-tuning runs on given the evaluation's key, and the whole model of
    ``(params, trained part)``: the part is that state at the start, the personalized
    params at the end)."""
    import jax

    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.algorithms.fedrep import FedRepConfig, fedrep
    from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, lg_fedavg

    if method == "fedavg_ft":
        return (fedavg(model, FedAvgConfig(sgd=sgd, finetune=True, client_snapshot=True)),
                lambda params: None, lambda key: key,
                lambda params, part: params if part is None else part)
    if method == "fedrep":  # head-only epochs run on fold_in(key, 0) (fedrep.train_head)
        algorithm = fedrep(model, FedRepConfig(sgd=sgd, head_epochs=sgd.epochs, body_epochs=1,
                                               head_layers=THEIR_LINEAR, client_snapshot=True))
        return (algorithm, lambda params: params["initial_head"],
                lambda key: jax.random.fold_in(key, 0),
                lambda params, part: {**params["body"], **part})
    if method == "lg_fedavg":
        algorithm = lg_fedavg(model, LGFedAvgConfig(sgd=sgd, global_layers=THEIR_LINEAR,
                                                    client_snapshot=True))
        return (algorithm, lambda params: params["initial_local"], lambda key: key,
                lambda params, part: {**part, **params["global"]})
    raise ValueError(f"method={method!r}: expected one of {list(METHODS)}")


def _client(settings: dict) -> tuple[Any, Any, dict, Any, Any]:
    """flowjax's EMNIST CNN with its dropout off (module docstring), the clients' SGD, the
    client's data, its train examples and the evaluation's key."""
    import jax

    from flowjax.algorithms.base import SGDConfig
    from flowjax.models import get_model

    model = parity.without_dropout(get_model("emnist_cnn", num_classes=settings["num_classes"]))
    sgd = SGDConfig(learning_rate=settings["learning_rate"], epochs=settings["epochs"],
                    batch_size=settings["batch_size"], momentum=settings["momentum"])
    data = parity.client_data(**settings)
    train = parity.client_examples(data["train_x"], data["train_y"], settings["batch_size"])
    return model, sgd, data, train, jax.random.key(settings["seed"] + 1)


def _passes(epochs_key, train, settings: dict) -> list:
    """The batches ``run_epochs`` draws for epochs 0 .. E-1 (key ``fold_in(epochs_key,
    e)``), as example indices, in the order their loop asks for them."""
    import jax
    import jax.numpy as jnp

    from flowjax.algorithms.base import valid_examples
    from flowjax.core.local_training import epoch_batches

    member = valid_examples(train)
    plan = jax.vmap(lambda e: epoch_batches(jax.random.fold_in(epochs_key, e), member,
                                            settings["batch_size"], member.shape[0]))(
        jnp.arange(settings["epochs"]))
    return parity.planned_passes({"fine_tuning": plan}, [
        ("fine_tuning", "all", e) for e in range(settings["epochs"])])


def flowjax_side(method: str = "fedavg_ft", settings: dict = SETTINGS) -> dict[str, Any]:
    """Initial weights, the fine-tuned weights, the copy's and the final model's logits
    on the test examples, their metrics and the epochs' batches (example indices), in the
    authors' layouts; no PyTorch needed."""
    import jax
    import jax.numpy as jnp

    model, sgd, data, train, key = _client(settings)
    algorithm, initial_state, epochs_key, whole = _method(method, model, sgd)
    params = algorithm.init(jax.random.key(settings["seed"]))
    state = initial_state(params)
    personal = jax.jit(algorithm.personalize)(params, train, key, state)
    predictions = algorithm.predict(params, personal, jnp.asarray(data["test_x"]))
    snapshot = np.asarray(predictions.global_snapshot)
    fine_tuned = np.asarray(predictions.personal_hard)
    return dict(initial=parity.cnn_to_torch_layout(whole(params, state)),
                updated=parity.cnn_to_torch_layout(whole(params, personal["personal"])),
                eval_snapshot_logits=snapshot, eval_personal_logits=fine_tuned,
                metrics=parity.generalized_test_metrics(snapshot, fine_tuned, data["test_y"]),
                passes=_passes(epochs_key(key), train, settings))


def _their_run(reference_dir: str, method: str, ours: dict[str, Any], initial: list,
               settings: dict) -> tuple[list, tuple, np.ndarray, np.ndarray]:
    """Their ``emnist_generalized_test`` of ``method`` on their ``EMNISTNet``s (62
    classes, no dropout) holding ``initial``, fed flowjax's epochs: the nets, their figures
    and the logits of ``before_net`` and of the final net on the test examples."""
    import torch
    torch.set_num_threads(1)
    trainer = parity.import_their_trainer(reference_dir, THEIR_MODULES[method])
    trainer.__dict__.update(lr=settings["learning_rate"], epochs=settings["epochs"],
                            DEVICE="cpu")
    data = parity.client_data(**settings)
    train = parity.ScriptedDataset(data["train_x"], data["train_y"], ours["passes"])
    test = parity.BatchedDataset(data["test_x"], data["test_y"], 100)
    nets = [parity.their_net(trainer, state) for state in initial]
    captured = []

    def hook(module, args, output):
        if not module.training:  # their test loop: before_net, then net, per batch
            captured.append(output.detach().numpy().copy())

    for net in nets:  # before_net (and HypCluster's net) are deep copies: the hooks come along
        net.register_forward_hook(hook)
    figures = trainer.emnist_generalized_test(*nets, train, test)
    if not train.exhausted():
        raise AssertionError("their loop ran fewer epochs than flowjax's plan")
    return nets, figures, np.concatenate(captured[0::2]), np.concatenate(captured[1::2])


def torch_side(reference_dir: str, ours: dict[str, Any], method: str = "fedavg_ft",
               settings: dict = SETTINGS) -> dict[str, Any]:
    """Their ``emnist_generalized_test`` of ``method`` from flowjax's initial weights, fed
    flowjax's epochs; the fine-tuned weights, the logits of ``before_net`` and of the
    final net, and their reported figures."""
    (net,), figures, before, final = _their_run(reference_dir, method, ours,
                                                [ours["initial"]], settings)
    return dict(updated={k: v.detach().numpy().copy() for k, v in net.state_dict().items()},
                eval_snapshot_logits=before, eval_personal_logits=final,
                metrics=parity.reported_metrics(figures))


# HypCluster: two clusters; 80 train examples, whole batches of 20, where their choice
# (the lower sum of the first epoch's minibatch mean losses) and flowjax's (the lower mean
# over its examples) are the same rule.
HYPCLUSTER_SETTINGS = {**SETTINGS, "train_examples": 80}


def hypcluster_flowjax_side(settings: dict = HYPCLUSTER_SETTINGS) -> dict[str, Any]:
    """Both clusters' initial weights, the copy's logits on the test examples and its
    accuracy, the logits of each cluster after one epoch (FedAvgFT's one-epoch
    fine-tuning from it, the same key), and the E epochs of batches; no PyTorch needed."""
    import jax
    import jax.numpy as jnp

    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.algorithms.hypcluster import HypClusterConfig, hypcluster
    from flowjax.models.base import forward

    model, sgd, data, train, key = _client(settings)
    algorithm = hypcluster(model, HypClusterConfig(sgd=sgd, clusters=2, client_snapshot=True))
    params = algorithm.init(jax.random.key(settings["seed"]))
    test_x = jnp.asarray(data["test_x"])
    personal = jax.jit(algorithm.personalize)(params, train, key)
    snapshot = np.asarray(algorithm.predict(params, personal, test_x).global_snapshot)
    one_epoch = fedavg(model, FedAvgConfig(sgd=dataclasses.replace(sgd, epochs=1),
                                           finetune=True))
    clusters = [np.asarray(forward(model, jax.jit(one_epoch.personalize)(
        params[name], train, key), test_x)) for name in ("cluster0", "cluster1")]
    return dict(initial=[parity.cnn_to_torch_layout(params[name])
                         for name in ("cluster0", "cluster1")],
                eval_snapshot_logits=snapshot, cluster_logits=clusters,
                metrics={"before_accuracy": float(np.mean(
                    snapshot.argmax(-1) == data["test_y"]))},
                passes=_passes(key, train, settings))


def hypcluster_torch_side(reference_dir: str, ours: dict[str, Any],
                          settings: dict = HYPCLUSTER_SETTINGS) -> dict[str, Any]:
    """Their HypCluster ``emnist_generalized_test`` (``client_hypcluster.py``) from
    flowjax's two clusters, fed flowjax's epochs: ``before_net``'s logits, the final
    net's, and their before accuracy (their other figures score their fine-tuned final
    model, which flowjax's HypCluster does not build)."""
    _, figures, before, final = _their_run(reference_dir, "hypcluster", ours, ours["initial"],
                                           settings)
    return dict(updated={}, eval_snapshot_logits=before, eval_personal_logits=final,
                metrics={"before_accuracy": parity.reported_metrics(figures)["before_accuracy"]})


def settings_of(method: str) -> dict:
    """The client and hyperparameters of ``method``'s check."""
    return HYPCLUSTER_SETTINGS if method == "hypcluster" else SETTINGS


def flowjax_side_of(method: str) -> dict[str, Any]:
    """flowjax's side of ``method``'s check (no PyTorch needed)."""
    return hypcluster_flowjax_side() if method == "hypcluster" else flowjax_side(method)


def _write_fixture(method: str, settings: dict, ours: dict[str, Any], theirs: dict[str, Any],
                   torch_version: str) -> None:
    """``tests/fixtures/parity_<method>.json``: the PyTorch side's figures, written whole
    or not at all (a kill leaves the old one)."""
    from flowjax import run_folder
    fixture = dict(settings=settings, torch_version=torch_version, tolerance=TOLERANCE,
                   passes=parity.passes_json(ours["passes"]), **parity.fixture_entry(theirs))
    run_folder.write_text_atomic(FIXTURES[method], json.dumps(fixture))
    print(f"wrote {os.path.relpath(FIXTURES[method], ROOT)}")


def _verdict(method: str, worst: float, ok: bool) -> bool:
    print(f"{method}: worst max abs diff {worst:.3e}, {'within' if ok else 'ABOVE'} its "
          f"{TOLERANCE:g} target")
    return ok


def hypcluster_check(reference_dir: str, write_fixture: bool, torch_version: str) -> bool:
    """Both sides of HypCluster's copy; within ``TOLERANCE``, and the copy of the other
    cluster and their final model both far from it."""
    ours = flowjax_side_of("hypcluster")
    theirs = hypcluster_torch_side(reference_dir, ours)
    gap = lambda a: float(np.max(np.abs(a - theirs["eval_snapshot_logits"])))
    diff, to_clusters = gap(ours["eval_snapshot_logits"]), [gap(c) for c in ours["cluster_logits"]]
    final = float(np.max(np.abs(ours["eval_snapshot_logits"] - theirs["eval_personal_logits"])))
    print(f"HypCluster (2 clusters, the lower first-epoch loss) evaluation copy, E = "
          f"{SETTINGS['epochs']} epochs of SGD (momentum {SETTINGS['momentum']}) on both "
          f"clusters (torch {torch_version}, float32, dropout off on both sides)")
    print(f"  max abs diff, client snapshot (Acc_g) logits:   {diff:.3e}")
    print(f"  their before_net vs each flowjax cluster after one epoch: "
          f"{to_clusters[0]:.3e}, {to_clusters[1]:.3e}")
    print(f"  before accuracy: theirs {theirs['metrics']['before_accuracy']}, "
          f"flowjax's {ours['metrics']['before_accuracy']}")
    print(f"  control, flowjax's copy vs their final model: max abs diff {final:.3e} (logits)")
    if write_fixture:
        _write_fixture("hypcluster", settings_of("hypcluster"), ours, theirs, torch_version)
    return _verdict("hypcluster", diff, diff <= TOLERANCE and theirs["metrics"] == ours["metrics"]
                    and max(to_clusters) > 100 * TOLERANCE and final > 100 * TOLERANCE)


def check(method: str, reference_dir: str, write_fixture: bool, torch_version: str) -> bool:
    """Runs both sides of ``method``, prints the differences (and writes its fixture);
    whether they are within ``TOLERANCE`` and the control tells copy from final model."""
    if method == "hypcluster":
        return hypcluster_check(reference_dir, write_fixture, torch_version)
    ours = flowjax_side(method)
    theirs = torch_side(reference_dir, ours, method)
    diffs = parity.compare(ours, theirs)
    print(f"{TITLES[method]} evaluation, E = {SETTINGS['epochs']} epochs of SGD (momentum "
          f"{SETTINGS['momentum']}) with the copy after the first (torch {torch_version}, "
          "float32, dropout off on both sides)")
    print(f"  max abs diff, every parameter after the E epochs: {diffs['params']:.3e}"
          f"  (largest move from the init: {diffs['params_moved']:.3e})")
    print(f"  max abs diff, client snapshot (Acc_g) logits:   {diffs['snapshot_logits']:.3e}")
    print(f"  max abs diff, fine-tuned (Acc_p) logits:        {diffs['personal_logits']:.3e}")
    print(f"  max abs diff, evaluation metrics:               {diffs['metrics']:.3e}"
          f"  (theirs: {theirs['metrics']})")
    # The check can tell the copy from the final model: their final logits are far from
    # flowjax's copy's.
    control = float(np.max(np.abs(ours["eval_snapshot_logits"]
                                  - theirs["eval_personal_logits"])))
    print(f"  control, flowjax's copy vs their final model: max abs diff {control:.3e} (logits)")
    worst = parity.worst_diff(diffs)
    if write_fixture:
        _write_fixture(method, settings_of(method), ours, theirs, torch_version)
    return _verdict(method, worst, worst <= TOLERANCE and control > 100 * TOLERANCE)


def main(argv: list[str] | None = None) -> int:
    from launch import cli
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", required=True,
                        help="checkout of github.com/Astuary/Flow")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {','.join(METHODS)}")
    parser.add_argument("--write_fixture", action="store_true",
                        help="write the PyTorch side's figures to "
                             "tests/fixtures/parity_<method>.json")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"--methods={args.methods!r}: expected a comma-separated subset of "
                     f"{','.join(METHODS)}")
    try:
        import torch
    except ImportError:
        print("launch/parity_fine_tuning.py needs PyTorch: pip install -e '.[parity]' "
              "(torch==2.13.0)", file=sys.stderr)
        return 2
    results = [check(method, args.reference_dir, args.write_fixture, torch.__version__)
               for method in methods]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
