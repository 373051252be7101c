r"""Roofline per model: FLOPs and bytes per client-step of each layer with per-client weights.

  python launch/roofline.py                          # formulas + XLA's cost analysis, markdown
  python launch/roofline.py --results=a.json,b.json  # + achieved fractions of benchmark runs

For the EMNIST CNN (batch 20) and the Stack Overflow LSTM (batch 16, 20 tokens) it prints:

1. per routed layer, FLOPs and bytes of one client-step (forward, backward, SGD update)
   by formula, beside XLA's compiled cost analysis of the same layer on this backend
   (``jax.jit(f).lower(...).compile().cost_analysis()``);
2. per method (FedAvg; Flow, whose client-step is half a local step and half a routing
   step: the policy step and the global step through both branches; ``flow_fused``, Flow
   with each layer's two branches in one product where its input outweighs its weights),
   the client-step by
   formula and XLA's cost of the whole client update (its loops count once: one step of
   each phase);
3. the bound on an H100 and an H200 from the datasheets' peak bandwidth and tensor-core
   throughput: client-steps/s <= 1 / max(FLOPs / peak FLOP/s, bytes / peak bandwidth);
4. with ``--results`` (``launch/benchmark.py --json_out`` files), each row's achieved
   fraction of its method's bound on ``--device``.

Bytes are the fewest a client-step must move through device memory: each per-client
weight read in the forward and the backward pass, its gradient written, the update reading
both and writing the weight (5 weight-sized passes; 4 where no input gradient is needed),
each layer's input and output activation written once and read back by the backward pass,
and the im2col patches where that formulation materializes them. An LSTM whose recurrent
weights leave the cache re-reads them at every time step: that traffic is listed apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg  # noqa: E402
from flowjax.algorithms.flow import FlowConfig, flow  # noqa: E402
from flowjax.core.cohort import ClientExamples  # noqa: E402
from flowjax.models import get_model  # noqa: E402
from flowjax.routing.routed import input_outweighs_weights  # noqa: E402
from flowjax.validation import example_input  # noqa: E402
from launch import cli  # noqa: E402

F32 = 4  # bytes
BATCH = {"emnist_cnn": 20, "stackoverflow_lstm": 16}
POLICY = {"emnist_cnn": (350, 150, 50, 50), "stackoverflow_lstm": (64, 64, 32, 16)}

# Datasheet peaks (dense, i.e. without the 2:4 sparsity the datasheets quote first):
# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, TF32 tensor core
# 989 TFLOPS and BF16 1,979 TFLOPS with sparsity (494.5 / 989.5 dense), GPU memory
# bandwidth 3.35 TB/s (80 GB HBM3); NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the
# same compute, 4.8 TB/s (141 GB HBM3e).
PEAKS = {
    "h100": {"name": "H100 SXM 80GB", "bandwidth": 3.35e12, "fp32": 67e12, "tf32": 494.5e12,
             "bf16": 989.5e12},
    "h200": {"name": "H200 SXM 141GB", "bandwidth": 4.8e12, "fp32": 67e12, "tf32": 494.5e12,
             "bf16": 989.5e12},
}


# ----------------------------------------------------------------------------- formulas


def layer_shapes(model, batch: int) -> list[tuple[str, dict, tuple, tuple]]:
    """``(name, param shapes, input shape, output shape)`` of each routed layer."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = example_input(model, batch)
    h = jax.eval_shape(model.embed_input, x)
    out = []
    for j, name in enumerate(model.layer_names):
        y = jax.eval_shape(lambda p, h, j=j: model.layer_apply(j, p, h), params[name], h)
        out.append((name, jax.tree.map(lambda a: a.shape, params[name]), h.shape, y.shape))
        h = jax.eval_shape(lambda y, j=j: model.glue_apply(j, y, False, jax.random.key(0)), y)
    return out


