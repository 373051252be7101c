"""Two processes under jax.distributed (one CPU device each, gloo collectives) run one
simulation through launch/train.py and reproduce the single-process, two-device run."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests import forkserver
from tests.test_launch import ROOT, TINY

FLAGS = ["--config=configs/shakespeare.py:quick", *TINY, "--config.clients_per_round=4",
         "--config.mapping.strategy=loop", "--config.mapping.num_devices=2",
         "--config.checkpoint_every=1", "--config.eval.held_out=True",
         "--config.eval.held_out_clients=4"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def train(workdir, *args, devices_per_process: int = 1, flags=FLAGS, fault=None):
    """A ``launch/train.py`` process; with ``fault``, ``tests/crashing_train.py``'s."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + f" --xla_force_host_platform_device_count={devices_per_process}")
    script = ["tests/crashing_train.py", fault] if fault else ["launch/train.py"]
    return forkserver.Popen([sys.executable, *script, *flags, f"--workdir={workdir}", *args],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def finish(process):
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return out


# CI checks the multi-host mechanism (sharded cohorts, process 0 reporting, checkpoints)
# with FedAvg; Flow's routed model and Ditto's per-client state store add compile time,
# so they run with pytest -m slow.
# Ditto's client states on disk: one folder of rows per process.
@pytest.mark.parametrize("algorithm,client_states", [
    ("fedavg", "memory"), pytest.param("flow", "memory", marks=pytest.mark.slow),
    pytest.param("ditto", "memory", marks=pytest.mark.slow),
    pytest.param("ditto", "disk", marks=pytest.mark.slow)])
def test_two_processes_equal_one_process_with_two_devices(tmp_path, algorithm, client_states):
    address = f"localhost:{free_port()}"
    hosts = [train(tmp_path / "multi", f"--config.algorithm={algorithm}",
                   f"--config.client_states={client_states}",
                   f"--coordinator_address={address}", "--num_processes=2",
                   f"--process_id={i}") for i in range(2)]
    outputs = [finish(p) for p in hosts]
    assert "wrote" in outputs[0] and "wrote" not in outputs[1]  # only process 0 reports
    finish(train(tmp_path / "single", f"--config.algorithm={algorithm}", devices_per_process=2))

    multi, single = (json.loads((tmp_path / d / "results.json").read_text())
                     for d in ("multi", "single"))
    for population in ("train_clients", "held_out_clients"):
        for field in ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting"):
            assert multi["populations"][population][field] == pytest.approx(
                single["populations"][population][field], rel=1e-6, abs=1e-7)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").open()
               if json.loads(line)["kind"] == "train"] for d in ("multi", "single")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["1", "2"]
    if client_states == "disk":
        assert sorted(os.listdir(tmp_path / "multi" / "client_states")) == [
            "process_0", "process_1"]
    for run in ("multi", "single"):  # sharded: still one compilation per program
        info = json.loads((tmp_path / run / "run.json").read_text())
        assert info["compilations"] == {"round": 1, "eval": 1}, (run, info)


def test_bad_process_flags_are_one_line_errors(tmp_path):
    done = forkserver.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), *FLAGS,
                           f"--workdir={tmp_path}", "--num_processes=2", "--process_id=2",
                           "--coordinator_address=localhost:1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: process_id must be in [0, 1], got 2"


# Ditto on the synthetic MLP task (what is checked is the checkpoint's and the stores',
# not the model's), its client states on disk, one folder per process.
DITTO_ON_DISK = ["--config=configs/synthetic.py:quick", "--config.data.num_clients=12",
                 "--config.num_rounds=4", "--config.checkpoint_every=1",
                 "--config.clients_per_round=4", "--config.eval.clients=4",
                 "--config.mapping.strategy=loop", "--config.mapping.num_devices=2",
                 "--config.algorithm=ditto", "--config.client_states=disk"]


def two_processes(workdir, fault=None, extra=((), ())):
    """``(returncode, stderr)`` of each process of a two-process run of ``DITTO_ON_DISK``;
    ``workdir`` and ``fault`` may be one per process, ``extra`` are their own flags."""
    address = f"localhost:{free_port()}"
    workdirs = workdir if isinstance(workdir, tuple) else (workdir, workdir)
    faults = fault if isinstance(fault, tuple) else (fault, fault)
    hosts = [train(workdirs[i], f"--coordinator_address={address}", "--num_processes=2",
                   f"--process_id={i}", *extra[i], flags=DITTO_ON_DISK, fault=faults[i])
             for i in range(2)]
    done = [(p, *p.communicate(timeout=600)) for p in hosts]
    return [(p.returncode, err) for p, _, err in done]


