"""launch/plot.py and flowjax.paper.plot_data on hand-written run folders with known numbers."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from flowjax.paper import plot_data, plot_draw  # noqa: E402
from flowjax.evaluation.metrics import GROUPS, Q0_BINS  # noqa: E402
from tests import forkserver  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LAYERS = 3


def histogram(bins_by_layer):
    """``[LAYERS][Q0_BINS]`` counts: layer j holds ``bins_by_layer[j]`` = {bin: count}."""
    counts = np.zeros((LAYERS, Q0_BINS))
    for layer, bins in enumerate(bins_by_layer):
        for b, count in bins.items():
            counts[layer, b] = count
    return counts.tolist()


def summary(breakdown, q0_histogram=None):
    """A ``populations.<pop>`` entry of results.json (the fields the plots read, plus a
    few others as the real file has them)."""
    routed = q0_histogram is not None
    q0_histogram = q0_histogram or {g: [] for g in GROUPS}
    q0_by_group = {}
    for group in GROUPS:
        counts = np.asarray(q0_histogram[group], dtype=float)
        centres = (np.arange(Q0_BINS) + 0.5) / Q0_BINS
        q0_by_group[group] = ([None if c.sum() == 0 else float(c @ centres / c.sum())
                               for c in counts] if routed else [])
    return {"num_clients": 4, "acc_g": 0.5, "acc_p": 0.6, "breakdown": breakdown,
            "q0_by_group": q0_by_group, "q0_histogram": q0_histogram}


def write_run(folder, *, dataset, algorithm, seed, evals, breakdown=None, q0=None,
              held_out=False):
    """A run folder in the on-disk format; no ``breakdown`` = unfinished (no results.json)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump({"dataset": dataset, "algorithm": algorithm, "seed": seed}, handle)
    populations = ["train_clients"] + (["held_out_clients"] if held_out else [])
    lines = []
    for round_, (acc_g, acc_p) in sorted(evals.items()):
        lines.append({"round": round_, "kind": "train", "loss": 1.0 / round_})
        for population in populations:
            lines.append({"round": round_, "kind": "eval", "population": population,
                          "acc_g": acc_g, "acc_p": acc_p, "breakdown": {g: 0.25 for g in GROUPS}})
    with open(os.path.join(folder, "metrics.jsonl"), "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    if breakdown is not None:
        results = {"dataset": dataset, "algorithm": algorithm, "breakdown": breakdown,
                   "populations": {p: summary(breakdown, q0) for p in populations}}
        with open(os.path.join(folder, "results.json"), "w") as handle:
            json.dump(results, handle)


BREAKDOWN_A = {"both_correct": 0.4, "global_only": 0.1, "personalized_only": 0.2, "neither": 0.3}
BREAKDOWN_B = {"both_correct": 0.6, "global_only": 0.1, "personalized_only": 0.0, "neither": 0.3}
# Layer 1 all in bin 0, layer 2 all in the last bin, layer 3 uniform; global_only empty.
Q0 = {"both_correct": histogram([{0: 5}, {Q0_BINS - 1: 5}, dict.fromkeys(range(Q0_BINS), 1)]),
      "global_only": histogram([{}, {}, {}]),
      "personalized_only": histogram([{3: 2}, {3: 2}, {}]),
      "neither": histogram([{1: 1}, {2: 1}, {3: 1}])}


def plot(workdir, *flags):
    return forkserver.run([sys.executable, os.path.join(ROOT, "launch", "plot.py"),
                           f"--workdir={workdir}", *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def titles(figure):
    return [ax.get_title() for ax in figure.axes]


# ---------------------------------------------------------------- box statistics


def test_quantiles_of_one_filled_bin_interpolate_within_it():
    counts = np.zeros(Q0_BINS)
    counts[4] = 7.0
    width = 1.0 / Q0_BINS
    stats = plot_data.histogram_box_stats(counts)
    for key, p in zip(("whislo", "q1", "med", "q3", "whishi"), (0.05, 0.25, 0.5, 0.75, 0.95)):
        assert stats[key] == pytest.approx((4 + p) * width)
    assert stats["mean"] == pytest.approx(4.5 * width)  # the bin centre
    assert stats["fliers"] == []


def test_quantiles_of_uniform_mass_are_the_percentiles():
    stats = plot_data.histogram_box_stats(np.full(Q0_BINS, 3.0), mean=0.42, label="2")
    assert (stats["whislo"], stats["q1"], stats["med"], stats["q3"], stats["whishi"]) == \
        pytest.approx((0.05, 0.25, 0.5, 0.75, 0.95))
    assert stats["mean"] == 0.42 and stats["label"] == "2"  # the exact mean wins


def test_quantiles_skip_empty_bins_and_reject_an_empty_histogram():
    counts = np.zeros(10)
    counts[[2, 7]] = 1.0
    assert plot_data.histogram_quantile(counts, 0.0) == pytest.approx(0.2)
    assert plot_data.histogram_quantile(counts, 0.25) == pytest.approx(0.25)
    assert plot_data.histogram_quantile(counts, 0.75) == pytest.approx(0.75)
    assert plot_data.histogram_quantile(counts, 1.0) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="empty histogram"):
        plot_data.histogram_quantile(np.zeros(10), 0.5)


def test_seed_band_averages_the_seeds_that_evaluated_each_round():
    band = plot_data.seed_band([{1: 0.2, 2: 0.4}, {1: 0.4, 2: 0.8}, {1: 0.6}])
    assert band.rounds.tolist() == [1, 2]
    np.testing.assert_allclose(band.mean, [0.4, 0.6])
    # Sample std (ddof=1), the statistic of the reproduce tables.
    np.testing.assert_allclose(band.std, [0.2, np.sqrt(0.08)])
    assert band.seeds.tolist() == [3, 2]


# ---------------------------------------------------------------- layouts


def test_single_run_dir(tmp_path):
    write_run(tmp_path, dataset="toy", algorithm="flow", seed=0,
              evals={2: (0.1, 0.2), 4: (0.3, 0.5)}, breakdown=BREAKDOWN_A, q0=Q0)
    runs = plot_data.load_runs(str(tmp_path))
    assert [(r.method, r.seed, r.dataset) for r in runs] == [("flow", 0, "toy")]
    figures = plot_draw.workdir_figures(runs)
    assert sorted(figures) == ["breakdown_toy.png", "learning_curves_toy.png",
                               "routing_q0_toy_flow.png"]
    curves = figures["learning_curves_toy.png"]
    assert titles(curves) == ["Acc_g (train_clients)", "Acc_p (train_clients)"]
    (line,) = curves.axes[1].lines
    assert line.get_xdata().tolist() == [2, 4]
    np.testing.assert_allclose(line.get_ydata(), [20.0, 50.0])  # percent

    routing = figures["routing_q0_toy_flow.png"]
    assert titles(routing) == [f"{g} (train_clients)" for g in GROUPS]
    boxes = [len(ax.patches) for ax in routing.axes]  # one box patch per layer with mass
    assert boxes == [LAYERS, 0, 2, LAYERS]
    empty = routing.axes[GROUPS.index("global_only")]
    assert [t.get_text() for t in empty.texts] == ["no instances in this group"]
    # bxp draws a median line per box; layer 1 of both_correct sits in bin 0.
    medians = [l.get_ydata()[0] for l in routing.axes[0].lines
               if len(l.get_xdata()) == 2 and l.get_ydata()[0] == l.get_ydata()[1]]
    assert pytest.approx(0.5 / Q0_BINS) in medians
    assert pytest.approx(0.5) in medians  # the uniform layer


def test_the_one_client_figure_draws_the_client_with_the_largest_loss_gap(tmp_path):
    """Appendix E's figure: over the seeds, the evaluated client whose personalized model
    lowers its test loss most, drawn from that client's histograms alone."""
    for seed, (client, loss_g, loss_p, q0) in enumerate([
            ("c7", 2.0, 1.5, Q0),  # gap 0.5
            ("c3", 3.0, 1.0, {**Q0, "both_correct": histogram([{9: 4}, {9: 4}, {9: 4}])})]):
        folder = tmp_path / "toy" / "flow" / f"seed_{seed}"
        write_run(folder, dataset="toy", algorithm="flow", seed=seed,
                  evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A, q0=Q0)
        results = json.loads((folder / "results.json").read_text())
        own = summary(BREAKDOWN_A, q0)
        results["populations"]["train_clients"]["routing_client"] = {
            "client_id": client, "loss_g": loss_g, "loss_p": loss_p, "instances": 20.0,
            "groups": {}, "q0_by_group": own["q0_by_group"], "q0_histogram": q0}
        (folder / "results.json").write_text(json.dumps(results))
    figures = plot_draw.workdir_figures(plot_data.load_runs(str(tmp_path)))
    assert sorted(figures) == ["breakdown_toy.png", "learning_curves_toy.png",
                               "routing_q0_one_client_toy_flow.png", "routing_q0_toy_flow.png"]
    one = figures["routing_q0_one_client_toy_flow.png"]
    assert one.texts[0].get_text().endswith(
        "(train_clients: client c3, seed 1, test loss 3 global vs 1 personalized)")
    # Seed 1's client alone: both_correct all in bin 9 of every layer, so every level
    # line (caps at the 5th / 95th percentile, median) lies within that bin.
    levels = [l.get_ydata()[0] for l in one.axes[0].lines
              if len(l.get_xdata()) == 2 and l.get_ydata()[0] == l.get_ydata()[1]]
    assert sorted(levels) == pytest.approx(
        [(9 + p) / Q0_BINS for p in (0.05, 0.5, 0.95) for _ in range(LAYERS)])


def test_compare_dir_draws_every_method_and_routes_only_flow(tmp_path):
    write_run(tmp_path / "flow", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2), 2: (0.3, 0.4)}, breakdown=BREAKDOWN_A, q0=Q0, held_out=True)
    write_run(tmp_path / "fedavg", dataset="toy", algorithm="fedavg", seed=0,
              evals={1: (0.2, 0.2), 2: (0.3, 0.3)}, breakdown=BREAKDOWN_B, held_out=True)
    figures = plot_draw.workdir_figures(plot_data.load_runs(str(tmp_path)))
    assert sorted(figures) == ["breakdown_toy.png", "learning_curves_toy.png",
                               "routing_q0_toy_flow.png"]
    curves = figures["learning_curves_toy.png"]
    assert titles(curves) == ["Acc_g (train_clients)", "Acc_p (train_clients)",
                              "Acc_g (held_out_clients)", "Acc_p (held_out_clients)"]
    assert all(sorted(l.get_label() for l in ax.lines) == ["fedavg", "flow"]
               for ax in curves.axes)

    bars = figures["breakdown_toy.png"]
    assert titles(bars) == ["instance breakdown (train_clients)",
                            "instance breakdown (held_out_clients)"]
    ax = bars.axes[0]
    assert len(ax.patches) == 2 * len(GROUPS)  # 2 methods x 4 stacked segments
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fedavg", "flow"]
    heights = {(round(p.get_x() + p.get_width() / 2), round(p.get_y(), 6)): p.get_height()
               for p in ax.patches}
    # flow (x=1): both_correct 40% at the bottom, then global_only 10% from 40.
    assert heights[(1, 0.0)] == pytest.approx(40.0)
    assert heights[(1, 40.0)] == pytest.approx(10.0)
    assert sum(p.get_height() for p in ax.patches) == pytest.approx(200.0)

    routing = figures["routing_q0_toy_flow.png"]
    assert len(routing.axes) == 2 * len(GROUPS)  # train and held-out rows


