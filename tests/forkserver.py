"""Python children started from an interpreter that has already imported the heavy
libraries, for the tests that run the launchers as a user does.

A launcher's child spends about 2 CPU-seconds importing JAX, Flax, optax, orbax and numpy
before it reads a flag (2-core machine, jax 0.10.2), and the suite starts about 150 of
them. Here one server process per test process imports those libraries once (never this
project's code, whose import state some tests check) and forks a child per request; the
child then runs the script or ``-c`` code as ``__main__`` exactly as ``python`` would:
its own ``sys.argv``, ``sys.path[0]``, working directory, umask and standard streams, and
the interpreter's own exit (exit handlers, waiting for threads, the exit status of an
uncaught exception or a signal).

Only a child whose environment is the server's, but for variables no preloaded library
reads at import, is forked: JAX reads its ``JAX_*`` settings at import, which in the
server happened under the server's environment. Those other variables are
``NOT_READ_AT_IMPORT``, this project's own ``FLOWJAX_*`` (it is never preloaded), and
those the preloaded imports set themselves (JAX sets ``TF_CPP_MIN_LOG_LEVEL`` and
``TPU_SKIP_MDS_QUERY``), which a test process gains when it imports JAX after this
module: a child may carry the value the imports set, and has it from its start, as a
fresh interpreter has once it imported ``PRELOAD`` (where this process had such a
variable at import already, the server cannot tell it from the user's, and a child
without it starts fresh).
Any other request (another environment, another interpreter or program, options not
handled here, or ``FLOWJAX_TEST_FORKSERVER=0``) runs as a plain ``subprocess`` child.

What a forked child shares with its siblings is the server's: string hash seed and the
libraries' import-time state (``numpy``'s global generator is reseeded). A check that two
separate processes give the same bytes should start one of them with ``fresh=True``.
"""

from __future__ import annotations

import atexit
import io
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# Imported by the server before it forks: third-party libraries only. None of them may
# start a thread or a JAX backend at import (the server checks both and refuses to serve).
PRELOAD = ("numpy", "jax", "jax.numpy", "flax", "flax.linen", "optax", "orbax.checkpoint",
           "ml_collections", "ml_collections.config_flags", "absl.app", "absl.flags",
           "absl.logging", "tqdm", "msgpack")
DISABLE = "FLOWJAX_TEST_FORKSERVER"
# Not read when PRELOAD is imported (traced, Python and C reads alike): XLA parses its
# flags when JAX starts its first backend; pytest names the running test in the
# environment its children inherit; the test process gains the last two from libraries
# it imports in-process, which PRELOAD does not load (tensorboardX sets its crc32c mode,
# torch its inductor cache), and reads them there.
NOT_READ_AT_IMPORT = frozenset({"XLA_FLAGS", "PYTEST_CURRENT_TEST", "CRC32C_SW_MODE",
                                "TORCHINDUCTOR_CACHE_DIR"})
_HEADER = struct.Struct("!Q")

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL

# The server's environment: the test process's at import (collection time, after
# conftest.py set it up), not at the first request, which may come from a test that
# patched a variable for itself: the server would then refuse every later, unpatched
# request for the rest of the process.
_ENVIRON_AT_IMPORT = dict(os.environ)


# ----------------------------------------------------------------------------- client


class _Server:
    """This process's server: started at the first request, ended with this process."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="flowjax-forkserver-")
        self.path = os.path.join(self.folder, "socket")
        self.environ = _ENVIRON_AT_IMPORT
        self.set_by_imports: dict[str, str] | None = None
        # stdin is the server's lifeline: it ends when this process closes the pipe.
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        env=self.environ, cwd=os.path.dirname(self.path))
        atexit.register(self.close)

    def ready(self, timeout: float = 120.0) -> bool:
        """Whether the server listens (it has imported ``PRELOAD``); False if it refused,
        did not start in time or has ended."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()  # no second wait for a server that will not serve
                self.process.wait()
                break
            time.sleep(0.02)
        if self.process.poll() is not None:
            return False
        if self.set_by_imports is None:  # written before the socket appeared
            with open(self.path + ".environ") as file:
                self.set_by_imports = json.load(file)
        return True

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)  # the server removed it if it could


_server: _Server | None = None
_server_lock = threading.Lock()


def _running_server() -> _Server | None:
    global _server
    with _server_lock:
        if _server is None:
            _server = _Server()
        return _server if _server.ready() else None


