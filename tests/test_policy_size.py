"""launch/policy_size.py: Flow's policy beside w_g, as the paper's Appendix C gives it."""

import pytest

from launch import policy_size


@pytest.fixture(scope="module")
def sizes():
    return {(dataset, whose): size for dataset, whose, size in policy_size.rows()}


def test_reference_mode_policies_are_the_sizes_the_paper_reports(sizes):
    """The authors' EMNIST policy (350-150-50-2, exits on the first three) is the paper's
    27.86% of w_g to the digit, and their Stack Overflow policy is the 0.891M its storage
    table adds to Flow (145.651M - 144.76M); reference mode builds both."""
    emnist = sizes[("emnist", "flowjax semantics=reference")]
    assert (emnist.policy, emnist.global_model) == (336_158, 1_206_590)
    assert round(emnist.percent, 2) == sizes[("emnist", "paper (Appendix C)")] == 27.86
    assert sizes[("stackoverflow", "flowjax semantics=reference")].policy == 891_151
    assert round(sizes[("stackoverflow", "flowjax semantics=reference")].policy / 1e6, 3) == (
        round(145.651 - 144.76, 3))


def test_paper_mode_policies_are_the_projects_layout(sizes):
    """Paper mode's policies: an exit after every base layer (350-150-50-50 on EMNIST) and
    the LSTMs' 64-64-32-16 over token features, far smaller than the authors' LSTM
    policies, which read the cells' states (README, Flow as implemented)."""
    counts = {dataset: sizes[(dataset, "flowjax semantics=paper")].policy
              for dataset in ("emnist", "cifar", "shakespeare", "stackoverflow")}
    assert counts == {"emnist": 338_708, "cifar": 4_154_062, "shakespeare": 8_936,
                      "stackoverflow": 88_248}
    for dataset in ("shakespeare", "stackoverflow"):
        assert counts[dataset] < sizes[(dataset, "flowjax semantics=reference")].policy / 10


def test_the_command_prints_every_row(capsys):
    policy_size.main([])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 4 * 3
    assert lines[2].split() == ["emnist", "flowjax", "semantics=reference", "336,158",
                                "1,206,590", "27.86%"]


def test_a_folder_that_is_not_their_checkout_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^--reference_dir='.*': expected a checkout of "
                       r"github.com/Astuary/Flow \(models/emnist_cnn_dynamic_v4.py not found\)$"):
        policy_size.main([f"--reference_dir={tmp_path}"])
    assert capsys.readouterr().out == ""  # refused before any row
