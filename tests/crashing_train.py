"""``launch/train.py`` with a crash at a chosen point, for the crash tests only: the
fault is injected here, from the test side; production code has no hook for it.

  python tests/crashing_train.py round:3 <launch/train.py flags>
      SIGKILL once round 3 is dispatched (the round still in flight on the device)
  python tests/crashing_train.py checkpoint:4 <flags>
      SIGKILL while checkpoint 4 is being written (orbax's save started, not finished)
  python tests/crashing_train.py checkpoint:6:SIGINT <flags>
      that signal instead (SIGINT: Ctrl-C)
  python tests/crashing_train.py saved:4 <flags>
      SIGKILL once checkpoint 4 is complete on disk, before anything else runs (a
      disk-backed client-state store has not yet started that checkpoint's undo log)
  python tests/crashing_train.py disk_full:2 <flags>
      no crash: the disk-backed client-state store's sync for the second checkpoint
      raises ENOSPC, as a full disk makes it
  python tests/crashing_train.py results_full:1 <flags>
      no crash: the first write of results.json raises ENOSPC
  python tests/crashing_train.py run_json_written:1 <flags>
      SIGKILL in the first atomic write of run.json, its temporary file complete, before
      it replaces run.json (the leftover temporary file stays in the run folder)
  python tests/crashing_train.py built:1:SIGTERM <flags>
      that signal once the run's simulation is built (data loaded, HypCluster's warm-up
      done), before the run loop starts
"""

import os
import signal
import sys


def crash(signum: int) -> None:
    os.kill(os.getpid(), signum)


def inject(fault: str) -> None:
    """Wraps the engine's round or orbax's save so that ``fault`` happens there."""
    point, index, *name = fault.split(":")
    index, signum = int(index), getattr(signal, name[0]) if name else signal.SIGKILL
    if point == "round":
        from flowjax.engine.simulation import Simulation
        run_round = Simulation.run_round

        def crashing_round(self, state, round_index, cohort=None):
            result = run_round(self, state, round_index, cohort)
            if round_index + 1 == index:
                crash(signum)
            return result

        Simulation.run_round = crashing_round
    elif point == "checkpoint":
        import orbax.checkpoint as ocp
        save = ocp.CheckpointManager.save

        def crashing_save(self, step, *args, **kwargs):
            saved = save(self, step, *args, **kwargs)  # asynchronous: the write goes on
            if step == index:
                crash(signum)
            return saved

        ocp.CheckpointManager.save = crashing_save
    elif point == "saved":
        from flowjax.checkpoint import Checkpointer
        complete_save = Checkpointer.save

        def crashing_complete_save(self, rounds_done, *args, **kwargs):
            complete_save(self, rounds_done, *args, **kwargs)
            if rounds_done == index:
                crash(signum)

        Checkpointer.save = crashing_complete_save
    elif point == "disk_full":
        import errno
        from flowjax.core.client_state_disk import DiskClientStateStore
        sync, calls = DiskClientStateStore._sync, []

        def full_sync(self):
            calls.append(None)
            if len(calls) == index:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.directory)
            sync(self)

        DiskClientStateStore._sync = full_sync
    elif point == "built":
        from flowjax import config as run_config
        simulation_for, calls = run_config.simulation_for, []

        def signalling_simulation_for(*args, **kwargs):
            built = simulation_for(*args, **kwargs)
            calls.append(None)
            if len(calls) == index:
                crash(signum)
            return built

        run_config.simulation_for = signalling_simulation_for
    elif point == "results_full":
        import errno
        from flowjax import run_folder
        write, calls = run_folder.write_json_atomic, []

        def full_write(file, payload):
            if os.path.basename(file) == run_folder.RESULTS:
                calls.append(None)
                if len(calls) == index:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
            write(file, payload)

        run_folder.write_json_atomic = full_write
    elif point == "run_json_written":
        from flowjax import run_folder
        from flowjax.core import file_modes
        as_if_created, calls = file_modes.as_if_created, []

        def crashing_as_if_created(file):  # write_text_atomic's step before the rename
            as_if_created(file)
            if os.path.basename(file).startswith(f".{run_folder.RUN_INFO}.tmp-"):
                calls.append(None)
                if len(calls) == index:
                    crash(signum)

        file_modes.as_if_created = crashing_as_if_created
    else:
        raise ValueError(f"fault {fault!r}: expected round:N[:SIGNAL], "
                         f"checkpoint:N[:SIGNAL], built:N[:SIGNAL], saved:N, disk_full:N, "
                         f"results_full:N or run_json_written:N")


if __name__ == "__main__":
    fault = sys.argv.pop(1)
    # A Ctrl-C comes from a terminal, where SIGINT is never ignored; a test session started
    # in the background (`&` from a script) hands its children SIGINT ignored, which would
    # swallow the injected one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # launch.train sets the XLA flags before JAX is imported, as the plain command does.
    from launch import cli, train
    inject(fault)
    train.flags.mark_flags_as_required(["workdir"])
    cli.run(train.main, resumable=True)