def refusal(args, cwd=None, env=None) -> str | None:
    """Why ``args`` would start a fresh interpreter rather than a forked child; None
    where it is forked: ``python script.py ...`` or ``python -c code ...`` in the
    server's environment (module docstring), once the server serves."""
    env = dict(os.environ if env is None else env)
    if "0" in (os.environ.get(DISABLE), env.get(DISABLE)):
        return f"{DISABLE}=0"
    if len(args) < 2 or args[0] != sys.executable:
        return "not this interpreter with a program"
    program = str(args[1])
    if program == "-c" and len(args) < 3:
        return "-c without code"
    if program != "-c" and (program.startswith("-")
                            or not os.path.isfile(os.path.join(cwd or ".", program))):
        return f"{program}: not a script file or -c"
    # The launchers point JAX at their compilation cache before importing it
    # (launch/xla_env.py), which a forked child cannot do; with the suite's cache set
    # (tests/conftest.py) they leave it alone.
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        return "no JAX_COMPILATION_CACHE_DIR: the launcher would choose its own"
    server = _running_server()
    if server is None:
        return "no fork server is serving"
    differences = environment_differences(env, server)
    return f"its environment differs from the server's in {differences}" if differences else None


def environment_differences(env: dict[str, str], server: _Server) -> list[str]:
    """The variables of ``env`` that would make a fresh interpreter import ``PRELOAD``
    otherwise than the server did (module docstring): where its value is neither the
    server's nor, for a variable the imports set, the value they set."""
    def alike(name):
        if name in NOT_READ_AT_IMPORT or name.startswith("FLOWJAX_"):
            return True
        imported = (server.set_by_imports[name],) if name in server.set_by_imports else ()
        return env.get(name) in (server.environ.get(name), *imported)

    return sorted(name for name in set(env) | set(server.environ) if not alike(name))


class ForkedProcess:
    """A forked child, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None,
                 text: bool = False) -> None:
        self.args = [str(a) for a in args]
        self.returncode: int | None = None
        self._text = text
        self._status = b""
        self.stdin = self.stdout = self.stderr = None
        ends, theirs = {}, []

        def child_end(choice, fd, name, mode):
            if choice is None:
                return fd
            if choice == DEVNULL:
                end = os.open(os.devnull, os.O_RDWR)
            elif choice == PIPE:
                read, write = os.pipe()
                end, ours = (read, write) if mode == "w" else (write, read)
                ends[name] = os.fdopen(ours, mode + "b", buffering=0)
            elif isinstance(choice, int):
                return choice
            else:
                return choice.fileno()
            theirs.append(end)
            return end

        fds = [child_end(stdin, 0, "stdin", "w"), child_end(stdout, 1, "stdout", "r")]
        fds.append(fds[1] if stderr == STDOUT else child_end(stderr, 2, "stderr", "r"))
        request = json.dumps({"argv": self.args[1:], "cwd": os.path.abspath(cwd or os.getcwd()),
                              "env": dict(os.environ if env is None else env),
                              "umask": _umask()}).encode()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(_server.path)
            socket.send_fds(self._socket, [_HEADER.pack(len(request))], fds)
            self._socket.sendall(request)
            self.pid = int(self._read_line())
        finally:
            for fd in theirs:
                os.close(fd)
        for name, stream in ends.items():
            if text:  # as subprocess.Popen's text streams; communicate() reads the fd
                stream = io.TextIOWrapper(io.BufferedReader(stream) if name != "stdin"
                                          else io.BufferedWriter(stream),
                                          encoding=locale.getpreferredencoding(False))
            setattr(self, name, stream)

    def _read_line(self, timeout: float | None = None) -> bytes:
        self._socket.settimeout(timeout)
        while b"\n" not in self._status:
            try:
                chunk = self._socket.recv(64)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the fork server lost child {self.args}")
            self._status += chunk
        line, self._status = self._status.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            kind, number = self._read_line(timeout).split()
            self.returncode = int(number) if kind == b"exit" else -int(number)
            self._socket.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):
        """``subprocess.Popen.communicate``: writes ``input``, reads both pipes to their
        end, waits; text mode decodes and translates newlines as ``subprocess`` does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = {self.stdout: [], self.stderr: []}
        with selectors.DefaultSelector() as selector:
            for stream in (self.stdout, self.stderr):
                if stream is not None:
                    selector.register(stream, selectors.EVENT_READ)
            pending = b""
            if self.stdin is not None:
                pending = input.encode(locale.getpreferredencoding(False)) if (
                    self._text and input is not None) else (input or b"")
                if pending:
                    selector.register(self.stdin, selectors.EVENT_WRITE)
                else:
                    self.stdin.close()
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    if key.fileobj is self.stdin:
                        written = os.write(self.stdin.fileno(), pending[:65536])
                        pending = pending[written:]
                        if not pending:
                            selector.unregister(self.stdin)
                            self.stdin.close()
                        continue
                    data = os.read(key.fileobj.fileno(), 65536)
                    if data:
                        chunks[key.fileobj].append(data)
                    else:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out, err = (self._decoded(b"".join(chunks[s])) if s is not None else None
                    for s in (self.stdout, self.stderr))
        return out, err

    def _decoded(self, data: bytes):
        if not self._text:
            return data
        text = data.decode(locale.getpreferredencoding(False))
        return text.replace("\r\n", "\n").replace("\r", "\n")