def test_reproduce_grid_means_seeds_and_keeps_unfinished_curves(tmp_path):
    grid = tmp_path / "grid"
    write_run(grid / "toy" / "flow" / "seed_0", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2), 2: (0.3, 0.4)}, breakdown=BREAKDOWN_A, q0=Q0)
    write_run(grid / "toy" / "flow" / "seed_1", dataset="toy", algorithm="flow", seed=1,
              evals={1: (0.3, 0.4), 2: (0.5, 0.6)}, breakdown=BREAKDOWN_B, q0=Q0)
    write_run(grid / "toy" / "pi_flow" / "seed_0", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.2, 0.2)})  # unfinished: curve only
    write_run(grid / "other" / "fedavg" / "seed_0", dataset="other", algorithm="fedavg",
              seed=0, evals={5: (0.5, 0.5)}, breakdown=BREAKDOWN_B)
    runs = plot_data.load_runs(str(grid))
    assert sorted((r.dataset, r.method, r.seed) for r in runs) == [
        ("other", "fedavg", 0), ("toy", "flow", 0), ("toy", "flow", 1), ("toy", "pi_flow", 0)]
    figures = plot_draw.workdir_figures(runs)
    assert sorted(figures) == ["breakdown_other.png", "breakdown_toy.png",
                               "learning_curves_other.png", "learning_curves_toy.png",
                               "routing_q0_toy_flow.png"]

    acc_g = figures["learning_curves_toy.png"].axes[0]
    lines = {l.get_label(): l for l in acc_g.lines}
    assert sorted(lines) == ["flow", "pi_flow"]
    np.testing.assert_allclose(lines["flow"].get_ydata(), [20.0, 40.0])  # mean of 2 seeds
    assert len(acc_g.collections) == 1  # the +-std band of flow only (pi_flow: one seed)

    ax = figures["breakdown_toy.png"].axes[0]
    assert len(ax.patches) == len(GROUPS)  # the unfinished pi_flow has no bar
    assert ax.patches[0].get_height() == pytest.approx(50.0)  # mean of 40% and 60%

    pooled = plot_data.pooled_routing([r for r in runs if r.method == "flow"])
    np.testing.assert_allclose(pooled["train_clients"].histograms["both_correct"],
                               2 * np.asarray(Q0["both_correct"]))
    notes = plot_data.run_notes(runs)
    assert len(notes) == 1 and "pi_flow" in notes[0] and "unfinished" in notes[0]


