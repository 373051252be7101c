"""The benchmark's helpers (the timed paths run in launch/benchmark.py itself), and the
device script's command lines."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from launch import benchmark
from tests import forkserver
from tests.helpers import loops


def test_dashed_flag_names_become_absl_names():
    argv = ["benchmark.py", "--compare-torch", "--max-clients=4", "--models=a-b", "--", "--x-y"]
    assert benchmark.normalize_flag_spelling(argv) == [
        "benchmark.py", "--compare_torch", "--max_clients=4", "--models=a-b", "--", "--x-y"]


def test_skewed_sizes_are_the_stackoverflow_model():
    from flowjax.data.synthetic import stackoverflow_like_sizes
    np.testing.assert_array_equal(benchmark.client_sizes(50, 400, skewed=True),
                                  stackoverflow_like_sizes(50, 0))
    assert (benchmark.client_sizes(3, 400, skewed=False) == 400).all()


def test_padding_counts_what_each_mapping_executes():
    from flowjax.core.cohort import ClientExamples
    from flowjax.core.mapping import ClientMapping
    counts = np.array([40, 1, 20, 3])  # batch 10: 4, 1, 2, 1 steps
    cohort = ClientExamples(x=None, y=None, mask=None, num_examples=counts, client_id=None)
    loop = benchmark.mapping_padding(cohort, ClientMapping("loop"), 10)
    assert loop == {"useful_steps": 8, "executed_steps": 8, "step_efficiency": 1.0,
                    "example_efficiency": 64 / 80}
    vmap = benchmark.mapping_padding(cohort, ClientMapping("vmap"), 10)
    assert vmap["executed_steps"] == 16 and vmap["step_efficiency"] == 0.5
    chunked = benchmark.mapping_padding(cohort, ClientMapping("chunked", 2), 10)
    assert chunked["executed_steps"] == 4 + 4 + 1 + 1  # [4, 2] and [1, 1]
    # 3 steps per loop iteration: [4, 2] runs one loop of 3 steps (the client of 2 waits),
    # then 2 single steps (its rest); [1, 1] one single step. A loop runs each client's own.
    three = benchmark.mapping_padding(cohort, ClientMapping("chunked", 2), 10, steps_per_loop=3)
    assert three["executed_steps"] == 5 + 5 + 1 + 1
    assert benchmark.mapping_padding(cohort, ClientMapping("loop"), 10,
                                     steps_per_loop=3)["executed_steps"] == 8


def test_cohort_sizes_double_up_to_the_maximum():
    assert benchmark.cohort_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert benchmark.cohort_sizes(6) == [1, 2, 4, 6]
    assert benchmark.cohort_sizes(1) == [1]


def test_torch_comparison_is_skipped_without_torch(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert benchmark.time_torch("emnist_cnn", None, 2, 1) is None
    assert "torch is not installed" in capsys.readouterr().out
    assert benchmark.time_torch("shakespeare_lstm", None, 2, 1) is None
    assert "only emnist_cnn" in capsys.readouterr().out


def test_torch_fedavg_round_is_the_weighted_mean_of_the_clients():
    torch = pytest.importorskip("torch")
    from launch import torch_reference
    rng = np.random.default_rng(0)
    model = torch_reference.emnist_cnn()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [torch_reference.client_batches(rng.normal(size=(n, 28, 28)).astype(np.float32),
                                              rng.integers(0, 62, n), 4, 2) for n in (8, 3)]
    assert [len(c) for c in clients] == [2, 1]  # no padding: 3 examples take one step
    for layer in model.modules():  # dropout off: the rounds below must be deterministic
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0
    alone = [torch_reference.fedavg_round(model, start, [batches], 0.1) for batches in clients]
    mean = torch_reference.fedavg_round(model, start, clients, 0.1)
    for name in start:
        expected = alone[0][name] * (8 / 11) + alone[1][name] * (3 / 11)
        assert torch.allclose(mean[name], expected, atol=1e-6)
    assert not torch.allclose(mean["0.weight"], start["0.weight"])  # it trained


def test_padding_counts_every_epoch():
    from flowjax.core.cohort import ClientExamples
    from flowjax.core.mapping import ClientMapping
    cohort = ClientExamples(x=None, y=None, mask=None, num_examples=np.array([40, 10]),
                            client_id=None)
    three = benchmark.mapping_padding(cohort, ClientMapping("vmap"), 10, epochs=3)
    assert three == {"useful_steps": 15, "executed_steps": 24, "step_efficiency": 15 / 24,
                     "example_efficiency": 150 / 240}


@pytest.fixture(scope="module")
def skewed_fedavg():
    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.data.synthetic import stackoverflow_like_sizes, synthetic_images
    from tests.helpers import tiny_mlp
    sizes = np.maximum(stackoverflow_like_sizes(12, seed=3) // 8, 2)
    task = synthetic_images(num_clients=12, num_classes=10, sizes=sizes, seed=0)
    return task, fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.05, epochs=2,
                                                               batch_size=4)))


@pytest.mark.slow  # CI time; run with -m slow
def test_planned_mapping_is_the_cost_models_choice_under_the_memory_cap(skewed_fedavg, capsys):
    from flowjax.memory_plan import chunk_for_sizes, plan_chunk_size
    task, algorithm = skewed_fedavg
    padded = -(-int(np.max(task.train.num_examples("train"))) // 4) * 4
    # A budget under which the cap binds (the round's plan holds 7.2 MiB for the whole
    # cohort and 0.4 MiB per chunk client: 28e02c4 planned the whole round, and 4 MiB, the
    # budget before it, no longer fits one client) and one under which it does not.
    for budget, capped in ((10 * 2**20, True), (2**30, False)):
        plan = plan_chunk_size(algorithm, task.train.example_spec, padded_examples=padded,
                               batch_size=4, device_bytes=budget, cohort_clients=12)
        assert (plan.clients_per_chunk < 12) == capped, plan.describe()
        mapping = benchmark.planned_mapping(algorithm, task, 4, budget)
        assert mapping.strategy == "chunked"
        assert mapping.chunk_size == chunk_for_sizes(benchmark.client_steps(task, 4),
                                                     plan.clients_per_chunk)
        assert 1 <= mapping.chunk_size <= plan.clients_per_chunk
        assert f"chunk_for_sizes picks {mapping.chunk_size}" in capsys.readouterr().out
        grouped = benchmark.planned_mapping(algorithm, task, 4, budget, steps_per_loop=3)
        assert grouped.chunk_size == chunk_for_sizes(benchmark.client_steps(task, 4),
                                                     plan.clients_per_chunk, steps_per_loop=3)
        capsys.readouterr()
    with pytest.raises(benchmark.BadFlags, match="not one client fits"):
        benchmark.planned_mapping(algorithm, task, 4, 1000)


def test_compiled_round_is_timed_without_a_warm_up_or_a_retrace(skewed_fedavg):
    import jax
    import optax
    from flowjax.core.mapping import ClientMapping
    from flowjax.experiment import RunSettings, Simulation
    task, algorithm = skewed_fedavg
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=12, batch_size=4,
                           eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, optax.sgd(1.0), ClientMapping("chunked", 4))
    timing = benchmark.time_compiled_round(simulation, simulation.init_state(),
                                           jax.device_put(simulation.cohort(0)), repeats=2)
    assert timing["compile_s"] > 0 and timing["round_s"] > 0
    assert simulation.trace_counts["round"] == 1  # traced for the compile, never again


def test_projection_is_clients_per_second_and_hours(capsys):
    rows = {("fedavg", "python loop (sequential)"): {"round_s": 9.0},
            ("fedavg", "chunked 63 (planned)"): {"round_s": 18.0, "compile_s": 30.0}}
    out = benchmark.print_projection(rows, 1000, 2000)
    assert out == [{"method": "fedavg", "mapping": "chunked 63 (planned)",
                    "clients_per_s": 1000 / 18.0, "rounds": 2000, "projected_hours": 10.0}]
    assert capsys.readouterr().out == ("fedavg chunked 63 (planned): 55.6 clients/s; 2000 rounds "
                                       "of 1000 clients: 10.00 h, compiled once in 30 s\n")


def test_bad_flags_fail_in_one_line_before_anything_is_timed(tmp_path):
    """A flag for another model, a count the benchmark cannot divide by (it used to end in
    a traceback after compiling), and a --json_out it could only fail to write after the
    whole benchmark."""
    import subprocess
    import sys
    missing = tmp_path / "missing" / "bench.json"
    unwritable = (f"error: --json_out={missing}: expected a file path in an existing folder "
                  "you can write")
    expected = {
        ("benchmark.py", "--models=shakespeare_lstm", "--conv_impl=im2col"):
            "error: --conv_impl: shakespeare_lstm does not implement conv_impl (only emnist_cnn)",
        ("benchmark.py", "--repeats=0"): "error: flag --repeats=0: 0 is not a positive integer",
        ("benchmark.py", "--models=emnist_cnn", f"--json_out={missing}"): unwritable,
        # Its runs take minutes on a GPU: the file is checked first too.
        ("determinism_check.py", f"--json_out={missing}"): unwritable,
    }
    running = {args: forkserver.Popen([sys.executable, f"launch/{args[0]}", *args[1:]],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for args in expected}
    for args, process in running.items():
        _, stderr = process.communicate(timeout=300)
        assert (process.returncode, stderr.strip()) == (2, expected[args]), args
    assert not missing.parent.exists()


@pytest.mark.slow
def test_scale_flags_end_to_end_at_a_tiny_size(tmp_path):
    """The Stack Overflow scale command's flags, on the EMNIST CNN at 2 clients x 1 step."""
    import json
    import subprocess
    import sys
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "launch/benchmark.py", "--models=emnist_cnn", "--clients=2", "--steps=1",
         "--epochs=2", "--strategies=planned", "--plan_memory_gb=1", "--nopython_loop",
         "--nocentralized", "--nowarmup", "--repeats=1", "--project_rounds=2000",
         "--conv_impl=im2col", "--compute_dtype=bfloat16", f"--json_out={out}"],
        capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())["models"]["emnist_cnn"]
    assert report["useful_steps"] == 2 * 1 * 2 and report["centralized_s"] is None
    assert report["model_options"] == {"conv_impl": "im2col", "compute_dtype": "bfloat16"}
    for row in report["rows"]:
        assert row["mapping"].endswith("(planned)") and row["compile_s"] > 0
        assert row["useful_steps"] == row["executed_steps"] == 4
        assert row["speedup_vs_python_loop"] is None
    assert [p["method"] for p in report["projection"]] == ["fedavg", "flow"]


