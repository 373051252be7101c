"""config.tensorboard: metrics.jsonl's records as TensorBoard scalars, read back by hand."""

import json
import math
import os
import struct
import sys
import types

import pytest

pytest.importorskip("tensorboardX")

from tensorboardX.proto import event_pb2  # noqa: E402

from flowjax import tensorboard_log  # noqa: E402
from flowjax.runner import prepare_workdir, run_config_to_workdir  # noqa: E402
from tests.helpers import small_config  # noqa: E402


def read_events(logdir):
    """Every ``Event`` of the event files in ``logdir``, file by file in name order."""
    return read_events_of(logdir, event_files(logdir))


def event_files(logdir):
    return sorted(name for name in os.listdir(logdir) if name.startswith("events.out.tfevents"))


def read_events_of(logdir, names):
    """The ``Event``s of the event files ``names`` in ``logdir``, in that order.

    An event file is TFRecord framing: uint64 length, uint32 length CRC, the serialized
    proto, uint32 data CRC (the CRCs are not checked here).
    """
    events = []
    for name in names:
        with open(os.path.join(logdir, name), "rb") as handle:
            data = handle.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
            offset += 12 + length + 4
    return events


def scalars(events):
    """``{tag: {step: value}}`` of the scalar summaries."""
    out = {}
    for event in events:
        for value in event.summary.value:
            out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_run_writes_the_metrics_as_scalars(tmp_path):
    # FedAvg compiles in a third of Flow's time; the routed fields are covered below.
    config = small_config(tensorboard=True, algorithm="fedavg", num_rounds=2,
                          checkpoint_every=0, log_every=1,
                          **{"eval.every": 1, "eval.held_out": False})
    run_config_to_workdir(config, str(tmp_path), progress=False)
    logged = scalars(read_events(tmp_path / "tensorboard"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "eval"}
    expected = {}
    for record in records:
        for tag, value in tensorboard_log.record_scalars(record).items():
            expected.setdefault(tag, {})[record["round"]] = value
    assert set(logged) == set(expected)
    for tag, steps in expected.items():
        assert set(logged[tag]) == set(steps), tag
        for step, value in steps.items():  # event files store float32
            assert logged[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-7), (tag, step)
    eval_train = next(r for r in records if r["kind"] == "eval" and r["round"] == 2
                      and r["population"] == "train_clients")
    assert logged["eval/train_clients/acc_p"][2] == pytest.approx(eval_train["acc_p"], rel=1e-6)
    for group, fraction in eval_train["breakdown"].items():
        assert logged[f"eval/train_clients/breakdown/{group}"][2] == pytest.approx(
            fraction, rel=1e-6, abs=1e-7)
    losses = {r["round"]: r["loss"] for r in records if r["kind"] == "train"}
    assert logged["train/loss"] == pytest.approx(losses, rel=1e-6) and len(losses) == 2


def test_tensorboard_turned_on_after_a_run_logs_its_records(tmp_path):
    # It changes no number, so the finished run is reused, and its records logged once.
    config = small_config(algorithm="fedavg", num_rounds=2, checkpoint_every=0, log_every=1,
                          **{"eval.every": 1, "eval.held_out": False})
    first = run_config_to_workdir(config, str(tmp_path), progress=False)
    assert not (tmp_path / "tensorboard").exists()
    config.tensorboard = True
    for _ in range(2):
        assert run_config_to_workdir(config, str(tmp_path), progress=False) == first
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(event_files(tmp_path / "tensorboard")) == 1  # the second reuse adds nothing
    logged = scalars(read_events(tmp_path / "tensorboard"))
    assert logged["train/loss"] == pytest.approx(
        {r["round"]: r["loss"] for r in records if r["kind"] == "train"}, rel=1e-6)
    assert set(logged["eval/train_clients/acc_p"]) == {1, 2}


def test_a_resumed_run_with_tensorboard_newly_on_logs_the_rounds_before_it(tmp_path):
    history = [{"round": 1, "kind": "train", "loss": 1.0}, {"round": 2, "kind": "train", "loss": 2.0}]
    log = tensorboard_log.TensorBoardLog(str(tmp_path))
    log.on_run_start(types.SimpleNamespace(history=history))  # what Checkpoints restored
    log({"round": 3, "kind": "train", "loss": 3.0})
    log.close()
    assert scalars(read_events(tmp_path / "tensorboard"))["train/loss"] == {1: 1.0, 2: 2.0, 3: 3.0}
    again = tensorboard_log.TensorBoardLog(str(tmp_path))
    again.on_run_start(types.SimpleNamespace(history=history))  # event files exist: nothing
    again.close()
    assert len(event_files(tmp_path / "tensorboard")) == 1


def test_a_run_killed_before_its_events_were_flushed_logs_them_again_on_resume(tmp_path):
    """SIGKILL loses what tensorboardX had buffered: an attempt's event file may end
    before its last rounds, or be empty. Without a clean close's record of the rounds it
    holds, the resumed run logs its whole history again, purging from the first round."""
    history = [{"round": r, "kind": "train", "loss": float(r)} for r in (1, 2, 3, 4)]
    killed = tensorboard_log.TensorBoardLog(str(tmp_path))
    killed(history[0])
    killed._writer.flush()
    # The kill: rounds 2 to 4 never reached the file, and the writer never closed.
    (first,) = event_files(tmp_path / "tensorboard")
    killed._writer = None
    resumed = tensorboard_log.TensorBoardLog(str(tmp_path))
    resumed.on_run_start(types.SimpleNamespace(history=history))
    resumed({"round": 5, "kind": "train", "loss": 5.0})
    resumed.close()
    events = read_events(tmp_path / "tensorboard")
    starts = [e.step for e in events if e.HasField("session_log")
              and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [1]  # TensorBoard hides the killed attempt's steps
    newest = sorted(set(event_files(tmp_path / "tensorboard")) - {first})
    assert scalars(read_events_of(tmp_path / "tensorboard", newest))["train/loss"] == {
        1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}
    assert (tmp_path / "tensorboard" / ".logged_through").read_text() == "5"


def test_an_attempt_killed_after_a_clean_one_does_not_leave_the_clean_ones_claim(tmp_path):
    """A clean close vouches for rounds 1-22; the next attempt resumes from round 12
    (another checkpoint cadence), hides the old steps from 13 on and is killed before its
    events reach the file: the claim must drop to 12, or the resume after it would skip
    relogging and rounds 13 on would be hidden and never written again."""
    history = [{"round": r, "kind": "train", "loss": float(r)} for r in range(1, 25)]
    clean = tensorboard_log.TensorBoardLog(str(tmp_path))
    for record in history[:22]:
        clean(record)
    clean.close()
    assert (tmp_path / "tensorboard" / ".logged_through").read_text() == "22"
    killed = tensorboard_log.TensorBoardLog(str(tmp_path))
    killed.on_run_start(types.SimpleNamespace(history=history[:12]))  # all vouched for
    killed(history[12])
    killed._writer = None  # SIGKILL: its events never reach the file, it never closes
    assert (tmp_path / "tensorboard" / ".logged_through").read_text() == "12"
    resumed = tensorboard_log.TensorBoardLog(str(tmp_path))
    resumed.on_run_start(types.SimpleNamespace(history=history[:22]))
    for record in history[22:]:
        resumed(record)
    resumed.close()
    shown = {}
    for name in event_files(tmp_path / "tensorboard"):  # as TensorBoard reads them
        events = read_events_of(tmp_path / "tensorboard", [name])
        for event in events:
            if event.HasField("session_log") and event.session_log.status == \
                    event_pb2.SessionLog.START:
                shown = {step: v for step, v in shown.items() if step < event.step}
        shown.update(scalars(events).get("train/loss", {}))
    assert shown == {r: float(r) for r in range(1, 25)}
    assert (tmp_path / "tensorboard" / ".logged_through").read_text() == "24"


def test_a_killed_writes_temporary_marker_is_removed_by_the_next_attempt(tmp_path):
    """A kill in the atomic write of .logged_through leaves its temporary file; the next
    attempt (the runner holds the folder's lock) removes it as it opens its event file."""
    logdir = tmp_path / "tensorboard"
    logdir.mkdir()
    leftover = logdir / "..logged_through.tmp-k1ll3d_x"
    leftover.write_text("9")
    log = tensorboard_log.TensorBoardLog(str(tmp_path))
    log({"round": 1, "kind": "train", "loss": 1.0})
    log.close()
    assert not leftover.exists()
    assert sorted(name for name in os.listdir(logdir) if name.startswith(".")) == [
        ".logged_through"]
    assert (logdir / ".logged_through").read_text() == "1"


def test_record_scalars_names_tags_by_kind_population_and_field():
    train = {"round": 3, "kind": "train", "loss": 0.5, "weight": 8.0, "local_loss": None}
    assert tensorboard_log.record_scalars(train) == {"train/loss": 0.5, "train/weight": 8.0}
    evaluation = {"round": 4, "kind": "eval", "population": "held_out_clients",
                  "acc_g": 0.25, "num_clients": 6, "breakdown": {"both_correct": 0.75},
                  "q0_by_group": {"neither": [0.5, None]},
                  "q0_histogram": {"neither": [[1.0, 0.0], [0.0, 1.0]]}}
    assert tensorboard_log.record_scalars(evaluation) == {
        "eval/held_out_clients/acc_g": 0.25, "eval/held_out_clients/num_clients": 6.0,
        "eval/held_out_clients/breakdown/both_correct": 0.75,
        "eval/held_out_clients/q0_by_group/neither/0": 0.5}
    assert math.isnan(tensorboard_log.record_scalars(
        {"round": 1, "kind": "train", "loss": float("nan")})["train/loss"])


def test_a_resumed_run_purges_the_earlier_attempts_later_steps(tmp_path):
    first = tensorboard_log.TensorBoardLog(str(tmp_path))
    for round_ in (1, 2, 3):
        first({"round": round_, "kind": "train", "loss": float(round_)})
    first.close()
    resumed = tensorboard_log.TensorBoardLog(str(tmp_path))
    resumed({"round": 3, "kind": "train", "loss": 3.0})
    resumed.close()
    files = event_files(tmp_path / "tensorboard")
    assert len(files) == 2  # the second attempt does not overwrite the first
    second = read_events(tmp_path / "tensorboard")
    starts = [e.step for e in second if e.HasField("session_log")
              and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [3]  # TensorBoard hides the first attempt's steps >= 3
    nothing = tensorboard_log.TensorBoardLog(str(tmp_path))
    nothing.close()  # no record: no new, empty event file
    assert event_files(tmp_path / "tensorboard") == files


def test_overwrite_removes_the_old_event_files(tmp_path):
    # An earlier flowjax run's (its config.json says so; a folder without one is refused:
    # tests/test_resume.py).
    (tmp_path / "config.json").write_text('{"algorithm": "fedavg", "num_rounds": 3}')
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host.0").write_bytes(b"")
    prepare_workdir(str(tmp_path), {"seed": 1}, overwrite=True)
    assert not (tmp_path / "tensorboard").exists()


def test_missing_tensorboardx_names_the_option(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"config.tensorboard=True needs tensorboardX"):
        tensorboard_log.TensorBoardLog(str(tmp_path))


def test_hypclusters_warm_up_rounds_are_logged_like_its_own(tmp_path):
    # The warm-up's records start the run's history: logged at its start, steps 1 to W.
    config = small_config(tensorboard=True, algorithm="hypcluster", num_rounds=2,
                          checkpoint_every=0, log_every=1, **{"eval.held_out": False})
    config.methods.hypcluster.warmup_rounds = 1
    run_config_to_workdir(config, str(tmp_path), progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["round"]: r["loss"] for r in records if r["kind"] == "train"}
    assert [r.get("stage") for r in records if r["kind"] == "train"] == ["warm-up", None]
    logged = scalars(read_events(tmp_path / "tensorboard"))
    assert logged["train/loss"] == pytest.approx(losses, rel=1e-6) and set(losses) == {1, 2}