def layer_formula(shapes: dict, in_shape: tuple, out_shape: tuple, *, input_grad: bool,
                  im2col: bool = False) -> dict:
    """FLOPs and fewest bytes of one client-step of one layer (see the module docstring)."""
    n_params = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(
        s, tuple)))
    w = F32 * n_params
    a_in = F32 * math.prod(in_shape)
    a_out = F32 * math.prod(out_shape)
    extra, rereads = 0, 0
    if "embedding" in shapes:  # a gather forward, a scatter-add into a dense gradient
        fwd = dw = dx = 0  # int32 ids in: a_in is their 4 bytes each
    elif "recurrent_kernel" in shapes:
        features, gates = shapes["kernel"]
        hidden = shapes["recurrent_kernel"][0]
        rows = math.prod(in_shape[:-1])  # batch x time
        fwd = 2 * rows * (features + hidden) * gates
        dw = fwd
        dx = 2 * rows * (features if input_grad else 0) * gates + 2 * rows * hidden * gates
        extra = F32 * rows * (gates + 2 * hidden) * 2  # gates, h and c: written, read back
        rereads = 2 * in_shape[1] * F32 * hidden * gates  # W_h per time step, fwd and bwd
    else:
        kernel = shapes["kernel"]
        k, n = math.prod(kernel[:-1]), kernel[-1]
        m = math.prod(out_shape[:-1])
        fwd = 2 * m * k * n
        dw = fwd
        dx = fwd if input_grad else 0
        if im2col and len(kernel) == 4:
            patches = F32 * m * k
            extra = patches * (3 + (2 if input_grad else 0))
    update = 2 * n_params
    # FlowConfig.fuse_branches (routing.routed.shares_input): where the input holds more
    # values than the weights, each routing sub-step (policy, global) reads the input and
    # the patches once for both branches and writes one input gradient, and copies both
    # weights into a stack (read and written): per routing step, two such sub-steps.
    fused_saving = 0
    if input_outweighs_weights(n_params, math.prod(in_shape)):
        fused_saving = 2 * ((2 if input_grad else 1) * a_in - 4 * w + extra)
    bytes_fwd = w + a_in + a_out
    bytes_dx = (a_out + w + a_in) if input_grad else 0  # read dy and W, write dx
    bytes_dw = a_out + a_in + w  # read dy and x, write dW
    return {"params": n_params, "flops_fwd": fwd, "flops_bwd": dx + dw, "flops_dx": dx,
            "flops_dw": dw, "flops_update": update, "bytes_fwd": bytes_fwd,
            "bytes_bwd": bytes_dx + bytes_dw, "bytes_dx": bytes_dx, "bytes_dw": bytes_dw,
            "bytes_update": 3 * w, "bytes_extra": extra, "bytes_weight_rereads": rereads,
            "bytes_fused_saving": fused_saving}


def model_formulas(model, batch: int, im2col: bool) -> dict[str, dict]:
    layers = {}
    for j, (name, shapes, in_shape, out_shape) in enumerate(layer_shapes(model, batch)):
        # The first routed layer reads data (images, token ids): no input gradient.
        layers[name] = layer_formula(shapes, in_shape, out_shape, input_grad=j > 0,
                                     im2col=im2col)
    return layers