@pytest.fixture
def parsed_flags():
    """absl's flags marked parsed: the benchmark's functions read them outside ``main``."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return flags.FLAGS


def test_variants_carry_their_loop_shapes_and_bad_ones_fail_in_one_line(parsed_flags):
    from absl import flags
    from absl.testing import flagsaver
    from flowjax.models.base import forward
    assert benchmark.parse_variant("flow") == ("flow", {})
    assert benchmark.parse_variant("flow_fused+lstm_unroll=20+steps_per_loop=4") == (
        "flow_fused", {"lstm_unroll": 20, "steps_per_loop": 4})
    for entry, message in (
            ("flwo+lstm_unroll=2", r"^'flwo\+lstm_unroll=2': expected one of fedavg, flow, "
                                   r"flow_fused, flow_mixed_state, optionally with \+OPTION=N$"),
            ("flow+unroll=2", r"^'flow\+unroll=2': expected \+OPTION=N with "
                              r"OPTION one of lstm_unroll, steps_per_loop and N >= 1, or "
                              r"custom_grad and N 0 or 1, not 'unroll=2'$"),
            ("fedavg+steps_per_loop=0", r"N 0 or 1, not 'steps_per_loop=0'$"),
            ("flow+custom_grad=2", r"N 0 or 1, not 'custom_grad=2'$")):
        with pytest.raises(benchmark.BadFlags, match=message):
            benchmark.parse_variant(entry)
    # The flag's validator: a bad entry fails while the command line is parsed (so the
    # device script's check, test_every_step_of_the_device_script_parses_its_flags, sees it).
    with flagsaver.flagsaver():
        with pytest.raises(flags.IllegalFlagValueError, match=r"'flow\+unroll=2': expected"):
            flags.FLAGS.algorithms = ["fedavg", "flow+unroll=2"]
    x = np.zeros((2, 20), np.int32)
    with flagsaver.flagsaver(algorithms=["fedavg", "fedavg+lstm_unroll=20+steps_per_loop=3"]):
        model, variants = benchmark.algorithms("stackoverflow_lstm", x)
        with pytest.raises(benchmark.BadFlags, match=r"^--algorithms: 'fedavg\+lstm_unroll=20"
                           r"\+steps_per_loop=3': emnist_cnn does not implement lstm_unroll "
                           r"\(only shakespeare_lstm, stackoverflow_lstm\)$"):
            benchmark.algorithms("emnist_cnn", np.zeros((2, 28, 28, 1), np.float32))
    plain, unrolled = variants["fedavg"], variants["fedavg+lstm_unroll=20+steps_per_loop=3"]
    assert (plain.algorithm.name, plain.steps_per_loop) == ("fedavg", 1)
    assert (unrolled.algorithm.name, unrolled.steps_per_loop) == ("fedavg", 3)
    assert plain.algorithm.model is model and unrolled.algorithm.model is not model

    def time_loops(routable):  # the LSTM's: none left at 20 steps per iteration
        return loops(lambda p: forward(routable, p, x), routable.init(jax.random.key(0)))

    assert (time_loops(plain.algorithm.model), time_loops(unrolled.algorithm.model)) == (1, 0)
    # Gradients per variant, side by side: the model's hand-written VJPs, or autodiff; and
    # Flow's mixed-state recurrence (the routed LSTM's VJP in its prediction).
    assert benchmark.parse_variant("flow_mixed_state+custom_grad=0") == (
        "flow_mixed_state", {"custom_grad": 0})
    entries = ["flow", "flow_mixed_state", "flow_mixed_state+custom_grad=0"]
    with flagsaver.flagsaver(algorithms=entries):
        model, variants = benchmark.algorithms("stackoverflow_lstm", x)

    def program(entry):
        algorithm = variants[entry].algorithm
        params = jax.eval_shape(algorithm.init, jax.random.key(0))
        personal = {**params, "local": params["global"]}
        return str(jax.make_jaxpr(lambda p, q: algorithm.predict(p, q, x))(params, personal))

    separate, mixed, autodiff = (program(entry) for entry in entries)
    assert variants["flow_mixed_state"].algorithm.model is model
    assert variants["flow_mixed_state+custom_grad=0"].algorithm.model is not model
    assert ("name=_routed_lstm" in separate, "name=_routed_lstm" in mixed) == (False, True)
    assert "custom_vjp_call" in mixed and "custom_vjp_call" not in autodiff


def test_a_cut_run_already_printed_its_denominator_and_each_rows_compile_cost(capsys,
                                                                             parsed_flags):
    """A device call's ``timeout`` can cut a run before its table: the centralized step is
    timed and printed before any row, and each row's line carries its first round's
    seconds (compiling included), the cost a script's timeouts must leave room for."""
    from absl.testing import flagsaver
    with flagsaver.flagsaver(algorithms=["fedavg"], strategies=["vmap"], python_loop=False):
        timed = benchmark.time_model("emnist_cnn", clients=2, steps=1, repeats=1)
    lines = capsys.readouterr().out.splitlines()
    central = timed["centralized_s"]
    row = timed["rows"][("fedavg", "vmap")]
    assert lines == [f"timed the centralized-equivalent step: {2 / central:.1f} client-steps/s "
                     f"({central:.3f} s)",
                     f"timed fedavg, vmap: {row['round_s']:.3f} s per round (first round, "
                     f"compiling included: {row['first_round_s']:.1f} s)"]
    assert row["first_round_s"] > row["round_s"] > 0  # the first one compiled