def test_plot_data_needs_no_matplotlib(tmp_path):
    """The figures' data (names, kinds, seed means) comes from plot_data alone; only
    plot_draw imports matplotlib."""
    for seed, breakdown in ((0, BREAKDOWN_A), (1, BREAKDOWN_B)):
        write_run(tmp_path / "flow" / f"seed_{seed}", dataset="toy", algorithm="flow",
                  seed=seed, evals={1: (0.1, 0.2)}, breakdown=breakdown, q0=Q0)
    script = (
        "import json, sys\n"
        "sys.modules['matplotlib'] = None  # any matplotlib import raises ImportError\n"
        "from flowjax.paper import plot_data\n"
        f"plots = plot_data.workdir_plots(plot_data.load_runs({str(tmp_path)!r}))\n"
        "print(json.dumps({name: [p.kind, p.title] for name, p in plots.items()}))\n"
        "print(json.dumps(plots['breakdown_toy.png'].data))\n")
    done = forkserver.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    kinds, breakdown = map(json.loads, done.stdout.splitlines())
    assert kinds == {
        "learning_curves_toy.png": ["learning_curves", "toy: accuracy during training"],
        "breakdown_toy.png": ["breakdown", "toy: test instances by correct model"],
        "routing_q0_toy_flow.png": ["routing", "toy / flow: q0 per layer by instance group "
                                               "(2 seeds pooled)"]}
    assert breakdown == {"train_clients": {"flow": {g: (BREAKDOWN_A[g] + BREAKDOWN_B[g]) / 2
                                                    for g in GROUPS}}}


