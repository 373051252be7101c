"""launch/trace_summary.py on traces that JAX's own profiler wrote, and benchmark.py's
--profile_dir through the compiled round."""

import sys

import jax
import jax.numpy as jnp
import pytest
from absl import flags

from launch import benchmark, trace_summary
from tests import forkserver


def test_busy_time_is_the_union_of_the_intervals():
    assert trace_summary.busy_time([]) == 0.0
    assert trace_summary.busy_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.75)]) == 4.0
    assert trace_summary.busy_time([(4.0, 5.0), (0.0, 1.0)]) == 2.0


def test_an_event_enclosing_others_of_its_thread_is_left_out():
    event = lambda tid, ts, dur, op: {"ph": "X", "pid": 1, "tid": tid, "ts": ts,  # noqa: E731
                                      "dur": dur, "name": op, "args": {"hlo_op": op}}
    loop, body, after, other_thread = (event(1, 0, 10, "while.1"), event(1, 2, 3, "dot.1"),
                                       event(1, 10, 1, "add.1"), event(2, 1, 5, "copy.1"))
    assert trace_summary.leaf_events([after, loop, body, other_thread]) == [
        body, after, other_thread]
    summary = trace_summary.summarize([loop, body, after, other_thread])["1"]
    assert (summary["events"], summary["op_time_us"], summary["busy_us"]) == (3, 9.0, 6.0)


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", "gemm"),
    ("gemm_fusion_dot.12", "gemm"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNN", "gemm"),
    ("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc", "convolution"),
    ("cudnn-conv-bias-activation.3", "convolution"),
    ("loop_convert_fusion.4", "other"),
    ("MemcpyD2D", "copy"),
    ("loop_transpose_fusion", "copy"),
    ("input_reduce_fusion.2", "other"),
])
def test_kernels_are_classified_by_name(name, kind):
    assert trace_summary.kind_of(name) == kind


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A jitted two-layer step traced by jax.profiler, and its compiled HLO."""
    directory = tmp_path_factory.mktemp("trace")

    def step(w1, w2, x):
        with jax.named_scope("first_layer"):
            h = jnp.tanh(x @ w1)
        with jax.named_scope("second_layer"):
            return jnp.sum((h @ w2) ** 2)

    args = [jnp.ones((256, 256)) * 0.01, jnp.ones((256, 64)) * 0.01, jnp.ones((128, 256))]
    grad = jax.jit(jax.grad(step, argnums=(0, 1)))
    compiled = grad.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(directory)):
        jax.block_until_ready(compiled(*args))
    hlo = directory / "step.hlo.txt"
    hlo.write_text(compiled.as_text())
    return directory, hlo


def test_a_real_trace_is_summarized_per_process_with_its_ops_named(traced):
    directory, hlo = traced
    summaries = trace_summary.summarize_dir(directory, hlo, top=50)
    assert list(summaries) == ["/host:CPU"]  # the CPU backend's ops run on host threads
    cpu = summaries["/host:CPU"]
    assert cpu["events"] >= 2 and cpu["distinct_kernels"] == len(cpu["top"])
    assert 0 < cpu["busy_us"] <= cpu["span_us"]
    assert cpu["busy_us"] <= cpu["op_time_us"] + 1e-6  # the union never exceeds the sum
    assert sum(cpu["by_kind_us"].values()) == pytest.approx(cpu["op_time_us"])
    assert sum(entry["count"] for entry in cpu["top"]) == cpu["events"]
    sources = " ".join(entry["source"] or "" for entry in cpu["top"])
    # The compiled HLO's op_name metadata names the JAX scopes the ops came from.
    assert "first_layer" in sources and "second_layer" in sources
    assert any("first_layer" in key for key in cpu["by_source_us"])
    assert cpu["by_kind_us"].get("gemm", 0) > 0  # the dot_generals, by their op_name
    text = trace_summary.format_summary(summaries)
    assert text.startswith(f"/host:CPU: {cpu['events']} op events")
    assert "| op | kernel | kind | count | ms | share | from |" in text


def test_op_names_read_the_metadata_of_each_instruction():
    text = ('  %fusion.3 = f32[2]{0} fusion(f32[2]{0} %p), kind=kLoop, calls=%f, '
            'metadata={op_name="jit(step)/first_layer/tanh" source_file="x.py"}\n'
            '  ROOT %dot.1 = f32[2,2]{1,0} dot(%a, %b), metadata={op_name="jit(step)/dot"}\n'
            '  %p = f32[2]{0} parameter(0)\n')
    # Each also under its GPU kernel's spelling (a command buffer's kernels carry only that).
    assert trace_summary.op_names(text) == {"fusion.3": "jit(step)/first_layer/tanh",
                                            "dot.1": "jit(step)/dot",
                                            "fusion_3": "jit(step)/first_layer/tanh",
                                            "dot_1": "jit(step)/dot"}


def test_source_keys_keep_the_layer_and_primitive():
    key = trace_summary.source_key
    assert key("jit(f)/while/body/closed_call/vmap()/while/body/transpose(jvp(LSTM))/"
               "tbh,tbg->hg/dot_general") == "transpose(jvp(LSTM))/dot_general"
    assert key("jit(step)/jvp(Dense)/while/body/add") == "jvp(Dense)/add"
    assert key("jit(step)/first_layer/tanh") == "first_layer/tanh"
    assert key("jit(step)/while") == "while"
    assert key(None) == "(no op_name)"


def test_device_streams_are_summarized_and_host_threads_left_out():
    """The layout of a GPU trace (as the profiler writes it: a /device:GPU:0 process whose
    stream lines hold the kernels, copies without an hlo_op), built by hand."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name",
             "args": {"name": "XLA Modules"}}]
    kernel = lambda ts, dur, name, op: {"ph": "X", "pid": 2, "tid": 7, "ts": ts, "dur": dur,  # noqa: E731
                                        "name": name, "args": {"hlo_op": op}}
    events = meta + [
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 100, "name": "thunk",
         "args": {"hlo_op": "dot.1"}},
        {"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 100, "name": "jit_round"},
        kernel(10, 4, "sm90_xmma_gemm_f32", "dot.1"),
        kernel(20, 2, "loop_add_fusion", "fusion.2"),
        kernel(30, 4, "sm90_xmma_gemm_f32", "dot.1"),
        {"ph": "X", "pid": 2, "tid": 7, "ts": 40, "dur": 10, "name": "MemcpyD2D", "args": {}},
    ]
    summaries = trace_summary.summarize(events)
    assert list(summaries) == ["/device:GPU:0"]
    gpu = summaries["/device:GPU:0"]
    assert (gpu["events"], gpu["span_us"], gpu["busy_us"], gpu["op_time_us"]) == (4, 40, 20, 20)
    assert gpu["by_kind_us"] == {"copy": 10.0, "gemm": 8.0, "other": 2.0}
    assert [(e["op"], e["count"], e["time_us"]) for e in gpu["top"]] == [
        ("MemcpyD2D", 1, 10.0), ("dot.1", 2, 8.0), ("fusion.2", 1, 2.0)]
    assert "(idle 50.0%)" in trace_summary.format_summary(summaries)
    # Without lines named "Stream...": the device's events that carry an hlo_op.
    unnamed = [e for e in events if e.get("name") != "thread_name"]
    gpu = trace_summary.summarize(unnamed)["/device:GPU:0"]
    assert (gpu["events"], gpu["op_time_us"]) == (3, 10.0)