def step_totals(layers: dict[str, dict], policy_params: int, batch: int) -> dict[str, dict]:
    """FedAvg's client-step and Flow's (mean of a local and a routing step), by formula.

    Flow's routing step = a policy step (both branches forward, input gradients back
    through both, no weight gradient) + a global step (both branches forward, input
    gradients through both, weight gradients and update of the global branch); the
    policy (an MLP on the input) runs forward in both and backward in the first.
    ``flow_fused`` is Flow with ``FlowConfig.fuse_branches`` (``layer_formula``'s saving).
    """
    def total(key):
        return sum(layer[key] for layer in layers.values())

    fwd, dx, dw, upd = (total(k) for k in ("flops_fwd", "flops_dx", "flops_dw", "flops_update"))
    b_fwd, b_dx, b_dw, b_upd = (total(k) for k in ("bytes_fwd", "bytes_dx", "bytes_dw",
                                                    "bytes_update"))
    b_extra, rereads = total("bytes_extra"), total("bytes_weight_rereads")
    fedavg = {"flops": fwd + dx + dw + upd, "bytes": b_fwd + b_dx + b_dw + b_upd + b_extra,
              "bytes_rereads": rereads}
    # Routing step: 4 forward and 4 input-gradient passes (2 branches x 2 steps), 1 weight-
    # gradient pass and update (global branch); the policy forward twice, backward once
    # (about twice its forward) and its update.
    policy_fwd = 2 * batch * policy_params
    routing = {"flops": 4 * fwd + 4 * dx + dw + upd + 4 * policy_fwd + 2 * policy_params,
               "bytes": 4 * b_fwd + 4 * b_dx + b_dw + b_upd + 4 * b_extra
               + 6 * F32 * policy_params,
               "bytes_rereads": 4 * rereads}
    flow_step = {k: (fedavg[k] + routing[k]) / 2 for k in fedavg}
    # flow_fused: the same FLOPs; the fused layers' routing passes move fewer bytes.
    fused_routing = {**routing, "bytes": routing["bytes"] - total("bytes_fused_saving")}
    flow_fused = {k: (fedavg[k] + fused_routing[k]) / 2 for k in fedavg}
    return {"fedavg": fedavg, "flow": flow_step, "flow_fused": flow_fused}


# ----------------------------------------------------------------------------- XLA


def cost(fn, *args) -> dict[str, float]:
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {"flops": float(analysis.get("flops", 0.0)),
            "bytes": float(analysis.get("bytes accessed", 0.0))}


def xla_layer_costs(model, batch: int) -> dict[str, dict]:
    """XLA's cost of each layer's forward, backward, and SGD update. XLA counts a loop's
    body once (the LSTM's recurrence: one of its time steps)."""
    params = model.init(jax.random.key(0))
    x = example_input(model, batch)
    h = jnp.zeros(x.shape, x.dtype)
    h = model.embed_input(h)
    out = {}
    for j, name in enumerate(model.layer_names):
        apply = lambda p, h, j=j: model.layer_apply(j, p, h)  # noqa: E731
        y = apply(params[name], h)
        g = jnp.ones_like(y)

        def fwd_bwd(p, h, g, apply=apply, j=j):
            # The output too, so the forward pass is not dead code: bwd = this - fwd.
            if j == 0:  # data in: the weight gradient only
                out, pullback = jax.vjp(lambda p: apply(p, h), p)
            else:
                out, pullback = jax.vjp(apply, p, h)
            return out, pullback(g)

        update = lambda p, d: jax.tree.map(lambda a, b: a - 0.1 * b, p, d)  # noqa: E731
        fwd = cost(apply, params[name], h)
        both = cost(fwd_bwd, params[name], h, g)
        out[name] = {"flops_fwd": fwd["flops"], "bytes_fwd": fwd["bytes"],
                     "flops_bwd": both["flops"] - fwd["flops"],
                     "bytes_bwd": both["bytes"] - fwd["bytes"],
                     **{f"{k}_update": v for k, v in cost(update, params[name],
                                                          params[name]).items()}}
        h = model.glue_apply(j, y, False, jax.random.key(0))
    return out


def xla_client_update_cost(algorithm, model, batch: int, clients: int = 1) -> dict[str, float]:
    """XLA's cost of one client update, per client (``clients`` vmapped); its local-step
    loops count once, so this is one step of each phase."""
    x = example_input(model, 2 * batch)
    x = jnp.zeros(x.shape, x.dtype)
    # Language models take a label per token, the others one per example.
    y = jnp.zeros(x.shape if model.policy_input == "tokens" else x.shape[:1], jnp.int32)
    steps = 2
    examples = ClientExamples(
        x=x.reshape((steps, batch) + x.shape[1:]), y=y.reshape((steps, batch) + y.shape[1:]),
        mask=jnp.ones((steps, batch), bool), num_examples=jnp.int32(2 * batch),
        client_id=jnp.int32(0))
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape), examples)
    params = algorithm.init(jax.random.key(0))

    def update(params, stacked):
        return jax.vmap(lambda ex: algorithm.client_update(params, ex, jax.random.key(0)).params
                        )(stacked)

    total = cost(update, params, stacked)
    return {k: v / clients for k, v in total.items()}


