r"""What the authors' text kNN-Per evaluation adds to a prediction, run on their own code.

  pip install -e '.[parity]'                                  # torch==2.13.0, CPU
  git clone https://github.com/Astuary/Flow authors-flow      # their one commit
  python launch/their_text_knn.py --reference_dir=authors-flow

Their ``shakespeare_generalized_test`` and ``stackoverflow_nwp_generalized_test``
(``trainers/client_knnper.py``) key a whole sequence (every position's LSTM output,
flattened) and store per train sequence ``argmax(logits[i], dim=1)``, which on their
``[vocabulary, positions]`` logits is, for each token, the position where it scores
highest. Their vote on a test sequence then goes, for each neighbour, to every class at
those positions (Shakespeare: ``knn_logits[0, j, positions]`` for every ``j``) or to
token ``t`` at position ``t`` (Stack Overflow: ``knn_logits[0, positions, positions]``).
flowjax does not reproduce these (``methods.knn_per.reference_acc_p`` is refused for the
LSTMs). This script runs both functions on their memoization networks (small widths,
PyTorch's seeded init) with synthetic token clients whose test sequences are copies of
train sequences, so each test sequence's nearest entry is at distance 0 and its vote is
as large as it gets, reads their scores where their code takes the argmax
(``torch.max``), and prints where the vote landed and how many predictions it changed.
Their modules are imported from ``--reference_dir`` (no licence: nothing is copied).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from launch import parity

# (their function, their network's class and arguments, their k and lambda
# (configs/hyperparameters.py: shakespeare_knnper, stackoverflow_nwp_knnper), vocabulary,
# sequence length). Widths are small: the indexing, not the model, is what is shown.
CASES = {
    "shakespeare": ("shakespeare_generalized_test", "ShakespeareNet",
                    dict(embedding_dim=8, vocab_size=90, hidden_size=32), 3, 0.5, 90, 80),
    "stackoverflow": ("stackoverflow_nwp_generalized_test", "StackoverflowNWPNet",
                      dict(vocab_size=60, embedding_size=8, hidden_size=16, num_layers=1),
                      5, 0.5, 60, 20),
}
TRAIN, TEST, BATCH = 12, 6, 4


def their_run(reference_dir: str, name: str) -> dict[str, Any]:
    """Their text kNN-Per evaluation of case ``name``: the net's logits and their scores
    per test sequence (``[N, vocabulary, positions]``), the labels and their figures."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    function, net_class, arguments, neighbours, lam, vocabulary, length = CASES[name]
    trainer = parity.import_their_trainer(reference_dir, "trainers.client_knnper")
    recorded = parity.RecordedTorch(torch)
    trainer.__dict__.update(knn_neighbors_count=neighbours, lambda_=lam,
                            vocab_size=vocabulary, DEVICE="cpu", torch=recorded)
    data = parity.token_client_data(seed=0, train_examples=TRAIN, test_examples=0,
                                    vocab_size=vocabulary, sequence_length=length)
    test_x, test_y = data["train_x"][:TEST], data["train_y"][:TEST]  # copies: d = 0
    net = getattr(trainer, net_class)(*arguments.values())
    figures = getattr(trainer, function)(
        net, parity.BatchedDataset(data["train_x"], data["train_y"], BATCH),
        parity.BatchedDataset(test_x, test_y, 1))
    return dict(logits=np.concatenate(recorded.max_inputs[0::2]).astype(np.float64),
                scores=np.concatenate(recorded.max_inputs[1::2]).astype(np.float64),
                labels=test_y, lam=lam, figures=parity.reported_metrics(figures))


def describe(name: str, run: dict[str, Any]) -> dict[str, Any]:
    """Where the vote ``scores - (1 - lambda) logits`` landed, and what it changed."""
    votes = run["scores"] - (1 - run["lam"]) * run["logits"]  # [N, classes, positions]
    real = run["labels"] != 0  # their accuracy counts non-pad positions
    spread = votes.max(axis=1) - votes.min(axis=1)  # per sequence and position
    voted = np.argwhere(np.abs(votes) > 1e-6)  # (sequence, class, position)
    changed = (run["scores"].argmax(1) != run["logits"].argmax(1)) & real
    return dict(largest=float(votes.max()), spread=float(spread.max()),
                on_diagonal=bool(np.all(voted[:, 1] == voted[:, 2])), voted=len(voted),
                classes=sorted({int(c) for c in voted[:, 1]}), changed=int(changed.sum()),
                positions=int(real.sum()), figures=run.get("figures"))


def main(argv: list[str] | None = None) -> int:
    from launch import cli
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", required=True,
                        help="checkout of github.com/Astuary/Flow")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("launch/their_text_knn.py needs PyTorch: pip install -e '.[parity]' "
              "(torch==2.13.0)", file=sys.stderr)
        return 2
    for name in CASES:
        found = describe(name, their_run(args.reference_dir, name))
        figures = found["figures"]
        print(f"{name} ({CASES[name][0]}, k = {CASES[name][3]}, lambda = {CASES[name][4]}, "
              f"torch {torch.__version__}): test sequences are train sequences")
        print(f"  largest vote: {found['largest']:.3f}; its largest spread across the classes "
              f"of one position: {found['spread']:.1e}")
        classes = found["classes"]
        print(f"  votes above 1e-6: {found['voted']}, on {len(classes)} of "
              f"{CASES[name][5]} classes (ids {classes[0]} to {classes[-1]}); only at class "
              f"id = position index: {'yes' if found['on_diagonal'] else 'no'}")
        print(f"  predictions the vote changed: {found['changed']} of {found['positions']} "
              f"non-pad positions; their accuracy before {figures['before_accuracy']:.4f}, "
              f"after {figures['after_accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