def test_the_routing_title_counts_the_seeds_pooled_not_the_seeds_routed(tmp_path):
    """A seed whose results predate q0_histogram routes (q0_by_group) but is not pooled:
    the title must not count it."""
    for seed in (0, 1, 2):
        write_run(tmp_path / "flow" / f"seed_{seed}", dataset="toy", algorithm="flow",
                  seed=seed, evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A, q0=Q0)
    results = tmp_path / "flow" / "seed_2" / "results.json"
    older = json.loads(results.read_text())
    del older["populations"]["train_clients"]["q0_histogram"]
    results.write_text(json.dumps(older))
    runs = plot_data.load_runs(str(tmp_path))
    plots = plot_data.workdir_plots(runs)
    assert plots["routing_q0_toy_flow.png"].title == (
        "toy / flow: q0 per layer by instance group (2 seeds pooled)")
    np.testing.assert_allclose(plots["routing_q0_toy_flow.png"].data["train_clients"]
                               .histograms["both_correct"], 2 * np.asarray(Q0["both_correct"]))


def test_a_variant_folder_of_seeds_is_named_by_the_folder(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / "pi_flow" / f"seed_{seed}", dataset="toy", algorithm="flow",
                  seed=seed, evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    runs = plot_data.load_runs(str(tmp_path / "pi_flow"))
    assert [(r.method, r.seed) for r in runs] == [("pi_flow", 0), ("pi_flow", 1)]


def test_an_unfinished_run_takes_the_dataset_name_of_its_finished_siblings(tmp_path):
    write_run(tmp_path / "flow", dataset="toy_0.1", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    write_run(tmp_path / "fedavg", dataset="toy", algorithm="fedavg", seed=0,
              evals={1: (0.1, 0.2)})
    (tmp_path / "flow" / "config.json").write_text(json.dumps({"dataset": "toy", "seed": 0}))
    assert {r.dataset for r in plot_data.load_runs(str(tmp_path))} == {"toy_0.1"}


def test_local_has_no_acc_g_curve_and_no_breakdown_bar(tmp_path):
    """Local's Acc_g and breakdown score its untrained starting model: the tables show
    "-" for them, and the figures drew them as results. A finished and an unfinished
    seed (no results.json: the method is the folder's name)."""
    write_run(tmp_path / "flow" / "seed_0", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    write_run(tmp_path / "local" / "seed_0", dataset="toy", algorithm="local", seed=0,
              evals={1: (0.05, 0.6)}, breakdown=BREAKDOWN_B)
    write_run(tmp_path / "local" / "seed_1", dataset="toy", algorithm="local", seed=1,
              evals={1: (0.05, 0.5)})
    write_run(tmp_path / "pi_flow" / "seed_0", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.3)}, breakdown=BREAKDOWN_A)
    runs = plot_data.load_runs(str(tmp_path))
    assert [(r.method, r.results is None) for r in runs] == [
        ("flow", False), ("local", False), ("local", True), ("pi_flow", False)]
    curves = plot_data.curve_bands(runs)["train_clients"]
    assert list(curves["acc_g"]) == ["flow", "pi_flow"]
    assert list(curves["acc_p"]) == ["flow", "local", "pi_flow"]
    assert list(curves["acc_p"]["local"].mean) == pytest.approx([0.55])  # both seeds
    assert list(plot_data.mean_breakdowns(runs)["train_clients"]) == ["flow", "pi_flow"]
    # Each method keeps its colour in the panel that lacks Local.
    curves = plot_draw.workdir_figures(runs)["learning_curves_toy.png"]
    colours = [{line.get_label(): line.get_color() for line in ax.lines} for ax in curves.axes]
    assert colours[0] == {m: colours[1][m] for m in ("flow", "pi_flow")}
    assert len(set(colours[1].values())) == 3


def test_same_method_name_in_two_folders_is_disambiguated(tmp_path):
    for study in ("a", "b"):
        write_run(tmp_path / study / "flow", dataset="toy", algorithm="flow", seed=0,
                  evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    assert sorted(r.method for r in plot_data.load_runs(str(tmp_path))) == ["a/flow", "b/flow"]


# ---------------------------------------------------------------- the command


def test_plot_command_writes_pngs(tmp_path):
    write_run(tmp_path / "flow", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2), 2: (0.3, 0.4)}, breakdown=BREAKDOWN_A, q0=Q0, held_out=True)
    write_run(tmp_path / "fedavg", dataset="toy", algorithm="fedavg", seed=0,
              evals={1: (0.2, 0.2)}, breakdown=BREAKDOWN_B, held_out=True)
    done = plot(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = ["breakdown_toy.png", "learning_curves_toy.png", "routing_q0_toy_flow.png"]
    assert sorted(os.listdir(tmp_path / "plots")) == expected
    for name in expected:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
        assert f"wrote {tmp_path / 'plots' / name}" in done.stdout
    assert "note: every run evaluated at one round" not in done.stdout  # flow has two


def test_the_default_folder_drops_figures_no_longer_drawn_and_out_dir_keeps_them(tmp_path):
    """A method's run removed from the folder: its routing figure would stay in plots/
    beside figures that no longer show it; another file there, or --out_dir, is kept."""
    write_run(tmp_path / "flow", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A, q0=Q0)
    write_run(tmp_path / "fedavg", dataset="toy", algorithm="fedavg", seed=0,
              evals={1: (0.2, 0.2)}, breakdown=BREAKDOWN_B)
    out = tmp_path / "mine"
    for extra in ([], [f"--out_dir={out}"]):
        assert plot(tmp_path, *extra).returncode == 0
    (tmp_path / "plots" / "notes.txt").write_text("mine")
    shutil.rmtree(tmp_path / "flow")
    again = [plot(tmp_path, *extra) for extra in ([], [f"--out_dir={out}"])]
    assert [done.returncode for done in again] == [0, 0], again[0].stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "plots")) == ["breakdown_toy.png",
                                                      "learning_curves_toy.png", "notes.txt"]
    assert (f"removed {tmp_path / 'plots' / 'routing_q0_toy_flow.png'} (an earlier figure "
            f"this invocation does not draw)") in again[0].stdout
    assert sorted(os.listdir(out)) == ["breakdown_toy.png", "learning_curves_toy.png",
                                       "routing_q0_toy_flow.png"]