def test_each_variant_gets_a_ratio_line_beside_its_plain_method(capsys):
    rows = {("fedavg", "vmap"): {"round_s": 1.2}, ("fedavg+steps_per_loop=10", "vmap"):
            {"round_s": 1.0}, ("flow+lstm_unroll=20", "vmap"): {"round_s": 3.0}}
    out = {}
    benchmark.print_ratios({"rows": rows, "torch": None, "methods": tuple(
        key[0] for key in rows)}, out)
    assert out == {"fedavg_over_fedavg+steps_per_loop=10": pytest.approx(1.2)}  # no plain flow
    assert capsys.readouterr().out == ("fedavg round / fedavg+steps_per_loop=10 round (best "
                                       "mapping each): 1.20x\n")


def test_the_mixed_state_recurrence_is_timed_beside_flow_and_its_autodiff(capsys):
    rows = {("flow", "loop"): {"round_s": 2.0}, ("flow_mixed_state", "loop"): {"round_s": 1.5},
            ("flow_mixed_state+custom_grad=0", "loop"): {"round_s": 3.0}}
    out = {}
    benchmark.print_ratios({"rows": rows, "torch": None, "methods": tuple(
        key[0] for key in rows)}, out)
    assert out == {"flow_mixed_state_over_flow": pytest.approx(0.75),
                   "flow_mixed_state_over_flow_mixed_state+custom_grad=0": pytest.approx(0.5)}
    assert capsys.readouterr().out == (
        "Flow round with the mixed-state recurrence / Flow round: 0.75x\n"
        "flow_mixed_state round / flow_mixed_state+custom_grad=0 round (best mapping each): "
        "0.50x\n")


