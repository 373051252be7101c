"""The launchers as a user runs them (subprocesses, real flags)."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.data.plays=('macbeth',)", "--config.num_rounds=2", "--config.clients_per_round=3",
        "--config.data.max_train_examples=4", "--config.data.max_test_examples=4",
        "--config.eval.clients=4", "--config.eval.chunk=4", "--config.eval.held_out=False",
        "--config.methods.flow.policy_hidden=(8,8,8,8)"]
# The launchers' own behaviour (files, table, resume) does not depend on the dataset: these
# tests run them on the synthetic MLP task, whose programs compile in a fraction of the
# Shakespeare LSTM's time (test_multihost keeps TINY's Shakespeare runs through train.py).
SMALL = ["--config=configs/synthetic.py:quick", "--config.data.num_clients=12",
         "--config.num_rounds=2", "--config.clients_per_round=3", "--config.eval.clients=4",
         "--config.log_every=1"]


def launch(script, *args, env=None):
    return forkserver.run([sys.executable, os.path.join(ROOT, "launch", script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)


def own_compilation_cache(folder):
    """The environment of a launcher left to pick its own compilation cache (the test
    session's is dropped) in ``folder``, logging JAX's cache hits and misses."""
    session = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    env = {name: value for name, value in os.environ.items() if name not in session}
    return dict(env, FLOWJAX_COMPILATION_CACHE=str(folder),
                JAX_DEBUG_LOG_MODULES="jax._src.compiler")


def test_train_writes_results_and_prints_the_table(tmp_path):
    workdir = tmp_path / "run"
    env = own_compilation_cache(tmp_path / "cache")
    done = launch("train.py", f"--workdir={workdir}", *SMALL, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    for field in ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting", "breakdown", "num_eval_clients"):
        assert field in results
    run_info = json.loads((workdir / "run.json").read_text())
    assert run_info["compilations"] == {"round": 1, "eval": 1}
    # The code that ran: this checkout's commit (CI runs a clone), or None outside git.
    in_git = os.path.exists(os.path.join(ROOT, ".git"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() if in_git else None
    assert run_info["code"]["commit"] == commit
    assert run_info["code"]["version"] == importlib.metadata.version("flowjax")
    assert isinstance(run_info["code"]["dirty"], bool) == in_git
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["train", "train", "eval"]
    assert json.loads((workdir / "config.json").read_text())["num_rounds"] == 2
    assert "| flow | train_clients | 4 |" in done.stdout
    # The launcher kept every program it compiled; the same run again loads them all and
    # gives the same bytes.
    assert any(name.endswith("-cache") for name in os.listdir(tmp_path / "cache"))
    again = launch("train.py", f"--workdir={tmp_path / 'again'}", *SMALL, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Persistent compilation cache hit" in again.stderr
    assert "PERSISTENT COMPILATION CACHE MISS" not in again.stderr
    assert ((tmp_path / "again" / "results.json").read_bytes()
            == (workdir / "results.json").read_bytes())
    assert json.loads((tmp_path / "again" / "run.json").read_text())["compilations"] == {
        "round": 1, "eval": 1}


def test_run_json_names_the_code_the_process_imported(monkeypatch):
    """compare.py and reproduce.py run method after method in one process: a commit made
    meanwhile is not the code that process runs, so run.json must not name it."""
    from flowjax import runner
    imported = runner.code_version()
    monkeypatch.setattr(runner, "_git", lambda root, *args: "f" * 40 + "\n")
    assert runner.code_version() == imported


def test_compilation_cache_folder_follows_the_environment():
    from launch.xla_env import compilation_cache_dir
    assert compilation_cache_dir({}) == os.path.join(
        os.path.expanduser("~"), ".cache", "flowjax", "xla")
    assert compilation_cache_dir({"XDG_CACHE_HOME": "/c"}) == "/c/flowjax/xla"
    assert compilation_cache_dir({"FLOWJAX_COMPILATION_CACHE": "/d",
                                  "XDG_CACHE_HOME": "/c"}) == "/d"
    assert compilation_cache_dir({"FLOWJAX_COMPILATION_CACHE": "0"}) is None
    assert compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/j",
                                  "FLOWJAX_COMPILATION_CACHE": "0"}) == "/j"


def test_train_rejects_a_bad_value_in_one_line(tmp_path):
    done = launch("train.py", "--config=configs/shakespeare.py:quick", f"--workdir={tmp_path}",
                  *TINY, "--config.algorithm=flwo")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: config.algorithm='flwo': expected one of")
    assert "Traceback" not in done.stderr


def test_compare_writes_one_table_and_resumes(tmp_path):
    args = [f"--workdir={tmp_path}", "--methods=flow,fedavg", *SMALL]
    first = launch("compare.py", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    table = (tmp_path / "comparison.md").read_text()
    assert "| flow | train_clients |" in table and "| fedavg | train_clients |" in table
    # FedAvg has no personal model: its Acc_p and every comparison column are the paper's -.
    fedavg_row = next(line for line in table.splitlines() if line.startswith("| fedavg |"))
    assert fedavg_row.rstrip(" |").endswith(" | ".join(["—"] * 8))
    assert "—" not in next(line for line in table.splitlines() if line.startswith("| flow |"))
    csv = (tmp_path / "comparison.csv").read_text().splitlines()
    assert csv[0].startswith("method,population,num_clients,acc_g,acc_p") and len(csv) == 3
    stamp = os.path.getmtime(tmp_path / "flow" / "results.json")
    again = launch("compare.py", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "flow: finished earlier" in again.stdout
    assert os.path.getmtime(tmp_path / "flow" / "results.json") == stamp
    # run.json holds only timing: without it the table stands and the sum says so.
    table_rows = [line for line in table.splitlines() if line.startswith("| ")]
    (tmp_path / "fedavg" / "run.json").unlink()
    partial = launch("compare.py", *args)
    assert partial.returncode == 0, partial.stderr[-3000:]
    rerun = (tmp_path / "comparison.md").read_text()
    assert "summed run time of 1 of the 2 methods (the others lack run.json)" in rerun
    assert [line for line in rerun.splitlines() if line.startswith("| ")] == table_rows
    # Fewer methods (both finished, reused) keep the comparison of both as it was.
    full = {name: (tmp_path / name).read_bytes() for name in ("comparison.md", "comparison.csv")}
    one = launch("compare.py", *[a for a in args if not a.startswith("--methods")],
                 "--methods=fedavg")
    assert one.returncode == 0, one.stderr[-3000:]
    assert (f"kept {tmp_path}/comparison.md: it shows 1 result(s) that this table does "
            f"not cover, e.g. flow; this comparison goes to {tmp_path}/comparison-subset.md") in one.stdout
    assert {name: (tmp_path / name).read_bytes() for name in full} == full
    subset = (tmp_path / "comparison-subset.csv").read_text().splitlines()
    assert subset == [csv[0], *[line for line in csv[1:] if line.startswith("fedavg,")]]


def test_hypcluster_kmeans_init_is_set_from_the_command_line(tmp_path):
    done = launch("train.py", f"--workdir={tmp_path}", *SMALL,
                  "--config.algorithm=hypcluster", "--config.methods.hypcluster.warmup_rounds=1",
                  "--config.methods.hypcluster.init=kmeans")
    assert done.returncode == 0, done.stderr[-3000:]
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["methods"]["hypcluster"]["init"] == "kmeans"


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_client_state_memory_reports_the_rows_and_the_peaks_of_each_step(tmp_path, store):
    done = launch("client_state_memory.py", "--rows=60", "--row_floats=5000",
                  f"--store={store}", f"--dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    if store == "disk":  # after the steps: the log's size (each row logged once, below)
        assert lines.pop() == "undo log: 0.00 GB"
    rows, *steps = lines[-5:]
    assert rows == f"rows: 60 client states of 0.02 MB = 0.00 GB, in {store}"
    assert [s.split(":")[0].split(" (")[0] for s in steps] == [
        "after imports", "after filling the store", "after one checkpoint",
        "after overwriting every row"]
    assert all(" s): " in s for s in steps[1:])  # each step's wall time
    peaks = [float(s.split("process peak ")[1].split(" GB")[0]) for s in steps]
    assert peaks == sorted(peaks)  # peaks only grow
    assert all(s.endswith(" GB anonymous") for s in steps)  # Linux: /proc/self/status
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()  # the checkpoint a run writes
    if store == "disk":  # each row overwritten once after the checkpoint: logged once
        from flowjax.core.client_state_disk import UNDO_HEADER_BYTES
        log = tmp_path / "run" / "client_states" / "undo.log"
        assert log.stat().st_size == UNDO_HEADER_BYTES + 60 * (16 + 5000 * 4)


def test_memory_capped_kills_past_its_cap_and_reports_the_kill():
    """``launch/memory_capped.sh`` (the disk store's beyond-memory measurement): a
    process that allocates past the cap is killed for memory, one under it is not, and
    each run says so. Needs root and cgroup memory control; bad input needs neither."""
    def capped(limit, *command):
        return subprocess.run(["bash", "launch/memory_capped.sh", limit, *command],
                              capture_output=True, text=True, cwd=ROOT)

    bad = capped("4GB", "true")
    assert bad.returncode == 2
    assert bad.stderr == "memory_capped.sh: LIMIT_GB=4GB; expected a number of GiB, e.g. 4\n"
    allocate = "import numpy as np; a = np.ones(int({} * 2**27)); print(a.sum())"  # GiB
    under = capped("0.75", sys.executable, "-c", allocate.format(0.25))
    if under.returncode == 2 and under.stderr.startswith(("memory_capped.sh: cannot ",
                                                          "memory_capped.sh: this host swaps")):
        pytest.skip(under.stderr.strip())  # no root, no memory control, or swap uncapped
    assert under.returncode == 0, under.stderr
    assert under.stdout.splitlines()[0] == str(float(2**25))
    assert "exit status 0 under a cap of 0.75 GiB" in under.stdout
    assert under.stdout.rstrip().endswith("oom_kill 0")
    large = capped("5", "true")  # past 2**31 bytes (awk's %d once capped it at 2 GiB)
    assert "exit status 0 under a cap of 5.00 GiB" in large.stdout
    over = capped("0.75", sys.executable, "-c", allocate.format(1))
    assert over.returncode == 137
    assert "exit status 137 under a cap of 0.75 GiB; peak usage 0.75 GiB" in over.stdout
    assert over.stdout.rstrip().endswith("oom_kill 1")
    # SIGTERM (a scheduler's stop) reaches the command, and nothing is left behind.
    import signal
    import time
    marker = f"flowjax-capped-test-{os.getpid()}"
    stopped = subprocess.Popen(["bash", "launch/memory_capped.sh", "1", sys.executable, "-c",
                                f"import time; time.sleep(60)  # {marker}"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = f"^{sys.executable} -c .*{marker}"  # the command itself, not the script
    for _ in range(100):  # until the command runs
        if subprocess.run(["pgrep", "-f", running], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    stopped.send_signal(signal.SIGTERM)
    try:
        out, err = stopped.communicate(timeout=30)
    finally:  # a failing script must not leave the sleeping command behind
        subprocess.run(["pkill", "-f", running])
    assert stopped.returncode == 143 and "exit status 143 under a cap of 1.00 GiB" in out
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1
    import glob
    assert "is left" not in err
    assert not glob.glob(f"/sys/fs/cgroup/**/flowjax_capped_{stopped.pid}", recursive=True)


def test_every_launcher_shows_the_traceback_of_a_bad_input_under_debug(tmp_path):
    """``--debug`` (README, "Bad inputs") on each launcher that reads user input: the bad
    input that ends in one ``error:`` line, exit status 2, shows its traceback instead."""
    corrupt_run = tmp_path / "plots" / "run"
    corrupt_run.mkdir(parents=True)
    (corrupt_run / "results.json").write_text("{")
    missing = str(tmp_path / "missing")
    not_a_store = tmp_path / "store"  # the benchmark would replace and delete its --dir
    not_a_store.mkdir()
    (not_a_store / "keep.txt").write_text("mine")
    bad_inputs = {
        "train.py": ["--config=configs/synthetic.py:quick", "--config.algorithm=flwo",
                     f"--workdir={tmp_path / 'train'}"],
        "compare.py": ["--config=configs/synthetic.py:quick", "--methods=flwo",
                       f"--workdir={tmp_path / 'compare'}"],
        "reproduce.py": ["--table=table9", f"--workdir={tmp_path / 'reproduce'}"],
        "chunk_costs.py": ["--timings=4:0.5"],
        "convert.py": ["--dataset=emnist", f"--source={missing}", f"--out={tmp_path / 'out'}"],
        "plot.py": [f"--workdir={tmp_path / 'plots'}"],
        "label_baselines.py": ["--config=configs/synthetic.py:quick", "--label=nosuch"],
        "precision_effect.py": [f"--float32_workdir={missing}", f"--bfloat16_workdir={missing}",
                                f"--out={tmp_path / 'table'}"],
        "benchmark.py": ["--models=mlp"],
        "determinism_check.py": ["--models=mlp"],
        "lapack_pool_deadlock.py": ["--arms=sequential,batchd"],
        "bench_store.py": ["--num_clients=3", f"--dir={not_a_store}"],
        # Its disk store would overwrite a workdir's client_states/ given as --dir.
        "client_state_memory.py": ["--rows=2", "--store=disk", f"--dir={not_a_store}"],
    }
    # All at once: each is an interpreter start and a check of flags or files.
    running = {(script, debug): forkserver.Popen(
        [sys.executable, os.path.join(ROOT, "launch", script), *args, *debug],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for script, args in bad_inputs.items() for debug in ((), ("--debug",))}
    for (script, debug), process in running.items():
        _, stderr = process.communicate(timeout=600)
        if debug:
            assert process.returncode != 0 and "Traceback" in stderr, (script, stderr)
        else:
            assert process.returncode == 2, (script, process.returncode, stderr)
            assert stderr.strip().splitlines()[-1].startswith("error: "), (script, stderr)
            assert "Traceback" not in stderr, (script, stderr)
    assert [p.name for p in not_a_store.iterdir()] == ["keep.txt"]


def test_lapack_pool_deadlock_counts_finished_and_hung_processes():
    """``launch/lapack_pool_deadlock.py``: the workaround's arm (``sequential_vmap``)
    finishes in fresh processes and the table says so; a run past the timeout counts as
    hung (the batched arm's deadlock is not forced here: it needs two busy pool threads)."""
    done = launch("lapack_pool_deadlock.py", "--arms=sequential", "--tries=2", "--batch=2",
                  "--size=8", "--timeout_s=300")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-3:] == ["| arm | finished | hung |", "|---|---:|---:|",
                                             "| sequential | 2 | 0 |"]
    from launch import lapack_pool_deadlock
    assert lapack_pool_deadlock.run_arm("sequential", 1, 1e-3, 2, 8) == (0, 1)


def test_ctrl_c_line_tells_how_to_resume_only_where_a_launcher_trains_run_folders(capsys):
    from launch import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    for resumable, line in ((True, f"interrupted (Ctrl-C); {cli.RESUMES}"),
                            (False, "interrupted (Ctrl-C)")):
        assert cli._quiet_interrupt(interrupted, resumable)([]) == cli.INTERRUPTED == 130
        assert capsys.readouterr().err == line + "\n"


# Runs launch/train.py as its own script, after a garbage-collector callback that sends the
# process SIGINT once flowjax (and with it JAX) is importing: the Ctrl-C lands inside a gc
# callback, as it did in JAX's (which swallowed it).
_CTRL_C_IN_A_GC_CALLBACK = """
import gc, os, runpy, signal, sys
sent = []
def ctrl_c(phase, info):
    if phase == "start" and "flowjax" in sys.modules and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
gc.callbacks.insert(0, ctrl_c)
sys.argv = ["launch/train.py", *sys.argv[1:]]
runpy.run_path("launch/train.py", run_name="__main__")
"""


def test_ctrl_c_while_a_launcher_starts_ends_it_at_once(tmp_path):
    """A Ctrl-C in a launcher's first seconds (importing JAX) went into JAX's gc callback,
    which swallows exceptions: the run went on to the end, exit 0. Now it ends the process
    there in one line, exit 130, nothing written."""
    workdir = tmp_path / "run"
    done = forkserver.run([sys.executable, "-c", _CTRL_C_IN_A_GC_CALLBACK, *SMALL,
                           f"--workdir={workdir}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "interrupted (Ctrl-C) while starting, before anything was written"], done.stderr
    assert not workdir.exists()


def test_a_tables_command_line_is_quoted_so_it_can_be_pasted_back():
    from launch import cli
    argv = [os.path.join(ROOT, "launch", "compare.py"), "--workdir=/tmp/a b",
            "--methods=fedavg,flow", "--config=configs/synthetic.py:quick"]
    assert cli.command_line(argv) == ("python launch/compare.py '--workdir=/tmp/a b' "
                                      "--methods=fedavg,flow --config=configs/synthetic.py:quick")


def test_argparse_launchers_refuse_bad_values_in_one_line():
    """The launchers that parse with argparse (no absl: parity, sensitivity and the
    measurement scripts) print one ``error:`` line, not a usage block, and check ranges
    before working: ``sensitivity.py --seed=-1`` ended in a traceback after a minute."""
    expected = {
        ("sensitivity.py", "--seed=-1"): "argument --seed: '-1': expected an integer >= 0",
        ("bench_layers.py", "--clients=0"): "argument --clients: '0': expected an integer >= 1",
        ("step_parts.py", "--repeats=x"): "argument --repeats: 'x': expected an integer >= 1",
        ("roofline.py", "--device=tpu"): "argument --device: invalid choice: 'tpu'",
        ("parity.py",): "the following arguments are required: --reference_dir",
    }
    running = {args: forkserver.Popen([sys.executable, os.path.join(ROOT, "launch", args[0]),
                                       *args[1:]], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT)
               for args in expected}
    for args, process in running.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, (args, stderr)
        assert len(stderr.strip().splitlines()) == 1, (args, stderr)
        assert stderr.startswith(f"error: {expected[args]}"), (args, stderr)


def test_bench_layers_times_the_cnn_convolutions_beside_pytorch():
    """``bench_layers.py --torch_convs`` (README "Speed"): one line per convolution of the
    EMNIST CNN with flowjax's and PyTorch's times and their ratios."""
    pytest.importorskip("torch")
    done = launch("bench_layers.py", "--torch_convs", "--repeats=1")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("conv")]
    assert [line.split()[0] for line in lines] == ["conv1", "conv2"]
    pattern = (r"^conv\d batch 20: forward flowjax [\d.]+ ms, PyTorch [\d.]+ ms \([\d.]+x\); "
               r"forward\+backward flowjax [\d.]+ ms, PyTorch [\d.]+ ms \([\d.]+x\); "
               r"flowjax with XLA's autodiff [\d.]+ ms \([\d.]+x\)$")
    assert all(re.match(pattern, line) for line in lines), lines
