"""The fork server's children behave as new interpreters do: each program runs both ways
and the two are compared (tests/forkserver.py)."""

import os
import signal
import sys
import time

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import atexit, os, sys, threading, time
print(__name__, __file__ if '__file__' in globals() else None, sys.argv, sys.path[0])
print(os.getcwd(), oct(os.umask(0o022)), os.environ.get('XLA_FLAGS'))
print(sys.stdin.read().upper())
atexit.register(lambda: print('exit handlers run', flush=True))
def late():
    time.sleep(0.2)
    print('a thread still running is waited for', flush=True)
threading.Thread(target=late).start()
print('to stderr', file=sys.stderr)
"""

# The tests of the server itself; with it disabled every child starts fresh.
NEEDS_SERVER = pytest.mark.skipif(os.environ.get(forkserver.DISABLE) == "0",
                                  reason=f"{forkserver.DISABLE}=0 starts no server")

ENDINGS = {
    "status": "raise SystemExit(3)",
    "exception": "import json\njson.loads('{')",
    "ctrl-c": "raise KeyboardInterrupt",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "exit-code-text": "import sys\nsys.exit('stopped: reason')",
}


def both(args, **kwargs):
    """The fresh interpreter's and the forked child's ``CompletedProcess``."""
    return [forkserver.run(args, capture_output=True, text=True, timeout=120, fresh=fresh,
                           **kwargs) for fresh in (True, False)]


def test_a_forked_script_sees_and_does_what_a_new_interpreter_does(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, XLA_FLAGS="--xla_dump_to=nowhere")
    old = os.umask(0o027)
    try:
        fresh, forked = both([sys.executable, str(script), "a b", "--flag"], cwd=tmp_path,
                             env=env, input="some input\r\n")
    finally:
        os.umask(old)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.stdout.splitlines() == [
        f"__main__ {script} ['{script}', 'a b', '--flag'] {tmp_path}",
        f"{tmp_path} 0o27 --xla_dump_to=nowhere", "SOME INPUT", "",
        "a thread still running is waited for", "exit handlers run"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_program_ends_with_a_new_interpreters_status(ending):
    fresh, forked = both([sys.executable, "-c", ENDINGS[ending]], cwd=ROOT)
    assert forked.returncode == fresh.returncode
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    assert fresh.returncode == {"status": 3, "exception": 1, "ctrl-c": -signal.SIGINT,
                                "killed": -signal.SIGKILL, "exit-code-text": 1}[ending]


@NEEDS_SERVER
def test_children_are_forked_where_they_can_be_and_started_where_they_cannot():
    """A forked child has no interpreter of its own to start: if the server stopped
    serving, every launcher test would quietly take its old time again."""
    code = [sys.executable, "-c", "pass"]
    assert isinstance(forkserver.Popen(code, cwd=ROOT), forkserver.ForkedProcess), (
        forkserver.refusal(code, ROOT))
    # JAX reads JAX_* at import: a child that sets one needs its own interpreter.
    other = dict(os.environ, JAX_ENABLE_X64="1")
    assert not isinstance(forkserver.Popen(code, cwd=ROOT, env=other),
                          forkserver.ForkedProcess)
    assert not isinstance(forkserver.Popen(code, cwd=ROOT, fresh=True),
                          forkserver.ForkedProcess)


@NEEDS_SERVER
def test_what_the_test_process_gains_in_its_environment_does_not_stop_the_forking():
    """In a fresh test process: a first request with a variable JAX reads at import
    starts fresh (the server keeps the environment this module was imported under); then
    the process gains what its own imports set (JAX's and tensorboardX's) and a patched
    FLOWJAX_* variable, none of which the server's imports read, and its requests are
    forked again; another value of a variable JAX's import sets still starts fresh.
    (Before, the server took the environment of the first request and refused every
    request after any such change: the suite's forking stopped for the rest of a worker,
    depending on xdist's order.)"""
    program = ("import os, sys\n"
               "from tests import forkserver\n"
               "code = [sys.executable, '-c', 'pass']\n"
               "os.environ['JAX_ENABLE_X64'] = '1'\n"
               "first = forkserver.Popen(code)\n"
               "os.environ.pop('JAX_ENABLE_X64')\n"
               "import jax, tensorboardX\n"
               "os.environ['FLOWJAX_SHARED_FS_WAIT_S'] = '1'  # as monkeypatch.setenv\n"
               "after = forkserver.Popen(code)\n"
               "print(*(isinstance(p, forkserver.ForkedProcess) for p in (first, after)))\n"
               "print(first.wait(), after.wait(), forkserver.refusal(code))\n"
               "print(forkserver.refusal(code, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0')))\n"
               # Where a child's environment lacks what JAX's import sets, it has it, as a
               # fresh interpreter has once it imported JAX.
               "env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}\n"
               "show = [sys.executable, '-c', 'import os, jax\\n"
               "print(os.environ.get(\"TF_CPP_MIN_LOG_LEVEL\"))']\n"
               "print(*(forkserver.run(show, env=env, capture_output=True, text=True,\n"
               "                       fresh=fresh).stdout.strip() for fresh in (True, False)),\n"
               "      forkserver.refusal(show, env=env))\n")
    # As a test process starts: without what imports of JAX or tensorboardX set (this
    # one's workers have imported JAX by now), nor a JAX_ENABLE_X64 of the caller's.
    gained = ("TF_CPP_MIN_LOG_LEVEL", "TPU_SKIP_MDS_QUERY", "CRC32C_SW_MODE",
              "JAX_ENABLE_X64")
    env = {k: v for k, v in os.environ.items() if k not in gained}
    done = forkserver.run([sys.executable, "-c", program], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, fresh=True)
    assert done.stdout == ("False True\n0 0 None\n"
                           "its environment differs from the server's in "
                           "['TF_CPP_MIN_LOG_LEVEL']\n1 1 None\n"), done.stderr[-2000:]


def test_xla_reads_the_flags_of_the_childs_environment(tmp_path):
    """XLA parses XLA_FLAGS when JAX starts its first backend, in the child, not at the
    server's imports: a child given a default build's flags (``helpers.default_xla_env``)
    compiles with them, not with the suite's."""
    program = ("import jax, jax.numpy as jnp\n"
               "print(jax.jit(lambda x: x * 3)(jnp.ones(3)).tolist())")
    for fresh in (True, False):
        dumps = tmp_path / f"fresh_{fresh}"
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                         f"--xla_dump_to={dumps}")
        done = forkserver.run([sys.executable, "-c", program], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120, fresh=fresh)
        assert done.stdout == "[3.0, 3.0, 3.0]\n", done.stderr[-2000:]
        assert any(name.endswith(".txt") for name in os.listdir(dumps)), fresh


def test_a_signal_reaches_the_forked_child_and_a_timeout_kills_it():
    loop = [sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(60)"]
    process = forkserver.Popen(loop, cwd=ROOT, stdout=forkserver.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    with pytest.raises(forkserver.subprocess.TimeoutExpired):
        forkserver.run(loop, cwd=ROOT, capture_output=True, timeout=1)


@NEEDS_SERVER
def test_the_server_removes_its_folder_when_the_test_process_is_killed():
    """A test process killed before its exit handlers run (a pytest worker at a
    timeout) leaves no server folder behind: the server removes it when its lifeline
    ends. (Before, only the test process's atexit removed it.)"""
    program = ("import os, signal, sys\n"
               "from tests import forkserver\n"
               "assert forkserver.run([sys.executable, '-c', 'pass']).returncode == 0\n"
               "print(forkserver._server.folder, os.listdir(forkserver._server.folder),\n"
               "      flush=True)\n"
               "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = forkserver.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, fresh=True)
    folder, listing = done.stdout.split(" ", 1)
    assert (done.returncode, listing) == (-signal.SIGKILL,
                                          "['socket', 'socket.environ']\n"), done.stderr
    deadline = time.monotonic() + 30
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder)