def test_each_mappings_padding_is_printed_when_only_variants_were_timed(capsys):
    """Padding belongs to the mapping: its FedAvg row's, else the first row's with it (a
    run of ``fedavg+lstm_unroll=20`` alone printed an empty line before)."""
    def row(step, example):
        return {"round_s": 1.0, "step_efficiency": step, "example_efficiency": example}
    rows = {("flow+lstm_unroll=20", "chunked 4"): row(0.5, 0.4),
            ("fedavg+lstm_unroll=20", "chunked 19"): row(0.7, 0.6),
            ("flow", "chunked 19"): row(0.1, 0.1)}
    out = {}
    benchmark.print_ratios({"rows": rows, "torch": None, "methods": ()}, out)
    assert out["padding"] == {"chunked 4": {"step_efficiency": 0.5, "example_efficiency": 0.4},
                              "chunked 19": {"step_efficiency": 0.7, "example_efficiency": 0.6}}
    assert ("useful / executed client-steps (example slots) per mapping: chunked 4 0.50 "
            "(0.40), chunked 19 0.70 (0.60)\n") in capsys.readouterr().out


def test_strategy_names_carry_their_own_chunk_size():
    from flowjax.core.mapping import ClientMapping
    assert benchmark.parse_strategy("chunked:19", 5, 1) == ClientMapping("chunked", 19)
    assert benchmark.parse_strategy("chunked", 5, 1) == ClientMapping("chunked", 5)
    assert benchmark.parse_strategy("vmap", 5, 1) == ClientMapping("vmap", 5)
    with pytest.raises(benchmark.BadFlags, match="'vmap:3'; expected chunked:N with N >= 1"):
        benchmark.parse_strategy("vmap:3", 5, 1)
    with pytest.raises(benchmark.BadFlags, match="'chunked:0'"):
        benchmark.parse_strategy("chunked:0", 5, 1)