def _umask() -> int:
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    raise RuntimeError("no Umask: line in /proc/self/status")


def Popen(args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False,
          fresh: bool = False):
    """``subprocess.Popen`` of ``args``, forked from the server where it can be;
    ``fresh=True`` always starts a new interpreter."""
    if not fresh and refusal(args, cwd, env) is None:
        return ForkedProcess(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                             stderr=stderr, text=text)
    return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                            stderr=stderr, text=text)


def run(args, *, cwd=None, env=None, input=None, capture_output: bool = False,
        text: bool = False, timeout: float | None = None, check: bool = False,
        stdout=None, stderr=None, fresh: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run`` of ``args``, forked from the server where it can be."""
    if capture_output:
        stdout = stderr = PIPE
    process = Popen(args, cwd=cwd, env=env, stdin=PIPE if input is not None else None,
                    stdout=stdout, stderr=stderr, text=text, fresh=fresh)
    try:
        out, err = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    except BaseException:
        process.kill()
        raise
    done = subprocess.CompletedProcess(process.args, process.wait(), out, err)
    if check:
        done.check_returncode()
    return done


# ----------------------------------------------------------------------------- server


def _serve(path: str) -> dict[str, Any] | None:
    """Imports ``PRELOAD``, listens at ``path`` and forks a child per request; returns the
    request in that child and None in the server once its lifeline (stdin) closes."""
    import importlib
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    from jax._src import xla_bridge
    if threading.active_count() != 1 or xla_bridge._backends:
        print(f"forkserver: not serving: {threading.active_count()} Python threads or a "
              "JAX backend after the imports", file=sys.stderr)
        return None
    if set(before) - set(os.environ):  # a child could not have it removed as they did
        print(f"forkserver: not serving: the imports removed {set(before) - set(os.environ)} "
              "from the environment", file=sys.stderr)
        return None
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    with open(path + ".environ.tmp", "w") as file:
        json.dump(set_by_imports, file)
    os.rename(path + ".environ.tmp", path + ".environ")  # before the socket's name
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name
    # The middle processes below report to their own connections; the kernel reaps them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not listener:
                    return None  # stdin closed: the test process is gone
                connection, _ = listener.accept()
                try:
                    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
                    request = _receive(connection, _HEADER.unpack(header)[0])
                except (OSError, RuntimeError, ValueError, struct.error):
                    connection.close()  # a client gone mid-request; serve the next
                    continue
                if os.fork() == 0:
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    listener.close()
                    return _supervise(connection, fds, dict(request,
                                                            set_by_imports=set_by_imports))
                connection.close()
                for fd in fds:
                    os.close(fd)


def _receive(connection: socket.socket, size: int) -> dict[str, Any]:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise RuntimeError("forkserver: a request ended early")
        data += chunk
    return json.loads(data)


def _supervise(connection, fds, request):
    """In the middle process: forks the child, reports its pid and then its exit."""
    pid = os.fork()
    if pid == 0:
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=True)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    connection.sendall((f"signal {-code}\n" if code < 0 else f"exit {code}\n").encode())
    os._exit(0)


def _become(request: dict[str, Any]) -> None:
    """Runs the request's program in this (forked) process as ``python`` runs it."""
    import types
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    # As a fresh import does: only the value from before the imports or the one they set
    # is let through (environment_differences), and an import turns both into the latter.
    os.environ.update(request["set_by_imports"])
    import numpy
    numpy.random.seed()  # a fresh interpreter seeds it from the OS
    argv = request["argv"]
    if argv[0] == "-c":
        source, filename, sys.argv, first = argv[1], "<string>", ["-c", *argv[2:]], ""
    else:
        filename = argv[0]
        with open(filename, "rb") as file:
            source = file.read()
        sys.argv, first = list(argv), os.path.dirname(os.path.realpath(filename))
    sys.path[0] = first
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__builtins__, __spec__=None, __loader__=None)
    if filename != "<string>":
        main.__file__ = filename
    sys.modules["__main__"] = main
    code = compile(source, filename, "exec", dont_inherit=True)
    del request, source
    exec(code, main.__dict__)  # noqa: S102 -- running the program is the point


if __name__ == "__main__":
    _SERVER_PID = os.getpid()  # _serve returns in each forked child too
    try:
        _request = _serve(sys.argv[1])
    finally:
        if os.getpid() == _SERVER_PID:
            # The server removes its folder when it ends, whether or not the test
            # process's atexit ran (a killed pytest worker left one behind per run).
            shutil.rmtree(os.path.dirname(sys.argv[1]), ignore_errors=True)
    if _request is not None:
        _become(_request)
