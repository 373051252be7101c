"""Crash safety: SIGKILL mid-round and mid-checkpoint, resume, identical results.

Every run is a ``launch/train.py`` process (crashes through ``tests/crashing_train.py``).
They share the session's compilation cache (``tests/conftest.py``): the first run
compiles, the others, resumed ones included, load the same executables, which changes no
number (the runs compare byte for byte) and takes most of the time out of the later runs.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from flowjax.core.client_state_disk import UNDO_HEADER_BYTES
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The synthetic MLP task: what is checked here (kill, resume, refuse, one-line errors) is
# the launcher's and the checkpoint's, not the dataset's, and its train.py run costs about
# 5 CPU-s with a warm compilation cache where the Shakespeare LSTM's cost 41 (2 cores).
# test_multihost keeps a Shakespeare run through train.py in CI.
RUN = ["--config=configs/synthetic.py:quick", "--config.data.num_clients=12",
       "--config.num_rounds=6", "--config.checkpoint_every=2", "--config.clients_per_round=3",
       "--config.eval.clients=4", "--config.eval.every=3"]


def train(workdir, *extra, fault=None, fresh=False):
    """``launch/train.py`` with ``RUN`` and ``extra``; with ``fault`` (``round:3``,
    ``checkpoint:4``, ``checkpoint:6:SIGINT``) the run crashes there. Forked from the
    test process's preloaded interpreter (``tests/forkserver.py``) unless ``fresh``."""
    script = (["tests/crashing_train.py", fault] if fault else ["launch/train.py"])
    return forkserver.run([sys.executable, *script, *RUN, f"--workdir={workdir}", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, fresh=fresh)


# The runs the others are compared with byte for byte start a new interpreter: forked
# runs share their server's string hash seed, a fresh one draws its own.
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("clean")
    done = train(workdir, fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


@pytest.mark.parametrize("fault", [
    pytest.param("round:3", marks=pytest.mark.slow),  # the stateful test below kills mid-round
    # SIGKILL while orbax writes: CI's cadence test below kills at this point and resumes
    # to the same bytes (with other cadences), beside the Ctrl-C test's interrupted write.
    pytest.param("checkpoint:4", marks=pytest.mark.slow),
    pytest.param("round:6", marks=pytest.mark.slow),  # killed after the last round
])
def test_killed_and_resumed_run_is_bit_identical(uninterrupted, tmp_path, fault):
    killed = train(tmp_path, fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "results.json").exists()
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_checkpoint_and_log_cadence_may_change_at_a_resume(uninterrupted, tmp_path):
    # Killed writing round 4's checkpoint, resumed from round 2's with checkpoints every 3
    # rounds and training records fetched every 4: with eval.every=3 the records of rounds
    # 3 were pending at round 3's evaluation, and still land before it.
    killed = train(tmp_path, fault="checkpoint:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "results.json").exists()
    resumed = train(tmp_path, "--config.checkpoint_every=3", "--config.log_every=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["resumed_from_round"] == 2
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_a_kill_mid_write_leaves_a_temporary_file_the_resumed_run_removes(uninterrupted,
                                                                         tmp_path):
    """write_text_atomic's temporary file outlives a kill; the next run of the folder (it
    holds the lock) removes it, and an older run's unnamed kind, and finishes exactly."""
    killed = train(tmp_path, fault="run_json_written:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(".run.json.tmp-")]
    assert len(leftovers) == 1 and not (tmp_path / "run.json").exists()
    (tmp_path / ".tmp-abcd_123").write_text("{")  # as write_text_atomic named them before
    (tmp_path / ".tmp-notes").write_text("a user's")  # not that pattern: kept
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(uninterrupted) + [".tmp-notes"])
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / name).read_bytes() == (uninterrupted / name).read_bytes(), name


# Both signals take one path (launch/cli.py raises SIGTERM as Ctrl-C is raised); CI runs
# SIGTERM's, a scheduler's, and SIGINT's with -m slow (13 s).
@pytest.mark.parametrize("signal_name,status,shown", [
    pytest.param("SIGINT", 130, "Ctrl-C", marks=pytest.mark.slow), ("SIGTERM", 143, "SIGTERM")])
def test_ctrl_c_mid_checkpoint_is_one_line_and_resumes_exactly(uninterrupted, tmp_path,
                                                               signal_name, status, shown):
    # The signal while checkpoint 6 is written: it replaces checkpoint 2 (max_to_keep=2),
    # which orbax deletes file by file in its finalize thread. Both finish before the exit.
    # SIGTERM (what a scheduler or `kill` sends first) ends the run as Ctrl-C does.
    stopped = train(tmp_path, fault=f"checkpoint:6:{signal_name}")
    assert stopped.returncode == status, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"interrupted ({shown}); the same command resumes from the newest checkpoint (with "
        "checkpoint_every=0 a run starts over)")
    assert "Traceback" not in stopped.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "6"]
    assert not (tmp_path / "results.json").exists()
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / name).read_bytes() == (uninterrupted / name).read_bytes(), name