def test_bad_devices_or_strategies_are_refused_before_anything_is_timed():
    """They were checked in the loop over them: a traceback after the first timings, which
    were lost (``--json_out`` never written)."""
    count = jax.device_count()
    assert benchmark.checked_device_counts(["1"], ["loop", "chunked:3", "planned"], 5) == [1]
    for devices, strategies, message in (
            (["abc"], ["loop"], "--devices=abc: 'abc': expected an integer >= 1"),
            (["²"], ["loop"], "--devices=²: '²': expected an integer >= 1"),
            (["1", "0"], ["loop"], f"--devices=1,0: '0': expected an integer in [1, {count}] "
                                   "(devices visible)"),
            (["1"], ["loop", "bogus"], "--strategies=loop,bogus: 'bogus'; expected some of "
                                       "loop, chunked, chunked:N (N >= 1), vmap or planned"),
            (["1"], ["chunked:0"], "--strategies: 'chunked:0'; expected chunked:N with N >= 1"),
            ([], ["loop"], "--devices and --strategies: expected at least one value each")):
        with pytest.raises(benchmark.BadFlags) as raised:
            benchmark.checked_device_counts(devices, strategies, 5)
        assert str(raised.value) == message


def test_run_twice_tells_a_reproducible_round_from_one_that_is_not():
    """``launch/determinism_check.py``'s comparison (run on GPUs by launch/gpu_bench.sh):
    on CPU the same rounds run twice agree bit for bit; a client update that draws host
    noise (as atomics reorder a GPU's sums) is reported, with the size of the gap."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.data.synthetic import synthetic_images
    from launch.bench_common import run_twice
    from tests.helpers import tiny_mlp

    task = synthetic_images(num_clients=4, num_classes=10, examples=(8, 8), seed=0, held_out=0)
    algorithm = fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                              batch_size=4)))
    same = run_twice(algorithm, task, rounds=2, batch_size=4)
    assert same["identical"] and same["differing_arrays"] == 0 and same["compilations"] == 1

    rng = np.random.default_rng(0)  # seeded: the two runs still draw different noise

    def noisy_update(params, client, key, state=None):
        result = algorithm.client_update(params, client, key, state)
        noise = jax.pure_callback(lambda: np.float32(rng.normal() * 1e-6),
                                  jax.ShapeDtypeStruct((), jnp.float32))
        return dataclasses.replace(result, params=jax.tree.map(lambda p: p + noise, result.params))
    noisy = run_twice(dataclasses.replace(algorithm, client_update=noisy_update), task,
                      rounds=2, batch_size=4)
    assert not noisy["identical"] and noisy["differing_arrays"] > 0
    assert 0 < noisy["max_abs_diff"] < 1e-4


# -m slow (33 s: 19 interpreter starts): run it before a device call (README, "Speed").
@pytest.mark.slow
def test_every_step_of_the_device_script_parses_its_flags(tmp_path):
    """``launch/gpu_bench.sh`` gets one 15-minute device call: each of its launcher
    commands is run here with ``tests/flags_only_python.py`` as the Python, which parses
    the flags as the launcher would and runs nothing, so a typo fails in CI instead."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{root}/tests/flags_only_python.py" '
                      '"$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PY=str(python), OUT=str(out), BASE=root, BUDGET_S="100000")
    done = subprocess.run(["bash", "launch/gpu_bench.sh"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    log = (out / "gpu_bench.log").read_text()
    steps = dict(re.findall(r"^## (\S+): rc=(\d+)", log, re.M))
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(steps) == {"versions", "so64_baseline", "so64_unroll", "emnist_slices",
                          "so1000_flow_unroll", "determinism", "so64_mixed_state",
                          "emnist_cmdbuf", "profile_emnist", "emnist_parts",
                          "so64_unroll_chunks", "pool_gradient", "pool_gradient_highest",
                          "emnist_xla", "roofline"}, log[-3000:]
    assert set(steps.values()) == {"0"}, log[-3000:]


def test_step_parts_times_every_part_of_a_small_lstm_step(tmp_path):
    """``launch/step_parts.py`` (run on GPUs by launch/gpu_bench.sh) at a CPU size: a row
    per routable layer, the recurrence's chained products, the loss and the update, each
    timed, and their sum against the whole step."""
    from launch import step_parts
    out = tmp_path / "parts.json"
    report = step_parts.main(["--clients=2", "--repeats=1", "--compute_dtypes=float32,bfloat16",
                              '--model_options={"hidden": 16, "embed_dim": 8, "dense": 8}',
                              f"--json_out={out}"])
    assert json.loads(out.read_text()) == report
    assert [t["compute_dtype"] for t in report["tables"]] == ["float32", "bfloat16"]
    for table in report["tables"]:
        assert list(table["ms"]) == [
            "step", "layer embedding", "layer lstm", "recurrent products x 40, chained",
            "layer dense1", "layer dense2", "loss", "update"]
        assert all(ms > 0 for ms in table["ms"].values())
        parts = [ms for name, ms in table["ms"].items() if name.startswith("layer ")]
        assert table["parts_sum_ms"] == pytest.approx(
            sum(parts) + table["ms"]["loss"] + table["ms"]["update"])
    with pytest.raises(SystemExit):
        step_parts.parse_args(["--clients=0"])