@pytest.mark.slow  # 46 s of CI; the token itself: test_client_state_disk.py, in CI
def test_a_killed_two_process_run_resumes_its_client_states_on_disk_exactly(tmp_path):
    """Both processes killed, or one: the same command resumes exactly."""
    # Killed after round 3 overwrote rows checkpointed at round 2: each process writes
    # them back from its own undo log, under the token of process 0's checkpoint.
    assert [code for code, _ in two_processes(tmp_path / "killed", fault="round:3")] == [
        -signal.SIGKILL] * 2
    shutil.copytree(tmp_path / "killed", tmp_path / "broken")
    for code, err in two_processes(tmp_path / "killed"):
        assert code == 0, err[-3000:]
    for code, err in two_processes(tmp_path / "clean"):
        assert code == 0, err[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert ((tmp_path / "killed" / name).read_bytes()
                == (tmp_path / "clean" / name).read_bytes()), name
    # Process 1 alone killed (out of memory, say): process 0 stops at its next collective
    # in one line, exit 2. It once printed its line, then waited in JAX's shutdown barrier
    # for the heartbeat timeout (100 s) and aborted with a C++ stack trace (exit -6).
    (code0, err0), (code1, _) = two_processes(tmp_path / "one", fault=(None, "round:3"))
    assert (code0, code1) == (2, -signal.SIGKILL), err0[-3000:]
    assert "Fatal Python error" not in err0 and "Terminating process" not in err0, err0[-3000:]
    line = err0.strip().splitlines()[-1]
    assert line.startswith("error: process 0: a step all 2 processes take together failed ("), line
    assert line.endswith("another process has stopped (its output or the scheduler's log says "
                         "why): the same command on every host resumes from the newest "
                         "checkpoint"), line
    for code, err in two_processes(tmp_path / "one"):
        assert code == 0, err[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert ((tmp_path / "one" / name).read_bytes()
                == (tmp_path / "clean" / name).read_bytes()), name
    # One process cannot restore its rows: both stop in one line (not the other one
    # waiting in the first round's collectives until a timeout).
    os.remove(tmp_path / "broken" / "client_states" / "process_1" / "undo.log")
    (code0, err0), (code1, err1) = two_processes(tmp_path / "broken")
    assert (code0, code1) == (2, 2)
    assert err0.strip().splitlines()[-1].endswith(
        "checkpoints/2: client states: process(es) 1 stopped (their output says why); "
        "expected every process to go on")
    assert "process_1: no undo.log" in err1.strip().splitlines()[-1]


def test_a_failed_collective_is_a_lost_process_and_a_bad_argument_is_not(monkeypatch):
    """What ``ProcessLost`` covers (the two-process run above takes it through train.py):
    the runtime's failure of a step all processes take, not an error of the caller's."""
    from flowjax import distributed

    def failing(message):
        def collective():
            raise ValueError(message)
        return collective

    gloo = ("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error [127.0.0.1]:416: "
            "Connection reset by peer")
    with pytest.raises(ValueError, match="^UNKNOWN: Gloo"):  # one process: as it is
        distributed._together(failing(gloo))
    monkeypatch.setattr(distributed, "multiprocess", lambda: True)
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 3)
    with pytest.raises(distributed.ProcessLost) as lost:
        distributed._together(failing(gloo))
    assert str(lost.value) == (
        f"process 0: a step all 3 processes take together failed ({gloo}); another process "
        f"has stopped (its output or the scheduler's log says why): the same command on "
        f"every host resumes from the newest checkpoint")
    with pytest.raises(ValueError, match="^tiled must be a bool$"):
        distributed._together(failing("tiled must be a bool"))


def last_lines(results):
    return [(code, err.strip().splitlines()[-1]) for code, err in results]


def test_processes_that_disagree_stop_together_in_one_line_before_writing(tmp_path,
                                                                          monkeypatch):
    # A process looks for process 0's config.json for up to 60 s (an NFS client's cached
    # lookups); 1 s here, where the workdirs below are not shared.
    monkeypatch.setenv("FLOWJAX_SHARED_FS_WAIT_S", "1")
    # Other flags on one host (a cadence the run folder itself would accept at a resume):
    # every process stops before anything is written, instead of hanging in a collective.
    (code0, line0), (code1, line1) = last_lines(two_processes(
        tmp_path / "flags", extra=((), ("--config.checkpoint_every=2",))))
    assert (code0, code1) == (2, 2)
    for line in (line0, line1):
        assert line.endswith("process(es) 1 run another config, other flags or see another "
                             "--workdir than process 0; expected the same command on every "
                             "host but --process_id, and a workdir on a filesystem they share")
    assert not (tmp_path / "flags").exists()
    # A workdir that is not shared (two folders stand for one path on two disks): the
    # other process does not see the config.json process 0 wrote.
    (code0, line0), (code1, line1) = last_lines(two_processes((tmp_path / "a", tmp_path / "b")))
    assert (code0, code1) == (2, 2)
    assert line1.endswith("this process does not see the config.json process 0 wrote; "
                          "expected a workdir on a filesystem every process shares")
    assert line0.endswith("process(es) 1 stopped (their output says why); expected every "
                          "process to go on")
    assert os.listdir(tmp_path / "a") == ["config.json"] and not (tmp_path / "b").exists()


def test_a_device_mesh_that_leaves_a_process_out_is_refused_before_training(tmp_path):
    """Two processes of one device each: num_devices=1 (the default) puts the whole
    clients axis on process 0's device, and the run failed after its first round (process
    1 without a shard, orbax refusing host-local arrays); now both stop at once in one
    line, nothing written."""
    (code0, line0), (code1, line1) = last_lines(two_processes(
        tmp_path, extra=(("--config.mapping.num_devices=1",),) * 2))
    assert (code0, code1) == (2, 2)
    for line in (line0, line1):
        assert line.endswith("config.mapping.num_devices=1: expected an integer in [2, 2]: in "
                             "a run of 2 processes the clients axis must reach a device of "
                             "every process (it takes the first num_devices of the 2 "
                             "devices)"), line
    assert not tmp_path.exists() or not os.listdir(tmp_path)


@pytest.mark.slow  # stop_together itself runs in CI through the test above
def test_a_full_disk_on_one_process_stops_every_process_in_one_line(tmp_path):
    # Process 1's client-state files cannot be synced for checkpoint 2 (ENOSPC): both
    # stop there, before that checkpoint is written, and resume from checkpoint 1.
    (code0, line0), (code1, line1) = last_lines(
        two_processes(tmp_path, fault=(None, "disk_full:2")))
    assert (code0, code1) == (2, 2)
    assert "No space left on device" in line1
    assert line0.endswith("checkpoints/2: client states: process(es) 1 stopped (their "
                          "output says why); expected every process to go on")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    for code, err in two_processes(tmp_path):
        assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["resumed_from_round"] == 1


@pytest.mark.slow
def test_every_process_waits_for_process_0s_results_and_fails_with_it(tmp_path):
    # Process 0 cannot write results.json (ENOSPC) after the last round: process 1, which
    # once exited 0 before process 0 wrote anything, stops with it; the same command then
    # writes the results from the last checkpoint, the clean run's bytes.
    (code0, line0), (code1, line1) = last_lines(
        two_processes(tmp_path / "full", fault=("results_full:1", None)))
    assert (code0, code1) == (2, 2)
    assert "No space left on device" in line0
    assert line1.endswith("results of --workdir=" + str(tmp_path / "full") + ": process(es) 0 "
                          "stopped (their output says why); expected every process to go on")
    assert not (tmp_path / "full" / "results.json").exists()
    for workdir in ("full", "clean"):
        for code, err in two_processes(tmp_path / workdir):
            assert code == 0, err[-3000:]
    assert ((tmp_path / "full" / "results.json").read_bytes()
            == (tmp_path / "clean" / "results.json").read_bytes())
    assert json.loads((tmp_path / "full" / "run.json").read_text())["resumed_from_round"] == 4


@pytest.mark.slow
def test_a_signal_stops_every_process_at_the_same_round_and_resumes_exactly(tmp_path):
    # A scheduler's SIGTERM reaching process 0 while it writes checkpoint 2 (held until
    # written) and process 1 before it (once round 2 is dispatched): both stop after
    # checkpoint 2, neither waits for the other in orbax's barriers, and the same
    # command resumes exactly.
    results = two_processes(tmp_path / "term",
                            fault=("checkpoint:2:SIGTERM", "round:2:SIGTERM"))
    assert [code for code, _ in results] == [143, 143], [e[-2000:] for _, e in results]
    assert sorted(os.listdir(tmp_path / "term" / "checkpoints")) == ["1", "2"]
    # Ctrl-C on one host only: the other stops with it.
    results = two_processes(tmp_path / "int", fault=(None, "round:3:SIGINT"))
    assert [code for code, _ in results] == [130, 130], [e[-2000:] for _, e in results]
    # SIGTERM on process 1 before the run loop (no agreed stop there): it leaves at once,
    # and process 0 stops at its next collective in one line. JAX's preemption service
    # once took that SIGTERM, and both ran to the end and exited 0.
    (code0, err0), (code1, err1) = two_processes(tmp_path / "early",
                                                 fault=(None, "built:1:SIGTERM"))
    assert (code0, code1) == (2, 143), (err0[-2000:], err1[-2000:])
    assert err1.strip().splitlines()[-1].startswith("interrupted (SIGTERM); the same command")
    assert err0.strip().splitlines()[-1].startswith(
        "error: process 0: a step all 2 processes take together failed ("), err0[-2000:]
    assert "Fatal Python error" not in err0 + err1
    for workdir in ("term", "int", "early", "clean"):
        for code, err in two_processes(tmp_path / workdir):
            assert code == 0, err[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        for workdir in ("term", "int", "early"):
            assert ((tmp_path / workdir / name).read_bytes()
                    == (tmp_path / "clean" / name).read_bytes()), (workdir, name)


# CI: 6 s. The plain path's early signal: the slow test above.
def test_a_signal_before_the_run_loop_under_debug_leaves_at_once_with_its_traceback(tmp_path):
    # --debug re-raises a signal for its traceback; a re-raise outside the run loop's agreed
    # stops would then wait in JAX's shutdown barrier for process 0, which waits for it in
    # its next collective, until the heartbeat timeout aborts both.
    (code0, err0), (code1, err1) = two_processes(
        tmp_path / "early", fault=(None, "built:1:SIGTERM"), extra=((), ("--debug",)))
    assert (code0, code1) == (2, 143), (err0[-2000:], err1[-2000:])
    assert "Traceback (most recent call last)" in err1, err1[-2000:]
    assert err1.strip().splitlines()[-1].endswith("Terminated"), err1[-2000:]
    assert err0.strip().splitlines()[-1].startswith(
        "error: process 0: a step all 2 processes take together failed ("), err0[-2000:]
    assert "Fatal Python error" not in err0 + err1


@pytest.mark.slow  # 20 s; the wait's bound and its message: the test above, in CI
def test_a_process_waits_for_process_0s_config_json_to_come_into_sight(tmp_path):
    # Process 1's --workdir comes into sight 3 s after process 0 wrote its config.json,
    # as a file another NFS client created can stay out of sight for up to acdirmax
    # (60 s): it waits for it, where it once stopped both processes at once.
    workdir, late = tmp_path / "shared", tmp_path / "late"

    def link_later():
        deadline = time.monotonic() + 300
        while not (workdir / "config.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)
        late.symlink_to(workdir)

    linker = threading.Thread(target=link_later)
    linker.start()
    started = time.monotonic()
    results = two_processes((workdir, late))
    linker.join()
    for code, err in results:
        assert code == 0, err[-3000:]
    assert time.monotonic() - started > 3
    assert (workdir / "results.json").exists()
    assert json.loads((workdir / "run.json").read_text())["resumed_from_round"] is None


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan", ""])
def test_a_bad_shared_fs_wait_is_a_one_line_error(monkeypatch, text):
    from flowjax import runner
    monkeypatch.setenv("FLOWJAX_SHARED_FS_WAIT_S", text)
    with pytest.raises(ValueError) as error:
        runner.shared_fs_wait_s()
    assert str(error.value) == f"FLOWJAX_SHARED_FS_WAIT_S={text!r}; expected seconds >= 0"
    monkeypatch.setenv("FLOWJAX_SHARED_FS_WAIT_S", "2.5")
    assert runner.shared_fs_wait_s() == 2.5
    monkeypatch.delenv("FLOWJAX_SHARED_FS_WAIT_S")
    assert runner.shared_fs_wait_s() == runner.SHARED_FS_WAIT_S == 60.0
