#!/usr/bin/env bash
# Issue 16's GPU measurements in one device call: every run under `timeout`, inside one time
# budget; raw output to $OUT (gpu_bench.log + raw.tgz with each run's text and JSON).
#
#   bash launch/gpu_bench.sh
#
# Environment:
#   NEW       code to measure (default: .), e.g. a `git archive HEAD` copy
#   BASE      today's code, the baseline rerun in the same call (default: .baseline, made
#             on the host with `git archive <commit> flowjax launch | tar -x -C .baseline`)
#   BUDGET_S  seconds for all runs together (default 450); a run gets at most what is left
#   PY        the Python with jax[cuda], one executable without arguments (default:
#             python3, the device image's; that image lacks ml_collections, so the call
#             carries its wheel: see docs/benchmarks/gpu-h100-2026-11-27.md for the command)
# Stack Overflow at 64 skewed clients (the baseline, then the LSTM with no time loop), EMNIST
# (the centralized step, FedAvg and fused Flow, with and without 10 local steps per loop
# iteration), Stack Overflow's profile, its rows with 4 steps per loop iteration, its step
# parts, its unrolled rows at more chunk sizes, the pool check at the highest matmul
# precision; then EMNIST with loops
# as command buffers, bf16 EMNIST, EMNIST's profile and step parts; then what earlier calls
# measured once: bf16 Stack Overflow, the determinism check, command buffers over Stack
# Overflow's loops, cuDNN's convolutions, a bf16 1,000-client Flow round, the mixed-state
# recurrence's VJP against autodiff and the roofline.
set -u
OUT=${OUT:-/tmp/gpu_bench_out}
NEW=$(cd "${NEW:-.}" && pwd)
BASE=$(cd "${BASE:-.baseline}" 2>/dev/null && pwd || echo "")
BUDGET_S=${BUDGET_S:-450}
PY=${PY:-python3}
RAW=$OUT/raw
LOG=$OUT/gpu_bench.log
mkdir -p "$RAW"
export FLOWJAX_XLA_TUNING=0 PYTHONUNBUFFERED=1
START=$(date +%s)

step() {  # step NAME TIMEOUT_S CODE_DIR ARGS...: `$PY ARGS` in CODE_DIR, if budget is left
  local name=$1 limit=$2 dir=$3
  shift 3
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if ((left < 25)); then
    echo "## $name: skipped, ${left} s of the budget left" | tee -a "$LOG"
    return
  fi
  ((limit > left)) && limit=$left
  echo "## $name (timeout ${limit} s, code $dir): $PY $*" | tee -a "$LOG"
  local t0=$(date +%s)
  (cd "$dir" && PYTHONPATH=. timeout "$limit" "$PY" "$@") >"$RAW/$name.txt" 2>&1
  local rc=$?
  grep -v -e "^W0000" -e "^I0000" -e "^WARNING: All log messages" "$RAW/$name.txt" >>"$LOG"
  echo "## $name: rc=$rc, $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

{
  echo "# launch/gpu_bench.sh, $(date -u +%FT%TZ), budget ${BUDGET_S} s"
  echo "# code: $NEW; baseline: ${BASE:-none}"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,power.limit,driver_version --format=csv
  nvidia-smi
} >>"$LOG" 2>&1
step versions 60 "$NEW" -c "
import jax, jaxlib, flax, optax, numpy
d = jax.devices()[0]
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__,
      'optax', optax.__version__, 'numpy', numpy.__version__)
print('device', d.device_kind, 'platform', d.platform, 'memory_stats', d.memory_stats())
try:
    import torch
    print('torch', torch.__version__, torch.cuda.get_device_properties(0))
except Exception as error:
    print('torch properties unavailable:', error)
"

# In priority order; a step that no longer fits the budget is skipped. Each target is a
# ratio within this call: Stack Overflow at 64 skewed clients against today's code (BASE),
# then EMNIST at 100 clients under the GPU's conv formulation. The timeouts leave room for
# compiling: on 2026-11-27b (docs/benchmarks/gpu-h100-2026-11-27b.md) the loop-shape
# variants compiled for so long that two steps were cut; each row now prints its first
# round's seconds, compiling included.
SO64=(--models=stackoverflow_lstm --skewed --clients=64)
if [[ -n "$BASE" ]]; then
  # Today's mapping (sorted chunks of 4) in today's code: the target's denominator.
  step so64_baseline 80 "$BASE" launch/benchmark.py "${SO64[@]}" --strategies=chunked --chunk_size=4 --nopython_loop --nocentralized --repeats=2 --json_out="$RAW/so64_baseline.json"
