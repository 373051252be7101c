"""``launch/their_undefined_names.py``: the static pass that found the global ``cid`` the
authors' APFL and Ditto trainers read and never define (README, "Baselines as
implemented"), on generated modules."""

import os
import sys

from launch.their_undefined_names import undefined_globals
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE = '''
import os
from collections import OrderedDict as od

def reads_cid(net):
    return str(cid) + os.sep

def reads_main_hyperparameters():
    return lr * epochs, od()

def declares_counter():
    global counter
    counter = 1

def reads_counter():
    return counter

def reads_builtins_and_locals(a):
    b = len(a)
    return [b for _ in range(b)]

class Client:
    def fit(self):
        return self.cid, missing_thing

def outer():
    def inner():
        return also_missing
    return inner

if __name__ == "__main__":
    lr = 0.1
    for epochs in range(3):
        pass
'''


def test_undefined_globals_lists_only_names_nothing_binds():
    """Names bound only under ``__main__``, by a ``global`` statement elsewhere, by an
    import, or builtins count as defined; a method's and a nested function's free names
    are checked as well."""
    assert undefined_globals(MODULE) == {"reads_cid": ["cid"], "fit": ["missing_thing"],
                                         "inner": ["also_missing"]}


def test_launcher_reports_each_module_and_refuses_another_folder(tmp_path):
    trainers = tmp_path / "trainers"
    trainers.mkdir()
    (trainers / "client_a.py").write_text(MODULE)
    (trainers / "client_b.py").write_text("def f(x):\n    return x\n")
    script = os.path.join(ROOT, "launch", "their_undefined_names.py")
    done = forkserver.run([sys.executable, script, f"--reference_dir={tmp_path}",
                           "--no_call"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "trainers/client_a.py: 1 of its 9 functions and methods read 'cid', which nothing "
        "defines: reads_cid",
        "trainers/client_a.py: 1 of its 9 functions and methods read 'missing_thing', which "
        "nothing defines: fit",
        "trainers/client_a.py: 1 of its 9 functions and methods read 'also_missing', which "
        "nothing defines: inner",
        "trainers/client_b.py: every name its 1 functions and methods read is defined",
        "1 of 2 modules read a name nothing defines"]
    done = forkserver.run([sys.executable, script, f"--reference_dir={trainers}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --reference_dir={str(trainers)!r}: expected a checkout of "
        "github.com/Astuary/Flow (no trainers/ folder) (--help lists the options)"]


def test_their_modules_import_from_a_relative_reference_dir(tmp_path, monkeypatch):
    """``--reference_dir=authors-flow`` as the README writes it: the import runs from
    inside their checkout, where the relative path put on ``sys.path`` named another
    folder (``ModuleNotFoundError: No module named 'trainers'``)."""
    from launch import parity
    (tmp_path / "their" / "trainers").mkdir(parents=True)
    (tmp_path / "their" / "trainers" / "client_x.py").write_text(
        "import os\nWHERE = os.getcwd()\n")
    monkeypatch.chdir(tmp_path)
    module = parity.import_their_trainer("their", "trainers.client_x")
    assert os.path.realpath(module.WHERE) == os.path.realpath(tmp_path / "their")
    assert os.path.realpath(os.getcwd()) == os.path.realpath(tmp_path)
