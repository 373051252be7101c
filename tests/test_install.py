"""The launchers and the config files they load work from any working directory.

``launch`` and ``configs`` are installed packages (setup.cfg), so nothing puts the
repository root on ``sys.path``: run from a directory outside the checkout, a launcher
still finds ``launch.cli`` and a config file still finds its sibling configs.
"""

import os
import sys

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_from(folder, script, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return forkserver.run([sys.executable, os.path.join(ROOT, "launch", script), *args],
                          capture_output=True, text=True, cwd=folder, env=env, timeout=300)


def test_a_config_that_imports_its_siblings_loads_outside_the_checkout(tmp_path):
    # fashion_mnist.py imports configs.base and configs.emnist; the unknown field is
    # reported only after the file has been loaded.
    config = os.path.join(ROOT, "configs", "fashion_mnist.py")
    done = run_from(tmp_path, "train.py", f"--config={config}", "--config.no_such_field=1",
                    f"--workdir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: unknown config field 'no_such_field'"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_plot_runs_outside_the_checkout(tmp_path):
    done = run_from(tmp_path, "plot.py", f"--workdir={tmp_path}")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: no runs under --workdir={tmp_path} (no folder holds "
                           "results.json or metrics.jsonl)\n")