fi
# chunked:19 is memory_plan.chunk_for_sizes's pick for these 64 sizes. +lstm_unroll=20:
# the LSTM's 20 time steps with no loop, forward and backward (config.lstm_unroll). On
# 2026-11-27b it ran FedAvg 1.51x and Flow 1.63x over the baseline, each in a different
# call; here both in one, with what they cost to compile.
step so64_unroll 220 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --algorithms=fedavg+lstm_unroll=20,flow+lstm_unroll=20 --json_out="$RAW/so64_unroll.json"
BENCH=(launch/benchmark.py --repeats=3)
EMNIST=(--models=emnist_cnn --clients=100 --steps=10 --strategies=vmap --nopython_loop)
# The centralized step first (the target's denominator, printed before the rows), then
# FedAvg and Flow with fused branches (FlowConfig.fuse_branches; Flow / FedAvg <= 1.5x is
# the target), each also with its 10 local steps in one loop iteration
# (config.sgd.steps_per_loop, now an inner loop of known trip count; its first form, ten
# unrolled steps, gained FedAvg 1.05x on 2026-11-27b and did not compile for fused Flow in
# time; the 2026-11-27 trace had the device idle 9.5% of the round while the host read
# each iteration's condition).
step emnist_slices 200 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=im2col_slices --algorithms=fedavg,flow_fused,fedavg+steps_per_loop=10,flow_fused+steps_per_loop=10 --json_out="$RAW/emnist_slices.json"
# Where the time goes (launch/trace_summary.py): one more execution of a round,
# compiled ahead of time, traced by JAX's profiler; each row prints the device's busy and
# idle time, op time by kind and by layer, and its top kernels (into the .txt and JSON).
# Stack Overflow's never traced so far: FedAvg's round with no time loop, today's best.
# The traces themselves stay in raw.tgz only while it fits what a device call returns.
PROFILE=(--nopython_loop --nocentralized --nowarmup --repeats=1)
step profile_so64 100 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 "${PROFILE[@]}" --algorithms=fedavg+lstm_unroll=20 --profile_dir="$RAW/profile_so64" --json_out="$RAW/profile_so64.json"
# With steps_per_loop=4 each chunk's data-dependent step loop runs a quarter as many
# iterations (the inner loop of 4 has a trip count XLA knows: no condition read, no wait);
# the fitted fixed cost per chunk-step is ~1 ms (FedAvg) / ~2.4 ms (Flow).
step so64_grouped 150 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --algorithms=fedavg+lstm_unroll=20+steps_per_loop=4,flow+lstm_unroll=20+steps_per_loop=4 --json_out="$RAW/so64_grouped.json"
# What one vmapped step of 19 clients costs part by part, each part its own program with
# no loop (layers' forward and backward, the loss, the update, the recurrence's products
# alone), float32 and bf16: the per-slot cost without a profiler.
step so_parts 90 "$NEW" launch/step_parts.py --model=stackoverflow_lstm --clients=19 --compute_dtypes=float32,bfloat16 --json_out="$RAW/so_parts.json"
# With no time loop a chunk-step's fixed cost should fall, and smaller chunks (less
# padding) could win: rows to refit launch/chunk_costs.py's two costs (on the host:
#   python launch/chunk_costs.py --results=so64_unroll.json,so64_unroll_chunks.json \
#       --algorithm=fedavg+lstm_unroll=20).
step so64_unroll_chunks 160 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:4,chunked:8,chunked:32 --nopython_loop --nocentralized --repeats=2 --algorithms=fedavg+lstm_unroll=20 --json_out="$RAW/so64_unroll_chunks.json"
# On 2026-11-27b both pools' gradients were 7.9e-2 off float64 on the H100 (1e-6 and 54%
# on the CPU under the launchers' flag): the pool is not it. At the highest matmul
# precision (no TF32 products), does the deviation go?
step pool_gradient 60 "$NEW" "$NEW/tests/routed_pool_gradient.py" highest
# The same loop kept on the device instead: XLA's command buffers over loops (CUDA graphs'
# conditional nodes); on Stack Overflow they lost (roofline.md), on EMNIST never timed.
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" step emnist_cmdbuf 110 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=im2col_slices --algorithms=fedavg,flow_fused --json_out="$RAW/emnist_cmdbuf.json"
step emnist_slices_bf16 150 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=im2col_slices --compute_dtype=bfloat16 --algorithms=fedavg,flow_fused,fedavg+steps_per_loop=10,flow_fused+steps_per_loop=10 --json_out="$RAW/emnist_slices_bf16.json"
step profile_emnist 100 "$NEW" launch/benchmark.py "${EMNIST[@]}" "${PROFILE[@]}" --conv_impl=im2col_slices --algorithms=fedavg,flow,flow_fused --profile_dir="$RAW/profile_emnist" --json_out="$RAW/profile_emnist.json"
step emnist_parts 80 "$NEW" launch/step_parts.py --model=emnist_cnn --clients=100 --compute_dtypes=float32,bfloat16 --json_out="$RAW/emnist_parts.json"
find "$RAW" \( -name '*.xplane.pb' -o -name 'round.hlo.txt' \) -delete 2>/dev/null

