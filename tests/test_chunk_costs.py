"""launch/chunk_costs.py: the fit of a round's two step costs and the bounds it gives."""

import itertools
import json

import numpy as np
import pytest
from absl import flags

from launch import chunk_costs
from launch.chunk_costs import (StepCosts, best_partition, chunk_counts, fit_step_costs,
                                padding_free_floor, required_costs)

STEPS = np.array([9, 1, 4, 4, 2, 7, 1])


def test_counts_follow_sorted_chunks():
    # Sorted: 9 7 4 4 2 1 1; chunks of 3: (9 7 4) (4 2 1) (1).
    assert chunk_counts(STEPS, 3) == (9 + 4 + 1, 9 * 3 + 4 * 3 + 1 * 1)
    assert chunk_counts(STEPS, 1) == (int(STEPS.sum()), int(STEPS.sum()))
    assert chunk_counts(STEPS, 7) == (9, 63)


def test_fit_recovers_the_costs_that_made_the_timings():
    truth = StepCosts(fixed=1e-3, per_slot=2.5e-4)
    timings = {k: truth.seconds(*chunk_counts(STEPS, k)) for k in (1, 2, 3, 7)}
    fitted = fit_step_costs(STEPS, timings)
    np.testing.assert_allclose([fitted.fixed, fitted.per_slot], [1e-3, 2.5e-4], rtol=1e-9)


def brute_force_partition(steps, costs):
    ordered = np.sort(steps)[::-1]
    best = np.inf
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [len(ordered)]
        best = min(best, sum(costs.seconds(ordered[a], ordered[a] * (b - a))
                             for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("fixed", [0.0, 0.5, 3.0, 50.0])
def test_best_partition_is_the_cheapest_split_and_above_the_floor(fixed):
    costs = StepCosts(fixed=fixed, per_slot=1.0)
    seconds, sizes = best_partition(STEPS, costs)
    assert seconds == pytest.approx(brute_force_partition(STEPS, costs), rel=1e-12)
    assert sum(sizes) == len(STEPS)
    floor = padding_free_floor(STEPS, costs)
    assert floor == fixed * 9 + STEPS.sum()
    assert floor <= seconds <= min(costs.seconds(*chunk_counts(STEPS, k)) for k in range(1, 8))


def test_equal_sizes_reach_the_floor_in_one_chunk():
    steps = np.full(6, 5)
    costs = StepCosts(fixed=2.0, per_slot=1.0)
    assert best_partition(steps, costs) == (padding_free_floor(steps, costs), [6])


def best_uniform(steps, costs):
    return min(costs.seconds(*chunk_counts(steps, k)) for k in range(1, len(steps) + 1))


def test_required_costs_reach_the_target_exactly_and_none_when_the_other_cost_is_too_long():
    costs = StepCosts(fixed=1e-3, per_slot=2.5e-4)
    target = best_uniform(STEPS, costs) / 2
    per_slot, fixed = required_costs(STEPS, costs, target)
    # At the required cost the best single chunk size takes exactly the target time.
    assert best_uniform(STEPS, StepCosts(costs.fixed, per_slot)) == pytest.approx(target, rel=1e-12)
    assert best_uniform(STEPS, StepCosts(fixed, costs.per_slot)) == pytest.approx(target, rel=1e-12)
    assert per_slot < costs.per_slot and fixed < costs.fixed
    # Below the fixed cost of the longest client's steps alone, no per-slot cost is enough.
    short = costs.fixed * STEPS.max() * 0.99
    assert required_costs(STEPS, costs, short)[0] is None
    assert required_costs(STEPS, costs, costs.per_slot * STEPS.sum() * 0.99)[1] is None


def test_launcher_prints_the_fit_and_refuses_bad_timings(capsys):
    argv = ["chunk_costs.py", "--round_clients=16", "--batch_size=16",
            "--timings=2:0.30,8:0.20,16:0.25", "--baseline_chunk=2"]
    flags.FLAGS(argv)
    try:
        assert chunk_costs.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("16 clients, ")
        assert "| 8 |" in out and "padding-free floor (any mapping)" in out
        assert "x the measured chunks of 2" in out
        assert "2x the measured chunks of 2 (0.150 s, best single chunk size) needs: " in out
        flags.FLAGS(["chunk_costs.py", "--timings=2:0.3,8:0.2", "--target_speedup=0"])
        assert chunk_costs.main([]) == 2
        assert capsys.readouterr().err.strip() == "error: --target_speedup=0.0; expected > 0"
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["chunk_costs.py", "--timings=2:0.3,8:fast"])
        assert chunk_costs.main([]) == 2
        assert capsys.readouterr().err.strip() == (
            "error: --timings: '8:fast'; expected chunk:seconds with chunk >= 1 and "
            "seconds > 0, e.g. 19:0.451")
    finally:
        flags.FLAGS.unparse_flags()


# A real benchmark output (H100, issue 16's call 1): 64 skewed Stack Overflow-like clients,
# batch 16, one epoch, chunks of 4.
H100_SO64 = "docs/benchmarks/gpu-h100-2026-11-26/so64_baseline.json"


def test_results_rows_match_the_sizes_recomputed_here():
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), H100_SO64)
    rows, clients, epochs = chunk_costs.timings_from_results([path], "flow")
    assert (clients, epochs) == (64, 1)
    assert rows == {4: (pytest.approx(1.402920556), 1256)}
    steps = -(-chunk_costs.stackoverflow_like_sizes(64, 0) // 16)
    chunk_costs.check_slots(steps, {4: 1256})  # the benchmark's own sizes, recomputed
    with pytest.raises(ValueError, match="executed 1256 client-step slots in the benchmark, "
                                         "1008 with these sizes"):
        chunk_costs.check_slots(-(-chunk_costs.stackoverflow_like_sizes(64, 0) // 20), {4: 1256})


def test_results_from_files_fit_like_the_same_timings(tmp_path):
    def round_file(name, chunks):
        steps = -(-chunk_costs.stackoverflow_like_sizes(64, 0) // 16)
        rows = [{"method": "fedavg", "mapping": f"chunked {k}", "round_s": 0.1 * k + 0.5,
                 "executed_steps": chunk_counts(steps, k)[1]} for k in chunks]
        rows.append({"method": "fedavg", "mapping": "vmap", "round_s": 9.0, "executed_steps": 1})
        path = tmp_path / name
        path.write_text(json.dumps({"clients": 64, "epochs": 1, "skewed": True,
                                    "models": {"stackoverflow_lstm": {"rows": rows}}}))
        return str(path)

    files = [round_file("a.json", [4]), round_file("b.json", [19, 32])]
    flags.FLAGS(["chunk_costs.py", f"--results={','.join(files)}"])
    try:
        from_files = chunk_costs.report_for_flags()
        flags.FLAGS(["chunk_costs.py", "--timings=4:0.9,19:2.4,32:3.7"])
        assert from_files == chunk_costs.report_for_flags()
    finally:
        flags.FLAGS.unparse_flags()