def test_kernels_inside_a_command_buffer_are_rows_of_their_own_named_by_their_fusion():
    """As an H100 trace of the EMNIST round showed (docs/benchmarks/gpu-h100-2026-11-27):
    every kernel of a loop body that XLA runs as a command buffer carries the buffer's
    hlo_op, so one row per op had put the whole body under its first kernel's name. The
    kernels are named after their fusions (``.`` spelled ``_``), which the HLO names."""
    meta = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Compute)"}}]
    kernel = lambda ts, dur, name: {"ph": "X", "pid": 2, "tid": 7, "ts": ts, "dur": dur,  # noqa: E731
                                    "name": name, "args": {"hlo_op": "command_buffer_23"}}
    events = meta + [kernel(0, 5, "loop_multiply_fusion_3"), kernel(5, 3, "input_fusion_1"),
                     kernel(8, 2, "nvjet_tst_128x64_64x8_1x1_v_bz_TNN"),
                     kernel(10, 5, "loop_multiply_fusion_3")]
    hlo = ('  %loop_multiply_fusion.3 = f32[2]{0} fusion(f32[2]{0} %p), kind=kLoop, calls=%f, '
           'metadata={op_name="jit(round)/jvp(Conv_0)/mul"}\n'
           '  %input_fusion-1 = f32[2]{0} fusion(f32[2]{0} %p), kind=kInput, calls=%g, '
           'metadata={op_name="jit(round)/transpose(jvp(Dense_0))/reduce_sum"}\n'
           '  %command_buffer_23 = () call(f32[2]{0} %p), to_apply=%body\n')
    names = trace_summary.op_names(hlo)
    assert names["loop_multiply_fusion_3"] == names["loop_multiply_fusion.3"]
    gpu = trace_summary.summarize(events, names)["/device:GPU:0"]
    rows = {(e["op"], e["kernel"]): (e["count"], e["time_us"], e["source"], e["kind"])
            for e in gpu["top"]}
    assert rows == {
        ("command_buffer_23", "loop_multiply_fusion_3"): (2, 10.0, "jit(round)/jvp(Conv_0)/mul",
                                                         "other"),
        ("command_buffer_23", "input_fusion_1"): (
            1, 3.0, "jit(round)/transpose(jvp(Dense_0))/reduce_sum", "other"),
        ("command_buffer_23", "nvjet_tst_128x64_64x8_1x1_v_bz_TNN"): (1, 2.0, None, "gemm")}
    assert gpu["distinct_kernels"] == 3
    assert gpu["by_source_us"] == {"jvp(Conv_0)/mul": 10.0,
                                   "transpose(jvp(Dense_0))/reduce_sum": 3.0,
                                   "(no op_name)": 2.0}