# Measured once by earlier calls (docs/benchmarks/gpu-h100-2026-11-2{6,7}.md): bf16 Stack
# Overflow (no gain), the determinism check (bit for bit), command buffers over Stack
# Overflow's loops, cuDNN's grouped convolutions, the device's ceilings; and a bf16
# 1,000-client Flow round (never reached so far).
step so64_bf16 90 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --compute_dtype=bfloat16 --json_out="$RAW/so64_bf16.json"
# Same seed, same numbers on the GPU? The same FedAvg and Flow rounds twice, compared bit
# for bit (the CNN's convolutions and the LSTM's embedding gradient may sum with atomics).
step determinism 80 "$NEW" launch/determinism_check.py --json_out="$RAW/determinism.json"

# The fixed cost of a chunk-step (docs/benchmarks/roofline.md, launch/chunk_costs.py: ~1 ms
# FedAvg, ~2.4 ms Flow) bounds any mapping at 1.83x / 1.89x over chunks of 4; XLA's command
# buffers (CUDA graphs) extended to loops target that launch overhead (2026-11-27: no gain,
# chunks of 4 slower: FedAvg 0.618 s vs 0.586 s in today's code). Chunks of 4 and 19,
# so the fit can be redone from this call's rows (on the host, after the call):
#   python launch/chunk_costs.py --results=so64_cmdbuf.json --algorithm=flow
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" step so64_cmdbuf 110 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:4,chunked:19 --nopython_loop --nocentralized --repeats=2 --json_out="$RAW/so64_cmdbuf.json"
step emnist_xla 100 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=xla --json_out="$RAW/emnist_xla.json"
SO1000=(launch/benchmark.py --models=stackoverflow_lstm --skewed --clients=1000 --epochs=3 --strategies=planned --nopython_loop --nocentralized --nowarmup --repeats=1 --project_rounds=2000)
step so1000_flow_bf16 170 "$NEW" "${SO1000[@]}" --algorithms=flow --compute_dtype=bfloat16 --json_out="$RAW/so1000_flow_bf16.json"
# Flow's mixed-state LSTM recurrence (FlowConfig.recurrence='mixed_state'; off by default)
# with its hand-written VJP, beside the same method under autodiff (+custom_grad=0) and the
# default Flow, in one process: on the 2-core CPU the VJP ran its Shakespeare round 1.37x
# faster under loop, Stack Overflow's 1.13x under vmap and no faster under loop
# (docs/benchmarks/cpu-mixed-state-vjp.md); never timed on a GPU.
step so64_mixed_state 150 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --algorithms=flow,flow_mixed_state,flow_mixed_state+custom_grad=0 --json_out="$RAW/so64_mixed_state.json"
step roofline 70 "$NEW" launch/roofline.py --models=emnist_cnn,stackoverflow_lstm --json_out="$RAW/roofline_gpu.json"

echo "# done after $(($(date +%s) - START)) s" | tee -a "$LOG"
tar czf "$OUT/raw.tgz" -C "$OUT" raw
# A device call returns files of at most 16 MiB: without the traces if they do not fit.
if (($(stat -c %s "$OUT/raw.tgz") > 15 * 1024 * 1024)); then
  echo "# raw.tgz over 15 MiB: packed again without the *.trace.json.gz files" | tee -a "$LOG"
  tar czf "$OUT/raw.tgz" --exclude='*.trace.json.gz' -C "$OUT" raw
fi
rm -rf "$RAW"