# ----------------------------------------------------------------------------- report


def bound(step: dict, peaks: dict, compute: str) -> dict[str, float]:
    t_flops = step["flops"] / peaks[compute]
    t_bytes = step["bytes"] / peaks["bandwidth"]
    return {"client_steps_per_s": 1.0 / max(t_flops, t_bytes),
            "limit": "memory" if t_bytes >= t_flops else "compute",
            "t_flops_us": 1e6 * t_flops, "t_bytes_us": 1e6 * t_bytes}


def fmt(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".strip()


def model_report(name: str, conv_impl: str, xla: bool) -> dict:
    options = {"conv_impl": conv_impl} if name == "emnist_cnn" else {}
    model = get_model(name, **options)
    batch = BATCH[name]
    layers = model_formulas(model, batch, im2col=conv_impl == "im2col")
    x = example_input(model, batch)
    example = jnp.zeros(x.shape, x.dtype)
    sgd = SGDConfig(learning_rate=0.1, epochs=1, batch_size=batch)
    methods = {"fedavg": fedavg(model, FedAvgConfig(sgd=sgd)),
               **{method: flow(model, FlowConfig(sgd=sgd, gamma=1e-3, policy_hidden=POLICY[name],
                                                 fuse_branches=method == "flow_fused"), example)
                  for method in ("flow", "flow_fused")}}
    flow_params = methods["flow"].init(jax.random.key(0))
    policy_params = sum(a.size for a in jax.tree.leaves(flow_params["policy"]))
    steps = step_totals(layers, policy_params, batch)
    report = {"model": name, "batch": batch, "conv_impl": conv_impl, "layers": layers,
              "steps": steps, "policy_params": policy_params}
    if xla:
        report["xla_backend"] = jax.default_backend()
        report["xla_layers"] = xla_layer_costs(model, batch)
        whole = {m: xla_client_update_cost(a, model, batch) for m, a in methods.items()}
        # FedAvg's update holds one step; Flow's one local and one routing step.
        report["xla_steps"] = {"fedavg": whole["fedavg"],
                               **{m: {k: v / 2 for k, v in whole[m].items()}
                                  for m in ("flow", "flow_fused")}}
    return report


def print_report(report: dict) -> None:
    name, layers = report["model"], report["layers"]
    xla = report.get("xla_layers", {})
    print(f"\n### {name}, batch {report['batch']}"
          + (f", conv_impl={report['conv_impl']}" if name == "emnist_cnn" else "")
          + ": per client-step, per routed layer\n")
    print("| layer | params | FLOPs fwd | FLOPs bwd | FLOPs update | bytes fwd | bytes bwd | "
          "bytes update | extra bytes | XLA FLOPs fwd / bwd | XLA bytes fwd / bwd / update |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layer, f in layers.items():
        x = xla.get(layer)
        extra = f["bytes_extra"] + f["bytes_weight_rereads"]
        xla_cols = (f"{fmt(x['flops_fwd'])} / {fmt(x['flops_bwd'])} | {fmt(x['bytes_fwd'], 'B')} / "
                    f"{fmt(x['bytes_bwd'], 'B')} / {fmt(x['bytes_update'], 'B')}") if x else "- | -"
        print(f"| {layer} | {f['params']:,} | {fmt(f['flops_fwd'])} | {fmt(f['flops_bwd'])} | "
              f"{fmt(f['flops_update'])} | {fmt(f['bytes_fwd'], 'B')} | {fmt(f['bytes_bwd'], 'B')} "
              f"| {fmt(f['bytes_update'], 'B')} | {fmt(extra, 'B') if extra else '-'} | {xla_cols} |")
    print(f"\n{name}: per client-step and bound (datasheet peaks; compute at TF32 tensor-core "
          "rate, bf16 in brackets)\n")
    print("| method | FLOPs | bytes (fewest) | XLA FLOPs | XLA bytes | H100 bound client-steps/s "
          "| H200 bound client-steps/s |")
    print("|---|---|---|---|---|---|---|")
    for method, step in report["steps"].items():
        x = report.get("xla_steps", {}).get(method)
        cells = []
        for device in ("h100", "h200"):
            tf32, bf16 = (bound(step, PEAKS[device], c) for c in ("tf32", "bf16"))
            cells.append(f"{tf32['client_steps_per_s']:,.0f} ({tf32['limit']}) "
                         f"[{bf16['client_steps_per_s']:,.0f}]")
        print(f"| {method} | {fmt(step['flops'])} | {fmt(step['bytes'], 'B')} | "
              f"{fmt(x['flops']) if x else '-'} | {fmt(x['bytes'], 'B') if x else '-'} | "
              f"{cells[0]} | {cells[1]} |")
    rereads = report["steps"]["fedavg"]["bytes_rereads"]
    if rereads:
        slow = {m: {**s, "bytes": s["bytes"] + s["bytes_rereads"]}
                for m, s in report["steps"].items()}
        print(f"\nIf the recurrent weights are re-read from memory every time step "
              f"(+{fmt(rereads, 'B')} per FedAvg client-step): bound " + ", ".join(
                  f"{m} {bound(s, PEAKS[d], 'tf32')['client_steps_per_s']:,.0f} on {d.upper()}"
                  for m, s in slow.items() for d in ("h100", "h200")))


def achieved(reports: dict, result_files: list[str], device: str) -> list[dict]:
    """Each benchmark row's useful client-steps/s over its method's bound on ``device``."""
    rows = []
    print(f"\nAchieved fraction of the bound on {PEAKS[device]['name']} (TF32 compute; "
          "bf16 rows against the bf16 rate)\n")
    print("| run | model | method | mapping | useful client-steps/s | bound | fraction | "
          "bound, W_h re-read per time step | fraction |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in result_files:
        result = json.load(open(path))
        compute = "bf16" if result.get("compute_dtype") == "bfloat16" else "tf32"
        for model_name, model in result["models"].items():
            impl = result.get("conv_impl", "auto")  # "auto" is "xla" (resolve_conv_impl)
            # im2col_slices builds and folds the same patches as im2col: the same bytes.
            key = (model_name, "im2col" if impl in ("im2col", "im2col_slices")
                   and model_name == "emnist_cnn" else "xla")
            if key not in reports:
                continue
            for row in model["rows"]:
                # A benchmark variant (``flow+lstm_unroll=20``) changes the loop's shape, not
                # the bytes or FLOPs a client-step must move: its method's bound.
                step = reports[key]["steps"].get(row["method"].split("+")[0])
                if step is None:
                    continue
                limit = bound(step, PEAKS[device], compute)["client_steps_per_s"]
                rate = row["client_steps_per_s"]
                reread = None
                if step["bytes_rereads"]:
                    # bf16 compute re-reads the recurrent weight's bf16 copy: half the bytes.
                    rereads = step["bytes_rereads"] / (2 if compute == "bf16" else 1)
                    reread = bound({**step, "bytes": step["bytes"] + rereads},
                                   PEAKS[device], compute)["client_steps_per_s"]
                rows.append({"run": os.path.basename(path), "model": model_name,
                             "method": row["method"], "mapping": row["mapping"],
                             "rate": rate, "bound": limit, "fraction": rate / limit,
                             "bound_rereads": reread})
                extra = (f"{reread:,.0f} | {rate / reread:.3f}" if reread else "- | -")
                print(f"| {os.path.basename(path)} | {model_name} | {row['method']} | "
                      f"{row['mapping']} | {rate:,.0f} | {limit:,.0f} | {rate / limit:.3f} | "
                      f"{extra} |")
    return rows


def measure_ceilings() -> dict[str, float]:
    """This device's copy bandwidth (bytes read + written per second) and matmul rates
    (float32 at JAX's default precision, bf16), medians of 10 after a warm-up."""
    import statistics
    import time

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    x = jax.random.normal(jax.random.key(0), (256, 1024, 1024), jnp.float32)  # 1 GiB
    copy = timed(jax.jit(lambda a: a * 1.0001), x)
    out = {"copy_bytes_per_s": 2 * x.nbytes / copy}
    del x
    n = 8192
    for name, dtype in (("matmul_f32_default_flops", jnp.float32),
                        ("matmul_bf16_flops", jnp.bfloat16)):
        a = jax.random.normal(jax.random.key(1), (n, n), dtype)
        b = jax.random.normal(jax.random.key(2), (n, n), dtype)
        out[name] = 2 * n ** 3 / timed(jax.jit(jnp.matmul), a, b)
    return out


def hlo_inventory(conv_impl: str, clients: int = 100, batch: int = 20) -> dict[str, int]:
    """What XLA made of a vmapped FedAvg client update of the EMNIST CNN: its library
    calls (cuDNN convolutions, cuBLAS GEMMs) and grouped convolutions, from the compiled
    HLO text."""
    import re
    model = get_model("emnist_cnn", conv_impl=conv_impl)
    algorithm = fedavg(model, FedAvgConfig(sgd=SGDConfig(learning_rate=0.1, epochs=1,
                                                         batch_size=batch)))
    x = jnp.zeros((clients, 2, batch, 28, 28))
    examples = ClientExamples(x=x, y=jnp.zeros((clients, 2, batch), jnp.int32),
                              mask=jnp.ones((clients, 2, batch), bool),
                              num_examples=jnp.full((clients,), 2 * batch, jnp.int32),
                              client_id=jnp.arange(clients, dtype=jnp.int32))
    params = algorithm.init(jax.random.key(0))
    text = jax.jit(lambda p, ex: jax.vmap(
        lambda e: algorithm.client_update(p, e, jax.random.key(0)).params)(ex)).lower(
            params, examples).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    counts = {t: targets.count(t) for t in sorted(set(targets))}
    groups = re.findall(r"feature_group_count=(\d+)", text)
    counts["convolutions with feature_group_count > 1"] = sum(int(g) > 1 for g in groups)
    counts["convolution ops"] = len(re.findall(r"= [^ ]+ convolution\(", text))
    counts["dot ops"] = len(re.findall(r"= [^ ]+ dot\(", text))
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` when ``argv`` is None); exits 2 on a bad flag."""
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="emnist_cnn,stackoverflow_lstm",
                        help="comma-separated; empty: none")
    parser.add_argument("--no_xla", action="store_true", help="formulas only")
    parser.add_argument("--results", default="", help="benchmark.py --json_out files")
    parser.add_argument("--device", default="h100", choices=sorted(PEAKS))
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--ceilings", action="store_true",
                        help="also measure this device's copy bandwidth and matmul rates")
    parser.add_argument("--inventory", action="store_true",
                        help="also list the library calls of a vmapped EMNIST client update")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    print(f"jax {jax.__version__}, XLA cost analysis on {jax.devices()[0].device_kind} "
          f"({jax.default_backend()})")
    out = {}
    if args.ceilings:
        out["ceilings"] = measure_ceilings()
        print("measured ceilings: " + ", ".join(f"{k} {v / 1e12:.2f} T"
                                                for k, v in out["ceilings"].items()), flush=True)
    if args.inventory:
        out["inventory"] = {}
        for impl in ("xla", "im2col"):
            out["inventory"][impl] = hlo_inventory(impl)
            print(f"compiled HLO of a vmapped FedAvg client update, 100 clients, "
                  f"conv_impl={impl}: {out['inventory'][impl]}", flush=True)
    reports = {}
    for name in filter(None, args.models.split(",")):
        impls = ("xla", "im2col") if name == "emnist_cnn" else ("xla",)
        for impl in impls:
            reports[(name, impl)] = model_report(name, impl, xla=not args.no_xla)
            print_report(reports[(name, impl)])
    out["reports"] = {f"{m}/{i}": r for (m, i), r in reports.items()}
    if args.results:
        out["achieved"] = achieved(reports, args.results.split(","), args.device)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    main()