def test_launcher_fails_in_one_line_without_a_trace(tmp_path, capsys):
    flags.FLAGS(["trace_summary.py", f"--trace_dir={tmp_path}"])
    try:
        assert trace_summary.main([]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --trace_dir={tmp_path}: no *.trace.json.gz under it; expected the folder "
            "given to jax.profiler.trace")
    finally:
        flags.FLAGS.unparse_flags()


def test_benchmark_profiles_the_compiled_round(tmp_path):
    """``--profile_dir``: one more execution of the round compiled ahead of time, traced,
    with its HLO beside the trace and the summary in the row."""
    import optax

    from flowjax.algorithms.base import SGDConfig
    from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
    from flowjax.core.mapping import ClientMapping
    from flowjax.data.synthetic import synthetic_images
    from flowjax.experiment import RunSettings, Simulation
    from tests.helpers import tiny_mlp

    task = synthetic_images(num_clients=4, num_classes=10, examples=(8, 8), seed=0, held_out=0)
    algorithm = fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                              batch_size=4)))
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=4, batch_size=4,
                           eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, optax.sgd(1.0), ClientMapping("vmap"))
    folder = str(tmp_path / "fedavg-vmap")
    timing = benchmark.time_compiled_round(simulation, simulation.init_state(),
                                           jax.device_put(simulation.cohort(0)), repeats=1,
                                           profile_dir=folder)
    assert simulation.trace_counts["round"] == 1  # the profiled execution compiles nothing
    profile = timing["profile"]
    assert profile["directory"] == folder and profile["round_s_traced"] > 0
    cpu = profile["processes"]["/host:CPU"]
    assert cpu["events"] > 0 and 0 < cpu["busy_us"] <= cpu["span_us"]
    assert (tmp_path / "fedavg-vmap" / "round.hlo.txt").read_text().startswith("HloModule")
    assert any(entry["source"] for entry in cpu["top"])  # named from the round's own HLO


def test_profile_dir_without_nowarmup_fails_in_one_line():
    done = forkserver.run([sys.executable, "launch/benchmark.py", "--models=emnist_cnn",
                           "--profile_dir=/tmp/x"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --profile_dir=/tmp/x: expected --nowarmup as well; "
                                   "the profiled execution reuses the round compiled ahead of "
                                   "time")