def test_runs_evaluated_once_say_their_curves_are_points(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / "flow" / f"seed_{seed}", dataset="toy", algorithm="flow",
                  seed=seed, evals={20: (0.1, 0.2)}, breakdown=BREAKDOWN_A, q0=Q0)
    notes = plot_data.run_notes(plot_data.load_runs(str(tmp_path)))
    assert notes == ["every run evaluated at one round only (config.eval.every=0: after the "
                     "last), so the learning curves are one point per method; "
                     "--config.eval.every=N evaluates every N rounds and changes no number "
                     "of training"]


@pytest.mark.parametrize("make, message", [
    (lambda path: path / "missing", "is not a directory"),
    (lambda path: path, "no runs under"),
])
def test_plot_command_rejects_bad_workdirs_in_one_line(tmp_path, make, message):
    done = plot(make(tmp_path))
    assert done.returncode == 2
    lines = [l for l in done.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in done.stderr


def test_a_broken_results_file_is_named(tmp_path):
    write_run(tmp_path, dataset="toy", algorithm="flow", seed=0, evals={1: (0.1, 0.2)})
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(plot_data.RunFileError, match="results.json"):
        plot_data.load_runs(str(tmp_path))


def test_plot_methods_and_out_dir_select_the_runs_and_the_folder(tmp_path):
    # A reproduce grid whose workdir another table's runs share (launch/mini_reproduction.sh).
    for method, algorithm in (("flow", "flow"), ("fedavg", "fedavg"), ("flow_ref_halves", "flow")):
        write_run(tmp_path / "toy" / method / "seed_0", dataset="toy", algorithm=algorithm,
                  seed=0, evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A,
                  q0=Q0 if algorithm == "flow" else None)
    out = tmp_path / "only"
    done = forkserver.run([sys.executable, os.path.join(ROOT, "launch", "plot.py"),
                           f"--workdir={tmp_path}", "--plot_methods=fedavg,flow",
                           f"--out_dir={out}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["breakdown_toy.png", "learning_curves_toy.png",
                                       "routing_q0_toy_flow.png"]
    assert not (tmp_path / "plots").exists()
    # Without --out_dir, every run's figures, then one method's beside them.
    for selection in ([], ["--plot_methods=fedavg"]):
        done = forkserver.run([sys.executable, os.path.join(ROOT, "launch", "plot.py"),
                               f"--workdir={tmp_path}", *selection], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "plots")) == [
        "breakdown_toy.png", "learning_curves_toy.png", "routing_q0_toy_flow.png",
        "routing_q0_toy_flow_ref_halves.png"]
    assert sorted(os.listdir(tmp_path / "plots-fedavg")) == ["breakdown_toy.png",
                                                              "learning_curves_toy.png"]
    assert ((tmp_path / "plots" / "breakdown_toy.png").read_bytes()
            != (tmp_path / "plots-fedavg" / "breakdown_toy.png").read_bytes())
    runs = plot_data.select_methods(plot_data.load_runs(str(tmp_path)), ["fedavg", "flow"])
    assert sorted(r.method for r in runs) == ["fedavg", "flow"]
    with pytest.raises(ValueError, match=r"^no run of method ditto; the runs' methods are "
                                         r"fedavg, flow, flow_ref_halves$"):
        plot_data.select_methods(runs + plot_data.load_runs(str(tmp_path)), ["ditto"])


def test_a_bad_dpi_or_out_dir_is_one_line_and_writes_nothing(tmp_path):
    write_run(tmp_path, dataset="toy", algorithm="fedavg", seed=0, evals={1: (0.1, 0.2)},
              breakdown=BREAKDOWN_A)
    a_file = tmp_path / "out.png"
    a_file.write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    for flags, expected in ((["--dpi=-5"], "error: --dpi=-5: expected an integer in [1, 1200]"),
                            # matplotlib ran out of memory in a traceback
                            (["--dpi=20000"], "error: --dpi=20000: expected an integer in "
                                              "[1, 1200]"),
                            ([f"--out_dir={a_file}"], f"error: --out_dir={a_file} is a file; "
                                                      "expected a directory")):
        done = plot(tmp_path, *flags)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(expected), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert a_file.read_text() == "mine"


# launch/plot.py as its own script, with matplotlib's savefig cut short by a Ctrl-C after
# a few bytes of the breakdown figure.
_CTRL_C_IN_SAVEFIG = """
import runpy, sys
import matplotlib.figure
def savefig(self, out, **options):
    if "breakdown" not in self.axes[0].get_title():
        return real(self, out, **options)
    (out if hasattr(out, "write") else open(out, "wb")).write(b"PNG cut")
    raise KeyboardInterrupt
real, matplotlib.figure.Figure.savefig = matplotlib.figure.Figure.savefig, savefig
sys.argv = ["launch/plot.py", *sys.argv[1:]]
runpy.run_path("launch/plot.py", run_name="__main__")
"""


def test_ctrl_c_while_a_png_is_written_keeps_the_earlier_png(tmp_path):
    """savefig wrote onto the PNG itself: Ctrl-C there left a truncated file where a good
    one was, and a traceback. Now the earlier PNG stays, and one line, exit 130."""
    write_run(tmp_path, dataset="toy", algorithm="fedavg", seed=0, evals={1: (0.1, 0.2)},
              breakdown=BREAKDOWN_A)
    assert plot(tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "plots").iterdir()}
    done = forkserver.run([sys.executable, "-c", _CTRL_C_IN_SAVEFIG, f"--workdir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C)", done.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "plots").iterdir()} == before
    assert "breakdown_toy.png" in before


def test_breakdown_bars_are_client_means_where_the_results_have_them(tmp_path):
    """The paper's Figure 3 averages each client's fractions, as Acc_g and Acc_p are; a
    results.json from before ``breakdown_client_mean`` existed gives its pooled one."""
    write_run(tmp_path / "flow", dataset="toy", algorithm="flow", seed=0,
              evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    write_run(tmp_path / "fedavg", dataset="toy", algorithm="fedavg", seed=0,
              evals={1: (0.1, 0.2)}, breakdown=BREAKDOWN_A)
    path = tmp_path / "flow" / "results.json"
    results = json.loads(path.read_text())
    results["populations"]["train_clients"]["breakdown_client_mean"] = BREAKDOWN_B
    path.write_text(json.dumps(results))
    means = plot_data.mean_breakdowns(plot_data.load_runs(str(tmp_path)))["train_clients"]
    assert means["flow"] == pytest.approx(BREAKDOWN_B)
    assert means["fedavg"] == pytest.approx(BREAKDOWN_A)
