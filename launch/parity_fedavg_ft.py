r"""Parity of flowjax's FedAvgFT evaluation, client snapshot included, with the authors' code.

  pip install -e '.[parity]'                                  # torch==2.13.0, CPU
  git clone https://github.com/Astuary/Flow authors-flow      # their one commit, 0df6b97
  python launch/parity_fedavg_ft.py --reference_dir=authors-flow
  python launch/parity_fedavg_ft.py --reference_dir=authors-flow --write_fixture

The paper's FedAvgFT Acc_g is the ``before_net`` of the authors' ``emnist_generalized_test``
(``trainers/client_fedavg_finetuning.py``): E epochs of SGD (momentum 0.9) on the client's
train split, a copy taken after the first; its Acc_p is the model after all E.
flowjax's FedAvgFT with ``client_snapshot=True`` and ``sgd.momentum=0.9`` computes both
from one fine-tuning run (``flowjax.algorithms.base.train_part_with_snapshot``). Both
sides start from the same weights (flowjax's ``emnist_cnn`` init, converted to their
``EMNISTNet``, ``models/emnist_cnn.py``) and see the same minibatches: each pass their loop
asks for is the next epoch of flowjax's plan for the client's key (a synthetic EMNIST-shaped
client, ``launch/parity.py``'s). The script prints the ``max abs diff`` over every parameter
after the E epochs, over the copy's and the final model's logits on the test examples,
and over their reported accuracies and 2x2 counts. Dropout is off on both sides (PyTorch
and JAX draw different masks). Their module is imported from ``--reference_dir`` as
``launch/parity.py`` imports theirs (no licence: nothing of it is copied here).

``flowjax_side`` needs no PyTorch: ``tests/test_parity.py`` recomputes it and compares it
with the committed figures of the PyTorch side (``tests/fixtures/parity_fedavg_ft.json``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from launch import parity

ROOT = parity.ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "parity_fedavg_ft.json")
# Their emnist_fedavgft hyperparameters (configs/hyperparameters.py): E = 3 epochs, batch
# 20, lr 0.01; momentum 0.9 is written in their emnist_generalized_test. 62 classes.
SETTINGS = dict(seed=0, train_examples=90, test_examples=40, epochs=3, batch_size=20,
                learning_rate=0.01, momentum=0.9, num_classes=62)
TOLERANCE = parity.TOLERANCE


def flowjax_side(settings: dict = SETTINGS) -> dict[str, Any]:
    """Initial weights, the fine-tuned weights, the copy's and the final model's logits
    on the test examples, their metrics and the epochs' batches (example indices), in the
    authors' layouts; no PyTorch needed."""
    import jax
    import jax.numpy as jnp

    from flowjax.algorithms.base import SGDConfig, valid_examples
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.core.local_training import epoch_batches
    from flowjax.models import get_model

    # Dropout off (module docstring).
    model = parity.without_dropout(get_model("emnist_cnn", num_classes=settings["num_classes"]))
    sgd = SGDConfig(learning_rate=settings["learning_rate"], epochs=settings["epochs"],
                    batch_size=settings["batch_size"], momentum=settings["momentum"])
    algorithm = fedavg(model, FedAvgConfig(sgd=sgd, finetune=True, client_snapshot=True))
    data = parity.client_data(**settings)
    params = algorithm.init(jax.random.key(settings["seed"]))
    train = parity.client_examples(data["train_x"], data["train_y"], settings["batch_size"])
    key = jax.random.key(settings["seed"] + 1)
    personal = jax.jit(algorithm.personalize)(params, train, key)
    predictions = algorithm.predict(params, personal, jnp.asarray(data["test_x"]))
    snapshot = np.asarray(predictions.global_snapshot)
    fine_tuned = np.asarray(predictions.personal_hard)
    # The batches run_epochs draws for epoch e (key fold_in(key, e)), as example indices.
    member = valid_examples(train)
    epochs = range(settings["epochs"])
    plan = jax.vmap(lambda e: epoch_batches(jax.random.fold_in(key, e), member,
                                            settings["batch_size"], member.shape[0]))(
        jnp.arange(settings["epochs"]))
    passes = parity.planned_passes({"fine_tuning": plan},
                                   [("fine_tuning", "all", e) for e in epochs])
    return dict(initial=parity.cnn_to_torch_layout(params),
                updated=parity.cnn_to_torch_layout(personal["personal"]),
                eval_snapshot_logits=snapshot, eval_personal_logits=fine_tuned,
                metrics=parity.generalized_test_metrics(snapshot, fine_tuned, data["test_y"]),
                passes=passes)


def torch_side(reference_dir: str, ours: dict[str, Any],
               settings: dict = SETTINGS) -> dict[str, Any]:
    """Their ``emnist_generalized_test`` from flowjax's initial weights, fed flowjax's
    epochs; the fine-tuned weights, the logits of ``before_net`` and of the final net,
    and their reported figures."""
    import torch
    torch.set_num_threads(1)
    trainer = parity.import_their_trainer(reference_dir, "trainers.client_fedavg_finetuning")
    trainer.__dict__.update(lr=settings["learning_rate"], epochs=settings["epochs"],
                            DEVICE="cpu")
    data = parity.client_data(**settings)
    train = parity.ScriptedDataset(data["train_x"], data["train_y"], ours["passes"])
    test = parity.BatchedDataset(data["test_x"], data["test_y"], 100)
    net = parity.their_net(trainer, ours["initial"])  # their 62-class EMNISTNet, no dropout
    captured = []

    def hook(module, args, output):
        if not module.training:  # their test loop; deepcopy carries the hook to before_net
            captured.append((module is net, output.detach().numpy().copy()))

    net.register_forward_hook(hook)
    figures = trainer.emnist_generalized_test(net, train, test)
    if not train.exhausted():
        raise AssertionError("their loop ran fewer epochs than flowjax's plan")
    return dict(updated={k: v.detach().numpy().copy() for k, v in net.state_dict().items()},
                eval_snapshot_logits=np.concatenate([o for final, o in captured if not final]),
                eval_personal_logits=np.concatenate([o for final, o in captured if final]),
                metrics=parity.reported_metrics(figures))


def main(argv: list[str] | None = None) -> int:
    from launch import cli
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", required=True,
                        help="checkout of github.com/Astuary/Flow")
    parser.add_argument("--write_fixture", action="store_true",
                        help="write the PyTorch side's figures to "
                             "tests/fixtures/parity_fedavg_ft.json")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("launch/parity_fedavg_ft.py needs PyTorch: pip install -e '.[parity]' "
              "(torch==2.13.0)", file=sys.stderr)
        return 2
    ours = flowjax_side()
    theirs = torch_side(args.reference_dir, ours)
    diffs = parity.compare(ours, theirs)
    print(f"FedAvgFT evaluation, E = {SETTINGS['epochs']} epochs of SGD (momentum "
          f"{SETTINGS['momentum']}) with the copy after the first (torch {torch.__version__}, "
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
    if args.write_fixture:
        from flowjax import run_folder
        fixture = dict(settings=SETTINGS, torch_version=torch.__version__, tolerance=TOLERANCE,
                       passes=parity.passes_json(ours["passes"]),
                       **parity.fixture_entry(theirs))
        run_folder.write_text_atomic(FIXTURE, json.dumps(fixture))  # a kill leaves it whole
        print(f"wrote {os.path.relpath(FIXTURE, ROOT)}")
    ok = worst <= TOLERANCE and control > 100 * TOLERANCE
    print(f"FedAvgFT: worst max abs diff {worst:.3e}, {'within' if ok else 'ABOVE'} its "
          f"{TOLERANCE:g} target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
