"""launch/roofline.py: its formulas agree with XLA's compiled cost analysis, and bounds."""

import math

import pytest

from flowjax.models import get_model
from launch import roofline


@pytest.fixture(scope="module")
def emnist():
    return get_model("emnist_cnn", conv_impl="xla")


def test_emnist_formulas_by_hand(emnist):
    layers = roofline.model_formulas(emnist, 20, im2col=False)
    conv2 = layers["conv2"]
    assert conv2["flops_fwd"] == 2 * 20 * 24 * 24 * (3 * 3 * 32) * 64
    assert conv2["flops_bwd"] == 2 * conv2["flops_fwd"]  # input and weight gradients
    assert layers["conv1"]["flops_dx"] == 0  # images need no gradient
    assert layers["fc1"]["flops_fwd"] == 2 * 20 * 9216 * 128
    assert sum(f["params"] for f in layers.values()) == 1_206_590
    # Weights: read forward, read for dx, gradient written, update reads both, writes one.
    fc1, weights, x, y = layers["fc1"], 4 * 1_179_776, 4 * 20 * 9216, 4 * 20 * 128
    assert fc1["bytes_fwd"] == weights + x + y
    assert fc1["bytes_dx"] == y + weights + x and fc1["bytes_dw"] == y + x + weights
    assert fc1["bytes_update"] == 3 * weights
    im2col = roofline.model_formulas(emnist, 20, im2col=True)["conv2"]
    assert im2col["bytes_extra"] == 4 * 20 * 24 * 24 * 288 * 5  # patches: 5 passes


def test_formulas_match_xla_cost_analysis(emnist):
    """Forward FLOPs of every EMNIST layer: the formula plus the bias adds XLA counts."""
    formulas = roofline.model_formulas(emnist, 20, im2col=False)
    xla = roofline.xla_layer_costs(emnist, 20)
    for name, (_, shapes, _, out_shape) in zip(emnist.layer_names,
                                                roofline.layer_shapes(emnist, 20)):
        bias_adds = math.prod(out_shape)
        assert xla[name]["flops_fwd"] == pytest.approx(formulas[name]["flops_fwd"] + bias_adds,
                                                       rel=1e-3)
        if name != "conv1":  # XLA's backward: the input and the weight gradient
            assert xla[name]["flops_bwd"] == pytest.approx(formulas[name]["flops_bwd"], rel=0.01)


def test_bound_is_the_slower_of_compute_and_memory():
    peaks = roofline.PEAKS["h100"]
    memory_bound = roofline.bound({"flops": 1e9, "bytes": 1e8}, peaks, "tf32")
    assert memory_bound["limit"] == "memory"
    assert memory_bound["client_steps_per_s"] == pytest.approx(3.35e12 / 1e8)
    compute_bound = roofline.bound({"flops": 1e12, "bytes": 1e6}, peaks, "bf16")
    assert compute_bound["limit"] == "compute"
    assert compute_bound["client_steps_per_s"] == pytest.approx(989.5e12 / 1e12)


def test_flow_step_costs_about_twice_fedavg(emnist):
    steps = roofline.step_totals(roofline.model_formulas(emnist, 20, im2col=False), 0, 20)
    # A routing step is 4 forward + 4 input-gradient + 1 weight-gradient passes, a local
    # step 3 passes: (3 + 9) / 2 = 6 forward-sized passes vs FedAvg's 3 (conv1: no dx).
    assert 1.9 < steps["flow"]["flops"] / steps["fedavg"]["flops"] < 2.1


def test_fused_branches_save_the_shared_input_passes_of_the_convolutions(emnist):
    """flow_fused: per routing step (two sub-steps), the input read and its gradient
    written once instead of twice, the patches' five passes once instead of twice, the
    stacked weights copied; only where the input outweighs the weights (the convs)."""
    layers = roofline.model_formulas(emnist, 20, im2col=True)
    a_in, w, patches = 4 * 20 * 26 * 26 * 32, 4 * 18_496, 4 * 20 * 24 * 24 * 288 * 5
    assert layers["conv2"]["bytes_fused_saving"] == 2 * (2 * a_in - 4 * w + patches)
    conv1_in, conv1_w, conv1_patches = 4 * 20 * 28 * 28, 4 * 320, 4 * 20 * 26 * 26 * 9 * 3
    assert layers["conv1"]["bytes_fused_saving"] == 2 * (conv1_in - 4 * conv1_w + conv1_patches)
    assert layers["fc1"]["bytes_fused_saving"] == layers["fc2"]["bytes_fused_saving"] == 0
    steps = roofline.step_totals(layers, 1000, 20)
    assert steps["flow_fused"]["flops"] == steps["flow"]["flops"]
    saved = sum(layer["bytes_fused_saving"] for layer in layers.values())
    assert steps["flow"]["bytes"] - steps["flow_fused"]["bytes"] == pytest.approx(saved / 2)


def test_achieved_fraction_is_the_rate_over_the_methods_bound(emnist, tmp_path, capsys):
    import json
    result = {"conv_impl": "xla", "compute_dtype": "float32", "models": {"emnist_cnn": {
        "rows": [{"method": "fedavg", "mapping": "vmap", "client_steps_per_s": 6850.0},
                 {"method": "flow", "mapping": "vmap", "client_steps_per_s": 3876.0},
                 {"method": "fedavg+steps_per_loop=10", "mapping": "vmap",
                  "client_steps_per_s": 7000.0}]}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(result))
    layers = roofline.model_formulas(emnist, 20, im2col=False)
    reports = {("emnist_cnn", "xla"): {"steps": roofline.step_totals(layers, 1000, 20)}}
    rows = roofline.achieved(reports, [str(path)], "h100")
    steps = reports[("emnist_cnn", "xla")]["steps"]
    assert [row["method"] for row in rows] == ["fedavg", "flow", "fedavg+steps_per_loop=10"]
    # The variant (another loop shape) against its method's bound.
    for row, rate, method in zip(rows, (6850.0, 3876.0, 7000.0), ("fedavg", "flow", "fedavg")):
        limit = 3.35e12 / steps[method]["bytes"]  # memory-bound
        assert row["bound"] == pytest.approx(limit)
        assert row["fraction"] == pytest.approx(rate / limit)
    assert "| run.json | emnist_cnn | fedavg | vmap | 6,850 |" in capsys.readouterr().out


@pytest.mark.parametrize("compute_dtype, reread_bytes", [("float32", 4e8), ("bfloat16", 2e8)])
def test_the_recurrent_weights_re_reads_are_bf16_sized_under_bf16_compute(
        compute_dtype, reread_bytes, tmp_path):
    import json
    result = {"compute_dtype": compute_dtype, "models": {"stackoverflow_lstm": {
        "rows": [{"method": "fedavg", "mapping": "vmap", "client_steps_per_s": 1000.0}]}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(result))
    step = {"flops": 1e9, "bytes": 1e8, "bytes_rereads": 4e8}  # memory-bound on an H100
    reports = {("stackoverflow_lstm", "xla"): {"steps": {"fedavg": step}}}
    (row,) = roofline.achieved(reports, [str(path)], "h100")
    assert row["bound"] == pytest.approx(3.35e12 / 1e8)
    assert row["bound_rereads"] == pytest.approx(3.35e12 / (1e8 + reread_bytes))