@pytest.fixture(scope="module")
def ditto_in_memory(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ditto_memory")
    done = train(workdir, "--config.algorithm=ditto", fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


def killed_at_round_3_resumes_exactly(tmp_path, *extra, killed_at=3, clean=None):
    """Runs ``extra`` clean into ``clean/`` (unless ``clean`` is such a run's folder) and
    killed at round ``killed_at`` then resumed into ``killed/``; both leave the same
    results and metrics, byte for byte."""
    if clean is None:
        clean = tmp_path / "clean"
        done = train(clean, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
    killed = train(tmp_path / "killed", *extra, fault=f"round:{killed_at}")
    assert killed.returncode == -signal.SIGKILL
    resumed = train(tmp_path / "killed", *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / "killed" / name).read_bytes() == (clean / name).read_bytes()


def test_stateful_method_resumes_its_client_states_exactly(ditto_in_memory, tmp_path):
    killed_at_round_3_resumes_exactly(tmp_path, "--config.algorithm=ditto",
                                      clean=ditto_in_memory)
    # run.json's wall time is the whole run's: the killed attempt's time up to the
    # checkpoint of round 2 it resumed from, plus the resumed attempt's.
    fresh, resumed = (json.loads((folder / "run.json").read_text())
                      for folder in (ditto_in_memory, tmp_path / "killed"))
    assert fresh["resumed_from_round"] is None
    assert fresh["wall_time_s"] == fresh["wall_time_s_this_attempt"] > 0
    assert resumed["resumed_from_round"] == 2 and resumed["warnings"] == []
    assert resumed["wall_time_s"] > resumed["wall_time_s_this_attempt"] > 0


def test_hypcluster_resumes_after_its_warm_up_exactly(tmp_path):
    # A resumed attempt runs the FedAvg warm-up (rounds 1-2) again, then continues
    # HypCluster's rounds from the checkpoint of round 4 (config.simulation_for), as the
    # uninterrupted run did.
    killed_at_round_3_resumes_exactly(tmp_path, "--config.algorithm=hypcluster",
                                      "--config.methods.hypcluster.warmup_rounds=2",
                                      killed_at=5)
    resumed = json.loads((tmp_path / "killed" / "run.json").read_text())
    assert resumed["resumed_from_round"] == 4
    # Its metrics.jsonl (the checkpoint's history) holds the warm-up's rounds, once.
    train_records = [json.loads(line) for line in
                     (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == "train"]
    assert [(r["round"], r.get("stage")) for r in train_records] == [
        (1, "warm-up"), (2, "warm-up"), (3, None), (4, None), (5, None), (6, None)]


def same_run(workdir, reference):
    return all((workdir / n).read_bytes() == (reference / n).read_bytes()
               for n in ("results.json", "metrics.jsonl"))


def test_client_states_on_disk_resume_exactly_with_the_memory_runs_bytes(ditto_in_memory,
                                                                         tmp_path):
    disk = ("--config.algorithm=ditto", "--config.client_states=disk")
    # Killed after round 3 overwrote rows of clients checkpointed at round 2: the undo log
    # holds their round-2 bytes, and the resume writes them back.
    killed = train(tmp_path / "a", *disk, fault="round:3")
    assert killed.returncode == -signal.SIGKILL
    assert os.path.getsize(tmp_path / "a" / "client_states" / "undo.log") > UNDO_HEADER_BYTES
    resumed = train(tmp_path / "a", *disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "GiB of disk in " in resumed.stdout  # the forecast names where the rows go
    assert same_run(tmp_path / "a", ditto_in_memory)
    # Killed once checkpoint 4 was complete, before its undo log began: the log is round
    # 2's, the files hold round 4's rows, and nothing is applied.
    killed = train(tmp_path / "b", *disk, fault="saved:4")
    assert killed.returncode == -signal.SIGKILL
    # Its rows are not in the checkpoint: resuming it in memory is refused in one line,
    # before its config.json is touched (it used to be rewritten to say "memory").
    config_bytes = (tmp_path / "b" / "config.json").read_bytes()
    # The killed run's stale lock is taken over and released; nothing else may change.
    unlocked = lambda folder: {k: v for k, v in file_bytes(folder).items()  # noqa: E731
                               if k != ".flowjax-lock"}
    folder_before = unlocked(tmp_path / "b")
    refused = train(tmp_path / "b", "--config.algorithm=ditto")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'b'} holds an unfinished run whose client states are in its "
        "client_states/ (client_states='disk'); expected --config.client_states=disk to "
        "resume it, or use --overwrite to replace the run or another --workdir")
    assert (tmp_path / "b" / "config.json").read_bytes() == config_bytes
    assert unlocked(tmp_path / "b") == folder_before  # the check read, changed nothing
    resumed = train(tmp_path / "b", *disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "b" / "run.json").read_text())["resumed_from_round"] == 4
    assert same_run(tmp_path / "b", ditto_in_memory)
    # Ctrl-C while the first checkpoint is written: held, then delivered before that
    # checkpoint's undo log begins; the same command resumes from it.
    stopped = train(tmp_path / "c", *disk, fault="checkpoint:2:SIGINT")
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    resumed = train(tmp_path / "c", *disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_run(tmp_path / "c", ditto_in_memory)


def test_went_past_a_divergence_reads_the_rounds_a_resume_will_not_replay(tmp_path):
    from flowjax.run_folder import went_past_a_divergence

    def records(*lines):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    train_record = {"round": 1, "kind": "train", "loss": 2.0, "clients_skipped": 0}
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    records(train_record, {**train_record, "round": 3, "clients_skipped": 1})
    assert not went_past_a_divergence(tmp_path)  # round 3 comes after the checkpoint
    for diverged in ({"clients_skipped": 2}, {"loss": float("nan")}, {"server_nonfinite": 1}):
        records({**train_record, **diverged})
        assert went_past_a_divergence(tmp_path), diverged
    records(train_record, {"round": 2, "kind": "eval", "clients_nonfinite": 3})
    assert went_past_a_divergence(tmp_path)
    records(train_record, {**train_record, "round": 3, "clients_skipped": 1})
    (tmp_path / "results.json").write_text("{}")  # finished: every record counts
    assert went_past_a_divergence(tmp_path)


def test_record_diverged_is_what_the_stop_guard_stops_at():
    """``run_folder.record_diverged`` (read on disk to refuse a 'stop' resume of a run that
    went on past a divergence) and ``DivergenceGuard('stop')`` (which stops a run) repeat
    one rule in two modules: the guard raises for a record exactly when it holds."""
    from flowjax.engine.callbacks import DivergenceError, DivergenceGuard, RunState
    from flowjax.run_folder import record_diverged

    guard = DivergenceGuard("stop", warn=lambda message: None)
    run = RunState(simulation=None, state=None)
    train_record = {"round": 1, "kind": "train", "loss": 2.0, "clients_skipped": 0,
                    "server_nonfinite": False}
    eval_record = {"round": 1, "kind": "eval", "population": "train_clients",
                   "num_clients": 4, "clients_nonfinite": 0}
    cases = [train_record, eval_record, {**train_record, "loss": None},
             {**train_record, "clients_skipped": 2}, {**train_record, "loss": float("nan")},
             {**train_record, "loss": float("inf")}, {**train_record, "server_nonfinite": True},
             {**eval_record, "clients_nonfinite": 1},
             {**train_record, "loss": 1e30}]  # large but finite: a warning, not a stop
    stops = []
    for record in cases:
        try:
            guard.on_record(run, record)
            stops.append(False)
        except DivergenceError:
            stops.append(True)
    assert stops == [record_diverged(record) for record in cases]
    assert stops == [False, False, False, True, True, True, True, True, False]


def test_a_memory_checkpoint_resumes_in_memory_after_a_disk_attempt_saved_nothing(
        ditto_in_memory, tmp_path):
    """Files in client_states/ alone do not make the newest checkpoint a disk run's: a disk
    attempt killed before its first checkpoint left round 2's memory checkpoint, whose
    rows are in it, and the memory command resumes from it to the same bytes."""
    killed = train(tmp_path, "--config.algorithm=ditto", fault="round:3")
    assert killed.returncode == -signal.SIGKILL
    disk = train(tmp_path, "--config.algorithm=ditto", "--config.client_states=disk",
                 fault="round:3")
    assert disk.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path / "client_states")
    resumed = train(tmp_path, "--config.algorithm=ditto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["resumed_from_round"] == 2
    assert same_run(tmp_path, ditto_in_memory)


@pytest.mark.slow  # the store's side is test_client_state_disk.py's memory-checkpoint test
def test_a_run_out_of_memory_resumes_with_its_client_states_on_disk(ditto_in_memory, tmp_path):
    killed = train(tmp_path, "--config.algorithm=ditto", fault="round:3")
    assert killed.returncode == -signal.SIGKILL
    resumed = train(tmp_path, "--config.algorithm=ditto", "--config.client_states=disk")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_run(tmp_path, ditto_in_memory)


@pytest.mark.slow  # in-process equivalent: test_experiment.py's same-seed test
def test_same_seed_same_bytes_and_other_seed_differs(uninterrupted, tmp_path):
    again = train(tmp_path / "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "results.json").read_bytes() == (uninterrupted / "results.json").read_bytes()
    other = train(tmp_path / "other", "--config.seed=1")
    assert other.returncode == 0, other.stderr[-3000:]
    assert (tmp_path / "other" / "results.json").read_bytes() != (uninterrupted / "results.json").read_bytes()


def test_a_different_config_is_refused_without_touching_the_run(uninterrupted, tmp_path):
    workdir = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(uninterrupted), str(workdir)], check=True)
    before = {p: (workdir / p).read_bytes() for p in ("results.json", "config.json", "metrics.jsonl")}
    # Another evaluation cadence: another config, and the same compiled programs.
    refused = train(workdir, "--config.eval.every=2")
    assert refused.returncode == 2
    assert "holds a run with a different config (differs in: eval.every)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert {p: (workdir / p).read_bytes() for p in before} == before
    replaced = train(workdir, "--config.eval.every=2", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert json.loads((workdir / "config.json").read_text())["eval"]["every"] == 2
    # Evaluating more often changes no number of training (plot.py's note says so).
    assert (workdir / "results.json").read_bytes() == before["results.json"]
    trained = [[line for line in text.decode().splitlines() if '"kind": "train"' in line]
               for text in ((workdir / "metrics.jsonl").read_bytes(), before["metrics.jsonl"])]
    assert trained[0] == trained[1] and len(trained[0]) == 6


def test_divergence_stops_with_a_one_line_message_naming_the_round(tmp_path):
    diverged = train(tmp_path, "--config.sgd.learning_rate=1e30")
    assert diverged.returncode == 2
    message = diverged.stderr.strip().splitlines()[-1]
    assert message.startswith("error: round ") and "training diverged" in message, message
    # Valid data: the optimization is named, with the values to lower.
    assert ("while the round's inputs and labels are valid" in message
            and "Lower config.sgd.learning_rate (now 1e+30) or config.methods.flow.gamma "
                "(now 0.01)" in message)
    assert "Traceback" not in diverged.stderr
    assert not (tmp_path / "results.json").exists()


def test_corrupt_checkpoint_fails_in_one_line_and_is_left_in_place(uninterrupted, tmp_path):
    # A run that died after its last checkpoint, before its results: the module's clean
    # run without them (CI time: no run of its own; killed runs resume in the tests above).
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    for name in ("results.json", "run.json"):
        (tmp_path / name).unlink(missing_ok=True)
    checkpoint = max((tmp_path / "checkpoints").iterdir(), key=lambda p: int(p.name))
    assert checkpoint.name == "6"
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.stat().st_size > 0)
    assert files
    for path in files:
        path.write_bytes(b"\0" * path.stat().st_size)  # same size, garbage content
    before = {p: p.read_bytes() for p in files}
    failed = train(tmp_path)
    assert failed.returncode == 2, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "cannot be restored" in last, last
    assert "Traceback" not in failed.stderr
    assert {p: p.read_bytes() for p in files} == before
    assert not (tmp_path / "results.json").exists()
    # --overwrite would delete round 4's intact checkpoint too; the line names the way
    # back to it, and following it gives the uninterrupted run's bytes.
    assert last.endswith(f"; or move {checkpoint} out of checkpoints/ to resume from round "
                         f"4's checkpoint"), last
    shutil.move(checkpoint, tmp_path.parent / f"{tmp_path.name}-corrupt-6")
    from flowjax.runner import run_config_to_workdir  # in this process: CI time
    run_config_to_workdir(run_config(), str(tmp_path), progress=False)
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_a_checkpoint_unreadable_for_a_cause_outside_it_is_not_called_corrupt(
        uninterrupted, tmp_path, monkeypatch):
    """A permission or memory error while reading must not advise --overwrite (which
    deletes an intact run) nor a move to an older checkpoint."""
    import orbax.checkpoint as ocp

    from flowjax.runner import run_config_to_workdir
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    for name in ("results.json", "run.json"):
        (tmp_path / name).unlink()

    # As Python raises them, and as tensorstore does (it reads the arrays' data; a test
    # run as root cannot take a file's permission away, so the errors are injected).
    for error, shown in (
            (PermissionError(13, "Permission denied", f"{tmp_path}/checkpoints/6/state"),
             f"PermissionError: [Errno 13] Permission denied: '{tmp_path}/checkpoints/6/state'"),
            (ValueError("PERMISSION_DENIED: Error opening \"file\" driver: Permission denied"),
             'ValueError: PERMISSION_DENIED: Error opening "file" driver: Permission denied')):
        def unreadable(self, step, *args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(ocp.CheckpointManager, "restore", unreadable)
        with pytest.raises(ValueError) as failed:
            run_config_to_workdir(run_config(), str(tmp_path), progress=False)
        assert str(failed.value) == (
            f"checkpoint {tmp_path}/checkpoints/6 cannot be restored ({shown}); the checkpoint "
            f"may be intact: fix that and run the same command again (--overwrite would "
            f"delete the run)")


def run_config(**fields):
    """``RUN``'s config (in this process: the runner's checks of a workdir need no
    launcher), with ``fields`` set."""
    from configs import synthetic
    from tests.helpers import apply_overrides
    overrides = dict(arg[len("--config."):].split("=") for arg in RUN[1:])
    config = apply_overrides(synthetic.get_config("quick"),
                             {name: int(value) for name, value in overrides.items()})
    return apply_overrides(config, fields)


def file_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_checkpoint_every_0_is_refused_where_it_would_drop_a_runs_checkpoints(
        uninterrupted, tmp_path):
    """Resuming with ``checkpoint_every=0`` built no checkpoint reader, so the run started
    over, and its first write emptied ``metrics.jsonl``. Now it is refused in one line
    and every file stays; any other cadence resumes (the cadence test above)."""
    from flowjax.runner import run_config_to_workdir
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    for name in ("results.json", "run.json"):  # killed after its last checkpoint
        (tmp_path / name).unlink()
    before = file_bytes(tmp_path)
    with pytest.raises(ValueError) as refused:
        run_config_to_workdir(run_config(checkpoint_every=0), str(tmp_path), progress=False)
    assert str(refused.value) == (
        f"{tmp_path} holds this config's unfinished run with checkpoints up to round 6, "
        "which checkpoint_every=0 would not resume: the run would start over and lose them; "
        "expected checkpoint_every >= 1 to resume it (any value), or use --overwrite to "
        "replace the run or another --workdir")
    assert file_bytes(tmp_path) == before


def test_a_workdir_in_use_by_another_run_is_refused_and_left_to_it(uninterrupted, tmp_path):
    """Two runs on one workdir (the same command started twice, two grids sharing a cell)
    truncated each other's metrics.jsonl and raced on the checkpoints. The second is
    refused while the first holds the workdir's lock; a finished run leaves no lock."""
    from flowjax.run_folder import LOCK, RunLock
    from flowjax.runner import run_config_to_workdir
    assert not (uninterrupted / LOCK).exists()
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    (tmp_path / "results.json").unlink()  # an unfinished run, which would train
    with RunLock(str(tmp_path)):
        before = file_bytes(tmp_path)
        with pytest.raises(ValueError) as refused:
            run_config_to_workdir(run_config(), str(tmp_path), progress=False)
        assert file_bytes(tmp_path) == before
    assert str(refused.value) == (
        f"--workdir={tmp_path} is in use by another process (pid {os.getpid()}, "
        f"{tmp_path / LOCK}); expected one run per workdir at a time: wait for it, or use "
        "another --workdir")
    assert not (tmp_path / LOCK).exists()
    # The lock of a run refused later on (a multi-host flag check) leaves no folder.
    with RunLock(str(tmp_path / "new" / "run")):
        assert (tmp_path / "new" / "run" / LOCK).read_text() == f"{os.getpid()}\n"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("theirs", ['{"model_type": "bert", "hidden_size": 768}', "null",
                                    "", "# not json"])
def test_another_programs_config_json_is_neither_replaced_nor_deleted(tmp_path, overwrite,
                                                                      theirs):
    """A folder holding another program's ``config.json`` (a model folder's) is no run:
    it used to be replaced by the run's, and ``--overwrite`` deleted it with the files
    a run would write; one that was not JSON (or ``null``) was read as a run's torn
    write, which ``--overwrite`` deleted the same way (a run writes it atomically), and a
    ``null`` one ended in a traceback without it."""
    from flowjax.runner import run_config_to_workdir
    (tmp_path / "config.json").write_text(theirs)
    (tmp_path / "metrics.jsonl").write_text("theirs\n")
    (tmp_path / "checkpoints" / "mine").mkdir(parents=True)
    (tmp_path / "checkpoints" / "mine" / "weights").write_bytes(b"w")
    before = file_bytes(tmp_path)
    with pytest.raises(ValueError) as refused:
        run_config_to_workdir(run_config(), str(tmp_path), progress=False, overwrite=overwrite)
    file = f"{tmp_path}/config.json"
    assert str(refused.value) == (
        f"{file} is not a flowjax run's config (it lacks algorithm, num_rounds); nothing was "
        "changed; use another --workdir" if theirs.startswith(("{", "null")) else
        f"{file} is not valid JSON, and a flowjax run writes it whole, so what wrote it is "
        "unknown; nothing was changed; move it away to run there, or use another --workdir")
    assert file_bytes(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_another_programs_checkpoints_and_events_are_not_deleted(tmp_path, overwrite):
    """Without a config.json nothing tells whose ``checkpoints/`` and ``tensorboard/``
    these are: ``--overwrite`` deleted them (and the refusal without it advised it)."""
    from flowjax.runner import run_config_to_workdir
    (tmp_path / "checkpoints" / "model_step_1000").mkdir(parents=True)
    (tmp_path / "checkpoints" / "model_step_1000" / "w.bin").write_bytes(b"weights")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_bytes(b"events")
    before = file_bytes(tmp_path)
    with pytest.raises(ValueError) as refused:
        run_config_to_workdir(run_config(), str(tmp_path), progress=False, overwrite=overwrite)
    remedy = ("nothing was deleted; move its files away to run there (--overwrite deletes "
              "only a run whose config.json says it is flowjax's), or use another --workdir")
    assert str(refused.value) == (
        f"{tmp_path} holds checkpoints/, tensorboard/ but no config.json, so what made them "
        f"is unknown; {remedy}")
    assert file_bytes(tmp_path) == before


def test_a_run_does_not_write_among_another_programs_events(tmp_path):
    """Without --overwrite too: a folder of event files and no config.json is refused
    before the run writes its own beside them (it used to be run into)."""
    from flowjax.runner import run_config_to_workdir
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_bytes(b"events")
    with pytest.raises(ValueError, match=r" holds tensorboard/ but no config.json, so what "
                                         r"made them is unknown; nothing was deleted; "):
        run_config_to_workdir(run_config(), str(tmp_path), progress=False)
    assert file_bytes(tmp_path) == {"tensorboard/events.out": b"events"}


def test_skip_clients_goes_on_and_reports_the_dropped_clients(tmp_path):
    done = train(tmp_path, "--config.sgd.learning_rate=1e30",
                 "--config.on_divergence=skip_clients")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["clients_skipped"] for r in records if r["kind"] == "train"]
    assert len(skipped) == 6 and all(s > 0 for s in skipped)
    # Dropped clients do not count in the round's loss either.
    assert all(r["loss"] is None for r in records if r["kind"] == "train" and r["clients_skipped"] == 3)
    assert (tmp_path / "results.json").exists()


def test_a_server_step_that_diverges_stops_before_its_checkpoint_under_either_setting(
        tmp_path):
    """Finite client updates, a server step that overflows: the round's record flags it and
    the run stops before saving that round, even under skip_clients (it cannot drop a
    server step; the next round's clients would all diverge from the broken model)."""
    for setting in ("stop", "skip_clients"):
        workdir = tmp_path / setting
        done = train(workdir, "--config.algorithm=fedavg", "--config.sgd.learning_rate=10",
                     "--config.server.learning_rate=3e38", "--config.checkpoint_every=1",
                     f"--config.on_divergence={setting}")
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(
            "error: round 1: training diverged: the server's update (the clients' mean and "
            "the server optimizer's step) made its parameters non-finite (every client update "
            "was finite)")
        records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        assert [(r["round"], r["server_nonfinite"], r["clients_skipped"]) for r in records] == [
            (1, 1.0, 0.0)]
        assert not (workdir / "results.json").exists()
        checkpoints = workdir / "checkpoints"
        assert not checkpoints.exists() or not any(checkpoints.iterdir())


LOCAL_DIVERGES = ("--config.algorithm=local", "--config.methods.local.sgd.learning_rate=1e30")


def test_a_diverged_personalization_stops_and_skip_clients_resumes_it(tmp_path):
    # Local trains only at evaluation time, so training stays finite and the evaluation
    # (rounds 3 and 6) is where it diverges.
    diverged = train(tmp_path / "run", *LOCAL_DIVERGES)
    assert diverged.returncode == 2, diverged.stderr[-3000:]
    assert diverged.stderr.strip().splitlines()[-1] == (
        "error: round 3: evaluation diverged: 4 of 4 train_clients client(s) made non-finite "
        "predictions (first: client 'f_00000'); stopping, the last good checkpoint is round "
        "2. Lower config.methods.local.sgd.learning_rate (now 1e+30), or set "
        "on_divergence='skip_clients' to count such predictions as wrong and go on")
    assert not (tmp_path / "run" / "results.json").exists()
    # The remedy, in the same workdir: "stop" never goes past a divergence, so the run
    # resumes from round 2's checkpoint and gives a fresh skip_clients run's bytes.
    resumed = train(tmp_path / "run", *LOCAL_DIVERGES, "--config.on_divergence=skip_clients")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["resumed_from_round"] == 2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["on_divergence"] == (
        "skip_clients")
    fresh = train(tmp_path / "fresh", *LOCAL_DIVERGES, "--config.on_divergence=skip_clients")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    for name in ("results.json", "metrics.jsonl"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    # argmax over NaN logits picks class 0, which would score the share of label 0.
    results = json.loads((tmp_path / "fresh" / "results.json").read_text())
    summary = results["populations"]["train_clients"]
    assert (results["acc_p"], results["acc_p_soft"]) == (0.0, 0.0)
    assert (summary["clients_nonfinite"], summary["first_nonfinite_client"]) == (4, "f_00000")
    assert json.loads((tmp_path / "fresh" / "run.json").read_text())["warnings"] == [
        "round 3: 4 of 4 train_clients client(s) made non-finite predictions (first: client "
        "'f_00000'); they count as wrong (on_divergence='skip_clients'; results.json counts "
        "such clients as clients_nonfinite)"]
    # Not the other way: a skip_clients run may have gone on past a divergence.
    back = train(tmp_path / "fresh", *LOCAL_DIVERGES)
    assert back.returncode == 2
    assert "holds a run with a different config (differs in: on_divergence)" in back.stderr


def test_stop_resumes_a_run_that_a_skip_clients_attempt_left_before_dropping_anyone(
        uninterrupted, tmp_path):
    """A skip_clients attempt rewrites config.json at its start; stopped before it dropped
    a client (here killed after its round 5, having saved round 4's checkpoint) the run is
    still the one stop would make, so the original command resumes it to the same bytes
    (the checkpoint's own config check agrees)."""
    killed = train(tmp_path, fault="checkpoint:4")
    assert killed.returncode == -signal.SIGKILL
    again = train(tmp_path, "--config.on_divergence=skip_clients", fault="round:5")
    assert again.returncode == -signal.SIGKILL
    assert json.loads((tmp_path / "config.json").read_text())["on_divergence"] == "skip_clients"
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "4"  # saved under skip_clients
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_run(tmp_path, uninterrupted)


def test_metrics_jsonl_is_on_disk_before_results_json_marks_the_run_finished(tmp_path,
                                                                            monkeypatch):
    """A finished run is never resumed (which rewrites metrics.jsonl from the checkpoint's
    history), so its appended lines must reach the disk before results.json is written."""
    import os as os_module
    from flowjax.runner import run_config_to_workdir
    synced, replace = [], os_module.replace
    fsync = os_module.fsync

    def recording_fsync(fd):
        name = os_module.path.basename(os_module.readlink(f"/proc/self/fd/{fd}"))
        synced.append((name, os_module.fstat(fd).st_size))
        fsync(fd)

    def recording_replace(source, target):
        synced.append(("replaced", os_module.path.basename(target)))
        replace(source, target)

    monkeypatch.setattr(os_module, "fsync", recording_fsync)
    monkeypatch.setattr(os_module, "replace", recording_replace)
    run_config_to_workdir(run_config(checkpoint_every=0), str(tmp_path), progress=False)
    size = (tmp_path / "metrics.jsonl").stat().st_size
    assert size > 0
    assert synced.index(("metrics.jsonl", size)) < synced.index(("replaced", "results.json"))


def test_an_overwrite_killed_midway_can_be_finished_by_the_same_command(tmp_path,
                                                                         monkeypatch):
    """``--overwrite`` removes config.json last: killed after any other removal, the
    folder still says it is flowjax's, and the same command finishes it (config.json
    removed first left files that every rerun, --overwrite too, refused)."""
    from flowjax import run_folder
    from flowjax.runner import run_config_to_workdir
    config = run_config()
    run_config_to_workdir(config, str(tmp_path), progress=False)
    real_remove = os.remove

    def killed_after_the_first(file):
        real_remove(file)
        raise KeyboardInterrupt  # stands for the kill: nothing after it runs

    monkeypatch.setattr(run_folder.os, "remove", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        run_folder.remove_run(str(tmp_path))
    monkeypatch.setattr(run_folder.os, "remove", real_remove)
    assert (tmp_path / "config.json").exists() and not (tmp_path / "checkpoints").exists()
    config.seed = 1
    run_config_to_workdir(config, str(tmp_path), progress=False, overwrite=True)
    assert json.loads((tmp_path / "config.json").read_text())["seed"] == 1


def test_overwrite_removes_the_replaced_runs_figures_and_only_them(tmp_path):
    """plot.py's PNGs of the replaced run would otherwise sit beside the new run as if
    they showed it; a file plot.py does not write stays, as does --out_dir's folder."""
    from flowjax.runner import run_config_to_workdir
    config = run_config(num_rounds=1, checkpoint_every=0)  # what --overwrite removes: any run
    run_config_to_workdir(config, str(tmp_path), progress=False)
    for folder, names in (("plots", ["a.png", "notes.txt"]), ("plots-fedavg", ["b.png"]),
                          ("figures", ["c.png"])):
        (tmp_path / folder).mkdir()
        for name in names:
            (tmp_path / folder / name).write_text("x")
    config.seed = 1
    run_config_to_workdir(config, str(tmp_path), progress=False, overwrite=True)
    assert sorted(os.listdir(tmp_path / "plots")) == ["notes.txt"]
    assert not (tmp_path / "plots-fedavg").exists()
    assert sorted(os.listdir(tmp_path / "figures")) == ["c.png"]


def test_run_json_is_written_before_results_json(tmp_path, monkeypatch):
    """results.json marks a run finished (a finished run is reused, never rewritten):
    written last, so that a kill between the two cannot lose run.json."""
    from flowjax import run_folder
    from flowjax.runner import run_config_to_workdir
    written, real_write = [], run_folder.write_json_atomic
    monkeypatch.setattr(run_folder, "write_json_atomic", lambda file, value: (
        written.append(os.path.basename(file)), real_write(file, value))[-1])
    run_config_to_workdir(run_config(), str(tmp_path), progress=False)
    assert written[-2:] == ["run.json", "results.json"]


def test_two_table_writers_at_once_keep_the_wider_table(tmp_path, monkeypatch):
    """Writer 1 judges the folder (no table yet), then writer 2, with a wider table,
    starts: under the table lock it waits for writer 1 to finish and then replaces the
    narrower table. Without the lock writer 2 would judge an empty folder too and finish
    first, and writer 1 would then replace the wider table with its narrower one."""
    import threading
    from flowjax import run_folder
    stem = str(tmp_path / "table")

    def outside(rows):  # a table's rows that another table, shown as its CSV, leaves out
        return lambda text: sorted(set(text.split()) - set(rows))

    def write(rows):
        return run_folder.write_table_keeping_wider(stem, outside(rows), " ".join(rows),
                                                    "\n".join(rows))

    second = threading.Thread(target=write, args=(["a", "b", "c"],))
    judge, judged = run_folder.table_stem, []

    def judge_then_let_the_second_in(name, shows):
        judged.append(judge(name, shows))
        if len(judged) == 1:  # writer 1 has judged: writer 2 starts, given 1 s to finish
            second.start()
            second.join(timeout=1.0)
        return judged[-1]

    monkeypatch.setattr(run_folder, "table_stem", judge_then_let_the_second_in)
    assert write(["a"]) == (stem, "", [])
    second.join()
    assert (tmp_path / "table.csv").read_text() == "a\nb\nc"
    assert (tmp_path / "table.md").read_text() == "a b c"
    assert judged == [(stem, ""), (stem, "")]
    assert sorted(os.listdir(tmp_path)) == ["table.csv", "table.md"]  # the lock file too


def test_a_table_written_whole_removes_the_part_tables_it_covers(tmp_path):
    """Rows stand for a table's results: the part tables written beside a wider one
    (``-subset``, ``-subset-2``) go once a table at the stem covers them; one showing
    rows it does not cover stays."""
    from flowjax import run_folder
    stem = str(tmp_path / "table")

    def write(rows):
        return run_folder.write_table_keeping_wider(
            stem, lambda text: sorted(set(text.split()) - set(rows)), " ".join(rows),
            "\n".join(rows))

    assert write(["a", "b"]) == (stem, "", [])
    assert write(["c"])[:2] == (stem + "-subset", "it shows 2 result(s) that this table "
                                                  "does not cover, e.g. a")
    assert write(["a"])[0] == stem + "-subset-2"
    assert write(["a", "b"]) == (stem, "", [stem + "-subset-2"])
    assert sorted(os.listdir(tmp_path)) == ["table-subset.csv", "table-subset.md",
                                            "table.csv", "table.md"]
    assert write(["a", "b", "c"]) == (stem, "", [stem + "-subset"])
    assert (tmp_path / "table.csv").read_text() == "a\nb\nc"


def test_a_table_writes_its_csv_before_its_md(tmp_path, monkeypatch):
    """table_stem judges what <table>.md shows from the .csv: written first, a kill
    between the two cannot leave a new .md beside an old .csv."""
    from flowjax import run_folder
    written, real_write = [], run_folder.write_text_atomic
    monkeypatch.setattr(run_folder, "write_text_atomic", lambda file, text: (
        written.append(os.path.basename(file)), real_write(file, text))[-1])
    run_folder.write_table(str(tmp_path / "table2"), "| md |\n", "table,row\n")
    assert written == ["table2.csv", "table2.md"]
