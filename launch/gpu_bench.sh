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
#             carries its wheel: see docs/benchmarks/gpu-h200-2026-12-04.md for the command)
# Stack Overflow at 64 skewed clients (the baseline, then the LSTM with no time loop), EMNIST
# (the centralized step, FedAvg with and without 10 local steps per loop iteration, fused
# Flow), Stack Overflow at the chunk sizes the H200's fit favours, a 1,000-client Flow
# round with no time loop, the determinism check, the mixed-state recurrence's VJP
# against autodiff, EMNIST with loops as command buffers, EMNIST's profile and step
# parts, the pool check at both matmul
# precisions, cuDNN's convolutions and the device's ceilings. What the H200 call of
# 2026-12-04 settled (bf16 EMNIST, 4 steps per loop iteration on Stack Overflow, Stack
# Overflow's profile and step parts) is no longer run.
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
# the H200 on 2026-12-04 (docs/benchmarks/gpu-h200-2026-12-04.md) FedAvg 1.72x and Flow
# 1.85x over the baseline in this step, compiled in 20 s / 63 s.
step so64_unroll 160 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --algorithms=fedavg+lstm_unroll=20,flow+lstm_unroll=20 --json_out="$RAW/so64_unroll.json"
BENCH=(launch/benchmark.py --repeats=3)
EMNIST=(--models=emnist_cnn --clients=100 --steps=10 --strategies=vmap --nopython_loop)
# The centralized step first (the target's denominator, printed before the rows), then
# FedAvg (also with its 10 local steps as one inner loop, config.sgd.steps_per_loop: 0.56
# -> 0.59 of centralized on 2026-12-04) and Flow with fused branches (FlowConfig.
# fuse_branches; Flow / FedAvg <= 1.5x is the target; 1.62x on 2026-12-04, and
# steps_per_loop changed nothing for it).
step emnist_slices 150 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=im2col_slices --algorithms=fedavg,fedavg+steps_per_loop=10,flow_fused --json_out="$RAW/emnist_slices.json"
# Chunks of 11 and 32 with no time loop. Fitted to 2026-12-04's rows (chunks of 4, 8, 19:
# 0.415 ms per chunk-step + 0.164 ms per client-step slot, within 0.3%), chunks of 11
# would run FedAvg's round in 0.277 s (1.88x the baseline's 0.522 s) against 19's 0.303 s;
# memory_plan.OVERHEAD_CLIENTS (10, from older rows) still picks 19. To refit on the host:
#   python launch/chunk_costs.py --results=so64_unroll.json,so64_unroll_chunks.json \
#       --algorithm=fedavg+lstm_unroll=20
step so64_unroll_chunks 90 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:11,chunked:32 --nopython_loop --nocentralized --repeats=2 --algorithms=fedavg+lstm_unroll=20 --json_out="$RAW/so64_unroll_chunks.json"
# The 1,000-client Flow round (paper sizes: 3 epochs, batch 16) with today's fastest LSTM
# (no time loop) at the memory planner's chunk size; the last measured was 30.5 s with
# the time loop, on an H100 (2026-11-26).
SO1000=(launch/benchmark.py --models=stackoverflow_lstm --skewed --clients=1000 --epochs=3 --strategies=planned --nopython_loop --nocentralized --nowarmup --repeats=1 --project_rounds=2000)
step so1000_flow_unroll 200 "$NEW" "${SO1000[@]}" --algorithms=flow+lstm_unroll=20 --json_out="$RAW/so1000_flow_unroll.json"
# Same seed, same numbers on the GPU? The same FedAvg and Flow rounds twice, compared bit
# for bit (the CNN's convolutions and the LSTM's embedding gradient may sum with atomics).
# On 2026-12-04 three of the four were identical and Stack Overflow Flow's was cut at 70 s.
step determinism 110 "$NEW" launch/determinism_check.py --json_out="$RAW/determinism.json"
# Flow's mixed-state LSTM recurrence (FlowConfig.recurrence='mixed_state'; off by default)
# with its hand-written VJP, beside the same method under autodiff (+custom_grad=0), both
# with no time loop like so64_unroll's Flow row: on the 2-core CPU the VJP ran its
# Shakespeare round 1.37x faster under loop, Stack Overflow's 1.13x under vmap and no
# faster under loop (docs/benchmarks/cpu-mixed-state-vjp.md); never timed on a GPU.
step so64_mixed_state 170 "$NEW" launch/benchmark.py "${SO64[@]}" --strategies=chunked:19 --nopython_loop --nocentralized --repeats=2 --algorithms=flow_mixed_state+lstm_unroll=20,flow_mixed_state+lstm_unroll=20+custom_grad=0 --json_out="$RAW/so64_mixed_state.json"
# XLA's command buffers over loops (CUDA graphs' conditional nodes), the loop kept on the
# device; on Stack Overflow they lost (roofline.md), on EMNIST never timed.
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" step emnist_cmdbuf 110 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=im2col_slices --algorithms=fedavg,flow_fused --json_out="$RAW/emnist_cmdbuf.json"
# Where EMNIST's time goes (launch/trace_summary.py): one more execution of a round,
# compiled ahead of time, traced by JAX's profiler (busy and idle time, op time by kind
# and by layer, top kernels; Stack Overflow's was taken on 2026-12-04), then one step's
# parts, each its own program (layers' forward and backward, the loss, the update).
PROFILE=(--nopython_loop --nocentralized --nowarmup --repeats=1)
step profile_emnist 100 "$NEW" launch/benchmark.py "${EMNIST[@]}" "${PROFILE[@]}" --conv_impl=im2col_slices --algorithms=fedavg,flow_fused --profile_dir="$RAW/profile_emnist" --json_out="$RAW/profile_emnist.json"
step emnist_parts 80 "$NEW" launch/step_parts.py --model=emnist_cnn --clients=100 --compute_dtypes=float32,bfloat16 --json_out="$RAW/emnist_parts.json"
find "$RAW" \( -name '*.xplane.pb' -o -name 'round.hlo.txt' \) -delete 2>/dev/null
# The routed CNN's gradient against float64 at JAX's default matmul precision: 7.9e-2 on
# the H100s, 5.7e-7 at the highest precision on the H200; both on one machine here.
step pool_gradient 40 "$NEW" "$NEW/tests/routed_pool_gradient.py"
step pool_gradient_highest 40 "$NEW" "$NEW/tests/routed_pool_gradient.py" highest
# Measured by earlier calls (docs/benchmarks/gpu-h100-2026-11-2{6,7}.md): cuDNN's grouped
# convolutions, the device's ceilings (never on an H200).
step emnist_xla 100 "$NEW" "${BENCH[@]}" "${EMNIST[@]}" --conv_impl=xla --json_out="$RAW/emnist_xla.json"
step roofline 100 "$NEW" launch/roofline.py --models=emnist_cnn,stackoverflow_lstm --ceilings --json_out="$RAW/roofline_gpu.json"

echo "# done after $(($(date +%s) - START)) s" | tee -a "$LOG"
tar czf "$OUT/raw.tgz" -C "$OUT" raw
# A device call returns files of at most 16 MiB: without the traces if they do not fit.
if (($(stat -c %s "$OUT/raw.tgz") > 15 * 1024 * 1024)); then
  echo "# raw.tgz over 15 MiB: packed again without the *.trace.json.gz files" | tee -a "$LOG"
  tar czf "$OUT/raw.tgz" --exclude='*.trace.json.gz' -C "$OUT" raw
fi
rm -rf "$RAW"
